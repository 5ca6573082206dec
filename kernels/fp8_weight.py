"""FP8 weights for a draft model: e4m3 values and one power-of-two scale per output row.

A draft step at small batch is a weight read, like a decode step, and an EAGLE-3 head's bytes are
most of what speculation adds to a cycle; one byte per weight instead of two halves that read.
The scale is a power of two, so q * scale is exact in bf16/fp16: `dense`, the weight every path
that cannot read FP8 uses (cuBLAS at prefill-sized M, the CPU), is the same matrix the FP8 kernels
read, and only summation order separates their results. Rows keep their own scale, so a fused
matrix (qkv, gate_up) quantized whole equals its parts quantized apart.

Kernels that read FP8 take `weight_and_scale(w)`: the e4m3 [N, K] matrix and the [N] fp32 scales
they multiply each output row's fp32 sum by.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value


class Fp8Weight(NamedTuple):
    q: torch.Tensor  # [N, K] float8_e4m3fn, contiguous
    scale: torch.Tensor  # [N] fp32, powers of two
    dense: torch.Tensor  # [N, K] q * scale in the model dtype (exact)

    @property
    def shape(self) -> torch.Size:
        return self.q.shape


def quantize_fp8(w: torch.Tensor) -> Fp8Weight:
    """w [N, K] bf16/fp16/fp32 -> Fp8Weight: each row scaled by the power of two that brings its
    largest magnitude to at most FP8_MAX, rounded to nearest e4m3. w itself is not modified."""
    if not isinstance(w, torch.Tensor) or w.dim() != 2 or not w.is_floating_point():
        raise ValueError(f"quantize_fp8 takes a floating [N, K] matrix, got {getattr(w, 'shape', type(w).__name__)}")
    if not torch.isfinite(w).all():
        raise ValueError("quantize_fp8: the matrix holds NaN or inf")
    amax = w.abs().amax(dim=1).float()
    exp = torch.ceil(torch.log2(torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))))
    scale = torch.exp2(exp).contiguous()
    q = (w.float() / scale[:, None]).to(FP8).contiguous()
    return Fp8Weight(q, scale, (q.float() * scale[:, None]).to(w.dtype).contiguous())


def dense(w) -> torch.Tensor:
    """The matrix in the model dtype: w itself, or an Fp8Weight's exact dequantisation."""
    return w.dense if isinstance(w, Fp8Weight) else w


def for_rows(w, m: int):
    """The operand a product of m rows reads: an FP8 matrix at one row (a weight read, which FP8
    halves), its dense matrix otherwise (at 4 rows both GEMV paths ran slower on FP8: RESULTS.md,
    "FP8 draft weights")."""
    return w if m == 1 or not isinstance(w, Fp8Weight) else w.dense


def weight_and_scale(w) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What a kernel reads: (w, None), or an Fp8Weight's (q, scale)."""
    return (w.q, w.scale) if isinstance(w, Fp8Weight) else (w, None)


@triton.jit
def _row_scaled(acc, scale_ptr, rows, HAS_SCALE: tl.constexpr):
    # An FP8 matrix's per-row scales (powers of two: exact) on sums of shape [BLOCK_N] or
    # [BLOCK_N, X], rows: their weight rows.
    if HAS_SCALE:
        s = tl.load(scale_ptr + rows)
        if len(acc.shape) == 2:
            s = s[:, None]
        acc = acc * s
    return acc
