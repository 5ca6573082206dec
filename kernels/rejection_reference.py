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



def _check_tensor(name: str, t, shape: tuple, dtypes: tuple, dev: torch.device, contiguous: bool = False) -> None:
    if not (isinstance(t, torch.Tensor) and tuple(t.shape) == shape and t.dtype in dtypes
            and (t.is_contiguous() or not contiguous)):
        got = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
        want = "/".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(f"{name} must be a {'contiguous ' * contiguous}{list(shape)} {want} tensor, got {got}")
    if t.device != dev:
        raise ValueError(f"{name} is on {t.device} but target_logits is on {dev}")


def _validate(target_logits, draft_token_ids, temperature, seed, position, draft_logits=None,
              num_draft_tokens=None, acceptance_counts=None, out=None, top_k=None, top_p=None, min_p=None):
    """Every argument's metadata; values (temperature >= 0, 0 <= num_draft_tokens <= K, the filters'
    ranges) on CPU tensors outside capture only: checking a CUDA tensor's values would sync."""
    if not (isinstance(target_logits, torch.Tensor) and target_logits.dim() == 3):
        raise ValueError(f"target_logits must be a [B, K+1, V] tensor, got {getattr(target_logits, 'shape', None)}")
    b, r, v = target_logits.shape
    k = r - 1
    dev = target_logits.device
    if not (b >= 1 and r >= 1 and v >= 1):
        raise ValueError(f"target_logits must have B, K+1, V >= 1, got {tuple(target_logits.shape)}")
    _check_tensor("target_logits", target_logits, (b, r, v), _LOGIT_DTYPES, dev)
    if target_logits.stride(2) != 1:
        raise ValueError("target_logits must be contiguous in the vocab dim")
    ids = draft_token_ids
    if not (isinstance(ids, torch.Tensor) and tuple(ids.shape) == (b, k) and not ids.dtype.is_floating_point
            and not ids.dtype.is_complex and ids.dtype != torch.bool):
        got = f"{tuple(ids.shape)} {ids.dtype}" if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise ValueError(f"draft_token_ids must be an integer [B={b}, K={k}] tensor, got {got}")
    _check_tensor("draft_token_ids", ids, (b, k), (ids.dtype,), dev)
    _check_tensor("temperature", temperature, (b,), (torch.float32,), dev)
    _check_tensor("seed", seed, (b,), (torch.int64,), dev)
    _check_tensor("position", position, (b,), (torch.int64,), dev)
    if draft_logits is not None:
        _check_tensor("draft_logits", draft_logits, (b, k, v), _LOGIT_DTYPES, dev)
        if k > 0 and draft_logits.stride(2) != 1:
            raise ValueError("draft_logits must be contiguous in the vocab dim")
    if num_draft_tokens is not None:
        _check_tensor("num_draft_tokens", num_draft_tokens, (b,), (torch.int32, torch.int64), dev)
    if acceptance_counts is not None:
        _check_tensor("acceptance_counts", acceptance_counts, (k,), (torch.int64,), dev, contiguous=True)
    if out is not None:
        if not (isinstance(out, tuple | list) and len(out) == 3):
            raise ValueError("out must be (token_ids, num_emitted, logprobs)")
        for name, t, shape, dtype in (("out.token_ids", out[0], (b, r), torch.int64),
                                      ("out.num_emitted", out[1], (b,), torch.int32),
                                      ("out.logprobs", out[2], (b, r), torch.float32)):
            _check_tensor(name, t, shape, (dtype,), dev, contiguous=True)
    for name, t, dtypes in (("top_k", top_k, (torch.int32, torch.int64)), ("top_p", top_p, (torch.float32,)),
                            ("min_p", min_p, (torch.float32,))):
        if t is not None:
            _check_tensor(name, t, (b,), dtypes, dev)
    if dev.type != "cpu" or capturing():
        return
    checks = [(temperature < 0, "temperature must be >= 0 (0 means greedy)")]
    if num_draft_tokens is not None:
        checks.append(((num_draft_tokens < 0) | (num_draft_tokens > k), f"num_draft_tokens must lie in [0, K={k}]"))
    if top_k is not None:
        checks.append((top_k < 0, "top_k must be >= 0 (0 means off)"))
    if top_p is not None:  # NaN fails top_p's and min_p's ranges (a NaN temperature is greedy)
        checks.append((~((top_p > 0) & (top_p <= 1)), "top_p must lie in (0, 1] (1 means off)"))
    if min_p is not None:
        checks.append((~((min_p >= 0) & (min_p < 1)), "min_p must lie in [0, 1) (0 means off)"))
    for bad, msg in checks:
        if bool(bad.any()):
            raise ValueError(msg)


def _sanitize(x: torch.Tensor) -> torch.Tensor:
    x = torch.where(torch.isnan(x), torch.full_like(x, float("-inf")), x)
    return x.clamp(max=FLT_MAX)


def _logsumexp(x: torch.Tensor) -> torch.Tensor:
    # torch.logsumexp of an all -inf row is -inf; kept explicit so a dead row is obvious.
    lse = torch.logsumexp(x, dim=-1)
    return torch.where(x.amax(dim=-1) == float("-inf"), torch.full_like(lse, float("-inf")), lse)


