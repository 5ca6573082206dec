"""Vocab-parallel sampling's per-shard statistics and finishing step, each in Triton and in PyTorch.
The plan and the public entry points: kernels/vocab_parallel.py.

One stat layout serves both: a rank's send buffer is [_NPLANES, B*(K+1), SPS] int32, the sampler's
stat planes (kernels/rejection_kernels.py: _NUM_FPLANES fp32 planes stored as their bits, then the
2 int32 planes) over the SPS splits of its shard, each split SPLIT_LEN entries, never straddling a
race chunk. all_gather stacks the W buffers; _assemble_kernel lays them out as the single-GPU walk
reads them ([plane, row, split], splits in vocab order, the padding past V dropped, the draft's
logit moved to split 0), and the unchanged _walk_kernel finishes. The PyTorch versions below
(shard_stats_reference, assemble_reference, walk_reference) are that layout's definition on the
CPU: the same quantities, split by split, in torch ops.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from graphrt.kernels import rejection_kernels as rk
from graphrt.kernels.argmax import lowest_argmax
from graphrt.kernels.rejection_kernels import _NUM_FPLANES
from graphrt.kernels.rejection_reference import _sanitize, accepted, emitted, inv_temperature
from graphrt.kernels.rng import CHUNK_STREAM, bits_to_uniform, race_bits, race_gumbel

# The plane numbers as plain ints (they are tl.constexpr there) for indexing torch tensors.
_P_RAW_MAX, _P_MAX, _P_SUM, _P_QMAX, _P_QSUM, _P_RACE, _P_RACE_X, _P_XD, _P_YD, _P_XSUM = (
    getattr(rk, f"_P_{name}").value for name in ("RAW_MAX", "MAX", "SUM", "QMAX", "QSUM", "RACE", "RACE_X", "XD", "YD",
                                                 "XSUM"))
_NPLANES = _NUM_FPLANES + 2  # + raw argmax, fused race winner
_I_ARGMAX, _I_RACE = _NUM_FPLANES, _NUM_FPLANES + 1
INT32_MAX = 2**31 - 1
_NEG_INF = float("-inf")


# ---------------------------------------------------------------------------------------------
# argmax: each rank's (max, lowest local index), then the lowest rank holding the global max
# ---------------------------------------------------------------------------------------------


@triton.jit
def _argmax_finish_kernel(
    src_ptr,  # [W, 2, B] int32: per rank, the row max (fp32 bits) and its lowest local index
    val_ptr,  # [B] logits dtype out
    idx_ptr,  # [B] int64 out: global index
    B, V, SHARD, W,  # SHARD: the shard size of vocab_shard (rank r starts at min(r * SHARD, V))
    W_POW2: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    w = tl.arange(0, W_POW2)
    ok = w < W
    bits = tl.load(src_ptr + w.to(tl.int64) * 2 * B + row, mask=ok, other=0)
    v = tl.where(ok, bits.to(tl.float32, bitcast=True), float("-inf"))
    m = tl.max(v, axis=0)
    # Shards are in vocab order and each reports its lowest index of its max: the first rank
    # holding the max has the global lowest. All -inf: rank 0, index 0.
    first = tl.min(tl.where(ok & (v == m), w, W_POW2), axis=0)
    li = tl.load(src_ptr + first.to(tl.int64) * 2 * B + B + row)
    start = tl.minimum(first.to(tl.int64) * SHARD, V)
    tl.store(val_ptr + row, m.to(val_ptr.dtype.element_ty))  # m is a widened logit: exact
    tl.store(idx_ptr + row, start + li)


def argmax_finish_triton(gathered: torch.Tensor, vocab: int, shard: int, values: torch.Tensor,
                         indices: torch.Tensor) -> None:
    """gathered [W, 2, B] int32 -> values [B] (logits dtype), indices [B] int64, in place."""
    w, _, b = gathered.shape
    _argmax_finish_kernel[(b,)](gathered, values, indices, b, vocab, shard, w,
                                W_POW2=triton.next_power_of_2(w), num_warps=1)


def argmax_finish_reference(gathered: torch.Tensor, vocab: int, shard: int, values: torch.Tensor,
                            indices: torch.Tensor) -> None:
    w, _, b = gathered.shape
    v = gathered[:, 0].contiguous().view(torch.float32)  # [W, B]
    m = v.amax(0)
    ranks = torch.arange(w, device=v.device)[:, None].expand(w, b)
    first = torch.where(v == m, ranks, w).amin(0)
    cols = torch.arange(b, device=v.device)
    li = gathered[first, 1, cols].to(torch.int64)
    values.copy_(m)
    indices.copy_((first * shard).clamp(max=vocab) + li)


# ---------------------------------------------------------------------------------------------
# The sampler's stat planes of one shard (PyTorch; Triton: _row_stats_kernel with SHARDED)
# ---------------------------------------------------------------------------------------------


def shard_stats_reference(shard: torch.Tensor, drafts: torch.Tensor, temperature: torch.Tensor,
                          seed: torch.Tensor, position: torch.Tensor, kb: torch.Tensor, start: int,
                          vocab: int, split_len: int, sps: int) -> torch.Tensor:
    """shard [B, K+1, V_local] (entries [start, start + V_local) of a `vocab`-entry row), drafts
    [B, K], temperature [B] fp32, seed / position [B] int64, kb [B] int64 (clamped k_b) ->
    [_NPLANES, B*(K+1), sps] int32: what _row_stats_kernel stores with SHARDED and FUSE_RACE
    (XSUM on), sps splits of split_len entries; padding past V_local is -inf. Sums are torch's
    exp, not the kernel's exp2: equal to fp32 rounding; ids, maxima and race keys bit for bit."""
    b, r, vl = shard.shape
    k = r - 1
    dev = shard.device
    n = sps * split_len
    ninf = torch.tensor(_NEG_INF, device=dev)
    greedy, inv_t = inv_temperature(temperature)
    raw = torch.nn.functional.pad(shard.float(), (0, n - vl), value=_NEG_INF)
    x = _sanitize(raw * inv_t[:, None, None])  # [b, r, n]
    gid = start + torch.arange(n, device=dev)  # global ids
    split0 = start + torch.arange(sps, device=dev) * split_len  # each split's first global id
    j = torch.arange(r, device=dev)
    d = torch.full((b, r), -1, dtype=torch.int64, device=dev)
    d[:, :k] = drafts.to(torch.int64)
    excl = torch.where((j[None] < kb[:, None]) & (d >= 0) & (d < vocab), d, -1)  # [b, r]

    rmax, ridx = lowest_argmax(raw.view(b, r, sps, split_len))  # a dead split: index 0
    xs = x.view(b, r, sps, split_len)
    m = xs.amax(-1)
    e = torch.exp(xs - torch.where(m == _NEG_INF, 0.0, m)[..., None])  # -inf entries: 0
    s = e.sum(-1)
    sx = torch.where(gid.view(sps, split_len) == excl[:, :, None, None], 0.0, e).sum(-1)

    # The fused race: every split's best x + g, the row's draft left out (rows j < k_b).
    g = -torch.log(-torch.log(bits_to_uniform(race_bits(seed[:, None], position[:, None] + j, gid))))
    live = (gid < start + vl) & (gid != excl[..., None]) & ~greedy[:, None, None]
    key = torch.where(live, x + g, ninf).view(b, r, sps, split_len)
    km = key.amax(-1)
    pos = torch.arange(split_len, device=dev)
    li = torch.where(key == km[..., None], pos, split_len).amin(-1).clamp(max=split_len - 1)
    raced = km > _NEG_INF
    widx = torch.where(raced, split0 + li, INT32_MAX)
    wx = torch.where(raced, xs.gather(-1, li[..., None]).squeeze(-1), ninf)

    # The draft's logit in the split that holds it, -inf elsewhere (the finish takes the max).
    dc = d.clamp(0, vocab - 1) - start
    held = (j[None] < k) & (dc >= 0) & (dc < vl)
    x_d = x.gather(-1, dc.clamp(0, n - 1)[..., None]).squeeze(-1)
    xd = torch.where(held[..., None] & (torch.arange(sps, device=dev) == dc[..., None] // split_len),
                     x_d[..., None], ninf)

    out = torch.empty((_NPLANES, b * r, sps), dtype=torch.int32, device=dev)
    f = out[:_NUM_FPLANES].view(torch.float32)
    for plane, val in ((_P_RAW_MAX, rmax), (_P_MAX, m), (_P_SUM, s), (_P_QMAX, ninf), (_P_QSUM, 0.0),
                       (_P_RACE, km), (_P_RACE_X, wx), (_P_XD, xd), (_P_YD, ninf), (_P_XSUM, sx)):
        f[plane] = torch.as_tensor(val, dtype=torch.float32, device=dev).expand(b, r, sps).reshape(b * r, sps)
    out[_I_ARGMAX] = (split0 + ridx).reshape(b * r, sps).to(torch.int32)
    out[_I_RACE] = widx.reshape(b * r, sps).to(torch.int32)
    return out


# ---------------------------------------------------------------------------------------------
# Assemble: W ranks' planes -> the single-GPU walk's planes
# ---------------------------------------------------------------------------------------------


@triton.jit
def _assemble_kernel(
    src_ptr,  # [W, NPLANES, ROWS, SPS] int32: every rank's planes, as all_gather stacks them
    dst_ptr,  # [NPLANES, ROWS, SPLITS] int32: the walk's planes (SPLITS <= W * SPS)
    ROWS, SPS, SPLITS, W,
    NPLANES: tl.constexpr,
    XD: tl.constexpr,  # the draft-logit plane: its split 0 gets the max over every split
    G_POW2: tl.constexpr,  # >= W * SPS
):
    p = tl.program_id(0).to(tl.int64)
    row = tl.program_id(1).to(tl.int64)
    g = tl.arange(0, G_POW2)
    ok = g < W * SPS
    rank = (g // SPS).to(tl.int64)
    src = rank * NPLANES * ROWS * SPS + (p * ROWS + row) * SPS + g % SPS
    bits = tl.load(src_ptr + src, mask=ok, other=0)
    # One split per row holds the draft (or none, when no draft): the rest are -inf.
    xd = tl.max(tl.where(ok, bits.to(tl.float32, bitcast=True), float("-inf")), axis=0)
    bits = tl.where((p == XD) & (g == 0), xd.to(tl.int32, bitcast=True), bits)
    tl.store(dst_ptr + (p * ROWS + row) * SPLITS + g, bits, mask=g < SPLITS)


def assemble_triton(gathered: torch.Tensor, splits: int) -> torch.Tensor:
    """gathered [W, _NPLANES, rows, SPS] int32 -> [_NPLANES, rows, splits] int32."""
    w, planes, rows, sps = gathered.shape
    out = torch.empty((planes, rows, splits), dtype=torch.int32, device=gathered.device)
    _assemble_kernel[(planes, rows)](gathered, out, rows, sps, splits, w, NPLANES=planes, XD=_P_XD,
                                     G_POW2=triton.next_power_of_2(w * sps), num_warps=1)
    return out


def assemble_reference(gathered: torch.Tensor, splits: int) -> torch.Tensor:
    w, planes, rows, sps = gathered.shape
    cat = gathered.permute(1, 2, 0, 3).reshape(planes, rows, w * sps).contiguous()
    out = cat[..., :splits].contiguous()
    xd = cat[_P_XD].view(torch.float32).amax(-1)
    out[_P_XD, :, 0] = xd.view(torch.int32)
    return out


# ---------------------------------------------------------------------------------------------
# The walk on assembled planes (PyTorch; Triton: _walk_kernel with FUSE_RACE)
# ---------------------------------------------------------------------------------------------


def _merge_lse(m: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """[..., n] partial (max, sum-exp) -> lse [...] (-inf where every part is)."""
    mm = m.amax(-1)
    w = torch.where(m > _NEG_INF, s * torch.exp(m - torch.where(mm == _NEG_INF, 0.0, mm)[..., None]), 0.0)
    return torch.where(mm == _NEG_INF, _NEG_INF, mm + torch.log(w.sum(-1)))


def walk_reference(planes: torch.Tensor, drafts: torch.Tensor, temperature: torch.Tensor, seed: torch.Tensor,
                   position: torch.Tensor, kb: torch.Tensor, vocab: int, spc: int,
                   counts: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """planes [_NPLANES, B*(K+1), splits] int32 (assembled) -> (token_ids [B, K+1] int64, num_emitted
    [B] int32, logprobs [B, K+1] fp32), counts [K] int64 accumulated: _walk_kernel's rules."""
    b, k = drafts.shape
    r = k + 1
    splits = planes.shape[-1]
    dev = planes.device
    f = planes[:_NUM_FPLANES].view(torch.float32).view(_NUM_FPLANES, b, r, splits)
    i = planes[_NUM_FPLANES:].view(2, b, r, splits).to(torch.int64)
    greedy, inv_t = inv_temperature(temperature)
    rmax = f[_P_RAW_MAX].amax(-1)
    amax = torch.where(f[_P_RAW_MAX] == rmax[..., None], i[0], INT32_MAX).amin(-1)  # [b, r]
    x_amax = _sanitize(rmax * inv_t[:, None])
    lse = _merge_lse(f[_P_MAX], f[_P_SUM])
    d = drafts.to(torch.int64)
    x_d = f[_P_XD, :, :k, 0]
    n_acc = accepted(d, vocab, x_d, lse, amax, greedy, seed, position, kb)
    rows = torch.arange(b, device=dev)

    # Row n_acc's two-level race from its splits: chunks on their mass without the draft, then the
    # winning chunk's best split winner (the row pass raced every split, draft excluded).
    nc = -(-splits // spc)
    pad = nc * spc - splits

    def per_chunk(plane, fill):
        return torch.nn.functional.pad(plane[rows, n_acc], (0, pad), value=fill).view(b, nc, spc)

    lse_c = _merge_lse(per_chunk(f[_P_MAX], _NEG_INF), per_chunk(f[_P_XSUM], 0.0))
    ckey = torch.where(lse_c > _NEG_INF, lse_c + race_gumbel(seed, position + n_acc, nc, CHUNK_STREAM), _NEG_INF)
    kc, cw = lowest_argmax(ckey)
    rk = per_chunk(f[_P_RACE], _NEG_INF)[rows, cw]  # [b, spc]
    ri = per_chunk(i[1], INT32_MAX)[rows, cw]
    rx = per_chunk(f[_P_RACE_X], _NEG_INF)[rows, cw]
    km = rk.amax(-1)
    win = torch.where(rk == km[:, None], ri, INT32_MAX).amin(-1)
    x_win = torch.where(ri == win[:, None], rx, _NEG_INF).amax(-1)
    raced = ~greedy & (kc > _NEG_INF) & (km > _NEG_INF)
    tok_n = torch.where(raced, win, amax[rows, n_acc])
    x_t = torch.where(raced, x_win, x_amax[rows, n_acc])
    lse_n = lse[rows, n_acc]
    lp_n = torch.where(lse_n == _NEG_INF, _NEG_INF, x_t - lse_n)
    return emitted(d, x_d - lse[:, :k], n_acc, tok_n, lp_n, counts)
