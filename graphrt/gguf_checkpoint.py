"""Load a GGUF file (llama.cpp's format) into the same Checkpoint an HF folder gives.

Read with the optional `gguf` package. The config comes from the file's metadata, assembled into an
HF-style dict and validated by `ModelConfig.from_hf_dict` as a config.json is; the weights are
dequantized to the asked dtype at load (float32 when none is asked): graphrt has no quantized
kernels. llama.cpp's tensor names map to the canonical ones through _GLOBAL_NAMES and _LAYER_NAMES.

llama.cpp's converter permutes the rows of a llama model's q and k projections (weights and biases)
so that its rotary kernel can rotate adjacent pairs; graphrt rotates half against half, as HF does,
so the permutation is undone here. Qwen2/Qwen3 are converted without it.

gguf's reader parses every metadata field (the whole tokenizer vocabulary) when it opens a file,
where graphrt needs only the scalar fields and the tensor table, so those are kept in
$GRAPHRT_CACHE/gguf-index/<gguf_file_key>/index.json and later loads read the tensors from their
offsets without the reader.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from graphrt.checkpoint import Checkpoint, check_names, expected_shapes
from graphrt.config import ModelConfig
from graphrt.errors import CheckpointError, GraphrtError

SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")
# general.architecture -> the HF architectures[0] that ModelConfig.from_hf_dict reads
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
# architectures whose q/k rows llama.cpp's converter permutes (LlamaModel.permute in convert_hf_to_gguf.py)
_PERMUTED = ("llama",)

_GLOBAL_NAMES = {"token_embd.weight": "embed_tokens.weight", "output_norm.weight": "norm.weight",
                 "output.weight": "lm_head.weight"}
_LAYER_NAMES = {"attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
                "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
                **{f"attn_{a}.{p}": f"self_attn.{b}_proj.{p}" for a, b in zip(("q", "k", "v", "output"), "qkvo")
                   for p in ("weight", "bias")},
                **{f"ffn_{m}.weight": f"mlp.{m}_proj.weight" for m in ("gate", "up", "down")}}
_GGUF_NAMES = {v: k for k, v in _GLOBAL_NAMES.items()}
_GGUF_LAYER_NAMES = {v: k for k, v in _LAYER_NAMES.items()}


def find_gguf(path: str | os.PathLike) -> str | None:
    """The GGUF file `path` stands for: a file (named .gguf or starting with the GGUF magic), or
    the one .gguf in a folder without config.json. None for anything else (an HF folder)."""
    p = os.fspath(path)
    if os.path.isfile(p):
        if p.endswith(".gguf"):
            return p
        with open(p, "rb") as f:
            return p if f.read(4) == b"GGUF" else None
    if os.path.isdir(p) and not os.path.exists(os.path.join(p, "config.json")):
        found = sorted(n for n in os.listdir(p) if n.endswith(".gguf"))
        if len(found) > 1:
            raise CheckpointError(f"{p}: holds {len(found)} .gguf files ({', '.join(found)}); pass the path of one")
        if found:
            return os.path.join(p, found[0])
    return None


def gguf_module():
    try:
        import gguf
    except ImportError:
        raise GraphrtError(
            "reading a .gguf file needs the gguf package: pip install gguf (or pip install 'graphrt[gguf]')"
        ) from None
    return gguf


_HEAD_BYTES = 64 << 20  # a GGUF file's header (metadata, tokenizer included, then the tensor table) comes first


def gguf_file_key(file: str | os.PathLike, *versions: str) -> str:
    """A cache key for what is read from a GGUF file's header: its size, its first 64 MiB (the whole
    header, for any vocabulary in use) and the versions of the packages that read it; not its path,
    so that a copy of the file finds the same entry."""
    h = hashlib.sha256("|".join((str(os.path.getsize(file)), *versions)).encode())
    with open(file, "rb") as f:
        h.update(f.read(_HEAD_BYTES))
    return h.hexdigest()[:32]


def canonical_gguf_name(name: str) -> str | None:
    """llama.cpp tensor name -> canonical name; None when graphrt has no place for it."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
        return f"layers.{int(parts[1])}.{_LAYER_NAMES[parts[2]]}"
    return None


