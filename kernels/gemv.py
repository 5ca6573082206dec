"""Skinny GEMM for decode: y[M, N] = x[M, K] @ w[N, K]^T (+ bias[N]) with M = a few rows.

At decode time a projection's cost is the read of its weights, and cuBLAS's tiles, made for large
M, read them at a fraction of DRAM bandwidth. Three deterministic paths in one kernel:
  - FMA (M <= 4): each program streams [BLOCK_N, BLOCK_K] weight tiles, one tl.load per tile (Triton
    does not pipeline plain loads, so the tile size is the unrolling), and keeps per-lane fp32
    partials per row of x, reduced once at the end, or (REDUCE_EACH) every step: fewer registers,
    more programs resident, more bytes in flight.
  - DOT (M <= 64): y^T = w x^T on tensor cores, x padded to BLOCK_M >= 16 columns, the weight tile
    on the product's M side; Triton pipelines the loads that feed a dot (num_stages). Past 64 rows
    (up to gemv_config.TILED_MAX_M, unsplit) the rows come in tiles of 64 over the grid's third
    dimension (TILE_M), each program one weight tile against one row tile.
  - FMA per row (PER_ROW, 2 <= M <= ROWS_MAX_M, small weights only): each program is the M = 1
    program of one row, the rows of a weight tile adjacent in the grid so that all but the first
    find it in L2. A verify step's rows keep the one-row path's fusions and, row for row, its bits;
    on large matrices the extra L2 traffic costs more than the launches saved.
Where the tiles are too few to fill the SMs, K is split: each split writes fp32 partials and the
last program of a tile to arrive (a per-tile counter) sums them in split order, in the same launch,
or a second kernel does where the counter buffer is unavailable. The sum's order never depends on
which program finishes first.

`linear_reference` (F.linear) is the oracle; `gemv_triton` the kernel with every launch knob
exposed (scripts/gemv_sweep.py); kernels/linear.py the dispatchers (gemv_config.select_config
says where it beats cuBLAS).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from graphrt.kernels import gemv_config
from graphrt.kernels.activation import silu_mul
from graphrt.kernels.argmax import Proposal, _validate_proposal, argmax_keys, fold_argmax, fold_finish
from graphrt.kernels.counters import COUNTER_SLOTS, counters, last_to_finish
from graphrt.kernels.fp8_weight import FP8, _row_scaled, weight_and_scale
from graphrt.kernels.gemv_config import ROWS_MAX_M, _path_default, _split_for, row_fma_config, select_config
from graphrt.kernels.norm import PendingNorm, norm_stats, normed_tile
from graphrt.kernels.pdl import pdl_enabled, pdl_launch, wait_for_producer
from graphrt.kernels.push_reduce import PushTarget, no_push_args, push_reduce_row, push_reduce_tile

__all__ = ["linear_reference", "gemv_triton", "select_config", "row_fma_config", "ROWS_MAX_M"]

_SUPPORTED = (torch.bfloat16, torch.float16, torch.float32)  # fp32: interpreter tests only
_FAST_DTYPES = (torch.bfloat16, torch.float16)
_FMA_MAX_M = 4  # one fp32 partial tile per row lives in registers


# ---------------------------------------------------------------------------------------------
# PyTorch reference
# ---------------------------------------------------------------------------------------------


def linear_reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K], w [N, K], bias [N] or None -> [M, N] in x's dtype (F.linear)."""
    return F.linear(x, w, bias)


# ---------------------------------------------------------------------------------------------
# Triton
# ---------------------------------------------------------------------------------------------


# Each helper assigns in both branches of a constexpr `if` and returns once: the Triton frontend
# rejects a second `return` after a taken constexpr branch that returned.
@triton.jit
def _fma_zeros(BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, REDUCE_EACH: tl.constexpr):
    if REDUCE_EACH:
        z = tl.zeros([BLOCK_N], tl.float32)
    else:
        z = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    return z


@triton.jit
def _fma_step(acc, w, x_row_ptr, offs_k, kmask, MASK_K: tl.constexpr, REDUCE_EACH: tl.constexpr):
    if MASK_K:
        xv = tl.load(x_row_ptr + offs_k, mask=kmask, other=0.0)
    else:
        xv = tl.load(x_row_ptr + offs_k)
    return _fma_acc(acc, w, xv, REDUCE_EACH)


@triton.jit
def _fma_acc(acc, w, xv, REDUCE_EACH: tl.constexpr):
    if REDUCE_EACH:
        # Reduce along K every step: a few shuffles per step, but the accumulator is one register
        # per row instead of one per loaded element, which leaves room for more loads in flight.
        acc = acc + tl.sum(w * xv.to(tl.float32)[None, :], axis=1)
    else:
        acc = acc + w * xv.to(tl.float32)[None, :]
    return acc


@triton.jit
def _fma_rows(a0, a1, a2, a3, w, x_ptr, k, stride_xm, offs_k, kmask, MASK_K: tl.constexpr,
              REDUCE_EACH: tl.constexpr, BLOCK_M: tl.constexpr):
    # One weight tile against each of the (up to four) rows of x.
    a0 = _fma_step(a0, w, x_ptr + k, offs_k, kmask, MASK_K, REDUCE_EACH)
    if BLOCK_M > 1:
        a1 = _fma_step(a1, w, x_ptr + stride_xm + k, offs_k, kmask, MASK_K, REDUCE_EACH)
    if BLOCK_M > 2:
        a2 = _fma_step(a2, w, x_ptr + 2 * stride_xm + k, offs_k, kmask, MASK_K, REDUCE_EACH)
    if BLOCK_M > 3:
        a3 = _fma_step(a3, w, x_ptr + 3 * stride_xm + k, offs_k, kmask, MASK_K, REDUCE_EACH)
    return a0, a1, a2, a3


