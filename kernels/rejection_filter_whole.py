"""The filters' search over a whole row (kernels 4 and 5 of kernels/rejection_filter.py), for the
rows the threshold kernel flags: their candidates overflowed the buffer or weighed less than top_p
of the row. Up to STATIC_ROWS rows, each row has programs of its own, one a split of it. Past that,
the kernels run on at least SPREAD_PROGRAMS programs and at least one a row, and share the flagged
rows out among them at run time from the threshold kernel's list, each row split over as many
programs as divide among them. So one flat row in a large batch gets the whole grid, and a call
that flags nothing costs launches whose programs read one count and exit.
  4. _pivot_kernel, PASSES launches (by the keys' width), spread rows without top_k (top_p and
     min_p only): each split sums its entries' weights at NP pivot keys spread over the range
     that holds top_p's threshold; the next launch's programs add the splits' sums up and narrow
     the range to the gap between two pivots (every program of the row alike: no atomics, no
     counters). The first pass starts from the row's lowest live key and also finds, per split,
     the lowest key weighing min_p's bar.
  5. _window_kernel: the last pass's sums narrow the range to at most WINDOW keys, whose entries
     are counted key by key; the row's last program finds the exact threshold from them (the
     weight over the window plus count times weight per key) and min_p's from the splits' lowest
     keys. Rows it cannot take (top_k, a range still wider than the window) get _row_tau over the
     whole row in one program instead.
Apart from the threshold kernel, which every filtered row runs, so that their tiles over the row
do not set its registers. Pivots, not a weight histogram by key bin: its int64 atomics per entry
contended as flagged rows grew.
"""

import torch
import triton
import triton.language as tl
from graphrt.kernels.counters import counters, last_to_finish, shared_workspace
from graphrt.kernels.rejection_filter_select import (
    _key_range,
    _key_value,
    _keys,
    _narrow,
    _pivots,
    _reset_row,
    _row_filters,
    _row_tau,
    _tl_weights,
)
from graphrt.kernels.rejection_kernels import _INT32_MAX, _NEG_INF, _pdl_wait, _scaled
from graphrt.kernels.rejection_reference import LOG2E_F32, W_BITS

WINDOW = tl.constexpr(256)  # the keys kernel 5 counts one by one (tl.histogram costs ~bins / 32 a warp's entry)
MAX_SPLITS = tl.constexpr(32)  # programs a row at most (kernel 4's sums: [rows, 2, MAX_SPLITS, NP])
SPREAD_PROGRAMS = 256  # programs per launch (at least): most exit at once on most calls
STATIC_ROWS = 8  # up to this many rows (B = 2 at K = 3), each row has programs of its own
PIVOT_SUMS = 8192  # kernel 4's [entries a step, NP] int64 sums per program (entries: at most a tile)
_LIVE_Z = tl.constexpr(W_BITS + 1.0)  # under x_max by this many log2 units nothing weighs (with a margin)
_TL_LOG2E = tl.constexpr(LOG2E_F32)


# (pivots a pass, passes) by the keys' low zero bits (bf16, fp16, fp32): the passes narrow a row's
# live keys (those that weigh anything) to WINDOW. bf16 rows span at most ~35k live keys, fp16 ~80k,
# fp32 ~2.6e9 (more only at temperatures past 1e30, which the one-program search then takes)
SEARCH_PLANS = {16: (16, 2), 13: (16, 3), 0: (32, 5)}
_MAX_NP = max(n for n, _ in SEARCH_PLANS.values())


