"""The filters' search over a whole row (kernels 4 and 5 of kernels/rejection_filter.py), for the
rows the threshold kernel flags: their candidates overflowed the buffer or weighed less than top_p
of the row. Up to STATIC_ROWS rows, each row has programs of its own, one a split of it. Past that,
both kernels run on at least SPREAD_PROGRAMS programs and at least one a row, and share the flagged
rows out among them at run time from the threshold kernel's list: up to SPREAD_ROWS flagged rows,
each is split over as many programs as divide among them; past that, one program takes each. So one
flat row in a large batch still gets the spread search, and a call that flags nothing costs two
launches whose programs read one count and exit.
  4. _bins_kernel, spread rows without top_k (top_p and min_p only): the row's entries weighed by
     key bin (NBINS bins); its last program picks the window of WINDOW keys that holds the
     threshold (top_p's crossing bin, or min_p's if higher). fp32 keys take two launches, the
     second over the bins inside the first's.
  5. _window_kernel: the window's entries counted key by key; the row's last program finds the exact
     threshold from them (the weight over the window plus count times weight per key). Rows it
     cannot take (top_k, a min_p cut past the window, more than SPREAD_ROWS flagged rows in the
     call) get _row_tau over the whole row in one program instead.
Apart from the threshold kernel, which every filtered row runs, so that their tiles over the row
do not set its registers.
"""

import torch
import triton
import triton.language as tl
from graphrt.kernels.counters import counters, last_to_finish, shared_workspace
from graphrt.kernels.rejection_filter_select import (
    _key_range,
    _key_value,
    _keys,
    _reset_row,
    _row_filters,
    _row_tau,
    _tl_weights,
)
from graphrt.kernels.rejection_kernels import _NEG_INF, _pdl_wait, _scaled

NBINS = 4096  # kernel 4's key bins
WINDOW = tl.constexpr(256)  # the keys kernel 5 counts one by one
# up to this many flagged rows a call spreads each row's search over programs: the bins' atomics
# contend as rows grow (H100, flat top_p rows, every row flagged: 13x faster than one program a
# row at B = 1, 2.6x at B = 8, 1.6x at B = 16, slower at B = 64)
SPREAD_ROWS = 32
SPREAD_PROGRAMS = 256  # programs per launch (at least): most exit at once on most calls
STATIC_ROWS = 8  # up to this many rows (B = 2 at K = 3), each row has programs of its own


