"""Fused speculative rejection sampler: accept a prefix of the drafts, emit one correction/bonus token.

Per request b with k_b drafts (row j of target_logits predicts the token at position[b] + j):

  greedy = not (temperature > 0)          (0, negative inside a graph, and NaN are greedy)
  inv_t  = 1 if greedy else 1 / temperature           (fp32, correctly rounded in both versions)
  x_j    = logits[b, j].float() * inv_t, NaN -> -inf, +inf -> fp32 max;  lse_j = logsumexp(x_j)
  p_j    = exp(x_j - lse_j); a row with lse_j = -inf is dead: p_j = 0, argmax_j = 0
  argmax_j = lowest index among the maxima of the raw row (NaN never wins)

  walk j = 0 .. k_b-1 with draft d (an id outside [0, V) is rejected and never used as an index):
    greedy:  accept iff d == argmax_j and the row is not dead
    one-hot: accept iff u_j < p_j(d)                  u_j = accept_uniform(seed, position + j)
    full q:  accept iff u_j * q_j(d) < p_j(d)         q_j = softmax of the draft logits, same rules
  first rejection at j -> correction from row j, then stop:
    greedy:  argmax_j
    one-hot: two-level Gumbel-max race over x_j, d excluded (below)
    full q:  race over log(max(0, p_j - q_j)) + g; all-zero residual -> race over x_j + g
    every key -inf (dead row, or only d was alive) -> argmax_j
  all k_b accepted -> bonus from row k_b: argmax (greedy), else the race over x, nothing excluded
  (two-level without draft logits, one level over x + g in full q)
  logprob of an emitted token t at row i: x_i[t] - lse_i (-inf on a dead row)

  g(v) = gumbel(race_bits(seed, position + j, v)). The two-level race (_two_level_race): the vocab
  splits into chunks of RACE_CHUNK entries; chunk c races on lse(x over c, d excluded) +
  gumbel(chunk_bits(seed, position + j, c)), then the winning chunk's entries on x + g. That draws
  v with probability p(v) / (1 - p(d)) exactly like one race over the row, but hashes one chunk per
  request instead of V entries. Full q races the whole row in one level: its residual needs every
  entry anyway.

Ties in races and argmaxes go to the lowest index, so every emitted id is in [0, V) whatever the
input. The Triton path matches the reference token for token: the races and argmaxes are exact
(same fp32 ops, same RNG bits), and the only fp32 values computed differently are lse/exp/log, whose
last-ulp differences flip a decision only when u lands within ~1e-7 of p(d) or two race keys tie to
~1e-6.

Triton structure (no [B*(K+1), V] fp32 intermediate; target logits read once in their own dtype).
Tiles are [lanes, 8] (16 bytes of bf16 per lane); two launches (four in full q), chained by
programmatic dependent launch (PDL) on Hopper so that each kernel's launch hides behind the one
before:
  1. _row_stats_kernel, grid (B*(K+1), splits): per split of the vocab, the raw (max, lowest
     argmax), the online (max, sum-exp) of the scaled row, the sum without the row's draft (one-hot:
     a chunk's mass for the correction's race) and the draft logits' stats in full-q mode. One-hot
     splits never straddle a race chunk. The hot loop keeps per-lane raw-domain state and does one
     rescale per lane and one exp2 per entry (_stats_step); the argmax keeps only the tile where
     each lane's max was reached and re-reads that tile once at the end. Inputs where the fast lse
     is not the reference's (a +inf logit, x overflowing) rerun the split through the exact
     sanitised loop. The split holding row j's draft also stores its logit (and q's), so the walk
     reads nothing that depends on another read. When `fuse_race` (B*(K+1) <= 8, one-hot) it also
     races every row's entries per split, draft excluded, so the walk reads no logits.
  2. _walk_kernel, grid B: merges the splits, walks the drafts, writes the accepted part,
     num_emitted, acceptance_counts and the correction/bonus token: greedy's argmax, or one-hot's
     two-level race (_pick_chunk: the chunks' keys from the split stats; then _chunk_winner over
     the fused race's split winners, or _race_chunk_entries: the winning chunk's RACE_CHUNK entries
     raced here, pruned exactly by _race_tile where asked: a tile is raced only if some entry's
     upper bound raw * inv_t + (-log(1 - u)) beats the best key so far, so such tiles cost the
     hash and one fast lg2 per entry instead of two exact logs). In full q it leaves the
     one row that needs a race in a small workspace.
  3. _race_kernel, grid (B, splits), full q only: the residual race (and the race over p, its
     fallback) over that one row per sampled request; greedy requests return at once.
  4. _finish_kernel, grid B, full q only: merges the race splits and writes the token and its
     logprob (the winners carry their x, so no logit is re-read).
The race cannot join the row pass at large batches: it needs the row's lse and the walk's decision
first; done for every row there it would make that pass compute-bound.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from graphrt.kernels.argmax import lowest_argmax
from graphrt.kernels.counters import capturing
from graphrt.kernels.pdl import (
    pdl_enabled,
    pdl_launch,
    release_dependents,
    wait_for_producer,
    wait_for_producer_release_later,
)
from graphrt.kernels.rng import (
    CHUNK_STREAM,
    accept_uniform,
    race_gumbel,
    tl_accept_uniform,
    tl_bits_to_uniform,
    tl_chunk_key,
    tl_gumbel,
    tl_gumbel_upper_bound,
    tl_race_bits,
    tl_race_gumbel,
    tl_race_key,
)

_LOGIT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_FLT_MAX = 3.4028234663852886e38
_TL_FLT_MAX = tl.constexpr(_FLT_MAX)
_INT32_MAX = tl.constexpr(2**31 - 1)
_NEG_INF = tl.constexpr(float("-inf"))
_LOG2E = tl.constexpr(1.4426950408889634)
# Stat planes of the row pass workspace ([planes, rows, splits] fp32; x_d / y_d use split 0 only).
_P_RAW_MAX, _P_MAX, _P_SUM, _P_QMAX, _P_QSUM, _P_RACE, _P_RACE_X, _P_XD, _P_YD, _P_XSUM = (
    tl.constexpr(i) for i in range(10))
_NUM_FPLANES = 10
# Vocab chunk of the two-level race (one-hot q and K = 0): part of the sampling definition, so the
# reference and the kernels share it; every row pass split lies inside one chunk.
RACE_CHUNK = 8192


def _check_race_chunk(chunk: int | None, v: int) -> int:
    """The race chunk for a vocabulary of v. One chunk of at least v entries draws the same tokens
    whatever its size (its own Gumbel never decides anything), so it is cut to the next power of
    two >= v: at a test's V = 30 the interpreter then walks 2 tiles of 16 instead of 512."""
    chunk = RACE_CHUNK if chunk is None else chunk
    if chunk < 1 or chunk & (chunk - 1):
        raise ValueError(f"race_chunk must be a power of two, got {chunk}")
    return min(chunk, triton.next_power_of_2(max(1, v)))


