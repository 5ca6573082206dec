"""The filters' exact threshold search, shared by their kernels (kernels/rejection_filter.py and
kernels/rejection_filter_whole.py): order-preserving integer keys of the logits, their fixed-point
weights (rejection_reference.weights, the same fp32 ops in Triton), the radix select over a row or
a buffer (_select), one row's threshold from its entries (_row_tau), and each filter kernel's start
(_filters). The rule it implements is thresholds_reference's (kernels/rejection_reference.py).
"""

import triton
import triton.language as tl
from graphrt.kernels.rejection_kernels import _INT32_MAX, _NEG_INF, _inv_temperature, _pdl_wait, _scaled
from graphrt.kernels.rejection_reference import LOG2E_F32, POLY, W_BITS

_TL_W = tl.constexpr(W_BITS)
TILE_NP = tl.constexpr(8)  # pivots per round of the searches held in registers (_select_tile)
_TL_LOG2E_F32 = tl.constexpr(LOG2E_F32)
_C1, _C2, _C3, _C4, _C5 = (tl.constexpr(c) for c in POLY)


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
def _pivots(lo, hi, NP: tl.constexpr):
    """A pivot round's NP keys over [lo, hi]: lo + 1 ... hi, non-decreasing."""
    return lo + 1 + ((hi - lo - 1) * tl.arange(0, NP).to(tl.int64)) // (NP - 1)


@triton.jit
def _narrow(piv, ok, lo, hi):
    """[lo, hi] after a pivot round (ok: S at each pivot reaches the target): from the highest pivot
    that reaches it to below the lowest that does not."""
    return tl.maximum(lo, tl.max(tl.where(ok, piv, lo), axis=0)), tl.minimum(hi, tl.min(tl.where(ok, hi, piv - 1),
                                                                                         axis=0))


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
    offs0 = tl.arange(0, BLOCK_V)
    above = tl.zeros_like(lo)
    while lo < hi:
        wide = hi < lo  # False; MASS: whether the range spans more than 256 keys
        if MASS:
            wide = hi - lo >= 256
        if wide:
            piv = _pivots(lo, hi, NP)
            acc = tl.zeros([NP], tl.int64)
            for t in range(0, tl.cdiv(V, BLOCK_V)):
                offs = t * BLOCK_V + offs0
                raw = tl.load(row_ptr + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
                ge = (_keys(raw, SHIFT)[:, None] >= piv[None, :]) & (offs < V)[:, None]
                acc += tl.sum(tl.where(ge, _tl_weights(_scaled(raw, inv_t), x_max)[:, None], 0), axis=0)
            ok = acc.to(tl.float64) >= target
            above = tl.max(tl.where(ok, above, acc), axis=0)  # S at the lowest failing pivot
            lo, hi = _narrow(piv, ok, lo, hi)
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
def _select_tile(key, w, lo, hi, target, NP: tl.constexpr):
    """_select over a tile held in registers (key [T] int64, w [T] integer: 1 to count an entry, its
    weight to weigh it, 0 to leave it out): the largest key v in [lo, hi] with S(v) >= target, given
    S(lo) >= target. NP pivots a round, each round one reduction of the tile and no reload. Keys
    are compared as int32 (they fit): as int64 the [T, NP] compare spilled (sm_90)."""
    while lo < hi:
        piv = _pivots(lo, hi, NP)
        acc = tl.sum(tl.where(key.to(tl.int32)[:, None] >= piv.to(tl.int32)[None, :], w[:, None], 0), axis=0)
        lo, hi = _narrow(piv, acc.to(tl.float64) >= target, lo, hi)
    return lo


@triton.jit
def _filters(temp_ptr, topk_ptr, topp_ptr, minp_ptr, R, V, HAS_K: tl.constexpr, HAS_P: tl.constexpr,
             HAS_M: tl.constexpr, PDL: tl.constexpr):
    """The start of each filter kernel with a program a row: the PDL wait, then this program's row
    and _row_filters(row)."""
    _pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    b, active, inv_t, k, use_k, top_p, min_p = _row_filters(row, temp_ptr, topk_ptr, topp_ptr, minp_ptr, R, V,
                                                            HAS_K, HAS_P, HAS_M)
    return row, b, active, inv_t, k, use_k, top_p, min_p


@triton.jit
def _row_filters(row, temp_ptr, topk_ptr, topp_ptr, minp_ptr, R, V, HAS_K: tl.constexpr, HAS_P: tl.constexpr,
                 HAS_M: tl.constexpr):
    """Row row's request b and b's (active, inv_t, k, use_k, top_p, min_p); active: a sampled row
    that filters."""
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
    return b, ~greedy & (use_k | (top_p < 1.0) | (min_p > 0.0)), inv_t, k, use_k, top_p, min_p


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
              BLOCK_V: tl.constexpr, NP: tl.constexpr, TILE: tl.constexpr):
    """top_p's and min_p's part of _row_tau over the n entries at src_ptr, every entry with key >=
    lo among them: (tau_key raised to their cut, ok). total: the row's weight, or -1 for these
    entries' own (the mass top-k kept); ok is False when they weigh less than top_p of total.
    TILE: n may fit one tile, then searched in registers (a few hundred candidates, not a row)."""
    offs0 = tl.arange(0, BLOCK_V)
    # the mass kept by top-k, the lowest key that weighs anything, min-p's lowest key
    thr = min_p.to(tl.float64) * 4294967296.0
    mass = tl.zeros([BLOCK_V], tl.int64)
    wmin = tl.full([BLOCK_V], _INT32_MAX, tl.int64)
    mmin = tl.full([BLOCK_V], _INT32_MAX, tl.int64)
    if TILE:
        tile_key = tl.zeros([BLOCK_V], tl.int64)
    for t in range(0, tl.cdiv(n, BLOCK_V)):
        offs = t * BLOCK_V + offs0
        raw = tl.load(src_ptr + offs, mask=offs < n, other=float("-inf")).to(tl.float32)
        key = _keys(raw, SHIFT)
        if TILE:
            tile_key = key
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
            lo_w = tl.maximum(lo, tl.min(wmin, axis=0))
            if TILE:
                if n <= BLOCK_V:  # the loop's one tile is still in registers: mass holds its weights
                    tau_key = _select_tile(tile_key, mass, lo_w, kmax, target, TILE_NP)
                else:
                    tau_key = _select(src_ptr, n, lo_w, kmax, target, x_max, inv_t, True, SHIFT, BLOCK_V, NP)
            else:
                tau_key = _select(src_ptr, n, lo_w, kmax, target, x_max, inv_t, True, SHIFT, BLOCK_V, NP)
    if min_p > 0.0:
        tau_key = tl.maximum(tau_key, tl.min(mmin, axis=0))
    return tau_key, ok