@triton.jit
def _share(flag_ptr, need_ptr, rows, V, LISTED: tl.constexpr, BLOCK_V: tl.constexpr):
    """This program's share of the flagged rows, the same rule in kernels 4 and 5 (launched on the
    same grid): (row, split, splits, first tile, end tile), row -1 for none; a split's tiles of
    BLOCK_V are [first, end) of the row's. LISTED: from the threshold kernel's list (flag_ptr:
    count, then rows), split s of the f-th flagged row going to program f * splits + s, each row in
    as many splits as divide among the grid (at most MAX_SPLITS, one a tile). Else program (p, s)
    takes split s of row p if need_ptr flags it."""
    p = tl.program_id(0)
    tiles = tl.cdiv(V, BLOCK_V)
    if LISTED:
        nflag = tl.load(flag_ptr)
        splits = tl.maximum(tl.minimum(tl.minimum(tl.num_programs(0) // tl.maximum(nflag, 1), tiles), MAX_SPLITS), 1)
        f = p // splits
        s = p - f * splits
        row = tl.load(flag_ptr + 1 + f, mask=f < nflag, other=-1)
    else:
        s = tl.program_id(1)
        splits = tl.num_programs(1)
        row = tl.where(tl.load(need_ptr + p, mask=p < rows, other=0) != 0, p, -1)
    per_split = tl.cdiv(tiles, splits)
    return row.to(tl.int64), s, splits, s * per_split, tl.minimum((s + 1) * per_split, tiles)


@triton.jit
def _narrowed(row, slot, state_ptr, above_ptr, part_ptr, splits, target, NP: tl.constexpr):
    """(lo, hi, above) of the search after the pass whose state is in slot: the range that pass
    searched, narrowed at its pivots by its splits' sums unless it spanned at most WINDOW keys (it
    took no sums then). above = the weight of the keys over hi."""
    lo = tl.load(state_ptr + row * 4 + slot * 2).to(tl.int64)
    hi = tl.load(state_ptr + row * 4 + slot * 2 + 1).to(tl.int64)
    above = tl.load(above_ptr + row * 2 + slot)
    if hi - lo >= WINDOW:
        sp = tl.arange(0, MAX_SPLITS)[:, None]
        acc = tl.sum(tl.load(part_ptr + ((row * 2 + slot) * MAX_SPLITS + sp) * NP + tl.arange(0, NP)[None, :],
                             mask=sp < splits, other=0), axis=0)
        ok = acc.to(tl.float64) >= target
        above = tl.max(tl.where(ok, above, acc), axis=0)  # S at the lowest failing pivot
        lo, hi = _narrow(_pivots(lo, hi, NP), ok, lo, hi)
    return lo, hi, above


@triton.jit
def _pivot_kernel(
    logits_ptr, temp_ptr, topk_ptr, topp_ptr, minp_ptr,  # as _threshold_kernel
    need_ptr,  # [B*(K+1)] int32: _threshold_kernel's flags
    flag_ptr,  # [1 + rows] int32: _threshold_kernel's count and list of the flagged rows
    kmax_ptr,  # [rows] int32: the row's largest key (kernel 1's, kept for flagged rows)
    mass_ptr,  # [rows] int64: the row's weight (kernel 2's; top_p rows)
    part_ptr,  # [rows, 2, MAX_SPLITS, NP] int64 out: each split's weight at or over each pivot (by pass parity)
    state_ptr,  # [rows, 2, 2] int32 out: the range [lo, hi] this pass searched (by parity)
    above_ptr,  # [rows, 2] int64 out: the weight over that range
    mins_ptr,  # [rows, MAX_SPLITS] int32 out (PASS 0, min_p rows): each split's lowest key weighing min_p's bar
    stride_lb, stride_lj, R, V, rows,
    HAS_K: tl.constexpr, HAS_P: tl.constexpr, HAS_M: tl.constexpr, SHIFT: tl.constexpr,
    BLOCK_V: tl.constexpr,  # a split's tiles
    LISTED: tl.constexpr,  # the flagged rows shared out from the list (else a program a row and split)
    NP: tl.constexpr,
    PASS: tl.constexpr,
    STEP: tl.constexpr,  # entries a step (BLOCK_V a multiple)
    PDL: tl.constexpr = 0,
):
    """A pass of the spread whole-row search, for each flagged row without top_k (top_p and min_p
    only: a flat row whose kept entries overflow the candidates). S(v), the weight of the row's
    entries with key >= v, falls as v rises; top_p's threshold is the largest v with S(v) >= top_p
    of the row's weight. The range [lo, hi] holds it with S(lo) >= that; this pass narrows the
    last pass's range by its sums (pass 0: from the lowest live key to the row's max) and, while
    it spans more than WINDOW keys, sums S at NP pivots over it in each split."""
    _pdl_wait(PDL)
    row, s, splits, t0, t1 = _share(flag_ptr, need_ptr, rows, V, LISTED, BLOCK_V)
    if row >= 0:
        b, active, inv_t, k, use_k, top_p, min_p = _row_filters(row, temp_ptr, topk_ptr, topp_ptr, minp_ptr, R, V,
                                                                HAS_K, HAS_P, HAS_M)
        if ~use_k:
            kmax = tl.load(kmax_ptr + row).to(tl.int64)
            x_max = _scaled(_key_value(kmax, SHIFT), inv_t)
            if PASS == 0:  # nothing under the lowest live key weighs anything: S there is the row's weight
                floor = x_max - _LIVE_Z / _TL_LOG2E - tl.abs(x_max) * 1e-6  # margins over fp32's rounding
                floor = (floor / inv_t).to(tl.float32)
                floor -= tl.abs(floor) * 1e-6
                lo = tl.minimum(_keys(floor, SHIFT), kmax)
                hi = kmax
                if top_p >= 1.0:  # min_p alone: no search
                    lo = kmax
                above = tl.zeros_like(kmax)
            else:
                target = top_p.to(tl.float64) * tl.load(mass_ptr + row).to(tl.float64)
                lo, hi, above = _narrowed(row, (PASS - 1) % 2, state_ptr, above_ptr, part_ptr, splits, target, NP)
            slot: tl.constexpr = PASS % 2
            if s == 0:
                tl.store(state_ptr + row * 4 + slot * 2, lo.to(tl.int32))
                tl.store(state_ptr + row * 4 + slot * 2 + 1, hi.to(tl.int32))
                tl.store(above_ptr + row * 2 + slot, above)
            search = hi - lo >= WINDOW
            mins = (PASS == 0) & (min_p > 0.0)
            if search | mins:
                row_ptr = logits_ptr + b * stride_lb + (row % R) * stride_lj
                piv = _pivots(lo, hi, NP).to(tl.int32)
                bar = min_p.to(tl.float64) * 4294967296.0
                # [NP, STEP]: a thread's entries and all NP sums of them in its own registers (as
                # [STEP, NP] the layout spread the pivots over lanes, and every step went through
                # shared memory)
                acc = tl.zeros([NP, STEP], tl.int64)
                low = tl.full([STEP], _INT32_MAX, tl.int32)
                offs0 = tl.arange(0, STEP)
                STEPS: tl.constexpr = BLOCK_V // STEP
                nxt = tl.load(row_ptr + t0 * BLOCK_V + offs0, mask=t0 * BLOCK_V + offs0 < tl.where(t0 < t1, V, 0),
                              other=float("-inf"))
                for t in range(t0 * STEPS, t1 * STEPS):
                    offs = t * STEP + offs0
                    raw = nxt.to(tl.float32)
                    # the next step's entries load while these are summed
                    nxt = tl.load(row_ptr + offs + STEP, mask=offs + STEP < tl.where(t + 1 < t1 * STEPS, V, 0),
                                  other=float("-inf"))
                    key = _keys(raw, SHIFT).to(tl.int32)
                    w = tl.where(offs < V, _tl_weights(_scaled(raw, inv_t), x_max), 0)
                    if search:  # int32 keys: as int64 the compare took twice the registers. A select
                        # last, not an add: on `acc += where(...)` the compiler spread the pivots over
                        # warps to make the final sum thread-local, at a shared-memory trip a step
                        acc = tl.where(key[None, :] >= piv[:, None], acc + w[None, :], acc)
                    if mins:
                        low = tl.minimum(low, tl.where((w > 0) & (w.to(tl.float64) >= bar), key, _INT32_MAX))
                if search:
                    tl.store(part_ptr + ((row * 2 + slot) * MAX_SPLITS + s) * NP + tl.arange(0, NP),
                             tl.sum(acc, axis=1))
                if mins:
                    tl.store(mins_ptr + row * MAX_SPLITS + s, tl.min(low, axis=0))


@triton.jit
def _window_kernel(
    logits_ptr, temp_ptr, topk_ptr, topp_ptr, minp_ptr,  # as _threshold_kernel
    tau_ptr,  # [B*(K+1)] fp32: the threshold of each row flagged in need_ptr, out
    need_ptr, flag_ptr, kmax_ptr, mass_ptr, hist_ptr,  # as _pivot_kernel; kernels 1 and 2's state, reset here (CAND)
    part_ptr, state_ptr, above_ptr, mins_ptr, ctr_ptr,  # _pivot_kernel's; counters(), a slot per row
    wcnt_ptr,  # [rows, WINDOW] int32 zeros on entry: the window's entries key by key (reset here)
    stride_lb, stride_lj, R, V, rows,
    HAS_K: tl.constexpr, HAS_P: tl.constexpr, HAS_M: tl.constexpr, SHIFT: tl.constexpr,
    BLOCK_V: tl.constexpr,  # the tile over the row
    SPREAD: tl.constexpr,  # _pivot_kernel ran (CAND)
    PASSES: tl.constexpr,  # its launches (SPREAD)
    NP_SPREAD: tl.constexpr,  # its pivots (SPREAD)
    CAND: tl.constexpr,  # kernels 1-3 ran with their workspace
    LISTED: tl.constexpr,  # as _pivot_kernel's (CAND only)
    NP: tl.constexpr = 8,
    PDL: tl.constexpr = 0,
):
    """The threshold of each flagged row (its candidates overflowed the buffer or weighed less
    than top_p of the row; with CAND False every filtering row). A row _pivot_kernel took has the
    entries of its last range counted key by key, and its last program finds the exact threshold
    from them: the weight over the range plus each key's count times its weight; min_p's cut is
    the splits' lowest key weighing its bar, and the threshold the higher of the two. Rows with
    top_k, rows whose range is still wider than WINDOW, and rows not spread take the one-program
    search over the whole row (_row_tau) instead. That program also leaves the row's workspace as
    the next call expects it."""
    _pdl_wait(PDL)
    row, s, splits, t0, t1 = _share(flag_ptr, need_ptr, rows, V, LISTED, BLOCK_V)
    if row >= 0:
        b, active, inv_t, k, use_k, top_p, min_p = _row_filters(row, temp_ptr, topk_ptr, topp_ptr, minp_ptr, R, V,
                                                                HAS_K, HAS_P, HAS_M)
        row_ptr = logits_ptr + b * stride_lb + (row % R) * stride_lj
        d = tl.arange(0, WINDOW)
        spread = SPREAD & ~use_k
        last = s == 0  # a row not spread is searched by its first program alone
        fits = row < 0
        kmax = row * 0
        target = top_p.to(tl.float64)
        above = row * 0
        key_lo = row * 0
        if SPREAD:  # compiled out without the search's buffers (placeholders then)
            if spread:
                kmax = tl.load(kmax_ptr + row).to(tl.int64)
                target = top_p.to(tl.float64) * tl.load(mass_ptr + row).to(tl.float64)
                lo, hi, above = _narrowed(row, (PASSES - 1) % 2, state_ptr, above_ptr, part_ptr, splits, target,
                                          NP_SPREAD)
                fits = (top_p < 1.0) & (hi - lo < WINDOW)
                key_lo = hi - WINDOW + 1  # the window ends at hi, whose weight above is known
                if fits:
                    offs0 = tl.arange(0, BLOCK_V)
                    cnt = tl.zeros([WINDOW], tl.int32)
                    for t in range(t0, t1):
                        offs = t * BLOCK_V + offs0
                        key = _keys(tl.load(row_ptr + offs, mask=offs < V, other=float("-inf")).to(tl.float32), SHIFT)
                        cnt += tl.histogram((key - key_lo).to(tl.int32), WINDOW,
                                            mask=(offs < V) & (key >= key_lo) & (key <= hi))
                    tl.atomic_add(wcnt_ptr + row * WINDOW + d, cnt, mask=cnt > 0, sem="relaxed")
                # every split, counting or not: the last has read kmax and mass in all of them before it resets them
                last = last_to_finish(ctr_ptr + row, splits)
        if last:
            tau = tl.zeros_like(inv_t) + _NEG_INF
            found = row < 0
            if SPREAD:
                if spread:
                    found = row >= 0
                    tau_key = tl.zeros_like(kmax) - _INT32_MAX
                    if top_p < 1.0:  # the largest key v with the weight from v up >= top_p of the row's
                        found = fits
                        if fits:
                            x_max = _scaled(_key_value(kmax, SHIFT), inv_t)
                            wcnt = tl.load(wcnt_ptr + row * WINDOW + d, cache_modifier=".cg").to(tl.int64)
                            val = wcnt * _tl_weights(_scaled(_key_value(key_lo + d, SHIFT), inv_t), x_max)
                            s_from = above + tl.sum(val, axis=0) - tl.cumsum(val, axis=0) + val
                            tau_key = key_lo + tl.max(tl.where(s_from.to(tl.float64) >= target, d, -1), axis=0)
                            tl.store(wcnt_ptr + row * WINDOW + d, tl.zeros([WINDOW], tl.int32))
                    if min_p > 0.0:  # the lowest key present that weighs min_p's bar (the row's max does)
                        sp = tl.arange(0, MAX_SPLITS)
                        low = tl.min(tl.load(mins_ptr + row * MAX_SPLITS + sp, mask=sp < splits, other=_INT32_MAX),
                                     axis=0).to(tl.int64)
                        found = found & (low < _INT32_MAX)
                        tau_key = tl.maximum(tau_key, low)
                    tau = _key_value(tl.minimum(tau_key, kmax), SHIFT)
            if ~found:
                kmin, kmax_w = _key_range(row_ptr, V, SHIFT, BLOCK_V)
                tau, _, _ = _row_tau(row_ptr, V, kmin, kmax_w, k, use_k, top_p, min_p, inv_t, tl.zeros_like(k) - 1,
                                     tau_ptr, tau_ptr, need_ptr, False, SHIFT, BLOCK_V, BLOCK_V, NP, 1)
            tl.store(tau_ptr + row, tau)
            if CAND:
                _reset_row(kmax_ptr, mass_ptr, hist_ptr, row)


_spread_workspaces: dict[torch.device, tuple[torch.Tensor, ...]] = {}


def _spread_workspace(dev: torch.device, rows: int) -> tuple[torch.Tensor, ...] | None:
    """The spread search's state (kernels 4 and 5): the splits' sums at the pivots [rows', 2 *
    MAX_SPLITS * _MAX_NP] int64, the ranges [rows', 4] int32, the weights over them [rows', 2] int64, the
    splits' lowest keys for min_p [rows', MAX_SPLITS] int32 (each written before it is read), and
    the window's counts [rows', WINDOW] int32 zeros (each row's last program zeroes what it used);
    one per device, rows' >= rows (counters.shared_workspace: None inside a capture that would have
    to grow it)."""
    return shared_workspace(_spread_workspaces, dev, rows, lambda n: (
        torch.empty((n, 2 * MAX_SPLITS.value * _MAX_NP), dtype=torch.int64, device=dev),
        torch.empty((n, 4), dtype=torch.int32, device=dev), torch.empty((n, 2), dtype=torch.int64, device=dev),
        torch.empty((n, MAX_SPLITS.value), dtype=torch.int32, device=dev),
        torch.zeros((n, WINDOW.value), dtype=torch.int32, device=dev)))


def whole_row_search(target_logits, temperature, filters, tau, need, state, *, block_v: int, flags: dict,
                     launch: dict) -> None:
    """Kernels 4 and 5 on the rows flagged in need ([B*(K+1)] int32), writing their thresholds to
    tau; target_logits [B, K+1, V], temperature and filters as thresholds_triton's. state: kernels
    1-3's (kmax, mass, hist, the flagged rows' count and list) or None (every filtering row flagged,
    no candidates)."""
    b, r, v = target_logits.shape
    rows = b * r
    # these launches release their dependents as they start (PDL 1, where PDL is on): most calls flag
    # no row, and an empty program's exit would otherwise hold up the next launch
    flags = dict(flags, PDL=min(flags["PDL"], 1))
    ws = _spread_workspace(target_logits.device, rows) if state is not None else None
    ctr = counters(target_logits.device, rows) if state is not None else None
    spread = ws is not None and ctr is not None  # else one program a row (inside a capture that would allocate)
    part, ranges, above, mins, wcnt = ws if spread else (tau,) * 5  # valid pointers, unused
    kmax, mass, hist, flagged = state if state is not None else (tau,) * 4
    args = (target_logits.stride(0), target_logits.stride(1), r, v, rows)
    np_, passes = SEARCH_PLANS[flags["SHIFT"]]
    # the interpreter runs programs one after another: on the CPU a few serve as well as many
    programs = SPREAD_PROGRAMS if target_logits.is_cuda else min(SPREAD_PROGRAMS, 64)
    # a few rows: each its own programs (a split of the row each), as many as the flagged ones could
    # use; more: the flagged rows shared out at run time (the list costs two dependent reads before a row's first tile)
    listed = spread and rows > STATIC_ROWS
    if listed:
        grid = (max(programs, rows),)  # no fewer than rows: one program a row at least
    else:
        tiles = triton.cdiv(v, block_v)
        grid = (rows, triton.cdiv(tiles, triton.cdiv(tiles, max(1, min(tiles, MAX_SPLITS.value, programs // rows))))
                if spread else 1)
    for p in range(passes if spread else 0):
        _pivot_kernel[grid](target_logits, temperature, *filters, need, flagged, kmax, mass, part, ranges, above,
                            mins, *args, BLOCK_V=block_v, LISTED=listed, NP=np_, PASS=p,
                            STEP=min(block_v, PIVOT_SUMS // np_), **flags, **launch)
    _window_kernel[grid](target_logits, temperature, *filters, tau, need, flagged, kmax, mass, hist, part, ranges,
                         above, mins, ctr if spread else tau, wcnt, *args, BLOCK_V=block_v, SPREAD=spread,
                         PASSES=passes, NP_SPREAD=np_, CAND=state is not None, LISTED=listed, **flags, **launch)
