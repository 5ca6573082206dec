"""The filters' per-row thresholds on the GPU, without sorting: the rule (top_k, top_p, min_p) and
its reference, thresholds_reference, are in kernels/rejection_reference.py. No [rows, V] buffer and
no sort; rows that filter nothing return at once in every kernel.

Up to six launches (seven for fp16 logits, nine for fp32), all but the third spread over many
programs per row:
  1. _filter_stats_kernel, grid (rows, tiles): the row's largest key (atomic max), and the max of
     each GROUP-entry group and of each SUPER-group supergroup (buffers in the logits' dtype).
     One read of the row and no compaction: a gather inside this streaming pass, in every form
     tried, cost several times the read itself.
  2. _filter_weigh_kernel, grid (rows, splits), top_p rows without top_k only: the row's exact
     weight (relative to its max, fixed point) and a histogram of its entries by half-octave of
     weight.
  3. _threshold_kernel, grid rows: copies the groups that may hold a kept entry (_group_bar) to a
     per-row candidate buffer (_group_candidates), then finds the exact threshold over them
     (_row_tau), bit for bit the reference's. A row whose candidates overflow the buffer, or weigh
     less than top_p of the row, is flagged for kernels 4 and 5 instead. With Draws (the one-hot
     sampler) it also draws each sampled row whose threshold came from its candidates
     (_candidate_draws): every entry the filter keeps is a candidate.
  4. and 5. The whole-row search of the flagged rows (kernels/rejection_filter_whole.py).
The sampler then reads the thresholds (tau [B*(K+1)] fp32) in its row pass, its walk and full q's
race; its row pass skips the rows drawn here, and its walk takes their results (Draws.stats_i,
stats_f) instead of the planes'.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from graphrt.kernels.counters import shared_workspace
from graphrt.kernels.rejection_filter_select import (
    _TL_LOG2E_F32,
    _compact,
    _filters,
    _key_range,
    _key_value,
    _keys,
    _keys32,
    _reset_row,
    _row_tau,
    _select,
    _tl_weights,
)
from graphrt.kernels.rejection_filter_whole import whole_row_search
from graphrt.kernels.rejection_kernels import (
    _INT32_MAX,
    _NEG_INF,
    _chunk_race,
    _race_result,
    _scaled,
)
from graphrt.kernels.rng import tl_race_gumbel, tl_race_key

_KEY_SHIFT = {torch.bfloat16: 16, torch.float16: 13, torch.float32: 0}  # always-zero low bits
FILTER_CAP = 4096  # candidates a row keeps for the exact pass; past that the pass reads the row
FILTER_WARPS = 8  # the filters' kernels' warps (the threshold kernel's: LaunchConfig.filter_cand_warps)
GROUP = 16  # entries per group: kernel 1 keeps each group's max, kernel 3 takes candidates by whole groups
SUPER = 16  # groups per supergroup (at most): kernel 3 finds top_k's bar and the groups to take from their maxima


# ---------------------------------------------------------------------------------------------
# Triton
# ---------------------------------------------------------------------------------------------


@triton.jit
def _filter_stats_kernel(
    logits_ptr,  # [B, K+1, V] bf16/fp16/fp32, vocab dim contiguous
    temp_ptr, topk_ptr, topp_ptr, minp_ptr,  # [B] fp32, int32/int64, fp32, fp32 (as _threshold_kernel)
    kmax_ptr,  # [rows] int32, -(2**31 - 1) on entry: the row's largest key (atomic max)
    gmax_ptr,  # [rows, NG] the logits' dtype, out: each GROUP-entry group's largest logit (NaN as -inf)
    smax_ptr,  # [rows, NS] the same, out: each SUPER-group supergroup's
    flag_ptr,  # [1 + rows] int32: how many rows the threshold kernel flags, and which; the count zeroed here
    stride_lb, stride_lj, R, V, NG, NS,
    HAS_K: tl.constexpr, HAS_P: tl.constexpr, HAS_M: tl.constexpr, SHIFT: tl.constexpr,
    BLOCK_V: tl.constexpr,  # one tile per program, a multiple of GROUP * SUPER
    GROUP: tl.constexpr,
    SUPER: tl.constexpr,
    PDL: tl.constexpr = 0,
):
    row, b, active, inv_t, k, use_k, top_p, min_p = _filters(temp_ptr, topk_ptr, topp_ptr, minp_ptr, R, V, HAS_K,
                                                             HAS_P, HAS_M, PDL)
    if (row == 0) & (tl.program_id(1) == 0):  # the last call's kernels 4 and 5 have read it
        tl.store(flag_ptr, 0)
    if active:
        # a flat tile reshaped into groups: loaded through [supergroups, groups, GROUP] offsets it ran slower
        offs = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
        raw = tl.load(logits_ptr + b * stride_lb + (row % R) * stride_lj + offs, mask=offs < V,
                      other=float("-inf")).to(tl.float32)
        # one of the group's values: exact in its dtype
        m = tl.max(tl.reshape(tl.where(raw != raw, _NEG_INF, raw), [BLOCK_V // GROUP, GROUP]), axis=1)
        g = tl.program_id(1) * (BLOCK_V // GROUP) + tl.arange(0, BLOCK_V // GROUP)
        tl.store(gmax_ptr + row * NG + g, m.to(gmax_ptr.dtype.element_ty), mask=g < NG)
        NSB: tl.constexpr = BLOCK_V // (GROUP * SUPER)
        ms = tl.max(tl.reshape(m, [NSB, SUPER]), axis=1)
        sg = tl.program_id(1) * NSB + tl.arange(0, NSB)
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
def _candidate_draws(kept_ptr, vid_ptr, n, tau, rmax, x_max, inv_t, excl, seed, pos, BLOCK_V: tl.constexpr,
                     CHUNK: tl.constexpr, NC_POW2: tl.constexpr):
    """What the sampler's row pass and its two-level race find on a row from the n entries at
    kept_ptr (raw values in increasing vocab order; vid_ptr: their vocab ids), of which the filter
    keeps those at or over tau: (the lowest id of the raw max rmax (0 on a dead row), the kept row's
    lse, the race's winner with excl left out and its x; x -inf: nothing to race, the walk falls
    back to the argmax). x_max: the row's largest scaled logit. The race keys are the whole-row
    race's, bit for bit (same ops, same counter-based bits by vocab id); the entries the filter
    removes would only add -inf."""
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
        raw = tl.load(kept_ptr + slot, mask=slot < n, other=float("-inf"))
        inb = (slot < n) & (raw >= tau)
        vid = tl.load(vid_ptr + slot, mask=inb, other=0)
        x = tl.where(inb, _scaled(raw, inv_t), _NEG_INF)
        s_row += tl.exp(x - x_max)
        amax = tl.minimum(amax, tl.where(inb & (raw == rmax), vid, _INT32_MAX))
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
    # the second level over chunk cw's entries only (a strict > per lane, then the lowest id): one
    # masked pass over the kept entries, usually one tile, where a pass to find the chunk's slots
    # first cost a reload and two reductions
    rkey = tl_race_key(seed, pos)
    best = tl.full([BLOCK_V], _NEG_INF, tl.float32)
    best_i = tl.full([BLOCK_V], _INT32_MAX, tl.int32)
    best_x = tl.full([BLOCK_V], _NEG_INF, tl.float32)
    for t in range(0, tl.cdiv(n, BLOCK_V)):
        slot = t * BLOCK_V + offs0
        raw = tl.load(kept_ptr + slot, mask=slot < n, other=float("-inf"))
        vid = tl.load(vid_ptr + slot, mask=slot < n, other=0)
        inr = (slot < n) & (raw >= tau) & (vid // CHUNK == cw)
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
def _threshold_kernel(
    logits_ptr,  # [B, K+1, V] bf16/fp16/fp32, vocab dim contiguous
    temp_ptr,  # [B] fp32
    topk_ptr,  # [B] int32/int64 (HAS_K only)
    topp_ptr,  # [B] fp32 (HAS_P only)
    minp_ptr,  # [B] fp32 (HAS_M only)
    tau_ptr,  # [B*(K+1)] fp32 out: the row's threshold, -inf where nothing is filtered (not yet where flagged)
    need_ptr,  # [B*(K+1)] int32 out: 1 where the row's threshold needs the whole-row search (kernels 4, 5), else 0
    flag_ptr,  # [1 + rows] int32 (CAND): the count kernel 1 zeroed, then the rows flagged, in no order, appended
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
                tau, done, m = _row_tau(cand_ptr + row * CAP, n, key_bar, kmax, k, use_k,
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
                        if m < 0:  # top_k's kept entries (m of them) already hold every entry over tau
                            m = _compact(cand_ptr + row * CAP, gid_ptr + CAP // GROUP, n, -_INT32_MAX, tau,
                                         kept_ptr + row * CAP, kvid_ptr + row * CAP, SHIFT, CAND_BLOCK_V, GROUP)
                        amax, lse, win, x_win = _candidate_draws(
                            kept_ptr + row * CAP, kvid_ptr + row * CAP, m, tau, rmax, x_max, inv_t, excl,
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
    if CAND:
        if ~done:  # kernels 4 and 5 share out the flagged rows from this list
            tl.store(flag_ptr + 1 + tl.atomic_add(flag_ptr, 1, sem="relaxed"), row.to(tl.int32))
    if DRAW:  # every row, every call: the row pass and the walk read it
        tl.store(dstat_i_ptr + row, drawn.to(tl.int32))


_workspaces: dict[tuple, tuple[torch.Tensor, ...]] = {}


def _workspace(dev: torch.device, rows: int, cap: int, ng: int, ns: int,
               dtype: torch.dtype) -> tuple[torch.Tensor, ...] | None:
    """Kernels 1-3's buffers (as _threshold_kernel's arguments) for rows' >= rows, one per device,
    cap, ng, ns and dtype (counters.shared_workspace: None inside a capture that would have to grow
    it): the threshold kernel leaves each row it used as it found it."""
    def make(n):  # 1024 rows from the start: B = 256 at K = 3
        return (torch.full((n,), -(2**31 - 1), dtype=torch.int32, device=dev),
                torch.zeros(n, dtype=torch.int64, device=dev), torch.zeros((n, 64), dtype=torch.int32, device=dev),
                torch.empty((n, ng), dtype=dtype, device=dev), torch.empty((n, ns), dtype=dtype, device=dev),
                torch.empty((n, cap), dtype=torch.float32, device=dev),
                torch.empty((n, 2 * (cap // GROUP)), dtype=torch.int32, device=dev),
                torch.empty((n, cap), dtype=torch.float32, device=dev),
                torch.empty((n, cap), dtype=torch.int32, device=dev), torch.zeros(n + 1, dtype=torch.int32, device=dev))

    return shared_workspace(_workspaces, (dev, cap, ng, ns, dtype), rows, make)


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


def thresholds_triton(target_logits, temperature, top_k, top_p, min_p, *, block_v: int, pdl: int,
                      num_warps: int = FILTER_WARPS, cap: int = FILTER_CAP, stats_block_v: int = 8192,
                      programs: int = 1024, cand_block_v: int | None = None, cand_warps: int | None = None,
                      kept_block_v: int = 256, draws: Draws | None = None,
                      whole: torch.Tensor | None = None) -> torch.Tensor:
    """tau [B*(K+1)] fp32 for target_logits [B, K+1, V] bf16/fp16/fp32 (vocab dim contiguous),
    temperature [B] fp32 and the filter tensors ([B] int32/int64, [B] fp32, [B] fp32; None: off);
    the rule of kernels/rejection_reference.thresholds_reference. block_v: the tile of kernel 2
    and of the whole-row search (kernels 4 and 5), stats_block_v kernel 1's (one per program);
    programs: kernel 2's launches aim at about that many; cap: candidates per row (below GROUP: every row
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
        kmax, mass, hist, gmax, smax, cand, ids, kept, kvid, flagged = ws
        _filter_stats_kernel[(rows, triton.cdiv(v, stats_block_v))](
            target_logits, temperature, *filters, kmax, gmax, smax, flagged, *strides, ng, ns, BLOCK_V=stats_block_v,
            GROUP=GROUP, SUPER=sup, **flags, **launch)
        if top_p is not None:
            tiles = triton.cdiv(v, block_v)
            per_split = triton.cdiv(tiles, max(1, min(tiles, programs // rows)))
            _filter_weigh_kernel[(rows, triton.cdiv(tiles, per_split))](
                target_logits, temperature, *filters, kmax, mass, hist, *strides, per_split, BLOCK_V=block_v,
                **flags, **launch)
    else:
        kmax = mass = hist = gmax = smax = cand = ids = kept = kvid = flagged = tau  # valid pointers, unused
    d = draws
    sample = () if d is None else (d.draft_ids, d.num_draft_tokens if d.num_draft_tokens is not None else d.seed,
                                   d.seed, d.position, d.stats_i, d.stats_f)
    dstrides = (d.draft_ids.stride(0), d.draft_ids.stride(1)) if d is not None and d.draft_ids.dim() == 2 else (0, 0)
    draw = dict(DRAW=True, HAS_ND=d.num_draft_tokens is not None, CHUNK=d.chunk,
                NC_POW2=triton.next_power_of_2(triton.cdiv(v, d.chunk))) if d is not None else {}
    need = torch.empty(rows, dtype=torch.int32, device=dev) if whole is None else whole
    _threshold_kernel[(rows,)](
        target_logits, temperature, *filters, tau, need, flagged, kmax, mass, hist, gmax, smax, cand, ids, kept, kvid,
        *(sample or (tau,) * 6), *dstrides, *strides, ng, ns, cap, CAND=ws is not None,
        CAND_BLOCK_V=cand_block_v, KEPT_BLOCK_V=min(kept_block_v, cand_block_v), GROUP=GROUP, SUPER=sup, **flags,
        **draw, **dict(launch, num_warps=cand_warps or num_warps))
    whole_row_search(target_logits, temperature, filters, tau, need,
                     (kmax, mass, hist, flagged) if ws is not None else None,
                     block_v=block_v, flags=flags, launch=launch)
    return tau