def gguf_tensor_name(canonical: str) -> str:
    """Canonical name -> llama.cpp's (for messages, and for writing test files)."""
    if canonical in _GGUF_NAMES:
        return _GGUF_NAMES[canonical]
    _, i, rest = canonical.split(".", 2)
    return f"blk.{i}.{_GGUF_LAYER_NAMES[rest]}"


def reverse_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation: within each head its converter interleaved the first and
    second halves of the rows (reshape(n_head, 2, d/2).swapaxes(1, 2)); this puts them back."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


@dataclass
class _Tensor:
    name: str  # as stored
    canonical: str
    shape: tuple[int, ...]  # PyTorch order: GGUF lists dims innermost first
    type_name: str
    data: tuple[int, str, tuple[int, ...]]  # its bytes' offset in the file, numpy dtype and shape, as gguf reads them


def _index_of(reader) -> dict:
    """What graphrt reads of a file through gguf's reader: each metadata field's value (a scalar),
    length (an array) or error, and the tensor table."""
    fields = {}
    for key, field in reader.fields.items():
        try:
            value = field.contents()
        except Exception as exc:  # noqa: BLE001 - reported if the field is asked for
            fields[key] = {"error": str(exc)}
            continue
        fields[key] = {"length": len(value)} if isinstance(value, list) else {"value": value}
    tensors = [[t.name, [int(x) for x in t.shape.tolist()], t.tensor_type.name, int(t.data_offset), t.data.dtype.str,
                list(t.data.shape)] for t in reader.tensors]
    return {"byte_order": reader.byte_order, "fields": fields, "tensors": tensors}


@functools.lru_cache(maxsize=4)
def _index(file: str, size: int, mtime_ns: int) -> dict:
    """The file's index, kept in the cache. Remembered in this process for the file's size and
    modification time: a config read followed by a load, or a target and its self-draft from one
    file, read it once."""
    from graphrt.presets import cache_dir, kept_in_cache

    gguf = gguf_module()
    try:
        version = importlib.metadata.version("gguf")
    except importlib.metadata.PackageNotFoundError:  # importable but not installed as a distribution
        version = "?"

    def read(kept: Path) -> dict:
        index = json.loads((kept / "index.json").read_text())
        if not (isinstance(index, dict) and {"byte_order", "fields", "tensors"} <= index.keys()):
            raise ValueError("not an index")
        return index

    def write(index: dict, tmp: Path) -> None:
        tmp.mkdir()
        (tmp / "index.json").write_text(json.dumps(index))

    return kept_in_cache(cache_dir() / "gguf-index" / gguf_file_key(file, version), read,
                         lambda: _index_of(gguf.GGUFReader(file)), write, done="index.json")


