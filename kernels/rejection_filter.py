"""The filters' per-row thresholds on the GPU, without sorting: the rule (top_k, top_p, min_p) and
its reference, thresholds_reference, are in kernels/rejection_reference.py. No [rows, V] buffer and
no sort; rows that filter nothing return at once in every kernel.

Up to five launches, all but the third spread over many programs per row:
  1. _filter_stats_kernel, grid (rows, tiles): the row's largest key (atomic max), and the max of
     each GROUP-entry group and of each SUPER-group supergroup (buffers in the logits' dtype).
     One read of the row and no compaction: on the H200 a gather inside this streaming pass, in
     every form tried, cost several times the read itself.
  2. _filter_weigh_kernel, grid (rows, splits), top_p rows without top_k only: the row's exact
     weight (relative to its max, fixed point) and a histogram of its entries by half-octave of
     weight.
  3. _threshold_kernel, grid rows: the groups that may hold a kept entry (_group_bar: top_k: from
     the k-th largest supergroup max up, since k entries reach it and the row's top k all lie in
     groups whose max does; top_p: from the highest histogram bin under which the row weighs at
     most 1 - top_p; min_p alone: over its bar), found supergroup first, have their entries
     copied to a per-row candidate buffer (_group_candidates); then the exact threshold over them
     (_row_tau), bit for bit the reference's: a radix select over the order-preserving integer
     keys (_select), top_k's from the supergroup bar up. What top_k keeps (a few dozen of the
     candidates) is copied to a buffer of its own (_compact), and top_p and min_p read only that.
     A row whose candidates overflow the buffer, or weigh less than top_p of the row, is flagged
     for kernels 4 and 5 instead. It also resets the workspace rows it used, which every call and
     graph replay shares (_workspace); kernel 5 resets a flagged row's.
     With Draws (the one-hot sampler), a sampled row whose threshold came from its candidates is
     also drawn there (_candidate_draws): every entry the filter keeps is a candidate, so once
     those are copied out (_compact) the kept row's lse, its argmax, the draft's x and the
     two-level race (same keys, bit for bit, as the whole-row race's: counter-based bits by vocab
     id) need nothing else of the row.
  4. _bins_kernel, grid (rows, splits), flagged rows without top_k (bf16 and fp16 logits): the
     row's entries counted and weighed by key bin (4096 bins); its last program picks the window of
     256 keys that holds the threshold (top_p's crossing bin, or min_p's if higher).
  5. _window_kernel, grid (rows, splits), flagged rows: the window's entries counted key by key;
     the row's last program finds the exact threshold from them (the weight over the window plus
     count times weight per key). Rows it cannot take (top_k, fp32 keys, a min_p cut past the
     window) get _row_tau over the whole row in that program instead. The other rows' programs
     exit at once. Kernels 4 and 5 stand apart from kernel 3, which every filtered row runs, so
     that their tiles over the row do not set its registers.
The sampler then reads the thresholds (tau [B*(K+1)] fp32) in its row pass, its walk and full q's
race; its row pass skips the rows drawn here, and its walk takes their results (Draws.stats_i,
stats_f) instead of the planes'.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from graphrt.kernels.counters import capturing
from graphrt.kernels.rejection_kernels import (
    _INT32_MAX,
    _NEG_INF,
    _chunk_race,
    _inv_temperature,
    _pdl_wait,
    _race_result,
    _scaled,
)
from graphrt.kernels.rejection_reference import LOG2E_F32, POLY, W_BITS
from graphrt.kernels.rng import tl_race_gumbel, tl_race_key

_TL_W = tl.constexpr(W_BITS)
_TL_LOG2E_F32 = tl.constexpr(LOG2E_F32)
_C1, _C2, _C3, _C4, _C5 = (tl.constexpr(c) for c in POLY)
_KEY_SHIFT = {torch.bfloat16: 16, torch.float16: 13, torch.float32: 0}  # always-zero low bits
FILTER_CAP = 4096  # candidates a row keeps for the exact pass; past that the pass reads the row
GROUP = 16  # entries per group: kernel 1 keeps each group's max, kernel 3 takes candidates by whole groups
SUPER = 16  # groups per supergroup (at most): kernel 3 finds top_k's bar and the groups to take from their maxima
NBINS = 4096  # the spread whole-row search's key bins (kernel 4)
WINDOW = tl.constexpr(256)  # the keys its second level (kernel 5) counts one by one
SPREAD_ROWS = 32  # up to this many rows a call spreads the whole-row search; past it, one program a row
SPREAD_PROGRAMS = 256  # the spread search's programs per call, about


# ---------------------------------------------------------------------------------------------
# Triton
# ---------------------------------------------------------------------------------------------


@triton.jit
def _tl_weights(x, x_max):
    """weights() in Triton: the same fp32 ops in the same order (launch without FMA contraction)."""
    z = (x - x_max) * _TL_LOG2E_F32
    live = z >= -_TL_W
    n = tl.floor(tl.where(live, z, 0.0))
    f = tl.where(live, z, 0.0) - n
    p = 1.0 + f * (_C1 + f * (_C2 + f * (_C3 + f * (_C4 + f * _C5))))
    p = tl.minimum(p, 2.0)
    scale = ((n.to(tl.int32) + _TL_W + 127) << 23).to(tl.float32, bitcast=True)  # 2**(W + n), exact
    return tl.where(live, tl.floor(p * scale).to(tl.int64), 0)


@triton.jit
def _keys32(raw):
    """Order-preserving int32 keys of fp32 values (NaN as -inf, -0.0 as +0.0): equal keys <=> equal
    values."""
    raw = tl.where(raw != raw, _NEG_INF, raw) + 0.0
    bits = raw.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, -(bits & 0x7FFFFFFF), bits)


@triton.jit
def _keys(raw, SHIFT: tl.constexpr):
    """_keys32 as int64 without the low SHIFT bits, which the logits' dtype always leaves zero."""
    return (_keys32(raw) >> SHIFT).to(tl.int64)


@triton.jit
def _key_value(key, SHIFT: tl.constexpr):
    k = (key << SHIFT).to(tl.int32)
    return tl.where(k < 0, (-k) | -2147483648, k).to(tl.float32, bitcast=True)


