"""Paged KV attention and store_kv: Triton vs reference vs an independent dense oracle.

On CPU the Triton kernels run under TRITON_INTERPRET=1 (tests/conftest.py) at small sizes; the
`gpu` tests repeat the comparisons at Llama-3.1-8B sizes in bf16. Every random case draws a fresh
seed (tests/seeds.py: replayable with GRAPHRT_TEST_SEED) and prints it in the assertion message.

Every cache slot that is not a live KV position is poisoned with NaN: a kernel that reads a block
past the live length (table entries of -1, huge or stale ids: vLLM #43682) or the tail of the last
live block would produce NaN (or crash on an invalid address).
"""

from __future__ import annotations

import itertools
import os

import pytest
import torch
from graphrt.kernels.attention import (
    attention_workspace,
    choose_num_splits,
    paged_attention,
    paged_attention_reference,
    paged_attention_triton,
    store_kv,
    store_kv_reference,
    store_kv_triton,
)

from tests.seeds import fresh_seed

# (atol, rtol) of an output against the fp32 reference, by dtype. bf16/fp16 kernels round the
# softmax weights to the cache dtype before the PV product, as flash attention does.
TOL = {
    torch.float32: (2e-5, 2e-5),
    torch.float16: (4e-3, 4e-3),
    torch.bfloat16: (3e-2, 3e-2),
}




