"""Simulated acceptance: a benchmarking mode that sets how many drafts each verify step accepts.

A draft's real acceptance depends on the draft and the data; a runtime's cost does not. To measure
cost at a known acceptance (SGLang's SGLANG_SIMULATE_ACC_LEN has the same purpose), TARGET_VERIFY
runs its target forward and the real rejection kernel as always, then this kernel replaces each
request's outcome:

  accepted count  a = number of leading draws u_1, u_2, ... below alpha, capped by the request's
                  drafts (num_draft_tokens[b] <= K): P(a >= j) = alpha^j, so acceptance decays along
                  the chain as real drafts' does, and E[a + 1] = 1 + alpha + ... + alpha^K = L
                  (alpha from `acceptance_rate_for`; L = K + 1 gives alpha = 1);
  emitted tokens  the drafts d_1 .. d_a, then the target's own top-1 at position a (its argmax over
                  row a of the logits: NaN never wins, ties to the lowest index, so every id is in
                  [0, V); or top[b, a] when the caller has the rows' top-1 already, as a
                  tensor-parallel rank holding a vocab shard does); entries past a are -1;
  logprobs        NaN: nothing here is sampled from the target's distribution;
  counts          acceptance_counts[j] += 1 for every accepted draft j (give the real kernel none).

u_j is the counter-based uniform of (seed, position + j) on its own stream (kernels/rng.py), so a
seeded request draws the same counts whatever else is in its batch, eager or graph. Reads one
logits row per request; static shapes, no host sync: it sits in the captured TARGET_VERIFY graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from graphrt.kernels.argmax import lowest_argmax
from graphrt.kernels.rng import bits_to_uniform, mix32, row_key, tl_bits_to_uniform, tl_mix32, tl_row_key

SIMULATE_STREAM = 0x3A9D52F7  # kernels/rng.py's streams: accept, race, chunk; this one is apart
_TL_SIMULATE_STREAM = tl.constexpr(SIMULATE_STREAM)


def acceptance_rate_for(mean_length: float, num_draft_tokens: int) -> float:
    """alpha in [0, 1] with 1 + alpha + ... + alpha^K = mean_length (1 <= mean_length <= K + 1)."""
    K = num_draft_tokens
    if not 1.0 <= mean_length <= K + 1:
        raise ValueError(f"simulated acceptance length must be in [1, K + 1] = [1, {K + 1}], got {mean_length}")
    if mean_length in (1.0, K + 1):  # nothing, or everything, accepted
        return 0.0 if mean_length == 1.0 else 1.0
    lo, hi = 0.0, 1.0
    for _ in range(60):  # bisection: the sum grows with alpha
        mid = (lo + hi) / 2
        if sum(mid**j for j in range(1, K + 1)) < mean_length - 1:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def simulate_uniforms(seed: torch.Tensor, position: torch.Tensor, K: int) -> torch.Tensor:
    """u [B, K]: the draws of drafts 1..K (seed, position: [B] int64)."""
    j = torch.arange(K, device=seed.device, dtype=torch.int64)
    return bits_to_uniform(mix32(row_key(seed[:, None], position[:, None] + j) ^ SIMULATE_STREAM))


def _check(logits, drafts, num_drafts, seed, position, alpha, out):
    B, R, V = logits.shape
    K = R - 1
    if drafts.shape != (B, K) or num_drafts.shape != (B,) or seed.shape != (B,) or position.shape != (B,):
        got = ", ".join(str(tuple(t.shape)) for t in (drafts, num_drafts, seed, position))
        raise ValueError(f"drafts must be [{B}, {K}] and num_drafts, seed, position [{B}]; got {got}")
    if alpha.shape != (1,) or alpha.dtype != torch.float32:
        raise ValueError(f"alpha must be a [1] fp32 tensor, got {tuple(alpha.shape)} {alpha.dtype}")
    emitted, num_emitted, logprobs, counts = out
    if emitted.shape != (B, R) or num_emitted.shape != (B,) or logprobs.shape != (B, R) or counts.shape != (K,):
        raise ValueError("out must be (emitted [B, K+1], num_emitted [B], logprobs [B, K+1], counts [K])")


def simulate_acceptance_reference(logits, drafts, num_drafts, seed, position, alpha, *, out, top=None):
    """logits [B, K+1, V]; drafts [B, K] int64; num_drafts, seed, position [B] int64 (num_drafts:
    any int dtype); alpha [1] fp32; out = (emitted [B, K+1] int64, num_emitted [B] int32,
    logprobs [B, K+1] fp32, acceptance_counts [K] int64), written in place; top: [B, K+1] int64,
    each row's top-1 (then the logits are not read)."""
    _check(logits, drafts, num_drafts, seed, position, alpha, out)
    emitted, num_emitted, logprobs, counts = out
    B, R, _ = logits.shape
    K = R - 1
    u = simulate_uniforms(seed, position, K)
    j = torch.arange(K, device=logits.device)
    alive = ((u < alpha) & (j[None, :] < num_drafts.to(torch.int64)[:, None])).to(torch.int64).cumprod(dim=1)
    a = alive.sum(dim=1)  # [B]
    rows = torch.arange(B, device=logits.device)
    top = lowest_argmax(logits[rows, a])[1] if top is None else top[rows, a]
    cols = torch.arange(R, device=logits.device)[None, :]
    drafts_padded = torch.cat([drafts, drafts.new_full((B, 1), -1)], dim=1)
    tokens = torch.where(cols < a[:, None], drafts_padded, torch.full_like(drafts_padded, -1))
    tokens[rows, a] = top
    emitted.copy_(tokens)
    num_emitted.copy_((a + 1).to(num_emitted.dtype))
    logprobs.fill_(float("nan"))
    counts += alive.sum(dim=0)
    return out


