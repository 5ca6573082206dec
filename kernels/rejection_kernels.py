"""The sampler's row pass and walk (kernels 1 and 2 of every call), and the Triton helpers that
kernels/rejection_fullq.py shares. Rules: kernels/rejection_reference.py; launch: kernels/rejection.py.

No [B*(K+1), V] fp32 intermediate; the target logits are read once, in their own dtype. Tiles are
[lanes, VEC] (16 bytes per lane).
  1. _row_stats_kernel, grid (B*(K+1), splits): per split of the vocab, the raw (max, lowest
     argmax), the online (max, sum-exp) of the scaled row, the sum without the row's draft (one-hot:
     a chunk's mass for the correction's race) and the draft logits' stats in full q. One-hot
     splits never straddle a race chunk.
  2. _walk_kernel, grid B: merges the splits, walks the drafts, writes the accepted part,
     num_emitted, acceptance_counts and the correction/bonus token: greedy's argmax, or one-hot's
     two-level race. In full q it leaves the one row that needs a race for kernels/rejection_fullq.py.
Workspace: stat planes fstat [_NUM_FPLANES, B*(K+1), splits] fp32 (planes _P_*; _P_XD / _P_YD use
split 0 only) and istat [2, B*(K+1), splits] int32 (raw argmax, fused race winner).
"""

from __future__ import annotations

import triton
import triton.language as tl
from graphrt.kernels.pdl import release_dependents, wait_for_producer, wait_for_producer_release_later
from graphrt.kernels.rejection_reference import FLT_MAX
from graphrt.kernels.rng import (
    tl_accept_uniform,
    tl_bits_to_uniform,
    tl_chunk_key,
    tl_gumbel,
    tl_gumbel_upper_bound,
    tl_race_bits,
    tl_race_gumbel,
    tl_race_key,
)

_TL_FLT_MAX = tl.constexpr(FLT_MAX)
_INT32_MAX = tl.constexpr(2**31 - 1)
_NEG_INF = tl.constexpr(float("-inf"))
_LOG2E = tl.constexpr(1.4426950408889634)
_P_RAW_MAX, _P_MAX, _P_SUM, _P_QMAX, _P_QSUM, _P_RACE, _P_RACE_X, _P_XD, _P_YD, _P_XSUM = (
    tl.constexpr(i) for i in range(10))
_NUM_FPLANES = 10
# The row pass's (and full q's race pass's) programs in all, splits ~ PROGRAMS / rows (about two
# waves of a few programs per SM), and their warps.
PROGRAMS = 1024
WARPS = 4


@triton.jit
def _scaled(raw, inv_t):
    # NaN -> -inf (never sampled, never the max) and +inf -> fp32 max (so x - lse stays finite).
    x = raw * inv_t
    x = tl.where(x != x, _NEG_INF, x)
    return tl.minimum(x, _TL_FLT_MAX)


@triton.jit
def _inv_temperature(temp_ptr, b):
    t = tl.load(temp_ptr + b).to(tl.float32)
    greedy = ~(t > 0)  # NaN compares false: greedy
    safe_t = tl.where(greedy, 1.0, t)
    # Correctly rounded, like torch's 1 / t: `/` in Triton is an approximate division on NVIDIA.
    inv_t = tl.where(greedy, 1.0, tl.math.div_rn(1.0, safe_t))
    return greedy, inv_t


@triton.jit
def _pdl_wait(PDL: tl.constexpr):
    """Every program runs this before touching memory (LaunchConfig.pdl: 0 off, 1 dependents
    released here, 2 released by the kernel itself after its hot loop, or when it exits)."""
    if PDL == 1:
        wait_for_producer()
    if PDL == 2:
        wait_for_producer_release_later()


