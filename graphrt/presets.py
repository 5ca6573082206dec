"""Embedded default models: random-weight checkpoints written once, in the real on-disk format,
into a cache folder ($GRAPHRT_CACHE, default ~/.cache/graphrt). Nothing is downloaded.

Drafts: a self-draft (the target's first layers with its embeddings and LM head, as a standalone
LM or an EAGLE-1/2 head), or a random EAGLE-3 head in the published layout. Random weights accept
almost nothing; a self-draft makes acceptance figures mean something, `graphrt bench --accept-len`
sets acceptance for cost measurements, and every report names the draft it used.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from pathlib import Path

import torch

from graphrt.checkpoint import load_config
from graphrt.checkpoint_writer import self_draft, write_random_checkpoint

_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def cache_dir() -> Path:
    return Path(os.environ.get("GRAPHRT_CACHE", Path.home() / ".cache" / "graphrt"))


def write_once(path: Path, write, done: str = "config.json") -> Path:
    """path, written by write(tmp) into a temporary sibling and renamed into place unless it holds
    `done` already, so an interrupted write never leaves a folder that looks complete. Each writer
    has a sibling of its own: processes that start on an empty cache at once (test workers, two
    benches) each write one, the first rename wins and the others' copies are dropped."""
    if not (path / done).exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        try:
            write(tmp)
            try:
                tmp.rename(path)
            except OSError:  # another writer's copy is there (a rename never replaces a full folder)
                if not (path / done).exists():
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return path


def kept_in_cache(path: Path, read, make, write, *, done: str):
    """read(path) where an earlier process kept the value, else make() and keep it there with
    write(value, tmp) through write_once. A damaged copy (read raises) is made again and replaced; a
    read-only cache makes it again next time."""
    if path.is_dir():
        try:
            return read(path)
        except Exception:  # noqa: BLE001 - any failure to read a kept copy means the same thing
            shutil.rmtree(path, ignore_errors=True)
    value = make()
    with contextlib.suppress(OSError):
        write_once(path, lambda tmp: write(value, tmp), done=done)
    return value


def ensure_preset(name: str, dtype: torch.dtype = torch.bfloat16, *, seed: int = 0, layers: int | None = None) -> Path:
    """layers: keep only the first N layers (a shape too large for the disk, timed per layer)."""
    cut = f"-{layers}l" if layers else ""
    return write_once(cache_dir() / f"{name}{cut}-{_DTYPES[dtype]}-seed{seed}",
                      lambda tmp: write_random_checkpoint(tmp, name, dtype=dtype, seed=seed, num_layers=layers))


def ensure_self_draft(target: Path, num_layers: int, kind: str = "lm") -> Path:
    if target.is_file():  # a GGUF file, maybe inside an installed package: its draft goes to the cache
        path = cache_dir() / f"{target.stem}-{target.stat().st_size}-selfdraft-{kind}{num_layers}"
    else:
        path = target.with_name(f"{target.name}-selfdraft-{kind}{num_layers}")
    return write_once(path, lambda tmp: self_draft(target, tmp, num_layers, kind=kind))


def ensure_eagle3_head(target: Path, dtype: torch.dtype = torch.bfloat16, *, seed: int = 0) -> Path:
    """A random EAGLE-3 head for `target` in the published layout: one layer over [norm(embedding);
    hidden_norm(fc(low, mid, high))], fc 3H -> H, a 32000-token draft vocabulary (V // 2 for small
    vocabularies) with d2t/t2d, the target's layers (2, L // 2, L - 3) as aux states."""
    return write_once(target.with_name(f"{target.name}-eagle3-seed{seed}"), lambda tmp: write_random_checkpoint(
        tmp, load_config(target), kind="eagle3", target=target, dtype=dtype, seed=seed))


