"""Rotary position embedding of q and k, fused with the optional per-head q/k RMSNorm (Qwen3) and
the store of this step's k and v into the paged KV cache: one launch between the qkv GEMM and
paged attention.

Convention: non-interleaved ("rotate_half"), table-driven. `cos`, `sin` are [max_positions,
head_dim] fp32 tables as graphrt.models.layers.Rotary builds them (any scaling, e.g. llama3, is
already in the table). For a head vector x of dtype T at position p:

    xf = x.float(); rot = cat(-xf[D/2:], xf[:D/2])
    out = (xf * cos[p] + rot * sin[p]).to(T)

With per-head norm weights (Qwen3), x is first replaced by rms_norm(x, w, eps) over head_dim
(kernels/norm.py semantics). The rotated k and the untouched v are then written to slot
slot_mapping[n] of the cache, cast to its dtype; negative slots are skipped.

Positions index the tables as torch indexing does: a negative position p reads row p +
max_positions. Hazard (the position analogue of vLLM #43682): padded rows may carry any position;
the kernel clamps the row into the table so it never reads out of bounds (the reference raises
instead), and such rows' outputs are don't-care.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from graphrt.kernels.attention import _check_cache, _check_devices, store_kv
from graphrt.kernels.norm import apply_norm, rms_norm_reference
from graphrt.kernels.pdl import pdl_enabled, pdl_launch, wait_for_producer

__all__ = ["apply_rotary_reference", "rotary_store_kv", "rotary_store_kv_reference", "rotary_store_kv_triton"]

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def apply_rotary_reference(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """x: [N, heads, head_dim]; positions: [N] int64; cos, sin: [max_positions, head_dim] fp32. Rows
    as table_row picks them: a negative position from the end, any position kept inside the table."""
    n = cos.shape[0]
    rows = torch.where(positions < 0, positions + n, positions).clamp(0, n - 1)
    return rotate_reference(x, cos[rows][:, None, :], sin[rows][:, None, :])


def rotate_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """(x * cos + rotate_half(x) * sin) in fp32, rounded to x's dtype; cos, sin broadcast against x
    (also the training head's rotation, graphrt/train/head.py)."""
    xf = x.float()
    half = xf.shape[-1] // 2
    rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)


def rotary_store_kv_reference(
    q, k, v, positions, cos, sin, k_cache, v_cache, slot_mapping, *, q_norm=None, k_norm=None, eps=1e-6
) -> torch.Tensor:
    """q: [N, Hq, D], k, v: [N, Hkv, D] (any strides); positions: [N] int64; cos, sin:
    [max_positions, D] fp32; k_cache, v_cache: [num_blocks, page, Hkv, D]; slot_mapping: [N] int64;
    q_norm, k_norm: [D] or None. Stores k, v; returns the rotated q, [N, Hq, D] contiguous. Also the
    capturable CUDA fallback: the store goes through attention.store_kv."""
    if q_norm is not None:  # Qwen3 normalises each head before the rotation
        q = rms_norm_reference(q, q_norm, eps)
        k = rms_norm_reference(k, k_norm, eps)
    q = apply_rotary_reference(q, positions, cos, sin)
    k = apply_rotary_reference(k, positions, cos, sin)
    store_kv(k, v.contiguous(), k_cache, v_cache, slot_mapping)  # CPU: store_kv_reference
    return q


@triton.jit
def table_row(pos_ptr, max_positions):
    """The cos/sin table row of the position at pos_ptr (int64): torch indexing semantics for a
    negative position, clamped so a padded row's garbage position never reads outside the table."""
    pos = tl.load(pos_ptr).to(tl.int64)
    pos = tl.where(pos < 0, pos + max_positions, pos)
    return tl.minimum(tl.maximum(pos, 0), max_positions - 1)