@triton.jit
def _fma_normed(a0, c0, w, u, x_ptr, res_ptr, g_ptr, k, offs_k, kmask, rstd, REDUCE_EACH: tl.constexpr,
                GATED: tl.constexpr, NORM_RES: tl.constexpr, g=None):
    # One weight tile (and a second one, u, when GATED) against the normalised x tile at column k;
    # g: the norm weights of the tile when already loaded (before the PDL wait).
    if g is None:
        g = tl.load(g_ptr + k + offs_k, mask=kmask, other=0.0)
    xv = normed_tile(x_ptr, res_ptr, g, k, offs_k, kmask, rstd, NORM_RES)
    a0 = _fma_acc(a0, w, xv, REDUCE_EACH)
    if GATED:
        c0 = _fma_acc(c0, u, xv, REDUCE_EACH)
    return a0, c0


@triton.jit
def _fma_tile(a0, a1, a2, a3, c0, w, u, x_ptr, res_ptr, g_ptr, k, K, stride_xm, offs_k, kmask, rstd, g,
              MASK_K: tl.constexpr, REDUCE_EACH: tl.constexpr, BLOCK_M: tl.constexpr, GATED: tl.constexpr,
              NORM: tl.constexpr, NORM_RES: tl.constexpr):
    # One weight tile w at column k (and its up tile u when GATED) against every row of x, or,
    # with NORM, against the normalised row (g: the tile's norm weights when already loaded).
    if NORM:
        if not MASK_K:
            kmask = (k + offs_k) < K
        a0, c0 = _fma_normed(a0, c0, w, u, x_ptr, res_ptr, g_ptr, k, offs_k, kmask, rstd, REDUCE_EACH, GATED,
                             NORM_RES, g)
    else:
        a0, a1, a2, a3 = _fma_rows(a0, a1, a2, a3, w, x_ptr, k, stride_xm, offs_k, kmask, MASK_K, REDUCE_EACH,
                                   BLOCK_M)
        if GATED:
            c0 = _fma_step(c0, u, x_ptr + k, offs_k, kmask, MASK_K, REDUCE_EACH)
    return a0, a1, a2, a3, c0


@triton.jit
def _fma_k_loop(w_ptrs, u_ptrs, x_ptr, res_ptr, sum_ptr, g_ptr, eps, k0, k_full, k_end, K, stride_xm, offs_k, tile,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr, REDUCE_EACH: tl.constexpr,
                GATED: tl.constexpr, NORM: tl.constexpr, NORM_RES: tl.constexpr, BLOCK_H: tl.constexpr,
                USE_PDL: tl.constexpr):
    """The FMA path's K loop (first tile peeled ahead of the PDL wait, whole tiles, masked tail),
    shared by every kernel that must sum as the M = 1 GEMV does.

    w_ptrs, u_ptrs: [BLOCK_N, BLOCK_K] pointers at column 0 of the weight rows (u_ptrs read only
    when GATED); x_ptr: row 0 of x, BLOCK_M <= 4 rows stride_xm apart, or with NORM the one row
    whose RMSNorm res_ptr, g_ptr, sum_ptr and eps describe (kernels/norm.norm_stats; the programs
    of weight tile 0 store sum_ptr). Sums columns [k0, k_end) of K; k_full: where the whole tiles
    end. Returns the fp32 accumulators (a0, a1, a2, a3, c0), one per row of x and c0 for u, each
    to pass through _fma_final. Executes the PDL wait when USE_PDL."""
    a0 = _fma_zeros(BLOCK_N, BLOCK_K, REDUCE_EACH)
    a1 = _fma_zeros(BLOCK_N, BLOCK_K, REDUCE_EACH)
    a2 = _fma_zeros(BLOCK_N, BLOCK_K, REDUCE_EACH)
    a3 = _fma_zeros(BLOCK_N, BLOCK_K, REDUCE_EACH)
    c0 = _fma_zeros(BLOCK_N, BLOCK_K, REDUCE_EACH)
    k_start = k0
    if USE_PDL:
        # The weights are not written by the kernel this one depends on, so the first tile
        # streams in while that kernel finishes; x and everything written are touched only after
        # the wait. At M = 1 with K <= BLOCK_K that is the whole weight read.
        kmask = (k0 + offs_k) < k_end
        w = tl.load(w_ptrs + k0, mask=kmask[None, :], other=0.0).to(tl.float32)
        if GATED:
            u = tl.load(u_ptrs + k0, mask=kmask[None, :], other=0.0).to(tl.float32)
        if NORM:  # norm weights too
            g = tl.load(g_ptr + k0 + offs_k, mask=kmask, other=0.0)
        wait_for_producer()
    rstd = 1.0
    if NORM:
        rstd = norm_stats(x_ptr, res_ptr, sum_ptr, K, eps, tile == 0, NORM_RES, BLOCK_H)
    if USE_PDL:
        a0, a1, a2, a3, c0 = _fma_tile(a0, a1, a2, a3, c0, w, u if GATED else w, x_ptr, res_ptr, g_ptr, k0, K,
                                       stride_xm, offs_k, kmask, rstd, g if NORM else None, True,
                                       REDUCE_EACH, BLOCK_M, GATED, NORM, NORM_RES)
        k_start = k0 + BLOCK_K
    for k in range(k_start, k_full, BLOCK_K):
        w = tl.load(w_ptrs + k).to(tl.float32)
        if GATED:
            u = tl.load(u_ptrs + k).to(tl.float32)
        a0, a1, a2, a3, c0 = _fma_tile(a0, a1, a2, a3, c0, w, u if GATED else w, x_ptr, res_ptr, g_ptr, k, K,
                                       stride_xm, offs_k, None, rstd, None, False, REDUCE_EACH, BLOCK_M, GATED,
                                       NORM, NORM_RES)
    if k_full < k_end and k_full >= k_start:  # K tail (unless the peeled first tile was it)
        kmask = (k_full + offs_k) < k_end
        w = tl.load(w_ptrs + k_full, mask=kmask[None, :], other=0.0).to(tl.float32)
        if GATED:
            u = tl.load(u_ptrs + k_full, mask=kmask[None, :], other=0.0).to(tl.float32)
        a0, a1, a2, a3, c0 = _fma_tile(a0, a1, a2, a3, c0, w, u if GATED else w, x_ptr, res_ptr, g_ptr, k_full,
                                       K, stride_xm, offs_k, kmask, rstd, None, True, REDUCE_EACH, BLOCK_M,
                                       GATED, NORM, NORM_RES)
    return a0, a1, a2, a3, c0