def inv_temperature(temperature: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(greedy, inv_t) [B]: greedy = not (temperature > 0), inv_t = 1 there, else 1 / temperature."""
    greedy = ~(temperature > 0)
    return greedy, torch.where(greedy, torch.ones_like(temperature), 1.0 / temperature)


def drafts_per_request(num_draft_tokens: torch.Tensor | None, b: int, k: int, dev: torch.device) -> torch.Tensor:
    """k_b [B] int64: num_draft_tokens clamped to [0, K], or K for every request."""
    if num_draft_tokens is None:
        return torch.full((b,), k, dtype=torch.int64, device=dev)
    return num_draft_tokens.to(torch.int64).clamp(0, k)


def accepted(drafts, vocab, x_d, lse, amax, greedy, seed, position, kb, q_d=None) -> torch.Tensor:
    """The walk -> n_acc [B] int64, the drafts accepted before the first rejection (or k_b). drafts
    [B, K] int64, x_d [B, K] their scaled logits, lse and amax [B, K+1] each row's, greedy [B],
    seed and position [B] int64, kb [B] int64; q_d [B, K] (full q) the drafts' q."""
    k = drafts.shape[1]
    if k == 0:
        return kb
    j = torch.arange(k, device=drafts.device)
    dead = lse[:, :k] == float("-inf")
    valid = (drafts >= 0) & (drafts < vocab)
    p_d = torch.where(valid & ~dead, torch.exp(x_d - lse[:, :k]), 0.0)
    u = accept_uniform(seed[:, None], position[:, None] + j)
    sampled = u < p_d if q_d is None else u * q_d < p_d
    accept = torch.where(greedy[:, None], valid & ~dead & (drafts == amax[:, :k]), sampled)
    return torch.where((j < kb[:, None]) & ~accept, j, kb[:, None]).amin(-1)


def emitted(drafts, lp_d, n_acc, tok_n, lp_n, counts) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(token_ids, num_emitted, logprobs) of the walk's outcome: the n_acc accepted drafts (their
    logprobs lp_d [B, K]), then row n_acc's tok_n and lp_n [B]; counts [K] int64 accumulated."""
    b, k = drafts.shape
    token_ids = torch.full((b, k + 1), -1, dtype=torch.int64, device=drafts.device)
    logprobs = torch.zeros((b, k + 1), dtype=torch.float32, device=drafts.device)
    if k > 0:
        acc = torch.arange(k, device=drafts.device)[None, :] < n_acc[:, None]
        token_ids[:, :k] = torch.where(acc, drafts, -1)
        logprobs[:, :k] = torch.where(acc, lp_d, 0.0)
        if counts is not None:
            counts += acc.sum(0)
    rows = torch.arange(b, device=drafts.device)
    token_ids[rows, n_acc] = tok_n
    logprobs[rows, n_acc] = lp_n
    return token_ids, (n_acc + 1).to(torch.int32), logprobs


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
    greedy, inv_t = inv_temperature(temperature)
    inv_t = inv_t[:, None, None]
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
    greedy, inv_t = inv_temperature(temperature)
    raw = target.float()
    _, amax = lowest_argmax(raw)  # [b, r]
    x = _sanitize(raw * inv_t[:, None, None])
    lse = _logsumexp(x)  # [b, r]
    dead = lse == inf
    drafts = drafts.to(torch.int64)
    valid = (drafts >= 0) & (drafts < v)
    dc = drafts.clamp(0, v - 1)  # never index with an invalid id
    x_d = x[:, :k].gather(-1, dc[..., None]).squeeze(-1)  # [b, k]
    q_d = None
    if draft_logits is not None:
        y = _sanitize(draft_logits.float() * inv_t[:, None, None])
        lse_q = _logsumexp(y)  # [b, k]
        y_d = y.gather(-1, dc[..., None]).squeeze(-1)
        q_d = torch.where(lse_q > inf, torch.exp(y_d - lse_q), torch.zeros_like(y_d))
    n_acc = accepted(drafts, v, x_d, lse, amax, greedy, seed, position, kb, q_d)

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
    return emitted(drafts, x_d - lse[:, :k], n_acc, tok, lp_n, counts_acc)


def rejection_sample_reference(target_logits, draft_token_ids, temperature, seed, position, *, draft_logits=None,
                               num_draft_tokens=None, acceptance_counts=None, out=None, top_k=None, top_p=None,
                               min_p=None, race_chunk: int | None = None) -> RejectionOutput:
    """Vectorized PyTorch ground truth; same arguments as `rejection_sample`.
    race_chunk: vocab chunk of the two-level race (a power of two; RACE_CHUNK by default; tests
    shrink it to exercise many chunks at small V). Filters: thresholds_reference, then every
    filtered entry at -inf and the rules above on what is left.

    Requests are independent, so large inputs run in chunks of requests to bound the fp32 and
    int64 (RNG) temporaries; small-V calls with 1e5 requests stay one vectorized chunk.
    """
    _validate(target_logits, draft_token_ids, temperature, seed, position, draft_logits,
              num_draft_tokens, acceptance_counts, out, top_k, top_p, min_p)
    b, r, v = target_logits.shape
    dev = target_logits.device
    filtered = top_k is not None or top_p is not None or min_p is not None
    k = r - 1
    kb = drafts_per_request(num_draft_tokens, b, k, dev)
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
