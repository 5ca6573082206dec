"""The filters' per-row thresholds on the GPU, without sorting: the rule (top_k, top_p, min_p) and
its reference, thresholds_reference, are in kernels/rejection_reference.py; _threshold_kernel
finds the same threshold bit for bit by a radix select over the logits' order-preserving integer
keys (_select). No [rows, V] buffer and no sort. One program per row, one pass over the row each:
the max; top_k: a 256-bin histogram level per 8 bits of the key range (2 for the 16-bit keys of
bf16 / fp16 logits, up to 4 for fp32); top_p / min_p: the kept mass; top_p: pivot rounds (8 keys
each) while its range spans more than 256 keys, then one histogram level. The sampler then reads
the thresholds (tau [B*(K+1)] fp32) in its row pass, its walk and full q's race.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from graphrt.kernels.rejection_kernels import _NEG_INF, _inv_temperature, _pdl_wait, _scaled
from graphrt.kernels.rejection_reference import LOG2E_F32, POLY, W_BITS

_TL_W = tl.constexpr(W_BITS)
_TL_LOG2E_F32 = tl.constexpr(LOG2E_F32)
_C1, _C2, _C3, _C4, _C5 = (tl.constexpr(c) for c in POLY)
_INT32_BIG = tl.constexpr(2**31 - 1)
_KEY_SHIFT = {torch.bfloat16: 16, torch.float16: 13, torch.float32: 0}  # always-zero low bits


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
def _keys(raw, SHIFT: tl.constexpr):
    """Order-preserving int64 keys of fp32 values (NaN as -inf, -0.0 as +0.0): equal keys <=> equal
    values. SHIFT drops the low bits that the logits' dtype always leaves zero."""
    raw = tl.where(raw != raw, _NEG_INF, raw) + 0.0
    bits = raw.to(tl.int32, bitcast=True)
    key = tl.where(bits < 0, -(bits & 0x7FFFFFFF), bits)
    return (key >> SHIFT).to(tl.int64)


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
def _threshold_kernel(
    logits_ptr,  # [B, K+1, V] bf16/fp16/fp32, vocab dim contiguous
    temp_ptr,  # [B] fp32
    topk_ptr,  # [B] int32/int64 (HAS_K only)
    topp_ptr,  # [B] fp32 (HAS_P only)
    minp_ptr,  # [B] fp32 (HAS_M only)
    tau_ptr,  # [B*(K+1)] fp32 out: the row's threshold, -inf where nothing is filtered
    stride_lb, stride_lj, R, V,
    HAS_K: tl.constexpr, HAS_P: tl.constexpr, HAS_M: tl.constexpr,
    SHIFT: tl.constexpr,  # low key bits the dtype leaves zero (16 bf16, 13 fp16, 0 fp32)
    BLOCK_V: tl.constexpr,
    NP: tl.constexpr = 8,  # pivots per bisection round
    PDL: tl.constexpr = 0,
):
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
    tau = tl.zeros_like(inv_t) + _NEG_INF
    if ~greedy & (use_k | (top_p < 1.0) | (min_p > 0.0)):  # rows that filter nothing stop here
        row_ptr = logits_ptr + b * stride_lb + (row % R) * stride_lj
        offs0 = tl.arange(0, BLOCK_V)
        kmax = tl.max(tl.full([BLOCK_V], -_INT32_BIG, tl.int64), axis=0)
        kmin = -kmax
        for t in range(0, tl.cdiv(V, BLOCK_V)):
            offs = t * BLOCK_V + offs0
            key = _keys(tl.load(row_ptr + offs, mask=offs < V, other=float("-inf")).to(tl.float32), SHIFT)
            kmax = tl.maximum(kmax, tl.max(tl.where(offs < V, key, -_INT32_BIG), axis=0))
            kmin = tl.minimum(kmin, tl.min(tl.where(offs < V, key, _INT32_BIG), axis=0))
        x_max = _scaled(_key_value(kmax, SHIFT), inv_t)
        if x_max > _NEG_INF:  # a dead row keeps -inf
            lo = kmin
            if use_k:
                lo = _select(row_ptr, V, kmin, kmax, k.to(tl.float64), x_max, inv_t, False, SHIFT, BLOCK_V, NP)
            tau_key = lo
            if (top_p < 1.0) | (min_p > 0.0):
                # the mass kept by top-k, the lowest key that weighs anything, min-p's lowest key
                thr = min_p.to(tl.float64) * 4294967296.0
                mass = tl.zeros([BLOCK_V], tl.int64)
                wmin = tl.full([BLOCK_V], _INT32_BIG, tl.int64)
                mmin = tl.full([BLOCK_V], _INT32_BIG, tl.int64)
                for t in range(0, tl.cdiv(V, BLOCK_V)):
                    offs = t * BLOCK_V + offs0
                    raw = tl.load(row_ptr + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
                    key = _keys(raw, SHIFT)
                    w = tl.where((offs < V) & (key >= lo), _tl_weights(_scaled(raw, inv_t), x_max), 0)
                    mass += w
                    wmin = tl.minimum(wmin, tl.where(w > 0, key, _INT32_BIG))
                    mmin = tl.minimum(mmin, tl.where((offs < V) & (w.to(tl.float64) >= thr), key, _INT32_BIG))
                if top_p < 1.0:
                    target = top_p.to(tl.float64) * tl.sum(mass, axis=0).to(tl.float64)
                    tau_key = _select(row_ptr, V, tl.maximum(lo, tl.min(wmin, axis=0)), kmax, target, x_max,
                                      inv_t, True, SHIFT, BLOCK_V, NP)
                if min_p > 0.0:
                    tau_key = tl.maximum(tau_key, tl.min(mmin, axis=0))
            tau = _key_value(tl.minimum(tau_key, kmax), SHIFT)
    tl.store(tau_ptr + row, tau)


def thresholds_triton(target_logits, temperature, top_k, top_p, min_p, *, block_v: int, num_warps: int,
                      pdl: int) -> torch.Tensor:
    """tau [B*(K+1)] fp32 for target_logits [B, K+1, V] bf16/fp16/fp32, temperature [B] fp32 and
    the filter tensors ([B] int32/int64, [B] fp32, [B] fp32; None: off); the rule of
    kernels/rejection_reference.thresholds_reference. One program per row; rows that filter nothing return at once."""
    b, r, v = target_logits.shape
    tau = torch.empty(b * r, dtype=torch.float32, device=target_logits.device)
    some = next(t for t in (top_k, top_p, min_p) if t is not None)  # a valid pointer when unused
    _threshold_kernel[(b * r,)](
        target_logits, temperature, top_k if top_k is not None else some, top_p if top_p is not None else some,
        min_p if min_p is not None else some, tau, target_logits.stride(0), target_logits.stride(1), r, v,
        HAS_K=top_k is not None, HAS_P=top_p is not None, HAS_M=min_p is not None,
        SHIFT=_KEY_SHIFT[target_logits.dtype], BLOCK_V=block_v, PDL=pdl, num_warps=num_warps,
        enable_fp_fusion=False, **({"launch_pdl": True} if pdl else {}),
    )
    return tau
