"""The EAGLE-3 layer's input in one launch: the token's embedding row gathered and normalised, and the
hidden state normalised, side by side, with the layer's residual.

    eagle3_input(tokens, table, hidden, w_embed, w_hidden, eps, normed_residual=True, rows=None)
        = (cat([rms_norm(table[tokens], w_embed), rms_norm(hidden, w_hidden)], -1),
           residual[rows])      # residual: rms_norm(hidden, w_hidden), or hidden; rows: all when None

Unfused, a draft step spends four launches here (the gather, two norms, the concatenation), each a
fixed cost that a small head's step cannot hide, and DRAFT_EXTEND one more to gather its last rows'
residuals (extra programs here, one a row, normalise again what the row's own program did). The
Triton kernel runs one program per row with the norm kernel's layout (kernels/norm.py: BLOCK_H and
warps from the row width), so every normalised row carries the bits rms_norm_triton stores.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from graphrt.kernels.norm import apply_norm, norm_num_warps, rms_norm, rms_norm_reference, row_rstd
from graphrt.kernels.pdl import pdl_enabled, pdl_launch, wait_for_producer

__all__ = ["eagle3_input", "eagle3_input_reference", "eagle3_input_triton", "eagle3_input_unfused"]


def _residual(normed: torch.Tensor, hidden: torch.Tensor, normed_residual: bool, rows) -> torch.Tensor:
    residual = normed if normed_residual else hidden
    return residual if rows is None else residual.index_select(0, rows)


def eagle3_input_reference(tokens: torch.Tensor, table: torch.Tensor, hidden: torch.Tensor, w_embed: torch.Tensor,
                           w_hidden: torch.Tensor, eps: float, normed_residual: bool = True,
                           rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens [N] int; table [V, H]; hidden [N, H]; w_embed, w_hidden [H]; rows [B] int64 row indices
    or None -> ([N, 2H], [B or N, H])."""
    normed = rms_norm_reference(hidden, w_hidden, eps)
    x = torch.cat([rms_norm_reference(F.embedding(tokens, table), w_embed, eps), normed], dim=-1)
    return x, _residual(normed, hidden, normed_residual, rows)