@triton.jit
def _dot_k_loop(w_ptrs, u_ptrs, xt_ptrs, k0, k_full, k_end, offs_k, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_K: tl.constexpr, GATED: tl.constexpr, DOT_PRECISION: tl.constexpr, M=0,
               PAD_M: tl.constexpr = False):
    """The DOT path's K loop over columns [k0, k_end): whole BLOCK_K tiles up to k_full, then the
    masked tail. PAD_M (BLOCK_M > M): the tile's padding rows, M and past, load nothing and read as
    zeros (all reading row 0 slowed the 4-row products of a verify step, and r % M put a division
    before the first load; docs/notes/benchmarks-history.md). Returns the [BLOCK_N, BLOCK_M] fp32
    sums w @ x^T (and u @ x^T if GATED, else zeros). FP8 weight tiles are widened to x's dtype
    (exactly) before each product.
    kernels/qkv_rotary.py's 3-16-token launch runs the same loop, so its sums are the GEMV's."""
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    acc_u = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    xmask = (tl.arange(0, BLOCK_M) < M)[None, :]
    for k in range(k0, k_full, BLOCK_K):
        if PAD_M:
            xt = tl.load(xt_ptrs + k, mask=xmask, other=0.0)
        else:
            xt = tl.load(xt_ptrs + k)
        acc = tl.dot(tl.load(w_ptrs + k).to(xt.dtype), xt, acc, input_precision=DOT_PRECISION)
        if GATED:
            acc_u = tl.dot(tl.load(u_ptrs + k).to(xt.dtype), xt, acc_u, input_precision=DOT_PRECISION)
    if k_full < k_end:  # K tail (K not a multiple of BLOCK_K)
        kmask = (k_full + offs_k) < k_end
        tmask = kmask[:, None] & xmask if PAD_M else kmask[:, None]
        xt = tl.load(xt_ptrs + k_full, mask=tmask, other=0.0)
        w = tl.load(w_ptrs + k_full, mask=kmask[None, :], other=0.0).to(xt.dtype)
        acc = tl.dot(w, xt, acc, input_precision=DOT_PRECISION)
        if GATED:
            u = tl.load(u_ptrs + k_full, mask=kmask[None, :], other=0.0).to(xt.dtype)
            acc_u = tl.dot(u, xt, acc_u, input_precision=DOT_PRECISION)
    return acc, acc_u


@triton.jit
def _fma_final(acc, REDUCE_EACH: tl.constexpr):
    if REDUCE_EACH:
        out = acc
    else:
        out = tl.sum(acc, axis=1)
    return out


@triton.jit
def _store_row(vals, m, y_ptr, ws_ptr, bias_ptr, offs_n, M, N, stride_ym, split,
               HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, add_ptr=None, HAS_ADD: tl.constexpr = False):
    # One output row of the FMA path: straight to y, or to the split's partial slab. HAS_ADD: y is
    # add + the product, the product rounded to y's dtype first (residual_add's bits).
    nmask = offs_n < N
    if SPLIT:
        tl.store(ws_ptr + (split * M + m).to(tl.int64) * N + offs_n, vals, mask=nmask)
    else:
        if HAS_BIAS:
            vals += tl.load(bias_ptr + offs_n, mask=nmask, other=0.0).to(tl.float32)
        dt = y_ptr.dtype.element_ty
        if HAS_ADD:
            vals = tl.load(add_ptr + m * N + offs_n, mask=nmask, other=0.0).to(tl.float32) + vals.to(dt).to(tl.float32)
        tl.store(y_ptr + m * stride_ym + offs_n, vals.to(dt), mask=nmask)


