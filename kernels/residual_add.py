"""The residual add that no projection or norm takes into its launch: a draft layer's output,
stream + mlp_out (the target defers its adds into the next norm, kernels/norm.PendingNorm).

    residual_add(stream, out) = stream + out      # in their dtype, one rounding (as torch's add)

Where a one-layer EAGLE-3 head's down projection runs one row per program, its epilogue makes the
sum (kernels/linear.linear_add). Elsewhere PendingAdd defers it to the norm that reads it next, the
head's final norm, whose launch (add_rms_norm, or a GEMV's norm prologue) stores the sum where the
next draft step reads it.

A torch add there would be a graph node without a programmatic edge between the decode path's
PDL kernels (kernels/pdl.py): the next kernels could not start early, and it would break the rule
that only graphrt's kernels (or the forward's input gather) run between a phase's metadata and the
attention that reads it before its wait (tests/test_capture.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from graphrt.kernels.norm import PendingNorm
from graphrt.kernels.pdl import pdl_enabled, pdl_launch, wait_for_producer

__all__ = ["PendingAdd", "residual_add", "residual_add_reference", "residual_add_triton", "summed"]

_BLOCK = 1024


def residual_add_reference(stream: torch.Tensor, out: torch.Tensor, into: torch.Tensor | None = None) -> torch.Tensor:
    """stream, out: the same shape and float dtype. Returns stream + out, a new tensor (into: written
    there instead, a contiguous tensor of that shape and dtype)."""
    return torch.add(stream, out, out=into) if into is not None else stream + out


@triton.jit
def _residual_add_kernel(
    a_ptr, b_ptr,  # [numel] fp32/fp16/bf16, contiguous
    out_ptr,  # [numel] the same dtype
    numel,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    if USE_PDL:  # a programmatic dependent: nothing before this line touches memory
        wait_for_producer()
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    a = tl.load(a_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, (a + b).to(out_ptr.dtype.element_ty), mask=mask)


def _fits(stream: torch.Tensor, out: torch.Tensor) -> bool:
    return (stream.shape == out.shape and stream.dtype == out.dtype and stream.device == out.device
            and stream.dtype in (torch.float32, torch.float16, torch.bfloat16)
            and stream.is_contiguous() and out.is_contiguous())


def residual_add_triton(stream: torch.Tensor, out: torch.Tensor, into: torch.Tensor | None = None) -> torch.Tensor:
    """stream, out: contiguous, one shape and float dtype (fp32/fp16/bf16) on one device. Returns
    stream + out, a new contiguous tensor: each sum computed in fp32 and rounded once to the dtype
    (torch's add: the same bits). Grid cdiv(numel, 1024); no host sync."""
    if not _fits(stream, out):
        raise ValueError(f"residual_add_triton takes two contiguous tensors of one shape and float dtype on one "
                         f"device; got {tuple(stream.shape)} {stream.dtype} {stream.device} and "
                         f"{tuple(out.shape)} {out.dtype} {out.device}")
    if into is not None and not _fits(stream, into):
        raise ValueError(f"into must be a contiguous {tuple(stream.shape)} {stream.dtype} tensor on {stream.device}")
    y = torch.empty_like(stream) if into is None else into
    n = stream.numel()
    if n:
        pdl = pdl_enabled(stream.device)
        _residual_add_kernel[(triton.cdiv(n, _BLOCK),)](stream, out, y, n, BLOCK=_BLOCK, USE_PDL=pdl, num_warps=4,
                                                      **pdl_launch(pdl))
    return y


def residual_add(stream: torch.Tensor, out: torch.Tensor, into: torch.Tensor | None = None) -> torch.Tensor:
    """stream + out [written into `into`]. CUDA tensors that fit -> Triton, else the reference."""
    if stream.is_cuda and _fits(stream, out) and (into is None or _fits(stream, into)):
        return residual_add_triton(stream, out, into)
    return residual_add_reference(stream, out, into)


class PendingAdd:
    """stream + out [N, H], not yet added. `total` is where the sum lands (into, else a new tensor),
    whichever of the two ways below computes it, once."""

    def __init__(self, stream: torch.Tensor, out: torch.Tensor, into: torch.Tensor | None = None):
        self.stream, self.out = stream, out
        self.total = torch.empty_like(stream) if into is None else into
        self._handed = False  # normed() or materialize() has made (or handed on) the sum

    def materialize(self) -> torch.Tensor:
        """total, the sum added by a launch of its own (residual_add(stream, out, into=total)) unless
        normed() or an earlier call has handed it on."""
        if not self._handed:
            residual_add(self.stream, self.out, self.total)
            self._handed = True
        return self.total

    def normed(self, weight: torch.Tensor, eps: float) -> PendingNorm:
        """rms_norm(stream + out, weight) for the projection that reads it, which stores the sum
        to total (the same bits as residual_add: one fp32 add rounded once)."""
        self._handed = True
        return PendingNorm(self.out, self.stream, weight, eps, stream=self.total)


def summed(state):
    """A draft state as a tensor: a PendingAdd's sum (added here unless a norm already does), anything
    else as it is."""
    return state.materialize() if isinstance(state, PendingAdd) else state
