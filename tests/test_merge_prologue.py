"""The split-attention merge in the o projection's prologue (kernels/attention.PendingMerge,
merge_splits; kernels/gemv.py MERGE_SPLITS): one launch instead of the merge kernel and the o GEMV,
against those two, bit for bit.

On CPU under the interpreter in fp32 and fp16, with a workspace poisoned with NaN beforehand (every
split must write its row, an empty one included) and a request whose short length leaves splits
empty; on the GPU in bf16 at the llama-1b shape through the dispatcher. Fresh seeds, printed on
failure.
"""

from __future__ import annotations

import pytest
import torch
from graphrt.kernels.attention import (
    MAX_SEQUENTIAL_SPLITS,
    PendingMerge,
    attention_workspace,
    paged_attention,
    paged_attention_reference,
    paged_attention_triton,
)
from graphrt.kernels.gemv import gemv_triton, linear, linear_attention_out

from tests.test_attention import _seed, make_case


def _attention(seq_len, hq, hkv, d, dtype, seed, device="cpu"):
    q, kc, vc, bt, sl, _ = make_case(seed, [seq_len], query_len=1, hq=hq, hkv=hkv, head_dim=d, page=4,
                                     dtype=dtype, extra_cols=6)
    return [t.to(device) for t in (q, kc, vc, bt, sl)]


@pytest.mark.parametrize("seq_len,num_splits", [(30, 3), (9, 3), (40, 2), (28, 5)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_o_projection_merges_in_its_prologue(seq_len, num_splits, dtype):
    hq, hkv, d, n_out = 4, 2, 16, 24
    seed = _seed()
    q, kc, vc, bt, sl = _attention(seq_len, hq, hkv, d, dtype, seed)
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(n_out, hq * d, generator=gen) / (hq * d) ** 0.5).to(dtype)
    ws = attention_workspace(1, hq, d, num_splits, "cpu")
    for t in ws:
        t.fill_(float("nan"))  # stale garbage: what an empty split does not overwrite would show
    kw = dict(query_len=1, scale=d**-0.5, num_splits=num_splits, block_n=8, workspace=ws)
    pending = paged_attention_triton(q, kc, vc, bt, sl, defer_merge=True, **kw)
    msg = f"seed={seed} seq_len={seq_len} splits={num_splits} {dtype}"
    assert isinstance(pending, PendingMerge) and pending.num_splits == num_splits, msg
    cfg = dict(use_dot=False, block_n=2, block_k=32, reduce_each=True)  # two K tiles of 32
    got = gemv_triton(pending.out.view(1, -1), w, merge=pending, **cfg)
    merged = pending.materialize()
    want = gemv_triton(merged.view(1, -1), w, **cfg)
    assert torch.isfinite(got).all(), msg
    assert torch.equal(got, want), msg
    # The merge itself is still attention (the reference, up to rounding).
    ref = paged_attention_reference(q, kc, vc, bt, sl, query_len=1, scale=d**-0.5)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(merged, ref, rtol=tol, atol=tol, msg=lambda m: f"{msg}: {m}")


def test_defer_merge_only_for_one_row_and_few_splits():
    seed = _seed()
    q, kc, vc, bt, sl = _attention(30, 4, 2, 16, torch.float32, seed)
    kw = dict(query_len=1, scale=0.25, block_n=8)
    assert isinstance(paged_attention_triton(q, kc, vc, bt, sl, num_splits=2, defer_merge=True, **kw), PendingMerge)
    for splits in (1, MAX_SEQUENTIAL_SPLITS + 1):  # unsplit: nothing to merge; many: the merge kernel
        out = paged_attention_triton(q, kc, vc, bt, sl, num_splits=splits, defer_merge=True, **kw)
        assert isinstance(out, torch.Tensor), splits
    # two query rows (a verify-sized step): merged here
    q2, kc2, vc2, bt2, sl2, _ = make_case(seed, [30], query_len=2, hq=4, hkv=2, head_dim=16, page=4,
                                          dtype=torch.float32)
    out = paged_attention_triton(q2, kc2, vc2, bt2, sl2, query_len=2, scale=0.25, num_splits=2, block_n=8,
                                 defer_merge=True)
    assert isinstance(out, torch.Tensor)
    # CPU: the reference, never deferred
    assert isinstance(paged_attention(q, kc, vc, bt, sl, query_len=1, scale=0.25, defer_merge=True), torch.Tensor)


def test_bad_merge_arguments_name_the_problem():
    q, kc, vc, bt, sl = _attention(30, 4, 2, 16, torch.float32, _seed())
    pending = paged_attention_triton(q, kc, vc, bt, sl, query_len=1, scale=0.25, num_splits=2, block_n=8,
                                     defer_merge=True)
    w = torch.randn(8, 64)
    with pytest.raises(ValueError, match="merge.out"):
        gemv_triton(torch.zeros(1, 64), w, merge=pending)  # another x
    with pytest.raises(ValueError, match="merge.out"):
        gemv_triton(pending.out.view(1, -1)[:, :32], torch.randn(8, 32), merge=pending)  # K != Hq * D
    # CPU dispatch: materialized, then the reference product
    got = linear_attention_out(pending, w)
    assert torch.equal(got, linear(pending.out.view(1, -1), w))


@pytest.mark.gpu
@pytest.mark.parametrize("seq_len", [37, 160])
def test_gpu_o_projection_prologue_is_bitwise(cuda, seq_len):
    """llama-1b: Hq 32, Hkv 8, D 64, o_proj [2048, 2048], through the dispatcher as decode runs it."""
    seed = _seed()
    q, kc, vc, bt, sl = _attention(seq_len, 32, 8, 64, torch.bfloat16, seed, device=cuda)
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(2048, 2048, generator=gen) / 2048**0.5).to(torch.bfloat16).to(cuda)
    pending = paged_attention(q, kc, vc, bt, sl, query_len=1, scale=0.125, max_seq_len=176, defer_merge=True)
    assert isinstance(pending, PendingMerge), f"seed={seed}: {type(pending)}"
    got = linear_attention_out(pending, w)
    want = linear(pending.materialize().view(1, -1), w)
    assert torch.equal(got, want), f"seed={seed} seq_len={seq_len}"
