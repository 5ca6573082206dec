"""Full q (the caller passed draft logits): the race pass and the finish, kernels 3 and 4 of the
sampler (kernels/rejection.py launches 1 and 2, the row pass and the walk, in every mode).

A rejection in full q draws from the residual max(0, p - q) and the bonus from p; both need every
entry of the row, so the race has one level over the whole row (no two-level chunk race) and
cannot join the row pass: it needs the row's lse and the walk's decision first. The walk leaves
per request the one row to race (race_i / race_f); greedy requests skip both kernels' work.
  3. _race_kernel, grid (B, splits): per split, the race over p (x + g) and, where the walk
     rejected, the residual race (log(max(0, p - q)) + g), each winner with its x.
  4. _finish_kernel, grid B: merges the splits and writes the token and its logprob (the winners
     carry their x, so no logit is re-read); an all-zero residual (p == q) falls back to the race
     over p.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from graphrt.kernels.pdl import pdl_launch, release_dependents
from graphrt.kernels.rejection_kernels import (
    _INT32_MAX,
    _NEG_INF,
    WARPS,
    _inv_temperature,
    _keep,
    _pdl_wait,
    _race_result,
    _scaled,
    _splits,
    _tile_offsets,
)
from graphrt.kernels.rng import tl_race_gumbel, tl_race_key


@triton.jit
def _race_kernel(
    logits_ptr,  # [B, K+1, V]
    qlogits_ptr,  # [B, K, V]
    temp_ptr,  # [B] fp32
    seed_ptr,  # [B] int64
    pos_ptr,  # [B] int64
    race_i_ptr,  # [B, 3] int32 from _walk_kernel
    race_f_ptr,  # [B, 3] fp32 from _walk_kernel
    part_k_ptr,  # [2, B, SPLITS] fp32 out: best key per chunk (p race, residual race)
    part_i_ptr,  # [2, B, SPLITS] int32 out: its lowest index
    part_x_ptr,  # [2, B, SPLITS] fp32 out: its x
    tau_ptr,  # [B*(K+1)] fp32: the filters' thresholds (FILTER only)
    stride_lb, stride_lj, stride_qb, stride_qj,
    R, V, SPLITS, TILES_PER_SPLIT,
    BLOCK_V: tl.constexpr,  # vocab entries loaded per tile
    VEC: tl.constexpr = 8,
    PDL: tl.constexpr = 0,
    FILTER: tl.constexpr = False,  # entries under the race row's tau are -inf
):
    """Full q: the residual race (and the race over p, its fallback when p == q, and the bonus
    token's race) over one row per sampled request, one level: the residual needs every entry."""
    _pdl_wait(PDL)
    b = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    race_row = tl.load(race_i_ptr + b * 3).to(tl.int64)
    if race_row >= 0:  # greedy requests have their token already
        use_res = tl.load(race_i_ptr + b * 3 + 1) != 0
        lse_p = tl.load(race_f_ptr + b * 3)
        lse_q = tl.load(race_f_ptr + b * 3 + 1)
        _, inv_t = _inv_temperature(temp_ptr, b)
        tau = inv_t
        if FILTER:
            tau = tl.load(tau_ptr + b * R + race_row)
        rkey = tl_race_key(tl.load(seed_ptr + b), tl.load(pos_ptr + b) + race_row)
        row_ptr = logits_ptr + b * stride_lb + race_row * stride_lj
        q_ptr = qlogits_ptr + b * stride_qb + race_row * stride_qj
        toffs = split * TILES_PER_SPLIT * BLOCK_V + _tile_offsets(BLOCK_V, VEC)
        lim = tl.minimum(V, (split + 1) * TILES_PER_SPLIT * BLOCK_V)  # end of this chunk
        best = tl.full([BLOCK_V // VEC, VEC], _NEG_INF, tl.float32)
        best_i = tl.full([BLOCK_V // VEC, VEC], _INT32_MAX, tl.int32)
        best_x = tl.full([BLOCK_V // VEC, VEC], _NEG_INF, tl.float32)
        rbest = tl.full([BLOCK_V // VEC, VEC], _NEG_INF, tl.float32)
        rbest_i = tl.full([BLOCK_V // VEC, VEC], _INT32_MAX, tl.int32)
        rbest_x = tl.full([BLOCK_V // VEC, VEC], _NEG_INF, tl.float32)
        # Software-pipelined: the next tile's load is in flight while this one is raced.
        raw = tl.load(row_ptr + toffs, mask=toffs < V, other=float("-inf")).to(tl.float32)
        for t in range(TILES_PER_SPLIT):
            offs = toffs + t * BLOCK_V
            nxt = offs + BLOCK_V
            raw_next = tl.load(row_ptr + nxt, mask=nxt < lim, other=float("-inf")).to(tl.float32)
            inb = offs < V
            x = _scaled(_keep(raw, tau, FILTER), inv_t)
            g = tl_race_gumbel(rkey, offs)
            key = tl.where(inb, x + g, _NEG_INF)
            win = key > best
            best = tl.where(win, key, best)
            best_i = tl.where(win, offs, best_i)
            best_x = tl.where(win, x, best_x)
            if use_res:
                y = _scaled(tl.load(q_ptr + offs, mask=inb, other=float("-inf")).to(tl.float32), inv_t)
                p = tl.where(lse_p > _NEG_INF, tl.exp(x - lse_p), 0.0)
                q = tl.where(lse_q > _NEG_INF, tl.exp(y - lse_q), 0.0)
                res = tl.maximum(p - q, 0.0)
                rkey_v = tl.where(inb & (res > 0), tl.log(res) + g, _NEG_INF)
                rwin = rkey_v > rbest
                rbest = tl.where(rwin, rkey_v, rbest)
                rbest_i = tl.where(rwin, offs, rbest_i)
                rbest_x = tl.where(rwin, x, rbest_x)
            raw = raw_next
        if PDL == 2:
            release_dependents()
        o = b * SPLITS + split
        plane = tl.num_programs(0).to(tl.int64) * SPLITS
        km, ki, kx = _race_result(best, best_i, best_x)
        tl.store(part_k_ptr + o, km)
        tl.store(part_i_ptr + o, ki)
        tl.store(part_x_ptr + o, kx)
        rm, ri, rx = _race_result(rbest, rbest_i, rbest_x)
        tl.store(part_k_ptr + plane + o, rm)
        tl.store(part_i_ptr + plane + o, ri)
        tl.store(part_x_ptr + plane + o, rx)


@triton.jit
def _merge_race(k_ptr, i_ptr, x_ptr, o, sm):
    """Race chunks -> (best key, its lowest index, its x)."""
    keys = tl.load(k_ptr + o, mask=sm, other=_NEG_INF, cache_modifier=".cg")
    idxs = tl.load(i_ptr + o, mask=sm, other=_INT32_MAX, cache_modifier=".cg")
    xs = tl.load(x_ptr + o, mask=sm, other=_NEG_INF, cache_modifier=".cg")
    km = tl.max(keys, axis=0)
    win = tl.min(tl.where(keys == km, idxs, _INT32_MAX), axis=0)
    return km, win.to(tl.int64), tl.max(tl.where(idxs == win, xs, _NEG_INF), axis=0)


@triton.jit
def _finish_kernel(
    race_i_ptr,  # [B, 3] int32 from _walk_kernel: race row (-1: none), residual?, argmax
    race_f_ptr,  # [B, 3] fp32 from _walk_kernel: lse of p and of q on the race row, x at its argmax
    part_k_ptr,  # [2, B, SPLITS] fp32 from _race_kernel
    part_i_ptr,  # [2, B, SPLITS] int32
    part_x_ptr,  # [2, B, SPLITS] fp32
    tok_ptr,  # [B, K+1] int64 out
    lp_ptr,  # [B, K+1] fp32 out
    R, SPLITS,
    SPLITS_POW2: tl.constexpr,  # all race splits of a request in one tile
    PDL: tl.constexpr = 0,
):
    _pdl_wait(PDL)
    b = tl.program_id(0).to(tl.int64)
    race_row = tl.load(race_i_ptr + b * 3).to(tl.int64)
    if race_row >= 0:
        plane = tl.num_programs(0).to(tl.int64) * SPLITS
        use_res = tl.load(race_i_ptr + b * 3 + 1) != 0
        amax_n = tl.load(race_i_ptr + b * 3 + 2).to(tl.int64)
        lse_n = tl.load(race_f_ptr + b * 3)
        x_amax = tl.load(race_f_ptr + b * 3 + 2)
        s = tl.arange(0, SPLITS_POW2)
        sm = s < SPLITS
        o = b * SPLITS + s
        km, win, xw = _merge_race(part_k_ptr, part_i_ptr, part_x_ptr, o, sm)
        rm, rwin, rxw = _merge_race(part_k_ptr + plane, part_i_ptr + plane, part_x_ptr + plane, o, sm)
        tok = tl.where(km > _NEG_INF, win, amax_n)
        x_t = tl.where(km > _NEG_INF, xw, x_amax)
        # An all-zero residual (p == q) falls back to the race over p.
        res = use_res & (rm > _NEG_INF)
        tok = tl.where(res, rwin, tok)
        x_t = tl.where(res, rxw, x_t)
        tl.store(tok_ptr + b * R + race_row, tok)
        tl.store(lp_ptr + b * R + race_row, tl.where(lse_n == _NEG_INF, _NEG_INF, x_t - lse_n))


def race_and_finish(target_logits, draft_logits, temperature, seed, position, race_i, race_f, tok, lp, tau, *,
                    block_v, vec, num_splits, pdl):
    """Launch kernels 3 and 4 after the walk. target_logits [B, K+1, V] and draft_logits [B, K, V]
    bf16/fp16/fp32 (vocab dim contiguous), temperature [B] fp32, seed / position [B] int64,
    race_i [B, 3] int32 and race_f [B, 3] fp32 from the walk; writes tok [B, K+1] int64 and
    lp [B, K+1] fp32 at each sampled request's race row; tau [B*(K+1)] fp32: the filters'
    thresholds (None: no filter). block_v: the race tile; splits per row
    num_splits, or about PROGRAMS programs in all."""
    b, r, v = target_logits.shape
    dev = target_logits.device
    splits, tiles = _splits(b, v, block_v, num_splits)
    part_k = torch.empty((2, b, splits), dtype=torch.float32, device=dev)
    part_i = torch.empty((2, b, splits), dtype=torch.int32, device=dev)
    part_x = torch.empty((2, b, splits), dtype=torch.float32, device=dev)
    launch = pdl_launch(bool(pdl))
    _race_kernel[(b, splits)](
        target_logits, draft_logits, temperature, seed, position, race_i, race_f, part_k, part_i, part_x,
        tau if tau is not None else race_f, target_logits.stride(0), target_logits.stride(1),
        draft_logits.stride(0), draft_logits.stride(1),
        r, v, splits, tiles, BLOCK_V=block_v, VEC=vec, num_warps=WARPS, enable_fp_fusion=False,
        PDL=pdl, FILTER=tau is not None, **launch,
    )
    _finish_kernel[(b,)](
        race_i, race_f, part_k, part_i, part_x, tok, lp, r, splits,
        SPLITS_POW2=triton.next_power_of_2(splits), PDL=pdl, num_warps=1 if splits <= 128 else 4,
        enable_fp_fusion=False, **launch,
    )