class RejectionOutput(NamedTuple):
    token_ids: torch.Tensor  # [B, K+1] int64, -1 after the last emitted token
    num_emitted: torch.Tensor  # [B] int32 in [1, k_b + 1]
    logprobs: torch.Tensor  # [B, K+1] fp32, 0.0 after the last emitted token


@dataclass(frozen=True)
class LaunchConfig:
    """How one call is launched; never what it draws (every config gives the same tokens).

    block_v, num_warps: the row pass's tile (vocab entries) and warps. target_programs: how many
    row pass programs to aim for (splits per row ~ target_programs / rows); num_splits: splits per
    row instead (and full q's race pass splits). fuse_race (one-hot only): the row pass also races
    every split, draft excluded, so the walk reads no logits. race_block_v: the tile of the one-hot
    walk's race over a chunk (cut to the chunk) or of full q's race pass; race_warps,
    race_programs: that race pass. prune: skip the one-hot race's tiles that cannot win
    (_race_tile), wherever it runs. walk_warps: None picks 16 for the walk's chunk race (8 when
    pruned), else 1 or 4 by the number of splits the walk merges. pdl: programmatic dependent
    launch (kernels/pdl.py): 0 off, 1 dependents released at the start, 2 released only after the
    row pass's and the race pass's hot loops; off where pdl_enabled is not.
    """

    block_v: int = 1024
    num_warps: int = 4
    target_programs: int = 1024
    num_splits: int | None = None
    fuse_race: bool = False
    race_block_v: int = 1024
    race_warps: int = 4
    race_programs: int = 1024
    prune: bool = False
    walk_warps: int | None = None
    pdl: int = 0


def launch_config(batch: int, k: int, full_q: bool) -> LaunchConfig:
    """The default launch by batch size and rows (B*(K+1)), from scripts/rejection_sweep.py at
    K = 3, V = 128256 bf16 on the H100 and the H200.

    - ~1024 row pass programs: about two waves of a few programs per SM.
    - The row pass races too (fuse_race) only up to 8 rows: it costs two logs per entry of every
      row, against one chunk per request in the walk.
    - 1024-entry row tiles, except full q past 8 rows (2048: it reads two logit rows per tile).
    - The walk's chunk race: below B = 128 each request's program is alone with its latency, so the
      whole chunk is one unpruned tile on 16 warps (the prune test is a block-wide reduction and a
      branch per tile); from B = 128 programs share SMs and pruned 2048-entry tiles on 8 warps do
      less work. The fused race has one tile per split: pruning there only costs.
    - PDL releases dependents at the start from 9 to 128 rows; otherwise late: at B = 1 the walk's
      early launch only delays the row pass's programs, and at large B an early race launch holds
      SM slots the row pass needs.
    """
    rows = batch * (k + 1)
    prune = batch >= 128
    return LaunchConfig(block_v=2048 if full_q and rows > 8 else 1024, fuse_race=rows <= 8 and not full_q,
                        race_block_v=1024 if full_q else 2048 if prune else RACE_CHUNK, prune=prune,
                        pdl=1 if 8 < rows <= 128 else 2)


# ---------------------------------------------------------------------------------------------
# Validation (metadata only; never reads a CUDA tensor's values)
# ---------------------------------------------------------------------------------------------


