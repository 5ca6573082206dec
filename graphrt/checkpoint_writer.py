"""Write random-weight checkpoints (and self-drafts) in the layouts `graphrt.checkpoint` reads from
published ones (its module doc), so tests and benchmarks go through the real loading path: HF-style
config.json, "model."-prefixed LM names (one file, or shards with an index), the published EAGLE-1/2
layout (LlamaForCausalLM, the EAGLE repo's `bias` key, no layer-0 input norm) and EAGLE-3's
(LlamaForCausalLMEagle3, midlayer.*, d2t int64, t2d bool).

Safetensors files are streamed tensor by tensor (and big tensors chunk by chunk), so writing the
8B-shaped preset keeps memory to a few MB beyond one chunk. Randomness is a torch.Generator seeded
per (seed, tensor name): the same call writes the same bytes whatever the sharding. Tensors above
4M elements are filled from a 4M-value pool of N(0, std) at generator-chosen offsets with random
signs (weights of the big presets are for timing, and true randn would take minutes on a CPU);
smaller tensors are i.i.d. N(0, std). Norm weights are ones, as in HF initialisation.
"""

from __future__ import annotations

import json
import math
import os
import struct
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from graphrt.checkpoint import (
    _index_weights,
    _read_tensor,
    canonical_name,
    expected_shapes,
    load_checkpoint,
    load_config,
    stored_name,
)
from graphrt.config import ModelConfig, default_eagle3_aux_layer_ids
from graphrt.errors import CheckpointError
from graphrt.gguf_checkpoint import find_gguf

_LLAMA3_8K = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192}
_TINY = dict(architecture="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
             max_position_embeddings=4096, tie_word_embeddings=False, bos_token_id=1, eos_token_ids=(2,))
_TINY_QWEN = {**_TINY, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "bos_token_id": None}
# Llama-3.2-1B's and Llama-3.1-8B's shapes (meta-llama's config.json files)
_LLAMA_1B = dict(architecture="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                 num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64, rms_norm_eps=1e-5,
                 rope_theta=500000.0, rope_scaling={**_LLAMA3_8K, "factor": 32.0}, max_position_embeddings=131072,
                 tie_word_embeddings=True, bos_token_id=128000, eos_token_ids=(128001, 128008, 128009))

# name -> ModelConfig fields. "tiny*" run a whole speculative cycle on a CPU in milliseconds; the
# variants differ from "tiny" only where their architecture does.
PRESETS: dict[str, dict] = {
    "tiny": _TINY,
    "tiny-tied": {**_TINY, "rope_theta": 500000.0, "tie_word_embeddings": True, "eos_token_ids": (2, 3),
                  "rope_scaling": {**_LLAMA3_8K, "factor": 32.0, "original_max_position_embeddings": 1024}},
    "tiny-qwen2": {**_TINY_QWEN, "architecture": "qwen2", "tie_word_embeddings": True, "attention_bias": True},
    "tiny-qwen3": {**_TINY_QWEN, "architecture": "qwen3", "head_dim": 32, "qk_norm": True},
    "llama-1b-shape": _LLAMA_1B,
    "llama-8b-shape": {**_LLAMA_1B, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                       "head_dim": 128, "rope_scaling": {**_LLAMA3_8K, "factor": 8.0}, "tie_word_embeddings": False},
    # SmolLM2-135M's shape (the real pair's target, --model smollm2): a small target bound by per-launch
    # latency, not bytes
    "smollm2-135m-shape": {**_LLAMA_1B, "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
                           "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
                           "rope_theta": 100000.0, "rope_scaling": None, "max_position_embeddings": 8192,
                           "bos_token_id": 1, "eos_token_ids": (2,)},
    # Llama-3.1-70B's shape: 141 GB in bf16, for tensor parallelism; `--layers N` keeps N of its 80 layers
    "llama-70b-shape": {**_LLAMA_1B, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
                        "num_attention_heads": 64, "head_dim": 128, "rope_scaling": {**_LLAMA3_8K, "factor": 8.0},
                        "tie_word_embeddings": False},
}

