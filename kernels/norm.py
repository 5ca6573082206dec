"""RMSNorm, alone and fused with the residual add that precedes it in a pre-norm decoder layer.

Semantics (Llama/Qwen reference implementations, which the logits must match in every dtype):

    rms_norm(x, w):            xf = x.float(); xf = xf * rsqrt(mean(xf ** 2, -1) + eps)
                               out = w * xf.to(x.dtype)          # the multiply in torch's promotion
    add_rms_norm(x, res, w):   r = x + res                        # in x's dtype, rounded once
                               return rms_norm(r, w), r

`out` has dtype torch.promote_types(w.dtype, x.dtype) (bf16 for a bf16 model; fp32 if the norm
weight was kept in fp32). The Triton kernel reproduces the rounding chain: fp32 statistics, one
rounding of the normalised row to x's dtype, then the weight product in fp32 rounded once to the
output dtype (what torch does for a bf16 * bf16 multiply). Only the order of the sum of squares
differs from torch's reduction, so GPU results agree to a few ulps of fp32 before rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from graphrt.kernels.pdl import pdl_enabled, pdl_launch, wait_for_producer

__all__ = ["PendingNorm", "rms_norm", "rms_norm_reference", "rms_norm_triton", "add_rms_norm",
           "add_rms_norm_reference", "add_rms_norm_triton"]

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., H] float; weight: [H]. Returns [..., H] in promote_types(weight, x)."""
    # Normalise in fp32 and cast back before the weight, as the reference implementations do, so
    # logits match theirs in every dtype.
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual: [N, H] same dtype; weight: [H]. Returns (rms_norm(x + residual), x + residual)."""
    r = residual + x
    return rms_norm_reference(r, weight, eps), r


@triton.jit
def norm_input(x_ptr, res_ptr, offs, mask, HAS_RESIDUAL: tl.constexpr):
    """A tile of the row a norm reads: x, or x + residual added in fp32 and rounded once to x's
    dtype (what torch does for two bf16/fp16 tensors)."""
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        res = tl.load(res_ptr + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + res.to(tl.float32)).to(x_ptr.dtype.element_ty)
    return x


@triton.jit
def row_rstd(row, H, eps):
    """1 / rms of a whole row (masked lanes zero), fp32. The one place the sum of squares is taken,
    so every kernel that normalises the same row with the same layout gets the same bits."""
    xf = row.to(tl.float32)
    return tl.rsqrt(tl.sum(xf * xf, axis=0) / H + eps)


@triton.jit
def apply_norm(x, rstd, w, out_dtype: tl.constexpr):
    """The rounding chain after the statistic: one rounding of the normalised values to x's dtype
    before the weight, then the weight product in fp32 rounded once to out_dtype."""
    y = (x.to(tl.float32) * rstd).to(x.dtype)
    return (w.to(tl.float32) * y.to(tl.float32)).to(out_dtype)


@triton.jit
def norm_stats(x_ptr, res_ptr, sum_ptr, K, eps, write_sum, NORM_RES: tl.constexpr, BLOCK_H: tl.constexpr):
    """The norm prologue of a one-row GEMV whose x is the input of an RMSNorm (kernels/gemv.py,
    kernels/qkv_rotary.py): the row's 1/rms from one [BLOCK_H] load of it, the norm kernel's load
    and sum. With a residual, the rounded x + residual (the stream the next layer reads) goes to
    sum_ptr from the program with write_sum. Call after the wait for x's producer."""
    offs = tl.arange(0, BLOCK_H)
    mask = offs < K
    row = norm_input(x_ptr, res_ptr, offs, mask, NORM_RES)
    if NORM_RES:
        if write_sum:
            tl.store(sum_ptr + offs, row, mask=mask)
    return row_rstd(row, K, eps)


@triton.jit
def normed_tile(x_ptr, res_ptr, g, k, offs_k, kmask, rstd, NORM_RES: tl.constexpr):
    """Columns k + offs_k of the normalised row with norm weights g: what the norm kernel would
    have stored there, bit for bit, given the same rstd."""
    xt = norm_input(x_ptr + k, res_ptr + k, offs_k, kmask, NORM_RES)
    return apply_norm(xt, rstd, g, x_ptr.dtype.element_ty)


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [N, H], row stride stride_xn, unit column stride
    res_ptr,  # [N, H] residual (read only if HAS_RESIDUAL)
    w_ptr,  # [H]
    out_ptr,  # [N, H] contiguous, promote_types(w, x)
    sum_ptr,  # [N, H] contiguous, x's dtype: x + residual (written only if HAS_RESIDUAL)
    H, eps,
    stride_xn, stride_rn,  # x, residual: row
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_H: tl.constexpr,  # power of two >= H: one program holds its whole row
    USE_PDL: tl.constexpr = False,
):
    if USE_PDL:  # a programmatic dependent: nothing before this line touches memory
        wait_for_producer()
    n = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_H)
    mask = offs < H
    x = norm_input(x_ptr + n * stride_xn, res_ptr + n * stride_rn, offs, mask, HAS_RESIDUAL)
    if HAS_RESIDUAL:
        tl.store(sum_ptr + n * H + offs, x, mask=mask)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    out = apply_norm(x, row_rstd(x, H, eps), w, out_ptr.dtype.element_ty)
    tl.store(out_ptr + n * H + offs, out, mask=mask)


def norm_num_warps(block_h: int) -> int:
    # 4 warps up to 4096 (llama-8b) as the one-row GEMVs with a norm prologue have: the same layout
    # of the row, so the same order of the sum of squares (norm_stats).
    return 1 if block_h <= 256 else 4 if block_h <= 4096 else 8 if block_h <= 8192 else 16


