"""kernels/eagle3_input.py: the EAGLE-3 layer's input (embedding gather and two RMSNorms) in one
launch, against the reference on the CPU (interpreter) and bit for bit against the unfused Triton
norms on the GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from graphrt.kernels.eagle3_input import eagle3_input, eagle3_input_reference, eagle3_input_triton
from graphrt.kernels.norm import rms_norm_triton

from tests.helpers import bit_diff
from tests.seeds import fresh_seed

TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}


def _case(n, h, v, dtype, gen, device="cpu", pad=0, tok_dtype=torch.int64):
    table = (torch.randn(v, h, generator=gen) * 2).to(dtype).to(device)
    buf = torch.full((n, h + pad), float("nan"), dtype=dtype, device=device)  # strided hidden rows
    buf[:, :h] = (torch.randn(n, h, generator=gen) * 3).to(dtype).to(device)
    hidden = buf[:, :h]
    we = (1 + 0.2 * torch.randn(h, generator=gen)).to(dtype).to(device)
    wh = (1 + 0.2 * torch.randn(h, generator=gen)).to(dtype).to(device)
    tokens = torch.randint(0, v, (n,), generator=gen).to(tok_dtype).to(device)
    return tokens, table, hidden, we, wh


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,h,pad,tok_dtype", [(1, 64, 0, torch.int64), (5, 37, 3, torch.int32),
                                               (4, 130, 0, torch.int64)])
def test_triton_matches_reference_and_leaves_inputs(dtype, n, h, pad, tok_dtype):
    seed = fresh_seed()
    args = _case(n, h, 50, dtype, torch.Generator().manual_seed(seed), pad=pad, tok_dtype=tok_dtype)
    snap = [a.clone() for a in args]
    x, normed = eagle3_input_triton(*args, 1e-5)
    ref_x, ref_normed = eagle3_input_reference(*args, 1e-5)
    for before, after in zip(snap, args):
        assert torch.equal(before, after), "an input was modified"
    atol, rtol = TOL[dtype]
    msg = f"seed={seed} {dtype} n={n} h={h}"
    assert x.shape == (n, 2 * h) and normed.shape == (n, h) and x.dtype == normed.dtype == dtype, msg
    torch.testing.assert_close(x.float(), ref_x.float(), atol=atol, rtol=rtol, msg=lambda m: f"{msg}: {m}")
    assert torch.equal(normed, x[:, h:]), msg


@pytest.mark.parametrize("normed_residual", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_residual_of_every_row_or_gathered_for_rows(normed_residual, dtype):
    """The residual output: the normalised hidden state or hidden itself, of every row or gathered
    for rows (DRAFT_EXTEND's last rows: repeated and out of order here) by extra programs of the same
    launch, whose rows are bit for bit the full launch's; x does not change with it."""
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    args = _case(6, 37, 50, dtype, gen, pad=3)
    rows = torch.tensor([5, 0, 3, 3], dtype=torch.int64)
    snap = [a.clone() for a in args] + [rows.clone()]
    x_all, res_all = eagle3_input_triton(*args, 1e-5, normed_residual)
    x, res = eagle3_input_triton(*args, 1e-5, normed_residual, rows)
    for before, after in zip(snap, list(args) + [rows]):
        assert torch.equal(before, after), "an input was modified"
    msg = f"seed={seed} {dtype} normed_residual={normed_residual}"
    assert torch.equal(x, x_all) and res.shape == (4, 37), msg
    assert torch.equal(res, res_all.index_select(0, rows)), msg
    if normed_residual:
        assert torch.equal(res_all, x_all[:, 37:]), msg
    else:
        assert res_all is args[2]  # hidden itself, no copy
    ref_x, ref_res = eagle3_input_reference(*args, 1e-5, normed_residual, rows)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(res.float(), ref_res.float(), atol=atol, rtol=rtol, msg=lambda m: f"{msg}: {m}")
    cpu_x, cpu_res = eagle3_input(*args, 1e-5, normed_residual, rows)  # the CPU dispatch: the unfused path
    assert torch.equal(cpu_x, ref_x) and torch.equal(cpu_res, ref_res), msg
    with pytest.raises(ValueError, match="rows"):
        eagle3_input_triton(*args, 1e-5, normed_residual, rows.to(torch.int32))


def test_cpu_dispatch_is_the_unfused_path_and_bad_inputs_name_the_problem():
    gen = torch.Generator().manual_seed(0)
    tokens, table, hidden, we, wh = _case(3, 16, 10, torch.float32, gen)
    x, normed = eagle3_input(tokens, table, hidden, we, wh, 1e-6)
    ref_x, ref_normed = eagle3_input_reference(tokens, table, hidden, we, wh, 1e-6)
    assert torch.equal(x, ref_x) and torch.equal(normed, ref_normed)
    with pytest.raises(ValueError, match="eagle3_input_triton takes"):
        eagle3_input_triton(tokens, table, hidden.double(), we, wh, 1e-6)
    with pytest.raises(ValueError, match="hidden"):
        eagle3_input_triton(tokens[:2], table, hidden, we, wh, 1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,h", [(1, 576), (4, 576), (4, 2048), (16, 4096), (3, 896)])
def test_gpu_is_the_unfused_kernels_bitwise(cuda, dtype, n, h):
    seed = fresh_seed()
    tokens, table, hidden, we, wh = _case(n, h, 1000, dtype, torch.Generator().manual_seed(seed), device=cuda, pad=8)
    x, normed = eagle3_input(tokens, table, hidden, we, wh, 1e-5)
    want_h = rms_norm_triton(hidden, wh, 1e-5)
    want_e = rms_norm_triton(F.embedding(tokens, table), we, 1e-5)
    msg = f"seed={seed} {dtype} n={n} h={h}"
    assert torch.equal(x[:, :h], want_e), f"{msg}: embedding half {bit_diff(x[:, :h], want_e)}"
    assert torch.equal(x[:, h:], want_h) and torch.equal(normed, want_h), f"{msg}: {bit_diff(normed, want_h)}"
    rows = torch.randint(0, n, (max(1, n // 2),), generator=torch.Generator().manual_seed(seed)).to(cuda)
    for normed_residual, full in ((True, want_h), (False, hidden)):
        _, res = eagle3_input(tokens, table, hidden, we, wh, 1e-5, normed_residual, rows)
        assert torch.equal(res, full.index_select(0, rows)), f"{msg} rows, normed_residual={normed_residual}"
