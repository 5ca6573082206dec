"""The filters' search over a whole row (kernels 4 and 5 of kernels/rejection_filter.py), for the
rows the threshold kernel flags: their candidates overflowed the buffer or weighed less than top_p
of the row. Both kernels run on (rows, splits) programs and return at once on other rows.
  4. _bins_kernel, rows without top_k (top_p and min_p only) with bf16 or fp16 logits: the row's
     entries weighed by key bin (NBINS bins); its last program picks the window of
     WINDOW keys that holds the threshold (top_p's crossing bin, or min_p's if higher).
  5. _window_kernel: the window's entries counted key by key; the row's last program finds the exact
     threshold from them (the weight over the window plus count times weight per key). Rows it
     cannot take (top_k, fp32 keys, a min_p cut past the window, more than SPREAD_ROWS rows in the
     call) get _row_tau over the whole row in that program instead.
Apart from the threshold kernel, which every filtered row runs, so that their tiles over the row
do not set its registers.
"""

import torch
import triton
import triton.language as tl
from graphrt.kernels.counters import counters, last_to_finish, shared_workspace
from graphrt.kernels.rejection_filter_select import (
    _filters,
    _key_range,
    _key_value,
    _keys,
    _reset_row,
    _row_tau,
    _tl_weights,
)
from graphrt.kernels.rejection_kernels import _NEG_INF, _scaled

NBINS = 4096  # kernel 4's key bins
WINDOW = tl.constexpr(256)  # the keys kernel 5 counts one by one
SPREAD_ROWS = 32  # up to this many rows a call spreads the search; past it, one program a row
SPREAD_PROGRAMS = 256  # the spread search's programs per call, about


@triton.jit
def _last_of_row(ctr_ptr, MERGE: tl.constexpr):
    """Whether this program is the last of its row's to finish (counters.last_to_finish); a row's
    only program is."""
    last = tl.program_id(1) >= 0
    if MERGE:
        last = last_to_finish(ctr_ptr, tl.num_programs(1))
    return last