def _validate(target_logits, draft_token_ids, temperature, seed, position, draft_logits,
              num_draft_tokens, acceptance_counts, out):
    def need(cond, msg):
        if not cond:
            raise ValueError(msg)

    for name, t in (("target_logits", target_logits), ("draft_token_ids", draft_token_ids),
                    ("temperature", temperature), ("seed", seed), ("position", position)):
        need(isinstance(t, torch.Tensor), f"{name} must be a torch.Tensor, got {type(t).__name__}")
    shape = tuple(target_logits.shape)
    need(target_logits.dim() == 3, f"target_logits must be [B, K+1, V], got shape {shape}")
    b, r, v = target_logits.shape
    k = r - 1
    need(b >= 1 and r >= 1 and v >= 1, f"target_logits must have B, K+1, V >= 1, got {shape}")
    need(target_logits.dtype in _LOGIT_DTYPES,
         f"target_logits dtype must be bf16/fp16/fp32, got {target_logits.dtype}")
    need(target_logits.stride(2) == 1, "target_logits must be contiguous in the vocab dim")
    dev = target_logits.device
    ids_shape = tuple(draft_token_ids.shape)
    need(draft_token_ids.dim() == 2, f"draft_token_ids must be [B, K], got shape {ids_shape}")
    need(ids_shape == (b, k), f"draft_token_ids shape {ids_shape} does not match target_logits "
         f"[B={b}, K+1={r}]: expected [{b}, {k}]")
    need(not draft_token_ids.dtype.is_floating_point and not draft_token_ids.dtype.is_complex
         and draft_token_ids.dtype != torch.bool,
         f"draft_token_ids must have an integer dtype, got {draft_token_ids.dtype}")
    need(tuple(temperature.shape) == (b,), f"temperature must be [{b}], got {tuple(temperature.shape)}")
    need(temperature.dtype == torch.float32, f"temperature must be float32, got {temperature.dtype}")
    need(tuple(seed.shape) == (b,) and seed.dtype == torch.int64,
         f"seed must be [{b}] int64, got {tuple(seed.shape)} {seed.dtype}")
    need(tuple(position.shape) == (b,) and position.dtype == torch.int64,
         f"position must be [{b}] int64, got {tuple(position.shape)} {position.dtype}")
    tensors = {"draft_token_ids": draft_token_ids, "temperature": temperature, "seed": seed,
               "position": position}
    if draft_logits is not None:
        need(isinstance(draft_logits, torch.Tensor) and draft_logits.dim() == 3
             and tuple(draft_logits.shape) == (b, k, v),
             f"draft_logits must be [{b}, {k}, {v}], got "
             f"{tuple(draft_logits.shape) if isinstance(draft_logits, torch.Tensor) else draft_logits}")
        need(draft_logits.dtype in _LOGIT_DTYPES,
             f"draft_logits dtype must be bf16/fp16/fp32, got {draft_logits.dtype}")
        need(k == 0 or draft_logits.stride(2) == 1, "draft_logits must be contiguous in the vocab dim")
        tensors["draft_logits"] = draft_logits
    if num_draft_tokens is not None:
        need(isinstance(num_draft_tokens, torch.Tensor) and tuple(num_draft_tokens.shape) == (b,)
             and num_draft_tokens.dtype in (torch.int32, torch.int64),
             f"num_draft_tokens must be [{b}] int32/int64")
        tensors["num_draft_tokens"] = num_draft_tokens
    if acceptance_counts is not None:
        need(isinstance(acceptance_counts, torch.Tensor) and tuple(acceptance_counts.shape) == (k,)
             and acceptance_counts.dtype == torch.int64 and acceptance_counts.is_contiguous(),
             f"acceptance_counts must be a contiguous [{k}] int64 tensor")
        tensors["acceptance_counts"] = acceptance_counts
    if out is not None:
        need(isinstance(out, tuple | list) and len(out) == 3,
             "out must be (token_ids, num_emitted, logprobs)")
        for name, t, shape, dtype in (("out.token_ids", out[0], (b, r), torch.int64),
                                      ("out.num_emitted", out[1], (b,), torch.int32),
                                      ("out.logprobs", out[2], (b, r), torch.float32)):
            need(isinstance(t, torch.Tensor) and tuple(t.shape) == shape and t.dtype == dtype
                 and t.is_contiguous(), f"{name} must be a contiguous {list(shape)} {dtype} tensor")
            tensors[name] = t
    for name, t in tensors.items():
        need(t.device == dev, f"{name} is on {t.device} but target_logits is on {dev}")
    # Value checks would sync a CUDA tensor (and are illegal during capture): CPU tensors only.
    if dev.type == "cpu" and not capturing():
        need(not bool((temperature < 0).any()), "temperature must be >= 0 (0 means greedy)")
        if num_draft_tokens is not None:
            need(bool(((num_draft_tokens >= 0) & (num_draft_tokens <= k)).all()),
                 f"num_draft_tokens must lie in [0, K={k}]")


def _sanitize(x: torch.Tensor) -> torch.Tensor:
    x = torch.where(torch.isnan(x), torch.full_like(x, float("-inf")), x)
    return x.clamp(max=_FLT_MAX)


def _logsumexp(x: torch.Tensor) -> torch.Tensor:
    # torch.logsumexp of an all -inf row is -inf; kept explicit so a dead row is obvious.
    lse = torch.logsumexp(x, dim=-1)
    return torch.where(x.amax(dim=-1) == float("-inf"), torch.full_like(lse, float("-inf")), lse)


# ---------------------------------------------------------------------------------------------
# PyTorch reference
# ---------------------------------------------------------------------------------------------


