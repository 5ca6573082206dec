"""The EAGLE-3 layer's input in one launch: the token's embedding row gathered and normalised, and the
hidden state normalised, side by side.

    eagle3_input(tokens, table, hidden, w_embed, w_hidden, eps)
        = (cat([rms_norm(table[tokens], w_embed), rms_norm(hidden, w_hidden)], -1),
           rms_norm(hidden, w_hidden))

Unfused, a draft step spends four launches here (the gather, two norms, the concatenation), each a
fixed cost that a small head's step cannot hide. The Triton kernel runs one program per row with the
norm kernel's layout (kernels/norm.py: BLOCK_H and warps from the row width), so both halves carry
the bits rms_norm_triton stores.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from graphrt.kernels.norm import apply_norm, norm_num_warps, rms_norm, rms_norm_reference, row_rstd
from graphrt.kernels.pdl import pdl_enabled, pdl_launch, wait_for_producer

__all__ = ["eagle3_input", "eagle3_input_reference", "eagle3_input_triton", "eagle3_input_unfused"]


def eagle3_input_reference(tokens: torch.Tensor, table: torch.Tensor, hidden: torch.Tensor, w_embed: torch.Tensor,
                           w_hidden: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens [N] int; table [V, H]; hidden [N, H]; w_embed, w_hidden [H] -> ([N, 2H], [N, H])."""
    normed = rms_norm_reference(hidden, w_hidden, eps)
    return torch.cat([rms_norm_reference(F.embedding(tokens, table), w_embed, eps), normed], dim=-1), normed


@triton.jit
def _eagle3_input_kernel(
    tok_ptr,  # [N] int32/int64
    table_ptr,  # [V, H] contiguous
    hid_ptr,  # [N, H], row stride stride_hn, unit column stride
    we_ptr, wh_ptr,  # [H] each
    out_ptr,  # [N, 2H] contiguous: the normalised embedding, then the normalised hidden state
    normed_ptr,  # [N, H] contiguous: the normalised hidden state again
    H, eps, stride_hn,
    BLOCK_H: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    n = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_H)
    mask = offs < H
    # the norm weights are no producer's output: read them before the wait
    we = tl.load(we_ptr + offs, mask=mask, other=0.0)
    wh = tl.load(wh_ptr + offs, mask=mask, other=0.0)
    if USE_PDL:
        wait_for_producer()
    tok = tl.load(tok_ptr + n).to(tl.int64)
    e = tl.load(table_ptr + tok * H + offs, mask=mask, other=0.0)
    h = tl.load(hid_ptr + n * stride_hn + offs, mask=mask, other=0.0)
    dt = out_ptr.dtype.element_ty
    tl.store(out_ptr + n * 2 * H + offs, apply_norm(e, row_rstd(e, H, eps), we, dt), mask=mask)
    y = apply_norm(h, row_rstd(h, H, eps), wh, dt)
    tl.store(out_ptr + n * 2 * H + H + offs, y, mask=mask)
    tl.store(normed_ptr + n * H + offs, y, mask=mask)


def _fusable(tokens, table, hidden, w_embed, w_hidden) -> bool:
    tensors = (tokens, table, hidden, w_embed, w_hidden)
    return (
        all(isinstance(t, torch.Tensor) and t.device == hidden.device for t in tensors)
        and tokens.dim() == 1 and tokens.dtype in (torch.int32, torch.int64)
        and table.dim() == 2 and table.is_contiguous() and hidden.dim() == 2 and hidden.stride(1) == 1
        and hidden.shape == (tokens.shape[0], table.shape[1])
        and table.dtype == hidden.dtype == w_embed.dtype == w_hidden.dtype
        and hidden.dtype in (torch.float32, torch.float16, torch.bfloat16)
        and w_embed.shape == w_hidden.shape == (table.shape[1],) and w_embed.is_contiguous()
        and w_hidden.is_contiguous()
    )


def eagle3_input_triton(tokens: torch.Tensor, table: torch.Tensor, hidden: torch.Tensor, w_embed: torch.Tensor,
                        w_hidden: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens [N] int32/int64 (valid ids of table); table [V, H] contiguous; hidden [N, H] unit column
    stride; w_embed, w_hidden [H] contiguous; all one float dtype on one device -> (x [N, 2H], normed
    hidden [N, H]), new contiguous tensors, as eagle3_input_reference with rms_norm_triton's bits."""
    if not _fusable(tokens, table, hidden, w_embed, w_hidden):
        raise ValueError(
            "eagle3_input_triton takes tokens [N] int32/int64, a contiguous table [V, H], hidden [N, H] with unit "
            "column stride and norm weights [H], one float dtype on one device; got tokens "
            f"{tuple(tokens.shape)} {tokens.dtype}, table {tuple(table.shape)} {table.dtype}, hidden "
            f"{tuple(hidden.shape)} {hidden.dtype}")
    n, h = hidden.shape
    out = torch.empty((n, 2 * h), dtype=hidden.dtype, device=hidden.device)
    normed = torch.empty((n, h), dtype=hidden.dtype, device=hidden.device)
    if n == 0:
        return out, normed
    block_h = triton.next_power_of_2(h)
    pdl = pdl_enabled(hidden.device)
    _eagle3_input_kernel[(n,)](
        tokens, table, hidden, w_embed, w_hidden, out, normed, h, float(eps), hidden.stride(0),
        BLOCK_H=block_h, USE_PDL=pdl, num_warps=norm_num_warps(block_h), **pdl_launch(pdl),
    )
    return out, normed


def eagle3_input(tokens: torch.Tensor, table: torch.Tensor, hidden: torch.Tensor, w_embed: torch.Tensor,
                 w_hidden: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """CUDA inputs the kernel takes -> one launch; anything else -> eagle3_input_unfused."""
    if hidden.is_cuda and _fusable(tokens, table, hidden, w_embed, w_hidden):
        return eagle3_input_triton(tokens, table, hidden, w_embed, w_hidden, eps)
    return eagle3_input_unfused(F.embedding(tokens, table), hidden, w_embed, w_hidden, eps)


def eagle3_input_unfused(embeds: torch.Tensor, hidden: torch.Tensor, w_embed: torch.Tensor, w_hidden: torch.Tensor,
                         eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The same from embeddings already gathered (a vocab-parallel lookup), each norm through
    kernels/norm.rms_norm's dispatch (the reference on CPU)."""
    normed = rms_norm(hidden, w_hidden, eps)
    return torch.cat([rms_norm(embeds, w_embed, eps), normed], dim=-1), normed
