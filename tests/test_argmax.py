"""argmax: reference vs a brute-force loop, Triton (interpreter on CPU, real kernel on GPU) vs reference."""

import math

import pytest
import torch
from graphrt.kernels import argmax
from graphrt.kernels.argmax import Proposal, argmax_reference, argmax_triton, propose_tokens

from tests.seeds import fresh_seed

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def brute_force(row: list[float]) -> tuple[float, int]:
    best, best_i = -math.inf, 0
    for i, x in enumerate(row):
        if not math.isnan(x) and x > best:
            best, best_i = x, i
    return best, best_i


def hard_logits(b: int, v: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Random rows with few distinct levels (ties), NaN, +/-inf and whole NaN / -inf rows."""
    x = torch.randint(-3, 4, (b, v), generator=gen).float() + 0.5 * torch.randn(b, v, generator=gen).round()
    r = torch.rand(b, v, generator=gen)
    x[r < 0.05] = float("nan")
    x[(r >= 0.05) & (r < 0.08)] = float("-inf")
    if b > 2:
        x[1] = float("nan")
        x[2] = float("-inf")
    if b > 3:
        x[3, torch.randint(0, v, (1,), generator=gen)] = float("inf")
    if b > 4:
        x[4, : v // 2] = float("nan")
    return x.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_matches_brute_force(dtype):
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    for b, v in [(1, 1), (6, 7), (7, 50)]:
        x = hard_logits(b, v, dtype, gen)
        vals, idx = argmax_reference(x)
        assert vals.dtype == dtype and idx.dtype == torch.int64
        for i in range(b):
            bv, bi = brute_force(x[i].float().tolist())
            assert (int(idx[i]), float(vals[i])) == (bi, bv), f"seed {seed} row {i}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("b,v,block_v,splits", [(1, 1, 16, None), (1, 300, 32, 4), (7, 77, 16, 3),
                                                (6, 64, 32, None), (3, 1000, 128, 2)])
def test_triton_matches_reference(dtype, b, v, block_v, splits):
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    x = hard_logits(b, v, dtype, gen)
    x_before = x.clone()
    ref = argmax_reference(x)
    got = argmax_triton(x, block_v=block_v, num_splits=splits)
    assert torch.equal(got[1], ref[1]), f"seed {seed}"
    assert torch.equal(got[0], ref[0]), f"seed {seed}"
    assert got[0].dtype == dtype
    assert torch.equal(x.view(torch.uint8), x_before.view(torch.uint8)), "input modified"


def test_triton_strided_rows_and_out():
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(5, 130, generator=gen)
    x = base[:, :100]  # row stride 130, vocab contiguous
    values = torch.empty(5)
    indices = torch.empty(5, dtype=torch.int64)
    got = argmax_triton(x, out=(values, indices), block_v=32)
    assert got[0] is values and got[1] is indices
    ref = argmax_reference(x)
    assert torch.equal(indices, ref[1]) and torch.equal(values, ref[0]), f"seed {seed}"


def test_ties_go_to_lowest_index_across_splits():
    x = torch.zeros(2, 200)
    x[0, [150, 40, 199]] = 5.0
    x[1, [199]] = float("inf")
    x[1, [3]] = float("nan")
    vals, idx = argmax_triton(x, block_v=16, num_splits=8)
    assert idx.tolist() == [40, 199] and vals.tolist() == [5.0, math.inf]


def test_public_argmax_cpu_and_validation():
    x = torch.randn(3, 10)
    v, i = argmax(x)
    assert torch.equal(i, argmax_reference(x)[1])
    out = (torch.empty(3), torch.empty(3, dtype=torch.int64))
    argmax(x, out=out)
    assert torch.equal(out[1], i)
    with pytest.raises(ValueError, match="logits"):
        argmax(torch.randn(10))
    with pytest.raises(ValueError, match="dtype"):
        argmax(torch.zeros(2, 3, dtype=torch.int32))
    with pytest.raises(ValueError, match="contiguous"):
        argmax_triton(torch.randn(10, 3).t())
    with pytest.raises(ValueError, match="out"):
        argmax_triton(x, out=(torch.empty(3), torch.empty(3, dtype=torch.int32)))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("b", [1, 8, 64, 256])
@pytest.mark.parametrize("v", [32000, 128256, 151936])
def test_triton_gpu_real_sizes(cuda, dtype, b, v):
    seed = fresh_seed()
    gen = torch.Generator(device=cuda).manual_seed(seed)
    x = torch.randn(b, v, device=cuda, generator=gen).to(dtype)
    if b > 2:
        x[1] = float("nan")
        x[2, 5:] = float("-inf")
        x[0, 100] = x[0, 7] = x[0].max() + 1  # tie
    ref = argmax_reference(x)
    got = argmax(x)
    assert torch.equal(got[1], ref[1]), f"seed {seed}"
    assert torch.equal(got[0], ref[0]), f"seed {seed}"


@pytest.mark.parametrize("fused", [False, True])
def test_triton_fused_and_unfused_match_reference(fused):
    """Both launch forms (last-program merge through the counter, or a second kernel)."""
    gen = torch.Generator().manual_seed(fresh_seed())
    x = torch.randn(5, 333, generator=gen).to(torch.bfloat16)
    x[1, :] = float("-inf")
    x[2, 7] = float("nan")
    x[3, 100] = x[3, 200] = float("inf")
    for _ in range(2):  # the counter is back at zero after a call
        vals, idx = argmax_triton(x, block_v=16, num_splits=5, fused=fused)
        ref_v, ref_i = argmax_reference(x)
        assert torch.equal(idx, ref_i)
        assert torch.equal(vals.float().nan_to_num(), ref_v.float().nan_to_num())


def _proposal_case(gen, b, v, mapped):
    """A draft step's inputs: logits with NaN / -inf rows, a token map, slots that skip and repeat."""
    x = hard_logits(b, v, torch.bfloat16, gen)
    token_map = torch.randperm(3 * v, generator=gen)[:v] if mapped else None
    slots = torch.randint(0, b + 2, (b,), generator=gen)
    dest = torch.randint(-5, -1, (b + 2, 4), generator=gen)
    return x, Proposal(token_map, dest, slots, 2)


def _proposal_expected(x, p):
    ids = argmax_reference(x)[1]
    ids = ids if p.token_map is None else p.token_map[ids]
    dest = p.dest.clone()
    for b in range(x.shape[0]):  # a repeated slot: every row that names it wrote one of its values
        dest[p.slots[b], p.column] = ids[b]
    return ids, dest


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("mapped", [False, True])
def test_triton_proposal_maps_and_stores(fused, mapped):
    """The argmax's last step maps each row's index and stores it to its slot's column: the same as
    argmax, then the map, then the store, in both launch forms; nothing else of dest changes."""
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    x, p = _proposal_case(gen, 6, 90, mapped)
    ids, dest = _proposal_expected(x, p)
    repeated = {int(s) for s in p.slots if (p.slots == s).sum() > 1}
    before = (x.clone(), p.slots.clone(), None if p.token_map is None else p.token_map.clone())
    out = torch.full((6,), -7, dtype=torch.int64)
    vals, got = argmax_triton(x, out=(torch.empty(6, dtype=x.dtype), out), block_v=16, num_splits=3, fused=fused,
                              propose=p)
    assert got is out and torch.equal(out, ids), f"seed {seed}"
    keep = torch.ones_like(dest, dtype=torch.bool)
    keep[list(repeated), p.column] = False
    assert torch.equal(p.dest[keep], dest[keep]), f"seed {seed}"
    for s in repeated:
        assert int(p.dest[s, p.column]) in ids[p.slots == s].tolist(), f"seed {seed}"
    assert torch.equal(vals.float().nan_to_num(), argmax_reference(x)[0].float().nan_to_num())
    assert torch.equal(x.view(torch.int16), before[0].view(torch.int16)) and torch.equal(p.slots, before[1])
    assert p.token_map is None or torch.equal(p.token_map, before[2])


def test_propose_tokens_cpu_and_validation():
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    x, p = _proposal_case(gen, 5, 40, True)
    p = p._replace(slots=torch.randperm(7, generator=gen)[:5])
    ids, dest = _proposal_expected(x, p)
    out = torch.empty(5, dtype=torch.int64)
    assert propose_tokens(x, p, out) is out
    assert torch.equal(out, ids) and torch.equal(p.dest, dest), f"seed {seed}"
    with pytest.raises(ValueError, match="column"):
        propose_tokens(x, p._replace(column=4), out)
    with pytest.raises(ValueError, match="slots"):
        propose_tokens(x, p._replace(slots=p.slots.int()), out)
    with pytest.raises(ValueError, match="token_map"):
        propose_tokens(x, p._replace(token_map=p.token_map[:10]), out)
    with pytest.raises(ValueError, match="out"):
        propose_tokens(x, p, out[:4])
    assert torch.equal(p.dest, dest), "a rejected call wrote dest"


@pytest.mark.gpu
@pytest.mark.parametrize("b", [1, 8, 64])
def test_propose_tokens_gpu(cuda, b):
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    x, p = _proposal_case(gen, b, 32000, True)
    p = p._replace(slots=torch.randperm(b + 2, generator=gen)[:b])
    ids, dest = _proposal_expected(x, p)
    p = Proposal(*(t.to(cuda) if isinstance(t, torch.Tensor) else t for t in p))
    out = torch.empty(b, dtype=torch.int64, device=cuda)
    propose_tokens(x.to(cuda), p, out)
    assert torch.equal(out.cpu(), ids) and torch.equal(p.dest.cpu(), dest), f"seed {seed}"
