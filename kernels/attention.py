"""Paged KV attention for every phase: PREFILL, TARGET_VERIFY, DRAFT_EXTEND, DRAFT_DECODE, TARGET_DECODE.

KV layout, one pool per model and one tensor per layer for K and one for V:

    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]

A request's row of `block_tables` lists its block ids in position order: position p lives in block
`block_tables[b, p // block_size]` at offset `p % block_size`; its slot is
`block_id * block_size + offset`.

Query rows of request b are `b * query_len .. b * query_len + query_len - 1`, in position order;
`seq_lens[b]` counts the KV positions after this step's keys were stored, so query row t sits at
position `seq_lens[b] - query_len + t` and attends causally to KV positions [0, that position].
Rows whose position is negative (padded batch rows, seq_len < query_len) produce zeros.

Each entry point has a PyTorch reference (`*_reference`) and a Triton kernel (`*_triton`);
`store_kv` and `paged_attention` dispatch on the device. Hazard (vLLM #43682): block-table entries
past ceil(seq_len / block_size) may hold -1, garbage or stale ids (padded rows, freed blocks);
nothing here dereferences them (each place that defends against it says so).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from graphrt.kernels.pdl import pdl_enabled, pdl_launch, prefetch_l2, wait_for_producer

__all__ = [
    "store_kv",
    "store_kv_reference",
    "store_kv_triton",
    "paged_attention",
    "paged_attention_reference",
    "paged_attention_triton",
    "attention_workspace",
    "choose_num_splits",
]

_LOG2E = 1.4426950408889634


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError("k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim], got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if k_cache.dtype != v_cache.dtype or k_cache.device != v_cache.device:
        raise ValueError("k_cache and v_cache must share dtype and device")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache must be contiguous along head_dim")


def _check_attention_args(query, k_cache, v_cache, block_tables, seq_lens, query_len, q_rows=None):
    _check_cache(k_cache, v_cache)
    _, _, hkv, d = k_cache.shape
    if query.dim() != 3 or query.shape[2] != d:
        raise ValueError(f"query must be [B * query_len, Hq, {d}], got {tuple(query.shape)}")
    if query.shape[1] % hkv != 0:
        raise ValueError(f"num query heads {query.shape[1]} is not a multiple of num kv heads {hkv}")
    if query_len < 1:
        raise ValueError(f"query_len must be >= 1, got {query_len}")
    if block_tables.dim() != 2 or seq_lens.dim() != 1 or seq_lens.shape[0] != block_tables.shape[0]:
        raise ValueError(f"block_tables must be [B, max_blocks] and seq_lens [B], got {tuple(block_tables.shape)} "
                         f"and {tuple(seq_lens.shape)}")
    if q_rows is not None:
        if query_len != 1 or q_rows.dim() != 1 or q_rows.dtype != torch.int64 or not q_rows.is_contiguous() \
                or q_rows.shape[0] != block_tables.shape[0]:
            raise ValueError(f"q_rows takes query_len 1 and a contiguous [B] int64 tensor, B = {block_tables.shape[0]}"
                             f"; got query_len {query_len}, q_rows {tuple(q_rows.shape)} {q_rows.dtype}")
        _check_devices(k_cache.device, "the cache", q_rows=q_rows)
    elif query.shape[0] != block_tables.shape[0] * query_len:
        raise ValueError(f"query has {query.shape[0]} rows, expected B * query_len = {block_tables.shape[0]} * "
                         f"{query_len}")
    if block_tables.dtype not in (torch.int32, torch.int64) or seq_lens.dtype not in (torch.int32, torch.int64):
        raise ValueError("block_tables and seq_lens must be integer tensors (int32)")
    _check_devices(k_cache.device, "the cache", query=query, block_tables=block_tables, seq_lens=seq_lens)


def _check_store_args(key, value, k_cache, v_cache, slot_mapping):
    _check_cache(k_cache, v_cache)
    _, _, hkv, d = k_cache.shape
    if key.shape != value.shape or key.dim() != 3 or tuple(key.shape[1:]) != (hkv, d):
        raise ValueError(f"key and value must be [N, {hkv}, {d}], got {tuple(key.shape)} and {tuple(value.shape)}")
    if slot_mapping.shape != (key.shape[0],):
        raise ValueError(f"slot_mapping must be [{key.shape[0]}], got {tuple(slot_mapping.shape)}")
    _check_devices(k_cache.device, "the cache", key=key, value=value, slot_mapping=slot_mapping)


def _check_devices(device, where: str, **tensors) -> None:
    for name, t in tensors.items():
        if t is not None and t.device != device:
            raise ValueError(f"{name} is on {t.device}, {where} on {device}")


def store_kv_reference(key, value, k_cache, v_cache, slot_mapping) -> None:
    """Write key[i], value[i] ([N, Hkv, D]) to slot slot_mapping[i] ([N] int64); negative slots are
    skipped. Boolean indexing syncs on CUDA: the CPU path and the tests' oracle."""
    _check_store_args(key, value, k_cache, v_cache, slot_mapping)
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    if slots.numel() and int(slots.max()) >= num_slots:
        raise IndexError(f"slot {int(slots.max())} is outside the cache's {num_slots} slots")
    k_flat = k_cache.view(num_slots, *k_cache.shape[2:])
    v_flat = v_cache.view(num_slots, *v_cache.shape[2:])
    k_flat[slots] = key[keep].to(k_cache.dtype)
    v_flat[slots] = value[keep].to(v_cache.dtype)