_DTYPE_NAME = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
_ST_NAME = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int64: "I64",
            torch.int32: "I32", torch.bool: "BOOL", torch.uint8: "U8", torch.float64: "F64"}
_POOL_SIZE = 1 << 22
_CHUNK = 1 << 20


def preset_config(name: str, **overrides) -> ModelConfig:
    """The ModelConfig of a preset, with fields overridden."""
    if name not in PRESETS:
        raise KeyError(f"unknown preset {name!r}; presets: {', '.join(PRESETS)}")
    return ModelConfig(**{**PRESETS[name], **overrides})


def _as_config(x, what: str) -> ModelConfig:
    if isinstance(x, ModelConfig):
        return x
    if isinstance(x, str) and x in PRESETS:
        return preset_config(x)
    if isinstance(x, (str, os.PathLike)) and os.path.isdir(x):
        return load_config(x)
    raise CheckpointError(f"{what}: {x!r} is neither a preset ({', '.join(PRESETS)}), a ModelConfig, nor a "
                          "checkpoint folder")


# -- entries and the streaming writers -------------------------------------------------------------


@dataclass
class _Entry:
    name: str  # stored name
    shape: tuple[int, ...]
    dtype: torch.dtype
    chunks: Callable[[], Iterator[torch.Tensor]]  # yields flat contiguous pieces, in order

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _seed_for(seed: int, name: str) -> int:
    return (int(seed) * 1_000_003 + zlib.crc32(name.encode())) % (2**63 - 1)


_pools: dict[tuple[int, torch.dtype, float], torch.Tensor] = {}


def _pool(seed: int, dtype: torch.dtype, std: float) -> torch.Tensor:
    key = (seed, dtype, std)
    if key not in _pools:
        g = torch.Generator().manual_seed(_seed_for(seed, "__pool__"))
        _pools.clear()
        _pools[key] = (torch.randn(_POOL_SIZE + _CHUNK, generator=g) * std).to(dtype)
    return _pools[key]


