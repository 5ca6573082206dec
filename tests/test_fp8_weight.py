"""FP8 draft weights (kernels/fp8_weight.py): the quantization, the GEMV and qkv + rotary kernels
reading e4m3 with per-row scales against the same products on the exact dense matrix, and the
runtime with an FP8 draft.

On CPU the kernels run under TRITON_INTERPRET=1 at small, odd sizes (the DOT path in fp16 and
fp32: the interpreter's tl.dot does not take bf16); the `gpu` tests repeat them in bf16 at the
8b head's sizes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from graphrt.kernels.activation import silu_and_mul_reference
from graphrt.kernels.fp8_weight import FP8, FP8_MAX, Fp8Weight, dense, for_rows, quantize_fp8
from graphrt.kernels.gemv import gemv_triton
from graphrt.kernels.linear import linear, linear_silu_mul
from graphrt.kernels.norm import PendingNorm
from graphrt.kernels.qkv_rotary import qkv_rotary_store_reference, qkv_rotary_store_triton

from tests.seeds import fresh_seed
from tests.test_gemv import _check
from tests.test_qkv_rotary import _case as _qkv_case


def _weights(n, k, dtype, gen, device="cpu"):
    # rows of very different magnitudes, a zero row and one tiny row: each takes its own scale
    w = torch.randn(n, k, generator=gen) * torch.logspace(-3, 1, n)[torch.randperm(n, generator=gen)][:, None]
    w[0] = 0
    return (w / k**0.5).to(dtype).to(device)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_quantize_is_exact_in_the_model_dtype_and_close_to_the_input(dtype):
    seed = fresh_seed()
    w = _weights(37, 100, dtype, torch.Generator().manual_seed(seed))
    before = w.clone()
    fw = quantize_fp8(w)
    assert torch.equal(w, before), "the input was modified"
    assert fw.q.dtype == FP8 and fw.q.shape == w.shape and fw.scale.shape == (37,) and fw.dense.dtype == dtype
    assert fw.shape == w.shape
    # powers of two, each row's largest value within e4m3's range
    assert torch.equal(torch.exp2(torch.log2(fw.scale).round()), fw.scale), f"seed={seed}"
    assert fw.q.float().abs().amax() <= FP8_MAX
    # dense is q * scale exactly (computed in fp64 here)
    assert torch.equal(fw.dense.double(), fw.q.double() * fw.scale.double()[:, None]), f"seed={seed}"
    # e4m3 keeps 3 mantissa bits: a normal value rounds within 2^-4 of itself; a row's largest
    # value sits in the top half of the range, so entries far below it may be subnormal
    err = (fw.dense.double() - w.double()).abs()
    bound = 2.0**-4 * w.double().abs() + fw.scale.double()[:, None] * 2.0**-9
    assert bool((err <= bound).all()), f"seed={seed}: {(err - bound).max()}"
    assert not fw.dense[0].any()  # the zero row stays zero


def test_quantize_rejects_what_it_cannot_represent():
    with pytest.raises(ValueError, match="NaN or inf"):
        quantize_fp8(torch.tensor([[1.0, float("nan")]]))
    with pytest.raises(ValueError, match="floating"):
        quantize_fp8(torch.ones(4, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"\[N, K\]"):
        quantize_fp8(torch.ones(4))


# (m, n, k, use_dot, block_n, block_k, split_k): the FMA path at 1-4 rows, a split, N and K tails;
# the DOT path unsplit and split
CASES = [(1, 37, 100, False, 4, 32, 1), (3, 50, 130, False, 2, 32, 2), (4, 19, 257, False, 4, 64, 1),
         (5, 64, 300, True, 16, 64, 3), (16, 50, 130, True, 32, 32, 1)]


@pytest.mark.parametrize("case", CASES)
def test_gemv_reads_fp8_as_the_dense_matrix(case):
    dtype = torch.float16  # the half dtype the interpreter's tl.dot takes (bf16 on the GPU below)
    m, n, k, use_dot, bn, bk, split = case
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(dtype)
    fw = quantize_fp8(_weights(n, k, dtype, gen))
    b = torch.randn(n, generator=gen).to(dtype)
    y = gemv_triton(x, fw, b, use_dot=use_dot, block_n=bn, block_k=bk, split_k=split, reduce_each=bool(seed % 2))
    _check(y, x, fw.dense, b, f"seed={seed} case={case} {dtype}")


@pytest.mark.parametrize("use_dot,m", [(False, 1), (True, 3)])
def test_gated_gemv_scales_gate_and_up_rows_apart(use_dot, m):
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, 72, generator=gen).to(torch.float16)
    fw = quantize_fp8(_weights(2 * 48, 72, torch.float16, gen))
    y = gemv_triton(x, fw, gated=True, use_dot=use_dot, block_n=16 if use_dot else 4, block_k=32, split_k=1)
    want = silu_and_mul_reference(F.linear(x.float(), fw.dense.float())).to(torch.float16)
    torch.testing.assert_close(y, want, rtol=1e-2, atol=1e-3, msg=lambda s: f"seed={seed}: {s}")


def test_norm_prologue_and_per_row_read_fp8():
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    x, res = (torch.randn(1, 96, generator=gen) for _ in range(2))
    g = torch.rand(96, generator=gen) + 0.5
    fw = quantize_fp8(_weights(40, 96, torch.float32, gen))
    pending = PendingNorm(x, res, g, 1e-6)
    y = gemv_triton(x, fw, norm=pending, block_n=4, block_k=32)
    h = PendingNorm(x, res, g, 1e-6).materialize()
    _check(y, h, fw.dense, None, f"seed={seed} norm prologue")
    xs = torch.randn(3, 96, generator=gen)
    kw = dict(block_n=4, block_k=32, reduce_each=True)
    rows = gemv_triton(xs, fw, per_row=True, **kw)
    assert torch.equal(rows, torch.cat([gemv_triton(xs[i : i + 1], fw, **kw) for i in range(3)]))
    _check(rows, xs, fw.dense, None, f"seed={seed} per row")


def test_dispatchers_on_cpu_use_the_dense_matrix_bitwise():
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 40, generator=gen).to(torch.bfloat16)
    fw = quantize_fp8(_weights(48, 40, torch.bfloat16, gen))
    assert torch.equal(linear(x, fw), F.linear(x, fw.dense)), f"seed={seed}"
    assert torch.equal(linear_silu_mul(x, fw), silu_and_mul_reference(F.linear(x, fw.dense))), f"seed={seed}"
    assert dense(fw) is fw.dense and dense(x) is x


def test_qkv_rotary_reads_fp8_as_the_dense_matrix():
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    x, w, b, positions, cos, sin, kc, vc, slots = _qkv_case(64, 4, 2, 16, torch.float32, gen, bias=True)
    fw = quantize_fp8(w)
    kc2, vc2 = kc.clone(), vc.clone()
    kw = dict(num_q_heads=4, num_kv_heads=2)
    q = qkv_rotary_store_triton(x, fw, b, positions, cos, sin, kc, vc, slots, **kw)
    q_ref = qkv_rotary_store_reference(x, fw.dense, b, positions, cos, sin, kc2, vc2, slots, **kw)
    for got, want in ((q, q_ref), (kc, kc2), (vc, vc2)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda s: f"seed={seed}: {s}")
    with pytest.raises(ValueError, match="scales"):
        qkv_rotary_store_triton(x, Fp8Weight(fw.q, fw.scale[:-1], fw.dense), b, positions, cos, sin, kc, vc, slots,
                                **kw)
    # FP8 is read at one row only: past it there is no FP8 configuration, and the dispatcher reads dense
    x3 = torch.cat([x] * 3)
    with pytest.raises(ValueError, match="configuration for 3 tokens"):
        qkv_rotary_store_triton(x3, fw, b, positions.expand(3), cos, sin, kc, vc, slots.expand(3), **kw)
    assert for_rows(fw, 3) is fw.dense and for_rows(fw, 1) is fw


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(1, 4096, 4096), (1, 32000, 4096), (1, 28672, 4096), (4, 4096, 14336),
                                   (8, 32000, 4096), (1, 2048, 12288)])
def test_gpu_fp8_linear_at_the_8b_heads_sizes(cuda, m, n, k):
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16).to(cuda)
    fw = quantize_fp8(_weights(n, k, torch.bfloat16, gen, cuda))
    _check(linear(x, fw), x, fw.dense, None, f"seed={seed} m={m} n={n} k={k}")
    if n % 2 == 0:
        want = silu_and_mul_reference(F.linear(x.float(), fw.dense.float())).to(torch.bfloat16)
        torch.testing.assert_close(linear_silu_mul(x, fw), want, rtol=2e-2, atol=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("hidden,hq,hkv,d", [(8192, 32, 8, 128), (4096, 32, 8, 64), (1152, 9, 3, 64)])
def test_gpu_fp8_qkv_rotary_and_norm_prologue_at_one_row(cuda, hidden, hq, hkv, d):
    """The one-row launches an FP8 draft step runs besides linear: qkv + rotary + KV store, and the
    LM head with the final norm in its prologue, against the same products on the dense matrix."""
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    x, w, b, positions, cos, sin, kc, vc, slots = _qkv_case(hidden, hq, hkv, d, torch.bfloat16, gen, bias=False,
                                                            device=cuda, pos=37, slot=9, page=16)
    fw = quantize_fp8(w)
    kc2, vc2 = kc.clone(), vc.clone()
    kw = dict(num_q_heads=hq, num_kv_heads=hkv)
    q = qkv_rotary_store_triton(x, fw, b, positions, cos, sin, kc, vc, slots, **kw)
    q_ref = qkv_rotary_store_reference(x, fw.dense, b, positions, cos, sin, kc2, vc2, slots, **kw)
    for got, want in ((q, q_ref), (kc, kc2), (vc, vc2)):  # summation order apart: a bf16 ulp or two
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-3, msg=lambda s: f"seed={seed}: {s}")
    h, res = (torch.randn(1, hidden // 2, generator=gen).to(torch.bfloat16).to(cuda) for _ in range(2))
    g = (torch.rand(hidden // 2, generator=gen) + 0.5).to(torch.bfloat16).to(cuda)
    head = quantize_fp8(_weights(32000, hidden // 2, torch.bfloat16, gen, cuda))
    got = linear(PendingNorm(h, res, g, 1e-5), head)
    normed = PendingNorm(h, res, g, 1e-5).materialize()
    _check(got, normed, head.dense, None, f"seed={seed} LM head with the norm in its prologue")
