"""The draft LM head with its argmax in the GEMV's epilogue (kernels/draft_head.py): the token is the
one the unfused path (GEMV, then argmax_triton with the proposal) picks, bit for bit, on random and
on hard logits (NaN, +/-inf, ties, rows of NaN or -inf); the mapped token lands in its slot's
column; the key and counter slots are left at rest. Interpreter on the CPU, the real kernel at the
draft heads' sizes on the GPU."""

import pytest
import torch
from graphrt.kernels.argmax import Proposal, argmax_keys, argmax_triton, lowest_argmax
from graphrt.kernels.draft_head import propose_from_head
from graphrt.kernels.fp8_weight import quantize_fp8
from graphrt.kernels.gemv import gemv_triton
from graphrt.kernels.gemv_config import row_fma_config
from graphrt.kernels.linear import linear
from graphrt.kernels.norm import PendingNorm

from tests.seeds import fresh_seed


def _proposal(v, gen, device, mapped=True):
    token_map = torch.randperm(v, generator=gen).to(device) if mapped else None
    dest = torch.full((5, 3), -7, dtype=torch.int64, device=device)
    return Proposal(token_map, dest, torch.tensor([3], device=device), 2)


def _unfused(y, v, gen, device, mapped):
    """The proposal argmax_triton makes from the stored logits y [1, V]: (token, dest)."""
    p = _proposal(v, torch.Generator().manual_seed(gen), device, mapped)
    out = torch.empty(1, dtype=torch.int64, device=device)
    argmax_triton(y, out=(torch.empty(1, dtype=y.dtype, device=device), out), propose=p)
    return out, p.dest


def _fused(run, v, gen, device, mapped):
    p = _proposal(v, torch.Generator().manual_seed(gen), device, mapped)
    out = torch.empty(1, dtype=torch.int64, device=device)
    run(p, out)
    return out, p.dest


def _hard_weights(v, k, dtype, gen):
    """x = e_0 makes the logits w[:, 0] exactly: few levels (ties), NaN, +/-inf."""
    w = torch.zeros(v, k)
    col = torch.randint(-2, 3, (v,), generator=gen).float()
    r = torch.rand(v, generator=gen)
    col[r < 0.1] = float("nan")
    col[(r >= 0.1) & (r < 0.2)] = float("-inf")
    w[:, 0] = col
    x = torch.zeros(1, k)
    x[0, 0] = 1.0
    return x.to(dtype), w.to(dtype)


CASES = [(37, 64, 4, 32), (50, 100, 8, 32), (16, 40, 16, 64), (1, 8, 4, 8)]  # V tails, K tails, one entry


@pytest.mark.parametrize("v,k,block_n,block_k", CASES)
@pytest.mark.parametrize("kind", ["random", "hard", "nan_row", "neg_inf_row"])
def test_epilogue_argmax_is_the_unfused_proposal(v, k, block_n, block_k, kind):
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    dtype = torch.float32 if seed % 2 else torch.float16
    if kind == "random":
        x, w = torch.randn(1, k, generator=gen).to(dtype), torch.randn(v, k, generator=gen).to(dtype)
    else:
        x, w = _hard_weights(v, k, dtype, gen)
        if kind != "hard":
            w[:, 0] = float("nan") if kind == "nan_row" else float("-inf")
    kw = dict(block_n=block_n, block_k=block_k, reduce_each=bool(seed % 3))
    mapped = bool(seed % 5)
    y = gemv_triton(x, w, **kw)
    want, want_dest = _unfused(y, v, seed, "cpu", mapped)
    got, got_dest = _fused(lambda p, out: gemv_triton(x, w, propose=p, out=out, **kw), v, seed, "cpu", mapped)
    assert torch.equal(got, want) and torch.equal(got_dest, want_dest), f"seed={seed} {kind}"
    idx = int(lowest_argmax(y)[1][0])
    assert 0 <= idx < v and (kind in ("random", "hard") or idx == 0), f"seed={seed} {kind}"
    assert torch.equal(argmax_keys(x.device), torch.full((512,), -(2**63), dtype=torch.int64))


def test_epilogue_argmax_with_norm_prologue_and_fp8():
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    x, res = (torch.randn(1, 96, generator=gen) for _ in range(2))
    g = torch.rand(96, generator=gen) + 0.5
    for w in (torch.randn(70, 96, generator=gen), quantize_fp8(torch.randn(70, 96, generator=gen))):
        kw = dict(block_n=8, block_k=32)
        y = gemv_triton(x, w, norm=PendingNorm(x, res, g, 1e-6), **kw)
        want, want_dest = _unfused(y, 70, seed, "cpu", True)
        got, got_dest = _fused(lambda p, out, w=w: gemv_triton(x, w, norm=PendingNorm(x, res, g, 1e-6), propose=p,
                                                               out=out, block_n=8, block_k=32), 70, seed, "cpu", True)
        assert torch.equal(got, want) and torch.equal(got_dest, want_dest), f"seed={seed}"


def test_propose_rejects_what_it_cannot_fold():
    x, w = torch.randn(2, 16), torch.randn(20, 16)
    p = _proposal(20, torch.Generator().manual_seed(0), "cpu")
    with pytest.raises(ValueError, match="propose= takes one row"):
        gemv_triton(x, w, propose=p, out=torch.empty(1, dtype=torch.int64))
    with pytest.raises(ValueError, match="propose= takes one row"):
        gemv_triton(x[:1], w, propose=p, out=torch.empty(1, dtype=torch.float32))
    with pytest.raises(ValueError, match="propose= takes one row"):
        gemv_triton(x[:1], w, propose=p, out=torch.empty(1, dtype=torch.int64), split_k=2, block_k=8)


@pytest.mark.gpu
@pytest.mark.parametrize("h,v", [(2048, 32000), (4096, 32000), (576, 16384)])
@pytest.mark.parametrize("fp8", [False, True])
def test_gpu_draft_head_proposal_is_the_unfused_one(cuda, h, v, fp8):
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(v, h, generator=gen) / h**0.5).to(torch.bfloat16).to(cuda)
    w = quantize_fp8(w) if fp8 else w
    assert row_fma_config(1, v, h, fp8) is not None  # the shapes take the fused launch
    g = (torch.rand(h, generator=gen) + 0.5).to(torch.bfloat16).to(cuda)
    for trial in range(4):
        state = torch.randn(1, h, generator=gen).to(torch.bfloat16).to(cuda)
        if trial == 3:
            state[0, 0] = float("nan")  # every logit NaN: token 0, mapped
        x_before = state.clone()
        y = linear(PendingNorm(state, None, g, 1e-5), w)
        want, want_dest = _unfused(y, v, seed + trial, cuda, True)
        got, got_dest = _fused(lambda p, out, s=state: propose_from_head(PendingNorm(s, None, g, 1e-5), w, p, out),
                               v, seed + trial, cuda, True)
        assert torch.equal(got, want) and torch.equal(got_dest, want_dest), f"seed={seed} trial={trial}"
        assert torch.equal(state.nan_to_num(), x_before.nan_to_num())
    assert bool((argmax_keys(cuda) == -(2**63)).all())