def _two_level_race(x: torch.Tensor, g: torch.Tensor, seed: torch.Tensor, position: torch.Tensor,
                    chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Gumbel-max sample of softmax(x) in two levels: race the vocab chunks of `chunk` entries on
    their log-mass (lse of the chunk + a chunk Gumbel), then the entries of the winning chunk on
    x + g. Chunk c wins with probability mass_c / total and entry v with p_v / mass_c, so v is drawn
    with probability p_v, like a race over the whole row, at 1/chunks of the per-entry work.

    x, g: [b, V] fp32 (-inf: excluded); seed, position: [b] -> (best key, lowest winning index),
    best = -inf when every entry is excluded."""
    b, v = x.shape
    n_chunks = -(-v // chunk)
    xc = torch.nn.functional.pad(x, (0, n_chunks * chunk - v), value=float("-inf"))
    ckey = _logsumexp(xc.view(b, n_chunks, chunk)) + race_gumbel(seed, position, n_chunks, CHUNK_STREAM)
    cbest, cwin = lowest_argmax(ckey)
    mine = (torch.arange(v, device=x.device) // chunk)[None, :] == cwin[:, None]
    best, winner = lowest_argmax(torch.where(mine, x + g, torch.full_like(x, float("-inf"))))
    return torch.where(cbest > float("-inf"), best, cbest), winner


def _reference_chunk(target, drafts, temperature, seed, position, draft_logits, kb, counts_acc,
                     race_chunk):
    b, r, v = target.shape
    k = r - 1
    dev = target.device
    inf = float("-inf")
    greedy = ~(temperature > 0)
    inv_t = torch.where(greedy, torch.ones_like(temperature), 1.0 / temperature)
    raw = target.float()
    _, amax = lowest_argmax(raw)  # [b, r]
    x = _sanitize(raw * inv_t[:, None, None])
    lse = _logsumexp(x)  # [b, r]
    dead = lse == inf
    j = torch.arange(r, device=dev)
    drafts = drafts.to(torch.int64)
    valid = (drafts >= 0) & (drafts < v)
    dc = drafts.clamp(0, v - 1)  # never index with an invalid id
    x_d = x[:, :k].gather(-1, dc[..., None]).squeeze(-1)  # [b, k]
    p_d = torch.where(valid & ~dead[:, :k], torch.exp(x_d - lse[:, :k]), torch.zeros_like(x_d))
    u = accept_uniform(seed[:, None], position[:, None] + j[None, :k])  # [b, k]
    if draft_logits is not None:
        y = _sanitize(draft_logits.float() * inv_t[:, None, None])
        lse_q = _logsumexp(y)  # [b, k]
        y_d = y.gather(-1, dc[..., None]).squeeze(-1)
        q_d = torch.where(lse_q > inf, torch.exp(y_d - lse_q), torch.zeros_like(y_d))
        accept_sampled = u * q_d < p_d
    else:
        accept_sampled = u < p_d
    accept_greedy = valid & ~dead[:, :k] & (drafts == amax[:, :k])
    accept = torch.where(greedy[:, None], accept_greedy, accept_sampled)
    rejected = (j[None, :k] < kb[:, None]) & ~accept
    n_acc = torch.where(rejected, j[None, :k].expand(b, k), kb[:, None]).amin(dim=-1) if k > 0 else kb

    # The one row per request that emits the correction/bonus token.
    rows = torch.arange(b, device=dev)
    x_n, lse_n, amax_n, dead_n = x[rows, n_acc], lse[rows, n_acc], amax[rows, n_acc], dead[rows, n_acc]
    is_bonus = n_acc >= kb
    if k > 0:
        d_n = drafts[rows, n_acc.clamp(max=k - 1)]
        valid_n = valid[rows, n_acc.clamp(max=k - 1)]
    else:
        d_n = torch.full_like(n_acc, -1)
        valid_n = torch.zeros_like(is_bonus)
    g = race_gumbel(seed, position + n_acc, v)  # [b, v]
    if draft_logits is not None and k > 0:
        # Full q races the whole row in one level: the residual needs every entry anyway.
        key = x_n + g
        use_res = ~is_bonus
        jq = n_acc.clamp(max=k - 1)
        lse_qn = lse_q[rows, jq][:, None]
        q_n = torch.where(lse_qn > inf, torch.exp(y[rows, jq] - lse_qn), torch.zeros_like(x_n))
        p_n = torch.where(dead_n[:, None], torch.zeros_like(x_n), torch.exp(x_n - lse_n[:, None]))
        res = (p_n - q_n).clamp(min=0)
        key_res = torch.where(res > 0, torch.log(res) + g, torch.full_like(g, inf))
        res_alive = key_res.amax(dim=-1) > inf
        # Full q excludes nothing: a rejected draft's mass is already out of the residual, and the
        # p fallback only runs when p == q, where a rejection means p(d) = 0 anyway.
        key = torch.where((use_res & res_alive)[:, None], key_res, key)
        best, winner = lowest_argmax(key)
    else:
        out = (~is_bonus & valid_n)[:, None] & (torch.arange(v, device=dev)[None, :] == d_n[:, None])
        best, winner = _two_level_race(x_n.masked_fill(out, inf), g, seed, position + n_acc, race_chunk)
    sampled_tok = torch.where(best > inf, winner, amax_n)
    tok = torch.where(greedy, amax_n, sampled_tok)
    lp_n = torch.where(dead_n, torch.full_like(lse_n, inf), x_n.gather(-1, tok[:, None]).squeeze(-1) - lse_n)

    token_ids = torch.full((b, r), -1, dtype=torch.int64, device=dev)
    logprobs = torch.zeros((b, r), dtype=torch.float32, device=dev)
    if k > 0:
        acc_mask = j[None, :k] < n_acc[:, None]
        token_ids[:, :k] = torch.where(acc_mask, drafts, token_ids[:, :k])
        logprobs[:, :k] = torch.where(acc_mask, x_d - lse[:, :k], logprobs[:, :k])
        if counts_acc is not None:
            counts_acc += acc_mask.sum(dim=0)
    token_ids[rows, n_acc] = tok
    logprobs[rows, n_acc] = lp_n
    return token_ids, (n_acc + 1).to(torch.int32), logprobs


def rejection_sample_reference(
    target_logits: torch.Tensor,
    draft_token_ids: torch.Tensor,
    temperature: torch.Tensor,
    seed: torch.Tensor,
    position: torch.Tensor,
    *,
    draft_logits: torch.Tensor | None = None,
    num_draft_tokens: torch.Tensor | None = None,
    acceptance_counts: torch.Tensor | None = None,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    race_chunk: int | None = None,
) -> RejectionOutput:
    """Vectorized PyTorch ground truth; same arguments as `rejection_sample`.
    race_chunk: vocab chunk of the two-level race (a power of two; RACE_CHUNK by default; tests
    shrink it to exercise many chunks at small V).

    Requests are independent, so large inputs run in chunks of requests to bound the fp32 and
    int64 (RNG) temporaries; small-V calls with 1e5 requests stay one vectorized chunk.
    """
    _validate(target_logits, draft_token_ids, temperature, seed, position, draft_logits,
              num_draft_tokens, acceptance_counts, out)
    b, r, v = target_logits.shape
    k = r - 1
    kb = (torch.full((b,), k, dtype=torch.int64, device=target_logits.device) if num_draft_tokens is None
          else num_draft_tokens.to(torch.int64).clamp(0, k))
    counts = (None if acceptance_counts is None
              else torch.zeros(k, dtype=torch.int64, device=target_logits.device))
    chunk = max(1, (1 << 25) // (r * v))
    parts = []
    for s in range(0, b, chunk):
        e = min(b, s + chunk)
        parts.append(_reference_chunk(
            target_logits[s:e], draft_token_ids[s:e], temperature[s:e], seed[s:e], position[s:e],
            None if draft_logits is None else draft_logits[s:e], kb[s:e], counts,
            _check_race_chunk(race_chunk, v)))
    token_ids = torch.cat([p[0] for p in parts])
    num_emitted = torch.cat([p[1] for p in parts])
    logprobs = torch.cat([p[2] for p in parts])
    if acceptance_counts is not None:
        acceptance_counts += counts
    if out is not None:
        out[0].copy_(token_ids)
        out[1].copy_(num_emitted)
        out[2].copy_(logprobs)
        return RejectionOutput(*out)
    return RejectionOutput(token_ids, num_emitted, logprobs)


# ---------------------------------------------------------------------------------------------
# Triton
# ---------------------------------------------------------------------------------------------


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
def _stats_step(raw, t, best, bt, s, sx, c, xo, toffs, XSUM: tl.constexpr):
    """One [lanes, VEC] tile of the raw-domain online stats: one rescale per lane, one exp2 per entry.

    best: the lane's running max of raw (NaN never counts: max() ignores it), bt: the tile where it
    was first reached (a strict `>`, so the lowest; _lowest_argmax finds the position in it), s:
    sum over the lane of exp((raw_i - best) * inv_t), c = inv_t * log2e. A NaN/-inf entry adds
    exp2(max(NaN or -inf, -inf)) = 0. (Tracking the position here instead, a few ops per entry,
    measured slower at every B on an H200, even with one tile per chunk.)
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
def _exact_lse_chunk(row_ptr, chunk_start, n_tiles, V, inv_t, excl, BLOCK_V: tl.constexpr):
    """The reference's sanitised online logsumexp over a chunk (slow path, rare inputs only):
    (max, sum, sum without entry excl)."""
    offs0 = tl.arange(0, BLOCK_V)
    m_run = tl.max(tl.full([BLOCK_V], _NEG_INF, tl.float32), axis=0)
    s_lane = tl.zeros([BLOCK_V], tl.float32)
    sx_lane = tl.zeros([BLOCK_V], tl.float32)
    for t in range(n_tiles):
        offs = chunk_start + t * BLOCK_V + offs0
        x = _scaled(tl.load(row_ptr + offs, mask=offs < V, other=float("-inf")).to(tl.float32), inv_t)
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
    stride_lb, stride_lj, stride_qb, stride_qj, stride_db, stride_dk,
    R, V, SPLITS, TILES_PER_SPLIT,
    HAS_ND: tl.constexpr,
    FULL_Q: tl.constexpr,
    FUSE_RACE: tl.constexpr,
    BLOCK_V: tl.constexpr,  # vocab entries loaded per tile
    VEC: tl.constexpr = 8,  # consecutive entries per lane (16 bytes of bf16)
    PRUNE: tl.constexpr = False,
    FAST: tl.constexpr = False,
    PDL: tl.constexpr = 0,
    XSUM: tl.constexpr = False,  # one-hot: also the sums without the draft (P_XSUM)
):
    _pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    b = row // R
    j = row % R
    K = R - 1
    greedy, inv_t = _inv_temperature(temp_ptr, b)
    c = inv_t * _LOG2E
    kb = K
    if HAS_ND:
        kb = tl.minimum(tl.maximum(tl.load(nd_ptr + b).to(tl.int64), 0), K)
    d = tl.load(draft_ptr + b * stride_db + j * stride_dk, mask=j < K, other=-1).to(tl.int64)
    # Row j's correction excludes its draft; the bonus row (j == k_b) excludes nothing.
    excl = tl.where((j < kb) & (d >= 0) & (d < V), d, -1)
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
    dc = tl.minimum(tl.maximum(d, 0), V - 1)
    mine = (j < K) & (dc >= chunk_start) & (dc < chunk_start + n_tiles * BLOCK_V)
    x_d = _scaled(tl.load(row_ptr + dc, mask=mine, other=0.0).to(tl.float32), inv_t)
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
        ra = tl.load(row_ptr + offs_a).to(tl.float32)
        rb = tl.load(row_ptr + offs_a + BLOCK_V).to(tl.float32)
        xo = excl - chunk_start - t * BLOCK_V
        best, bt, s, sx = _stats_step(ra, t, best, bt, s, sx, c, xo, toffs, XSUM)
        best, bt, s, sx = _stats_step(rb, t + 1, best, bt, s, sx, c, xo - BLOCK_V, toffs, XSUM)
        if FUSE_RACE:
            if ~greedy:
                race_best, race_idx, race_x, best_run = _race_tile(
                    ra, offs_a, offs_a != excl, inv_t, rkey, race_best, race_idx, race_x, best_run,
                    PRUNE, FAST)
                race_best, race_idx, race_x, best_run = _race_tile(
                    rb, offs_a + BLOCK_V, offs_a + BLOCK_V != excl, inv_t, rkey, race_best, race_idx,
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
        raw = tl.load(row_ptr + offs, mask=inb, other=float("-inf")).to(tl.float32)
        best, bt, s, sx = _stats_step(raw, t, best, bt, s, sx, c, excl - chunk_start - t * BLOCK_V,
                                      toffs, XSUM)
        if FUSE_RACE:
            if ~greedy:
                race_best, race_idx, race_x, best_run = _race_tile(
                    raw, offs, inb & (offs != excl), inv_t, rkey, race_best, race_idx, race_x, best_run,
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
        m_run, s_run, sx_run = _exact_lse_chunk(row_ptr, chunk_start, n_tiles, V, inv_t, excl, BLOCK_V)
    qm_run = rm * 0.0 + _NEG_INF
    qs_run = rm * 0.0
    if FULL_Q:
        qm_run, qs_run, _, qok = _stats_finish(qbest, qs, qs, inv_t, c)
        if need_q:
            if ~qok:
                qm_run, qs_run, _ = _exact_lse_chunk(q_ptr, chunk_start, n_tiles, V, inv_t, -1, BLOCK_V)
        tl.store(fstat_ptr + _P_YD * plane + row * SPLITS, y_d, mask=mine)
    tl.store(fstat_ptr + _P_XD * plane + row * SPLITS, x_d, mask=mine)
    tl.store(fstat_ptr + _P_RAW_MAX * plane + o, rm)
    tl.store(fstat_ptr + _P_MAX * plane + o, m_run)
    tl.store(fstat_ptr + _P_SUM * plane + o, s_run)
    if XSUM:
        tl.store(fstat_ptr + _P_XSUM * plane + o, sx_run)
    tl.store(fstat_ptr + _P_QMAX * plane + o, qm_run)
    tl.store(fstat_ptr + _P_QSUM * plane + o, qs_run)
    tl.store(istat_ptr + o, ri)
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
    cc = tl.arange(0, NC_POW2)
    pm = tl.reshape(pm, (NC_POW2, SPC))
    lse_c = _merge_lse(pm, tl.reshape(psx, (NC_POW2, SPC)), pm > _NEG_INF)
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
def _race_chunk_entries(row_ptr, cw, rkey, inv_t, excl, V, CHUNK: tl.constexpr, RACE_BLOCK_V: tl.constexpr,
                        VEC: tl.constexpr, PRUNE: tl.constexpr, FAST: tl.constexpr):
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
            raw, offs, (offs < V) & (offs != excl), inv_t, rkey, best, best_i, best_x, best_run,
            PRUNE, FAST)
        raw = raw_next
    km, win, xw = _race_result(best, best_i, best_x)
    return win.to(tl.int64), xw, km


@triton.jit
def _walk_body(b, plane, logits_ptr,
               draft_ptr, temp_ptr, seed_ptr, pos_ptr, nd_ptr,
               fstat_ptr, istat_ptr, tok_ptr, nemit_ptr, lp_ptr, counts_ptr, race_i_ptr,
               race_f_ptr, stride_lb, stride_lj, stride_db, stride_dk,
               R, V, SPLITS,
               HAS_ND: tl.constexpr, HAS_COUNTS: tl.constexpr, FULL_Q: tl.constexpr,
               FUSE_RACE: tl.constexpr, R_POW2: tl.constexpr, SPLITS_POW2: tl.constexpr,
               CHUNK: tl.constexpr, SPC: tl.constexpr, NC_POW2: tl.constexpr,
               RACE_BLOCK_V: tl.constexpr, VEC: tl.constexpr, PRUNE: tl.constexpr,
               FAST: tl.constexpr):
    """Request b: merge its chunks, walk its drafts (see _walk_kernel). plane = B*(K+1)*SPLITS.

    Every load of the walk itself is addressed by b alone (the row pass stored the drafts'
    logits), so they all issue at once: no read waits on another. A sampled one-hot request then
    runs its two-level race (_pick_chunk, then _chunk_winner or _race_chunk_entries)."""
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
    amax = tl.where(row_ok, amax, 0)
    x_amax = _scaled(rmax, inv_t)  # x at the argmax (-inf on a dead row)
    pm = tl.load(fstat_ptr + _P_MAX * plane + o2, mask=m2, other=_NEG_INF, cache_modifier=".cg")
    lse = _merge_lse(pm, tl.load(fstat_ptr + _P_SUM * plane + o2, mask=m2, other=0.0, cache_modifier=".cg"), m2)
    if not FULL_Q:  # the race's inputs for every row: none of these loads waits on the walk
        psx = tl.load(fstat_ptr + _P_XSUM * plane + o2, mask=m2, other=0.0, cache_modifier=".cg")
        if FUSE_RACE:
            rk = tl.load(fstat_ptr + _P_RACE * plane + o2, mask=m2, other=_NEG_INF, cache_modifier=".cg")
            ri = tl.load(istat_ptr + plane + o2, mask=m2, other=_INT32_MAX, cache_modifier=".cg")
            rx = tl.load(fstat_ptr + _P_RACE_X * plane + o2, mask=m2, other=_NEG_INF, cache_modifier=".cg")
    dead = lse == _NEG_INF

    is_draft = jr < K
    d = tl.load(draft_ptr + b * stride_db + jr * stride_dk, mask=is_draft, other=-1).to(tl.int64)
    valid = is_draft & (d >= 0) & (d < V)
    o_row = (b * R + jr) * SPLITS
    x_d = tl.load(fstat_ptr + _P_XD * plane + o_row, mask=is_draft, other=0.0, cache_modifier=".cg")
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
            # Row n_acc's two-level race (the reference's _two_level_race).
            sel = at_n[:, None]
            kc, cw = _pick_chunk(tl.max(tl.where(sel, pm, _NEG_INF), axis=0),
                                 tl.sum(tl.where(sel, psx, 0.0), axis=0), seed, pos + n_acc, NC_POW2, SPC)
            if FUSE_RACE:
                win, x_win, kmax = _chunk_winner(
                    tl.max(tl.where(sel, rk, _NEG_INF), axis=0), tl.sum(tl.where(sel, ri, 0), axis=0),
                    tl.max(tl.where(sel, rx, _NEG_INF), axis=0), cw, NC_POW2, SPC)
            else:
                win, x_win, kmax = _race_chunk_entries(
                    logits_ptr + b * stride_lb + n_acc * stride_lj, cw, tl_race_key(seed, pos + n_acc), inv_t,
                    excl, V, CHUNK, RACE_BLOCK_V, VEC, PRUNE, FAST)
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
):
    _pdl_wait(PDL)
    b = tl.program_id(0).to(tl.int64)
    _walk_body(b, tl.num_programs(0).to(tl.int64) * R * SPLITS, logits_ptr,
               draft_ptr, temp_ptr, seed_ptr, pos_ptr, nd_ptr,
               fstat_ptr, istat_ptr, tok_ptr, nemit_ptr, lp_ptr, counts_ptr, race_i_ptr,
               race_f_ptr, stride_lb, stride_lj, stride_db, stride_dk,
               R, V, SPLITS, HAS_ND, HAS_COUNTS, FULL_Q, FUSE_RACE, R_POW2, SPLITS_POW2,
               CHUNK, SPC, NC_POW2, RACE_BLOCK_V, VEC, PRUNE, FAST)


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
    stride_lb, stride_lj, stride_qb, stride_qj,
    R, V, SPLITS, TILES_PER_SPLIT,
    BLOCK_V: tl.constexpr,  # vocab entries loaded per tile
    VEC: tl.constexpr = 8,
    PDL: tl.constexpr = 0,
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
            x = _scaled(raw, inv_t)
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
def _finish_kernel(
    race_i_ptr,  # [B, 3] int32
    race_f_ptr,  # [B, 3] fp32
    part_k_ptr,  # [2, B, SPLITS] fp32
    part_i_ptr,  # [2, B, SPLITS] int32
    part_x_ptr,  # [2, B, SPLITS] fp32
    tok_ptr,  # [B, K+1] int64 out
    lp_ptr,  # [B, K+1] fp32 out
    R, SPLITS,
    SPLITS_POW2: tl.constexpr,  # all race chunks of a request in one tile
    PDL: tl.constexpr = 0,
):
    _pdl_wait(PDL)
    b = tl.program_id(0).to(tl.int64)
    race_row = tl.load(race_i_ptr + b * 3).to(tl.int64)
    if race_row >= 0:
        _finish_body(b, race_row, tl.num_programs(0).to(tl.int64) * SPLITS, race_i_ptr, race_f_ptr,
                     part_k_ptr, part_i_ptr, part_x_ptr, tok_ptr, lp_ptr, R, SPLITS, SPLITS_POW2)


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
def _finish_body(b, race_row, plane, race_i_ptr, race_f_ptr, part_k_ptr, part_i_ptr, part_x_ptr,
                 tok_ptr, lp_ptr, R, SPLITS, SPLITS_POW2: tl.constexpr):
    """Request b (race row race_row >= 0): merge the race chunks, write the token and its logprob."""
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


