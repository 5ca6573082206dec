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
_TL_FP8_MAX = tl.constexpr(FP8_MAX)


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
def _e4m3_rounded(v):
    # v (fp32, |v| <= 448) rounded to the nearest e4m3 value, ties to even, still in fp32, so that the
    # conversion after it is exact: Triton's interpreter drops the carry when rounding a conversion
    # up into the next binade (fp32 -124.8 -> e4m3 -64.0, triton 3.9). Normal values keep 3
    # mantissa bits (integer rounding of the fp32 bits, as the interpreter's own TF32 rounding does);
    # below 2^-6 e4m3 steps by 2^-9 (adding 1.5 * 2^23 rounds to a whole number; the product is exact).
    bits = v.to(tl.uint32, bitcast=True)
    bits = (bits + (((bits >> 20) & 1) + 0x7FFFF)) & 0xFFF00000
    normal = bits.to(tl.float32, bitcast=True)
    sub = ((v * 512.0 + 12582912.0) - 12582912.0) * (1.0 / 512.0)
    return tl.where(tl.abs(v) < 0.015625, sub, normal)


@triton.jit
def _x_parts(xt):
    # An activation tile for the FP8 MMA: xt [BLOCK_K, BLOCK_M] -> (hi, lo, scale [BLOCK_M]) with
    # xt ~= scale * (hi + lo / 16), hi and lo e4m3, each column's scale a power of two that puts its
    # largest magnitude in (224, 448]. Two e4m3 terms keep about 8 bits of each x (bf16 keeps 8), so
    # the FP8 weight meets an x that is almost exact and no tensor-core product needs widening.
    # x_parts_reference is the same split in torch.
    xf = xt.to(tl.float32)
    amax = tl.max(tl.abs(xf), axis=0)
    scale = tl.exp2(tl.ceil(tl.log2(tl.where(amax > 0, amax / _TL_FP8_MAX, 1.0))))
    v = xf / scale[None, :]
    hi = _e4m3_rounded(v)
    lo = _e4m3_rounded((v - hi) * 16.0)
    return hi.to(tl.float8e4nv), lo.to(tl.float8e4nv), scale


@triton.jit
def fp8_tile_dot(w, xt):
    """w [BLOCK_N, BLOCK_K] e4m3 @ xt [BLOCK_K, BLOCK_M] (bf16/fp16/fp32) -> [BLOCK_N, BLOCK_M] fp32 on
    the FP8 tensor cores: x split by _x_parts, the two products summed in fp32 and scaled back. Each
    tile's sum leaves the MMA's accumulator at once (its FP8 accumulation is not full fp32)."""
    hi, lo, scale = _x_parts(xt)
    return tl.dot(w, hi, tl.dot(w, lo) * 0.0625) * scale[None, :]


def x_parts_reference(x: torch.Tensor, block_k: int) -> torch.Tensor:
    """What fp8_tile_dot multiplies the weights by: x [M, K] split per block_k columns of each row as
    _x_parts splits it, returned in fp32 (scale * (hi + lo / 16))."""
    m, k = x.shape
    pad = -k % block_k
    xf = torch.nn.functional.pad(x.float(), (0, pad)).view(m, -1, block_k)
    amax = xf.abs().amax(dim=2, keepdim=True)
    scale = torch.exp2(torch.ceil(torch.log2(torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax)))))
    v = xf / scale
    hi = v.to(FP8).float()
    lo = ((v - hi) * 16.0).to(FP8).float()
    return (scale * (hi + lo / 16.0)).view(m, -1)[:, :k]


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