class GGUFFile:
    """An opened, header-checked GGUF file: its metadata and tensor table (no tensor data read)."""

    def __init__(self, file: str):
        self.file = file
        try:
            with open(file, "rb") as f:
                magic = f.read(4)
        except OSError as exc:
            raise CheckpointError(f"{file}: cannot read ({exc})") from exc
        if magic != b"GGUF":
            raise CheckpointError(f"{file}: not a GGUF file (starts with {magic!r}, expected b'GGUF')")
        try:
            st = os.stat(file)
            self.index = _index(os.path.abspath(file), st.st_size, st.st_mtime_ns)
        except GraphrtError:
            raise
        except ValueError as exc:
            if "GGMLQuantizationType" in str(exc):
                raise CheckpointError(f"{file}: a tensor has a GGML type this gguf package does not know ({exc}); "
                                      f"graphrt reads {', '.join(SUPPORTED_TYPES)}") from exc
            raise self._unreadable(exc) from exc
        except Exception as exc:  # the reader indexes its memory map without bounds checks
            raise self._unreadable(exc) from exc
        if self.index["byte_order"] != "I":
            raise CheckpointError(f"{file}: a big-endian GGUF file; graphrt reads little-endian ones")
        self._map = None

    def _unreadable(self, exc: Exception) -> CheckpointError:
        size = os.path.getsize(self.file)
        return CheckpointError(f"{self.file}: corrupt or truncated GGUF file ({size} bytes; gguf's reader "
                               f"failed with {type(exc).__name__}: {exc})")

    def get(self, key: str, kind: type | tuple, *, default: Any = ..., positive: bool = False) -> Any:
        """Metadata value `key`, checked to be of `kind` (int excludes bool)."""
        field = self.index["fields"].get(key)
        if field is None:
            if default is ...:
                raise CheckpointError(f"{self.file}: metadata key {key!r} is missing")
            return default
        if "error" in field:
            raise CheckpointError(f"{self.file}: metadata key {key!r} is unreadable ({field['error']})")
        value = field.get("value", f"an array of {field.get('length')}")
        ok = "value" in field and isinstance(value, kind) and not (
            isinstance(value, bool) and kind in (int, float, (int, float)))
        if not ok or (positive and value <= 0):
            raise CheckpointError(f"{self.file}: metadata key {key!r} must be a {'positive ' if positive else ''}"
                                  f"{getattr(kind, '__name__', 'number')}, found {value!r}")
        return value

    def length(self, key: str) -> int | None:
        """The length of array field `key`, None without one."""
        return self.index["fields"].get(key, {}).get("length")

    def tensors(self) -> list[_Tensor]:
        out = []
        for name, dims, type_name, offset, dtype, shape in self.index["tensors"]:
            canonical = canonical_gguf_name(name)
            if canonical is None:
                if name == "rope_freqs.weight":
                    raise CheckpointError(f"{self.file}: tensor 'rope_freqs.weight' (llama3-style RoPE frequency "
                                          "factors) is not supported from GGUF; load the model's HF folder instead")
                raise CheckpointError(f"{self.file}: unexpected tensor {name!r}: graphrt has no place for it")
            out.append(_Tensor(name, canonical, tuple(reversed(dims)), type_name, (offset, dtype, tuple(shape))))
        return out

    def data(self, t: _Tensor) -> np.ndarray:
        """t's stored bytes as gguf's reader gives them (a read-only view of the file)."""
        if self._map is None:
            self._map = np.memmap(self.file, dtype=np.uint8, mode="r")
        offset, dtype, shape = t.data
        dt = np.dtype(dtype)
        return self._map[offset:offset + int(np.prod(shape, dtype=np.int64)) * dt.itemsize].view(dt).reshape(shape)


def _shortest(x: float) -> float:
    """A float32 metadata value as the decimal it was written from (9.99999974e-06 -> 1e-05)."""
    return float(str(np.float32(x)))


def read_config(g: GGUFFile, shapes: dict[str, tuple[int, ...]]) -> ModelConfig:
    """ModelConfig from the metadata, through the same validation as a config.json."""
    arch = g.get("general.architecture", str)
    if arch not in GGUF_ARCHITECTURES:
        raise CheckpointError(f"{g.file}: metadata 'general.architecture' is {arch!r}, which graphrt does not run "
                              f"(supported from GGUF: {', '.join(GGUF_ARCHITECTURES)})")
    p = arch + "."

    def fail(key, msg):
        raise CheckpointError(f"{g.file}: metadata {p + key!r} {msg}")

    if g.get(p + "expert_count", int, default=0):
        fail("expert_count", "> 0: graphrt does not run mixture-of-experts")
    scaling = g.get(p + "rope.scaling.type", str, default="none")
    if scaling != "none":
        fail("rope.scaling.type", f"is {scaling!r}; graphrt runs plain RoPE from GGUF")
    hidden = g.get(p + "embedding_length", int, positive=True)
    heads = g.get(p + "attention.head_count", int, positive=True)
    head_dim = g.get(p + "attention.key_length", int, default=None, positive=True)
    value_dim = g.get(p + "attention.value_length", int, default=None, positive=True)
    if head_dim is not None and value_dim is not None and head_dim != value_dim:
        fail("attention.key_length", f"({head_dim}) != {p + 'attention.value_length'!r} ({value_dim}); graphrt "
             "needs one head size")
    head_dim = head_dim or value_dim
    rotary = g.get(p + "rope.dimension_count", int, default=None, positive=True)
    if rotary is not None and rotary != (head_dim or hidden // heads):
        fail("rope.dimension_count", f"({rotary}) is not the head size ({head_dim or hidden // heads}); graphrt "
             "rotates whole heads")
    vocab = g.get(p + "vocab_size", int, default=None, positive=True)
    if vocab is None:  # older files carry no vocab_size: the tokenizer's list, else the embedding's rows
        vocab = g.length("tokenizer.ggml.tokens") or shapes.get("embed_tokens.weight", (None,))[0]
    eos = [g.get(k, int, default=None) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                                  "tokenizer.ggml.eom_token_id")]
    d = dict(architectures=[GGUF_ARCHITECTURES[arch]], model_type=arch, vocab_size=vocab, hidden_size=hidden,
             intermediate_size=g.get(p + "feed_forward_length", int, positive=True),
             num_hidden_layers=g.get(p + "block_count", int, positive=True), num_attention_heads=heads,
             num_key_value_heads=g.get(p + "attention.head_count_kv", int, default=heads, positive=True),
             head_dim=head_dim, rms_norm_eps=_shortest(g.get(p + "attention.layer_norm_rms_epsilon", (int, float))),
             rope_theta=_shortest(g.get(p + "rope.freq_base", (int, float), default=10000.0)),
             max_position_embeddings=g.get(p + "context_length", int, default=2048, positive=True),
             tie_word_embeddings="lm_head.weight" not in shapes,
             attention_bias="layers.0.self_attn.q_proj.bias" in shapes,
             bos_token_id=g.get("tokenizer.ggml.bos_token_id", int, default=None),
             eos_token_id=list(dict.fromkeys(t for t in eos if t is not None)))
    return ModelConfig.from_hf_dict(d, g.file, weight_shapes=shapes)