def _splits(rows: int, vocab: int, block_v: int, num_splits: int | None,
            target_programs: int) -> tuple[int, int]:
    tiles = triton.cdiv(vocab, block_v)
    splits = max(1, min(tiles, triton.cdiv(target_programs, rows))) if num_splits is None else num_splits
    tiles_per_split = triton.cdiv(tiles, max(1, min(splits, tiles)))
    return triton.cdiv(tiles, tiles_per_split), tiles_per_split  # no empty chunk


def _chunk_splits(rows: int, vocab: int, block_v: int, chunk: int, num_splits: int | None,
                  target_programs: int) -> tuple[int, int, int]:
    """Splits for one-hot mode: whole tiles, never straddling a race chunk, `spc` (a power of two)
    per chunk, so the walk merges each chunk's mass from its own splits.
    -> (splits, tiles_per_split, spc)"""
    tiles_per_chunk = chunk // block_v
    want = num_splits if num_splits is not None else triton.cdiv(target_programs, rows)
    spc = min(tiles_per_chunk, triton.next_power_of_2(triton.cdiv(want, triton.cdiv(vocab, chunk))))
    tiles_per_split = tiles_per_chunk // spc
    return triton.cdiv(triton.cdiv(vocab, block_v), tiles_per_split), tiles_per_split, spc