@triton.jit
def _tile_offsets(BLOCK_V: tl.constexpr, VEC: tl.constexpr):
    """[BLOCK_V // VEC, VEC] offsets inside a tile: each lane (row) holds VEC consecutive entries."""
    return tl.arange(0, BLOCK_V // VEC)[:, None] * VEC + tl.arange(0, VEC)[None, :]


@triton.jit
def _keep(raw, tau, FILTER: tl.constexpr):
    """The filters (kernels/rejection_filter.py): entries under the row's threshold tau are -inf."""
    if FILTER:
        raw = tl.where(raw >= tau, raw, _NEG_INF)
    return raw


@triton.jit
def _stats_step(raw, t, best, bt, s, sx, c, xo, toffs, XSUM: tl.constexpr):
    """One [lanes, VEC] tile of the raw-domain online stats: one rescale per lane, one exp2 per entry.

    best: the lane's running max of raw (NaN never counts: max() ignores it), bt: the tile where it
    was first reached (a strict `>`, so the lowest; _lowest_argmax finds the position in it), s:
    sum over the lane of exp((raw_i - best) * inv_t), c = inv_t * log2e. A NaN/-inf entry adds
    exp2(max(NaN or -inf, -inf)) = 0. (Tracking the position here instead costs a few ops per entry
    and was slower at every batch size, even with one tile per chunk.)
    XSUM: sx is the same sum without the entry at tile position xo (the row's draft, which the
    correction's race excludes); summed apart, never subtracted, so "only the draft alive" gives 0.
    """
    m = tl.max(raw, axis=1)
    take = m > best
    new = tl.maximum(best, m)
    alpha = tl.exp2(tl.maximum((best - new) * c, _NEG_INF))  # 1, or 0 from -inf (NaN -> -inf)
    e = tl.exp2(tl.maximum((raw - new[:, None]) * c, _NEG_INF))
    te = tl.sum(e, axis=1)
    s = s * alpha + te
    if XSUM:
        if (xo >= 0) & (xo < toffs.shape[0] * toffs.shape[1]):  # the one tile holding the draft
            te = tl.sum(tl.where(toffs == xo, 0.0, e), axis=1)
        sx = sx * alpha + te
    bt = tl.where(take, t, bt)
    return new, bt, s, sx


@triton.jit
def _stats_finish(best, s, sx, inv_t, c):
    """Lanes -> (max of the scaled row x, sum of exp(x - that max), the same for sx); ok = False if
    the fast form cannot stand for the reference's (a +inf entry, or x overflowing), then the
    exact loop reruns."""
    mr = tl.max(best, axis=0)
    scale = tl.where(best > _NEG_INF, tl.exp2((best - mr) * c), 0.0)
    mx = mr * inv_t
    ok = (mr == _NEG_INF) | ((mx > _NEG_INF) & (mx < float("inf")))
    return _scaled(mr, inv_t), tl.sum(s * scale, axis=0), tl.sum(sx * scale, axis=0), ok


@triton.jit
def _lowest_argmax(row_ptr, best, bt, chunk_start, V, BLOCK_V: tl.constexpr, VEC: tl.constexpr):
    """(max, lowest index) of a chunk from the per-lane (best, first tile): the lanes holding the
    max re-read their entries of that one tile (cached) to find its position. All -inf/NaN: the
    chunk's lowest index."""
    rm = tl.max(best, axis=0)
    hit = (best == rm) & (best > _NEG_INF)
    offs = chunk_start + tl.where(hit, bt, 0)[:, None] * BLOCK_V + _tile_offsets(BLOCK_V, VEC)
    m2 = hit[:, None] & (offs < V)
    raw = tl.load(row_ptr + offs, mask=m2, other=float("-inf")).to(tl.float32)
    ri = tl.min(tl.min(tl.where(m2 & (raw == rm), offs, _INT32_MAX), axis=1), axis=0)
    return rm, tl.where(rm > _NEG_INF, ri, chunk_start)


@triton.jit
def _exact_lse_chunk(row_ptr, chunk_start, n_tiles, V, inv_t, excl, tau, BLOCK_V: tl.constexpr,
                     FILTER: tl.constexpr):
    """The reference's sanitised online logsumexp over a chunk (slow path, rare inputs only):
    (max, sum, sum without entry excl)."""
    offs0 = tl.arange(0, BLOCK_V)
    m_run = tl.max(tl.full([BLOCK_V], _NEG_INF, tl.float32), axis=0)
    s_lane = tl.zeros([BLOCK_V], tl.float32)
    sx_lane = tl.zeros([BLOCK_V], tl.float32)
    for t in range(n_tiles):
        offs = chunk_start + t * BLOCK_V + offs0
        x = _scaled(_keep(tl.load(row_ptr + offs, mask=offs < V, other=float("-inf")).to(tl.float32), tau,
                          FILTER), inv_t)
        m_new = tl.maximum(m_run, tl.max(x, axis=0))
        alpha = tl.exp(m_run - m_new)
        e = tl.exp(x - m_new)
        s_lane = tl.where(m_new == _NEG_INF, 0.0, s_lane * alpha + e)
        sx_lane = tl.where(m_new == _NEG_INF, 0.0, sx_lane * alpha + tl.where(offs == excl, 0.0, e))
        m_run = m_new
    return m_run, tl.sum(s_lane, axis=0), tl.sum(sx_lane, axis=0)


@triton.jit
def _race_tile(raw, offs, live, inv_t, rkey, best, idx, bx, best_run,
               PRUNE: tl.constexpr, FAST: tl.constexpr):
    """One [lanes, VEC] tile of the Gumbel-max race: key = x + g where live, else -inf.

    best/idx/bx: per-entry running best key, its index and its x (a strict `>`: tiles come in
    index order, so ties keep the lowest index). PRUNE: skip the two logs per entry when no entry
    of the tile can beat best_run, the best key of the earlier tiles: x <= raw * inv_t and
    g <= tl_gumbel_upper_bound(u), and fp32 rounding is monotone, so key <= round(raw * inv_t +
    bound) exactly; a skipped entry at most ties an earlier, lower index. The bound is taken per
    entry. NaN never raises it (max ignores NaN), an excluded entry only loosens it.
    """
    u = tl_bits_to_uniform(tl_race_bits(rkey, offs))
    if PRUNE:
        run = tl.max(tl.max(raw * inv_t + tl_gumbel_upper_bound(u, FAST), axis=1), axis=0) > best_run
    else:
        run = True
    if run:
        x = _scaled(raw, inv_t)
        key = tl.where(live, x + tl_gumbel(u), _NEG_INF)
        win = key > best
        best = tl.where(win, key, best)
        idx = tl.where(win, offs, idx)
        bx = tl.where(win, x, bx)
        if PRUNE:
            best_run = tl.maximum(best_run, tl.max(tl.max(key, axis=1), axis=0))
    return best, idx, bx, best_run


@triton.jit
def _race_result(best, idx, bx):
    """Per-entry race state -> (best key, its lowest index, its x); (-inf, INT32_MAX, -inf) if none."""
    km = tl.max(tl.max(best, axis=1), axis=0)
    wi = tl.min(tl.min(tl.where(best == km, idx, _INT32_MAX), axis=1), axis=0)
    xw = tl.max(tl.max(tl.where(idx == wi, bx, _NEG_INF), axis=1), axis=0)
    return km, wi, xw


@triton.jit
def _row_stats_kernel(
    logits_ptr,  # [B, K+1, V] bf16/fp16/fp32, vocab dim contiguous
    qlogits_ptr,  # [B, K, V] draft logits (FULL_Q only)
    draft_ptr,  # [B, K] integer draft ids
    temp_ptr,  # [B] fp32
    seed_ptr,  # [B] int64
    pos_ptr,  # [B] int64
    nd_ptr,  # [B] int32/int64 num_draft_tokens (HAS_ND only)
    fstat_ptr,  # [_NUM_FPLANES, B*(K+1), SPLITS] fp32 stat planes
    istat_ptr,  # [2, B*(K+1), SPLITS] int32: raw argmax, race winner
    tau_ptr,  # [B*(K+1)] fp32: the filters' thresholds (FILTER only)
    stride_lb, stride_lj, stride_qb, stride_qj, stride_db, stride_dk,
    R, V, SPLITS, TILES_PER_SPLIT,
    VOFF, V_ALL,  # SHARDED only: global id of this shard's entry 0, the full vocabulary's size
    HAS_ND: tl.constexpr,
    FULL_Q: tl.constexpr,
    FUSE_RACE: tl.constexpr,
    BLOCK_V: tl.constexpr,  # vocab entries loaded per tile
    VEC: tl.constexpr = 8,  # consecutive entries per lane (16 bytes of bf16)
    PRUNE: tl.constexpr = False,
    FAST: tl.constexpr = False,
    PDL: tl.constexpr = 0,
    XSUM: tl.constexpr = False,  # one-hot: also the sums without the draft (P_XSUM)
    FILTER: tl.constexpr = False,  # top_k / top_p / min_p: entries under tau are -inf
    SHARDED: tl.constexpr = False,  # vocab parallel (kernels/vocab_parallel.py), below
    DRAWN: tl.constexpr = False,  # the filters drew some rows from their candidates: skip those
    dstat_i_ptr=None,  # [3, B*(K+1)] int32 (DRAWN only): plane 0 says which rows (rejection_filter.Draws)
):
    """Split `split` of row `row`. The hot loop keeps per-lane raw-domain state and does one rescale
    per lane and one exp2 per entry (_stats_step); the argmax keeps only the tile where each lane's
    max was reached and re-reads that tile once at the end. Inputs where the fast lse is not the
    reference's (a +inf logit, x overflowing) rerun the split through the exact sanitised loop. The
    split holding row j's draft also stores its logit (and q's), so the walk reads nothing that
    depends on another read. FUSE_RACE (one-hot, few rows): also race every row's entries per
    split, draft excluded, so the walk reads no logits. DRAWN: rows the threshold kernel drew from
    their candidates end here at once, writing nothing.
    SHARDED: logits_ptr holds the V entries [VOFF, VOFF + V) of a V_ALL-entry row (one rank's
    vocab shard, VOFF a multiple of the race chunk); loads and tiles are local, every id that
    leaves the kernel or feeds the RNG is global (argmax ids, race bits and winners, the draft), so
    a rank's splits are the ones a single GPU computes over the same entries. The draft's logit goes
    to every split's own P_XD slot, -inf where the split does not hold it (the finish takes the max)."""
    _pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    if DRAWN:  # the walk takes a drawn row's results from the filters, and none of this pass's planes
        if tl.load(dstat_i_ptr + row) != 0:
            return
    split = tl.program_id(1)
    b = row // R
    j = row % R
    K = R - 1
    greedy, inv_t = _inv_temperature(temp_ptr, b)
    c = inv_t * _LOG2E
    tau = inv_t
    if FILTER:
        tau = tl.load(tau_ptr + row)
    kb = K
    if HAS_ND:
        kb = tl.minimum(tl.maximum(tl.load(nd_ptr + b).to(tl.int64), 0), K)
    d = tl.load(draft_ptr + b * stride_db + j * stride_dk, mask=j < K, other=-1).to(tl.int64)
    v_all = V
    voff = 0
    if SHARDED:
        v_all = V_ALL
        voff = VOFF
    # Row j's correction excludes its draft; the bonus row (j == k_b) excludes nothing. Sharded:
    # excl is local (negative or >= V when another rank holds the draft: it then matches nothing).
    excl = tl.where((j < kb) & (d >= 0) & (d < v_all), d - voff, -1)
    if FUSE_RACE:  # only the fused race uses it, and the interpreter runs dead code too
        rkey = tl_race_key(tl.load(seed_ptr + b), tl.load(pos_ptr + b) + j)
    need_q = (j < kb) & ~greedy

    row_ptr = logits_ptr + b * stride_lb + j * stride_lj
    q_ptr = qlogits_ptr + b * stride_qb + j * stride_qj
    tile0 = split * TILES_PER_SPLIT
    chunk_start = tile0 * BLOCK_V
    # Tiles of this chunk, and how many of them lie wholly inside the row (loaded without a mask).
    n_tiles = tl.minimum(TILES_PER_SPLIT, tl.cdiv(V, BLOCK_V) - tile0)
    n_full = tl.maximum(tl.minimum(n_tiles, V // BLOCK_V - tile0), 0)
    # The chunk holding the draft stores its logits for the walk (no dependent read there).
    dc = tl.minimum(tl.maximum(d, 0), v_all - 1) - voff
    mine = (j < K) & (dc >= chunk_start) & (dc < chunk_start + n_tiles * BLOCK_V)
    if SHARDED:  # the last tile may reach past this shard: the next rank's entry is not here
        mine = mine & (dc < V)
    x_d = _scaled(_keep(tl.load(row_ptr + dc, mask=mine, other=0.0).to(tl.float32), tau, FILTER), inv_t)
    if FULL_Q:
        y_d = _scaled(tl.load(q_ptr + dc, mask=mine, other=0.0).to(tl.float32), inv_t)

    toffs = _tile_offsets(BLOCK_V, VEC)
    best = tl.full([BLOCK_V // VEC], _NEG_INF, tl.float32)
    bt = tl.full([BLOCK_V // VEC], _INT32_MAX, tl.int32)
    s = tl.zeros([BLOCK_V // VEC], tl.float32)
    sx = tl.zeros([BLOCK_V // VEC], tl.float32)
    qbest = tl.full([BLOCK_V // VEC], _NEG_INF, tl.float32)
    qbt = tl.full([BLOCK_V // VEC], _INT32_MAX, tl.int32)
    qs = tl.zeros([BLOCK_V // VEC], tl.float32)
    race_best = tl.full([BLOCK_V // VEC, VEC], _NEG_INF, tl.float32)
    race_idx = tl.full([BLOCK_V // VEC, VEC], _INT32_MAX, tl.int32)
    race_x = tl.full([BLOCK_V // VEC, VEC], _NEG_INF, tl.float32)
    best_run = tl.max(tl.max(race_best, axis=1), axis=0)
    # Whole tiles, two loads in flight before either is used.
    for t in range(0, n_full - 1, 2):
        offs_a = chunk_start + t * BLOCK_V + toffs
        ra = _keep(tl.load(row_ptr + offs_a).to(tl.float32), tau, FILTER)
        rb = _keep(tl.load(row_ptr + offs_a + BLOCK_V).to(tl.float32), tau, FILTER)
        xo = excl - chunk_start - t * BLOCK_V
        best, bt, s, sx = _stats_step(ra, t, best, bt, s, sx, c, xo, toffs, XSUM)
        best, bt, s, sx = _stats_step(rb, t + 1, best, bt, s, sx, c, xo - BLOCK_V, toffs, XSUM)
        if FUSE_RACE:
            if ~greedy:
                race_best, race_idx, race_x, best_run = _race_tile(
                    ra, offs_a + voff, offs_a != excl, inv_t, rkey, race_best, race_idx, race_x, best_run,
                    PRUNE, FAST)
                race_best, race_idx, race_x, best_run = _race_tile(
                    rb, offs_a + BLOCK_V + voff, offs_a + BLOCK_V != excl, inv_t, rkey, race_best, race_idx,
                    race_x, best_run, PRUNE, FAST)
        if FULL_Q:
            if need_q:
                ya = tl.load(q_ptr + offs_a).to(tl.float32)
                yb = tl.load(q_ptr + offs_a + BLOCK_V).to(tl.float32)
                qbest, qbt, qs, _ = _stats_step(ya, t, qbest, qbt, qs, qs, c, -1, toffs, False)
                qbest, qbt, qs, _ = _stats_step(yb, t + 1, qbest, qbt, qs, qs, c, -1, toffs, False)
    # The odd whole tile and the partial last one, masked.
    for t in range(n_full - (n_full % 2), n_tiles):
        offs = chunk_start + t * BLOCK_V + toffs
        inb = offs < V
        raw = _keep(tl.load(row_ptr + offs, mask=inb, other=float("-inf")).to(tl.float32), tau, FILTER)
        best, bt, s, sx = _stats_step(raw, t, best, bt, s, sx, c, excl - chunk_start - t * BLOCK_V,
                                      toffs, XSUM)
        if FUSE_RACE:
            if ~greedy:
                race_best, race_idx, race_x, best_run = _race_tile(
                    raw, offs + voff, inb & (offs != excl), inv_t, rkey, race_best, race_idx, race_x, best_run,
                    PRUNE, FAST)
        if FULL_Q:
            if need_q:
                y = tl.load(q_ptr + offs, mask=inb, other=float("-inf")).to(tl.float32)
                qbest, qbt, qs, _ = _stats_step(y, t, qbest, qbt, qs, qs, c, -1, toffs, False)

    if PDL == 2:
        release_dependents()
    plane = tl.num_programs(0).to(tl.int64) * SPLITS  # elements per plane
    o = row * SPLITS + split
    rm, ri = _lowest_argmax(row_ptr, best, bt, chunk_start, V, BLOCK_V, VEC)
    m_run, s_run, sx_run, ok = _stats_finish(best, s, sx, inv_t, c)
    if ~ok:
        m_run, s_run, sx_run = _exact_lse_chunk(row_ptr, chunk_start, n_tiles, V, inv_t, excl, tau, BLOCK_V,
                                                FILTER)
    qm_run = rm * 0.0 + _NEG_INF
    qs_run = rm * 0.0
    if FULL_Q:
        qm_run, qs_run, _, qok = _stats_finish(qbest, qs, qs, inv_t, c)
        if need_q:
            if ~qok:
                qm_run, qs_run, _ = _exact_lse_chunk(q_ptr, chunk_start, n_tiles, V, inv_t, -1, tau, BLOCK_V,
                                                     False)
        tl.store(fstat_ptr + _P_YD * plane + row * SPLITS, y_d, mask=mine)
    if SHARDED:
        tl.store(fstat_ptr + _P_XD * plane + o, tl.where(mine, x_d, _NEG_INF))
    else:
        tl.store(fstat_ptr + _P_XD * plane + row * SPLITS, x_d, mask=mine)
    tl.store(fstat_ptr + _P_RAW_MAX * plane + o, rm)
    tl.store(fstat_ptr + _P_MAX * plane + o, m_run)
    tl.store(fstat_ptr + _P_SUM * plane + o, s_run)
    if XSUM:
        tl.store(fstat_ptr + _P_XSUM * plane + o, sx_run)
    tl.store(fstat_ptr + _P_QMAX * plane + o, qm_run)
    tl.store(fstat_ptr + _P_QSUM * plane + o, qs_run)
    tl.store(istat_ptr + o, ri + voff)
    if FUSE_RACE:
        kmax, kidx, kx = _race_result(race_best, race_idx, race_x)
        tl.store(fstat_ptr + _P_RACE * plane + o, kmax)
        tl.store(fstat_ptr + _P_RACE_X * plane + o, kx)
        tl.store(istat_ptr + plane + o, kidx)


@triton.jit
def _merge_lse(m_part, s_part, mask):
    """[.., SPLITS] partial (max, sum-exp) -> lse per row (-inf for a dead row)."""
    m = tl.max(m_part, axis=1)
    w = tl.where(mask & (m_part > _NEG_INF), s_part * tl.exp(m_part - m[:, None]), 0.0)
    s = tl.sum(w, axis=1)
    return tl.where(m == _NEG_INF, _NEG_INF, m + tl.log(s))


@triton.jit
def _pick_chunk(pm, psx, seed, pos, NC_POW2: tl.constexpr, SPC: tl.constexpr):
    """First level of the reference's _two_level_race on one row: the chunks race on their
    log-mass, merged from the row pass's per-split max and sum without the excluded draft (pm, psx:
    [NC_POW2 * SPC], -inf / 0 past the last split). -> (best chunk key, -inf if none; its chunk)"""
    pm = tl.reshape(pm, (NC_POW2, SPC))
    return _chunk_race(_merge_lse(pm, tl.reshape(psx, (NC_POW2, SPC)), pm > _NEG_INF), seed, pos, NC_POW2)


@triton.jit
def _chunk_race(lse_c, seed, pos, NC_POW2: tl.constexpr):
    """The chunks' race on their log-masses lse_c [NC_POW2] (-inf: empty) -> (best chunk key, -inf
    if none; its chunk). Shared by the row pass's path and the filters' draws from the candidates
    (kernels/rejection_filter.py), which must pick the same chunk bit for bit."""
    cc = tl.arange(0, NC_POW2)
    ckey = tl.where(lse_c > _NEG_INF, lse_c + tl_race_gumbel(tl_chunk_key(seed, pos), cc), _NEG_INF)
    kc = tl.max(ckey, axis=0)
    return kc, tl.min(tl.where(ckey == kc, cc, NC_POW2), axis=0)


@triton.jit
def _chunk_winner(rk, ri, rx, cw, NC_POW2: tl.constexpr, SPC: tl.constexpr):
    """Second level when the row pass raced every split (FUSE_RACE): the best of chunk cw's split
    winners (rk, ri, rx: each split's best key, its index and x). -> (winner, its x, its key)"""
    mine = (tl.arange(0, NC_POW2) == cw)[:, None]
    keys = tl.where(mine, tl.reshape(rk, (NC_POW2, SPC)), _NEG_INF)
    idxs = tl.reshape(ri, (NC_POW2, SPC))
    km = tl.max(tl.max(keys, axis=1), axis=0)
    win = tl.min(tl.min(tl.where(mine & (keys == km), idxs, _INT32_MAX), axis=1), axis=0)
    xw = tl.max(tl.max(tl.where(mine & (idxs == win), tl.reshape(rx, (NC_POW2, SPC)), _NEG_INF), axis=1), axis=0)
    return win.to(tl.int64), xw, km


@triton.jit
def _race_chunk_entries(row_ptr, cw, rkey, inv_t, excl, tau, V, CHUNK: tl.constexpr, RACE_BLOCK_V: tl.constexpr,
                        VEC: tl.constexpr, PRUNE: tl.constexpr, FAST: tl.constexpr, FILTER: tl.constexpr):
    """Second level otherwise: race chunk cw's CHUNK entries of the row, excl left out.
    -> (winner, its x, its key; key -inf if none)"""
    toffs = cw * CHUNK + _tile_offsets(RACE_BLOCK_V, VEC)
    best = tl.full([RACE_BLOCK_V // VEC, VEC], _NEG_INF, tl.float32)
    best_i = tl.full([RACE_BLOCK_V // VEC, VEC], _INT32_MAX, tl.int32)
    best_x = tl.full([RACE_BLOCK_V // VEC, VEC], _NEG_INF, tl.float32)
    best_run = tl.max(tl.max(best, axis=1), axis=0)
    raw = tl.load(row_ptr + toffs, mask=toffs < V, other=float("-inf")).to(tl.float32)
    for t in range(CHUNK // RACE_BLOCK_V):  # the next tile's load in flight while one races
        offs = toffs + t * RACE_BLOCK_V
        nxt = offs + RACE_BLOCK_V
        raw_next = tl.load(row_ptr + nxt, mask=(nxt < V) & (t + 1 < CHUNK // RACE_BLOCK_V),
                           other=float("-inf")).to(tl.float32)
        best, best_i, best_x, best_run = _race_tile(
            _keep(raw, tau, FILTER), offs, (offs < V) & (offs != excl), inv_t, rkey, best, best_i, best_x,
            best_run, PRUNE, FAST)
        raw = raw_next
    km, win, xw = _race_result(best, best_i, best_x)
    return win.to(tl.int64), xw, km


@triton.jit
def _walk_kernel(
    logits_ptr,  # [B, K+1, V]: the one-hot race re-reads one chunk of one row per request
    draft_ptr,  # [B, K] integer
    temp_ptr,  # [B] fp32
    seed_ptr,  # [B] int64
    pos_ptr,  # [B] int64
    nd_ptr,  # [B] int32/int64 (HAS_ND only)
    fstat_ptr,  # [_NUM_FPLANES, B*(K+1), SPLITS] fp32
    istat_ptr,  # [2, B*(K+1), SPLITS] int32
    tok_ptr,  # [B, K+1] int64 out
    nemit_ptr,  # [B] int32 out
    lp_ptr,  # [B, K+1] fp32 out
    counts_ptr,  # [K] int64, accumulated (HAS_COUNTS only)
    race_i_ptr,  # [B, 3] int32 out (full q): race row (-1: none), residual?, argmax
    race_f_ptr,  # [B, 3] fp32 out: lse of p and of q on the race row, x at its argmax
    tau_ptr,  # [B*(K+1)] fp32: the filters' thresholds (FILTER only)
    stride_lb, stride_lj, stride_db, stride_dk,
    R, V, SPLITS,
    HAS_ND: tl.constexpr,
    HAS_COUNTS: tl.constexpr,
    FULL_Q: tl.constexpr,
    FUSE_RACE: tl.constexpr,
    R_POW2: tl.constexpr,  # K+1 rows of one request in one tile
    SPLITS_POW2: tl.constexpr,  # all vocab splits of a row in one tile
    CHUNK: tl.constexpr = 1,  # one-hot: the two-level race's chunk, SPC splits each
    SPC: tl.constexpr = 1,
    NC_POW2: tl.constexpr = 1,
    RACE_BLOCK_V: tl.constexpr = 1,
    VEC: tl.constexpr = 8,
    PRUNE: tl.constexpr = False,
    FAST: tl.constexpr = False,
    PDL: tl.constexpr = 0,
    FILTER: tl.constexpr = False,
    DRAWN: tl.constexpr = False,  # rows drawn by the filters' threshold kernel: their results replace the planes'
    dstat_i_ptr=None,  # [3, B*(K+1)] int32 (DRAWN only): drawn (0/1), the lowest argmax, the race's winner
    dstat_f_ptr=None,  # [4, B*(K+1)] fp32: the raw max, the lse, x of the draft, x of the race's winner
):
    """Request b = program id: merge its rows' splits, walk its drafts, write its results.

    Every load of the walk itself is addressed by b alone (the row pass stored the drafts'
    logits), so they all issue at once: no read waits on another. A sampled one-hot request then
    runs its two-level race (_pick_chunk, then _chunk_winner over the fused race's split winners,
    or _race_chunk_entries over the winning chunk, pruned by _race_tile where asked). In full q it
    leaves the one row that needs a race in race_i / race_f for kernels/rejection_fullq.py. DRAWN:
    a drawn row's max, argmax, lse, draft's x and race winner come from the threshold kernel."""
    _pdl_wait(PDL)
    b = tl.program_id(0).to(tl.int64)
    plane = tl.num_programs(0).to(tl.int64) * R * SPLITS  # elements per stat plane
    K = R - 1
    greedy, inv_t = _inv_temperature(temp_ptr, b)
    kb = K
    if HAS_ND:
        kb = tl.minimum(tl.maximum(tl.load(nd_ptr + b).to(tl.int64), 0), K)
    seed = tl.load(seed_ptr + b)
    pos = tl.load(pos_ptr + b)

    jr = tl.arange(0, R_POW2).to(tl.int64)
    s = tl.arange(0, SPLITS_POW2)
    row_ok = jr < R
    m2 = row_ok[:, None] & (s < SPLITS)[None, :]
    o2 = (b * R + jr)[:, None] * SPLITS + s[None, :]
    raw_m = tl.load(fstat_ptr + _P_RAW_MAX * plane + o2, mask=m2, other=_NEG_INF, cache_modifier=".cg")
    raw_i = tl.load(istat_ptr + o2, mask=m2, other=_INT32_MAX, cache_modifier=".cg")
    rmax = tl.max(raw_m, axis=1)
    amax = tl.min(tl.where(raw_m == rmax[:, None], raw_i, _INT32_MAX), axis=1).to(tl.int64)
    pm = tl.load(fstat_ptr + _P_MAX * plane + o2, mask=m2, other=_NEG_INF, cache_modifier=".cg")
    lse = _merge_lse(pm, tl.load(fstat_ptr + _P_SUM * plane + o2, mask=m2, other=0.0, cache_modifier=".cg"), m2)
    o_row = (b * R + jr) * SPLITS
    is_draft = jr < K
    x_d = tl.load(fstat_ptr + _P_XD * plane + o_row, mask=is_draft, other=0.0, cache_modifier=".cg")
    drawn = jr < 0
    dwin = amax
    dx_win = rmax
    if DRAWN:
        rows = tl.num_programs(0).to(tl.int64) * R
        o_d = b * R + jr
        drawn = tl.load(dstat_i_ptr + o_d, mask=row_ok, other=0, cache_modifier=".cg") != 0
        dwin = tl.load(dstat_i_ptr + 2 * rows + o_d, mask=row_ok, other=0, cache_modifier=".cg").to(tl.int64)
        dx_win = tl.load(dstat_f_ptr + 3 * rows + o_d, mask=row_ok, other=_NEG_INF, cache_modifier=".cg")
        rmax = tl.where(drawn, tl.load(dstat_f_ptr + o_d, mask=row_ok, other=0.0, cache_modifier=".cg"), rmax)
        amax = tl.where(drawn, tl.load(dstat_i_ptr + rows + o_d, mask=row_ok, other=0, cache_modifier=".cg"), amax)
        lse = tl.where(drawn, tl.load(dstat_f_ptr + rows + o_d, mask=row_ok, other=0.0, cache_modifier=".cg"), lse)
        x_d = tl.where(drawn, tl.load(dstat_f_ptr + 2 * rows + o_d, mask=row_ok, other=0.0, cache_modifier=".cg"),
                       x_d)
    amax = tl.where(row_ok, amax, 0)
    x_amax = _scaled(rmax, inv_t)  # x at the argmax (-inf on a dead row)
    if not FULL_Q:  # the race's inputs for every row: none of these loads waits on the walk
        psx = tl.load(fstat_ptr + _P_XSUM * plane + o2, mask=m2, other=0.0, cache_modifier=".cg")
        if FUSE_RACE:
            rk = tl.load(fstat_ptr + _P_RACE * plane + o2, mask=m2, other=_NEG_INF, cache_modifier=".cg")
            ri = tl.load(istat_ptr + plane + o2, mask=m2, other=_INT32_MAX, cache_modifier=".cg")
            rx = tl.load(fstat_ptr + _P_RACE_X * plane + o2, mask=m2, other=_NEG_INF, cache_modifier=".cg")
    dead = lse == _NEG_INF

    d = tl.load(draft_ptr + b * stride_db + jr * stride_dk, mask=is_draft, other=-1).to(tl.int64)
    valid = is_draft & (d >= 0) & (d < V)
    p_d = tl.where(valid & ~dead, tl.exp(x_d - lse), 0.0)
    u = tl_accept_uniform(seed, pos + jr)
    if FULL_Q:
        mq = is_draft[:, None] & (s < SPLITS)[None, :]
        lse_q = _merge_lse(tl.load(fstat_ptr + _P_QMAX * plane + o2, mask=mq, other=_NEG_INF, cache_modifier=".cg"),
                           tl.load(fstat_ptr + _P_QSUM * plane + o2, mask=mq, other=0.0, cache_modifier=".cg"), mq)
        y_d = tl.load(fstat_ptr + _P_YD * plane + o_row, mask=is_draft, other=0.0, cache_modifier=".cg")
        q_d = tl.where(lse_q > _NEG_INF, tl.exp(y_d - lse_q), 0.0)
        acc_sampled = u * q_d < p_d
    else:
        lse_q = lse
        acc_sampled = u < p_d
    acc_greedy = valid & ~dead & (d == amax)
    accept = tl.where(greedy, acc_greedy, acc_sampled)
    rejected = (jr < kb) & ~accept
    n_acc = tl.min(tl.where(rejected, jr, kb), axis=0)

    at_n = jr == n_acc
    amax_n = tl.sum(tl.where(at_n, amax, 0), axis=0)
    x_amax_n = tl.max(tl.where(at_n, x_amax, _NEG_INF), axis=0)
    lse_n = tl.max(tl.where(at_n, lse, _NEG_INF), axis=0)
    lse_q_n = tl.max(tl.where(at_n, lse_q, _NEG_INF), axis=0)
    d_n = tl.sum(tl.where(at_n & valid, d, 0), axis=0)
    valid_n = tl.sum(tl.where(at_n & valid, 1, 0), axis=0) > 0
    is_bonus = n_acc >= kb
    if FULL_Q:
        use_res = ~is_bonus
    else:
        use_res = is_bonus & ~is_bonus
    excl = tl.where(is_bonus | use_res | ~valid_n, -1, d_n)

    tok_n = amax_n
    x_t = x_amax_n
    if not FULL_Q:
        if ~greedy:
            drawn_n = tl.max(tl.where(at_n & drawn, 1, 0), axis=0) > 0
            if drawn_n:  # the threshold kernel raced this row over its candidates
                win = tl.sum(tl.where(at_n, dwin, 0), axis=0)
                x_win = tl.max(tl.where(at_n, dx_win, _NEG_INF), axis=0)
                raced = x_win > _NEG_INF
            else:
                # Row n_acc's two-level race (the reference's _two_level_race).
                sel = at_n[:, None]
                kc, cw = _pick_chunk(tl.max(tl.where(sel, pm, _NEG_INF), axis=0),
                                     tl.sum(tl.where(sel, psx, 0.0), axis=0), seed, pos + n_acc, NC_POW2, SPC)
                if FUSE_RACE:
                    win, x_win, kmax = _chunk_winner(
                        tl.max(tl.where(sel, rk, _NEG_INF), axis=0), tl.sum(tl.where(sel, ri, 0), axis=0),
                        tl.max(tl.where(sel, rx, _NEG_INF), axis=0), cw, NC_POW2, SPC)
                else:
                    tau_n = inv_t
                    if FILTER:
                        tau_n = tl.load(tau_ptr + b * R + n_acc)
                    win, x_win, kmax = _race_chunk_entries(
                        logits_ptr + b * stride_lb + n_acc * stride_lj, cw, tl_race_key(seed, pos + n_acc), inv_t,
                        excl, tau_n, V, CHUNK, RACE_BLOCK_V, VEC, PRUNE, FAST, FILTER)
                raced = (kc > _NEG_INF) & (kmax > _NEG_INF)
            tok_n = tl.where(raced, win, amax_n)
            x_t = tl.where(raced, x_win, x_amax_n)
    lp_n = tl.where(lse_n == _NEG_INF, _NEG_INF, x_t - lse_n)

    toks = tl.where(jr < n_acc, d, tl.where(at_n, tok_n, -1))
    lps = tl.where(jr < n_acc, x_d - lse, tl.where(at_n, lp_n, 0.0))
    tl.store(tok_ptr + b * R + jr, toks, mask=row_ok)
    tl.store(lp_ptr + b * R + jr, lps, mask=row_ok)
    tl.store(nemit_ptr + b, (n_acc + 1).to(tl.int32))
    if HAS_COUNTS:
        tl.atomic_add(counts_ptr + jr, tl.full([R_POW2], 1, tl.int64), mask=jr < n_acc)
    if FULL_Q:  # the race pass samples the correction or bonus
        race_row = tl.where(greedy, -1, n_acc)
        tl.store(race_i_ptr + b * 3 + 0, race_row.to(tl.int32))
        tl.store(race_i_ptr + b * 3 + 1, tl.where(use_res, 1, 0).to(tl.int32))
        tl.store(race_i_ptr + b * 3 + 2, amax_n.to(tl.int32))
        tl.store(race_f_ptr + b * 3 + 0, lse_n)
        tl.store(race_f_ptr + b * 3 + 1, lse_q_n)
        tl.store(race_f_ptr + b * 3 + 2, x_amax_n)


def _splits(rows: int, vocab: int, block_v: int, num_splits: int | None) -> tuple[int, int]:
    tiles = triton.cdiv(vocab, block_v)
    splits = max(1, min(tiles, triton.cdiv(PROGRAMS, rows))) if num_splits is None else num_splits
    tiles_per_split = triton.cdiv(tiles, max(1, min(splits, tiles)))
    return triton.cdiv(tiles, tiles_per_split), tiles_per_split  # no empty chunk


def _chunk_splits(rows: int, vocab: int, block_v: int, chunk: int, num_splits: int | None) -> tuple[int, int, int]:
    """Splits for one-hot mode: whole tiles, never straddling a race chunk, `spc` (a power of two)
    per chunk, so the walk merges each chunk's mass from its own splits.
    -> (splits, tiles_per_split, spc)"""
    tiles_per_chunk = chunk // block_v
    want = num_splits if num_splits is not None else triton.cdiv(PROGRAMS, rows)
    spc = min(tiles_per_chunk, triton.next_power_of_2(triton.cdiv(want, triton.cdiv(vocab, chunk))))
    tiles_per_split = tiles_per_chunk // spc
    return triton.cdiv(triton.cdiv(vocab, block_v), tiles_per_split), tiles_per_split, spc