@triton.jit
def _store_kv_kernel(
    key_ptr,  # [N, Hkv, D]
    value_ptr,  # [N, Hkv, D]
    k_cache_ptr,  # [num_blocks, PAGE, Hkv, D]
    v_cache_ptr,  # [num_blocks, PAGE, Hkv, D]
    slot_ptr,  # [N] int64
    num_slots,  # num_blocks * PAGE
    stride_kn, stride_kh, stride_vn, stride_vh,  # key, value: token, head
    stride_kc_b, stride_kc_s, stride_kc_h, stride_vc_b, stride_vc_s, stride_vc_h,  # caches: block, slot, head
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,  # block_size: tokens per KV block
    BLOCK_H: tl.constexpr,  # kv heads per program (power of two >= NUM_KV_HEADS, capped)
    BLOCK_D: tl.constexpr,  # power of two >= HEAD_DIM
):
    n = tl.program_id(0)
    h_tile = tl.program_id(1)
    slot = tl.load(slot_ptr + n).to(tl.int64)
    # A negative slot means "skip this row"; one past the pool is skipped too (the reference raises).
    # Broadcast through a tensor: the interpreter rejects a scalar-and-tensor mask.
    offs_h = h_tile * BLOCK_H + tl.arange(0, BLOCK_H)
    slot_h = offs_h.to(tl.int64) * 0 + slot  # [BLOCK_H]
    keep = (slot_h >= 0) & (slot_h < num_slots) & (offs_h < NUM_KV_HEADS)
    blk = slot // PAGE
    off = slot % PAGE
    offs_d = tl.arange(0, BLOCK_D)
    mask = keep[:, None] & (offs_d[None, :] < HEAD_DIM)
    n64 = n.to(tl.int64)
    k = tl.load(key_ptr + n64 * stride_kn + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(value_ptr + n64 * stride_vn + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    k_dst = k_cache_ptr + (blk * stride_kc_b + off * stride_kc_s) + offs_h[:, None] * stride_kc_h
    v_dst = v_cache_ptr + (blk * stride_vc_b + off * stride_vc_s) + offs_h[:, None] * stride_vc_h
    k_dst += offs_d[None, :]
    v_dst += offs_d[None, :]
    tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv_triton(key, value, k_cache, v_cache, slot_mapping) -> None:
    """Triton store_kv: one program per token row (and kv-head tile); no host sync."""
    _check_store_args(key, value, k_cache, v_cache, slot_mapping)
    if key.stride(-1) != 1 or value.stride(-1) != 1:
        raise ValueError("key and value must be contiguous along head_dim")
    n = key.shape[0]
    if n == 0:
        return
    num_blocks, page, hkv, d = k_cache.shape
    block_d = triton.next_power_of_2(d)
    block_h = min(triton.next_power_of_2(hkv), max(1, 4096 // block_d))
    grid = (n, triton.cdiv(hkv, block_h))
    _store_kv_kernel[grid](
        key, value, k_cache, v_cache, slot_mapping, num_blocks * page,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        *k_cache.stride()[:3], *v_cache.stride()[:3],
        NUM_KV_HEADS=hkv, HEAD_DIM=d, PAGE=page, BLOCK_H=block_h, BLOCK_D=block_d,
        num_warps=4,
    )  # fmt: skip


def store_kv(key, value, k_cache, v_cache, slot_mapping) -> None:
    """Write this step's keys/values into the paged cache. CUDA -> Triton, else the reference."""
    if k_cache.is_cuda:
        store_kv_triton(key, value, k_cache, v_cache, slot_mapping)
    else:
        store_kv_reference(key, value, k_cache, v_cache, slot_mapping)


def paged_attention_reference(
    query, k_cache, v_cache, block_tables, seq_lens, *, query_len: int, scale: float, out=None,
    max_seq_len: int | None = None, q_rows: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """Gather each request's live blocks, masked softmax in fp32, vectorized over the batch. query:
    [B * query_len, Hq, D] (q_rows [B] int64, query_len 1: request b's query is row q_rows[b] of
    query, which may have any number of rows); block_tables: [B, max_blocks]; seq_lens: [B]. Keys are
    padded to max_seq_len (default: the table's capacity) and masked."""
    _check_attention_args(query, k_cache, v_cache, block_tables, seq_lens, query_len, q_rows)
    if q_rows is not None:
        query = query.index_select(0, q_rows)
    _, page, hkv, d = k_cache.shape
    bsz, max_blocks = block_tables.shape
    hq = query.shape[1]
    group = hq // hkv
    nb = max_blocks if max_seq_len is None else min(max_blocks, -(-max_seq_len // page))
    L = nb * page
    dev = query.device

    seq = seq_lens.long().clamp(min=0)  # [B]
    live_blocks = (seq + page - 1) // page  # [B]
    blk_idx = torch.arange(nb, device=dev)
    # vLLM #43682: table entries past the live blocks may be -1 / garbage / stale: they are replaced
    # by block 0 before the gather and every value gathered through them is masked out below
    # (torch.where, not a multiply, so NaN or inf in those blocks cannot leak).
    ids = torch.where(blk_idx[None, :] < live_blocks[:, None], block_tables[:, :nb].long(), 0)
    pos = torch.arange(L, device=dev)
    kv_valid = pos[None, :] < seq[:, None]  # [B, L]
    k = k_cache[ids].reshape(bsz, L, hkv, d)
    v = v_cache[ids].reshape(bsz, L, hkv, d)
    k = torch.where(kv_valid[:, :, None, None], k.float(), 0.0)
    v = torch.where(kv_valid[:, :, None, None], v.float(), 0.0)

    q = query.float().view(bsz, query_len, hkv, group, d)
    scores = torch.einsum("bthgd,blhd->bhgtl", q, k) * scale  # [B, Hkv, G, T, L]
    q_pos = seq[:, None] - query_len + torch.arange(query_len, device=dev)[None, :]  # [B, T]
    mask = (pos[None, None, :] <= q_pos[:, :, None]) & kv_valid[:, None, :]  # [B, T, L]
    scores = scores.masked_fill(~mask[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    # A row with no key (position < 0) is all -inf, so softmax gave NaN: those rows are zeros.
    probs = torch.where((q_pos >= 0)[:, None, None, :, None], probs, 0.0)
    o = torch.einsum("bhgtl,blhd->bthgd", probs, v).reshape(bsz * query_len, hq, d)
    if out is None:
        return o.to(query.dtype)
    out.copy_(o)
    return out


# Split-KV flash decoding. Kernel 1 (_paged_attn_partial_kernel), grid (B * Hkv, num_splits,
# num_q_tiles): a program owns one request, one kv head, one split of that request's KV range and
# one tile of query rows. Its BLOCK_M "rows" are (query row, query head of the GQA group) pairs,
# m = q_local * GROUP + g, so each K/V page is read once per kv head and feeds all GROUP query heads
# through tl.dot. It walks its KV range BLOCK_N tokens at a time (gathering per token through the
# block table) with an online softmax in the exp2 domain, fp32 accumulators.
#   * num_splits == 1: the program normalises and writes `out` directly (no second kernel).
#   * num_splits > 1: it writes (acc / l, lse) to the fp32 workspace and kernel 2
#     (_paged_attn_merge_kernel, grid (B * query_len, Hq / BLOCK_H, D / BLOCK_DM)) combines the splits.
#
# CUDA graphs: the grid depends only on static sizes (B, Hkv, query_len, max_seq_len); seq_lens only
# decide each program's range. The split length is derived on the device from the live length, so
# every split has work at any live length up to max_seq_len; a split or tile whose range is empty
# does nothing (the merge kernel recomputes from seq_lens which splits wrote).


@triton.jit
def _seq_cap(seq_len, max_blocks, PAGE: tl.constexpr):
    """Keys a request may have: never past the table's width, whatever seq_lens says."""
    return tl.minimum(tl.maximum(seq_len, 0), max_blocks * PAGE)


@triton.jit
def _split_len(seq_cap, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Tokens per split, from the live length: a multiple of BLOCK_N, >= BLOCK_N (the partial and
    merge kernels must agree on it)."""
    return tl.maximum(((seq_cap + NUM_SPLITS - 1) // NUM_SPLITS + BLOCK_N - 1) // BLOCK_N * BLOCK_N, BLOCK_N)


@triton.jit
def _prefetch_first_step(k_head, v_head, bt_row, seq_len, split, max_blocks, stride_kb, stride_ks, stride_vb,
                         stride_vs, ELEM_BITS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
                         BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, PF_LINES: tl.constexpr):
    """L2 prefetch of the K and V rows of this split's first KV step, before the PDL wait. The
    table is settled (kernels/pdl.py), so its entries load into L1, where the reads after the wait
    hit."""
    seq_cap = _seq_cap(seq_len, max_blocks, PAGE)
    offs_n = split * _split_len(seq_cap, NUM_SPLITS, BLOCK_N) + tl.arange(0, BLOCK_N)
    ok = offs_n < seq_cap
    blk = tl.load(bt_row + offs_n // PAGE, mask=ok, other=0).to(tl.int64)
    line = tl.arange(0, PF_LINES) * (128 // (ELEM_BITS // 8))
    m = ok[:, None] & (line < HEAD_DIM)[None, :]
    tok = (offs_n % PAGE)[:, None]
    prefetch_l2(k_head + blk[:, None] * stride_kb + tok * stride_ks + line[None, :], m)
    prefetch_l2(v_head + blk[:, None] * stride_vb + tok * stride_vs + line[None, :], m)


# Not specialised (so batch buckets share compiled variants): seq_lens_ptr and q_rows_ptr, each read
# by one scalar load whose alignment changes nothing, and total_rows, used only in the workspace
# address after the loop.
@triton.jit(do_not_specialize=["seq_lens_ptr", "q_rows_ptr", "total_rows"])
def _paged_attn_partial_kernel(
    q_ptr,  # [B * query_len, Hq, D]
    k_cache_ptr,  # [num_blocks, PAGE, Hkv, D]
    v_cache_ptr,  # [num_blocks, PAGE, Hkv, D]
    block_tables_ptr,  # [B, max_blocks] int32
    seq_lens_ptr,  # [B] int32
    q_rows_ptr,  # [B] int64 (Q_ROWS): request b's query row in q
    out_ptr,  # [B * query_len, Hq, D], written when NUM_SPLITS == 1
    ws_out_ptr,  # [NUM_SPLITS, B * query_len, Hq, D] fp32, written when NUM_SPLITS > 1
    ws_lse_ptr,  # [NUM_SPLITS, B * query_len, Hq] fp32 (log2 domain)
    query_len,
    max_blocks,
    total_rows,  # B * query_len
    scale_log2,  # softmax scale * log2(e)
    stride_qt, stride_qh,  # query: row, head
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,  # caches: block, slot, head
    stride_bt,  # block_tables: request
    stride_ot, stride_oh,  # out: row, head
    NUM_KV_HEADS: tl.constexpr,
    NUM_Q_HEADS: tl.constexpr,
    GROUP: tl.constexpr,  # NUM_Q_HEADS // NUM_KV_HEADS
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # power of two >= HEAD_DIM
    PAGE: tl.constexpr,  # block_size of the cache
    BLOCK_Q: tl.constexpr,  # query rows per program
    BLOCK_M: tl.constexpr,  # power of two >= max(16, BLOCK_Q * GROUP): (row, head) pairs
    BLOCK_N: tl.constexpr,  # KV tokens per loop step
    NUM_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 caches (no tf32), "tf32" otherwise (ignored)
    UPCAST_DOT: tl.constexpr,  # interpreter only: its tl.dot multiplies bf16 bit patterns as ints
    USE_PDL: tl.constexpr = False,
    PF_LINES: tl.constexpr = 0,  # 128-byte lines per K/V row to prefetch into L2 before the wait
    Q_ROWS: tl.constexpr = False,  # query_len 1, the queries picked from q's rows by q_rows_ptr
):
    pid_bh = tl.program_id(0)
    split = tl.program_id(1)
    q_tile = tl.program_id(2)
    b = pid_bh // NUM_KV_HEADS
    kvh = pid_bh % NUM_KV_HEADS
    bt_row = block_tables_ptr + b.to(tl.int64) * stride_bt
    k_head = k_cache_ptr + kvh * stride_kh
    v_head = v_cache_ptr + kvh * stride_vh
    # Settled (kernels/pdl.py): read once, before the wait.
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    if USE_PDL:
        if PF_LINES > 0:
            # This split's first KV step into L2 while the producer (the K/V store) finishes: a
            # one-step split's DRAM round trip leaves the critical path.
            _prefetch_first_step(k_head, v_head, bt_row, seq_len, split, max_blocks, stride_kb, stride_ks,
                                 stride_vb, stride_vs, k_cache_ptr.dtype.element_ty.primitive_bitwidth, HEAD_DIM,
                                 PAGE, BLOCK_N, NUM_SPLITS, PF_LINES)
        wait_for_producer()  # a programmatic dependent: what is not settled is read after this
    seq_cap = _seq_cap(seq_len, max_blocks, PAGE)

    q_start = q_tile * BLOCK_Q
    offs_m = tl.arange(0, BLOCK_M)
    q_local = offs_m // GROUP
    q_idx = q_start + q_local
    head = kvh * GROUP + offs_m % GROUP
    row_ok = (q_local < BLOCK_Q) & (q_idx < query_len)
    row_pos = seq_len - query_len + q_idx  # [BLOCK_M] position of each row; < 0: padded row
    row = b * query_len + q_idx  # [BLOCK_M] row of query / out

    # Causal skipping: this tile needs keys up to its last row's position only.
    tile_last = seq_len - query_len + tl.minimum(q_start + BLOCK_Q, query_len) - 1
    kv_end = tl.minimum(tile_last + 1, seq_cap)
    split_len = _split_len(seq_cap, NUM_SPLITS, BLOCK_N)
    kv_start = split * split_len
    kv_stop = tl.minimum(kv_start + split_len, kv_end)  # <= kv_start: nothing to do

    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    q_row = row.to(tl.int64)
    if Q_ROWS:  # q_idx is 0 on the live lanes
        q_row = tl.load(q_rows_ptr + b).to(tl.int64) + q_idx
    q = tl.load(
        q_ptr + q_row[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(kv_start, kv_stop, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_ok = offs_n < kv_stop
        # vLLM #43682: only table entries of live positions (< kv_stop <= seq_len) are loaded, and a
        # masked-off lane never dereferences its K/V address, so -1 / garbage / stale ids in the
        # tail of the table are never read.
        blk = tl.load(bt_row + offs_n // PAGE, mask=n_ok, other=0).to(tl.int64)
        tok = offs_n % PAGE
        k = tl.load(
            k_head + (blk * stride_kb + tok * stride_ks)[None, :] + offs_d[:, None],
            mask=n_ok[None, :] & d_ok[:, None],
            other=0.0,
        )  # [BLOCK_D, BLOCK_N]
        if UPCAST_DOT:
            s = tl.dot(q.to(tl.float32), k.to(tl.float32), input_precision="ieee")
        else:
            s = tl.dot(q, k, input_precision=DOT_PRECISION)
        s = s * scale_log2  # [BLOCK_M, BLOCK_N]
        causal = (offs_n[None, :] <= row_pos[:, None]) & n_ok[None, :]
        s = tl.where(causal, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row that has seen no key yet keeps m = -inf; subtract 0 instead so exp2 gives 0, not NaN.
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_sub)
        p = tl.exp2(s - m_sub[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        # Loaded here, not with K: issuing V before the QK^T product measured slower with one KV
        # step per split.
        v = tl.load(
            v_head + (blk * stride_vb + tok * stride_vs)[:, None] + offs_d[None, :],
            mask=n_ok[:, None] & d_ok[None, :],
            other=0.0,
        )  # [BLOCK_N, BLOCK_D]
        p_lo = p.to(v.dtype)  # P rounded to the cache dtype for the second MMA, as flash attention does
        if UPCAST_DOT:
            pv = tl.dot(p_lo.to(tl.float32), v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p_lo, v, input_precision=DOT_PRECISION)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    has_key = l_i > 0.0
    o = acc / tl.where(has_key, l_i, 1.0)[:, None]  # rows without a key: acc == 0 -> zeros
    if NUM_SPLITS == 1:
        tl.store(
            out_ptr + row[:, None].to(tl.int64) * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & d_ok[None, :],
        )
    else:
        # Empty splits write nothing; the merge kernel knows which splits wrote (same formula). The
        # scalar test goes through a [BLOCK_M] tensor: the interpreter rejects a scalar-and-tensor mask.
        wrote = row_ok & ((offs_m * 0 + kv_start) < kv_end)  # [BLOCK_M]
        ws_row = (split * total_rows + row).to(tl.int64) * NUM_Q_HEADS + head  # [BLOCK_M]
        tl.store(
            ws_out_ptr + ws_row[:, None] * HEAD_DIM + offs_d[None, :],
            o,
            mask=wrote[:, None] & d_ok[None, :],
        )
        lse = tl.where(has_key, m_i + tl.log2(tl.where(has_key, l_i, 1.0)), float("-inf"))
        tl.store(ws_lse_ptr + ws_row, lse, mask=wrote)


# Not specialised (so decode and verify buckets share compiled variants): seq_lens_ptr (one scalar
# load), query_len and total_rows (a program's row arithmetic, done before the PDL wait; the partials'
# addresses step by HEAD_DIM whatever they are).
@triton.jit(do_not_specialize=["seq_lens_ptr", "query_len", "total_rows"])
def _paged_attn_merge_kernel(
    out_ptr,  # [B * query_len, Hq, D]
    ws_out_ptr,  # [NUM_SPLITS, B * query_len, Hq, D] fp32
    ws_lse_ptr,  # [NUM_SPLITS, B * query_len, Hq] fp32
    seq_lens_ptr,  # [B] int32
    query_len,
    max_blocks,
    total_rows,  # B * query_len
    stride_ot, stride_oh,  # out: row, head
    NUM_Q_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_P2: tl.constexpr,  # power of two >= NUM_SPLITS
    BLOCK_H: tl.constexpr,  # query heads per program
    BLOCK_DM: tl.constexpr,  # head_dim slice per program
    USE_PDL: tl.constexpr = False,
):
    row = tl.program_id(0)
    h_tile = tl.program_id(1)
    d_tile = tl.program_id(2)
    b = row // query_len
    t = row % query_len
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)  # settled (kernels/pdl.py): before the wait
    if USE_PDL:  # the partials come from the producer
        wait_for_producer()
    seq_cap = _seq_cap(seq_len, max_blocks, PAGE)
    pos = seq_len - query_len + t
    last_key = tl.minimum(pos, seq_cap - 1)
    split_len = _split_len(seq_cap, NUM_SPLITS, BLOCK_N)
    # Splits that hold at least one key of this row: exactly those the partial kernel wrote; the
    # others may hold stale values from an earlier call and are never loaded.
    num_valid = tl.where(last_key >= 0, last_key // split_len + 1, 0)

    offs_h = h_tile * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_s = tl.arange(0, SPLITS_P2)
    offs_d = d_tile * BLOCK_DM + tl.arange(0, BLOCK_DM)
    d_ok = offs_d < HEAD_DIM
    h_ok = offs_h < NUM_Q_HEADS
    s_ok = (offs_s < num_valid)[None, :] & h_ok[:, None]  # [BLOCK_H, SPLITS_P2]
    ws_row = (offs_s[None, :] * total_rows + row).to(tl.int64) * NUM_Q_HEADS + offs_h[:, None]
    lse = tl.load(ws_lse_ptr + ws_row, mask=s_ok, other=float("-inf"))  # [BLOCK_H, SPLITS_P2]
    # Both loads before any use: the partials do not wait for the weights' arithmetic.
    part = tl.load(
        ws_out_ptr + ws_row[:, :, None] * HEAD_DIM + offs_d[None, None, :],
        mask=s_ok[:, :, None] & d_ok[None, None, :],
        other=0.0,
    )  # [BLOCK_H, SPLITS_P2, BLOCK_DM]
    lse_max = tl.max(lse, 1)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    w = tl.exp2(lse - lse_max[:, None])  # 0 for unused splits
    denom = tl.sum(w, 1)  # [BLOCK_H]
    o = tl.sum(part * w[:, :, None], 1) / tl.where(denom > 0.0, denom, 1.0)[:, None]  # rows w/o key: 0
    tl.store(
        out_ptr + row.to(tl.int64) * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=h_ok[:, None] & d_ok[None, :],
    )


# choose_num_splits's heuristics, tuned with kernels/attention_bench.py. Fewer tokens per split
# than _MIN_SPLIT_TOKENS (one BLOCK_N step at D = 128) cost more in merging than they gain.
# Programs per SM to aim for: 2, but 4 (one- or two-KV-step splits) for single-token queries on a
# grid so small that only latency matters; a verify-sized query keeps 2, since every split writes
# an fp32 partial per query row.
_MAX_SPLITS = 64
_MIN_SPLIT_TOKENS = 64
_PROGRAMS_PER_SM = 2
_PROGRAMS_PER_SM_TINY = 4  # query_len 1 and an un-split grid under 1/8 of the SMs
_MAX_BLOCK_M = 64  # prefill query tile: BLOCK_Q = _MAX_BLOCK_M // GROUP rows


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _device_sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return 16  # the interpreter (tests): small, so that tests exercise several splits


def choose_num_splits(num_programs: int, max_seq_len: int, sm_count: int, query_len: int = 1) -> int:
    """Splits of the KV range per (request, kv head, query tile), from static sizes only (the result
    fixes a CUDA graph's grid): only where the un-split grid leaves SMs idle, at most one per started
    _MIN_SPLIT_TOKENS of max_seq_len."""
    if num_programs >= sm_count:
        return 1
    tiny = query_len == 1 and 8 * num_programs <= sm_count
    per_sm = _PROGRAMS_PER_SM_TINY if tiny else _PROGRAMS_PER_SM
    want = -(-per_sm * sm_count // num_programs)
    # Rounded up: a context a little past a multiple of 64 gets one more split of one step, not one
    # less of two steps (one-step splits are the faster).
    by_len = -(-max_seq_len // _MIN_SPLIT_TOKENS)
    return max(1, min(want, by_len, _MAX_SPLITS))


def attention_workspace(
    total_rows: int, num_q_heads: int, head_dim: int, num_splits: int, device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(partial out [S, rows, Hq, D] fp32, lse [S, rows, Hq] fp32) for paged_attention_triton."""
    ws_out = torch.empty(num_splits, total_rows, num_q_heads, head_dim, dtype=torch.float32, device=device)
    ws_lse = torch.empty(num_splits, total_rows, num_q_heads, dtype=torch.float32, device=device)
    return ws_out, ws_lse


def paged_attention_triton(
    query, k_cache, v_cache, block_tables, seq_lens, *, query_len: int, scale: float, out=None,
    max_seq_len: int | None = None, num_splits: int | None = None,
    workspace: tuple[torch.Tensor, torch.Tensor] | None = None, block_n: int | None = None, num_warps: int = 4,
    num_stages: int | None = None, q_rows: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """Split-KV flash decoding over the paged cache; no host sync, static grid.

    max_seq_len: the static bound of seq_lens that sizes the split count (default: the table's
    capacity), not a correctness bound. num_splits: override the heuristic (tests, tuning).
    workspace: attention_workspace(...) with at least num_splits splits, else allocated here (from
    the graph's pool inside a capture). Under PDL both kernels read seq_lens and block_tables before
    their wait: the caller vouches that they are settled (kernels/pdl.py). q_rows: as the
    reference's, read after the wait (no launch gathers the rows)."""
    _check_attention_args(query, k_cache, v_cache, block_tables, seq_lens, query_len, q_rows)
    if query.stride(-1) != 1:
        raise ValueError("query must be contiguous along head_dim")
    num_blocks, page, hkv, d = k_cache.shape
    bsz, max_blocks = block_tables.shape
    _, hq, _ = query.shape
    total_rows = bsz * query_len
    group = hq // hkv
    out_shape = (total_rows, hq, d)
    if out is None:
        out = torch.empty(out_shape, dtype=query.dtype, device=query.device)
    elif out.shape != out_shape or out.stride(-1) != 1 or out.device != query.device:
        raise ValueError(f"out must be {out_shape} on {query.device}, contiguous along head_dim")
    if total_rows == 0:
        return out
    if block_tables.dtype != torch.int32 or not block_tables.stride(-1) == 1:
        raise ValueError("block_tables must be int32, contiguous along its last dim")

    # All rows in one tile for decode phases, BLOCK_Q-row tiles for prefill.
    block_q = query_len if query_len * group <= _MAX_BLOCK_M else max(1, _MAX_BLOCK_M // group)
    block_m = max(16, triton.next_power_of_2(block_q * group))
    num_q_tiles = triton.cdiv(query_len, block_q)
    block_d = triton.next_power_of_2(max(d, 16))
    if block_n is None:
        block_n = 64 if block_d >= 128 else 128
        if block_m >= 64:
            block_n = 64 if block_d <= 64 else 32
    if max_seq_len is None:
        max_seq_len = max_blocks * page
    if num_splits is None:
        num_splits = choose_num_splits(bsz * hkv * num_q_tiles, max_seq_len, _device_sm_count(query.device),
                                       query_len)
    if num_splits < 1 or num_splits > _MAX_SPLITS:
        raise ValueError(f"num_splits must be in [1, {_MAX_SPLITS}], got {num_splits}")

    if num_splits > 1:
        if workspace is None:
            workspace = attention_workspace(total_rows, hq, d, num_splits, query.device)
        ws_out, ws_lse = workspace
        if any(t.dtype != torch.float32 or not t.is_contiguous() or t.shape[0] < num_splits for t in workspace) or (
            tuple(ws_out.shape[1:]) != (total_rows, hq, d) or tuple(ws_lse.shape[1:]) != (total_rows, hq)
        ):
            raise ValueError(f"workspace must be contiguous fp32 ([>={num_splits}, {total_rows}, {hq}, {d}], "
                             f"[>={num_splits}, {total_rows}, {hq}])")
    else:
        ws_out = ws_lse = out  # unused by the kernel when NUM_SPLITS == 1

    dot_precision = "ieee" if k_cache.dtype == torch.float32 or query.dtype == torch.float32 else "tf32"
    if query.dtype != k_cache.dtype:
        raise ValueError(f"query dtype {query.dtype} differs from the cache's {k_cache.dtype}")
    if num_stages is None and num_splits > 1 and max_seq_len <= 2 * block_n * num_splits:
        # A split of one or two KV steps has nothing to software-pipeline; the stages' prologue
        # only delays its first load (one stage measured fastest at every tile at B = 1).
        num_stages = 1
    extra = {} if num_stages is None else {"num_stages": num_stages}
    # The q_rows launch (DRAFT_EXTEND's last rows) waits for its producers in full: as a programmatic
    # dependent it was resident early, and so were the kernels after it (the o GEMV prefetching its
    # weights), beside the 4-row projections before it, which then ran slower than with the query
    # gather's launch between them (docs/notes/benchmarks-history.md, 2026-11-27).
    pdl = pdl_enabled(query.device) and q_rows is None
    _paged_attn_partial_kernel[(bsz * hkv, num_splits, num_q_tiles)](
        query, k_cache, v_cache, block_tables, seq_lens, q_rows if q_rows is not None else seq_lens, out, ws_out,
        ws_lse, query_len, max_blocks, total_rows, scale * _LOG2E,
        query.stride(0), query.stride(1),
        *k_cache.stride()[:3], *v_cache.stride()[:3],
        block_tables.stride(0), out.stride(0), out.stride(1),
        NUM_KV_HEADS=hkv, NUM_Q_HEADS=hq, GROUP=group, HEAD_DIM=d, BLOCK_D=block_d, PAGE=page,
        BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=block_n, NUM_SPLITS=num_splits, DOT_PRECISION=dot_precision,
        # Triton's interpreter (CPU tests) runs tl.dot as numpy matmul on bf16's raw uint16 bits
        # (garbage) and on fp16 without BLAS (slow): there, both operands go through fp32.
        UPCAST_DOT=not query.is_cuda,
        USE_PDL=pdl,
        # Whole 128-byte lines of one K/V row (head_dim * element size), a power of two for arange.
        PF_LINES=triton.next_power_of_2(triton.cdiv(d * k_cache.element_size(), 128)),
        Q_ROWS=q_rows is not None,
        num_warps=num_warps,
        **extra,
        **pdl_launch(pdl),
    )  # fmt: skip
    if num_splits > 1:
        splits_p2 = triton.next_power_of_2(num_splits)
        # Merge tile [heads, splits, D slice] of <= 4096 fp32 values (32 a thread at 4 warps; 8192
        # spilled registers at 64 splits x D 128 on sm_90).
        merge_d = min(block_d, max(16, 4096 // splits_p2))
        merge_h = max(1, min(triton.next_power_of_2(hq), 4096 // (splits_p2 * merge_d)))
        merge_grid = (total_rows, triton.cdiv(hq, merge_h), triton.cdiv(d, merge_d))
        _paged_attn_merge_kernel[merge_grid](
            out, ws_out, ws_lse, seq_lens, query_len, max_blocks, total_rows, out.stride(0), out.stride(1),
            NUM_Q_HEADS=hq, HEAD_DIM=d, PAGE=page, BLOCK_N=block_n, NUM_SPLITS=num_splits, SPLITS_P2=splits_p2,
            BLOCK_H=merge_h, BLOCK_DM=merge_d, USE_PDL=pdl, num_warps=4, **pdl_launch(pdl),
        )  # fmt: skip
    return out


def paged_attention(
    query, k_cache, v_cache, block_tables, seq_lens, *, query_len: int, scale: float, out=None,
    max_seq_len: int | None = None, workspace: tuple[torch.Tensor, torch.Tensor] | None = None,
    q_rows: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """Causal attention of B * query_len query rows over the paged KV cache (module docstring),
    [B * query_len, Hq, D] in query's dtype (q_rows [B] int64, query_len 1: request b's query is
    row q_rows[b] of query). CUDA -> Triton, whose grid max_seq_len sizes and whose split buffer
    workspace is (for callers that keep static buffers per captured graph)."""
    args = (query, k_cache, v_cache, block_tables, seq_lens)
    kw = dict(query_len=query_len, scale=scale, out=out, max_seq_len=max_seq_len, q_rows=q_rows)
    if query.is_cuda:
        return paged_attention_triton(*args, **kw, workspace=workspace)
    return paged_attention_reference(*args, **kw)