@triton.jit
def rotate_half(x1, x2, c1, c2, s1, s2):
    """(out[:D/2], out[D/2:]) of (x * cos + rotate_half(x) * sin).to(x's dtype), fp32 math: shared
    with kernels/qkv_rotary.py so both round identically. The fused multiply-adds are spelled out:
    left to the compiler's contraction, which product it fuses differed between kernels (one bf16
    ulp in rare k-cache entries of the 3-16-token qkv launch against this kernel)."""
    f1 = x1.to(tl.float32)
    f2 = x2.to(tl.float32)
    return tl.fma(f1, c1, -(f2 * s1)).to(x1.dtype), tl.fma(f2, c2, f1 * s2).to(x1.dtype)


@triton.jit
def slot_ok(slot, like, num_slots):
    """Lanes of `like`'s shape that may store to `slot`: a negative slot means skip, and a slot past
    the pool is skipped too (no out-of-bounds write). Broadcast through a tensor: the interpreter
    rejects a scalar-and-tensor mask."""
    slot_v = like.to(tl.int64) * 0 + slot
    return (slot_v >= 0) & (slot_v < num_slots)


@triton.jit
def _rotary_store_kv_kernel(
    q_ptr,  # [N, Hq, D], strides (stride_qn, stride_qh, 1)
    k_ptr,  # [N, Hkv, D], strides (stride_kn, stride_kh, 1)
    v_ptr,  # [N, Hkv, D], strides (stride_vn, stride_vh, 1)
    pos_ptr,  # [N] int64
    cos_ptr,  # [max_positions, D] fp32, contiguous
    sin_ptr,  # [max_positions, D] fp32, contiguous
    q_norm_ptr,  # [D] (read only if HAS_NORM)
    k_norm_ptr,  # [D] (read only if HAS_NORM)
    q_out_ptr,  # [N, Hq, D] contiguous, q's dtype
    k_cache_ptr,  # [num_blocks, PAGE, Hkv, D]
    v_cache_ptr,  # [num_blocks, PAGE, Hkv, D]
    slot_ptr,  # [N] int64, negative = skip
    max_positions,
    num_slots,  # num_blocks * PAGE
    eps,
    stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh,  # q, k, v: token, head
    stride_kc_b, stride_kc_s, stride_kc_h, stride_vc_b, stride_vc_s, stride_vc_h,  # caches: block, slot, head
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,  # block_size: tokens per KV block
    HAS_NORM: tl.constexpr,
    BLOCK_HALF: tl.constexpr,  # power of two >= HEAD_DIM // 2
    USE_PDL: tl.constexpr = False,
    HEADS: tl.constexpr = 1,  # heads a program (grid dim 1), q heads first, then kv heads; one token (dim 0)
):
    if USE_PDL:  # a programmatic dependent: nothing before this line touches memory
        wait_for_producer()
    HALF: tl.constexpr = HEAD_DIM // 2
    offs = tl.arange(0, BLOCK_HALF)
    h = tl.program_id(1) * HEADS + tl.arange(0, HEADS)  # [HEADS]: q heads 0 .. Hq - 1, then kv heads
    is_q = h < NUM_Q_HEADS
    kh = tl.where(is_q, 0, h - NUM_Q_HEADS)
    half_ok = offs < HALF
    lanes = half_ok[None, :] & (h < NUM_Q_HEADS + NUM_KV_HEADS)[:, None]  # [HEADS, BLOCK_HALF]
    q_lanes = lanes & is_q[:, None]
    kv_lanes = lanes & ~is_q[:, None]
    col = offs[None, :]

    n = tl.program_id(0).to(tl.int64)
    src = tl.where(is_q, q_ptr + n * stride_qn + h * stride_qh, k_ptr + n * stride_kn + kh * stride_kh)
    src = src[:, None] + col
    x1 = tl.load(src, mask=lanes, other=0.0)
    x2 = tl.load(src + HALF, mask=lanes, other=0.0)
    if HAS_NORM:
        f1 = x1.to(tl.float32)
        f2 = x2.to(tl.float32)
        rstd = tl.rsqrt((tl.sum(f1 * f1, axis=1) + tl.sum(f2 * f2, axis=1)) / HEAD_DIM + eps)[:, None]
        norm_w = tl.where(is_q, q_norm_ptr, k_norm_ptr)[:, None] + col
        w1 = tl.load(norm_w, mask=lanes, other=0.0)
        w2 = tl.load(norm_w + HALF, mask=lanes, other=0.0)
        x1 = apply_norm(x1, rstd, w1, x1.dtype)
        x2 = apply_norm(x2, rstd, w2, x2.dtype)

    # One table row for the token, shared by its heads.
    row = table_row(pos_ptr + n, max_positions) * HEAD_DIM
    c1 = tl.load(cos_ptr + row + offs, mask=half_ok, other=0.0)[None, :]
    c2 = tl.load(cos_ptr + row + HALF + offs, mask=half_ok, other=0.0)[None, :]
    s1 = tl.load(sin_ptr + row + offs, mask=half_ok, other=0.0)[None, :]
    s2 = tl.load(sin_ptr + row + HALF + offs, mask=half_ok, other=0.0)[None, :]
    o1, o2 = rotate_half(x1, x2, c1, c2, s1, s2)

    dst = q_out_ptr + (n * NUM_Q_HEADS + h)[:, None] * HEAD_DIM + col
    tl.store(dst, o1, mask=q_lanes)
    tl.store(dst + HALF, o2, mask=q_lanes)

    slot = tl.load(slot_ptr + n).to(tl.int64)
    keep = kv_lanes & slot_ok(slot, kv_lanes, num_slots)
    blk = slot // PAGE
    off = slot % PAGE
    k_dst = (k_cache_ptr + blk * stride_kc_b + off * stride_kc_s + kh * stride_kc_h)[:, None] + col
    v_dst = (v_cache_ptr + blk * stride_vc_b + off * stride_vc_s + kh * stride_vc_h)[:, None] + col
    tl.store(k_dst, o1.to(k_cache_ptr.dtype.element_ty), mask=keep)
    tl.store(k_dst + HALF, o2.to(k_cache_ptr.dtype.element_ty), mask=keep)
    v_src = (v_ptr + n * stride_vn + kh * stride_vh)[:, None] + col
    v1 = tl.load(v_src, mask=keep, other=0.0)
    v2 = tl.load(v_src + HALF, mask=keep, other=0.0)
    tl.store(v_dst, v1.to(v_cache_ptr.dtype.element_ty), mask=keep)
    tl.store(v_dst + HALF, v2.to(v_cache_ptr.dtype.element_ty), mask=keep)


