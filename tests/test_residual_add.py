"""residual_add: the Triton kernel (interpreter on CPU, real kernel on GPU) against torch's add, bit for bit."""

import pytest
import torch
from graphrt.kernels.residual_add import residual_add, residual_add_reference, residual_add_triton

from tests.seeds import fresh_seed


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 1), (3, 576), (4, 1000), (2, 1025)])
def test_triton_equals_torch_add(dtype, shape):
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    a = (torch.randn(shape, generator=gen) * 30).to(dtype)
    b = torch.randn(shape, generator=gen).to(dtype)
    a[0, 0], b[-1, -1] = float("inf"), float("nan")
    before = (a.clone(), b.clone())
    got = residual_add_triton(a, b)
    want = residual_add_reference(a, b)
    assert got.dtype == dtype and got.shape == a.shape
    assert torch.equal(got.isnan(), want.isnan()), f"seed {seed}"
    if dtype == torch.bfloat16 and not got.is_cuda:
        # Triton's interpreter narrows fp32 to bf16 by truncation, not to nearest: one ulp at most
        torch.testing.assert_close(got, want, rtol=2**-7, atol=0, equal_nan=True, msg=f"seed {seed}")
    else:
        assert torch.equal(got.nan_to_num(), want.nan_to_num()), f"seed {seed}"
    assert torch.equal(a, before[0]) and torch.equal(b.isnan(), before[1].isnan())


def test_dispatch_and_bad_input():
    a, b = torch.randn(2, 8), torch.randn(2, 8)
    assert torch.equal(residual_add(a, b), a + b)
    for fn in (residual_add_triton, residual_add):  # into=: the sum written into a buffer of the caller's
        into = torch.full((2, 8), float("nan"))
        assert fn(a, b, into) is into and torch.equal(into, a + b)
    with pytest.raises(ValueError, match="into must be"):
        residual_add_triton(a, b, torch.empty(2, 8, dtype=torch.float16))
    assert torch.equal(residual_add(a.t(), b.t()), a.t() + b.t())  # the reference takes any layout
    for bad in (torch.randn(2, 7), torch.randn(2, 8, dtype=torch.float16), torch.randn(8, 2).t()):
        with pytest.raises(ValueError, match="residual_add_triton"):
            residual_add_triton(a, bad)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,h", [(1, 576), (4, 2048), (64, 4096), (256, 4096)])
def test_gpu_equals_torch_add(cuda, dtype, rows, h):
    seed = fresh_seed()
    gen = torch.Generator(device=cuda).manual_seed(seed)
    a = torch.randn(rows, h, device=cuda, generator=gen).to(dtype)
    b = torch.randn(rows, h, device=cuda, generator=gen).to(dtype)
    assert torch.equal(residual_add(a, b).view(torch.uint8), (a + b).view(torch.uint8)), f"seed {seed}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("into", [False, True])