def make_case(
    seed: int,
    seq_lens: list[int],
    *,
    query_len: int,
    hq: int,
    hkv: int,
    head_dim: int,
    page: int,
    dtype: torch.dtype,
    extra_cols: int = 2,
    device: str = "cpu",
):
    """Random paged cache with shuffled block ids, NaN everywhere but the live slots, and garbage
    (-1, 2**31 - 1, ids of poisoned or of other requests' blocks) in the table past the live blocks.

    Returns (query, k_cache, v_cache, block_tables, seq_lens, dense) where dense[b] = (K, V) of
    request b as contiguous [seq_len, Hkv, D] tensors (the values stored, in the cache dtype).
    """
    gen = torch.Generator().manual_seed(seed)
    bsz = len(seq_lens)
    live = [-(-max(s, 0) // page) for s in seq_lens]
    spare = 3
    num_blocks = sum(live) + spare
    width = max(live + [1]) + extra_cols
    perm = torch.randperm(num_blocks, generator=gen)
    nan = float("nan")
    k_cache = torch.full((num_blocks, page, hkv, head_dim), nan, dtype=dtype)
    v_cache = torch.full_like(k_cache, nan)
    tables = torch.empty(bsz, width, dtype=torch.int32)
    dense = []
    used = 0
    for b, s in enumerate(seq_lens):
        ids = perm[used : used + live[b]]
        used += live[b]
        tables[b, : live[b]] = ids.to(torch.int32)
        # Garbage past the live blocks: -1, huge, a poisoned spare block, another request's block.
        garbage = [-1, 2**31 - 1, int(perm[-1]), int(perm[0])]
        for j in range(live[b], width):
            tables[b, j] = garbage[int(torch.randint(len(garbage), (1,), generator=gen))]
        k = torch.randn(max(s, 0), hkv, head_dim, generator=gen).to(dtype)
        v = torch.randn(max(s, 0), hkv, head_dim, generator=gen).to(dtype)
        pos = torch.arange(max(s, 0))
        if s > 0:
            blk = ids[pos // page]
            k_cache[blk, pos % page] = k
            v_cache[blk, pos % page] = v
        dense.append((k, v))
    query = torch.randn(bsz * query_len, hq, head_dim, generator=gen).to(dtype)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    to = lambda t: t.to(device)
    return to(query), to(k_cache), to(v_cache), to(tables), to(seq), dense


def dense_attention(query, dense, *, query_len: int, scale: float) -> torch.Tensor:
    """Naive causal attention over contiguous K/V, in float64, one request at a time."""
    hq = query.shape[1]
    out = torch.zeros(query.shape, dtype=torch.float64)
    for b, (k, v) in enumerate(dense):
        s = k.shape[0]
        group = hq // k.shape[1]
        kk = k.double().repeat_interleave(group, dim=1)  # [S, Hq, D]
        vv = v.double().repeat_interleave(group, dim=1)
        for t in range(query_len):
            pos = s - query_len + t
            if pos < 0:
                continue  # padded row: zeros
            q = query[b * query_len + t].double()  # [Hq, D]
            scores = torch.einsum("hd,shd->hs", q, kk[: pos + 1]) * scale
            out[b * query_len + t] = torch.einsum("hs,shd->hd", torch.softmax(scores, -1), vv[: pos + 1])
    return out


def ragged_lens(query_len: int, page: int) -> list[int]:
    """seq_len == query_len, ending exactly on a block boundary, mid-block, and a padded row."""
    return [query_len, 3 * page, 2 * page + page // 2 + 1, query_len - 1]


def assert_close(actual, expected, dtype, seed, what):
    atol, rtol = TOL[dtype]
    actual = actual.float().cpu()
    expected = expected.float().cpu()
    assert not torch.isnan(actual).any(), f"{what}: NaN in output (a dead block was read?), seed={seed}"
    err = (actual - expected).abs().max().item()
    assert torch.allclose(actual, expected, atol=atol, rtol=rtol), f"{what}: max err {err}, seed={seed}"


# ---------------------------------------------------------------------------------------------
# Reference vs an independent dense oracle
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "query_len,group,head_dim,page",
    [(1, 1, 16, 4), (2, 2, 16, 16), (4, 4, 64, 4), (6, 2, 16, 4), (37, 2, 16, 16)],
)
def test_reference_matches_dense(query_len, group, head_dim, page):
    seed = fresh_seed()
    hkv = 2
    lens = ragged_lens(query_len, page) if query_len < 37 else [60]
    q, kc, vc, bt, sl, dense = make_case(
        seed, lens, query_len=query_len, hq=hkv * group, hkv=hkv, head_dim=head_dim, page=page,
        dtype=torch.float32,
    )  # fmt: skip
    scale = head_dim**-0.5
    ref = paged_attention_reference(q, kc, vc, bt, sl, query_len=query_len, scale=scale)
    assert ref.dtype == q.dtype and ref.shape == q.shape
    assert_close(ref, dense_attention(q, dense, query_len=query_len, scale=scale), torch.float32, seed, "ref")
    # Padded rows (position < 0) are exactly zero.
    for b, s in enumerate(lens):
        for t in range(query_len):
            if s - query_len + t < 0:
                assert torch.all(ref[b * query_len + t] == 0), f"padded row not zero, seed={seed}"


def test_reference_out_and_dispatch():
    seed = fresh_seed()
    q, kc, vc, bt, sl, dense = make_case(
        seed, [5, 9], query_len=2, hq=4, hkv=2, head_dim=16, page=4, dtype=torch.float32
    )
    out = torch.full_like(q, 7.0)
    got = paged_attention(q, kc, vc, bt, sl, query_len=2, scale=0.25, out=out)
    assert got is out
    assert_close(out, dense_attention(q, dense, query_len=2, scale=0.25), torch.float32, seed, "dispatch")


# ---------------------------------------------------------------------------------------------
# Triton (interpreter on CPU) vs reference
# ---------------------------------------------------------------------------------------------

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Every query_len x GQA ratio; head_dim, block_size and dtype rotate so each value meets each other.
TRITON_CASES = [
    (ql, g, [16, 64][i % 2], [4, 16][(i // 2) % 2], DTYPES[i % 3])
    for i, (ql, g) in enumerate(itertools.product([1, 2, 4, 6], [1, 2, 4]))
]


@pytest.mark.parametrize("query_len,group,head_dim,page,dtype", TRITON_CASES)
def test_triton_matches_reference(query_len, group, head_dim, page, dtype):
    seed = fresh_seed()
    hkv = 2
    q, kc, vc, bt, sl, dense = make_case(
        seed, ragged_lens(query_len, page), query_len=query_len, hq=hkv * group, hkv=hkv,
        head_dim=head_dim, page=page, dtype=dtype,
    )  # fmt: skip
    scale = head_dim**-0.5
    ref = paged_attention_reference(q, kc, vc, bt, sl, query_len=query_len, scale=scale)
    what = f"ql={query_len} group={group} D={head_dim} page={page} {dtype}"
    # One split (out written directly) and several (workspace + merge kernel), small KV steps so
    # that the splits really divide these short sequences.
    for num_splits, block_n in ((1, None), (3, 16)):
        tri = paged_attention_triton(
            q, kc, vc, bt, sl, query_len=query_len, scale=scale, num_splits=num_splits, block_n=block_n
        )
        assert tri.dtype == dtype and tri.shape == q.shape
        assert_close(tri, ref, dtype, seed, f"{what} splits={num_splits}")
        for b, s in enumerate(ragged_lens(query_len, page)):
            for t in range(max(0, query_len - s)):
                assert torch.all(tri[b * query_len + t] == 0), f"padded row not zero, seed={seed}"
    if dtype == torch.float32:
        assert_close(tri, dense_attention(q, dense, query_len=query_len, scale=scale), dtype, seed, what)


@pytest.mark.parametrize("lens", [[45], [37, 37, 37]])
@pytest.mark.parametrize("dtype,num_splits", [(torch.float32, None), (torch.bfloat16, 2)])
def test_triton_prefill(dtype, num_splits, lens):
    """query_len = 37 > one query tile (GQA 4: 16-row tiles), causal skipping per tile: one request
    past a cached prefix, and three prompts padded to one length as a batched prefill runs them."""
    seed = fresh_seed()
    q, kc, vc, bt, sl, dense = make_case(
        seed, lens, query_len=37, hq=8, hkv=2, head_dim=16, page=16, dtype=dtype
    )
    ref = paged_attention_reference(q, kc, vc, bt, sl, query_len=37, scale=0.25)
    tri = paged_attention_triton(
        q, kc, vc, bt, sl, query_len=37, scale=0.25, num_splits=num_splits, block_n=16
    )
    assert_close(tri, ref, dtype, seed, f"prefill {dtype}")
    if dtype == torch.float32:
        assert_close(tri, dense_attention(q, dense, query_len=37, scale=0.25), dtype, seed, "prefill dense")


def test_triton_workspace_stale_entries_never_read():
    """A reused workspace full of NaN, then of another call's partials, never leaks into the output:
    the merge kernel reads only the splits this call wrote (graph replays reuse one workspace)."""
    seed = fresh_seed()
    q, kc, vc, bt, sl, _ = make_case(
        seed, [70, 33, 4, 1], query_len=2, hq=4, hkv=2, head_dim=16, page=4, dtype=torch.float32
    )
    ws = attention_workspace(q.shape[0], 4, 16, 4, "cpu")
    ws[0].fill_(float("nan"))
    ws[1].fill_(float("nan"))
    ref = paged_attention_reference(q, kc, vc, bt, sl, query_len=2, scale=0.3)
    out = torch.empty_like(q)
    kw = dict(query_len=2, scale=0.3, num_splits=4, block_n=16, workspace=ws, out=out)
    paged_attention_triton(q, kc, vc, bt, sl, **kw)
    assert_close(out, ref, torch.float32, seed, "nan workspace")
    # Same buffers, shorter sequences: fewer splits are live; stale ones stay unread.
    sl2 = torch.tensor([20, 3, 4, 0], dtype=torch.int32)
    paged_attention_triton(q, kc, vc, bt, sl2, **kw)
    ref2 = paged_attention_reference(q, kc, vc, bt, sl2, query_len=2, scale=0.3)
    assert_close(out, ref2, torch.float32, seed, "reused workspace")


def test_triton_split_count_does_not_change_result():
    """Grid shape is static (max_seq_len / num_splits), results depend only on seq_lens."""
    seed = fresh_seed()
    q, kc, vc, bt, sl, _ = make_case(
        seed, [61, 17], query_len=1, hq=2, hkv=1, head_dim=16, page=4, dtype=torch.float32
    )
    ref = paged_attention_reference(q, kc, vc, bt, sl, query_len=1, scale=0.25)
    for kw in (dict(max_seq_len=4096), dict(num_splits=7, block_n=16), dict(max_seq_len=16)):
        tri = paged_attention_triton(q, kc, vc, bt, sl, query_len=1, scale=0.25, **kw)
        assert_close(tri, ref, torch.float32, seed, f"{kw}")


def test_choose_num_splits():
    assert choose_num_splits(1024, 32768, 132) == 1  # big batch: the grid already fills the GPU
    assert choose_num_splits(8, 4096, 132) == 64  # B=1, Hkv=8: capped by >= 64 tokens a split
    assert choose_num_splits(8, 2048, 132) == 32
    assert choose_num_splits(8, 32768, 132) == 64  # capped by _MAX_SPLITS
    assert choose_num_splits(64, 4096, 132) == 5  # ~2 programs per SM
    assert choose_num_splits(16, 4096, 132) == 33  # B=2: still a tiny grid
    assert choose_num_splits(32, 4096, 132) == 9  # B=4: 2 programs per SM
    assert choose_num_splits(8, 4096, 132, query_len=4) == 33  # verify rows: half the splits
    assert choose_num_splits(16, 4096, 132, query_len=4) == 17
    assert choose_num_splits(8, 64, 132) == 1  # one KV step: nothing to split
    assert choose_num_splits(8, 100, 132) == 2  # one split per started 64 tokens
    assert choose_num_splits(8, 176, 132) == 3  # llama-1b bench capacity: 3 one-step splits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_q_rows_pick_each_requests_query_from_a_larger_block(dtype):
    """q_rows (DRAFT_EXTEND's last rows): request b's one query is row q_rows[b] of a query block
    with more rows (here 4 a request, the pick anywhere in the block or another's); the same output
    as gathering those rows first, bit for bit, split and unsplit, and the reference's."""
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    lens = [9, 1, 17]
    q, kc, vc, bt, sl, _ = make_case(seed, lens, query_len=1, hq=4, hkv=2, head_dim=16, page=4, dtype=dtype)
    block = torch.randn(4 * len(lens), 4, 16, generator=gen).to(dtype)  # the rows to pick from
    q_rows = torch.tensor([3, 4, 4], dtype=torch.int64)
    snap = (block.clone(), q_rows.clone())
    picked = block.index_select(0, q_rows)
    ref = paged_attention_reference(picked, kc, vc, bt, sl, query_len=1, scale=0.25)
    assert torch.equal(paged_attention_reference(block, kc, vc, bt, sl, query_len=1, scale=0.25, q_rows=q_rows), ref)
    for num_splits, block_n in ((1, None), (3, 16)):
        kw = dict(query_len=1, scale=0.25, num_splits=num_splits, block_n=block_n)
        got = paged_attention_triton(block, kc, vc, bt, sl, q_rows=q_rows, **kw)
        want = paged_attention_triton(picked, kc, vc, bt, sl, **kw)
        assert got.shape == (3, 4, 16) and torch.equal(got, want), f"seed={seed} splits={num_splits}"
        assert_close(got, ref, dtype, seed, f"q_rows splits={num_splits}")
    assert torch.equal(block, snap[0]) and torch.equal(q_rows, snap[1])
    for bad in (q_rows.to(torch.int32), q_rows[:2], torch.zeros(6, dtype=torch.int64)[::2]):
        with pytest.raises(ValueError, match="q_rows"):
            paged_attention_triton(block, kc, vc, bt, sl, query_len=1, scale=0.25, q_rows=bad)
    with pytest.raises(ValueError, match="q_rows"):
        paged_attention_reference(block, kc, vc, bt, sl, query_len=2, scale=0.25, q_rows=q_rows)


def test_bad_arguments():
    q, kc, vc, bt, sl, _ = make_case(
        1, [5], query_len=1, hq=3, hkv=2, head_dim=16, page=4, dtype=torch.float32
    )
    with pytest.raises(ValueError, match="multiple"):
        paged_attention_reference(q, kc, vc, bt, sl, query_len=1, scale=1.0)
    q, kc, vc, bt, sl, _ = make_case(
        1, [5], query_len=1, hq=2, hkv=2, head_dim=16, page=4, dtype=torch.float32
    )
    with pytest.raises(ValueError, match="rows"):
        paged_attention_triton(q, kc, vc, bt, sl, query_len=2, scale=1.0)


# ---------------------------------------------------------------------------------------------
# store_kv
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", [store_kv_reference, store_kv_triton, store_kv])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_store_kv(impl, cache_dtype):
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    num_blocks, page, hkv, d, n = 7, 4, 3, 16, 10
    k_cache = torch.randn(num_blocks, page, hkv, d, generator=gen).to(cache_dtype)
    v_cache = torch.randn(num_blocks, page, hkv, d, generator=gen).to(cache_dtype)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    slots = torch.randperm(num_blocks * page, generator=gen)[:n]
    slots[torch.randperm(n, generator=gen)[:3]] = -1  # skipped rows
    # Key/value as views of a fused qkv projection (non-contiguous rows).
    qkv = torch.randn(n, 4 + 2 * hkv, d, generator=gen).to(cache_dtype)
    key, value = qkv[:, 4 : 4 + hkv], qkv[:, 4 + hkv :]
    impl(key, value, k_cache, v_cache, slots)

    bits = torch.int32 if cache_dtype == torch.float32 else torch.int16
    flat_k, flat_v = k_cache.view(-1, hkv, d), v_cache.view(-1, hkv, d)
    expect_k, expect_v = k_before.view(-1, hkv, d).clone(), v_before.view(-1, hkv, d).clone()
    keep = slots >= 0
    expect_k[slots[keep]] = key[keep]
    expect_v[slots[keep]] = value[keep]
    assert torch.equal(flat_k.view(bits), expect_k.view(bits)), f"k_cache slots differ, seed={seed}"
    assert torch.equal(flat_v.view(bits), expect_v.view(bits)), f"v_cache slots differ, seed={seed}"


def test_store_kv_casts_to_cache_dtype():
    key = torch.randn(3, 2, 16)
    value = torch.randn(3, 2, 16)
    kc = torch.zeros(2, 4, 2, 16, dtype=torch.bfloat16)
    vc = torch.zeros_like(kc)
    store_kv_triton(key, value, kc, vc, torch.tensor([0, 5, -1]))
    # The GPU rounds fp32 -> bf16 to nearest even; Triton's interpreter truncates: allow one ulp.
    ulp = dict(atol=0, rtol=2**-7)
    torch.testing.assert_close(kc.view(-1, 2, 16)[5], key[1].to(torch.bfloat16), **ulp)
    torch.testing.assert_close(vc.view(-1, 2, 16)[0], value[0].to(torch.bfloat16), **ulp)
    assert torch.count_nonzero(kc.view(-1, 2, 16)[[1, 2, 3, 4, 6, 7]]) == 0
    assert torch.count_nonzero(vc.view(-1, 2, 16)[[1, 2, 3, 4, 6, 7]]) == 0


def test_store_then_attend_roundtrip():
    """store_kv + paged_attention over a decode step equals the dense oracle (the model's path)."""
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    page, hkv, hq, d, ql = 4, 2, 4, 16, 3
    lens = [9, 5]
    kc = torch.full((8, page, hkv, d), float("nan"))
    vc = torch.full_like(kc, float("nan"))
    bt = torch.tensor([[5, 2, 7, -1], [0, 3, -1, -1]], dtype=torch.int32)
    dense = []
    for b, s in enumerate(lens):
        k, v = torch.randn(s, hkv, d, generator=gen), torch.randn(s, hkv, d, generator=gen)
        pos = torch.arange(s)
        slots = bt[b, pos // page].long() * page + pos % page
        for fn in (store_kv_reference, store_kv_triton):
            fn(k, v, kc, vc, slots)
        dense.append((k, v))
    # Query as a view of a fused qkv projection and out as a strided view: non-contiguous rows.
    qkv = torch.randn(len(lens) * ql, hq + 2 * hkv, d, generator=gen)
    q = qkv[:, :hq]
    sl = torch.tensor(lens, dtype=torch.int32)
    expect = dense_attention(q, dense, query_len=ql, scale=0.25)
    out = torch.zeros(len(lens) * ql, hq + 1, d)[:, 1:]
    tri = paged_attention_triton(q, kc, vc, bt, sl, query_len=ql, scale=0.25, out=out)
    assert tri is out
    assert_close(tri, expect, torch.float32, seed, "roundtrip")
    assert_close(
        paged_attention(q, kc, vc, bt, sl, query_len=ql, scale=0.25), expect, torch.float32, seed, "ref"
    )


# ---------------------------------------------------------------------------------------------
# GPU: real sizes, bf16
# ---------------------------------------------------------------------------------------------


def _reference_chunked(q, kc, vc, bt, sl, query_len, scale, chunk=4):
    """Reference over batch chunks, so that 32k-token contexts at B = 64 fit in memory."""
    outs = []
    for b0 in range(0, bt.shape[0], chunk):
        b1 = min(b0 + chunk, bt.shape[0])
        outs.append(
            paged_attention_reference(
                q[b0 * query_len : b1 * query_len],
                kc,
                vc,
                bt[b0:b1],
                sl[b0:b1],
                query_len=query_len,
                scale=scale,
            )
        )
    return torch.cat(outs)


def _gpu_case(bsz, seq, query_len, head_dim, hq=32, hkv=8, page=16, seed=0):
    """Random bf16 cache on the GPU: each request owns shuffled blocks; lengths near `seq`, ragged."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    blocks_per = -(-seq // page)
    num_blocks = bsz * blocks_per + 1
    kc = torch.randn(num_blocks, page, hkv, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    vc = torch.randn(num_blocks, page, hkv, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    kc[-1] = float("nan")  # the spare block: only reachable through garbage table entries
    vc[-1] = float("nan")
    perm = torch.randperm(bsz * blocks_per, device="cuda", generator=gen).to(torch.int32)
    bt = torch.cat(
        [perm.view(bsz, blocks_per), torch.full((bsz, 2), -1, device="cuda", dtype=torch.int32)], 1
    )
    lens = seq - torch.randint(0, 2 * page, (bsz,), device="cuda", generator=gen)
    lens[0] = seq
    sl = lens.clamp(min=query_len).to(torch.int32)
    q = torch.randn(bsz * query_len, hq, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    return q, kc, vc, bt, sl


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [128, 64])
@pytest.mark.parametrize("seq", [4096, 32768])
@pytest.mark.parametrize("bsz", [1, 8, 64])
@pytest.mark.parametrize("query_len", [1, 4])
def test_gpu_matches_reference(head_dim, seq, bsz, query_len):
    seed = fresh_seed()
    q, kc, vc, bt, sl = _gpu_case(bsz, seq, query_len, head_dim, seed=seed)
    scale = head_dim**-0.5
    ref = _reference_chunked(q, kc, vc, bt, sl, query_len, scale, chunk=max(1, 8 * 4096 // seq))
    tri = paged_attention(q, kc, vc, bt, sl, query_len=query_len, scale=scale)
    assert_close(tri, ref, torch.bfloat16, seed, f"B={bsz} seq={seq} ql={query_len} D={head_dim}")


@pytest.mark.gpu
def test_gpu_prefill_and_store():
    seed = fresh_seed()
    gen = torch.Generator(device="cuda").manual_seed(seed)
    page, hkv, hq, d, ql = 16, 8, 32, 128, 1500
    kc = torch.full((100, page, hkv, d), float("nan"), device="cuda", dtype=torch.bfloat16)
    vc = torch.full_like(kc, float("nan"))
    bt = torch.randperm(99, device="cuda", generator=gen)[:96].to(torch.int32).view(1, 96)
    k = torch.randn(ql, hkv, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(ql, hkv, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    pos = torch.arange(ql, device="cuda")
    store_kv(k, v, kc, vc, bt[0, pos // page].long() * page + pos % page)
    q = torch.randn(ql, hq, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    sl = torch.tensor([ql], device="cuda", dtype=torch.int32)
    ref = paged_attention_reference(q, kc, vc, bt, sl, query_len=ql, scale=d**-0.5)
    tri = paged_attention(q, kc, vc, bt, sl, query_len=ql, scale=d**-0.5)
    assert_close(tri, ref, torch.bfloat16, seed, "gpu prefill")


@pytest.mark.gpu
def test_gpu_graph_replay_follows_seq_lens():
    """Captured once, replayed with new device seq_lens: equals eager at the new lengths, bit for bit."""
    seed = fresh_seed()
    q, kc, vc, bt, sl = _gpu_case(2, 4096, 4, 128, seed=seed)
    out = torch.empty_like(q)
    ws = attention_workspace(q.shape[0], 32, 128, 64, "cuda")
    kw = dict(query_len=4, scale=128**-0.5, out=out, workspace=ws, max_seq_len=4096)
    paged_attention_triton(q, kc, vc, bt, sl, **kw)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_attention_triton(q, kc, vc, bt, sl, **kw)
    for new in ([4096, 4000], [17, 4], [1000, 2]):
        sl.copy_(torch.tensor(new, dtype=torch.int32))
        graph.replay()
        eager = paged_attention_triton(q, kc, vc, bt, sl, query_len=4, scale=128**-0.5, max_seq_len=4096)
        assert torch.equal(out, eager), f"replay != eager for seq_lens {new}, seed={seed}"
        ref = paged_attention_reference(q, kc, vc, bt, sl, query_len=4, scale=128**-0.5)
        assert_close(out, ref, torch.bfloat16, seed, f"replay {new}")


# ---------------------------------------------------------------------------------------------
# Split edges
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("query_len,num_splits,block_n,lens", [
    (1, 1, 16, [61, 17, 1]),  # one split: several steps each
    (1, 7, 16, [61, 17, 1]),  # empty splits, one-step splits
    (4, 3, 16, [70, 33, 4, 5]),  # query rows that span a step boundary in some splits
    (2, 64, 16, [20, 2]),  # more splits than steps
])
def test_split_edges_match_reference(query_len, num_splits, block_n, lens):
    """seq_lens is read once per program (before the PDL wait on the GPU: kernels/pdl.py, "Settled
    memory", whose graph-side rule tests/test_capture.py checks) and the split bounds derived from
    it agree between the partial and the merge kernel at every edge."""
    seed = fresh_seed()
    q, kc, vc, bt, sl, _ = make_case(
        seed, lens, query_len=query_len, hq=4, hkv=2, head_dim=16, page=4, dtype=torch.float32
    )
    kw = dict(query_len=query_len, scale=0.3, num_splits=num_splits, block_n=block_n)
    got = paged_attention_triton(q, kc, vc, bt, sl, **kw)
    ref = paged_attention_reference(q, kc, vc, bt, sl, query_len=query_len, scale=0.3)
    assert_close(got, ref, torch.float32, seed, "split edges")


def test_attention_share_variants_parse_and_restore(monkeypatch):
    """scripts/attention_share.py --variants: kernel keywords, environment switches and the merge
    probe are applied for one capture and undone after it (the next variant starts clean)."""
    import graphrt.kernels.attention as attention

    import graphrt.models.layers as layers
    from tests.helpers import load_script

    mod = load_script("attention_share")
    got = mod.parse_variants(" default; w8:num_warps=8 ;nm:merge=0,num_splits=32;off:env.GRAPHRT_PDL=0;")
    assert got == [("default", {}), ("w8", {"num_warps": 8}), ("nm", {"merge": 0, "num_splits": 32}),
                   ("off", {"env.GRAPHRT_PDL": "0"})]
    with pytest.raises(ValueError):
        mod.parse_variants("bad:num_warps=eight")
    monkeypatch.setattr(layers, "paged_attention", layers.paged_attention)
    monkeypatch.delenv("GRAPHRT_PDL", raising=False)
    merge = attention._paged_attn_merge_kernel
    with mod._variant({"merge": 0, "num_splits": 32, "env.GRAPHRT_PDL": "0"}):
        assert layers.paged_attention.keywords == {"num_splits": 32}
        assert os.environ["GRAPHRT_PDL"] == "0"
        assert attention._paged_attn_merge_kernel is not merge
        assert attention._paged_attn_merge_kernel[(1,)](1, 2, x=3) is None  # launches nothing
    assert "GRAPHRT_PDL" not in os.environ and attention._paged_attn_merge_kernel is merge