@triton.jit
def _bins_kernel(
    logits_ptr, temp_ptr, topk_ptr, topp_ptr, minp_ptr,  # as _threshold_kernel
    need_ptr,  # [B*(K+1)] int32: _threshold_kernel's flags
    kmax_ptr,  # [rows] int32: the row's largest key (kernel 1's, kept for flagged rows)
    mass_ptr,  # [rows] int64: the row's weight (kernel 2's; top_p rows)
    wsum_ptr,  # [rows, NBINS] int64 zeros on entry: the weight of the row's entries by key bin
    ctr_ptr,  # counters() (MERGE): a slot per row
    win_ptr,  # [rows] int32 out: the first bin of the row's window (its last program)
    above_ptr,  # [rows] int64 out: the weight of the keys over the window
    stride_lb, stride_lj, R, V, tiles_per_split,
    HAS_K: tl.constexpr, HAS_P: tl.constexpr, HAS_M: tl.constexpr, SHIFT: tl.constexpr,
    BLOCK_V: tl.constexpr,
    NBINS: tl.constexpr,
    MERGE: tl.constexpr,  # several programs a row
    PDL: tl.constexpr = 0,
):
    """The first level of the spread whole-row search, for each flagged row without top_k (top_p
    and min_p only: a flat row whose kept entries overflow the candidates), over (rows, splits)
    programs: the row's entries weighed by key bin (NBINS bins of 2**BIN_SHIFT keys; int64 atomics,
    exact in any order). The row's last program to finish picks the window of
    WINDOW keys that holds its threshold: from the bin where the weight from the top crosses top_p
    of the row, or the bin where the weights reach min_p's bar if higher (the threshold is the larger
    of the two cuts)."""
    row, b, active, inv_t, k, use_k, top_p, min_p = _filters(temp_ptr, topk_ptr, topp_ptr, minp_ptr, R, V, HAS_K,
                                                             HAS_P, HAS_M, PDL)
    if (tl.load(need_ptr + row) != 0) & ~use_k:
        KEY_BITS: tl.constexpr = 32 - SHIFT
        BIN_SHIFT: tl.constexpr = KEY_BITS - 12
        x_max = _scaled(_key_value(tl.load(kmax_ptr + row).to(tl.int64), SHIFT), inv_t)
        row_ptr = logits_ptr + b * stride_lb + (row % R) * stride_lj
        offs0 = tl.arange(0, BLOCK_V)
        t0 = tl.program_id(1) * tiles_per_split
        for t in range(t0, tl.minimum(t0 + tiles_per_split, tl.cdiv(V, BLOCK_V))):
            offs = t * BLOCK_V + offs0
            raw = tl.load(row_ptr + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
            bins = ((_keys(raw, SHIFT) + (1 << (KEY_BITS - 1))) >> BIN_SHIFT).to(tl.int32)
            w = tl.where(offs < V, _tl_weights(_scaled(raw, inv_t), x_max), 0)
            tl.atomic_add(wsum_ptr + row * NBINS + bins, w, mask=w > 0, sem="relaxed")
        d = tl.arange(0, NBINS)
        if _last_of_row(ctr_ptr + row, MERGE):
            wsum = tl.load(wsum_ptr + row * NBINS + d, cache_modifier=".cg")  # other SMs' atomics
            first = tl.zeros_like(row).to(tl.int32)
            if top_p < 1.0:  # the highest bin from whose start up the row weighs top_p of its weight
                target = top_p.to(tl.float64) * tl.load(mass_ptr + row).to(tl.float64)
                s_from = tl.sum(wsum, axis=0) - tl.cumsum(wsum, axis=0) + wsum
                first = tl.max(tl.where(s_from.to(tl.float64) >= target, d, 0), axis=0)
            if min_p > 0.0:  # the lowest bin whose top key reaches min_p's bar
                top_key = ((d + 1).to(tl.int64) << BIN_SHIFT) - 1 - (1 << (KEY_BITS - 1))
                w_top = _tl_weights(_scaled(_key_value(top_key, SHIFT), inv_t), x_max)
                bar = min_p.to(tl.float64) * 4294967296.0
                first = tl.maximum(first, tl.min(tl.where(w_top.to(tl.float64) >= bar, d, NBINS - 1), axis=0))
            tl.store(win_ptr + row, first)
            tl.store(above_ptr + row, tl.sum(tl.where(d >= first + (WINDOW >> BIN_SHIFT), wsum, 0), axis=0))


@triton.jit
def _window_kernel(
    logits_ptr, temp_ptr, topk_ptr, topp_ptr, minp_ptr,  # as _threshold_kernel
    tau_ptr,  # [B*(K+1)] fp32: the threshold of each row flagged in need_ptr, out
    need_ptr, kmax_ptr, mass_ptr, hist_ptr,  # as _bins_kernel; kernels 1 and 2's state, reset here (CAND)
    wsum_ptr, ctr_ptr, win_ptr, above_ptr,  # _bins_kernel's (wsum reset here)
    wcnt_ptr,  # [rows, WINDOW] int32 zeros on entry: the window's entries key by key
    stride_lb, stride_lj, R, V, tiles_per_split,
    HAS_K: tl.constexpr, HAS_P: tl.constexpr, HAS_M: tl.constexpr, SHIFT: tl.constexpr,
    BLOCK_V: tl.constexpr,  # the tile over the row
    NBINS: tl.constexpr,
    SPREAD: tl.constexpr,  # _bins_kernel ran (CAND and keys of at most 20 bits: bf16, fp16)
    CAND: tl.constexpr,
    MERGE: tl.constexpr,  # several programs a row (SPREAD only)
    NP: tl.constexpr = 8,
    PDL: tl.constexpr = 0,
):
    """The threshold of each flagged row (its candidates overflowed the buffer or weighed less
    than top_p of the row; with CAND False every filtering row), over (rows, splits) programs. A
    row _bins_kernel took has its window's entries counted key by key, and its last program finds
    the exact threshold from them: the weight over the window plus each key's count times its
    weight. Rows with top_k, rows whose min_p cut lies past the window, and every row without
    SPREAD take the one-program search over the whole row (_row_tau) in their last program
    instead. That program also leaves the row's workspace as the next call expects it."""
    row, b, active, inv_t, k, use_k, top_p, min_p = _filters(temp_ptr, topk_ptr, topp_ptr, minp_ptr, R, V, HAS_K,
                                                             HAS_P, HAS_M, PDL)
    if tl.load(need_ptr + row) != 0:
        KEY_BITS: tl.constexpr = 32 - SHIFT
        BIN_SHIFT: tl.constexpr = KEY_BITS - 12
        row_ptr = logits_ptr + b * stride_lb + (row % R) * stride_lj
        d = tl.arange(0, WINDOW)
        spread = ~use_k
        if not SPREAD:
            spread = row < 0
        key_lo = tl.zeros_like(row)
        if spread:
            key_lo = (tl.load(win_ptr + row, cache_modifier=".cg").to(tl.int64) << BIN_SHIFT) - (1 << (KEY_BITS - 1))
            offs0 = tl.arange(0, BLOCK_V)
            cnt = tl.zeros([WINDOW], tl.int32)
            t0 = tl.program_id(1) * tiles_per_split
            for t in range(t0, tl.minimum(t0 + tiles_per_split, tl.cdiv(V, BLOCK_V))):
                offs = t * BLOCK_V + offs0
                key = _keys(tl.load(row_ptr + offs, mask=offs < V, other=float("-inf")).to(tl.float32), SHIFT)
                cnt += tl.histogram((key - key_lo).to(tl.int32), WINDOW,
                                    mask=(offs < V) & (key >= key_lo) & (key < key_lo + WINDOW))
            tl.atomic_add(wcnt_ptr + row * WINDOW + d, cnt, mask=cnt > 0, sem="relaxed")
        if _last_of_row(ctr_ptr + row, MERGE):
            tau = tl.zeros_like(inv_t) + _NEG_INF
            found = row < 0
            if spread:
                kmax = tl.load(kmax_ptr + row).to(tl.int64)
                x_max = _scaled(_key_value(kmax, SHIFT), inv_t)
                wcnt = tl.load(wcnt_ptr + row * WINDOW + d, cache_modifier=".cg").to(tl.int64)
                w_key = _tl_weights(_scaled(_key_value(key_lo + d, SHIFT), inv_t), x_max)
                found = row >= 0
                tau_key = key_lo - 1
                if top_p < 1.0:  # the largest key v with the weight from v up >= top_p of the row's
                    val = wcnt * w_key
                    s_from = tl.load(above_ptr + row) + tl.sum(val, axis=0) - tl.cumsum(val, axis=0) + val
                    ok = s_from.to(tl.float64) >= top_p.to(tl.float64) * tl.load(mass_ptr + row).to(tl.float64)
                    tau_key = key_lo + tl.max(tl.where(ok, d, -1), axis=0)
                if min_p > 0.0:  # the lowest key present that weighs min_p's bar
                    reach = (wcnt > 0) & (w_key.to(tl.float64) >= min_p.to(tl.float64) * 4294967296.0)
                    low = tl.min(tl.where(reach, d, WINDOW), axis=0)
                    found = low < WINDOW
                    tau_key = tl.maximum(tau_key, key_lo + low)
                tau = _key_value(tl.minimum(tau_key, kmax), SHIFT)
                nb: tl.constexpr = NBINS
                tl.store(wsum_ptr + row * nb + tl.arange(0, nb), tl.zeros([nb], tl.int64))
                tl.store(wcnt_ptr + row * WINDOW + d, tl.zeros([WINDOW], tl.int32))
            if ~found:
                kmin, kmax_w = _key_range(row_ptr, V, SHIFT, BLOCK_V)
                tau, _ = _row_tau(row_ptr, V, kmin, kmax_w, k, use_k, top_p, min_p, inv_t, tl.zeros_like(k) - 1,
                                  tau_ptr, tau_ptr, need_ptr, False, SHIFT, BLOCK_V, BLOCK_V, NP, 1)
            tl.store(tau_ptr + row, tau)
            if CAND:
                _reset_row(kmax_ptr, mass_ptr, hist_ptr, row)


_spread_workspaces: dict[torch.device, tuple[torch.Tensor, ...]] = {}


def _spread_workspace(dev: torch.device, rows: int) -> tuple[torch.Tensor, ...] | None:
    """The spread search's zeroed state (kernels 4 and 5): the weights by key bin [rows', NBINS]
    int64, the window [rows'] int32, the weight over it [rows'] int64, the window's counts
    [rows', WINDOW] int32; one per device, rows' >= rows (counters.shared_workspace: None inside a
    capture that would have to grow it). Each flagged row's last program zeroes what it used."""
    return shared_workspace(_spread_workspaces, dev, rows, lambda n: (
        torch.zeros((n, NBINS), dtype=torch.int64, device=dev), torch.zeros(n, dtype=torch.int32, device=dev),
        torch.zeros(n, dtype=torch.int64, device=dev), torch.zeros((n, WINDOW.value), dtype=torch.int32, device=dev)))


def whole_row_search(target_logits, temperature, filters, tau, need, state, *, block_v: int, flags: dict,
                     launch: dict) -> None:
    """Kernels 4 and 5 on the rows flagged in need ([B*(K+1)] int32), writing their thresholds to
    tau; target_logits [B, K+1, V], temperature and filters as thresholds_triton's. state: kernels
    1 and 2's (kmax, mass, hist) or None (every filtering row flagged, no candidates)."""
    b, r, v = target_logits.shape
    rows = b * r
    # keys of at most 20 bits (a window holds whole bins), and few rows: the bins' atomics contend
    # as rows grow (H100, flat top_p rows: 13x faster than one program a row at B = 1, 2.6x at B = 8,
    # 1.6x at B = 16, slower at B = 64), and the extra launch costs every filtered call 0-3 us
    spread = state is not None and flags["SHIFT"] >= 12 and rows <= SPREAD_ROWS
    ws = _spread_workspace(target_logits.device, rows) if spread else None
    ctr = counters(target_logits.device, rows) if spread else None
    spread = ws is not None and ctr is not None  # else one program a row (inside a capture that would allocate)
    wsum, win, above, wcnt = ws if spread else (tau,) * 4  # valid pointers, unused
    kmax, mass, hist = state if state is not None else (tau, tau, tau)
    strides = (target_logits.stride(0), target_logits.stride(1), r, v)
    tiles = triton.cdiv(v, block_v)
    # about 256 programs: every filtered call launches them, and most exit at once (1024 cost
    # B = 2 and 4 3.5 us more than the one-program search's launch, H100)
    per_split = triton.cdiv(tiles, max(1, min(tiles, SPREAD_PROGRAMS // rows))) if spread else tiles
    grid = (rows, triton.cdiv(tiles, per_split))
    merge = grid[1] > 1
    if spread:
        _bins_kernel[grid](target_logits, temperature, *filters, need, kmax, mass, wsum, ctr, win, above,
                           *strides, per_split, BLOCK_V=block_v, NBINS=NBINS, MERGE=merge, **flags, **launch)
    _window_kernel[grid](target_logits, temperature, *filters, tau, need, kmax, mass, hist, wsum,
                         ctr if spread else tau, win, above, wcnt, *strides, per_split, BLOCK_V=block_v, NBINS=NBINS,
                         SPREAD=spread, CAND=state is not None, MERGE=merge, **flags, **launch)