@triton.jit
def _simulate_kernel(
    logits_ptr,  # [B, K+1, V] contiguous, any float dtype
    drafts_ptr,  # [B, K] int64, row stride drafts_stride, unit column stride
    nd_ptr,  # [B] int (num_drafts)
    seed_ptr,  # [B] int64
    pos_ptr,  # [B] int64
    alpha_ptr,  # [1] fp32
    emit_ptr,  # [B, K+1] int64
    nemit_ptr,  # [B] int32
    lp_ptr,  # [B, K+1] fp32
    counts_ptr,  # [K] int64
    top_ptr,  # [B, K+1] int64 (HAS_TOP): each row's top-1
    V,
    drafts_stride,
    K: tl.constexpr,
    KP: tl.constexpr,  # next power of 2 >= K + 1
    BLOCK_V: tl.constexpr,
    HAS_TOP: tl.constexpr = False,
):
    b = tl.program_id(0).to(tl.int64)
    seed = tl.load(seed_ptr + b)
    pos = tl.load(pos_ptr + b)
    nd = tl.load(nd_ptr + b).to(tl.int64)
    alpha = tl.load(alpha_ptr)
    a = tl.zeros((), tl.int64)
    alive = nd > 0
    for j in tl.static_range(K):
        u = tl_bits_to_uniform(tl_mix32(tl_row_key(seed, pos + j) ^ _TL_SIMULATE_STREAM))
        alive = alive & (u < alpha) & (j < nd)
        a += alive.to(tl.int64)
        tl.atomic_add(counts_ptr + j, alive.to(tl.int64))
    if HAS_TOP:
        top = tl.load(top_ptr + b * (K + 1) + a)
    else:  # the target's own top-1 at row a (lowest index among the maxima, NaN never wins)
        row = logits_ptr + (b * (K + 1) + a) * V
        offs = tl.arange(0, BLOCK_V)
        best_val = tl.full([BLOCK_V], float("-inf"), tl.float32)
        best_idx = tl.zeros([BLOCK_V], tl.int64)
        for start in range(0, V, BLOCK_V):
            idx = start + offs
            x = tl.load(row + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
            take = x > best_val  # NaN compares false
            best_val = tl.where(take, x, best_val)
            best_idx = tl.where(take, idx.to(tl.int64), best_idx)
        m = tl.max(best_val, axis=0)
        top = tl.min(tl.where(best_val == m, best_idx, V), axis=0)
        top = tl.where(top >= V, 0, top)  # a row of NaN / -inf: index 0
    cols = tl.arange(0, KP)
    d = tl.load(drafts_ptr + b * drafts_stride + cols, mask=cols < K, other=-1)
    tok = tl.where(cols < a, d, -1)
    tok = tl.where(cols == a, top, tok)
    tl.store(emit_ptr + b * (K + 1) + cols, tok, mask=cols < K + 1)
    tl.store(lp_ptr + b * (K + 1) + cols, tl.full([KP], float("nan"), tl.float32), mask=cols < K + 1)
    tl.store(nemit_ptr + b, (a + 1).to(tl.int32))


def simulate_acceptance_triton(logits, drafts, num_drafts, seed, position, alpha, *, out, top=None,
                               block_v: int = 4096):
    """Same contract as simulate_acceptance_reference. One launch, one program per request."""
    _check(logits, drafts, num_drafts, seed, position, alpha, out)
    emitted, num_emitted, logprobs, counts = out
    B, R, V = logits.shape
    # drafts may be a column slice (TARGET_VERIFY's tokens[:, 1:]): rows strided, columns not
    if not (logits.is_contiguous() and emitted.is_contiguous() and logprobs.is_contiguous()
            and (drafts.shape[1] < 2 or drafts.stride(1) == 1)):
        raise ValueError("logits, emitted and logprobs must be contiguous, and drafts' columns")
    _simulate_kernel[(B,)](
        logits, drafts, num_drafts, seed, position, alpha, emitted, num_emitted, logprobs, counts,
        top if top is not None else emitted, V, drafts.stride(0), K=R - 1, KP=triton.next_power_of_2(R),
        BLOCK_V=min(block_v, triton.next_power_of_2(V)), HAS_TOP=top is not None, num_warps=4,
    )
    return out


def simulate_acceptance(logits, drafts, num_drafts, seed, position, alpha, *, out, top=None):
    """Triton on CUDA, the reference elsewhere (contract: simulate_acceptance_reference)."""
    fn = simulate_acceptance_triton if logits.is_cuda else simulate_acceptance_reference
    return fn(logits, drafts, num_drafts, seed, position, alpha, out=out, top=top)