@triton.jit
def _row_tau(src_ptr, n, kmin, kmax, k, use_k, top_p, min_p, inv_t, mass_total, gid_ptr, kept_ptr, kvid_ptr,
             CAND: tl.constexpr, SHIFT: tl.constexpr, BLOCK_V: tl.constexpr, KEPT_BLOCK_V: tl.constexpr,
             NP: tl.constexpr, GROUP: tl.constexpr):
    """(tau, ok, m) of one row from its n entries at src_ptr, whose keys lie in [kmin, kmax] (those
    at or over the row's top-k cut do), kmax the row's largest: the whole row, or (CAND) its
    candidates (fp32, n >= 0, whole groups, gid_ptr: their groups), a superset of what the filters
    keep; use_k: 0 < k < the row's V. With CAND and top_p without top_k the kept mass is
    mass_total, the row's; ok is False when the candidates weigh less than top_p of it (the caller
    then passes the whole row). n = 0: a dead row. CAND with top_k and top_p or min_p: what top-k
    keeps is copied to kept_ptr / kvid_ptr first (_compact; m entries, else m = -1), and top_p and
    min_p read only that."""
    x_max = _scaled(_key_value(kmax, SHIFT), inv_t)
    tau = tl.zeros_like(inv_t) + _NEG_INF
    ok = n >= 0
    m = tl.zeros_like(n) - 1
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
                                            min_p, inv_t, x_max, SHIFT, KEPT_BLOCK_V, NP, True)
                else:
                    tau_key, ok = _mass_tau(src_ptr, n, lo, tau_key, kmax, mass_total, top_p, min_p, inv_t, x_max,
                                            SHIFT, BLOCK_V, NP, False)
            else:
                tau_key, ok = _mass_tau(src_ptr, n, lo, tau_key, kmax, tl.zeros_like(mass_total) - 1, top_p, min_p,
                                        inv_t, x_max, SHIFT, BLOCK_V, NP, False)
        tau = _key_value(tl.minimum(tau_key, kmax), SHIFT)
    return tau, ok, m


@triton.jit
def _reset_row(kmax_ptr, mass_ptr, hist_ptr, row):
    """Kernels 1 and 2's state of a row as the next call expects it."""
    tl.store(kmax_ptr + row, -_INT32_MAX)
    tl.store(mass_ptr + row, 0)
    tl.store(hist_ptr + row * 64 + tl.arange(0, 64), tl.zeros([64], tl.int32))