def _check_args(q, k, v, positions, cos, sin, k_cache, v_cache, slot_mapping, q_norm, k_norm):
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"q, k, v must be [N, heads, D], got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    n, hq, d = q.shape
    if k.shape != v.shape or k.shape[0] != n or k.shape[2] != d:
        raise ValueError(f"k and v must be [{n}, Hkv, {d}], got {tuple(k.shape)} and {tuple(v.shape)}")
    if d % 2:
        raise ValueError(f"head_dim must be even, got {d}")
    if q.dtype not in _FLOAT_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share one float dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous along head_dim, got strides {t.stride()}")
    if positions.shape != (n,) or positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"positions must be [{n}] int64, got {tuple(positions.shape)} {positions.dtype}")
    if slot_mapping.shape != (n,) or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping must be [{n}] int64, got {tuple(slot_mapping.shape)} {slot_mapping.dtype}")
    if cos.dim() != 2 or cos.shape[1] != d or cos.dtype != torch.float32 or not cos.is_contiguous():
        raise ValueError(f"cos must be a contiguous [max_positions, {d}] fp32 table, got {tuple(cos.shape)} "
                         f"{cos.dtype}")
    if sin.shape != cos.shape or sin.dtype != torch.float32 or not sin.is_contiguous():
        raise ValueError(f"sin must match cos ({tuple(cos.shape)} fp32), got {tuple(sin.shape)} {sin.dtype}")
    _check_cache(k_cache, v_cache)
    if tuple(k_cache.shape[2:]) != (k.shape[1], d):
        raise ValueError(f"k_cache must be [num_blocks, page, {k.shape[1]}, {d}], got {tuple(k_cache.shape)}")
    if (q_norm is None) != (k_norm is None):
        raise ValueError("q_norm and k_norm must be given together")
    if q_norm is not None:
        for name, w in (("q_norm", q_norm), ("k_norm", k_norm)):
            if w.shape != (d,) or w.dtype != q.dtype or w.stride(0) != 1:
                raise ValueError(f"{name} must be a contiguous [{d}] {q.dtype} vector, got {tuple(w.shape)} {w.dtype}")
    _check_devices(q.device, "q", k=k, v=v, positions=positions, cos=cos, sin=sin, k_cache=k_cache,
                   slot_mapping=slot_mapping, q_norm=q_norm, k_norm=k_norm)


