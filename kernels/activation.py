"""The gated-MLP activation: silu(gate) * up, reading the fused gate_up GEMM output once.

    silu_and_mul(gu): gate, up = gu[:, :I], gu[:, I:]
                      return F.silu(gate) * up        # in gu's dtype

The Triton kernel reproduces torch's rounding chain for bf16/fp16: silu computed in fp32 and
rounded to the input dtype, then the product computed in fp32 and rounded once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from graphrt.kernels.pdl import pdl_enabled, pdl_launch, wait_for_producer

__all__ = ["silu_and_mul", "silu_and_mul_reference", "silu_and_mul_triton", "silu_mul"]

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def silu_and_mul_reference(gu: torch.Tensor) -> torch.Tensor:
    """gu: [N, 2 * I] float. Returns silu(gu[:, :I]) * gu[:, I:], [N, I] in gu's dtype."""
    inter = gu.shape[-1] // 2
    return F.silu(gu[:, :inter]) * gu[:, inter:]


@triton.jit
def _silu_and_mul_kernel(
    gu_ptr,  # [N, 2 * I], row stride stride_gn, unit column stride
    out_ptr,  # [N, I] contiguous
    inter,  # I
    stride_gn,
    BLOCK_I: tl.constexpr,  # columns per program
    USE_PDL: tl.constexpr = False,
):
    if USE_PDL:  # a programmatic dependent: nothing before this line touches memory
        wait_for_producer()
    n = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    mask = offs < inter
    row = gu_ptr + n * stride_gn
    gate = tl.load(row + offs, mask=mask, other=0.0)
    up = tl.load(row + inter + offs, mask=mask, other=0.0)
    tl.store(out_ptr + n * inter + offs, silu_mul(gate, up).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def silu_mul(gate, up):
    """silu(gate) * up as torch rounds it: gate, up in the storage dtype; returns fp32, to be rounded
    once to that dtype. Shared with the gate_up GEMV's fused epilogue (kernels/gemv.py)."""
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)  # F.silu: fp32 math, one rounding
    return act.to(tl.float32) * up.to(tl.float32)


def silu_and_mul_triton(gu: torch.Tensor) -> torch.Tensor:
    """gu: [N, 2 * I] fp32/fp16/bf16 with unit column stride (any row stride). Returns a new
    contiguous [N, I] tensor in gu's dtype. Grid (N, cdiv(I, BLOCK_I)); no host sync."""
    if gu.dim() != 2:
        raise ValueError(f"gu must be [N, 2 * I], got shape {tuple(gu.shape)}")
    if gu.shape[1] % 2:
        raise ValueError(f"gu's last dim must be even (gate and up halves), got {gu.shape[1]}")
    if gu.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"gu must be fp32/fp16/bf16, got {gu.dtype}")
    if gu.shape[1] > 0 and gu.stride(1) != 1:
        raise ValueError(f"gu must be contiguous along its last dim, got strides {gu.stride()}")
    n, inter = gu.shape[0], gu.shape[1] // 2
    out = torch.empty((n, inter), dtype=gu.dtype, device=gu.device)
    if n == 0 or inter == 0:
        return out
    block_i = min(1024, triton.next_power_of_2(inter))
    grid = (n, triton.cdiv(inter, block_i))
    pdl = pdl_enabled(gu.device)
    _silu_and_mul_kernel[grid](gu, out, inter, gu.stride(0), BLOCK_I=block_i, USE_PDL=pdl,
                               num_warps=4 if block_i >= 512 else 1, **pdl_launch(pdl))
    return out


def silu_and_mul(gu: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of a fused [N, 2 * I] gate_up output. CUDA -> Triton, else the reference."""
    if gu.is_cuda and gu.dim() == 2 and gu.stride(-1) == 1:
        return silu_and_mul_triton(gu)
    return silu_and_mul_reference(gu)
