"""The RMSNorm in the prologue of a one-row GEMV (kernels/norm.PendingNorm, kernels/norm.norm_stats):
plain, gated (gate_up + SiLU·mul) and qkv + rotary + KV store, each against the norm kernel's
output fed to the same kernel without the prologue.

Equal bits are asked for everywhere. On CPU both sides run under the interpreter (the norm kernel
too, so the sum of squares is numpy's over the same row on both, and both sides share the kernel
configuration), in fp32 and fp16 (the interpreter's in-register bf16 cast truncates); the `gpu`
tests take bf16 at the llama-1b and llama-8b shapes with the dispatcher's configuration. Fresh
seeds, printed on failure.
"""

from __future__ import annotations

import pytest
import torch
from graphrt.kernels.activation import silu_and_mul
from graphrt.kernels.gemv import gemv_triton, row_fma_config
from graphrt.kernels.linear import linear_silu_mul, norm_fusable
from graphrt.kernels.norm import PendingNorm, add_rms_norm_reference, add_rms_norm_triton, rms_norm_triton
from graphrt.kernels.qkv_rotary import qkv_rotary_store, qkv_rotary_store_triton

from graphrt.models.layers import Rotary
from tests.seeds import fresh_seed


def _inputs(k, dtype, gen, device="cpu", *, residual: bool, rows: int = 1):
    x = torch.randn(rows, k, generator=gen).to(dtype).to(device)
    res = (3 * torch.randn(rows, k, generator=gen)).to(dtype).to(device) if residual else None
    g = (1 + 0.5 * torch.randn(k, generator=gen)).to(dtype).to(device)
    return x, res, g


def _norm_kernel(x, res, g, eps):
    """The standalone norm kernel: (output, stream)."""
    if res is None:
        return rms_norm_triton(x, g, eps), x
    return add_rms_norm_triton(x, res, g, eps)


# (n, k, block_n, block_k, reduce_each): one K tile, several, a K tail; odd N.
CASES = [(24, 64, 2, 64, True), (13, 100, 4, 32, False), (8, 257, 2, 64, True)]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows", [1, 3])
def test_gemv_norm_prologue_is_norm_then_gemv(case, gated, residual, dtype, rows):
    n, k, bn, bk, red = case
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    x, res, g = _inputs(k, dtype, gen, residual=residual, rows=rows)
    w = (torch.randn(2 * n if gated else n, k, generator=gen) / k**0.5).to(dtype)
    snap = [t.clone() for t in (x, g, w) + ((res,) if residual else ())]
    kw = dict(block_n=bn, block_k=bk, reduce_each=red, gated=gated, per_row=rows > 1)
    pending = PendingNorm(x, res, g, 1e-5)
    got = gemv_triton(x, w, norm=pending, **kw)
    h, stream = _norm_kernel(x, res, g, 1e-5)
    want = gemv_triton(h, w, **kw)
    msg = f"seed={seed} case={case} gated={gated} residual={residual} {dtype} rows={rows}"
    assert got.shape == want.shape and got.dtype == dtype, msg
    assert torch.equal(got, want), msg
    assert torch.equal(pending.stream, stream), msg  # x + residual, rounded once
    if residual:
        assert pending.stream is not x and pending.stream is not res, msg
    for before, after in zip(snap, (x, g, w) + ((res,) if residual else ())):
        assert torch.equal(before, after), f"an input was modified; {msg}"
    # And the eager model's result, up to the GEMV's rounding.
    h_ref, _ = add_rms_norm_reference(x, res if residual else torch.zeros_like(x), g, 1e-5)
    y_ref = h_ref.float() @ w.float().T
    if gated:
        y_ref = silu_and_mul(y_ref.to(dtype)).float()
    torch.testing.assert_close(got.float(), y_ref, rtol=2e-2, atol=2e-2, msg=lambda m: f"{msg}: {m}")


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows", [1, 2])
def test_qkv_norm_prologue_is_norm_then_qkv(residual, dtype, rows):
    hidden, hq, hkv, d = 96, 4, 2, 16
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    x, res, g = _inputs(hidden, dtype, gen, residual=residual, rows=rows)
    w = (torch.randn((hq + 2 * hkv) * d, hidden, generator=gen) / hidden**0.5).to(dtype)
    rot = Rotary(d, 10000.0, None, 64, "cpu")
    kc = torch.randn(3, 4, hkv, d, generator=gen).to(dtype)
    vc = torch.randn(3, 4, hkv, d, generator=gen).to(dtype)
    kc2, vc2 = kc.clone(), vc.clone()
    pos, slots = torch.arange(5, 5 + rows), torch.arange(3, 3 + rows)
    kw = dict(num_q_heads=hq, num_kv_heads=hkv)
    pending = PendingNorm(x, res, g, 1e-6)
    q = qkv_rotary_store_triton(x, w, None, pos, rot.cos, rot.sin, kc, vc, slots, **kw, norm=pending)
    h, stream = _norm_kernel(x, res, g, 1e-6)
    q2 = qkv_rotary_store_triton(h, w, None, pos, rot.cos, rot.sin, kc2, vc2, slots, **kw)
    msg = f"seed={seed} residual={residual} {dtype} rows={rows}"
    for got, want in ((q, q2), (kc, kc2), (vc, vc2)):
        assert torch.equal(got, want), msg
    assert torch.equal(pending.stream, stream), msg