def _random_chunks(name: str, shape, dtype, seed: int, std: float) -> Callable[[], Iterator[torch.Tensor]]:
    numel = math.prod(shape)

    def gen():
        g = torch.Generator().manual_seed(_seed_for(seed, name))
        if numel <= _POOL_SIZE:
            yield (torch.randn(numel, generator=g) * std).to(dtype)
            return
        pool = _pool(seed, dtype, std)
        offs = torch.randint(0, _POOL_SIZE, ((numel + _CHUNK - 1) // _CHUNK,), generator=g).tolist()
        signs = torch.randint(0, 2, (len(offs),), generator=g).tolist()
        for k, off in enumerate(offs):
            n = min(_CHUNK, numel - k * _CHUNK)
            piece = pool[off : off + n]
            yield -piece if signs[k] else piece

    return gen


def _const_chunks(t: torch.Tensor) -> Callable[[], Iterator[torch.Tensor]]:
    def gen():
        flat = t.reshape(-1)
        for s in range(0, flat.numel(), 16 * _CHUNK):
            yield flat[s : s + 16 * _CHUNK].contiguous()

    return gen


def _write_safetensors(file: str, entries: list[_Entry]) -> None:
    header: dict = {"__metadata__": {"format": "pt"}}
    off = 0
    for e in entries:
        header[e.name] = {"dtype": _ST_NAME[e.dtype], "shape": list(e.shape), "data_offsets": [off, off + e.nbytes]}
        off += e.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(file, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for e in entries:
            written = 0
            for piece in e.chunks():
                piece = piece.to(e.dtype).contiguous().reshape(-1)
                f.write(piece.view(torch.uint8).numpy())
                written += piece.numel() * e.dtype.itemsize
            if written != e.nbytes:
                raise RuntimeError(f"{file}: wrote {written} bytes for {e.name}, expected {e.nbytes}")


def _write_bin(file: str, entries: list[_Entry]) -> None:
    torch.save({e.name: torch.cat([p.to(e.dtype).reshape(-1) for p in e.chunks()]).reshape(e.shape).clone()
                for e in entries}, file)


def _write_files(path: Path, entries: list[_Entry], num_shards: int, file_format: str) -> None:
    if file_format not in ("safetensors", "bin"):
        raise ValueError(f"file_format must be 'safetensors' or 'bin', got {file_format!r}")
    num_shards = max(1, min(int(num_shards), len(entries)))
    st = file_format == "safetensors"
    writer = _write_safetensors if st else _write_bin
    stem, ext = ("model", "safetensors") if st else ("pytorch_model", "bin")
    if num_shards == 1:
        writer(str(path / f"{stem}.{ext}"), entries)
        return
    # contiguous split balanced by bytes; every shard gets at least one tensor
    total = sum(e.nbytes for e in entries)
    shards: list[list[_Entry]] = [[]]
    cur = 0
    for i, e in enumerate(entries):
        shards_left = num_shards - len(shards)
        if shards[-1] and shards_left > 0 and (cur >= total / num_shards or len(entries) - i <= shards_left):
            shards.append([])
            cur = 0
        shards[-1].append(e)
        cur += e.nbytes
    n = len(shards)
    weight_map = {}
    for k, shard in enumerate(shards):
        fname = f"{stem}-{k + 1:05d}-of-{n:05d}.{ext}"
        writer(str(path / fname), shard)
        for e in shard:
            weight_map[e.name] = fname
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / f"{stem}.{ext}.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _write_config(path: Path, cfg: ModelConfig) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg.to_hf_dict(), indent=2) + "\n")


# -- public ----------------------------------------------------------------------------------------


def draft_config(base: ModelConfig, target: ModelConfig, kind: str, *, num_layers: int | None = None,
                 draft_vocab_size: int | None = None, fc_bias: bool = False, torch_dtype: str | None = None
                 ) -> ModelConfig:
    """The config of an EAGLE-1/2 ("eagle") or EAGLE-3 ("eagle3") head with `base`'s layer shapes
    serving `target` (vocab from the target; EAGLE-3 fc width from the target's hidden size), in
    the published layouts: EAGLE-1/2 with embeddings of its own, EAGLE-3 without."""
    common = {name: getattr(base, name) for name in (
        "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
        "rms_norm_eps", "rope_theta", "rope_scaling", "max_position_embeddings")}
    common.update(vocab_size=target.vocab_size, num_hidden_layers=num_layers or 1, tie_word_embeddings=False,
                  torch_dtype=torch_dtype, bos_token_id=target.bos_token_id, eos_token_ids=target.eos_token_ids)
    if kind == "eagle":
        if base.hidden_size != target.hidden_size:
            raise CheckpointError(f"EAGLE-1/2 head hidden_size {base.hidden_size} must equal the target's "
                                  f"{target.hidden_size}")
        return ModelConfig(architecture="eagle", eagle_fc_bias=fc_bias, has_input_layernorm=False, **common)
    if kind == "eagle3":
        V, L = target.vocab_size, target.num_hidden_layers
        # Pin the aux layers only where the published default (2, L//2, L-3) does not fit the target.
        aux = default_eagle3_aux_layer_ids(L)
        return ModelConfig(architecture="eagle3", eagle_aux_layer_ids=None if aux == (2, L // 2, L - 3) else aux,
                           target_hidden_size=target.hidden_size,
                           draft_vocab_size=draft_vocab_size or (32000 if V >= 64000 else max(1, V // 2)),
                           has_embed_tokens=False, **common)
    raise ValueError(f"kind must be 'eagle' or 'eagle3' here, got {kind!r}")


def write_random_checkpoint(path: str | os.PathLike, preset_or_config: str | ModelConfig, *,
                            kind: str = "lm", dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                            num_shards: int = 1, target: str | os.PathLike | ModelConfig | None = None,
                            num_layers: int | None = None, draft_vocab_size: int | None = None,
                            init_std: float = 0.02, file_format: str = "safetensors", fc_bias: bool = False
                            ) -> ModelConfig:
    """Write a random checkpoint folder and return its ModelConfig (as the loader will read it).

    preset_or_config: a PRESETS name or an LM's ModelConfig. For kind="lm" it is the model;
        num_layers overrides its layer count. For kind="eagle"/"eagle3" it gives the head's layer
        shapes (hidden, heads, intermediate, RoPE).
    target: for heads, the target (preset name, ModelConfig or checkpoint folder); default: the
        preset itself. The head takes its vocab (and the EAGLE-3 fc width) from it.
    num_layers: draft layers (default 1 for heads). draft_vocab_size: EAGLE-3 (default 32000 for
        large vocabularies, V//2 for small ones). fc_bias: EAGLE-1/2 fc bias.
    file_format: "safetensors" (default) or "bin" (torch.save of a plain state dict).
    """
    if dtype not in _DTYPE_NAME:
        raise ValueError(f"dtype must be float32, float16 or bfloat16, got {dtype}")
    path = Path(path)
    base = _as_config(preset_or_config, "preset_or_config")
    tname = _DTYPE_NAME[dtype]
    if base.kind != "lm":
        raise ValueError(f"preset_or_config must be an LM's config, got architecture {base.architecture!r}")
    if kind == "lm":
        cfg = base.with_(num_hidden_layers=num_layers or base.num_hidden_layers, torch_dtype=tname)
    else:
        tcfg = _as_config(target, "target") if target is not None else base
        cfg = draft_config(base, tcfg, kind, num_layers=num_layers, draft_vocab_size=draft_vocab_size,
                           fc_bias=fc_bias, torch_dtype=tname)

    entries: list[_Entry] = []
    for name, shape in expected_shapes(cfg).items():
        sname = stored_name(name, cfg.kind)
        if name.endswith("norm.weight"):  # input/post/final/hidden/q/k norms: ones, as HF initialises
            entries.append(_Entry(sname, shape, dtype, _const_chunks(torch.ones(shape, dtype=dtype))))
        else:
            entries.append(_Entry(sname, shape, dtype, _random_chunks(name, shape, dtype, seed, init_std)))
    if cfg.kind == "eagle3":
        d2t, t2d = random_d2t(cfg.vocab_size, cfg.draft_vocab_size, seed)
        entries.append(_Entry("d2t", tuple(d2t.shape), torch.int64, _const_chunks(d2t)))
        entries.append(_Entry("t2d", tuple(t2d.shape), torch.bool, _const_chunks(t2d)))
    _write_config(path, cfg)
    _write_files(path, entries, num_shards, file_format)
    return cfg.with_(source=str(path))


def random_d2t(vocab_size: int, draft_vocab_size: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A valid EAGLE-3 vocabulary map: draft_vocab_size distinct target ids, sorted.

    d2t[i] = target_id[i] - i (so target_id = i + d2t[i]); t2d[target_id] = True for mapped ids.
    """
    g = torch.Generator().manual_seed(_seed_for(seed, "d2t"))
    ids = torch.randperm(vocab_size, generator=g)[:draft_vocab_size].sort().values
    d2t = ids - torch.arange(draft_vocab_size)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[ids] = True
    return d2t, t2d


def self_draft(target_dir: str | os.PathLike, out_dir: str | os.PathLike, num_layers: int, kind: str = "lm", *,
               fc_init: str = "embed") -> ModelConfig:
    """Build a draft from the target's first `num_layers` layers, sharing its embeddings and LM head.
    `target_dir` may be a GGUF file (the draft is then written dequantized, in float32).

    kind="lm": a standalone LM of layers 0..N-1 plus the target's embed_tokens, norm and lm_head
        (tied stays tied), in the target's stored dtype. Its greedy proposals are the truncated
        target's, so acceptance on random weights measures something.
    kind="eagle": an EAGLE-1/2 head (no embed_tokens of its own: it embeds with the target's table
        and, as every EAGLE-1/2 head, projects with the target's lm_head, with no final norm):
        fc_init="embed" (default): fc = [I | 0], so fc([emb; h]) = emb, and the head's layers are the
            target's layers 0..N-1 *with* layers.0.input_layernorm (config has_input_layernorm
            true). The head computes the first N target layers over the emitted tokens; the missing
            final norm does not change the argmax when the target's norm.weight is all ones (random
            presets), so its proposals match the kind="lm" self-draft's up to the first prompt token,
            which an EAGLE head never sees.
        fc_init="hidden": fc = [0 | I], so fc([emb; h]) = h, and layers copied from 0..N-1 with
            o_proj and down_proj zeroed, so the head is the identity on h: it proposes
            argmax lm_head(h_i), the target's own choice at i, i.e. it repeats the token it was just
            fed. Exact, so a test can check the hidden-state plumbing (published layout: no layer-0
            input norm).
    """
    target_dir, out = str(target_dir), Path(out_dir)
    tcfg = load_config(target_dir)
    if tcfg.kind != "lm":
        raise CheckpointError(f"{target_dir}: self_draft needs an LM target, found {tcfg.architecture}")
    if not 1 <= num_layers <= tcfg.num_hidden_layers:
        raise ValueError(f"num_layers must be in [1, {tcfg.num_hidden_layers}], got {num_layers}")
    if find_gguf(target_dir) is not None:
        # GGUF tensors are read whole and dequantized: load (and validate) the target once.
        loaded = load_checkpoint(target_dir).weights
        by_canon, read = loaded, loaded.__getitem__
    else:
        stored = _index_weights(target_dir)
        by_canon = {canonical_name(k, "lm"): v for k, v in stored.items()}
        handles: dict = {}
        read = lambda name: _read_tensor(by_canon[name], handles)  # noqa: E731

    def src(name: str) -> torch.Tensor:
        if name not in by_canon:
            raise CheckpointError(f"{target_dir}: missing tensor {name!r}")
        return read(name)

    dtype_of = src("embed_tokens.weight").dtype
    if kind == "lm":
        cfg = tcfg.with_(num_hidden_layers=num_layers, torch_dtype=_DTYPE_NAME.get(dtype_of, tcfg.torch_dtype))
        entries = []
        for name, shape in expected_shapes(cfg).items():
            t = src(name)
            entries.append(_Entry(stored_name(name, "lm"), shape, t.dtype, _const_chunks(t)))
    elif kind == "eagle":
        if fc_init not in ("embed", "hidden"):
            raise ValueError(f"fc_init must be 'embed' or 'hidden', got {fc_init!r}")
        cfg = draft_config(tcfg, tcfg, "eagle", num_layers=num_layers, torch_dtype=_DTYPE_NAME.get(dtype_of)).with_(
            has_embed_tokens=False, has_input_layernorm=(fc_init == "embed"))
        H = tcfg.hidden_size
        eye, zero = torch.eye(H, dtype=dtype_of), torch.zeros(H, H, dtype=dtype_of)
        fc = torch.cat([eye, zero] if fc_init == "embed" else [zero, eye], dim=1)
        entries = []
        for name, shape in expected_shapes(cfg).items():
            if name == "fc.weight":
                t = fc
            else:
                t = src(name)
                if fc_init == "hidden" and name.endswith(("o_proj.weight", "down_proj.weight", "o_proj.bias")):
                    t = torch.zeros_like(t)
            entries.append(_Entry(stored_name(name, "eagle"), shape, t.dtype, _const_chunks(t)))
    else:
        raise ValueError(f"self_draft kind must be 'lm' or 'eagle', got {kind!r}")
    _write_config(out, cfg)
    _write_files(out, entries, 1, "safetensors")
    return cfg.with_(source=str(out))