@triton.jit
def _select(row_ptr, V, lo, hi, target, x_max, inv_t, MASS: tl.constexpr, SHIFT: tl.constexpr,
            BLOCK_V: tl.constexpr, NP: tl.constexpr):
    """The largest key v in [lo, hi] with S(v) >= target, given S(lo) >= target; S(v) = the count
    (MASS: the weight) of the row's entries with key >= v, hi = the row's largest key.

    A radix select, one pass over the row a level: the keys in [lo, hi] fall in 256 bins of
    2**sh keys (tl.histogram counts them), the bin where S crosses the target becomes [lo, hi].
    Counts need nothing else; a bin's weight is its count times its key's weight only once bins are
    single keys, so MASS first narrows a wider range by pivots (S summed at NP keys per pass, the
    gap between two of them kept) until it spans at most 256 keys. above = S(hi + 1), carried."""
    d = tl.arange(0, 256)
    i = tl.arange(0, NP).to(tl.int64)
    offs0 = tl.arange(0, BLOCK_V)
    above = tl.zeros_like(lo)
    while lo < hi:
        wide = hi < lo  # False; MASS: whether the range spans more than 256 keys
        if MASS:
            wide = hi - lo >= 256
        if wide:
            piv = lo + 1 + ((hi - lo - 1) * i) // (NP - 1)  # lo + 1 ... hi, non-decreasing
            acc = tl.zeros([NP], tl.int64)
            for t in range(0, tl.cdiv(V, BLOCK_V)):
                offs = t * BLOCK_V + offs0
                raw = tl.load(row_ptr + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
                ge = (_keys(raw, SHIFT)[:, None] >= piv[None, :]) & (offs < V)[:, None]
                acc += tl.sum(tl.where(ge, _tl_weights(_scaled(raw, inv_t), x_max)[:, None], 0), axis=0)
            ok = acc.to(tl.float64) >= target
            above = tl.max(tl.where(ok, above, acc), axis=0)  # S at the lowest failing pivot
            lo = tl.maximum(lo, tl.max(tl.where(ok, piv, lo), axis=0))
            hi = tl.minimum(hi, tl.min(tl.where(ok, hi, piv - 1), axis=0))
        else:
            sh = tl.zeros_like(lo)
            while ((hi - lo) >> sh) >= 256:
                sh += 1
            hist = tl.zeros([256], tl.int32)
            for t in range(0, tl.cdiv(V, BLOCK_V)):
                offs = t * BLOCK_V + offs0
                key = _keys(tl.load(row_ptr + offs, mask=offs < V, other=float("-inf")).to(tl.float32), SHIFT)
                inr = (offs < V) & (key >= lo) & (key <= hi)
                hist += tl.histogram(((key - lo) >> sh).to(tl.int32), 256, mask=inr)
            val = hist.to(tl.int64)
            if MASS:  # single-key bins here
                val *= _tl_weights(_scaled(_key_value(lo + d, SHIFT), inv_t), x_max)
            s = above + tl.sum(val, axis=0) - tl.cumsum(val, axis=0) + val  # S at each bin's start
            sel = tl.max(tl.where(s.to(tl.float64) >= target, d, 0), axis=0)
            above += tl.sum(tl.where(d > sel, val, 0), axis=0)
            hi = tl.minimum(hi, lo + ((sel + 1).to(tl.int64) << sh) - 1)
            lo = lo + (sel.to(tl.int64) << sh)
    return lo


@triton.jit
def _filters(temp_ptr, topk_ptr, topp_ptr, minp_ptr, R, V, HAS_K: tl.constexpr, HAS_P: tl.constexpr,
             HAS_M: tl.constexpr, PDL: tl.constexpr):
    """Every filter kernel's start: the PDL wait, then this program's row, its request b and b's
    (active, inv_t, k, use_k, top_p, min_p); active: a sampled row that filters."""
    _pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    b = row // R
    greedy, inv_t = _inv_temperature(temp_ptr, b)
    k = tl.zeros_like(b)
    if HAS_K:
        k = tl.load(topk_ptr + b).to(tl.int64)
    top_p = tl.zeros_like(inv_t) + 1.0
    if HAS_P:
        top_p = tl.load(topp_ptr + b)
    min_p = tl.zeros_like(inv_t)
    if HAS_M:
        min_p = tl.load(minp_ptr + b)
    use_k = (k > 0) & (k < V)
    return row, b, ~greedy & (use_k | (top_p < 1.0) | (min_p > 0.0)), inv_t, k, use_k, top_p, min_p


@triton.jit
def _key_range(ptr, N, SHIFT: tl.constexpr, BLOCK_V: tl.constexpr):
    """(lowest, highest) key of the N values at ptr."""
    offs0 = tl.arange(0, BLOCK_V)
    hi = tl.max(tl.full([BLOCK_V], -_INT32_MAX, tl.int64), axis=0)
    lo = -hi
    for t in range(0, tl.cdiv(N, BLOCK_V)):
        offs = t * BLOCK_V + offs0
        key = _keys(tl.load(ptr + offs, mask=offs < N, other=float("-inf")).to(tl.float32), SHIFT)
        lo = tl.minimum(lo, tl.min(tl.where(offs < N, key, _INT32_MAX), axis=0))
        hi = tl.maximum(hi, tl.max(tl.where(offs < N, key, -_INT32_MAX), axis=0))
    return lo, hi


@triton.jit
def _compact(cand_ptr, gid_ptr, n, lo, tau, dst_ptr, dvid_ptr, SHIFT: tl.constexpr, BLOCK_V: tl.constexpr,
             GROUP: tl.constexpr):
    """Copy the n candidates at cand_ptr (whole groups; gid_ptr: their groups) with key >= lo and
    value >= tau (NaN never) to dst_ptr, in vocab order, and their vocab ids to dvid_ptr -> how many.
    Whatever reads them after needs only these, in a tile sized for the few entries a filter keeps."""
    offs0 = tl.arange(0, BLOCK_V)
    m = tl.zeros_like(n)
    for t in range(0, tl.cdiv(n, BLOCK_V)):
        slot = t * BLOCK_V + offs0
        raw = tl.load(cand_ptr + slot, mask=slot < n, other=float("nan"))
        take = (raw >= tau) & (_keys(raw, SHIFT) >= lo)
        pos = m + tl.cumsum(take.to(tl.int32), axis=0) - 1
        vid = tl.load(gid_ptr + slot // GROUP, mask=take, other=0) * GROUP + slot % GROUP
        tl.store(dst_ptr + pos, raw, mask=take)
        tl.store(dvid_ptr + pos, vid, mask=take)
        m += tl.sum(take.to(tl.int32), axis=0)
    return m


@triton.jit
def _mass_tau(src_ptr, n, lo, tau_key, kmax, total, top_p, min_p, inv_t, x_max, SHIFT: tl.constexpr,
              BLOCK_V: tl.constexpr, NP: tl.constexpr):
    """top_p's and min_p's part of _row_tau over the n entries at src_ptr, every entry with key >=
    lo among them: (tau_key raised to their cut, ok). total: the row's weight, or -1 for these
    entries' own (the mass top-k kept); ok is False when they weigh less than top_p of total."""
    offs0 = tl.arange(0, BLOCK_V)
    # the mass kept by top-k, the lowest key that weighs anything, min-p's lowest key
    thr = min_p.to(tl.float64) * 4294967296.0
    mass = tl.zeros([BLOCK_V], tl.int64)
    wmin = tl.full([BLOCK_V], _INT32_MAX, tl.int64)
    mmin = tl.full([BLOCK_V], _INT32_MAX, tl.int64)
    for t in range(0, tl.cdiv(n, BLOCK_V)):
        offs = t * BLOCK_V + offs0
        raw = tl.load(src_ptr + offs, mask=offs < n, other=float("-inf")).to(tl.float32)
        key = _keys(raw, SHIFT)
        w = tl.where((offs < n) & (key >= lo), _tl_weights(_scaled(raw, inv_t), x_max), 0)
        mass += w
        wmin = tl.minimum(wmin, tl.where(w > 0, key, _INT32_MAX))
        mmin = tl.minimum(mmin, tl.where((offs < n) & (w.to(tl.float64) >= thr), key, _INT32_MAX))
    ok = n >= 0
    if top_p < 1.0:
        kept = tl.sum(mass, axis=0)
        total = tl.where(total < 0, kept, total)
        target = top_p.to(tl.float64) * total.to(tl.float64)
        ok = kept.to(tl.float64) >= target
        if ok:
            tau_key = _select(src_ptr, n, tl.maximum(lo, tl.min(wmin, axis=0)), kmax, target, x_max, inv_t, True,
                              SHIFT, BLOCK_V, NP)
    if min_p > 0.0:
        tau_key = tl.maximum(tau_key, tl.min(mmin, axis=0))
    return tau_key, ok


@triton.jit
def _row_tau(src_ptr, n, kmin, kmax, k, use_k, top_p, min_p, inv_t, mass_total, gid_ptr, kept_ptr, kvid_ptr,
             CAND: tl.constexpr, SHIFT: tl.constexpr, BLOCK_V: tl.constexpr, KEPT_BLOCK_V: tl.constexpr,
             NP: tl.constexpr, GROUP: tl.constexpr):
    """(tau, ok) of one row from its n entries at src_ptr, whose keys lie in [kmin, kmax] (those
    at or over the row's top-k cut do), kmax the row's largest: the whole row, or (CAND) its
    candidates (fp32, n >= 0, whole groups, gid_ptr: their groups), a superset of what the filters
    keep; use_k: 0 < k < the row's V. With CAND and top_p without top_k the kept mass is
    mass_total, the row's; ok is False when the candidates weigh less than top_p of it (the caller
    then passes the whole row). n = 0: a dead row. CAND with top_k and top_p or min_p: what top-k
    keeps is copied to kept_ptr / kvid_ptr first (_compact), and top_p and min_p read only that."""
    x_max = _scaled(_key_value(kmax, SHIFT), inv_t)
    tau = tl.zeros_like(inv_t) + _NEG_INF
    ok = n >= 0
    if (n > 0) & (x_max > _NEG_INF):  # a dead row keeps -inf
        lo = kmin
        if use_k:
            lo = _select(src_ptr, n, kmin, kmax, k.to(tl.float64), x_max, inv_t, False, SHIFT, BLOCK_V, NP)
        tau_key = lo
        if (top_p < 1.0) | (min_p > 0.0):
            if CAND:
                if use_k:
                    m = _compact(src_ptr, gid_ptr, n, lo, _NEG_INF, kept_ptr, kvid_ptr, SHIFT, BLOCK_V, GROUP)
                    tau_key, ok = _mass_tau(kept_ptr, m, lo, tau_key, kmax, tl.zeros_like(mass_total) - 1, top_p,
                                            min_p, inv_t, x_max, SHIFT, KEPT_BLOCK_V, NP)
                else:
                    tau_key, ok = _mass_tau(src_ptr, n, lo, tau_key, kmax, mass_total, top_p, min_p, inv_t, x_max,
                                            SHIFT, BLOCK_V, NP)
            else:
                tau_key, ok = _mass_tau(src_ptr, n, lo, tau_key, kmax, tl.zeros_like(mass_total) - 1, top_p, min_p,
                                        inv_t, x_max, SHIFT, BLOCK_V, NP)
        tau = _key_value(tl.minimum(tau_key, kmax), SHIFT)
    return tau, ok


@triton.jit
def _filter_stats_kernel(
    logits_ptr,  # [B, K+1, V] bf16/fp16/fp32, vocab dim contiguous
    temp_ptr, topk_ptr, topp_ptr, minp_ptr,  # [B] fp32, int32/int64, fp32, fp32 (as _threshold_kernel)
    kmax_ptr,  # [rows] int32, -(2**31 - 1) on entry: the row's largest key (atomic max)
    gmax_ptr,  # [rows, NG] the logits' dtype, out: each GROUP-entry group's largest logit (NaN as -inf)
    smax_ptr,  # [rows, NS] the same, out: each SUPER-group supergroup's
    stride_lb, stride_lj, R, V, NG, NS,
    HAS_K: tl.constexpr, HAS_P: tl.constexpr, HAS_M: tl.constexpr, SHIFT: tl.constexpr,
    BLOCK_V: tl.constexpr,  # one tile per program, a multiple of GROUP * SUPER
    GROUP: tl.constexpr,
    SUPER: tl.constexpr,
    PDL: tl.constexpr = 0,
):
    row, b, active, inv_t, k, use_k, top_p, min_p = _filters(temp_ptr, topk_ptr, topp_ptr, minp_ptr, R, V, HAS_K,
                                                             HAS_P, HAS_M, PDL)
    if active:
        NSB: tl.constexpr = BLOCK_V // (GROUP * SUPER)
        sg = tl.program_id(1) * NSB + tl.arange(0, NSB)
        g = sg[:, None] * SUPER + tl.arange(0, SUPER)[None, :]
        offs = g[:, :, None] * GROUP + tl.arange(0, GROUP)[None, None, :]
        raw = tl.load(logits_ptr + b * stride_lb + (row % R) * stride_lj + offs, mask=offs < V,
                      other=float("-inf")).to(tl.float32)
        m = tl.max(tl.where(raw != raw, _NEG_INF, raw), axis=2)  # one of the group's values: exact in its dtype
        tl.store(gmax_ptr + row * NG + g, m.to(gmax_ptr.dtype.element_ty), mask=g < NG)
        ms = tl.max(m, axis=1)
        tl.store(smax_ptr + row * NS + sg, ms.to(smax_ptr.dtype.element_ty), mask=sg < NS)
        tl.atomic_max(kmax_ptr + row, tl.max(_keys32(ms) >> SHIFT, axis=0))


@triton.jit
def _filter_weigh_kernel(
    logits_ptr, temp_ptr, topk_ptr, topp_ptr, minp_ptr, kmax_ptr,  # as _filter_stats_kernel
    mass_ptr,  # [rows] int64 zeros on entry: the row's weight (top_p rows without top_k)
    hist_ptr,  # [rows, 64] int32 zeros on entry: its entries by half-octave of weight (the same rows)
    stride_lb, stride_lj, R, V, tiles_per_split,
    HAS_K: tl.constexpr, HAS_P: tl.constexpr, HAS_M: tl.constexpr, SHIFT: tl.constexpr,
    BLOCK_V: tl.constexpr,
    PDL: tl.constexpr = 0,
):
    row, b, active, inv_t, k, use_k, top_p, min_p = _filters(temp_ptr, topk_ptr, topp_ptr, minp_ptr, R, V, HAS_K,
                                                             HAS_P, HAS_M, PDL)
    if active & ~use_k & (top_p < 1.0):  # top_k rows find their candidates without the row's weight
        x_max = _scaled(_key_value(tl.load(kmax_ptr + row), SHIFT), inv_t)
        if x_max > _NEG_INF:  # a dead row has no candidates
            row_ptr = logits_ptr + b * stride_lb + (row % R) * stride_lj
            offs0 = tl.arange(0, BLOCK_V)
            mass = tl.zeros([BLOCK_V], tl.int64)
            hist = tl.zeros([64], tl.int32)
            t0 = tl.program_id(1) * tiles_per_split
            for t in range(t0, tl.minimum(t0 + tiles_per_split, tl.cdiv(V, BLOCK_V))):
                offs = t * BLOCK_V + offs0
                raw = tl.load(row_ptr + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
                x = _scaled(raw, inv_t)
                w = tl.where(offs < V, _tl_weights(x, x_max), 0)
                mass += w
                # bin j holds 32 + z in [j / 2, (j + 1) / 2), z = (x - x_max) * log2(e): its entries weigh
                # under 2**((j + 2) / 2) (half a bin of margin for the polynomial and the rounding)
                bins = tl.minimum(tl.maximum(tl.floor(2.0 * (x - x_max) * _TL_LOG2E_F32 + 64.0), 0.0), 63.0)
                hist += tl.histogram(bins.to(tl.int32), 64, mask=w > 0)
            tl.atomic_add(mass_ptr + row, tl.sum(mass, axis=0))
            d = tl.arange(0, 64)
            tl.atomic_add(hist_ptr + row * 64 + d, hist, mask=hist > 0)


@triton.jit
def _kth_key(ptr, N, k, x_max, inv_t, SHIFT: tl.constexpr, BLOCK_V: tl.constexpr, NP: tl.constexpr):
    """The largest key v with at least k of the N values at ptr at or above it; 0 < k < N."""
    lo, hi = _key_range(ptr, N, SHIFT, BLOCK_V)
    return _select(ptr, N, lo, hi, k.to(tl.float64), x_max, inv_t, False, SHIFT, BLOCK_V, NP)


@triton.jit
def _group_bar(smax_ptr, NS, gmax_ptr, NG, k, use_k, top_p, min_p, inv_t, x_max, hist_ptr, mass,
               SHIFT: tl.constexpr, BLOCK_V: tl.constexpr, NP: tl.constexpr):
    """(key_bar, z_bar): a group (a supergroup) holds candidates when its max's key >= key_bar and
    its max's z = (x - x_max) * log2(e) >= z_bar. top_k: key_bar is the k-th largest supergroup
    max (the k-th largest group max when k is not below the supergroups' count): k entries reach
    it, so the row's top k all lie in groups whose max does. Rows without top_k: z_bar is top_p's
    cut from the weight histogram (under it the row weighs at most 1 - top_p), else min_p's bar;
    both half a bin low."""
    key_bar = tl.zeros_like(k) - _INT32_MAX
    z_bar = tl.zeros_like(inv_t) + _NEG_INF
    if use_k:
        if k < NS:
            key_bar = _kth_key(smax_ptr, NS, k, x_max, inv_t, SHIFT, BLOCK_V, NP)
        elif k < NG:
            key_bar = _kth_key(gmax_ptr, NG, k, x_max, inv_t, SHIFT, BLOCK_V, NP)
    elif top_p < 1.0:
        d = tl.arange(0, 64)
        ub = tl.load(hist_ptr + d).to(tl.float32) * tl.exp2((d + 2).to(tl.float32) * 0.5)
        allowed = ((1.0 - top_p.to(tl.float64)) * mass.to(tl.float64)).to(tl.float32)
        cut = tl.max(tl.where(tl.cumsum(ub, axis=0) - ub <= allowed, d, 0), axis=0)
        z_bar = cut.to(tl.float32) * 0.5 - 32.5
    else:
        z_bar = tl.log2(tl.maximum(min_p, 1e-30)) - 0.5
    return key_bar, z_bar


@triton.jit
def _passes(v, valid, key_bar, z_bar, inv_t, x_max, SHIFT: tl.constexpr):
    """Which maxima v (raw logits) clear both bars of _group_bar."""
    v = v.to(tl.float32)
    return valid & (_keys(v, SHIFT) >= key_bar) & ((_scaled(v, inv_t) - x_max) * _TL_LOG2E_F32 >= z_bar)


@triton.jit
def _group_candidates(smax_ptr, NS, gmax_ptr, NG, row_ptr, V, cand_ptr, ids_ptr, CAP, key_bar, z_bar, inv_t,
                      x_max, SHIFT: tl.constexpr, BLOCK_V: tl.constexpr, GROUP: tl.constexpr,
                      SUPER: tl.constexpr):
    """Copy the entries of the groups that pass (_group_bar) to cand_ptr: the supergroups that pass
    first (their ids to ids_ptr), then their groups that do (to ids_ptr + CAP // GROUP), then the
    groups' entries. -> how many entries (whole groups, the row's end as -inf); past CAP the caller
    reads the whole row. A group that passes lies in a supergroup that does."""
    LIST = CAP // GROUP
    offs0 = tl.arange(0, BLOCK_V)
    ns = tl.zeros_like(NS)
    for t in range(0, tl.cdiv(NS, BLOCK_V)):
        offs = t * BLOCK_V + offs0
        take = _passes(tl.load(smax_ptr + offs, mask=offs < NS, other=float("-inf")), offs < NS, key_bar, z_bar,
                       inv_t, x_max, SHIFT).to(tl.int32)
        pos = ns + tl.cumsum(take, axis=0) - 1
        tl.store(ids_ptr + pos, offs, mask=(take > 0) & (pos < LIST))
        ns += tl.sum(take, axis=0)
    n = tl.zeros_like(NG)
    if ns <= LIST:
        SB: tl.constexpr = BLOCK_V // SUPER  # supergroups per step
        for t in range(0, tl.cdiv(ns, SB)):
            slot = t * SB + tl.arange(0, SB)
            sg = tl.load(ids_ptr + slot, mask=slot < ns, other=0)
            g = sg[:, None] * SUPER + tl.arange(0, SUPER)[None, :]
            live = (slot < ns)[:, None] & (g < NG)
            take = _passes(tl.load(gmax_ptr + g, mask=live, other=float("-inf")), live, key_bar, z_bar, inv_t, x_max,
                           SHIFT).to(tl.int32)
            take = tl.reshape(take, [SB * SUPER])
            pos = n + tl.cumsum(take, axis=0) - 1
            tl.store(ids_ptr + LIST + pos, tl.reshape(g, [SB * SUPER]), mask=(take > 0) & (pos < LIST))
            n += tl.sum(take, axis=0)
    else:
        n = LIST + 1
    if n <= LIST:
        GS: tl.constexpr = BLOCK_V // GROUP  # groups per copy
        e = tl.arange(0, GROUP)[None, :]
        for t in range(0, tl.cdiv(n, GS)):
            slot = t * GS + tl.arange(0, GS)[:, None]
            g = tl.load(ids_ptr + LIST + slot, mask=slot < n, other=0)
            vals = tl.load(row_ptr + g * GROUP + e, mask=(slot < n) & (g * GROUP + e < V), other=float("-inf"))
            tl.store(cand_ptr + slot * GROUP + e, vals.to(tl.float32), mask=slot < n)
    return n * GROUP


@triton.jit
def _candidate_draws(kept_ptr, vid_ptr, n, rmax, x_max, inv_t, excl, seed, pos, BLOCK_V: tl.constexpr,
                     CHUNK: tl.constexpr, NC_POW2: tl.constexpr):
    """What the sampler's row pass and its two-level race find on a row from the n entries its
    filter keeps (kept_ptr: raw values in increasing vocab order, so the entries of a race chunk
    are consecutive; vid_ptr: their vocab ids): (the lowest id of the raw max rmax (0 on a dead
    row), the kept row's lse, the race's winner with excl left out and its x; x -inf: nothing to
    race, the walk falls back to the argmax). x_max: the row's largest scaled logit. The race keys
    are the whole-row race's, bit for bit (same ops, same counter-based bits by vocab id); the
    entries the filter removes would only add -inf."""
    offs0 = tl.arange(0, BLOCK_V)
    cc = tl.arange(0, NC_POW2)
    s_row = tl.zeros([BLOCK_V], tl.float32)
    amax = tl.full([BLOCK_V], _INT32_MAX, tl.int32)
    # each chunk's mass without excl, relative to the running max of the live entries: a chunk more
    # than ~87 under it underflows, and could not win anyway (a Gumbel spans under 20)
    m_live = tl.max(tl.full([BLOCK_V], _NEG_INF, tl.float32), axis=0)
    s_c = tl.zeros([NC_POW2], tl.float32)
    for t in range(0, tl.cdiv(n, BLOCK_V)):
        slot = t * BLOCK_V + offs0
        inb = slot < n
        raw = tl.load(kept_ptr + slot, mask=inb, other=float("-inf"))
        vid = tl.load(vid_ptr + slot, mask=inb, other=0)
        x = _scaled(raw, inv_t)
        s_row += tl.exp(x - x_max)
        amax = tl.minimum(amax, tl.where(raw == rmax, vid, _INT32_MAX))
        ch = vid // CHUNK
        xl = tl.where(vid != excl, x, _NEG_INF)
        new = tl.maximum(m_live, tl.max(xl, axis=0))
        e = tl.where(new > _NEG_INF, tl.exp(xl - new), 0.0)
        alpha = tl.where(new > _NEG_INF, tl.exp(m_live - new), 0.0)
        s_c = s_c * alpha + tl.sum(tl.where(ch[:, None] == cc[None, :], e[:, None], 0.0), axis=0)
        m_live = new
    amax_s = tl.min(amax, axis=0)
    amax_s = tl.where(amax_s < _INT32_MAX, amax_s, 0)
    lse = x_max + tl.log(tl.sum(s_row, axis=0))
    # the first level: the row pass path's chunk race, on these log-masses
    kc, cw = _chunk_race(m_live + tl.log(s_c), seed, pos, NC_POW2)
    # chunk cw's slots, counted in a pass of their own: a per-chunk histogram carried through the loop
    # above cost ~35 registers (sm_90), enough to halve how many programs share an SM
    below = tl.zeros([BLOCK_V], tl.int32)
    inside = tl.zeros([BLOCK_V], tl.int32)
    for t in range(0, tl.cdiv(n, BLOCK_V)):
        slot = t * BLOCK_V + offs0
        inb = slot < n
        ch = tl.load(vid_ptr + slot, mask=inb, other=0) // CHUNK
        below += (inb & (ch < cw)).to(tl.int32)
        inside += (inb & (ch == cw)).to(tl.int32)
    start = tl.sum(below, axis=0)
    end = start + tl.sum(inside, axis=0)
    # the second level over chunk cw's candidates only (a strict > per lane, then the lowest id)
    rkey = tl_race_key(seed, pos)
    best = tl.full([BLOCK_V], _NEG_INF, tl.float32)
    best_i = tl.full([BLOCK_V], _INT32_MAX, tl.int32)
    best_x = tl.full([BLOCK_V], _NEG_INF, tl.float32)
    for t in range(start // BLOCK_V, tl.cdiv(end, BLOCK_V)):
        slot = t * BLOCK_V + offs0
        inr = (slot >= start) & (slot < end)
        raw = tl.load(kept_ptr + slot, mask=inr, other=float("-inf"))
        vid = tl.load(vid_ptr + slot, mask=inr, other=0)
        x = _scaled(raw, inv_t)
        key = tl.where(inr & (vid != excl), x + tl_race_gumbel(rkey, vid), _NEG_INF)
        win = key > best
        best = tl.where(win, key, best)
        best_i = tl.where(win, vid, best_i)
        best_x = tl.where(win, x, best_x)
    km, wi, xw = _race_result(tl.reshape(best, (BLOCK_V, 1)), tl.reshape(best_i, (BLOCK_V, 1)),
                              tl.reshape(best_x, (BLOCK_V, 1)))
    return amax_s, lse, wi, tl.where((kc > _NEG_INF) & (km > _NEG_INF), xw, _NEG_INF)


@triton.jit
def _reset_row(kmax_ptr, mass_ptr, hist_ptr, row):
    """Kernels 1 and 2's state of a row as the next call expects it."""
    tl.store(kmax_ptr + row, -_INT32_MAX)
    tl.store(mass_ptr + row, 0)
    tl.store(hist_ptr + row * 64 + tl.arange(0, 64), tl.zeros([64], tl.int32))


@triton.jit
def _threshold_kernel(
    logits_ptr,  # [B, K+1, V] bf16/fp16/fp32, vocab dim contiguous
    temp_ptr,  # [B] fp32
    topk_ptr,  # [B] int32/int64 (HAS_K only)
    topp_ptr,  # [B] fp32 (HAS_P only)
    minp_ptr,  # [B] fp32 (HAS_M only)
    tau_ptr,  # [B*(K+1)] fp32 out: the row's threshold, -inf where nothing is filtered (not yet where flagged)
    need_ptr,  # [B*(K+1)] int32 out: 1 where the row's threshold needs the whole-row search (kernels 4, 5), else 0
    kmax_ptr, mass_ptr, hist_ptr, gmax_ptr, smax_ptr,  # kernels 1 and 2's (CAND only); the first three reset here
    cand_ptr,  # [rows, CAP] fp32 scratch: the row's candidates
    ids_ptr,  # [rows, 2 * (CAP // GROUP)] int32 scratch: their supergroups, their groups
    kept_ptr, kvid_ptr,  # [rows, CAP] fp32, int32 scratch: what a filter keeps of them, and its vocab ids
    draft_ptr, nd_ptr, seed_ptr, pos_ptr,  # the sampler's [B, K] drafts, [B] num_draft_tokens, seed, position (DRAW)
    dstat_i_ptr,  # [3, rows] int32 out (DRAW): drawn from the candidates (0/1), the argmax, the race's winner
    dstat_f_ptr,  # [4, rows] fp32 out (DRAW, where drawn): the raw max, the lse, x of the draft, x of the winner
    stride_db, stride_dk,
    stride_lb, stride_lj, R, V, NG, NS, CAP,
    HAS_K: tl.constexpr, HAS_P: tl.constexpr, HAS_M: tl.constexpr,
    SHIFT: tl.constexpr,  # low key bits the dtype leaves zero (16 bf16, 13 fp16, 0 fp32)
    CAND_BLOCK_V: tl.constexpr,  # the tile over the maxima and the candidates (at most CAP entries)
    KEPT_BLOCK_V: tl.constexpr,  # the tile over what the filters keep of them (top_k's few entries)
    GROUP: tl.constexpr,
    SUPER: tl.constexpr,
    CAND: tl.constexpr = True,  # from kernels 1 and 2's group maxima; False: every active row is flagged
    NP: tl.constexpr = 4,  # pivots per bisection round: 8 took ~30 more registers (sm_90) for a pass fewer
    PDL: tl.constexpr = 0,
    DRAW: tl.constexpr = False,  # one-hot sampler: rows whose candidates hold their threshold are drawn here
    HAS_ND: tl.constexpr = False,
    CHUNK: tl.constexpr = 1,  # DRAW: the two-level race's chunk, NC_POW2 >= the row's chunks
    NC_POW2: tl.constexpr = 1,
):
    row, b, active, inv_t, k, use_k, top_p, min_p = _filters(temp_ptr, topk_ptr, topp_ptr, minp_ptr, R, V, HAS_K,
                                                             HAS_P, HAS_M, PDL)
    tau = tl.zeros_like(inv_t) + _NEG_INF
    j = row % R
    row_ptr = logits_ptr + b * stride_lb + j * stride_lj
    drawn = row < 0
    done = row >= 0
    if active:  # rows that filter nothing stop here
        done = row < 0
        if CAND:
            kmax = tl.load(kmax_ptr + row).to(tl.int64)
            rmax = _key_value(kmax, SHIFT)
            x_max = _scaled(rmax, inv_t)
            mass = tl.load(mass_ptr + row)
            n = tl.zeros_like(NG)
            gid_ptr = ids_ptr + row * 2 * (CAP // GROUP)
            key_bar = tl.zeros_like(k) - _INT32_MAX
            if x_max > _NEG_INF:  # a dead row has no candidates
                key_bar, z_bar = _group_bar(smax_ptr + row * NS, NS, gmax_ptr + row * NG, NG, k, use_k, top_p, min_p,
                                            inv_t, x_max, hist_ptr + row * 64, mass, SHIFT, CAND_BLOCK_V, NP)
                n = _group_candidates(smax_ptr + row * NS, NS, gmax_ptr + row * NG, NG, row_ptr, V,
                                      cand_ptr + row * CAP, gid_ptr, CAP, key_bar, z_bar,
                                      inv_t, x_max, SHIFT, CAND_BLOCK_V, GROUP, SUPER)
            if n <= CAP:
                # the row's top k all reach key_bar (k entries do), so the k-th largest does too
                tau, done = _row_tau(cand_ptr + row * CAP, n, key_bar, kmax, k, use_k,
                                     top_p, min_p, inv_t, mass, gid_ptr + CAP // GROUP, kept_ptr + row * CAP,
                                     kvid_ptr + row * CAP, True, SHIFT, CAND_BLOCK_V, KEPT_BLOCK_V, NP, GROUP)
                if DRAW:
                    if done:  # every kept entry is a candidate: the sampler needs nothing else of this row
                        K = R - 1
                        kb = K
                        if HAS_ND:
                            kb = tl.minimum(tl.maximum(tl.load(nd_ptr + b).to(tl.int64), 0), K)
                        d = tl.load(draft_ptr + b * stride_db + j * stride_dk, mask=j < K, other=-1).to(tl.int64)
                        # the row emits a correction where it rejects its draft, else the bonus: excl as the row pass
                        excl = tl.where((j < kb) & (d >= 0) & (d < V), d, -1)
                        raw_d = tl.load(row_ptr + tl.minimum(tl.maximum(d, 0), V - 1), mask=j < K, other=0.0)
                        x_d = _scaled(tl.where(raw_d.to(tl.float32) >= tau, raw_d.to(tl.float32), _NEG_INF), inv_t)
                        m = _compact(cand_ptr + row * CAP, gid_ptr + CAP // GROUP, n, -_INT32_MAX, tau,
                                     kept_ptr + row * CAP, kvid_ptr + row * CAP, SHIFT, CAND_BLOCK_V, GROUP)
                        amax, lse, win, x_win = _candidate_draws(
                            kept_ptr + row * CAP, kvid_ptr + row * CAP, m, rmax, x_max, inv_t, excl,
                            tl.load(seed_ptr + b), tl.load(pos_ptr + b) + j, KEPT_BLOCK_V, CHUNK, NC_POW2)
                        rows = tl.num_programs(0).to(tl.int64)
                        tl.store(dstat_i_ptr + rows + row, amax)
                        tl.store(dstat_i_ptr + 2 * rows + row, win)
                        tl.store(dstat_f_ptr + row, rmax)
                        tl.store(dstat_f_ptr + rows + row, lse)
                        tl.store(dstat_f_ptr + 2 * rows + row, x_d)
                        tl.store(dstat_f_ptr + 3 * rows + row, x_win)
                        drawn = done
            if done:  # a flagged row's max and weight serve the whole-row search, which resets them
                _reset_row(kmax_ptr, mass_ptr, hist_ptr, row)
    tl.store(tau_ptr + row, tau)
    # every row, every call (graph replays share the buffer): the whole-row search is kernels of their
    # own, whose tiles over the whole row would otherwise set this kernel's registers, and so how
    # many of its programs share an SM, on every row for the sake of the few that overflow
    tl.store(need_ptr + row, (~done).to(tl.int32))
    if DRAW:  # every row, every call: the row pass and the walk read it
        tl.store(dstat_i_ptr + row, drawn.to(tl.int32))


@triton.jit
def _bins_kernel(
    logits_ptr, temp_ptr, topk_ptr, topp_ptr, minp_ptr,  # as _threshold_kernel
    need_ptr,  # [B*(K+1)] int32: _threshold_kernel's flags
    kmax_ptr,  # [rows] int32: the row's largest key (kernel 1's, kept for flagged rows)
    mass_ptr,  # [rows] int64: the row's weight (kernel 2's; top_p rows)
    cnt_ptr,  # [rows, NBINS] int32 zeros on entry: the row's entries by key bin
    wsum_ptr,  # [rows, NBINS] int64 zeros on entry: their weight
    ctr_ptr,  # [rows, 2] int32 zeros on entry: this kernel's and _window_kernel's programs done
    win_ptr,  # [rows] int32 out: the first bin of the row's window (its last program)
    above_ptr,  # [rows] int64 out: the weight of the keys over the window
    stride_lb, stride_lj, R, V, tiles_per_split,
    HAS_K: tl.constexpr, HAS_P: tl.constexpr, HAS_M: tl.constexpr, SHIFT: tl.constexpr,
    BLOCK_V: tl.constexpr,
    NBINS: tl.constexpr,
    PDL: tl.constexpr = 0,
):
    """The first level of the spread whole-row search, for each flagged row without top_k (top_p
    and min_p only: a flat row whose kept entries overflow the candidates), over (rows, splits)
    programs: the row's entries by key bin (NBINS bins of 2**BIN_SHIFT keys), counted and weighed
    (int64 atomics: exact in any order). The row's last program to finish picks the window of
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
        cnt = tl.zeros([NBINS], tl.int32)
        t0 = tl.program_id(1) * tiles_per_split
        for t in range(t0, tl.minimum(t0 + tiles_per_split, tl.cdiv(V, BLOCK_V))):
            offs = t * BLOCK_V + offs0
            raw = tl.load(row_ptr + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
            bins = ((_keys(raw, SHIFT) + (1 << (KEY_BITS - 1))) >> BIN_SHIFT).to(tl.int32)
            w = tl.where(offs < V, _tl_weights(_scaled(raw, inv_t), x_max), 0)
            tl.atomic_add(wsum_ptr + row * NBINS + bins, w, mask=w > 0, sem="relaxed")
            cnt += tl.histogram(bins, NBINS, mask=offs < V)
        d = tl.arange(0, NBINS)
        tl.atomic_add(cnt_ptr + row * NBINS + d, cnt, mask=cnt > 0, sem="relaxed")
        tl.debug_barrier()
        if tl.atomic_add(ctr_ptr + row * 2, 1, sem="acq_rel", scope="gpu") == tl.num_programs(1) - 1:
            tl.atomic_xchg(ctr_ptr + row * 2, 0, sem="relaxed", scope="gpu")
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
    cnt_ptr, wsum_ptr, ctr_ptr, win_ptr, above_ptr,  # _bins_kernel's, reset here
    wcnt_ptr,  # [rows, WINDOW] int32 zeros on entry: the window's entries key by key
    stride_lb, stride_lj, R, V, tiles_per_split,
    HAS_K: tl.constexpr, HAS_P: tl.constexpr, HAS_M: tl.constexpr, SHIFT: tl.constexpr,
    BLOCK_V: tl.constexpr,  # the tile over the row
    NBINS: tl.constexpr,
    SPREAD: tl.constexpr,  # _bins_kernel ran (CAND and keys of at most 20 bits: bf16, fp16)
    CAND: tl.constexpr,
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
        tl.debug_barrier()
        if tl.atomic_add(ctr_ptr + row * 2 + 1, 1, sem="acq_rel", scope="gpu") == tl.num_programs(1) - 1:
            tl.atomic_xchg(ctr_ptr + row * 2 + 1, 0, sem="relaxed", scope="gpu")
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
                tl.store(cnt_ptr + row * nb + tl.arange(0, nb), tl.zeros([nb], tl.int32))
                tl.store(wsum_ptr + row * nb + tl.arange(0, nb), tl.zeros([nb], tl.int64))
                tl.store(wcnt_ptr + row * WINDOW + d, tl.zeros([WINDOW], tl.int32))
            if ~found:
                kmin, kmax_w = _key_range(row_ptr, V, SHIFT, BLOCK_V)
                tau, _ = _row_tau(row_ptr, V, kmin, kmax_w, k, use_k, top_p, min_p, inv_t, tl.zeros_like(k) - 1,
                                  tau_ptr, tau_ptr, need_ptr, False, SHIFT, BLOCK_V, BLOCK_V, NP, 1)
            tl.store(tau_ptr + row, tau)
            if CAND:
                _reset_row(kmax_ptr, mass_ptr, hist_ptr, row)


_workspaces: dict[tuple, tuple[torch.Tensor, ...]] = {}
_retired: list[tuple[torch.Tensor, ...]] = []


def _workspace(dev: torch.device, rows: int, cap: int, ng: int, ns: int,
               dtype: torch.dtype) -> tuple[torch.Tensor, ...] | None:
    """(kmax [rows'] int32, mass [rows'] int64, hist [rows', 64] int32, group and supergroup maxima
    [rows', ng] and [rows', ns] dtype, candidates [rows', cap] fp32, their supergroups' and groups'
    ids [rows', 2 * (cap // GROUP)] int32, what the filters keep of the candidates [rows', cap] fp32
    and its vocab ids [rows', cap] int32) with rows' >= rows, one per device, cap, ng, ns and
    dtype, shared by every call and graph replay: the threshold kernel leaves each row it used as
    it found it. None inside a capture when it would have to grow (allocating there would tie it
    to that graph's pool)."""
    ws = _workspaces.get((dev, cap, ng, ns, dtype))
    if ws is None or ws[0].numel() < rows:
        if capturing():
            return None
        if ws is not None:
            _retired.append(ws)  # graphs captured before may still point at it
        n = max(rows, 2 * ws[0].numel() if ws is not None else 1024)  # B = 256 at K = 3 from the start
        ws = (torch.full((n,), -(2**31 - 1), dtype=torch.int32, device=dev),
              torch.zeros(n, dtype=torch.int64, device=dev), torch.zeros((n, 64), dtype=torch.int32, device=dev),
              torch.empty((n, ng), dtype=dtype, device=dev), torch.empty((n, ns), dtype=dtype, device=dev),
              torch.empty((n, cap), dtype=torch.float32, device=dev),
              torch.empty((n, 2 * (cap // GROUP)), dtype=torch.int32, device=dev),
              torch.empty((n, cap), dtype=torch.float32, device=dev),
              torch.empty((n, cap), dtype=torch.int32, device=dev))
        _workspaces[(dev, cap, ng, ns, dtype)] = ws
    return ws


_spread_workspaces: dict[torch.device, tuple[torch.Tensor, ...]] = {}


def _spread_workspace(dev: torch.device, rows: int) -> tuple[torch.Tensor, ...]:
    """The spread whole-row search's zeroed state (kernels 4 and 5), rows' >= rows, one per
    device, shared by every call and graph replay: each flagged row's last program zeroes what it
    used. (key-bin counts [rows', NBINS] int32, their weights [rows', NBINS] int64, programs done
    [rows', 2] int32, window [rows'] int32, weight over it [rows'] int64, the window's counts
    [rows', WINDOW] int32). Unlike _workspace it also grows inside a capture, where it then comes
    from that graph's pool (the graph's replays zero it again first, which is the state it must
    start from): the whole-row search needs it on every path."""
    ws = _spread_workspaces.get(dev)
    if ws is None or ws[3].numel() < rows:
        if ws is not None:
            _retired.append(ws)  # graphs captured before may still point at it
        n = max(rows, 2 * ws[3].numel() if ws is not None else 1024)
        ws = (torch.zeros((n, NBINS), dtype=torch.int32, device=dev), torch.zeros((n, NBINS), dtype=torch.int64,
                                                                                  device=dev),
              torch.zeros((n, 2), dtype=torch.int32, device=dev), torch.zeros(n, dtype=torch.int32, device=dev),
              torch.zeros(n, dtype=torch.int64, device=dev), torch.zeros((n, WINDOW.value), dtype=torch.int32,
                                                                        device=dev))
        _spread_workspaces[dev] = ws
    return ws


class Draws(NamedTuple):
    """What the threshold kernel needs to draw a row from its candidates (the one-hot sampler's
    inputs) and where it writes what it found (the sampler's walk reads it; the row pass skips the
    rows drawn)."""

    draft_ids: torch.Tensor  # [B, K] integer (any [B] tensor at K = 0)
    num_draft_tokens: torch.Tensor | None  # [B] int32/int64
    seed: torch.Tensor  # [B] int64
    position: torch.Tensor  # [B] int64
    chunk: int  # the two-level race's chunk (a power of two)
    stats_i: torch.Tensor  # [3, B*(K+1)] int32 out: drawn (0/1), the lowest argmax, the race's winner
    stats_f: torch.Tensor  # [4, B*(K+1)] fp32 out: the raw max, the lse, x of the draft, x of the winner


def thresholds_triton(target_logits, temperature, top_k, top_p, min_p, *, block_v: int, num_warps: int,
                      pdl: int, cap: int = FILTER_CAP, stats_block_v: int = 8192, programs: int = 1024,
                      cand_block_v: int | None = None, cand_warps: int | None = None, kept_block_v: int = 256,
                      draws: Draws | None = None,
                      whole: torch.Tensor | None = None) -> torch.Tensor:
    """tau [B*(K+1)] fp32 for target_logits [B, K+1, V] bf16/fp16/fp32 (vocab dim contiguous),
    temperature [B] fp32 and the filter tensors ([B] int32/int64, [B] fp32, [B] fp32; None: off);
    the rule of kernels/rejection_reference.thresholds_reference. block_v: the tile of kernel 2
    and of the whole-row search (kernels 4 and 5), stats_block_v kernel 1's (one per program);
    programs: kernels 2, 4 and 5 aim at about that many; cap: candidates per row (below GROUP: every row
    reads its whole row in kernels 4 and 5); cand_block_v: kernel 3's tile over the maxima and the
    candidates (block_v by default), cand_warps its warps (num_warps by default), kept_block_v its tile
    over what the filters keep of them (top_k's few entries). draws: also draw, for the one-hot
    sampler, each sampled row whose threshold came from its candidates (draws.stats_i[0] says which:
    every row's flag is written). whole: [B*(K+1)] int32 out, 1 on the rows whose threshold took the
    whole-row search (a new buffer when None)."""
    b, r, v = target_logits.shape
    rows = b * r
    dev = target_logits.device
    # no tile wider than the row
    block_v, stats_block_v, cand_block_v = (min(bv, max(GROUP, triton.next_power_of_2(v)))
                                            for bv in (block_v, stats_block_v, cand_block_v or block_v))
    ng = triton.cdiv(v, GROUP)
    sup = min(SUPER, stats_block_v // GROUP)  # kernel 1's tiles hold whole supergroups
    ns = triton.cdiv(ng, sup)
    tau = torch.empty(rows, dtype=torch.float32, device=dev)
    some = next(t for t in (top_k, top_p, min_p) if t is not None)  # a valid pointer when unused
    filters = (top_k if top_k is not None else some, top_p if top_p is not None else some,
               min_p if min_p is not None else some)
    flags = dict(HAS_K=top_k is not None, HAS_P=top_p is not None, HAS_M=min_p is not None,
                 SHIFT=_KEY_SHIFT[target_logits.dtype], PDL=pdl)
    launch = dict(num_warps=num_warps, enable_fp_fusion=False, **({"launch_pdl": True} if pdl else {}))
    strides = (target_logits.stride(0), target_logits.stride(1), r, v)
    ws = _workspace(dev, rows, cap, ng, ns, target_logits.dtype) if cap >= GROUP else None
    if ws is not None:
        kmax, mass, hist, gmax, smax, cand, ids, kept, kvid = ws
        _filter_stats_kernel[(rows, triton.cdiv(v, stats_block_v))](
            target_logits, temperature, *filters, kmax, gmax, smax, *strides, ng, ns, BLOCK_V=stats_block_v,
            GROUP=GROUP, SUPER=sup, **flags, **launch)
        if top_p is not None:
            tiles = triton.cdiv(v, block_v)
            per_split = triton.cdiv(tiles, max(1, min(tiles, programs // rows)))
            _filter_weigh_kernel[(rows, triton.cdiv(tiles, per_split))](
                target_logits, temperature, *filters, kmax, mass, hist, *strides, per_split, BLOCK_V=block_v,
                **flags, **launch)
    else:
        kmax = mass = hist = gmax = smax = cand = ids = kept = kvid = tau  # valid pointers, unused
    d = draws
    sample = () if d is None else (d.draft_ids, d.num_draft_tokens if d.num_draft_tokens is not None else d.seed,
                                   d.seed, d.position, d.stats_i, d.stats_f)
    dstrides = (d.draft_ids.stride(0), d.draft_ids.stride(1)) if d is not None and d.draft_ids.dim() == 2 else (0, 0)
    draw = dict(DRAW=True, HAS_ND=d.num_draft_tokens is not None, CHUNK=d.chunk,
                NC_POW2=triton.next_power_of_2(triton.cdiv(v, d.chunk))) if d is not None else {}
    need = torch.empty(rows, dtype=torch.int32, device=dev) if whole is None else whole
    _threshold_kernel[(rows,)](
        target_logits, temperature, *filters, tau, need, kmax, mass, hist, gmax, smax, cand, ids, kept, kvid,
        *(sample or (tau,) * 6), *dstrides, *strides, ng, ns, cap, CAND=ws is not None,
        CAND_BLOCK_V=cand_block_v, KEPT_BLOCK_V=min(kept_block_v, cand_block_v), GROUP=GROUP, SUPER=sup, **flags,
        **draw, **dict(launch, num_warps=cand_warps or num_warps))
    cnt, wsum, ctr, win, above, wcnt = _spread_workspace(dev, rows)
    # keys of at most 20 bits (a window holds whole bins), and few rows: the bins' atomics contend
    # as rows grow (H100, flat top_p rows: 13x faster than one program a row at B = 1, 2.6x at B = 8,
    # 1.6x at B = 16, slower at B = 64), and the extra launch costs every filtered call 0-3 us
    spread = ws is not None and flags["SHIFT"] >= 12 and rows <= SPREAD_ROWS
    tiles = triton.cdiv(v, block_v)
    # about 256 programs: every filtered call launches them, and most exit at once (1024 cost
    # B = 2 and 4 3.5 us more than the one-program search's launch, H100)
    per_split = triton.cdiv(tiles, max(1, min(tiles, SPREAD_PROGRAMS // rows))) if spread else tiles
    grid = (rows, triton.cdiv(tiles, per_split))
    if spread:
        _bins_kernel[grid](target_logits, temperature, *filters, need, kmax, mass, cnt, wsum, ctr, win, above,
                           *strides, per_split, BLOCK_V=block_v, NBINS=NBINS, **flags, **launch)
    _window_kernel[grid](target_logits, temperature, *filters, tau, need, kmax, mass, hist, cnt, wsum, ctr, win, above,
                         wcnt, *strides, per_split, BLOCK_V=block_v, NBINS=NBINS, SPREAD=spread, CAND=ws is not None,
                         **flags, **launch)
    return tau