def test_bad_norm_arguments_name_the_problem():
    x = torch.randn(1, 64)
    w = torch.randn(32, 64)
    with pytest.raises(ValueError, match="PendingNorm of x"):
        gemv_triton(x, w, norm=PendingNorm(torch.randn(1, 64), None, torch.ones(64), 1e-6))
    with pytest.raises(ValueError, match="PendingNorm of x"):  # norm weight in another dtype
        gemv_triton(x, w, norm=PendingNorm(x, None, torch.ones(64, dtype=torch.float16), 1e-6))
    x2 = torch.randn(2, 64)
    with pytest.raises(ValueError, match="PendingNorm of x"):  # two rows in one program
        gemv_triton(x2, w, per_row=False, use_dot=False, norm=PendingNorm(x2, None, torch.ones(64), 1e-6))
    with pytest.raises(ValueError, match="unsplit FMA"):
        gemv_triton(x, w, split_k=2, block_k=32, use_dot=False, norm=PendingNorm(x, None, torch.ones(64), 1e-6))


def test_cpu_consumers_materialize_the_reference_norm():
    # On CPU nothing fuses: the consumers run the reference norm, then the reference product.
    gen = torch.Generator().manual_seed(fresh_seed())
    x, res, g = _inputs(64, torch.float32, gen, residual=True)
    w = torch.randn(48, 64, generator=gen)
    pending = PendingNorm(x, res, g, 1e-6)
    assert not norm_fusable(torch.zeros(1)) and pending.stream is None
    got = linear_silu_mul(pending, w)
    h, stream = add_rms_norm_reference(x, res, g, 1e-6)
    assert torch.equal(got, silu_and_mul(torch.nn.functional.linear(h, w)))
    assert torch.equal(pending.stream, stream)
    # no residual: the stream is x itself
    assert PendingNorm(x, None, g, 1e-6).stream is x


@pytest.mark.gpu
@pytest.mark.parametrize("hidden,inter,hq,hkv,d,rows", [(2048, 8192, 32, 8, 64, 1), (4096, 14336, 32, 8, 128, 1),
                                                       (576, 1536, 9, 3, 64, 4)])
@pytest.mark.parametrize("residual", [False, True])
def test_gpu_norm_prologue_is_bitwise(cuda, hidden, inter, hq, hkv, d, residual, rows):
    """The dispatcher's one-row-per-program configurations at the llama-1b and llama-8b shapes (one
    token) and SmolLM2's (the four tokens of a verify step): the fused launch equals norm kernel +
    the same GEMV bit for bit (same row layout, same sum of squares)."""
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    x, res, g = _inputs(hidden, torch.bfloat16, gen, cuda, residual=residual, rows=rows)
    msg = f"seed={seed} hidden={hidden} residual={residual} rows={rows}"
    h, stream = _norm_kernel(x, res, g, 1e-5)
    # gate_up + SiLU·mul, through the dispatcher
    w = (torch.randn(2 * inter, hidden, generator=gen) / hidden**0.5).to(torch.bfloat16).to(cuda)
    assert row_fma_config(rows, *w.shape) is not None
    pending = PendingNorm(x, res, g, 1e-5)
    assert norm_fusable(pending), msg
    got = linear_silu_mul(pending, w)
    assert torch.equal(got, linear_silu_mul(h, w)), msg
    assert torch.equal(pending.stream, stream), msg
    # qkv + rotary + KV store, through the dispatcher
    wq = (torch.randn((hq + 2 * hkv) * d, hidden, generator=gen) / hidden**0.5).to(torch.bfloat16).to(cuda)
    rot = Rotary(d, 500000.0, None, 128, cuda)
    kc = torch.zeros(4, 16, hkv, d, dtype=torch.bfloat16, device=cuda)
    vc, kc2, vc2 = kc.clone(), kc.clone(), kc.clone()
    pos, slots = torch.arange(37, 37 + rows, device=cuda), torch.arange(9, 9 + rows, device=cuda)
    kw = dict(num_q_heads=hq, num_kv_heads=hkv)
    pending = PendingNorm(x, res, g, 1e-5)
    q = qkv_rotary_store(pending, wq, None, pos, rot.cos, rot.sin, kc, vc, slots, **kw)
    q2 = qkv_rotary_store(h, wq, None, pos, rot.cos, rot.sin, kc2, vc2, slots, **kw)
    assert torch.equal(q, q2) and torch.equal(kc, kc2) and torch.equal(vc, vc2), msg
    assert torch.equal(pending.stream, stream), msg