def launch_tile(n: int, heads: int) -> tuple[int, int]:
    """(heads a program, warps) for n tokens of `heads` q + kv heads. One head a program (one warp)
    left thousands of programs at a verify step's 256 rows, each a chain of dependent loads that
    costs more to schedule than to run. Up to 32 tokens one head a program stays: in a B = 8 verify
    step (32 rows, under PDL) 8 heads a program lost, though they ran faster alone (RESULTS.md,
    "Rotary and KV store")."""
    if n <= 32:
        return 1, 1
    return min(8 if n <= 64 else 64, triton.next_power_of_2(heads)), 4


def rotary_store_kv_triton(
    q, k, v, positions, cos, sin, k_cache, v_cache, slot_mapping, *, q_norm=None, k_norm=None, eps=1e-6
) -> torch.Tensor:
    """Same contract as rotary_store_kv_reference. q, k, v may be column slices of one fused qkv
    output (row stride != width); only unit stride along head_dim is required. Norm weights, when
    given, must have q's dtype. One launch, grid (N, cdiv(Hq + Hkv, heads a program)); no host sync."""
    _check_args(q, k, v, positions, cos, sin, k_cache, v_cache, slot_mapping, q_norm, k_norm)
    n, hq, d = q.shape
    hkv = k.shape[1]
    q_out = torch.empty((n, hq, d), dtype=q.dtype, device=q.device)
    if n == 0:
        return q_out
    num_blocks, page = k_cache.shape[:2]
    has_norm = q_norm is not None
    pdl = pdl_enabled(q.device)
    heads, warps = launch_tile(n, hq + hkv)
    _rotary_store_kv_kernel[(n, triton.cdiv(hq + hkv, heads))](
        q, k, v, positions, cos, sin, q_norm if has_norm else cos, k_norm if has_norm else cos, q_out,
        k_cache, v_cache, slot_mapping, cos.shape[0], num_blocks * page, float(eps),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        *k_cache.stride()[:3], *v_cache.stride()[:3],
        NUM_Q_HEADS=hq, NUM_KV_HEADS=hkv, HEAD_DIM=d, PAGE=page, HAS_NORM=has_norm,
        BLOCK_HALF=triton.next_power_of_2(d // 2), USE_PDL=pdl, HEADS=heads, num_warps=warps,
        **pdl_launch(pdl),
    )  # fmt: skip
    return q_out


def rotary_store_kv(
    q, k, v, positions, cos, sin, k_cache, v_cache, slot_mapping, *, q_norm=None, k_norm=None, eps=1e-6
) -> torch.Tensor:
    """Rotate q and k (after the optional per-head norm), store k and v, return the rotated q.
    CUDA -> Triton (norm weights in a dtype other than q's fall back to the reference), else the
    reference."""
    fast = q.is_cuda and (q_norm is None or (q_norm.dtype == q.dtype and k_norm.dtype == q.dtype))
    fn = rotary_store_kv_triton if fast else rotary_store_kv_reference
    return fn(q, k, v, positions, cos, sin, k_cache, v_cache, slot_mapping, q_norm=q_norm, k_norm=k_norm, eps=eps)