def describe_draft(draft: Path, target: Path) -> str:
    """What a draft folder is, in the words a report needs."""
    d, t = load_config(draft), load_config(target)
    layers = f"{d.num_hidden_layers} layer{'s' * (d.num_hidden_layers > 1)}"
    if d.kind == "eagle3":
        return f"EAGLE-3 head ({layers}, draft vocabulary {d.draft_vocab_size}, aux layers {d.aux_layer_ids_for(t)})"
    if d.kind == "eagle":
        return f"EAGLE-1/2 head ({layers}, the target's LM head)"
    return f"standalone LM draft ({layers})"


def ensure_agreeable_preset(name: str, dtype: torch.dtype, draft_layers: int, alpha: float, *, seed: int = 0) -> Path:
    """The preset with the residual-branch outputs (o_proj, down_proj) of every layer from
    `draft_layers` on scaled by `alpha`.

    Random weights make every layer rewrite the residual stream, so no shallow draft ever agrees
    with the target. Damping the later layers makes the target's argmax mostly that of its first
    `draft_layers` layers, so a self-draft of that depth is accepted often, while the target still
    reads and multiplies every weight it had: costs are those of the real shape, acceptance is
    synthetic. Reports say so wherever this preset is used.
    """
    from safetensors.torch import load_file, save_file

    base = ensure_preset(name, dtype, seed=seed)

    def write(tmp):
        shutil.copytree(base, tmp)
        for file in sorted(tmp.glob("*.safetensors")):
            tensors = load_file(file)
            for key in tensors:
                parts = key.split(".")
                if (len(parts) > 3 and parts[1] == "layers" and int(parts[2]) >= draft_layers
                        and key.endswith(("o_proj.weight", "down_proj.weight"))):
                    tensors[key] = (tensors[key].float() * alpha).to(tensors[key].dtype)
            save_file(tensors, file, metadata={"format": "pt"})

    return write_once(base.with_name(f"{base.name}-damped{draft_layers}x{alpha:g}"), write)


def default_checkpoints(target, draft, dtype: torch.dtype, *, no_draft: bool = False, draft_layers=None,
                        preset: str | None = None, damped: float | None = None, draft_kind: str = "lm",
                        preset_layers: int | None = None):
    """(target, draft, description of the draft) for the CLI: given paths, or an embedded preset
    (llama-1b-shape on CUDA, tiny on the CPU) with a draft of draft_kind: "lm", a self-draft of a
    quarter of its layers; "eagle", an EAGLE-1/2 head of its first layer (the published heads have
    one); "eagle3", a random EAGLE-3 head (ensure_eagle3_head).
    damped: use ensure_agreeable_preset with this factor (the description says so). preset_layers:
    the preset's first N layers only."""
    if target is None:
        preset = preset or ("llama-1b-shape" if torch.cuda.is_available() else "tiny")
        base = ensure_preset(preset, dtype, layers=preset_layers)
        if damped is None:
            target = base
        else:
            n = draft_layers or max(1, load_config(base).num_hidden_layers // 4)
            target = ensure_agreeable_preset(preset, dtype, n, damped)
    if no_draft:
        return target, None, "none"
    if draft is not None:
        return target, draft, f"{describe_draft(Path(draft), Path(target))}: {draft}"
    if draft_kind == "eagle3":
        path = ensure_eagle3_head(Path(target), dtype)
        return target, path, f"random {describe_draft(path, Path(target))}"
    L = load_config(target).num_hidden_layers
    layers = draft_layers or (max(1, L // 4) if draft_kind == "lm" else 1)
    path = ensure_self_draft(Path(target), layers, kind=draft_kind)
    desc = f"self-draft, {describe_draft(path, Path(target))}: the target's first {layers} layer(s)"
    desc += ", shared embeddings and LM head" if draft_kind == "lm" else " over the token embedding (fc = [I | 0])"
    if damped is not None:
        desc += f"; target layers >= {layers} have residual-branch outputs scaled by {damped:g} (synthetic acceptance)"
    return target, path, desc