def gguf_config(file: str) -> ModelConfig:
    """The ModelConfig of a GGUF file, without reading tensor data."""
    g = GGUFFile(file)
    return read_config(g, {t.canonical: t.shape for t in g.tensors()})


def load_gguf_checkpoint(file: str, *, dtype: torch.dtype | None = None, device: str | torch.device = "cpu"
                         ) -> Checkpoint:
    """Load and strictly validate a GGUF file; every check runs before the first dequantization."""
    g = GGUFFile(file)
    tensors = g.tensors()
    cfg = read_config(g, {t.canonical: t.shape for t in tensors})
    expected = expected_shapes(cfg)
    check_names(expected, {t.canonical: (file, t.name) for t in tensors}, file, gguf_tensor_name, cfg.architecture)
    for t in tensors:
        if t.shape != expected[t.canonical]:
            raise CheckpointError(f"{file}: tensor {t.name!r} has shape {list(t.shape)}, but the metadata says "
                                  f"{list(expected[t.canonical])}")
        if t.type_name not in SUPPORTED_TYPES:
            raise CheckpointError(f"{file}: tensor {t.name!r} is stored as {t.type_name}; graphrt dequantizes "
                                  f"{', '.join(SUPPORTED_TYPES)}")

    dtype = dtype or torch.float32
    weights: dict[str, torch.Tensor] = {}
    for t in tensors:
        w = _dequantize(g, t)
        if cfg.architecture in _PERMUTED and t.canonical.endswith(("q_proj.weight", "q_proj.bias")):
            w = reverse_permute(w, cfg.num_attention_heads)
        elif cfg.architecture in _PERMUTED and t.canonical.endswith(("k_proj.weight", "k_proj.bias")):
            w = reverse_permute(w, cfg.num_key_value_heads)
        weights[t.canonical] = w.to(device=device, dtype=dtype)
    if cfg.tie_word_embeddings:
        weights["lm_head.weight"] = weights["embed_tokens.weight"]
    return Checkpoint(config=cfg, weights=weights, path=file, kind="lm")


def _dequantize(g: GGUFFile, t: _Tensor) -> torch.Tensor:
    gguf = gguf_module()
    try:
        arr = gguf.quants.dequantize(g.data(t), gguf.GGMLQuantizationType[t.type_name]).reshape(t.shape)
    except Exception as exc:
        raise CheckpointError(f"{g.file}: cannot dequantize tensor {t.name!r} ({t.type_name}): {exc}") from exc
    if not arr.flags.writeable:  # F32 comes back as a view of the read-only memory map
        arr = arr.copy()
    return torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32))

