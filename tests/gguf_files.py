"""Small GGUF files for the tests, written the way llama.cpp's converter writes them: its tensor
names, its metadata keys, q/k rows permuted for llama, 1-D norms in F32, matrices in a chosen type."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from graphrt.config import ModelConfig
from graphrt.gguf_checkpoint import gguf_tensor_name

gguf = pytest.importorskip("gguf")

DELETE = object()  # a metadata override that leaves the key out


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute (convert_hf_to_gguf.py), on the rows of a q or k weight/bias."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def metadata(cfg: ModelConfig) -> dict:
    arch = cfg.architecture
    p = arch + "."
    md = {
        p + "block_count": cfg.num_hidden_layers,
        p + "context_length": cfg.max_position_embeddings,
        p + "embedding_length": cfg.hidden_size,
        p + "feed_forward_length": cfg.intermediate_size,
        p + "attention.head_count": cfg.num_attention_heads,
        p + "attention.head_count_kv": cfg.num_key_value_heads,
        p + "rope.freq_base": cfg.rope_theta,
        p + "attention.layer_norm_rms_epsilon": cfg.rms_norm_eps,
        p + "vocab_size": cfg.vocab_size,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
    }
    if arch == "llama":
        md[p + "rope.dimension_count"] = cfg.head_dim
    if cfg.head_dim != cfg.hidden_size // cfg.num_attention_heads:
        md[p + "attention.key_length"] = md[p + "attention.value_length"] = cfg.head_dim
    return md


def quantize(w: np.ndarray, qtype: str):
    """(data, raw_dtype) for GGUFWriter.add_tensor."""
    t = gguf.GGMLQuantizationType[qtype]
    if qtype in ("F32", "F16"):
        return gguf.quants.quantize(w, t), None
    return gguf.quants.quantize(w, t), t


def write_gguf(path, cfg: ModelConfig, weights: dict[str, torch.Tensor], *, qtype: str = "F32",
               arch: str | None = None, meta: dict | None = None, skip: tuple[str, ...] = (),
               extra: dict[str, np.ndarray] | None = None, raw: dict[str, tuple[np.ndarray, str]] | None = None,
               shapes: dict[str, tuple[int, ...]] | None = None) -> Path:
    """Write `weights` (canonical names, PyTorch layout) and `cfg` as a GGUF file.

    meta: metadata overrides (DELETE removes a key); skip: llama.cpp names to leave out; extra:
    llama.cpp name -> F32 array to add; raw: llama.cpp name -> (quantized bytes, type name), written
    as given instead of the weight (already permuted, if it is a llama q/k); shapes: llama.cpp name
    -> a shape to write the tensor with (its data cut or tiled to fit)."""
    path = Path(path)
    arch = arch or cfg.architecture
    md = metadata(cfg)
    md.update(meta or {})
    path.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in md.items():
        if value is DELETE:
            continue
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        else:
            w.add_array(key, value)
    for name, t in weights.items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        gname = gguf_tensor_name(name)
        if gname in skip:
            continue
        if raw and gname in raw:
            data, tname = raw[gname]
            w.add_tensor(gname, data, raw_dtype=gguf.GGMLQuantizationType[tname])
            continue
        a = t.detach().float().numpy()
        if cfg.architecture == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            a = llama_cpp_permute(a, cfg.num_attention_heads)
        elif cfg.architecture == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            a = llama_cpp_permute(a, cfg.num_key_value_heads)
        if shapes and gname in shapes:
            a = np.resize(a, shapes[gname]).astype(np.float32)
        data, rtype = quantize(np.ascontiguousarray(a), qtype if a.ndim == 2 else "F32")
        w.add_tensor(gname, data, raw_dtype=rtype)
    for gname, a in (extra or {}).items():
        w.add_tensor(gname, a.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def random_weights(cfg: ModelConfig, seed: int = 0, std: float = 0.2) -> dict[str, torch.Tensor]:
    """Canonical name -> random fp32 tensor for every tensor `cfg` needs (norms near 1)."""
    from graphrt.checkpoint import expected_shapes

    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in expected_shapes(cfg).items():
        t = torch.randn(shape, generator=g) * std
        out[name] = 1 + t if name.endswith("norm.weight") else t
    if cfg.tie_word_embeddings:
        out["lm_head.weight"] = out["embed_tokens.weight"]
    return out