def _check_norm_args(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None) -> None:
    if x.dim() != 2:
        raise ValueError(f"x must be [N, H], got shape {tuple(x.shape)}")
    if x.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"x must be fp32/fp16/bf16, got {x.dtype}")
    if x.shape[1] > 0 and x.stride(1) != 1:
        raise ValueError(f"x must be contiguous along H (stride(1) == 1), got strides {x.stride()}")
    if weight.dim() != 1 or weight.shape[0] != x.shape[1]:
        raise ValueError(f"weight must be [{x.shape[1]}], got shape {tuple(weight.shape)}")
    if weight.dtype not in _FLOAT_DTYPES or weight.stride(0) != 1:
        raise ValueError(f"weight must be a contiguous fp32/fp16/bf16 vector, got {weight.dtype}")
    if weight.device != x.device:
        raise ValueError(f"weight is on {weight.device}, x on {x.device}")
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError(f"residual must match x ({tuple(x.shape)}, {x.dtype}), got {tuple(residual.shape)}, "
                             f"{residual.dtype}")
        if x.shape[1] > 0 and residual.stride(1) != 1:
            raise ValueError(f"residual must be contiguous along H, got strides {residual.stride()}")
        if residual.device != x.device:
            raise ValueError(f"residual is on {residual.device}, x on {x.device}")


def _launch(x, weight, eps, residual, total=None):
    n, h = x.shape
    out = torch.empty((n, h), dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if residual is None:
        total = out
    elif total is None:
        total = torch.empty((n, h), dtype=x.dtype, device=x.device)
    if n == 0 or h == 0:
        return out, total
    block_h = triton.next_power_of_2(h)
    pdl = pdl_enabled(x.device)
    _rms_norm_kernel[(n,)](
        x, residual if residual is not None else x, weight, out, total, h, float(eps),
        x.stride(0), residual.stride(0) if residual is not None else 0, HAS_RESIDUAL=residual is not None,
        BLOCK_H=block_h, USE_PDL=pdl, num_warps=norm_num_warps(block_h), **pdl_launch(pdl),
    )  # fmt: skip
    return out, total


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [N, H] fp32/fp16/bf16 with unit column stride (any row stride); weight: [H]. Returns a new
    contiguous [N, H] tensor in promote_types(weight, x). No host sync."""
    _check_norm_args(x, weight)
    return _launch(x, weight, eps, None)[0]


def add_rms_norm_triton(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, total: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual: [N, H] same dtype, unit column stride; weight: [H]. Returns (rms_norm(x +
    residual), x + residual), new contiguous tensors, in one pass (total: a contiguous [N, H] tensor
    of x's dtype the sum goes to instead). No host sync."""
    _check_norm_args(x, weight, residual)
    if total is not None and (total.shape != x.shape or total.dtype != x.dtype or not total.is_contiguous()
                              or total.device != x.device):
        raise ValueError(f"total must be a contiguous {tuple(x.shape)} {x.dtype} tensor on {x.device}")
    return _launch(x, weight, eps, residual, total)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim. CUDA 2-D input -> Triton, else the reference (any rank)."""
    if x.is_cuda and x.dim() == 2 and x.stride(-1) == 1:
        return rms_norm_triton(x, weight, eps)
    return rms_norm_reference(x, weight, eps)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, total: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual), the sum written into total when given. CUDA 2-D
    inputs -> Triton, else the reference."""
    if x.is_cuda and x.dim() == 2 and x.stride(-1) == 1 and residual.stride(-1) == 1:
        return add_rms_norm_triton(x, residual, weight, eps, total)
    out, r = add_rms_norm_reference(x, residual, weight, eps)
    return out, r if total is None else total.copy_(r)


class PendingNorm:
    """rms_norm(x [+ residual], weight) handed to the projection that reads it, not yet computed.

    At batch 1 a norm launch is a fixed cost of every layer, and a GEMV that runs one row per
    program on the FMA path already streams all of its row: it applies the norm in its prologue
    instead (norm_stats and normed_tile: the norm kernel's bits). Any other consumer calls
    materialize(). Either way `stream` is then x + residual (or x): what the next norm adds to.
    """

    def __init__(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 stream: torch.Tensor | None = None):
        """stream (with a residual): a contiguous tensor like x where x + residual goes (a new one
        when None)."""
        self.x, self.residual, self.weight, self.eps = x, residual, weight, eps
        self.stream = x if residual is None else None
        self._stream_out = stream

    def materialize(self) -> torch.Tensor:
        """The norm's output as its own launch (the reference on CPU)."""
        if self.residual is None:
            return rms_norm(self.x, self.weight, self.eps)
        h, self.stream = add_rms_norm(self.x, self.residual, self.weight, self.eps, self._stream_out)
        return h

    def fusable(self) -> bool:
        """Contiguous rows whose norm output keeps x's dtype (the GEMV's input dtype). Whether the
        GEMV itself runs on Triton, one row per program, is its dispatcher's call."""
        x, r, w = self.x, self.residual, self.weight
        return (
            x.dim() == 2 and x.is_contiguous()
            and w.dtype == x.dtype and w.shape == (x.shape[1],) and w.is_contiguous() and w.device == x.device
            and (r is None or (r.shape == x.shape and r.dtype == x.dtype and r.is_contiguous()))
        )

    def kernel_args(self) -> tuple:
        """(residual, weight, stream out, eps, has residual) for a kernel with the norm prologue;
        allocates the stream it will write. Pointers a kernel does not read are x."""
        if self.residual is None:
            return self.x, self.weight, self.x, float(self.eps), False
        self.stream = torch.empty_like(self.x) if self._stream_out is None else self._stream_out
        return self.residual, self.weight, self.stream, float(self.eps), True