@triton.jit
def _share(flag_ptr, need_ptr, rows, V, LISTED: tl.constexpr, SPREAD: tl.constexpr, SPREAD_ROWS: tl.constexpr,
           BLOCK_V: tl.constexpr):
    """This program's share of the flagged rows, the same rule in kernels 4 and 5: (row, split,
    splits, spread, first tile, end tile), row -1 for none; a split's tiles of BLOCK_V are
    [first, end) of the row's. LISTED: from the threshold kernel's list (flag_ptr: count, then
    rows), split s of the f-th flagged row going to program f * splits + s; up to SPREAD_ROWS flagged
    rows are spread over the programs (SPREAD), each into as many splits as divide among them (at
    most one a tile of BLOCK_V). Else program (p, s) takes split s of row p if need_ptr flags it,
    every row spread (SPREAD) over the grid's second dimension."""
    p = tl.program_id(0)
    if LISTED:
        s = p * 0
        splits = s + 1
        nflag = tl.load(flag_ptr)
        spread = p < 0
        if SPREAD:
            spread = nflag <= SPREAD_ROWS
            if spread:
                splits = tl.maximum(tl.minimum(tl.num_programs(0) // tl.maximum(nflag, 1), tl.cdiv(V, BLOCK_V)), 1)
        f = p // splits
        s = p - f * splits
        row = tl.load(flag_ptr + 1 + f, mask=f < nflag, other=-1)
    else:
        s = tl.program_id(1)
        splits = tl.num_programs(1)
        spread = (p >= 0) & SPREAD
        row = tl.where(tl.load(need_ptr + p, mask=p < rows, other=0) != 0, p, -1)
    tiles = tl.cdiv(V, BLOCK_V)
    per_split = tl.cdiv(tiles, splits)
    return row.to(tl.int64), s, splits, spread, s * per_split, tl.minimum((s + 1) * per_split, tiles)


@triton.jit
def _bins_kernel(
    logits_ptr, temp_ptr, topk_ptr, topp_ptr, minp_ptr,  # as _threshold_kernel
    need_ptr,  # [B*(K+1)] int32: _threshold_kernel's flags
    flag_ptr,  # [1 + rows] int32: _threshold_kernel's count and list of the flagged rows
    kmax_ptr,  # [rows] int32: the row's largest key (kernel 1's, kept for flagged rows)
    mass_ptr,  # [rows] int64: the row's weight (kernel 2's; top_p rows)
    wsum_ptr,  # [rows, NBINS] int64 zeros on entry: the weight of the row's entries by key bin
    ctr_ptr,  # counters(): a slot per row
    win_ptr,  # [rows] int32 out: the bin the row's threshold lies in (LEVEL 0 of 2), else its window's first
    above_ptr,  # [rows] int64 out: the weight of the keys over that bin, or over the window
    stride_lb, stride_lj, R, V, rows,
    HAS_K: tl.constexpr, HAS_P: tl.constexpr, HAS_M: tl.constexpr, SHIFT: tl.constexpr,
    BLOCK_V: tl.constexpr,
    NBINS: tl.constexpr,
    LISTED: tl.constexpr,  # the flagged rows shared out from the list (else a program a row and split)
    SPREAD_ROWS: tl.constexpr,
    LEVEL: tl.constexpr = 0,  # 1: the bins inside LEVEL 0's bin (32-bit keys)
    FINAL: tl.constexpr = True,  # this level picks the window (else: LEVEL 0 of 2)
    PDL: tl.constexpr = 0,
):
    """A level of the spread whole-row search, for each flagged row without top_k (top_p and min_p
    only: a flat row whose kept entries overflow the candidates), when the call flags at most
    SPREAD_ROWS rows: the row's entries weighed by key bin (NBINS bins of 2**SH keys, the key's next
    12 bits; int64 atomics, exact in any order). The row's last program to finish picks the bin
    that holds its threshold: where the weight from the top crosses top_p of the row, or the bin
    where the weights reach min_p's bar if higher (the threshold is the larger of the two cuts).
    Keys of at most 20 bits (bf16, fp16) need one level, whose bin starts the window of WINDOW
    keys kernel 5 counts; 32-bit keys (fp32) a second one inside that bin, whose bins are windows."""
    _pdl_wait(PDL)
    row, s, splits, spread, t0, t1 = _share(flag_ptr, need_ptr, rows, V, LISTED, True, SPREAD_ROWS, BLOCK_V)
    if spread & (row >= 0):
        b, active, inv_t, k, use_k, top_p, min_p = _row_filters(row, temp_ptr, topk_ptr, topp_ptr, minp_ptr, R, V,
                                                                HAS_K, HAS_P, HAS_M)
        if ~use_k:
            KEY_BITS: tl.constexpr = 32 - SHIFT
            SH: tl.constexpr = KEY_BITS - 12 * (LEVEL + 1)
            prefix = tl.zeros_like(row)  # the bins of level 0 containing this level's
            above = tl.zeros_like(row)
            if LEVEL > 0:
                prefix = tl.load(win_ptr + row).to(tl.int64)
                above = tl.load(above_ptr + row)
            x_max = _scaled(_key_value(tl.load(kmax_ptr + row).to(tl.int64), SHIFT), inv_t)
            row_ptr = logits_ptr + b * stride_lb + (row % R) * stride_lj
            offs0 = tl.arange(0, BLOCK_V)
            for t in range(t0, t1):
                offs = t * BLOCK_V + offs0
                raw = tl.load(row_ptr + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
                ukey = _keys(raw, SHIFT) + (1 << (KEY_BITS - 1))  # unsigned: bins in key order
                bins = ((ukey >> SH) & (NBINS - 1)).to(tl.int32)
                inb = (offs < V) & ((ukey >> (SH + 12)) == prefix)
                w = tl.where(inb, _tl_weights(_scaled(raw, inv_t), x_max), 0)
                tl.atomic_add(wsum_ptr + row * NBINS + bins, w, mask=w > 0, sem="relaxed")
            d = tl.arange(0, NBINS)
            if last_to_finish(ctr_ptr + row, splits):
                wsum = tl.load(wsum_ptr + row * NBINS + d, cache_modifier=".cg")  # other SMs' atomics
                first = tl.zeros_like(splits)
                if top_p < 1.0:  # the highest bin from whose start up the row weighs top_p of its weight
                    target = top_p.to(tl.float64) * tl.load(mass_ptr + row).to(tl.float64)
                    s_from = above + tl.sum(wsum, axis=0) - tl.cumsum(wsum, axis=0) + wsum
                    first = tl.max(tl.where(s_from.to(tl.float64) >= target, d, 0), axis=0)
                if min_p > 0.0:  # the lowest bin whose top key reaches min_p's bar
                    top_key = (((prefix << 12) + d + 1) << SH) - 1 - (1 << (KEY_BITS - 1))
                    w_top = _tl_weights(_scaled(_key_value(top_key, SHIFT), inv_t), x_max)
                    bar = min_p.to(tl.float64) * 4294967296.0
                    first = tl.maximum(first, tl.min(tl.where(w_top.to(tl.float64) >= bar, d, NBINS - 1), axis=0))
                # the window: WINDOW keys from bin first up (whole bins); level 0 of 2: bin first alone
                top: tl.constexpr = (WINDOW >> SH) if FINAL else 1
                tl.store(win_ptr + row, ((prefix << 12) + first).to(tl.int32))
                tl.store(above_ptr + row, above + tl.sum(tl.where(d >= first + top, wsum, 0), axis=0))
                if not FINAL:  # the next level's bins
                    tl.store(wsum_ptr + row * NBINS + d, tl.zeros([NBINS], tl.int64))


@triton.jit
def _window_kernel(
    logits_ptr, temp_ptr, topk_ptr, topp_ptr, minp_ptr,  # as _threshold_kernel
    tau_ptr,  # [B*(K+1)] fp32: the threshold of each row flagged in need_ptr, out
    need_ptr, flag_ptr, kmax_ptr, mass_ptr, hist_ptr,  # as _bins_kernel; kernels 1 and 2's state, reset here (CAND)
    wsum_ptr, ctr_ptr, win_ptr, above_ptr,  # _bins_kernel's (wsum reset here)
    wcnt_ptr,  # [rows, WINDOW] int32 zeros on entry: the window's entries key by key
    stride_lb, stride_lj, R, V, rows,
    HAS_K: tl.constexpr, HAS_P: tl.constexpr, HAS_M: tl.constexpr, SHIFT: tl.constexpr,
    BLOCK_V: tl.constexpr,  # the tile over the row
    NBINS: tl.constexpr,
    SPREAD: tl.constexpr,  # _bins_kernel ran (CAND)
    LEVELS: tl.constexpr,  # _bins_kernel's levels: 1, or 2 for 32-bit keys (SPREAD)
    CAND: tl.constexpr,  # kernels 1-3 ran with their workspace
    LISTED: tl.constexpr,  # as _bins_kernel's (CAND only)
    SPREAD_ROWS: tl.constexpr,
    NP: tl.constexpr = 8,
    PDL: tl.constexpr = 0,
):
    """The threshold of each flagged row (its candidates overflowed the buffer or weighed less
    than top_p of the row; with CAND False every filtering row). A row _bins_kernel took has its
    window's entries counted key by key, and its last program finds the exact threshold from
    them: the weight over the window plus each key's count times its weight. Rows with top_k, rows
    whose min_p cut lies past the window, and rows not spread take the one-program search over the
    whole row (_row_tau) instead. That program also leaves the row's workspace as the next call
    expects it."""
    _pdl_wait(PDL)
    row, s, splits, spread_call, t0, t1 = _share(flag_ptr, need_ptr, rows, V, LISTED, SPREAD, SPREAD_ROWS,
                                                 BLOCK_V)
    if row >= 0:
        b, active, inv_t, k, use_k, top_p, min_p = _row_filters(row, temp_ptr, topk_ptr, topp_ptr, minp_ptr, R, V,
                                                                HAS_K, HAS_P, HAS_M)
        KEY_BITS: tl.constexpr = 32 - SHIFT
        BIN_SHIFT: tl.constexpr = KEY_BITS - 12 * LEVELS  # the last level's bins
        row_ptr = logits_ptr + b * stride_lb + (row % R) * stride_lj
        d = tl.arange(0, WINDOW)
        spread = spread_call & ~use_k
        key_lo = tl.zeros_like(row)
        last = s == 0  # a row not spread is searched by its first program alone
        if spread:
            key_lo = (tl.load(win_ptr + row, cache_modifier=".cg").to(tl.int64) << BIN_SHIFT) - (1 << (KEY_BITS - 1))
            offs0 = tl.arange(0, BLOCK_V)
            cnt = tl.zeros([WINDOW], tl.int32)
            for t in range(t0, t1):
                offs = t * BLOCK_V + offs0
                key = _keys(tl.load(row_ptr + offs, mask=offs < V, other=float("-inf")).to(tl.float32), SHIFT)
                cnt += tl.histogram((key - key_lo).to(tl.int32), WINDOW,
                                    mask=(offs < V) & (key >= key_lo) & (key < key_lo + WINDOW))
            tl.atomic_add(wcnt_ptr + row * WINDOW + d, cnt, mask=cnt > 0, sem="relaxed")
            last = last_to_finish(ctr_ptr + row, splits)
        if last:
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
                tau, _, _ = _row_tau(row_ptr, V, kmin, kmax_w, k, use_k, top_p, min_p, inv_t, tl.zeros_like(k) - 1,
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
    1-3's (kmax, mass, hist, the flagged rows' count and list) or None (every filtering row flagged,
    no candidates)."""
    b, r, v = target_logits.shape
    rows = b * r
    spread = state is not None
    levels = 1 if flags["SHIFT"] >= 12 else 2  # keys of at most 20 bits: a window holds whole bins
    ws = _spread_workspace(target_logits.device, rows) if spread else None
    ctr = counters(target_logits.device, rows) if spread else None
    spread = ws is not None and ctr is not None  # else one program a row (inside a capture that would allocate)
    wsum, win, above, wcnt = ws if spread else (tau,) * 4  # valid pointers, unused
    kmax, mass, hist, flagged = state if state is not None else (tau,) * 4
    args = (target_logits.stride(0), target_logits.stride(1), r, v, rows)
    # a few rows: each its own programs (a split of the row each), as many as the flagged ones could
    # use; more: the flagged rows shared out at run time (a list read first: ~6 us at B = 1, H100)
    listed = state is not None and rows > STATIC_ROWS
    if listed:
        grid = (max(SPREAD_PROGRAMS, rows),)  # no fewer than rows: one program a row unspread
    else:
        tiles = triton.cdiv(v, block_v)
        grid = (rows, triton.cdiv(tiles, triton.cdiv(tiles, max(1, min(tiles, SPREAD_PROGRAMS // rows))))
                if spread else 1)
    for level in range(levels if spread else 0):  # listed: spread rows only, at most SPREAD_ROWS (its splits
        # need not match kernel 5's)
        _bins_kernel[(max(SPREAD_PROGRAMS, SPREAD_ROWS),) if listed else grid](
            target_logits, temperature, *filters, need, flagged, kmax, mass, wsum, ctr, win, above, *args,
            BLOCK_V=block_v, NBINS=NBINS, LISTED=listed, SPREAD_ROWS=SPREAD_ROWS, LEVEL=level,
            FINAL=level == levels - 1, **flags, **launch)
    _window_kernel[grid](target_logits, temperature, *filters, tau, need, flagged, kmax, mass, hist, wsum,
                         ctr if spread else tau, win, above, wcnt, *args, BLOCK_V=block_v, NBINS=NBINS,
                         SPREAD=spread, LEVELS=levels, CAND=state is not None, LISTED=listed,
                         SPREAD_ROWS=SPREAD_ROWS, **flags, **launch)