@triton.jit
def _eagle3_input_kernel(
    tok_ptr,  # [N] int32/int64
    table_ptr,  # [V, H] contiguous
    hid_ptr,  # [N, H], row stride stride_hn, unit column stride
    we_ptr, wh_ptr,  # [H] each
    out_ptr,  # [N, 2H] contiguous: the normalised embedding, then the normalised hidden state
    res_ptr,  # [N or B, H] contiguous (RES): the residual of every row, or of rows[b] for b < B
    rows_ptr,  # [B] int64 (RES == 2): the rows whose residual programs N .. N + B - 1 store
    N, H, eps, stride_hn,
    BLOCK_H: tl.constexpr,
    RES: tl.constexpr = 1,  # 0: no residual stored; 1: every row's (normalised); 2: the rows' (extra programs)
    RES_NORMED: tl.constexpr = True,  # RES == 2: the residual is the normalised hidden state, else hidden
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
    dt = out_ptr.dtype.element_ty
    if n < N:
        tok = tl.load(tok_ptr + n).to(tl.int64)
        e = tl.load(table_ptr + tok * H + offs, mask=mask, other=0.0)
        h = tl.load(hid_ptr + n * stride_hn + offs, mask=mask, other=0.0)
        tl.store(out_ptr + n * 2 * H + offs, apply_norm(e, row_rstd(e, H, eps), we, dt), mask=mask)
        y = apply_norm(h, row_rstd(h, H, eps), wh, dt)
        tl.store(out_ptr + n * 2 * H + H + offs, y, mask=mask)
        if RES == 1:
            tl.store(res_ptr + n * H + offs, y, mask=mask)
    else:  # RES == 2: one of the rows whose residual is gathered
        r = tl.load(rows_ptr + (n - N)).to(tl.int64)
        h = tl.load(hid_ptr + r * stride_hn + offs, mask=mask, other=0.0)
        if RES_NORMED:
            h = apply_norm(h, row_rstd(h, H, eps), wh, dt)
        tl.store(res_ptr + (n - N) * H + offs, h, mask=mask)


def _fusable(tokens, table, hidden, w_embed, w_hidden, rows=None) -> bool:
    tensors = (tokens, table, hidden, w_embed, w_hidden) + (() if rows is None else (rows,))
    return (
        all(isinstance(t, torch.Tensor) and t.device == hidden.device for t in tensors)
        and tokens.dim() == 1 and tokens.dtype in (torch.int32, torch.int64)
        and table.dim() == 2 and table.is_contiguous() and hidden.dim() == 2 and hidden.stride(1) == 1
        and hidden.shape == (tokens.shape[0], table.shape[1])
        and table.dtype == hidden.dtype == w_embed.dtype == w_hidden.dtype
        and hidden.dtype in (torch.float32, torch.float16, torch.bfloat16)
        and w_embed.shape == w_hidden.shape == (table.shape[1],) and w_embed.is_contiguous()
        and w_hidden.is_contiguous()
        and (rows is None or (rows.dim() == 1 and rows.dtype == torch.int64 and rows.is_contiguous()))
    )


def eagle3_input_triton(tokens: torch.Tensor, table: torch.Tensor, hidden: torch.Tensor, w_embed: torch.Tensor,
                        w_hidden: torch.Tensor, eps: float, normed_residual: bool = True,
                        rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens [N] int32/int64 (valid ids of table); table [V, H] contiguous; hidden [N, H] unit column
    stride; w_embed, w_hidden [H] contiguous; rows [B] contiguous int64 (valid rows of hidden) or
    None; all one float dtype on one device -> (x [N, 2H], residual [B or N, H]), as
    eagle3_input_reference with rms_norm_triton's bits: new contiguous tensors, but for the
    un-normalised residual of every row, which is hidden itself."""
    if not _fusable(tokens, table, hidden, w_embed, w_hidden, rows):
        raise ValueError(
            "eagle3_input_triton takes tokens [N] int32/int64, a contiguous table [V, H], hidden [N, H] with unit "
            "column stride, norm weights [H] and rows [B] int64 or None, one float dtype on one device; got "
            f"tokens {tuple(tokens.shape)} {tokens.dtype}, table {tuple(table.shape)} {table.dtype}, hidden "
            f"{tuple(hidden.shape)} {hidden.dtype}, rows {None if rows is None else (tuple(rows.shape), rows.dtype)}")
    n, h = hidden.shape
    out = torch.empty((n, 2 * h), dtype=hidden.dtype, device=hidden.device)
    mode = 2 if rows is not None else 1 if normed_residual else 0
    res = torch.empty((n if rows is None else rows.shape[0], h), dtype=hidden.dtype, device=hidden.device) \
        if mode else hidden
    extra = 0 if rows is None else rows.shape[0]
    if n + extra == 0:
        return out, res
    block_h = triton.next_power_of_2(h)
    pdl = pdl_enabled(hidden.device)
    _eagle3_input_kernel[(n + extra,)](
        tokens, table, hidden, w_embed, w_hidden, out, res, rows if rows is not None else tokens, n, h, float(eps),
        hidden.stride(0), BLOCK_H=block_h, RES=mode, RES_NORMED=normed_residual, USE_PDL=pdl,
        num_warps=norm_num_warps(block_h), **pdl_launch(pdl),
    )
    return out, res


def eagle3_input(tokens: torch.Tensor, table: torch.Tensor, hidden: torch.Tensor, w_embed: torch.Tensor,
                 w_hidden: torch.Tensor, eps: float, normed_residual: bool = True,
                 rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """CUDA inputs the kernel takes -> one launch; anything else -> eagle3_input_unfused."""
    if hidden.is_cuda and _fusable(tokens, table, hidden, w_embed, w_hidden, rows):
        return eagle3_input_triton(tokens, table, hidden, w_embed, w_hidden, eps, normed_residual, rows)
    return eagle3_input_unfused(F.embedding(tokens, table), hidden, w_embed, w_hidden, eps, normed_residual, rows)


def eagle3_input_unfused(embeds: torch.Tensor, hidden: torch.Tensor, w_embed: torch.Tensor, w_hidden: torch.Tensor,
                         eps: float, normed_residual: bool = True,
                         rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The same from embeddings already gathered (a vocab-parallel lookup), each norm through
    kernels/norm.rms_norm's dispatch (the reference on CPU)."""
    normed = rms_norm(hidden, w_hidden, eps)
    x = torch.cat([rms_norm(embeds, w_embed, eps), normed], dim=-1)
    return x, _residual(normed, hidden, normed_residual, rows)