def _on_gpu(dev: torch.device) -> bool:
    """A real CUDA launch (not the interpreter): inline PTX is available."""
    return dev.type == "cuda" and os.environ.get("TRITON_INTERPRET") != "1"


def rejection_sample_triton(
    target_logits: torch.Tensor,
    draft_token_ids: torch.Tensor,
    temperature: torch.Tensor,
    seed: torch.Tensor,
    position: torch.Tensor,
    *,
    draft_logits: torch.Tensor | None = None,
    num_draft_tokens: torch.Tensor | None = None,
    acceptance_counts: torch.Tensor | None = None,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    config: LaunchConfig | None = None,
    race_chunk: int | None = None,
) -> RejectionOutput:
    """Triton rejection sampler; same arguments and results as `rejection_sample`.

    Capturable in a CUDA graph: no host sync, no value-dependent Python branch. The workspaces
    (stat planes [_NUM_FPLANES, B*(K+1), splits] fp32 + [2, B*(K+1), splits] int32; full q: race
    state [B, 3] int32 + [B, 3] fp32 and race partials [2, B, race splits] fp32 / int32 / fp32)
    come from torch's caching allocator; under capture they live in the graph's private pool and
    stay fixed for every replay. Every workspace slot a later kernel reads is written by an earlier
    one in the same call, so nothing needs zeroing.
    config: the launch (launch_config(B, K, full q) by default; tests force every path with it,
    scripts/rejection_sweep.py times variants). race_chunk: the two-level race's chunk (a power of
    two, RACE_CHUNK by default); it changes which tokens a seed draws, so the reference must get
    the same.
    """
    _validate(target_logits, draft_token_ids, temperature, seed, position, draft_logits,
              num_draft_tokens, acceptance_counts, out)
    b, r, v = target_logits.shape
    k = r - 1
    dev = target_logits.device
    full_q = draft_logits is not None and k > 0
    rows = b * r
    cfg = config if config is not None else launch_config(b, k, full_q)
    fuse_race = cfg.fuse_race and not full_q  # the residual needs lse first
    chunk = _check_race_chunk(race_chunk, v)
    block_v, race_block_v = cfg.block_v, cfg.race_block_v
    if not full_q:  # tiles and the walk's race tiles both lie inside one chunk
        block_v, race_block_v = min(block_v, chunk), min(race_block_v, chunk)
    vec = min(4 if target_logits.dtype == torch.float32 else 8, block_v, race_block_v)  # 16-byte loads
    fast = _on_gpu(dev)
    pdl = cfg.pdl if pdl_enabled(dev) else 0
    launch = pdl_launch(bool(pdl))
    if full_q:
        splits, tiles_per_split = _splits(rows, v, block_v, cfg.num_splits, cfg.target_programs)
        spc = 1
    else:
        splits, tiles_per_split, spc = _chunk_splits(rows, v, block_v, chunk, cfg.num_splits,
                                                     cfg.target_programs)
    nc_pow2 = triton.next_power_of_2(triton.cdiv(splits, spc))
    # One-hot: the walk views a row's splits as [chunks, SPC] (a power of two >= splits).
    splits_pow2 = triton.next_power_of_2(splits) if full_q else nc_pow2 * spc
    if out is None:
        out = (torch.empty((b, r), dtype=torch.int64, device=dev),
               torch.empty((b,), dtype=torch.int32, device=dev),
               torch.empty((b, r), dtype=torch.float32, device=dev))
    tok, nemit, lp = out
    fstat = torch.empty((_NUM_FPLANES, rows, splits), dtype=torch.float32, device=dev)
    istat = torch.empty((2, rows, splits), dtype=torch.int32, device=dev)
    race_i = torch.empty((b, 3), dtype=torch.int32, device=dev)
    race_f = torch.empty((b, 3), dtype=torch.float32, device=dev)
    q = draft_logits if full_q else target_logits  # a valid pointer when unused
    q_strides = (q.stride(0), q.stride(1))
    nd = num_draft_tokens if num_draft_tokens is not None else seed
    counts = acceptance_counts if acceptance_counts is not None else seed
    ids_strides = (draft_token_ids.stride(0), draft_token_ids.stride(1)) if k > 0 else (0, 0)
    ids = draft_token_ids if k > 0 else seed  # a K = 0 tensor may carry no storage
    common = dict(HAS_ND=num_draft_tokens is not None, FULL_Q=full_q, VEC=vec, FAST=fast, PDL=pdl)
    # No FMA contraction: x * inv_t + g must round like the reference's two torch ops, or race
    # keys drift by an ulp and near-ties could pick different tokens.
    _row_stats_kernel[(rows, splits)](
        target_logits, q, ids, temperature, seed, position, nd, fstat, istat,
        target_logits.stride(0), target_logits.stride(1), *q_strides, *ids_strides,
        r, v, splits, tiles_per_split,
        FUSE_RACE=fuse_race, BLOCK_V=block_v, XSUM=not full_q, PRUNE=cfg.prune and fuse_race,
        num_warps=cfg.num_warps, enable_fp_fusion=False, **common, **launch,
    )
    walk_warps = cfg.walk_warps or ((8 if cfg.prune else 16) if not (full_q or fuse_race)
                                    else 1 if r * splits <= 256 else 4)
    _walk_kernel[(b,)](
        target_logits, ids, temperature, seed, position, nd, fstat, istat, tok, nemit, lp, counts,
        race_i, race_f, target_logits.stride(0), target_logits.stride(1), *ids_strides,
        r, v, splits,
        HAS_COUNTS=acceptance_counts is not None, FUSE_RACE=fuse_race,
        R_POW2=triton.next_power_of_2(r), SPLITS_POW2=splits_pow2, CHUNK=chunk, SPC=spc, NC_POW2=nc_pow2,
        RACE_BLOCK_V=race_block_v, PRUNE=cfg.prune, num_warps=walk_warps, enable_fp_fusion=False,
        **common, **launch,
    )
    if full_q:
        rsplits, rtiles = _splits(b, v, race_block_v, cfg.num_splits, cfg.race_programs)
        part_k = torch.empty((2, b, rsplits), dtype=torch.float32, device=dev)
        part_i = torch.empty((2, b, rsplits), dtype=torch.int32, device=dev)
        part_x = torch.empty((2, b, rsplits), dtype=torch.float32, device=dev)
        _race_kernel[(b, rsplits)](
            target_logits, q, temperature, seed, position, race_i, race_f, part_k, part_i, part_x,
            target_logits.stride(0), target_logits.stride(1), *q_strides,
            r, v, rsplits, rtiles, BLOCK_V=race_block_v, VEC=vec, num_warps=cfg.race_warps,
            enable_fp_fusion=False, PDL=pdl, **launch,
        )
        _finish_kernel[(b,)](
            race_i, race_f, part_k, part_i, part_x, tok, lp, r, rsplits,
            SPLITS_POW2=triton.next_power_of_2(rsplits), PDL=pdl,
            num_warps=1 if rsplits <= 128 else 4, enable_fp_fusion=False, **launch,
        )
    return RejectionOutput(tok, nemit, lp)


