"""The rejection sampler's definition: the PyTorch reference every Triton path reproduces.

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

Filters (top_k, top_p, min_p per request; thresholds_reference sorts, kernels/rejection_filter.py
does not, with the same bits). The target distribution p above is then the filtered one, and every
rule above holds against it: a draft the filters removed has p(d) = 0 and is rejected, the
correction and the bonus come from the renormalised kept entries, logprobs are under it. A
sampled row's filter is a value threshold tau on its raw logits: every entry with
raw >= tau is kept, so entries tied at the threshold are all kept; the rest behave as -inf (their
probability is 0 and the kept ones are renormalised). Greedy rows and dead rows get tau = -inf
(nothing filtered). In the order of vLLM and transformers, after the temperature:
  top_k (0 < k < V, else off):  tau_k = the k-th largest raw value (with multiplicity).
  top_p (< 1, else off):        among the entries with raw >= tau_k, tau_p = the largest value
                                whose kept mass M(tau_p) = sum of w over raw >= tau_p is still
                                >= top_p * M(tau_k): the smallest such set.
  min_p (> 0, else off):        tau_m = the smallest value with w >= min_p * w(max).
  tau = min(max(tau_k, tau_p, tau_m), the row's max): the largest entries always stay.
NaN counts as -inf, -0.0 as +0.0. The mass is a fixed-point weight, so that the Triton kernel and
the reference agree bit for bit whatever the order of summation:
  x = the sampler's scaled logit (raw * (1 / temperature), NaN -> -inf, +inf -> fp32 max),
  z = (x - x_max) * log2(e) in fp32; w = 0 if z < -W, else floor(poly(z - n) * 2**(W + n)) with
  n = floor(z) and poly a degree-5 polynomial for 2**f on [0, 1) (fp32 mul/add, no FMA; positive
  coefficients, so w never decreases as x grows): an int64, the max weighing 2**W = 2**32.
  Sums are exact int64, compared in fp64 (exact below 2**53: V < 2**20); w differs from
  2**W * p / p_max by under 3e-7 relative, and entries under 2**-32 of the max weigh nothing.
top_p and min_p thus act on these weights, which is what the law the tests check uses too. A
single rounding is left to resolve alike: top_p * M in fp64 (IEEE, the same on both sides).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from graphrt.kernels.argmax import lowest_argmax
from graphrt.kernels.counters import capturing
from graphrt.kernels.rng import CHUNK_STREAM, accept_uniform, race_gumbel

_LOGIT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
FLT_MAX = 3.4028234663852886e38
# Vocab chunk of the two-level race (one-hot q and K = 0): part of the sampling definition, so the
# reference and the kernels share it.
RACE_CHUNK = 8192
W_BITS = 32
LOG2E_F32 = 1.4426950216293335  # fp32(log2 e): the same constant in torch and Triton
# 2**f ~ 1 + f*(c1 + f*(c2 + f*(c3 + f*(c4 + f*c5)))), fp32 values, relative error < 3e-7 on [0, 1)
POLY = (0.693151593208313, 0.2401643842458725, 0.05579371005296707, 0.009031210094690323,
        0.0018587341764941812)


def _check_race_chunk(chunk: int | None, v: int) -> int:
    """The race chunk for a vocabulary of v. One chunk of at least v entries draws the same tokens
    whatever its size (its own Gumbel never decides anything), so it is cut to the next power of
    two >= v: at a test's V = 30 the interpreter then walks 2 tiles of 16 instead of 512."""
    chunk = RACE_CHUNK if chunk is None else chunk
    if chunk < 1 or chunk & (chunk - 1):
        raise ValueError(f"race_chunk must be a power of two, got {chunk}")
    return min(chunk, 1 << (max(1, v) - 1).bit_length())


class RejectionOutput(NamedTuple):
    token_ids: torch.Tensor  # [B, K+1] int64, -1 after the last emitted token
    num_emitted: torch.Tensor  # [B] int32 in [1, k_b + 1]
    logprobs: torch.Tensor  # [B, K+1] fp32, 0.0 after the last emitted token



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
    return x.clamp(max=FLT_MAX)


def _logsumexp(x: torch.Tensor) -> torch.Tensor:
    # torch.logsumexp of an all -inf row is -inf; kept explicit so a dead row is obvious.
    lse = torch.logsumexp(x, dim=-1)
    return torch.where(x.amax(dim=-1) == float("-inf"), torch.full_like(lse, float("-inf")), lse)


def check_filters(b: int, dev: torch.device, top_k, top_p, min_p, check_values: bool) -> None:
    """Metadata of the filter tensors (and their values where check_values: CPU tensors only)."""
    for name, t, dtypes in (("top_k", top_k, (torch.int32, torch.int64)), ("top_p", top_p, (torch.float32,)),
                            ("min_p", min_p, (torch.float32,))):
        if t is None:
            continue
        if not (isinstance(t, torch.Tensor) and tuple(t.shape) == (b,) and t.dtype in dtypes):
            raise ValueError(f"{name} must be a [{b}] {'/'.join(str(d)[6:] for d in dtypes)} tensor")
        if t.device != dev:
            raise ValueError(f"{name} is on {t.device} but target_logits is on {dev}")
    if check_values:
        if top_k is not None and not bool((top_k >= 0).all()):
            raise ValueError("top_k must be >= 0 (0 means off)")
        if top_p is not None and not bool(((top_p > 0) & (top_p <= 1)).all()):
            raise ValueError("top_p must lie in (0, 1] (1 means off)")
        if min_p is not None and not bool(((min_p >= 0) & (min_p < 1)).all()):
            raise ValueError("min_p must lie in [0, 1) (0 means off)")