def test_pending_add_is_the_add_whichever_launch_computes_it(dtype, into):
    """An EAGLE-3 head's state (kernels/residual_add.PendingAdd): added in its own launch, or in the
    final norm that reads it, alone or in the prologue of the one-row LM head GEMV, the sum lands in
    `total` (the caller's buffer with into) with residual_add's bits, and the norm's output is
    rms_norm of it (interpreter on CPU; fp32 and fp16)."""
    from graphrt.kernels.gemv import gemv_triton
    from graphrt.kernels.norm import rms_norm, rms_norm_triton
    from graphrt.kernels.residual_add import PendingAdd, summed

    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    stream, out = ((torch.randn(1, 96, generator=gen) * s).to(dtype) for s in (3, 1))
    g = (1 + 0.5 * torch.randn(96, generator=gen)).to(dtype)
    w = (torch.randn(40, 96, generator=gen) / 96**0.5).to(dtype)
    snap = (stream.clone(), out.clone())
    want_sum = residual_add_triton(stream, out)
    want_y = gemv_triton(rms_norm_triton(want_sum, g, 1e-5), w, block_n=4, block_k=32)
    buf = torch.full((1, 96), float("nan"), dtype=dtype) if into else None
    p = PendingAdd(stream, out, buf)
    assert (p.total is buf) if into else p.total.shape == stream.shape
    assert torch.equal(p.materialize(), want_sum) and torch.equal(summed(p), want_sum), f"seed {seed}"
    for prologue in (True, False):
        p = PendingAdd(stream, out, None if buf is None else buf.fill_(float("nan")))
        pn = p.normed(g, 1e-5)
        if prologue:  # the interpreter's norm on both sides
            y, want = gemv_triton(out, w, norm=pn, block_n=4, block_k=32), want_y
        else:  # add_rms_norm's dispatch: the reference on CPU
            y = gemv_triton(pn.materialize(), w, block_n=4, block_k=32)
            want = gemv_triton(rms_norm(want_sum, g, 1e-5), w, block_n=4, block_k=32)
        msg = f"seed {seed} prologue={prologue}"
        assert pn.stream is p.total and torch.equal(p.total, want_sum), msg
        assert torch.equal(y, want), msg
    assert torch.equal(stream, snap[0]) and torch.equal(out, snap[1])
    assert summed(want_sum) is want_sum


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows", [1, 3])
def test_add_in_the_gemv_epilogue_is_residual_add_after_it(dtype, rows):
    """gemv_triton(add=): a one-layer draft's residual add in its down projection's epilogue (one
    row per program, unsplit FMA; per_row at 3 rows), bit for bit residual_add(add, the product);
    into (out=) the caller's buffer; inputs untouched; the paths it does not take rejected."""
    from graphrt.kernels.gemv import gemv_triton
    from graphrt.kernels.linear import linear_add

    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 80, generator=gen).to(dtype)
    w = (torch.randn(37, 80, generator=gen) / 80**0.5).to(dtype)
    add = (3 * torch.randn(rows, 37, generator=gen)).to(dtype)
    snap = (x.clone(), w.clone(), add.clone())
    kw = dict(block_n=4, block_k=32, per_row=rows > 1)
    into = torch.full((rows, 37), float("nan"), dtype=dtype)
    got = gemv_triton(x, w, add=add, out=into, **kw)
    want = residual_add_triton(add, gemv_triton(x, w, **kw))
    assert got is into and torch.equal(got, want), f"seed {seed}"
    assert all(torch.equal(a, b) for a, b in zip((x, w, add), snap))
    # on the CPU linear_add is linear, then residual_add (the reference)
    assert torch.equal(linear_add(x, w, add), residual_add(add, torch.nn.functional.linear(x, w))), f"seed {seed}"
    for bad in (dict(use_dot=True), dict(split_k=2), dict(add=add[:, :5])):
        with pytest.raises(ValueError, match="add="):
            gemv_triton(x, w, **dict(dict(add=add, block_n=16, block_k=32), **bad))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k", [(2048, 8192), (4096, 14336), (576, 1536)])
def test_gpu_linear_add_is_residual_add_after_linear(cuda, dtype, n, k):
    """The dispatcher at a one-layer EAGLE-3 head's down projection (1b, 8b, SmolLM2 shapes, one row):
    the add in the GEMV's epilogue, the bits of linear then residual_add."""
    from graphrt.kernels.linear import linear, linear_add, one_row_product

    seed = fresh_seed()
    gen = torch.Generator(device=cuda).manual_seed(seed)
    x = torch.randn(1, k, device=cuda, generator=gen).to(dtype)
    w = (torch.randn(n, k, device=cuda, generator=gen) / k**0.5).to(dtype)
    add = (3 * torch.randn(1, n, device=cuda, generator=gen)).to(dtype)
    assert one_row_product(x, w)  # the path that takes the add
    want = residual_add(add, linear(x, w))
    assert torch.equal(linear_add(x, w, add).view(torch.uint8), want.view(torch.uint8)), f"seed {seed}"
