"""The attention prologue of a decode or verify step in one launch: the fused qkv GEMV with rotary
embedding of q and k and the store of k and v into the paged cache in its epilogue.

    qkv_rotary_store(x, w_qkv, bias, ...) == rotary_store_kv(*split(linear(x, w_qkv, bias)), ...)

bit for bit on the GPU: the GEMV's own K loops (kernels/gemv.py's _fma_k_loop one row per
program, M = 1 or per row up to gemv_config.ROWS_MAX_M tokens; _dot_k_loop unsplit at 3-64
tokens, and in 64-token tiles past that on small matrices), the qkv outputs rounded to the model
dtype as the unfused GEMV stores them, then kernels/rotary.py's arithmetic. Past 16 tokens `linear`
runs the plain product on cuBLAS, so there the equality holds against the DOT path's product with
the same tiles. The separate rotary launch
(and the qkv round trip through memory) is a fixed cost of every layer.

Each program owns BLOCK_N rotary pairs of one token (the tokens of a tile are adjacent programs):
pair i is head i // (D/2), dims (i % (D/2), + D/2), so the two halves a rotation mixes are summed by
the same program; v heads are paired the same way and stored as they come. _qkv_rotary_dot_kernel
does the same for every token at once (its layer's input norm then runs as its own launch). No
per-head q/k norm (Qwen3): it needs a whole head, which no program holds; those models keep the
two-launch path (qkv_rotary_store decides).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from graphrt.kernels.fp8_weight import FP8, Fp8Weight, _row_scaled, dense, for_rows, weight_and_scale
from graphrt.kernels.gemv import _dot_k_loop, _fma_final, _fma_k_loop, row_fma_config
from graphrt.kernels.gemv_config import dot_block_m, dot_rotary_config, row_tiles
from graphrt.kernels.linear import linear, materialized, norm_fusable
from graphrt.kernels.norm import PendingNorm
from graphrt.kernels.pdl import pdl_enabled, pdl_launch, wait_for_producer
from graphrt.kernels.rotary import _check_args, rotary_store_kv, rotate_half, slot_ok, table_row

__all__ = ["qkv_rotary_store", "qkv_rotary_store_reference", "qkv_rotary_store_triton", "fusable"]


def qkv_rotary_store_reference(x, w_qkv, bias, positions, cos, sin, k_cache, v_cache, slot_mapping, *,
                               num_q_heads: int, num_kv_heads: int, q_norm=None, k_norm=None,
                               eps=1e-6) -> torch.Tensor:
    """x [N, H], w_qkv [(Hq + 2 Hkv) D, H], bias [(Hq + 2 Hkv) D] or None; the rest as in
    rotary_store_kv. Stores k, v; returns the rotated q [N, Hq, D] contiguous. The two-launch path
    (linear.linear, then rotary_store_kv on column slices of its output)."""
    d = k_cache.shape[-1]
    qkv = linear(x, w_qkv, bias)
    n = qkv.shape[0]
    q = qkv[:, : num_q_heads * d].view(n, num_q_heads, d)
    k = qkv[:, num_q_heads * d : (num_q_heads + num_kv_heads) * d].view(n, num_kv_heads, d)
    v = qkv[:, (num_q_heads + num_kv_heads) * d :].view(n, num_kv_heads, d)
    return rotary_store_kv(q, k, v, positions, cos, sin, k_cache, v_cache, slot_mapping, q_norm=q_norm,
                           k_norm=k_norm, eps=eps)


# pos_ptr and slot_ptr not specialised: one scalar load each, and DRAFT_DECODE's later steps pass
# rows of [steps, B] tensors that are not 16-byte aligned at B = 1.
@triton.jit(do_not_specialize=["pos_ptr", "slot_ptr"])
def _qkv_rotary_kernel(
    x_ptr,  # [M, K] model dtype, contiguous
    w_ptr,  # [(Hq + 2 Hkv) * D, K] contiguous, x's dtype or float8_e4m3fn (HAS_SCALE)
    scale_ptr,  # [(Hq + 2 Hkv) * D] fp32 (HAS_SCALE only): per-row scales of an FP8 w
    bias_ptr,  # [(Hq + 2 Hkv) * D] (HAS_BIAS only)
    pos_ptr,  # [M] int64
    cos_ptr,  # [max_positions, D] fp32, contiguous
    sin_ptr,  # [max_positions, D] fp32, contiguous
    q_out_ptr,  # [M, Hq, D] contiguous
    k_cache_ptr,  # [num_blocks, PAGE, Hkv, D]
    v_cache_ptr,  # [num_blocks, PAGE, Hkv, D]
    slot_ptr,  # [M] int64, negative = skip the store
    res_ptr,  # [M, K] residual added to x before the norm (NORM_RES only)
    g_ptr,  # [K] norm weight, x's dtype (NORM only)
    sum_ptr,  # [M, K] out: x + residual (NORM_RES only)
    eps,  # the norm's epsilon (NORM only)
    M,  # tokens: program (tile, token) = divmod(pid, M)
    K,
    max_positions,
    num_slots,  # num_blocks * PAGE
    stride_kc_b, stride_kc_s, stride_kc_h, stride_vc_b, stride_vc_s, stride_vc_h,  # caches: block, slot, head
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,  # rotary pairs per program
    BLOCK_K: tl.constexpr,
    REDUCE_EACH: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    USE_PDL: tl.constexpr = False,
    NORM: tl.constexpr = False,  # x is the input of an RMSNorm (g_ptr, eps), applied in the prologue
    NORM_RES: tl.constexpr = False,  # NORM of x + residual (res_ptr), the sum stored to sum_ptr
    BLOCK_H: tl.constexpr = 16,  # NORM: a power of 2 >= K
    HAS_SCALE: tl.constexpr = False,
):
    HALF: tl.constexpr = HEAD_DIM // 2
    NUM_PAIRS: tl.constexpr = (NUM_Q_HEADS + 2 * NUM_KV_HEADS) * HALF
    # The tokens of one weight tile are adjacent programs: they run together and share its L2 lines.
    token = tl.program_id(0) % M
    tile = tl.program_id(0) // M
    x_ptr += token * K
    res_ptr += token * K
    sum_ptr += token * K
    pos_ptr += token
    slot_ptr += token
    q_out_ptr += token * (NUM_Q_HEADS * HEAD_DIM)
    pair = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = pair < NUM_PAIRS
    pair = tl.minimum(pair, NUM_PAIRS - 1)  # past the end: re-read the last pair, never stored
    head = pair // HALF
    dim = pair % HALF
    r1 = head * HEAD_DIM + dim
    # The epilogue's inputs first: position, slot and table rows are written before the kernel
    # this one depends on (the forward computes them ahead of the embedding), so under PDL they,
    # like the weights, load before the wait and their dependent chain is off the critical path.
    row = table_row(pos_ptr, max_positions) * HEAD_DIM + dim
    c1 = tl.load(cos_ptr + row)
    c2 = tl.load(cos_ptr + row + HALF)
    s1 = tl.load(sin_ptr + row)
    s2 = tl.load(sin_ptr + row + HALF)
    slot = tl.load(slot_ptr).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    w1_ptrs = w_ptr + r1.to(tl.int64)[:, None] * K + offs_k[None, :]
    # Both halves of a pair as the gated GEMV's gate and up tiles: each sums as the M = 1 GEMV does.
    a1, _, _, _, a2 = _fma_k_loop(w1_ptrs, w1_ptrs + HALF * K, x_ptr, res_ptr, sum_ptr, g_ptr, eps, 0,
                                  (K // BLOCK_K) * BLOCK_K, K, K, 0, offs_k, tile, BLOCK_N, BLOCK_K, 1, REDUCE_EACH,
                                  True, NORM, NORM_RES, BLOCK_H, USE_PDL)
    y1 = _row_scaled(_fma_final(a1, REDUCE_EACH), scale_ptr, r1, HAS_SCALE)
    y2 = _row_scaled(_fma_final(a2, REDUCE_EACH), scale_ptr, r1 + HALF, HAS_SCALE)
    if HAS_BIAS:
        y1 += tl.load(bias_ptr + r1).to(tl.float32)
        y2 += tl.load(bias_ptr + r1 + HALF).to(tl.float32)
    # Rounded to the model dtype as the unfused GEMV stores qkv; from here kernels/rotary.py's math.
    dt = q_out_ptr.dtype.element_ty
    x1 = y1.to(dt)
    x2 = y2.to(dt)

    o1, o2 = rotate_half(x1, x2, c1, c2, s1, s2)

    is_q = ok & (head < NUM_Q_HEADS)
    q_dst = q_out_ptr + r1
    tl.store(q_dst, o1, mask=is_q)
    tl.store(q_dst + HALF, o2, mask=is_q)
    keep = ok & slot_ok(slot, pair, num_slots)
    blk = slot // PAGE
    off = slot % PAGE
    kv_head = head - NUM_Q_HEADS
    is_k = keep & (kv_head >= 0) & (kv_head < NUM_KV_HEADS)
    k_dst = k_cache_ptr + blk * stride_kc_b + off * stride_kc_s + kv_head * stride_kc_h + dim
    tl.store(k_dst, o1.to(k_cache_ptr.dtype.element_ty), mask=is_k)
    tl.store(k_dst + HALF, o2.to(k_cache_ptr.dtype.element_ty), mask=is_k)
    v_head = kv_head - NUM_KV_HEADS
    is_v = keep & (v_head >= 0)
    v_dst = v_cache_ptr + blk * stride_vc_b + off * stride_vc_s + v_head * stride_vc_h + dim
    tl.store(v_dst, x1.to(v_cache_ptr.dtype.element_ty), mask=is_v)
    tl.store(v_dst + HALF, x2.to(v_cache_ptr.dtype.element_ty), mask=is_v)


@triton.jit(do_not_specialize=["pos_ptr", "slot_ptr"])
def _qkv_rotary_dot_kernel(
    x_ptr,  # [M, K] model dtype, contiguous
    w_ptr,  # [(Hq + 2 Hkv) * D, K] contiguous, x's dtype or float8_e4m3fn (HAS_SCALE)
    scale_ptr,  # [(Hq + 2 Hkv) * D] fp32 (HAS_SCALE only): per-row scales of an FP8 w
    bias_ptr,  # [(Hq + 2 Hkv) * D] (HAS_BIAS only)
    pos_ptr,  # [M] int64
    cos_ptr,  # [max_positions, D] fp32, contiguous
    sin_ptr,  # [max_positions, D] fp32, contiguous
    q_out_ptr,  # [M, Hq, D] contiguous
    k_cache_ptr,  # [num_blocks, PAGE, Hkv, D]
    v_cache_ptr,  # [num_blocks, PAGE, Hkv, D]
    slot_ptr,  # [M] int64, negative = skip the store
    M,  # tokens, <= BLOCK_M (TILE_M: any)
    K,
    max_positions,
    num_slots,  # num_blocks * PAGE
    stride_kc_b, stride_kc_s, stride_kc_h, stride_vc_b, stride_vc_s, stride_vc_h,  # caches: block, slot, head
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,  # rotary pairs per program: a 2 * BLOCK_N-row weight tile
    BLOCK_K: tl.constexpr,
    BLOCK_M: tl.constexpr,  # tokens padded: gemv_config.dot_block_m(M)
    PAD_M: tl.constexpr,  # BLOCK_M > M
    HAS_BIAS: tl.constexpr,
    USE_PDL: tl.constexpr = False,
    DOT_PRECISION: tl.constexpr = "tf32",  # "ieee" for fp32 inputs (tests)
    HAS_SCALE: tl.constexpr = False,
    TILE_M: tl.constexpr = False,  # the tokens in BLOCK_M tiles over grid dimension 1
):
    """The 3-64-token form (a verify step at batch 1 to 16, decoding at batch 3 to 64): all tokens
    in one program, the weight tile on the MMA's M side as in kernels/gemv.py's DOT path; past 64
    tokens (TILE_M) a program per 64-token tile. The weight tile interleaves each pair's two rows (j,
    j + D/2), so one dot yields both halves that the rotation mixes."""
    if TILE_M:
        m0 = tl.program_id(1) * BLOCK_M
        x_ptr += m0.to(tl.int64) * K
        pos_ptr += m0
        slot_ptr += m0
        q_out_ptr += m0.to(tl.int64) * (NUM_Q_HEADS * HEAD_DIM)
        M = tl.minimum(M - m0, BLOCK_M)
    HALF: tl.constexpr = HEAD_DIM // 2
    NUM_PAIRS: tl.constexpr = (NUM_Q_HEADS + 2 * NUM_KV_HEADS) * HALF
    pair = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = pair < NUM_PAIRS
    pair = tl.minimum(pair, NUM_PAIRS - 1)  # past the end: re-read the last pair, never stored
    head = pair // HALF
    dim = pair % HALF
    r1 = head * HEAD_DIM + dim
    offs_m = tl.arange(0, BLOCK_M)
    live = offs_m < M
    tok = tl.where(live, offs_m, 0) if PAD_M else offs_m  # padding tokens' table rows: token 0's; never stored
    # Positions, slots and table rows are written before the producer of x: loaded before the wait.
    row = table_row(pos_ptr + tok, max_positions)[None, :] * HEAD_DIM + dim[:, None]  # [BLOCK_N, BLOCK_M]
    c1 = tl.load(cos_ptr + row)
    c2 = tl.load(cos_ptr + row + HALF)
    s1 = tl.load(sin_ptr + row)
    s2 = tl.load(sin_ptr + row + HALF)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    rows = tl.reshape(tl.join(r1, r1 + HALF), [2 * BLOCK_N])  # r1[0], r1[0] + D/2, r1[1], ...
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + rows.to(tl.int64)[:, None] * K + offs_k[None, :]
    xt_ptrs = x_ptr + offs_m.to(tl.int64)[None, :] * K + offs_k[:, None]
    if USE_PDL:
        wait_for_producer()
    acc, _ = _dot_k_loop(w_ptrs, w_ptrs, xt_ptrs, 0, (K // BLOCK_K) * BLOCK_K, K, offs_k, 2 * BLOCK_N, BLOCK_M,
                         BLOCK_K, False, DOT_PRECISION, M, PAD_M)
    acc = _row_scaled(acc, scale_ptr, rows, HAS_SCALE)
    y1, y2 = tl.split(tl.permute(tl.reshape(acc, [BLOCK_N, 2, BLOCK_M]), [0, 2, 1]))
    if HAS_BIAS:
        y1 += tl.load(bias_ptr + r1).to(tl.float32)[:, None]
        y2 += tl.load(bias_ptr + r1 + HALF).to(tl.float32)[:, None]
    # Rounded to the model dtype as the unfused GEMV stores qkv; from here kernels/rotary.py's math.
    dt = q_out_ptr.dtype.element_ty
    x1 = y1.to(dt)
    x2 = y2.to(dt)
    o1, o2 = rotate_half(x1, x2, c1, c2, s1, s2)
    on = ok[:, None] & live[None, :]
    is_q = on & (head < NUM_Q_HEADS)[:, None]
    q_dst = q_out_ptr + tok[None, :] * (NUM_Q_HEADS * HEAD_DIM) + r1[:, None]
    tl.store(q_dst, o1, mask=is_q)
    tl.store(q_dst + HALF, o2, mask=is_q)
    keep = on & slot_ok(slot[None, :], pair[:, None], num_slots)
    blk = (slot // PAGE)[None, :]
    off = (slot % PAGE)[None, :]
    kv_head = (head - NUM_Q_HEADS)[:, None]
    is_k = keep & (kv_head >= 0) & (kv_head < NUM_KV_HEADS)
    k_dst = k_cache_ptr + blk * stride_kc_b + off * stride_kc_s + kv_head * stride_kc_h + dim[:, None]
    tl.store(k_dst, o1.to(k_cache_ptr.dtype.element_ty), mask=is_k)
    tl.store(k_dst + HALF, o2.to(k_cache_ptr.dtype.element_ty), mask=is_k)
    v_head = kv_head - NUM_KV_HEADS
    is_v = keep & (v_head >= 0)
    v_dst = v_cache_ptr + blk * stride_vc_b + off * stride_vc_s + v_head * stride_vc_h + dim[:, None]
    tl.store(v_dst, x1.to(v_cache_ptr.dtype.element_ty), mask=is_v)
    tl.store(v_dst + HALF, x2.to(v_cache_ptr.dtype.element_ty), mask=is_v)


def fusable(x, w_qkv, k_cache, *, has_qk_norm: bool, bias=None) -> bool:
    """Whether the one-launch path applies: CUDA, no q/k norm, bf16/fp16 throughout, contiguous
    operands, a one-row-per-program FMA or an unsplit DOT configuration for this many tokens."""
    return (
        x.is_cuda and x.dim() == 2 and not has_qk_norm
        and x.dtype in (torch.bfloat16, torch.float16) and dense(w_qkv).dtype == x.dtype
        and k_cache.dtype == x.dtype and (bias is None or bias.dtype == x.dtype) and x.stride(1) == 1
        and dense(w_qkv).is_contiguous()
        and (row_fma_config(x.shape[0], *w_qkv.shape, isinstance(w_qkv, Fp8Weight)) is not None
             or (x.is_contiguous() and dot_rotary_config(x.shape[0], *w_qkv.shape) is not None))
    )


def qkv_rotary_store_triton(x, w_qkv, bias, positions, cos, sin, k_cache, v_cache, slot_mapping, *,
                            num_q_heads: int, num_kv_heads: int, norm: PendingNorm | None = None) -> torch.Tensor:
    """Same contract as qkv_rotary_store_reference, for N tokens where the GEMV runs one row per
    program (gemv_config.row_fma_config: N = 1, or 2 <= N <= gemv_config.ROWS_MAX_M), or unsplit on
    the DOT path (gemv_config.dot_rotary_config: 3-64 tokens, up to gemv_config.TILED_MAX_M on small
    matrices). One launch; no host sync.
    norm (one row per program only): the PendingNorm whose input x is, applied in the GEMV's
    prologue (kernels/norm.norm_stats); the result is then the reference's on norm.materialize(),
    bit for bit, and norm.stream is set."""
    if x.dim() != 2:
        raise ValueError(f"x must be [N, H], got {tuple(x.shape)}")
    m = x.shape[0]
    d = k_cache.shape[-1]
    n_out = (num_q_heads + 2 * num_kv_heads) * d
    w_qkv, scale = weight_and_scale(w_qkv)
    if w_qkv.dim() != 2 or w_qkv.shape != (n_out, x.shape[1]) or w_qkv.dtype != (x.dtype if scale is None else FP8):
        raise ValueError(f"w_qkv must be [{n_out}, {x.shape[1]}] {x.dtype} (or an Fp8Weight), got "
                         f"{tuple(w_qkv.shape)} {w_qkv.dtype}")
    if scale is not None and (scale.shape != (n_out,) or scale.dtype != torch.float32 or not scale.is_contiguous()):
        raise ValueError(f"an FP8 w_qkv's scales must be a contiguous [{n_out}] fp32 vector")
    if bias is not None and (bias.shape != (n_out,) or bias.dtype != x.dtype or not bias.is_contiguous()):
        raise ValueError(f"bias must be a contiguous [{n_out}] {x.dtype} vector")
    if norm is not None and (norm.x is not x or not norm.fusable()):
        raise ValueError("norm= takes the PendingNorm of x itself: contiguous rows, norm weight in x's dtype")
    cfg = row_fma_config(m, n_out, x.shape[1], scale is not None)
    dot = dot_rotary_config(m, n_out, x.shape[1]) if cfg is None else None
    if (cfg is None and dot is None) or not x.is_contiguous() or not w_qkv.is_contiguous():
        raise ValueError(f"qkv_rotary_store_triton needs contiguous x and w_qkv and a one-row-per-program FMA "
                         f"or unsplit DOT GEMV configuration for {m} tokens")
    if dot is not None and norm is not None:
        raise ValueError("norm= takes a one-row-per-program configuration; materialize the norm for the DOT path")
    q_out = torch.empty((m, num_q_heads, d), dtype=x.dtype, device=x.device)
    # The rotary kernel's checks; q_out's first Hkv heads stand in for k and v (same dtype, layout).
    kv = q_out[:, :num_kv_heads]
    _check_args(q_out, kv, kv, positions, cos, sin, k_cache, v_cache, slot_mapping, None, None)
    num_blocks, page = k_cache.shape[:2]
    pdl = pdl_enabled(x.device)
    # What both kernels take: the operands, then (after each one's own) sizes, strides and constexprs.
    operands = (x, w_qkv, scale if scale is not None else cos, bias if bias is not None else x, positions, cos, sin,
                q_out, k_cache, v_cache, slot_mapping)
    sizes = (m, x.shape[1], cos.shape[0], num_blocks * page, *k_cache.stride()[:3], *v_cache.stride()[:3])
    shared = dict(NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=d, PAGE=page, HAS_BIAS=bias is not None,
                  USE_PDL=pdl, HAS_SCALE=scale is not None, **pdl_launch(pdl))
    if dot is not None:
        block_n = dot["block_n"] // 2  # pairs: the weight tile keeps the GEMV's rows
        block_m = dot_block_m(m)
        _qkv_rotary_dot_kernel[(triton.cdiv(n_out // 2, block_n), row_tiles(m))](
            *operands, *sizes, **shared, BLOCK_N=block_n, BLOCK_K=dot["block_k"], BLOCK_M=block_m,
            PAD_M=m % block_m != 0, TILE_M=row_tiles(m) > 1,
            DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=dot["num_warps"],
            num_stages=dot["num_stages"],
        )  # fmt: skip
        return q_out
    block_n = cfg["block_n"]
    res, g, stream, eps, has_res = norm.kernel_args() if norm is not None else (x, x, x, 0.0, False)
    _qkv_rotary_kernel[(triton.cdiv(n_out // 2, block_n) * m,)](
        *operands, res, g, stream, eps, *sizes, **shared, BLOCK_N=block_n,
        BLOCK_K=min(cfg["block_k"], triton.next_power_of_2(x.shape[1])), REDUCE_EACH=cfg["reduce_each"],
        NORM=norm is not None, NORM_RES=has_res, BLOCK_H=triton.next_power_of_2(x.shape[1]),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    return q_out


def qkv_rotary_store(x, w_qkv, bias, positions, cos, sin, k_cache, v_cache, slot_mapping, *,
                     num_q_heads: int, num_kv_heads: int, q_norm=None, k_norm=None, eps=1e-6) -> torch.Tensor:
    """The attention prologue: [the layer's input RMSNorm, when x is a PendingNorm,] qkv projection,
    [q/k norm,] rotary of q and k, store of k and v. One launch where `fusable` says so (with the
    input norm in the GEMV's prologue where kernels/linear.norm_fusable allows), else [the norm,] the
    GEMV, then rotary_store_kv (which also takes the per-head norms). Returns the rotated q
    [N, Hq, D]."""
    kw = dict(num_q_heads=num_q_heads, num_kv_heads=num_kv_heads)
    xt = x.x if isinstance(x, PendingNorm) else x
    w_qkv = for_rows(w_qkv, xt.shape[0])
    if fusable(xt, w_qkv, k_cache, has_qk_norm=q_norm is not None, bias=bias):
        one_row = row_fma_config(xt.shape[0], *w_qkv.shape, isinstance(w_qkv, Fp8Weight)) is not None
        norm = x if one_row and norm_fusable(x) else None
        return qkv_rotary_store_triton(xt if norm is not None else materialized(x), w_qkv, bias, positions, cos,
                                       sin, k_cache, v_cache, slot_mapping, **kw, norm=norm)
    return qkv_rotary_store_reference(materialized(x), w_qkv, bias, positions, cos, sin, k_cache, v_cache,
                                      slot_mapping, **kw, q_norm=q_norm, k_norm=k_norm, eps=eps)