@triton.jit
def _reduce_tile(pid_n, ws_ptr, bias_ptr, y_ptr, M, N, stride_ym, SPLIT_K,
                 HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 tab_ptr, seq_ptr, tp_rank, tp_words, PUSH_W: tl.constexpr):
    # BLOCK_M: a power of 2 >= M.
    # Sum the SPLIT_K partials of one output tile in split order (deterministic), + bias, cast;
    # PUSH_W: the cast tile then summed over the ranks (kernels/push_reduce.py).
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    idx = offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for s in range(0, SPLIT_K):
        # .cg: the partials were written by other SMs; L1 is not coherent with them.
        acc += tl.load(ws_ptr + s * M * N + idx, mask=mask, other=0.0, cache_modifier=".cg")
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    if PUSH_W > 0:
        push_reduce_tile(acc.to(y_ptr.dtype.element_ty), pid_n, M, BLOCK_M, BLOCK_N, N, y_ptr, stride_ym, tab_ptr,
                         seq_ptr, tp_rank, tp_words, PUSH_W)
    else:
        tl.store(y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :],
                 acc.to(y_ptr.dtype.element_ty), mask=mask)


# M == 1 stays specialised; M's divisibility by 16 is not (loads and stores vectorise along K and N
# only), so the DOT path's M = 4, 8 and 16 share one compiled variant.
@triton.jit(do_not_specialize_on_alignment=["M"])
def _gemv_kernel(
    x_ptr,  # [M, K] bf16/fp16/fp32, last dim contiguous (row stride stride_xm)
    w_ptr,  # [N, K] same dtype, or float8_e4m3fn (HAS_SCALE), contiguous
    scale_ptr,  # [N] fp32 (HAS_SCALE only; GATED: [2N]): output row n is scaled by scale[n]
    bias_ptr,  # [N] (HAS_BIAS only)
    y_ptr,  # [M, N] x's dtype, last dim contiguous (row stride stride_ym)
    ws_ptr,  # [SPLIT_K, M, N] fp32 partials (SPLIT only)
    ctr_ptr,  # [>= cdiv(N, BLOCK_N)] int32 zeros (FUSED only): splits of each tile done
    res_ptr,  # [M, K] contiguous residual added to x before the norm (NORM_RES only)
    g_ptr,  # [K] norm weight, x's dtype (NORM only)
    sum_ptr,  # [M, K] contiguous out: x + residual (NORM_RES only)
    eps,  # the norm's epsilon (NORM only)
    tab_ptr, seq_ptr, tp_rank, tp_words,  # the push buffers (PUSH_W only)
    add_ptr,  # [M, N] contiguous, y's dtype (HAS_ADD only): added to each output row
    M, N, K,
    stride_xm, stride_ym,
    K_PER_SPLIT,  # K columns per split, a multiple of BLOCK_K
    SPLIT_K,  # number of splits (grid dim 1)
    BLOCK_M: tl.constexpr,  # rows of x per program: M padded (DOT: gemv_config.dot_block_m(M); FMA: M, <= 4)
    BLOCK_N: tl.constexpr,  # rows of w (output columns) per program
    BLOCK_K: tl.constexpr,  # columns of w per step
    USE_DOT: tl.constexpr,
    REDUCE_EACH: tl.constexpr,  # FMA path: sum along K every step instead of once at the end
    HAS_BIAS: tl.constexpr,
    SPLIT: tl.constexpr,  # SPLIT_K > 1: partials to ws_ptr
    FUSED: tl.constexpr,  # SPLIT and the last split of a tile reduces it (ctr_ptr)
    RED_M: tl.constexpr = 16,  # BLOCK_M rounded up to a power of 2 (the FMA path's BLOCK_M is M)
    DOT_PRECISION: tl.constexpr = "tf32",  # "ieee" for fp32 inputs (tests): no silent tf32
    USE_PDL: tl.constexpr = False,  # a programmatic dependent (kernels/pdl.py), see below
    GATED: tl.constexpr = False,  # unsplit, one row per program or DOT: w is [2N, K] gate|up, y = silu(x.gate) * x.up
    NORM: tl.constexpr = False,  # FMA, one row per program, unsplit: x is the input of an RMSNorm (g_ptr, eps)
    NORM_RES: tl.constexpr = False,  # NORM of x + residual (res_ptr), the sum stored to sum_ptr
    BLOCK_H: tl.constexpr = 16,  # NORM: a power of 2 >= K (else unused, left at 16)
    PAD_M: tl.constexpr = False,  # DOT: BLOCK_M > M
    PER_ROW: tl.constexpr = False,  # FMA, unsplit, BLOCK_M = 1: program (tile, row) = divmod(pid, M)
    PUSH_W: tl.constexpr = 0,  # FMA unsplit at BLOCK_M <= 2, or DOT unsplit or FUSED; not GATED, no bias: y
    # summed over W ranks (kernels/push_reduce.py)
    HAS_SCALE: tl.constexpr = False,  # w is FP8 with per-row scales (kernels/fp8_weight.py)
    ARGMAX: tl.constexpr = False,  # FMA, M = 1, unsplit: y is the row's argmax.fold_argmax slots, not the logits
    HAS_ADD: tl.constexpr = False,  # FMA, unsplit, not GATED, PUSH_W or ARGMAX: y = add + x @ w^T
    TILE_M: tl.constexpr = False,  # DOT, unsplit, no push: x's rows in BLOCK_M tiles, grid dimension 2
):
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    if TILE_M:
        m0 = tl.program_id(2) * BLOCK_M
        x_ptr += m0.to(tl.int64) * stride_xm
        y_ptr += m0.to(tl.int64) * stride_ym
        M = tl.minimum(M - m0, BLOCK_M)
    if PER_ROW:
        # Rows of one tile are adjacent programs, so they run together and share its L2 lines.
        row = pid_n % M
        pid_n = pid_n // M
        x_ptr += row * stride_xm
        y_ptr += row * stride_ym
        res_ptr += row * K
        add_ptr += row * N
        sum_ptr += row * K
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # Rows past N re-read row N - 1 instead of masking every load; they are never stored.
    rows = tl.minimum(offs_n, N - 1)
    offs_k = tl.arange(0, BLOCK_K)
    k0 = split * K_PER_SPLIT
    k_end = tl.minimum(k0 + K_PER_SPLIT, K)
    k_full = k0 + ((k_end - k0) // BLOCK_K) * BLOCK_K
    w_ptrs = w_ptr + rows.to(tl.int64)[:, None] * K + offs_k[None, :]

    if USE_DOT:
        # y^T tile [BLOCK_N, BLOCK_M] = w tile [BLOCK_N, BLOCK_K] @ x^T [BLOCK_K, BLOCK_M]: with the
        # weight rows on the product's M side Hopper runs it on warpgroup MMA, which x on that side
        # (16 padded rows) never reached (docs/notes/benchmarks-history.md has the 4-row timings).
        if USE_PDL:
            wait_for_producer()
        offs_m = tl.arange(0, BLOCK_M)
        xt_ptrs = x_ptr + offs_m.to(tl.int64)[None, :] * stride_xm + offs_k[:, None]
        # GATED: acc_u sums the up rows, N below the gate rows
        acc, acc_u = _dot_k_loop(w_ptrs, w_ptrs + N * K, xt_ptrs, k0, k_full, k_end, offs_k, BLOCK_N, BLOCK_M,
                                 BLOCK_K, GATED, DOT_PRECISION, M, PAD_M)
        acc = _row_scaled(acc, scale_ptr, rows, HAS_SCALE)
        acc_u = _row_scaled(acc_u, scale_ptr + N, rows, HAS_SCALE and GATED)
        offs_m2 = offs_m[None, :]
        mask = (offs_m2 < M) & (offs_n[:, None] < N)
        if SPLIT:
            tl.store(ws_ptr + (split * M + offs_m2).to(tl.int64) * N + offs_n[:, None], acc, mask=mask)
        else:
            dt = y_ptr.dtype.element_ty
            if GATED:  # both products rounded to y's dtype first, as the unfused GEMV stores them
                acc = silu_mul(acc.to(dt), acc_u.to(dt))
            elif HAS_BIAS:
                acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[:, None]
            if PUSH_W > 0:
                push_reduce_tile(tl.trans(acc.to(dt)), pid_n, M, BLOCK_M, BLOCK_N, N, y_ptr, stride_ym, tab_ptr,
                                 seq_ptr, tp_rank, tp_words, PUSH_W)
            else:
                tl.store(y_ptr + offs_m2.to(tl.int64) * stride_ym + offs_n[:, None], acc.to(dt), mask=mask)
    else:
        # One [BLOCK_N, BLOCK_K] fp32 partial per row of x (BLOCK_M == M here); unused ones are
        # dead code. GATED: the up rows (N below the gate rows) in the same shape of tile, so each
        # output's two dot products sum in exactly the order of the unfused GEMV; c0 is up's.
        a0, a1, a2, a3, c0 = _fma_k_loop(w_ptrs, w_ptrs + N * K, x_ptr, res_ptr, sum_ptr, g_ptr, eps, k0, k_full,
                                         k_end, K, stride_xm, offs_k, pid_n, BLOCK_N, BLOCK_K, BLOCK_M, REDUCE_EACH,
                                         GATED, NORM, NORM_RES, BLOCK_H, USE_PDL)
        a0 = _row_scaled(a0, scale_ptr, rows, HAS_SCALE)
        a1 = _row_scaled(a1, scale_ptr, rows, HAS_SCALE and BLOCK_M > 1)
        a2 = _row_scaled(a2, scale_ptr, rows, HAS_SCALE and BLOCK_M > 2)
        a3 = _row_scaled(a3, scale_ptr, rows, HAS_SCALE and BLOCK_M > 3)
        c0 = _row_scaled(c0, scale_ptr + N, rows, HAS_SCALE and GATED)
        if GATED:
            # Both products rounded to y's dtype first, as the unfused GEMV stores them.
            dt = y_ptr.dtype.element_ty
            tl.store(y_ptr + offs_n, silu_mul(_fma_final(a0, REDUCE_EACH).to(dt),
                                              _fma_final(c0, REDUCE_EACH).to(dt)).to(dt), mask=offs_n < N)
        elif PUSH_W > 0 and BLOCK_M == 1:
            push_reduce_row(_fma_final(a0, REDUCE_EACH).to(y_ptr.dtype.element_ty), pid_n, BLOCK_N, N, y_ptr,
                            tab_ptr, seq_ptr, tp_rank, tp_words, PUSH_W)
        elif PUSH_W > 0:  # two rows: one tile of the DOT path's push
            rows2 = tl.trans(tl.join(_fma_final(a0, REDUCE_EACH), _fma_final(a1, REDUCE_EACH)))  # [2, BLOCK_N]
            push_reduce_tile(rows2.to(y_ptr.dtype.element_ty), pid_n, M, 2, BLOCK_N, N, y_ptr, stride_ym, tab_ptr,
                             seq_ptr, tp_rank, tp_words, PUSH_W)
        elif ARGMAX:  # the logits as the unfused GEMV would store them, never stored
            fold_argmax(_fma_final(a0, REDUCE_EACH).to(x_ptr.dtype.element_ty).to(tl.float32), offs_n, N, y_ptr,
                        pid_n)
        else:
            _store_row(_fma_final(a0, REDUCE_EACH), 0, y_ptr, ws_ptr, bias_ptr, offs_n, M, N, stride_ym,
                       split, HAS_BIAS, SPLIT, add_ptr, HAS_ADD)
        if BLOCK_M > 1 and PUSH_W == 0:
            _store_row(_fma_final(a1, REDUCE_EACH), 1, y_ptr, ws_ptr, bias_ptr, offs_n, M, N, stride_ym,
                       split, HAS_BIAS, SPLIT, add_ptr, HAS_ADD)
        if BLOCK_M > 2:
            _store_row(_fma_final(a2, REDUCE_EACH), 2, y_ptr, ws_ptr, bias_ptr, offs_n, M, N, stride_ym,
                       split, HAS_BIAS, SPLIT, add_ptr, HAS_ADD)
        if BLOCK_M > 3:
            _store_row(_fma_final(a3, REDUCE_EACH), 3, y_ptr, ws_ptr, bias_ptr, offs_n, M, N, stride_ym,
                       split, HAS_BIAS, SPLIT, add_ptr, HAS_ADD)

    if FUSED:  # the last split of the tile to finish reduces it
        if last_to_finish(ctr_ptr + pid_n, SPLIT_K):
            _reduce_tile(pid_n, ws_ptr, bias_ptr, y_ptr, M, N, stride_ym, SPLIT_K, HAS_BIAS,
                         RED_M, BLOCK_N, tab_ptr, seq_ptr, tp_rank, tp_words, PUSH_W)


@triton.jit
def _gemv_reduce_kernel(
    ws_ptr,  # [SPLIT_K, M, N] fp32
    bias_ptr,  # [N] (HAS_BIAS only)
    y_ptr,  # [M, N]
    M, N, stride_ym, SPLIT_K,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, USE_PDL: tl.constexpr = False,
):
    if USE_PDL:
        wait_for_producer()
    _reduce_tile(tl.program_id(0), ws_ptr, bias_ptr, y_ptr, M, N, stride_ym, SPLIT_K, HAS_BIAS, BLOCK_M, BLOCK_N,
                 y_ptr, y_ptr, 0, 0, 0)


# ---------------------------------------------------------------------------------------------
# Launch
# ---------------------------------------------------------------------------------------------


def _validate(x, w, scale, bias, out) -> None:
    if not isinstance(x, torch.Tensor) or not isinstance(w, torch.Tensor):
        raise ValueError("x and w must be torch.Tensors (or w an Fp8Weight)")
    if x.dim() != 2:
        raise ValueError(f"x must be [M, K], got shape {tuple(x.shape)}")
    if w.dim() != 2:
        raise ValueError(f"w must be [N, K], got shape {tuple(w.shape)}")
    m, k = x.shape
    n = w.shape[0]
    if w.shape[1] != k:
        raise ValueError(f"x [M, K] and w [N, K] disagree on K: {tuple(x.shape)} vs {tuple(w.shape)}")
    if m < 1 or n < 1 or k < 1:
        raise ValueError(f"empty problem: x {tuple(x.shape)}, w {tuple(w.shape)}")
    if m > gemv_config.TILED_MAX_M:
        raise ValueError(f"gemv_triton takes M <= {gemv_config.TILED_MAX_M} rows, got {m} (use F.linear)")
    if x.dtype not in _SUPPORTED:
        raise ValueError(f"x dtype must be bf16/fp16/fp32, got {x.dtype}")
    if w.dtype != (FP8 if scale is not None else x.dtype):
        raise ValueError(f"w dtype {w.dtype} differs from x dtype {x.dtype}")
    if scale is not None and (scale.shape != (n,) or scale.dtype != torch.float32 or not scale.is_contiguous()
                              or scale.device != w.device):
        raise ValueError(f"an FP8 matrix's scales must be a contiguous [{n}] fp32 vector on {w.device}")
    if x.device != w.device:
        raise ValueError(f"x on {x.device}, w on {w.device}")
    if x.stride(1) != 1:
        raise ValueError(f"x must be contiguous in K, got strides {x.stride()}")
    if not w.is_contiguous():
        raise ValueError(f"w must be contiguous [N, K], got strides {w.stride()}")
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or bias.shape != (n,):
            raise ValueError(f"bias must be [{n}], got {getattr(bias, 'shape', type(bias).__name__)}")
        if bias.dtype != x.dtype or bias.device != x.device or not bias.is_contiguous():
            raise ValueError(f"bias must be contiguous {x.dtype} on {x.device}")
    if out is not None:
        if not isinstance(out, torch.Tensor) or out.shape != (m, n) or out.dtype != x.dtype:
            raise ValueError(f"out must be [{m}, {n}] {x.dtype}")
        if out.device != x.device or out.stride(1) != 1:
            raise ValueError(f"out must be on {x.device} and contiguous in N")


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def gemv_triton(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, *, out: torch.Tensor | None = None,
    use_dot: bool | None = None, reduce_each: bool | None = None, block_n: int | None = None,
    block_k: int | None = None, split_k: int | None = None, num_warps: int | None = None,
    num_stages: int | None = None, fused: bool | None = None, pdl: bool | None = None, gated: bool = False,
    norm: PendingNorm | None = None, per_row: bool | None = None, push: PushTarget | None = None,
    propose: Proposal | None = None, add: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """x [M, K] (last dim contiguous), w [N, K] contiguous, bias [N] or None -> y [M, N] in x's dtype.

    bf16/fp16 (fp32 for the interpreter tests), fp32 accumulation, 1 <= M <= 64 (FMA path: M <= 4), or
    up to gemv_config.TILED_MAX_M on the unsplit DOT path (no push), in row tiles of 64.
    w may be an Fp8Weight (kernels/fp8_weight.py): its e4m3 matrix is read and each output row
    scaled, giving w.dense's result up to summation order. out: a preallocated y. Workspaces come
    from torch's caching allocator (the graph's pool under capture).
    use_dot, reduce_each, block_n, block_k, split_k, num_warps, num_stages: override the
    configuration (select_config's or the path's default; the sweep and the tests use them).
    fused (default: when split and the counters exist): the split-K sum in the same launch. pdl: a
    programmatic dependent (default pdl_enabled); the FMA path reads its first weight tile before
    the wait. per_row: one M = 1 program per row (2 <= M <= ROWS_MAX_M, unsplit), each row of y the
    bits of gemv_triton(x[i:i+1], w) with the same tiles; default the configuration's unless
    use_dot or split_k is given.
    Fusions, each bit for bit the unfused launches under the same configuration:
    - gated: w is [2I, K] gate rows then up rows, y = silu(x.gate^T) * (x.up^T) [M, I] (one row per
      program or the DOT path; no split, bias or out);
    - norm: x is norm.x, the input of an RMSNorm (kernels/norm.PendingNorm), normalised in the
      prologue (one row per program, unsplit, no out); norm.stream holds x + residual afterwards;
    - push: y summed over a tensor-parallel group in the epilogue (kernels/push_reduce.py; one or two
      rows on the unsplit FMA path, or the DOT path; no bias or gate), a collective;
    - propose: a draft step's top-1 instead of y (one row, unsplit FMA path, no bias, gate or push;
      out [1] int64): argmax_triton(y, propose=propose)'s token, y never written;
    - add: y is add + x @ w^T (add [M, N] contiguous in x's dtype; the unsplit FMA path, no gate, push
      or propose): residual_add(add, y)'s bits, the product rounded first.
    """
    w, scale = weight_and_scale(w)
    _validate(x, w, scale, bias, out if propose is None else None)
    m, k = x.shape
    n = w.shape[0]
    cfg = select_config(m, n, k, scale is not None and m == 1, gated) if m <= gemv_config.triton_max_m() else None
    tiled = gemv_config.row_tiles(m) > 1  # past 64 rows: the DOT path's row tiles
    if cfg is None:
        cfg = _path_default(m > _FMA_MAX_M if use_dot is None else use_dot)
    if use_dot is not None and use_dot != cfg["use_dot"]:
        cfg = _path_default(use_dot)
    if per_row is None:  # explicit path knobs (the sweep, the tests) ask for the classic paths
        per_row = cfg.get("per_row", False) and use_dot is None and split_k is None
    if per_row and (m < 2 or m > ROWS_MAX_M or use_dot):
        raise ValueError(f"per_row=True takes 2 <= M <= {ROWS_MAX_M} on the FMA path, got M = {m}")
    one_row = m == 1 or per_row  # every program computes one row of y
    if gated and (not (one_row or cfg["use_dot"]) or bias is not None or out is not None or n % 2):
        raise ValueError("gated=True takes M = 1, per_row or the DOT path, an even N (gate rows then up rows), no "
                         f"bias, no out; got x {tuple(x.shape)}, w {tuple(w.shape)}")
    if norm is not None and (norm.x is not x or not one_row or (out is not None and propose is None)
                             or not norm.fusable()):
        raise ValueError("norm= takes the PendingNorm of x itself: contiguous rows, one per program, norm weight in "
                         f"x's dtype, no out; got x {tuple(x.shape)}")
    if use_dot is False and m > _FMA_MAX_M and not per_row:
        raise ValueError(f"the FMA path (use_dot=False) takes M <= {_FMA_MAX_M}, got {m}")
    use_dot = cfg["use_dot"] if not per_row else False
    reduce_each = cfg["reduce_each"] if reduce_each is None else reduce_each
    block_n = cfg["block_n"] if block_n is None else block_n
    block_k = cfg["block_k"] if block_k is None else block_k
    num_warps = cfg["num_warps"] if num_warps is None else num_warps
    num_stages = cfg["num_stages"] if num_stages is None else num_stages
    for name, v in (("block_n", block_n), ("block_k", block_k)):
        if v < 1 or v & (v - 1):
            raise ValueError(f"{name} must be a power of 2, got {v}")
    if use_dot and (block_n < 16 or block_k < 16):
        raise ValueError(f"the DOT path needs block_n, block_k >= 16, got {block_n}, {block_k}")
    tiles = triton.cdiv(n, block_n)
    steps = triton.cdiv(k, block_k)
    if per_row:
        split_k = 1
    if split_k is None:
        split_k = 1 if tiled else cfg.get("split_k") or _split_for(tiles, steps, cfg.get("programs_per_sm", 0),
                                                                   _num_sms(x.device))
    split_k = max(1, min(split_k, steps))
    k_per_split = triton.cdiv(steps, split_k) * block_k
    split_k = triton.cdiv(k, k_per_split)  # no empty split
    block_m = gemv_config.dot_block_m(m) if use_dot else 1 if per_row else m
    if tiled and (not use_dot or split_k > 1 or push is not None):
        raise ValueError(f"past {gemv_config.dot_block_m(m)} rows gemv_triton takes the unsplit DOT path, no push; "
                         f"got M = {m}, use_dot={use_dot}, split_k={split_k}")
    if gated:
        if split_k > 1:
            raise ValueError("gated=True needs an unsplit launch")
        n //= 2  # y's width: one output per (gate row, up row) pair
        if use_dot and block_n > 16:  # each program reads two tiles: keep the unfused launch's count
            block_n //= 2
        tiles = triton.cdiv(n, block_n)
    if norm is not None and (use_dot or split_k > 1):
        raise ValueError("norm= needs the unsplit FMA path")
    if push is not None and ((not use_dot and (m > 2 or per_row or split_k > 1)) or gated or bias is not None
                             or not push.fits(n, block_n, x.dtype, m)):
        raise ValueError(f"push= takes one or two rows on the unsplit FMA path (not per_row) or the DOT path, no "
                         f"bias or gate, and a product the push buffers hold; got x {tuple(x.shape)}, "
                         f"w {tuple(w.shape)}")

    keys = argmax_keys(x.device) if propose is not None else None
    if propose is not None and (m != 1 or use_dot or split_k > 1 or gated or bias is not None or push is not None
                                or out is None or out.shape != (1,) or out.dtype != torch.int64
                                or out.device != x.device or keys is None):
        raise ValueError("propose= takes one row on the unsplit FMA path, no bias, gate or push, out a [1] int64 "
                         "tensor, and the argmax key slots (first call outside capture)")
    if propose is not None:
        _validate_proposal(propose, 1, n, x.device)
    if add is not None and (use_dot or split_k > 1 or gated or push is not None or propose is not None
                            or add.shape != (m, n) or add.dtype != x.dtype or not add.is_contiguous()
                            or add.device != x.device):
        raise ValueError(f"add= takes a contiguous [{m}, {n}] {x.dtype} tensor on {x.device} and the unsplit FMA "
                         f"path, no gate, push or propose; got {tuple(add.shape)} {add.dtype}")
    # propose: the kernel's y is the row's argmax slots, fold_finish writes out
    y = keys if propose is not None else torch.empty((m, n), dtype=x.dtype, device=x.device) if out is None else out
    ctr = None
    if split_k > 1:
        ws = torch.empty((split_k, m, n), dtype=torch.float32, device=x.device)
        if fused is None or fused:
            ctr = counters(x.device, tiles)
        if (fused or push is not None) and ctr is None:
            raise RuntimeError(f"{'push=' if push is not None else 'fused=True'} on a split launch needs the "
                               f"counter buffer (first call outside capture, <= {COUNTER_SLOTS} tiles)")
    else:
        ws = y  # unused
    b = bias if bias is not None else y  # unused when HAS_BIAS is False
    pdl = pdl_enabled(x.device) if pdl is None else pdl
    res, g, stream, eps, has_res = norm.kernel_args() if norm is not None else (x, x, x, 0.0, False)
    tp_args = push.kernel_args() if push is not None else no_push_args(x)
    _gemv_kernel[(tiles * m if per_row else tiles, split_k, gemv_config.row_tiles(m) if use_dot else 1)](
        x, w, scale if scale is not None else y, b, y, ws, ctr if ctr is not None else y, res, g, stream, eps, *tp_args,
        add if add is not None else y, m, n, k, x.stride(0), y.stride(0), k_per_split, split_k,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, USE_DOT=use_dot, REDUCE_EACH=reduce_each,
        HAS_BIAS=bias is not None, SPLIT=split_k > 1, FUSED=ctr is not None, RED_M=triton.next_power_of_2(block_m),
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", USE_PDL=pdl, GATED=gated,
        NORM=norm is not None, NORM_RES=has_res, BLOCK_H=triton.next_power_of_2(k) if norm is not None else 16,
        PAD_M=use_dot and m % block_m != 0, PER_ROW=per_row, PUSH_W=push.world if push is not None else 0,
        HAS_SCALE=scale is not None, ARGMAX=propose is not None, HAS_ADD=add is not None, TILE_M=tiled,
        num_warps=num_warps,
        num_stages=num_stages,
        **pdl_launch(pdl),
    )
    if propose is not None:
        fold_finish(keys, out, propose, pdl)
        return out
    if split_k > 1 and ctr is None:
        rb_m = triton.next_power_of_2(m)
        rb_n = max(16, min(256, 4096 // rb_m))
        _gemv_reduce_kernel[(triton.cdiv(n, rb_n),)](
            ws, b, y, m, n, y.stride(0), split_k, HAS_BIAS=bias is not None, BLOCK_M=rb_m, BLOCK_N=rb_n,
            USE_PDL=pdl, num_warps=4, **pdl_launch(pdl),
        )
    return y