def rejection_sample(
    target_logits: torch.Tensor,
    draft_token_ids: torch.Tensor,
    temperature: torch.Tensor,
    seed: torch.Tensor,
    position: torch.Tensor,
    *,
    draft_logits: torch.Tensor | None = None,
    num_draft_tokens: torch.Tensor | None = None,
    acceptance_counts: torch.Tensor | None = None,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> RejectionOutput:
    """Speculative rejection sampling (rules in the module docstring).

    target_logits [B, K+1, V] bf16/fp16/fp32 (K >= 0; K = 0 samples one token from row 0),
    draft_token_ids [B, K] integer, temperature [B] fp32 (0 = greedy), seed [B] int64,
    position [B] int64 (absolute position of the token row 0 predicts), draft_logits [B, K, V]
    (full-q mode), num_draft_tokens [B] int32/int64 (ragged k_b <= K), acceptance_counts [K] int64
    (accumulated in place: += number of requests whose draft j was accepted), out = preallocated
    (token_ids, num_emitted, logprobs).
    Returns RejectionOutput(token_ids [B, K+1] int64 (-1 after the last emitted),
    num_emitted [B] int32, logprobs [B, K+1] fp32 (0.0 after the last emitted)).

    Value checks (temperature >= 0, 0 <= num_draft_tokens <= K) run only on CPU tensors outside
    graph capture: checking a CUDA tensor's values would sync the host. On the GPU a negative or
    NaN temperature is greedy and num_draft_tokens is clamped to [0, K].
    CUDA tensors run the Triton kernels, anything else the PyTorch reference.
    """
    fn = rejection_sample_triton if target_logits.is_cuda else rejection_sample_reference
    return fn(target_logits, draft_token_ids, temperature, seed, position, draft_logits=draft_logits,
              num_draft_tokens=num_draft_tokens, acceptance_counts=acceptance_counts, out=out)