def weights(x: torch.Tensor, x_max: torch.Tensor) -> torch.Tensor:
    """The fixed-point weight of scaled logits x (fp32) under a row max x_max: int64."""
    z = (x - x_max) * LOG2E_F32
    live = z >= -W_BITS
    n = torch.floor(torch.where(live, z, torch.zeros_like(z)))
    f = torch.where(live, z, torch.zeros_like(z)) - n
    p = 1.0 + f * (POLY[0] + f * (POLY[1] + f * (POLY[2] + f * (POLY[3] + f * POLY[4]))))
    p = torch.clamp(p, max=2.0)
    w = torch.floor(torch.ldexp(p, (n + W_BITS).to(torch.int32))).to(torch.int64)
    return torch.where(live, w, torch.zeros_like(w))


def thresholds_reference(target_logits: torch.Tensor, temperature: torch.Tensor, top_k, top_p,
                         min_p) -> torch.Tensor:
    """tau [B, K+1] fp32 for target_logits [B, K+1, V] (rule in the module docstring), by sorting."""
    b, r, v = target_logits.shape
    dev = target_logits.device
    raw = target_logits.float()
    raw = torch.where(torch.isnan(raw), torch.full_like(raw, float("-inf")), raw) + 0.0
    greedy = ~(temperature > 0)
    inv_t = torch.where(greedy, torch.ones_like(temperature), 1.0 / temperature)[:, None, None]
    vals = raw.sort(dim=-1, descending=True).values
    xs = _sanitize(vals * inv_t)
    w = weights(xs, xs[..., :1])
    inf = torch.full((b, r), float("-inf"), device=dev)
    tau = inf.clone()
    if top_k is not None:
        k = top_k.to(torch.int64)[:, None].expand(b, r)
        kth = vals.gather(-1, (k - 1).clamp(0, v - 1)[..., None]).squeeze(-1)
        tau = torch.where((k > 0) & (k < v), kth, inf)
    if top_p is not None:
        wk = torch.where(vals >= tau[..., None], w, torch.zeros_like(w))
        cum = wk.cumsum(-1).double()
        target = top_p.double()[:, None, None] * cum[..., -1:]
        first = (cum >= target).to(torch.int8).argmax(-1)
        tau_p = vals.gather(-1, first[..., None]).squeeze(-1)
        tau = torch.where((top_p < 1)[:, None], torch.maximum(tau, tau_p), tau)
    if min_p is not None:
        ok = w.double() >= min_p.double()[:, None, None] * 2.0**W_BITS
        tau_m = torch.where(ok, vals, torch.full_like(vals, float("inf"))).amin(-1)
        tau = torch.where((min_p > 0)[:, None], torch.maximum(tau, tau_m), tau)
    tau = torch.minimum(tau, vals[..., 0])
    return torch.where(greedy[:, None] | (xs[..., 0] == float("-inf")), inf, tau)


def apply_thresholds(target_logits: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
    """target_logits [B, K+1, V] -> fp32 with every entry under its row's tau at -inf, as the
    kernels see it (NaN compares false: -inf, which the sampler treats NaN as anyway)."""
    raw = target_logits.float()
    return torch.where(raw >= tau[..., None], raw, torch.full_like(raw, float("-inf")))


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
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
    race_chunk: int | None = None,
) -> RejectionOutput:
    """Vectorized PyTorch ground truth; same arguments as `rejection_sample`.
    race_chunk: vocab chunk of the two-level race (a power of two; RACE_CHUNK by default; tests
    shrink it to exercise many chunks at small V). Filters: thresholds_reference, then every
    filtered entry at -inf and the rules above on what is left.

    Requests are independent, so large inputs run in chunks of requests to bound the fp32 and
    int64 (RNG) temporaries; small-V calls with 1e5 requests stay one vectorized chunk.
    """
    _validate(target_logits, draft_token_ids, temperature, seed, position, draft_logits,
              num_draft_tokens, acceptance_counts, out)
    b, r, v = target_logits.shape
    dev = target_logits.device
    check_filters(b, dev, top_k, top_p, min_p, dev.type == "cpu" and not capturing())
    filtered = top_k is not None or top_p is not None or min_p is not None
    k = r - 1
    kb = (torch.full((b,), k, dtype=torch.int64, device=target_logits.device) if num_draft_tokens is None
          else num_draft_tokens.to(torch.int64).clamp(0, k))
    counts = (None if acceptance_counts is None
              else torch.zeros(k, dtype=torch.int64, device=target_logits.device))
    chunk = max(1, (1 << 25) // (r * v))
    parts = []
    for s in range(0, b, chunk):
        e = min(b, s + chunk)
        target = target_logits[s:e]
        if filtered:
            target = apply_thresholds(target, thresholds_reference(
                target, temperature[s:e], *(None if f is None else f[s:e] for f in (top_k, top_p, min_p))))
        parts.append(_reference_chunk(
            target, draft_token_ids[s:e], temperature[s:e], seed[s:e], position[s:e],
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
