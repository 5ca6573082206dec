"""Load a local Hugging Face checkpoint folder into canonical weight names, strictly (GGUF files:
graphrt/gguf_checkpoint.py, dispatched to from `load_checkpoint`).

Layouts read: config.json plus
  * model.safetensors, or sharded *.safetensors with model.safetensors.index.json (`weight_map`),
  * pytorch_model.bin, or sharded .bin with pytorch_model.bin.index.json -- .bin only through
    `torch.load(weights_only=True)` (memory-mapped where the file format allows), so a pickle that
    names a callable is refused. Nothing from the folder is ever imported or executed (`auto_map`
    and remote code are ignored).

Canonical names (what `Checkpoint.weights` holds) are the HF names with the leading "model." removed:

  LM (Llama / Qwen2 / Qwen3), i in [0, num_hidden_layers):
    embed_tokens.weight                          [V, H]
    layers.{i}.input_layernorm.weight            [H]
    layers.{i}.self_attn.q_proj.weight           [n_heads * head_dim, H]     (+ .bias if attention_bias)
    layers.{i}.self_attn.k_proj.weight           [n_kv * head_dim, H]        (+ .bias if attention_bias)
    layers.{i}.self_attn.v_proj.weight           [n_kv * head_dim, H]        (+ .bias if attention_bias)
    layers.{i}.self_attn.o_proj.weight           [H, n_heads * head_dim]     (+ .bias if o_proj_bias)
    layers.{i}.self_attn.q_norm.weight           [head_dim]                  (Qwen3 only)
    layers.{i}.self_attn.k_norm.weight           [head_dim]                  (Qwen3 only)
    layers.{i}.post_attention_layernorm.weight   [H]
    layers.{i}.mlp.gate_proj.weight / up_proj    [I, H]
    layers.{i}.mlp.down_proj.weight              [H, I]
    norm.weight                                  [H]
    lm_head.weight                               [V, H]  (tied: the *same tensor object* as embed_tokens)

  EAGLE-1/2 head (published layout: no "model." prefix, yuhuili/EAGLE-*):
    fc.weight [H, 2H], fc.bias [H] (only if the checkpoint has it; config `bias` in the EAGLE repo)
    layers.{i}.* as above, except layers.0.input_layernorm.weight is usually absent
    embed_tokens.weight [V, H] (optional; when absent the target's table is used)
    No norm.weight, no lm_head: the head's output goes to the *target's* lm_head as is.
    fc input order is [token embedding ; target hidden state]: fc(cat(embed(t_{i+1}), h_i)).

  EAGLE-3 head (stored as midlayer.* -> canonical layers.0.*):
    fc.weight                         [H, 3 * H_target]   input cat(low, mid, high) target states
    layers.0.input_layernorm.weight   [H]   normalises the token embedding
    layers.0.hidden_norm.weight       [H]   normalises fc's output (or the recycled draft state)
    layers.0.self_attn.{q,k,v}_proj.weight  [out, 2H]     input cat(norm(emb), hidden_norm(h))
    layers.0.self_attn.o_proj.weight, post_attention_layernorm, mlp.*: as in a Llama layer
    norm.weight [H]; lm_head.weight [draft_vocab, H]
    d2t int64 [draft_vocab]: target_id = draft_id + d2t[draft_id]  (synthesised as zeros when the
        file has none and draft_vocab == V)
    t2d bool [V] (optional): t2d[target_id] is True where a draft id maps to it
    embed_tokens.weight [V, H] (optional; when absent the target's table is used)

Every problem is a CheckpointError naming the file (for shards: the shard) and the key or field,
with expected vs found shape where it applies.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from graphrt.config import ModelConfig, read_config_json
from graphrt.errors import CheckpointError, ConfigMismatchError

SAFETENSORS_INDEX = "model.safetensors.index.json"
BIN_INDEX = "pytorch_model.bin.index.json"

# Stored tensors that carry no parameters (buffers some exporters saved); dropped silently.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")

_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)
_INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


@dataclass
class Checkpoint:
    """A loaded checkpoint: canonical name -> tensor, and the config."""

    config: ModelConfig
    weights: dict[str, torch.Tensor]
    path: str
    kind: str  # "lm" | "eagle" | "eagle3"
    parallel: tuple[int, int] | None = None  # (rank, world size) when the weights are a tensor-parallel slice


@dataclass
class _Stored:
    """One tensor as stored: its file, shape and dtype, and how to read it."""

    name: str
    file: str
    shape: tuple[int, ...]
    dtype: torch.dtype | None  # None: a safetensors dtype torch has no name for
    dtype_name: str
    tensor: torch.Tensor | None = None  # .bin: already (memory-mapped) loaded


# -- reading the folder ----------------------------------------------------------------------------


def _read_safetensors_header(file: str) -> dict[str, _Stored]:
    """Parse a safetensors header and check it against the file size (catches truncation)."""
    try:
        size = os.path.getsize(file)
        with open(file, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{file}: truncated safetensors file ({size} bytes, no header length)")
            (n,) = struct.unpack("<Q", head)
            if n > min(size - 8, 100 * 2**20):
                raise CheckpointError(f"{file}: corrupt or truncated safetensors file (header length {n} > "
                                      f"file size {size})")
            raw = f.read(n)
    except OSError as exc:
        raise CheckpointError(f"{file}: cannot read ({exc})") from exc
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{file}: corrupt safetensors header ({exc})") from exc
    if not isinstance(header, dict):
        raise CheckpointError(f"{file}: corrupt safetensors header (not an object)")
    data_len = size - 8 - n
    out: dict[str, _Stored] = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype_name = meta["dtype"]
            shape = tuple(int(x) for x in meta["shape"])
            start, end = (int(x) for x in meta["data_offsets"])
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{file}: corrupt safetensors header entry for tensor {name!r}") from exc
        dtype = _ST_DTYPES.get(dtype_name)
        if end > data_len or start > end:
            raise CheckpointError(f"{file}: truncated or corrupt safetensors file: tensor {name!r} needs bytes "
                                  f"[{start}, {end}) of the data section, which holds {data_len}")
        if dtype is not None and (end - start) != math.prod(shape) * dtype.itemsize:
            raise CheckpointError(f"{file}: corrupt safetensors header: tensor {name!r} of shape {list(shape)} "
                                  f"{dtype_name} spans {end - start} bytes")
        out[name] = _Stored(name, file, shape, dtype, dtype_name)
    return out


def _torch_load(file: str) -> dict[str, torch.Tensor]:
    """torch.load with weights_only=True (mmap when the format allows); nothing else is unpickled."""
    try:
        try:
            obj = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as exc:
            # Legacy (pre-zipfile) .bin files cannot be memory-mapped; read them whole.
            if "mmap" not in str(exc).lower() and "zip" not in str(exc).lower():
                raise
            obj = torch.load(file, map_location="cpu", weights_only=True)
    except CheckpointError:
        raise
    except pickle.UnpicklingError as exc:
        # torch's message suggests weights_only=False; graphrt never does that. Keep the line that
        # names what the pickle asked for (e.g. "Unsupported global: GLOBAL os.system").
        lines = [ln.strip() for ln in str(exc).splitlines() if "nsupported" in ln or "WeightsUnpickler" in ln]
        what = (lines[0] if lines else "a pickled object that is not a tensor").split(". Please")[0]
        raise CheckpointError(f"{file}: refused: the pickle holds more than tensors ({what}); graphrt reads .bin "
                              "files only with torch.load(weights_only=True) and never runs code from a "
                              "checkpoint. Convert it to safetensors in an environment you trust.") from exc
    except Exception as exc:  # EOFError / RuntimeError for truncated or corrupt files, ...
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise CheckpointError(f"{file}: unreadable .bin (torch.load(weights_only=True) failed: "
                              f"{type(exc).__name__}: {first})") from exc
    if not isinstance(obj, Mapping):
        raise CheckpointError(f"{file}: expected a state dict (name -> tensor), found {type(obj).__name__}")
    for k, v in obj.items():
        if not isinstance(k, str) or not isinstance(v, torch.Tensor):
            raise CheckpointError(f"{file}: entry {k!r} is a {type(v).__name__}, not a tensor")
    return dict(obj)


def _read_index(index_file: str) -> dict[str, str]:
    try:
        with open(index_file, encoding="utf-8") as f:
            idx = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{index_file}: not valid JSON ({exc})") from exc
    wm = idx.get("weight_map") if isinstance(idx, dict) else None
    if not isinstance(wm, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in wm.items()):
        raise CheckpointError(f"{index_file}: field 'weight_map' must map tensor names to file names")
    for shard in set(wm.values()):
        if os.path.isabs(shard) or os.path.normpath(shard).startswith(".."):
            raise CheckpointError(f"{index_file}: field 'weight_map' names a file outside the folder: {shard!r}")
    return wm


def _index_weights(path: str) -> dict[str, _Stored]:
    """Every stored tensor of the folder: name -> _Stored (headers only for safetensors)."""
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: not a checkpoint folder (expected a directory with config.json)")
    names = sorted(os.listdir(path))
    st_index = os.path.join(path, SAFETENSORS_INDEX)
    bin_index = os.path.join(path, BIN_INDEX)
    if os.path.exists(st_index) or os.path.exists(bin_index):
        index_file = st_index if os.path.exists(st_index) else bin_index
        wm = _read_index(index_file)
        out: dict[str, _Stored] = {}
        for shard in sorted(set(wm.values())):
            shard_file = os.path.join(path, shard)
            if not os.path.exists(shard_file):
                raise CheckpointError(f"{index_file}: field 'weight_map' names {shard!r}, which does not exist")
            stored = _read_file(shard_file)
            for name in stored:
                if wm.get(name) != shard and not name.endswith(IGNORED_SUFFIXES):
                    raise CheckpointError(f"{shard_file}: holds tensor {name!r}, which "
                                          f"{os.path.basename(index_file)} maps to {wm.get(name)!r}")
            out.update(stored)
        for name, shard in wm.items():
            if name not in out:
                raise CheckpointError(f"{os.path.join(path, shard)}: tensor {name!r} listed in "
                                      f"{os.path.basename(index_file)} is not in the file")
        return out
    files = [n for n in names if n.endswith(".safetensors")]
    if not files:
        files = [n for n in names if n.startswith("pytorch_model") and n.endswith(".bin")]
    if not files:
        raise CheckpointError(f"{path}: no weights found (expected model.safetensors, sharded *.safetensors "
                              f"with {SAFETENSORS_INDEX}, or pytorch_model.bin)")
    out = {}
    for n in files:
        for name, s in _read_file(os.path.join(path, n)).items():
            if name in out:
                raise CheckpointError(f"{s.file}: tensor {name!r} is also stored in {out[name].file}")
            out[name] = s
    return out


def _read_file(file: str) -> dict[str, _Stored]:
    if file.endswith(".safetensors"):
        return _read_safetensors_header(file)
    return {k: _Stored(k, file, tuple(v.shape), v.dtype, str(v.dtype).replace("torch.", ""), tensor=v)
            for k, v in _torch_load(file).items()}


def scan_weight_shapes(path: str | os.PathLike) -> dict[str, tuple[int, ...]]:
    """{stored name: shape} of a checkpoint folder, without reading tensor data from safetensors."""
    return {k: v.shape for k, v in _index_weights(str(path)).items()}


def load_config(path: str | os.PathLike) -> ModelConfig:
    """The ModelConfig of a checkpoint folder (config.json, generation_config.json's eos ids, and the
    weight files' names and shapes, which tell EAGLE heads apart; no tensor data is read) or of a GGUF
    file's metadata."""
    from graphrt.gguf_checkpoint import find_gguf, gguf_config  # lazy: it imports this module

    gguf_file = find_gguf(path)
    if gguf_file is not None:
        return gguf_config(gguf_file)
    return ModelConfig.from_hf_dict(read_config_json(path), path, weight_shapes=scan_weight_shapes(path))


# -- canonical names and the expected table --------------------------------------------------------


def canonical_name(stored: str, kind: str) -> str:
    """Stored name -> canonical name: strip "model."; EAGLE-3 "midlayer." -> "layers.0."."""
    name = stored[len("model.") :] if stored.startswith("model.") else stored
    if kind == "eagle3" and name.startswith("midlayer."):
        name = "layers.0." + name[len("midlayer.") :]
    return name


def stored_name(canonical: str, kind: str) -> str:
    """Canonical name -> the name published checkpoints store it under (inverse of canonical_name)."""
    if kind == "lm":
        return canonical if canonical == "lm_head.weight" else "model." + canonical
    if kind == "eagle3" and canonical.startswith("layers.0."):
        return "midlayer." + canonical[len("layers.0.") :]
    return canonical


def _layer_shapes(cfg: ModelConfig, i: int, in_features: int, *, input_norm: bool) -> dict[str, tuple]:
    H, q, kv, inter = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    shapes = {"self_attn.q_proj.weight": (q, in_features), "self_attn.k_proj.weight": (kv, in_features),
              "self_attn.v_proj.weight": (kv, in_features), "self_attn.o_proj.weight": (H, q),
              "post_attention_layernorm.weight": (H,), "mlp.gate_proj.weight": (inter, H),
              "mlp.up_proj.weight": (inter, H), "mlp.down_proj.weight": (H, inter)}
    if input_norm:
        shapes["input_layernorm.weight"] = (H,)
    if cfg.attention_bias:
        shapes.update({"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,)})
    if cfg.o_proj_bias:
        shapes["self_attn.o_proj.bias"] = (H,)
    if cfg.qk_norm:
        shapes.update({"self_attn.q_norm.weight": (cfg.head_dim,), "self_attn.k_norm.weight": (cfg.head_dim,)})
    return {f"layers.{i}.{k}": v for k, v in shapes.items()}


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Canonical name -> shape of every tensor a checkpoint of this config must hold.

    For EAGLE heads the optional parts (fc.bias, layer-0 input norm, embed_tokens) follow the
    config's flags, which `load_checkpoint` derived from the weights; d2t/t2d are handled apart.
    """
    H, V = cfg.hidden_size, cfg.vocab_size
    out: dict[str, tuple[int, ...]] = {}
    kind = cfg.kind
    if kind == "lm":
        out["embed_tokens.weight"] = (V, H)
        for i in range(cfg.num_hidden_layers):
            out.update(_layer_shapes(cfg, i, H, input_norm=True))
        out["norm.weight"] = (H,)
        if not cfg.tie_word_embeddings:
            out["lm_head.weight"] = (V, H)
    elif kind == "eagle":
        out["fc.weight"] = (H, 2 * H)
        if cfg.eagle_fc_bias:
            out["fc.bias"] = (H,)
        for i in range(cfg.num_hidden_layers):
            out.update(_layer_shapes(cfg, i, H, input_norm=(i > 0 or cfg.has_input_layernorm)))
        if cfg.has_embed_tokens:
            out["embed_tokens.weight"] = (V, H)
    else:
        out["fc.weight"] = (H, 3 * cfg.target_hidden_size)
        out.update(_layer_shapes(cfg, 0, 2 * H, input_norm=True))
        out["layers.0.hidden_norm.weight"] = (H,)
        for i in range(1, cfg.num_hidden_layers):
            out.update(_layer_shapes(cfg, i, H, input_norm=True))
        out["norm.weight"] = (H,)
        if not (cfg.tie_word_embeddings and cfg.has_embed_tokens):
            out["lm_head.weight"] = (cfg.draft_vocab_size, H)
        if cfg.has_embed_tokens:
            out["embed_tokens.weight"] = (V, H)
    return out


# -- load -------------------------------------------------------------------------------------------


def load_checkpoint(path: str | os.PathLike, *, dtype: torch.dtype | None = None,
                    device: str | torch.device = "cpu", shard=None) -> Checkpoint:
    """Load and strictly validate a local HF checkpoint folder, or a GGUF file (a `.gguf` path, or a
    folder holding one .gguf and no config.json: graphrt/gguf_checkpoint.py).

    dtype: cast floating weights to it; None keeps each tensor's stored dtype (d2t stays int64,
        t2d bool, whatever dtype is asked; GGUF tensors are dequantized to float32).
    shard: a tensor-parallel rank's rule (graphrt/parallel/shard.target_shard_rule): canonical
        name -> (dim, start, end) or None; a safetensors file then yields only those bytes. Shapes
        are checked whole, before slicing.
    """
    from graphrt.gguf_checkpoint import find_gguf, load_gguf_checkpoint  # lazy: it imports this module

    path = str(path)
    if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
        raise CheckpointError(f"{path}: dtype must be a floating torch.dtype, got {dtype!r}")
    gguf_file = find_gguf(path)
    if gguf_file is not None:
        ckpt = load_gguf_checkpoint(gguf_file, dtype=dtype, device=device)
        if shard is not None:  # GGUF tensors are dequantized whole anyway
            from graphrt.parallel.shard import shard_tensor

            ckpt.weights = {n: shard_tensor(t, shard(n)) for n, t in ckpt.weights.items()}
            if ckpt.config.tie_word_embeddings:
                ckpt.weights["lm_head.weight"] = ckpt.weights["embed_tokens.weight"]
            ckpt.parallel = shard.parallel
        return ckpt
    d = read_config_json(path)
    stored = _index_weights(path)
    cfg = ModelConfig.from_hf_dict(d, path, weight_shapes={k: v.shape for k, v in stored.items()})
    kind = cfg.kind

    # stored -> canonical, refusing two stored names that land on one canonical name
    by_canon: dict[str, _Stored] = {}
    for name, s in stored.items():
        if name.endswith(IGNORED_SUFFIXES):
            continue
        c = canonical_name(name, kind)
        if c in by_canon:
            raise CheckpointError(f"{s.file}: tensors {by_canon[c].name!r} and {name!r} both map to canonical "
                                  f"name {c!r}")
        by_canon[c] = s

    expected = expected_shapes(cfg)
    # Harmless extras: a tied LM that also stores lm_head.weight (it is replaced by embed_tokens).
    if kind == "lm" and cfg.tie_word_embeddings and "lm_head.weight" in by_canon:
        s = by_canon.pop("lm_head.weight")
        _check_shape(s, "lm_head.weight", (cfg.vocab_size, cfg.hidden_size))
    special = {"d2t", "t2d"} if kind == "eagle3" else set()

    check_names(expected, {c: (s.file, s.name) for c, s in by_canon.items()}, _missing_where(path, stored),
                lambda name: stored_name(name, kind), cfg.architecture, special)
    for name, shape in expected.items():
        s = by_canon[name]
        _check_shape(s, name, shape)
        _check_float(s, name)

    if kind == "eagle3":
        Vd, V = cfg.draft_vocab_size, cfg.vocab_size
        if "d2t" not in by_canon and Vd != V:
            raise CheckpointError(f"{_missing_where(path, stored)}: missing tensor 'd2t' (draft_vocab_size {Vd} "
                                  f"!= vocab_size {V}, so the draft->target id map is needed)")
        for name, n, dtypes, want in (("d2t", Vd, _INT_DTYPES, "an integer dtype (int64)"),
                                      ("t2d", V, (torch.bool, *_INT_DTYPES), "bool")):
            if name in by_canon:
                s = by_canon[name]
                _check_shape(s, name, (n,))
                if s.dtype not in dtypes:
                    raise CheckpointError(f"{s.file}: tensor {name!r} has dtype {s.dtype_name}, expected {want}")

    # read, cast, place
    weights: dict[str, torch.Tensor] = {}
    handles: dict[str, Any] = {}
    fixed = {"d2t": torch.int64, "t2d": torch.bool}
    try:
        for name, s in by_canon.items():
            t = _read_tensor(s, handles, None if shard is None else shard(name))
            weights[name] = t.to(device=device, dtype=fixed.get(name, dtype if dtype is not None else t.dtype))
    finally:
        handles.clear()

    if cfg.tie_word_embeddings and (kind == "lm" or (kind == "eagle3" and cfg.has_embed_tokens
                                                     and "lm_head.weight" not in weights)):
        weights["lm_head.weight"] = weights["embed_tokens.weight"]
    if kind == "eagle3":
        if "d2t" in weights:
            _check_d2t_range(weights["d2t"], cfg.vocab_size, by_canon["d2t"].file)
        else:  # the identity map
            weights["d2t"] = torch.zeros(cfg.draft_vocab_size, dtype=torch.int64, device=device)
    return Checkpoint(config=cfg, weights=weights, path=path, kind=kind, parallel=getattr(shard, "parallel", None))


def check_names(expected: dict[str, tuple], found: dict[str, tuple[str, str]], missing_where: str, spell,
                architecture: str, allowed=()) -> None:
    """Every expected canonical name is found, and nothing else but `allowed`. found: canonical name
    -> (file, stored name); spell(canonical name): the stored name of a missing one."""
    for name, shape in expected.items():
        if name not in found:
            raise CheckpointError(f"{missing_where}: missing tensor {spell(name)!r} (canonical {name!r}; expected "
                                  f"shape {list(shape)} for this {architecture} config)")
    for name, (file, stored) in found.items():
        if name not in expected and name not in allowed:
            raise CheckpointError(f"{file}: unexpected tensor {stored!r} (canonical {name!r}) for this "
                                  f"{architecture} config")


def _read_tensor(s: _Stored, handles: dict[str, Any], part: tuple[int, int, int] | None = None) -> torch.Tensor:
    """The stored tensor, or only part = (dim, start, end) of it."""
    if s.tensor is not None:
        return s.tensor if part is None else s.tensor.narrow(part[0], part[1], part[2] - part[1]).contiguous()
    from safetensors import SafetensorError, safe_open

    try:
        h = handles.get(s.file)
        if h is None:
            h = handles[s.file] = safe_open(s.file, framework="pt", device="cpu")
        if part is None:
            return h.get_tensor(s.name)
        dim, start, end = part
        return h.get_slice(s.name)[(slice(None),) * dim + (slice(start, end),)]
    except (SafetensorError, OSError, RuntimeError) as exc:
        raise CheckpointError(f"{s.file}: cannot read tensor {s.name!r} ({exc})") from exc


def _check_shape(s: _Stored, name: str, shape: tuple[int, ...]) -> None:
    if tuple(s.shape) != tuple(shape):
        spelled = f"{s.name!r}" if s.name == name else f"{s.name!r} (canonical {name!r})"
        raise CheckpointError(f"{s.file}: tensor {spelled} has shape {list(s.shape)}, expected {list(shape)}")


def _check_float(s: _Stored, name: str) -> None:
    if s.dtype is None or not s.dtype.is_floating_point:
        raise CheckpointError(f"{s.file}: tensor {s.name!r} has dtype {s.dtype_name}, expected a floating dtype "
                              "(float32, float16 or bfloat16)")
    if s.dtype in _FP8:
        raise CheckpointError(f"{s.file}: tensor {s.name!r} is stored as {s.dtype_name}; quantized checkpoints "
                              "are not supported")


def _check_d2t_range(d2t: torch.Tensor, vocab: int, file: str) -> None:
    tgt = torch.arange(d2t.numel(), device=d2t.device) + d2t  # target_id = draft_id + d2t[draft_id]
    if d2t.numel() and (int(tgt.min()) < 0 or int(tgt.max()) >= vocab):
        bad = int(((tgt < 0) | (tgt >= vocab)).nonzero()[0, 0])
        raise CheckpointError(f"{file}: tensor 'd2t' maps draft id {bad} to target id {int(tgt[bad])}, outside "
                              f"[0, {vocab})")


def _missing_where(path: str, stored: dict[str, _Stored]) -> str:
    for idx in (SAFETENSORS_INDEX, BIN_INDEX):
        if os.path.exists(os.path.join(path, idx)):
            return os.path.join(path, idx)
    files = sorted({s.file for s in stored.values()})
    return files[0] if len(files) == 1 else path


# -- target/draft compatibility --------------------------------------------------------------------


def check_draft_compatible(target: ModelConfig | Checkpoint, draft: ModelConfig | Checkpoint) -> None:
    """Raise ConfigMismatchError (naming the field and both values) if `draft` cannot serve `target`.

    Standalone LM draft: same vocab_size. EAGLE-1/2: hidden_size equal to the target's (fc reads the
    target's hidden state and its output goes to the target's lm_head); if it carries embeddings,
    same vocab. EAGLE-3: 3 * target hidden == fc in_features (target_hidden_size), the same vocab
    (so d2t, checked at load against it, maps into the target's), aux layer ids inside the target,
    hidden_size == target's when the head has no embeddings of its own.
    """
    tcfg = target.config if isinstance(target, Checkpoint) else target
    dcfg = draft.config if isinstance(draft, Checkpoint) else draft
    kind = dcfg.kind
    src, tsrc = dcfg.source or "draft", tcfg.source or "target"

    def check(ok: bool, fld: str, dv, tv, why: str) -> None:
        if not ok:
            raise ConfigMismatchError(f"draft {src} does not fit target {tsrc}: field {fld!r}: draft {dv} vs "
                                      f"target {tv} ({why})")

    if tcfg.kind != "lm":
        raise ConfigMismatchError(f"target {tsrc}: field 'architectures' says {tcfg.architecture}, not an LM")
    dv, tv = dcfg.vocab_size, tcfg.vocab_size
    if kind == "lm":
        check(dv == tv, "vocab_size", dv, tv, "a draft LM must share the vocabulary")
        return
    if kind == "eagle":
        check(dcfg.hidden_size == tcfg.hidden_size, "hidden_size", dcfg.hidden_size, tcfg.hidden_size,
              "an EAGLE-1/2 head reads the target's hidden state and feeds the target's lm_head")
        check(not dcfg.has_embed_tokens or dv == tv, "vocab_size", dv, tv,
              "the head's embed_tokens must index the target vocabulary")
        return
    check(dcfg.target_hidden_size == tcfg.hidden_size, "target_hidden_size", dcfg.target_hidden_size,
          tcfg.hidden_size, f"fc.weight in_features {3 * dcfg.target_hidden_size} must be 3 x target hidden_size")
    check(dcfg.has_embed_tokens or dcfg.hidden_size == tcfg.hidden_size, "hidden_size", dcfg.hidden_size,
          tcfg.hidden_size, "the head has no embed_tokens.weight, so it embeds with the target's table")
    check(dv == tv, "vocab_size", dv, tv, "an EAGLE-3 head's vocab_size is the target vocabulary (t2d, embeddings)")
    dcfg.aux_layer_ids_for(tcfg)
