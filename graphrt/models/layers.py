"""Building blocks shared by every architecture: RMSNorm, rotary embeddings, the paged attention
block and the gated MLP. Weights are plain tensors; q/k/v and gate/up are fused at load so each
projection is one GEMM.

On CUDA a decoder layer is nine launches (ten when attention splits the KV): [residual add +]
RMSNorm, qkv GEMM, rotary(q, k) [+ Qwen3 q/k norm] + KV store, paged attention, o_proj GEMM,
residual add + RMSNorm, gate_up GEMM, SiLU * mul, down GEMM. A one-token step (batch 1) saves four:
the rotary + KV store runs in the qkv GEMV's epilogue (kernels/qkv_rotary.py, no q/k norm), SiLU *
mul in the gate_up GEMV's (kernels/linear.linear_silu_mul), and each [residual add +] RMSNorm in the
prologue of the GEMV that reads it (kernels/norm.PendingNorm); each bit for bit what it replaces.
At 3-16 tokens (a verify step at batch 1 to 4) the rotary + KV store and SiLU * mul still run in
the qkv and gate_up launches, and at 17-64 SiLU * mul in gate_up's and the rotary + KV store in
qkv's (up to 32 tokens where the hidden size is 1024 or more); the norms run as their own launches.
On CPU each kernel entry point runs its PyTorch reference; the GEMMs go through
kernels/linear.linear (F.linear off CUDA and at prefill-sized M)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from graphrt.kernels.attention import paged_attention
from graphrt.kernels.linear import linear, linear_add, linear_pushed, linear_silu_mul, one_row_product
from graphrt.kernels.norm import PendingNorm
from graphrt.kernels.qkv_rotary import qkv_rotary_store
from graphrt.kernels.residual_add import PendingAdd, residual_add


@dataclass
class AttentionMetadata:
    """Per-forward attention inputs, all device tensors of fixed shape (safe inside a CUDA graph).

    block_tables: [B, max_blocks] int32   seq_lens: [B] int32 (KV length after this step's stores)
    slot_mapping: [B * query_len] int64   query_len: tokens per request in this forward
    """

    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    slot_mapping: torch.Tensor
    query_len: int
    max_seq_len: int


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not scaling or scaling.get("rope_type", "default") == "default":
        return inv_freq
    if scaling["rope_type"] != "llama3":
        raise ValueError(f"unsupported rope_type {scaling['rope_type']!r}")
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


class Rotary:
    """cos/sin tables for every position up front, so a forward only gathers rows by position."""

    def __init__(self, head_dim: int, theta: float, scaling: dict | None, max_positions: int, device):
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos = emb.cos().to(device)  # [max_positions, head_dim] fp32
        self.sin = emb.sin().to(device)


class AttentionBlock:
    """Self-attention over the paged KV cache of one layer."""

    def __init__(self, weights: dict, prefix: str, cfg, rotary: Rotary, tp=None):
        # under tensor parallelism (graphrt/parallel/) the weights hold this rank's heads only
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        if tp is not None:
            _, self.num_heads, _, self.num_kv_heads = tp.heads(self.num_heads, self.num_kv_heads)
        self.tp = tp
        self.head_dim = cfg.head_dim
        self.eps = cfg.rms_norm_eps
        self.scale = self.head_dim**-0.5
        self.rotary = rotary
        self.qkv_weight = torch.cat([weights[f"{prefix}.{n}_proj.weight"] for n in "qkv"], dim=0)
        self.qkv_bias = (torch.cat([weights[f"{prefix}.{n}_proj.bias"] for n in "qkv"], dim=0)
                         if f"{prefix}.q_proj.bias" in weights else None)
        self.o_weight = weights[f"{prefix}.o_proj.weight"]
        self.q_norm = weights.get(f"{prefix}.q_norm.weight")
        self.k_norm = weights.get(f"{prefix}.k_norm.weight")

    def __call__(self, x, positions, meta: AttentionMetadata, k_cache, v_cache, rows=None):
        """x: [N, H], or the PendingNorm that produces it (the layer's input norm). rows: (indices
        [B] int64, their one-query metadata): every row's k and v are stored, then only those rows
        attend and are projected ([B, H] out)."""
        n = (x.x if isinstance(x, PendingNorm) else x).shape[0]
        q = qkv_rotary_store(  # the GEMV's epilogue where it can take it (module docstring)
            x, self.qkv_weight, self.qkv_bias, positions, self.rotary.cos, self.rotary.sin, k_cache, v_cache,
            meta.slot_mapping, num_q_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
            q_norm=self.q_norm, k_norm=self.k_norm, eps=self.eps,
        )
        q_rows = None
        if rows is not None:  # the attention reads those rows' queries itself
            q_rows, meta = rows
            n = q_rows.shape[0]
        out = paged_attention(
            q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
            query_len=meta.query_len, scale=self.scale, max_seq_len=meta.max_seq_len, q_rows=q_rows,
        )
        return row_parallel(out.reshape(n, self.num_heads * self.head_dim), self.o_weight, self.tp)


def row_parallel(x, w, tp):
    """x @ w^T for a row-parallel w (partial sums on each rank), summed over the ranks: in the GEMV's
    own launch where it can (kernels/linear.linear_pushed), otherwise the product, then an
    all-reduce."""
    if tp is None:
        return linear(x, w)
    y = linear_pushed(x, w, tp.push)
    return y if y is not None else tp.all_reduce(linear(x, w))


class GatedMLP:
    def __init__(self, weights: dict, prefix: str, tp=None):
        self.gate_up = torch.cat([weights[f"{prefix}.gate_proj.weight"], weights[f"{prefix}.up_proj.weight"]], 0)
        self.down = weights[f"{prefix}.down_proj.weight"]
        self.tp = tp

    def __call__(self, x, residual=None, into=None):
        """x: [N, H], or the PendingNorm that produces it. residual: a function giving the stream the
        output is added to (called once gate_up has run: a PendingNorm's stream exists only then);
        the sum is then returned, made in the down GEMV's epilogue where it can
        (kernels/linear.linear_add), else left to the next norm (a kernels/residual_add.PendingAdd;
        into: where the sum goes)."""
        h = linear_silu_mul(x, self.gate_up)
        if residual is None:
            return row_parallel(h, self.down, self.tp)
        stream = residual()
        if self.tp is None and one_row_product(h, self.down):
            return linear_add(h, self.down, stream, into)
        return PendingAdd(stream, row_parallel(h, self.down, self.tp), into)


class DecoderLayer:
    """Pre-norm Llama/Qwen decoder layer. `has_input_norm=False` serves EAGLE-1/2 heads, whose
    first layer takes the fc output without a norm."""

    def __init__(self, weights: dict, prefix: str, cfg, rotary: Rotary, has_input_norm: bool = True, tp=None):
        self.eps = cfg.rms_norm_eps
        self.input_norm = weights[f"{prefix}.input_layernorm.weight"] if has_input_norm else None
        self.post_norm = weights[f"{prefix}.post_attention_layernorm.weight"]
        self.attn = AttentionBlock(weights, f"{prefix}.self_attn", cfg, rotary, tp)
        self.mlp = GatedMLP(weights, f"{prefix}.mlp", tp)

    def __call__(self, x, positions, meta, k_cache, v_cache, rows=None, into=None):
        """x: [N, H] residual stream in; returns the residual stream out (rows: as
        forward_residual's; into: where it goes, a new tensor when None)."""
        out, residual, _ = self.forward_residual(x, None, positions, meta, k_cache, v_cache, rows)
        return residual_add(residual, out, into)

    def forward_residual(self, x, residual, positions, meta, k_cache, v_cache, rows=None):
        """vLLM-style residual carrying, each add deferred into the next norm (a PendingNorm): the
        stream entering this layer is x + residual (x alone when residual is None); returns
        (mlp_out, residual') whose sum is the stream leaving it, and the stream entering it (what an
        EAGLE-3 head's aux states are, without an add launch of their own). rows: as
        AttentionBlock's; mlp_out and residual' are then those rows'."""
        if self.input_norm is not None:
            h = PendingNorm(x, residual, self.input_norm, self.eps)
        else:
            h = x if residual is None else residual + x
        attn_out = self.attn(h, positions, meta, k_cache, v_cache, rows)
        entering = h.stream if isinstance(h, PendingNorm) else h
        h = PendingNorm(attn_out, entering if rows is None else entering.index_select(0, rows[0]), self.post_norm,
                        self.eps)
        out = self.mlp(h)
        return out, h.stream, entering
