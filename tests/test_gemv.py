"""Skinny GEMM (kernels/gemv.py): Triton vs F.linear.

On CPU the kernel runs under TRITON_INTERPRET=1 (tests/conftest.py) at small, odd sizes, both code
paths (FMA, DOT), with and without split-K (fused and two-launch); the interpreter's tl.dot does not
handle bf16, so the DOT path is checked there in fp32 and fp16 and in bf16 only on the GPU. The
`gpu` tests repeat the comparison at the llama-1b / 8b projection sizes in bf16 and inside a CUDA
graph. Every random case draws a fresh seed and prints it in the assertion message.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from graphrt.kernels import gemv_config
from graphrt.kernels.activation import silu_and_mul, silu_and_mul_reference
from graphrt.kernels.counters import counters
from graphrt.kernels.gemv import ROWS_MAX_M, gemv_triton, linear_reference, select_config
from graphrt.kernels.linear import linear, linear_silu_mul

from tests.helpers import bit_diff
from tests.seeds import fresh_seed


def _case(m, n, k, dtype, gen, *, bias, device="cpu", x_pad=0):
    """x [m, k] (a column slice of a NaN-padded buffer when x_pad: row stride k + x_pad), w, bias."""
    xb = torch.full((m, k + x_pad), float("nan"), dtype=dtype, device=device)
    xb[:, :k] = torch.randn(m, k, generator=gen).to(dtype).to(device)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype).to(device)
    b = torch.randn(n, generator=gen).to(dtype).to(device) if bias else None
    return xb[:, :k], w, b


def _check(y, x, w, b, msg):
    # Oracle: the exact product in fp64 of the (already rounded) inputs; the kernel sums in fp32 and
    # rounds once to the output dtype, so the error is about one output ulp plus fp32 ordering.
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert y.dtype == x.dtype and y.shape == ref.shape, msg
    assert torch.isfinite(y).all(), f"non-finite output; {msg}"
    eps = {torch.float32: 1e-5, torch.float16: 2**-10, torch.bfloat16: 2**-7}[x.dtype]
    tol = 2 * eps * ref.abs() + 1e-4 * (1 + ref.abs().max())
    err = (y.double() - ref).abs()
    assert bool((err <= tol).all()), f"{msg}: max err {err.max().item():.3g}"


# (m, n, k, block_n, block_k, split_k, fused): odd sizes, K tails, N tails, splits with a short last
# chunk; split_k None = the heuristic (no split at these sizes).
FMA_CASES = [
    (1, 37, 100, 4, 32, None, None),
    (1, 300, 16, 8, 16, 1, None),
    (2, 64, 300, 4, 64, 3, True),
    (3, 50, 130, 2, 32, 2, False),
    (4, 19, 257, 4, 64, 5, True),
]
DOT_CASES = [
    (1, 37, 100, 16, 32, None, None),
    (5, 64, 300, 16, 64, 3, True),
    (16, 50, 130, 32, 32, 2, False),
    (9, 200, 48, 64, 16, 3, True),
    (12, 16, 16, 16, 16, 1, None),
    (33, 70, 90, 32, 32, None, None),  # past 16 rows: the o and down projections at 17-64 rows
    (64, 48, 64, 16, 32, 2, True),
    (32, 70, 300, 64, 128, 3, True),  # the 17-64-row tiles (_DOT_TALL), split K with a short last chunk
    (150, 40, 48, 16, 16, 1, None),  # past 64 rows: three row tiles, the last one ragged
    (128, 24, 70, 32, 32, None, None),  # two whole row tiles, a K tail
]


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", FMA_CASES)
def test_fma_path_matches_reference(case, dtype, bias):
    m, n, k, bn, bk, split, fused = case
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    x, w, b = _case(m, n, k, dtype, gen, bias=bias, x_pad=3)
    reduce_each = bool(seed % 2)  # both accumulator layouts, alternately
    y = gemv_triton(x, w, b, use_dot=False, reduce_each=reduce_each, block_n=bn, block_k=bk, split_k=split,
                    fused=fused)
    _check(y, x, w, b, f"seed={seed} reduce_each={reduce_each} case={case} {dtype}")


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", DOT_CASES)
def test_dot_path_matches_reference(case, dtype, bias):
    m, n, k, bn, bk, split, fused = case
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    x, w, b = _case(m, n, k, dtype, gen, bias=bias, x_pad=5)
    y = gemv_triton(x, w, b, use_dot=True, block_n=bn, block_k=bk, split_k=split, fused=fused)
    _check(y, x, w, b, f"seed={seed} case={case} {dtype}")


@pytest.mark.parametrize("kind", sorted(gemv_config._M1_DEVICE_OVERRIDES))
def test_device_tables_tiles_compute_the_product(kind):
    """Every one-row entry of a device kind's table (kernels/gemv_config.py) is a launch the kernel
    takes and computes right: its tiles on a small product, two row tiles and a ragged K tail."""
    table = gemv_config._M1_DEVICE_OVERRIDES[kind]
    for (n, k), change in table.items():
        cfg = gemv_config._m1_config(n, k, table)
        seed = fresh_seed()
        cfg.pop("programs_per_sm")  # the dispatcher's, not a launch keyword
        x, w, b = _case(1, 2 * cfg["block_n"] - 1, cfg["block_k"] + 5, torch.bfloat16,
                        torch.Generator().manual_seed(seed), bias=False)
        y = gemv_triton(x, w, **cfg)
        _check(y, x, w, b, f"seed={seed} {kind} ({n}, {k}): {change}")


def test_dispatcher_past_16_rows_takes_o_down_and_gated_gate_up_only():
    """17-64 rows: the o projection (K = N) up to 32 rows and down-like products (K >= 2N) up to 64
    on the DOT path, split K, for matrices of the swept sizes; gate_up with the SiLU in its epilogue
    unsplit; qkv, a plain product of gate_up's shape, LM heads, other sizes and anything past 64 rows
    on cuBLAS."""
    tall = dict(gemv_config._DOT_TALL)
    for m, n, k in [(17, 2048, 2048), (32, 4096, 4096), (33, 2048, 8192), (64, 4096, 14336), (64, 2048, 6144)]:
        assert gemv_config.select_config(m, n, k) == tall, (m, n, k)
    for m, n, k in [(33, 2048, 2048), (64, 4096, 4096), (32, 3072, 2048), (32, 16384, 2048), (32, 3072, 4096),
                    (32, 128256, 2048), (65, 2048, 8192), (32, 3072, 576),
                    (32, 8192, 28672)]:  # the 70B shape's: not swept
        assert gemv_config.select_config(m, n, k) is None, (m, n, k)
    wide, small_k = dict(gemv_config._DOT_WIDE), dict(gemv_config._GATED_SMALL_K)
    for m, n, k in [(17, 16384, 2048), (64, 28672, 4096), (32, 14336, 4096)]:
        assert gemv_config.select_config(m, n, k, gated=True) == wide, (m, n, k)
    assert gemv_config.select_config(48, 3072, 576, gated=True) == small_k  # SmolLM2's: 64-wide K steps
    assert gemv_config.unsplit(wide) and gemv_config.unsplit(small_k) and small_k["block_k"] == 64
    for m, n, k in [(65, 16384, 2048), (32, 57344, 8192), (32, 2000, 300)]:  # past 64 rows, 70B's, tiny
        assert gemv_config.select_config(m, n, k, gated=True) is None, (m, n, k)


def test_dispatcher_on_small_matrices_past_16_rows():
    """17-256 rows (a verify step at B = 5-64) on SmolLM2's matrices: o and down unsplit on the DOT
    path, gate_up with its SiLU, in row tiles past 64; larger matrices past 64 rows, a plain product
    of gate_up's shape and anything past 256 rows on cuBLAS."""
    small_k = dict(gemv_config._GATED_SMALL_K)
    for m in (17, 32, 64, 65, 96, 128, 192, 256):
        assert gemv_config.select_config(m, 576, 576) == gemv_config._SMALL_TALL_SMALL_K, m  # o
        assert gemv_config.select_config(m, 576, 1536) == gemv_config._SMALL_TALL, m  # down
        assert gemv_config.select_config(m, 3072, 576, gated=True) == small_k, m
        assert gemv_config.unsplit(gemv_config.select_config(m, 576, 1536))
    for m in (65, 96, 128, 192, 256):
        assert gemv_config.row_tiles(m) == -(-m // 64) and gemv_config.dot_block_m(m) == 64
    for m, n, k, gated in [(257, 3072, 576, True), (257, 576, 576, False), (128, 16384, 2048, True),
                           (128, 3072, 576, False), (128, 2048, 2048, False), (96, 2048, 8192, False)]:
        assert gemv_config.select_config(m, n, k, gated=gated) is None, (m, n, k, gated)


@pytest.mark.parametrize("gated", [False, True])
def test_dot_row_tiles_are_the_64_row_launches_bitwise(gated):
    """Past 64 rows each program takes one 64-row tile of x: every tile's rows are the bits of the
    same tiles' launch over those 64 rows alone."""
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    x, w, _ = _case(192, 2 * 24 if gated else 40, 70, torch.float32, gen, bias=False, x_pad=3)
    kw = dict(use_dot=True, block_n=32, block_k=32, split_k=1, gated=gated)
    x_before = x.clone()
    y = gemv_triton(x, w, **kw)
    tiles = torch.cat([gemv_triton(x[i : i + 64], w, **kw) for i in (0, 64, 128)])
    assert torch.equal(y, tiles), f"seed={seed}: {bit_diff(y, tiles)}"
    assert torch.equal(x, x_before)


def test_row_tiles_refuse_what_they_cannot_run():
    x, w, _ = _case(100, 32, 300, torch.float32, torch.Generator().manual_seed(0), bias=False)
    with pytest.raises(ValueError, match="unsplit DOT path"):
        gemv_triton(x, w, use_dot=True, block_k=32, split_k=2)
    with pytest.raises(ValueError, match="FMA path"):
        gemv_triton(x, w, use_dot=False)
    with pytest.raises(ValueError, match="M <= 256"):
        gemv_triton(torch.cat([x, x, x]), w, use_dot=True)


def test_fused_and_unfused_split_agree_bitwise():
    # The split-K sum runs in split order either way: same bits, whichever program finishes last.
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    x, w, b = _case(3, 40, 200, torch.float32, gen, bias=True)
    kw = dict(use_dot=False, block_n=8, block_k=32, split_k=4)
    y1 = gemv_triton(x, w, b, fused=True, **kw)
    y2 = gemv_triton(x, w, b, fused=False, **kw)
    assert torch.equal(y1, y2), f"seed={seed}"
    # The counters are left at zero for the next launch.
    assert not counters(x.device, 8).any()


# (inter, k, block_n, block_k, reduce_each): N and K tails, K inside one tile, several K steps.
GATED_CASES = [(37, 100, 4, 32, True), (16, 64, 2, 64, False), (50, 130, 8, 32, True), (3, 257, 2, 64, False)]


@pytest.mark.parametrize("case", GATED_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gated_epilogue_is_the_unfused_pair_bitwise(case, dtype):
    """gate_up GEMV with SiLU·mul in its epilogue == the GEMV then silu_and_mul, same configuration.

    Same sums, same rounding chain. Under the interpreter numpy's exp may differ by an ulp between
    array lengths and an in-register cast to bf16 truncates (stores round), so here fp32 and fp16
    agree to a few ulps; the GPU test below asks for equal bits in bf16."""
    inter, k, bn, bk, red = case
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    x, w, _ = _case(1, 2 * inter, k, dtype, gen, bias=False, x_pad=3)
    kw = dict(use_dot=False, block_n=bn, block_k=bk, reduce_each=red)
    x_before, w_before = x.clone(), w.clone()
    fused = gemv_triton(x, w, gated=True, **kw)
    unfused = silu_and_mul(gemv_triton(x, w, **kw))
    assert fused.shape == (1, inter) and fused.dtype == dtype
    eps = torch.finfo(dtype).eps
    err = (fused.float() - unfused.float()).abs()
    tol = 4 * eps * (unfused.float().abs() + 1e-3)
    assert bool((err <= tol).all()), f"seed={seed} case={case} {dtype}: {err.max()}"
    # And both are what the eager model computes, up to the GEMV's rounding.
    ref = silu_and_mul_reference(F.linear(x, w))
    torch.testing.assert_close(fused, ref, rtol=2e-2, atol=2e-2, msg=lambda m: f"seed={seed}: {m}")
    assert torch.equal(x, x_before) and torch.equal(w, w_before)


# (inter, k, m, block_n, block_k): N tail, K tail, 16 rows
GATED_DOT_CASES = [(48, 100, 3, 32, 32), (40, 64, 5, 32, 64), (32, 130, 16, 64, 32), (24, 64, 40, 64, 32),
                   (80, 300, 64, 128, 128)]  # the last: the 17-64-row tiles (_DOT_WIDE), a short K tile


@pytest.mark.parametrize("case", GATED_DOT_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gated_epilogue_on_the_dot_path_is_the_unfused_pair(case, dtype):
    """The DOT path (a verify step's gate_up, 3-16 rows): the law of the one-row epilogue, each
    program reading a gate tile and an up tile of half the unfused tile's rows; the interpreter's
    exp and bf16 cast as in the test above."""
    inter, k, m, bn, bk = case
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    x, w, _ = _case(m, 2 * inter, k, dtype, gen, bias=False, x_pad=3)
    kw = dict(use_dot=True, block_n=bn, block_k=bk, split_k=1)
    fused = gemv_triton(x, w, gated=True, **kw)
    unfused = silu_and_mul(gemv_triton(x, w, **kw))
    assert fused.shape == (m, inter) and fused.dtype == dtype
    err = (fused.float() - unfused.float()).abs()
    eps = torch.finfo(dtype).eps
    # The fused launch's tiles hold half the unfused one's rows, and the interpreter's tl.dot is
    # numpy's matmul, whose order of summation may follow the shape: the two differ by the dot's own
    # rounding (k eps sum |x w| for gate g and up u), carried through silu(g) * u, besides the
    # epilogue's few ulps of the result.
    y, mag = F.linear(x.double(), w.double()), F.linear(x.double().abs(), w.double().abs())
    g, u = y[:, :inter], y[:, inter:]
    dot_err = k * eps * (1.1 * u.abs() * mag[:, :inter] + (g.abs() + 0.3) * mag[:, inter:])
    tol = 4 * eps * (unfused.float().abs() + 1e-3) + dot_err.float()
    assert bool((err <= tol).all()), f"seed={seed} case={case} {dtype}: {(err - tol).max()} over"
    ref = silu_and_mul_reference(F.linear(x, w))
    torch.testing.assert_close(fused, ref, rtol=2e-2, atol=2e-2, msg=lambda m: f"seed={seed}: {m}")


@pytest.mark.parametrize("m", [2, 3, 4, 6])
@pytest.mark.parametrize("gated,reduce_each", [(False, True), (True, True), (True, False)])
def test_per_row_path_is_the_one_row_product_per_row_bitwise(m, gated, reduce_each):
    """per_row: one M = 1 program per row of x, so each output row is the M = 1 launch's bits."""
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    x, w, b = _case(m, 2 * 19 if gated else 37, 130, torch.float32, gen, bias=not gated, x_pad=3)
    kw = dict(block_n=4, block_k=32, reduce_each=reduce_each, gated=gated, num_warps=1 if reduce_each else 2)
    got = gemv_triton(x, w, b, per_row=True, **kw)
    rows = torch.cat([gemv_triton(x[i : i + 1], w, b, **kw) for i in range(m)])
    assert torch.equal(got, rows), f"seed={seed} m={m} gated={gated}"
    assert select_config(m, 576, 1536)["per_row"] and not select_config(1, 576, 1536).get("per_row")
    assert not (select_config(m, 2048, 2048) or {}).get("per_row")  # 8 MiB: too large
    # latency-bound matrices (SmolLM2-135M's qkv, o, gate_up, down): the rows take tiles of their
    # own; one row keeps the default's
    for n, k in ((960, 576), (576, 576), (3072, 576), (576, 1536)):
        one, rows = select_config(1, n, k), select_config(m, n, k)
        assert rows["block_n"] == 4 and rows["num_warps"] <= 2 and one["block_n"] == 2, (n, k)
        assert not rows["use_dot"] and rows["block_k"] <= 2 * k, (n, k)
    assert select_config(m, 3072, 576)["block_k"] == 512 and not select_config(m, 3072, 576)["reduce_each"]
    assert not select_config(ROWS_MAX_M + 1, 576, 1536).get("per_row")
    with pytest.raises(ValueError, match="per_row=True takes"):
        gemv_triton(torch.cat([x] * (ROWS_MAX_M // m + 1)), w, b, per_row=True, **kw)


def test_linear_silu_mul_on_cpu_is_the_reference_bitwise():
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    for m in (1, 3):
        x, w, _ = _case(m, 48, 40, torch.bfloat16, gen, bias=False)
        assert torch.equal(linear_silu_mul(x, w), silu_and_mul_reference(F.linear(x, w))), f"seed={seed}"


@pytest.mark.parametrize(
    "args,kwargs",
    [
        ((torch.zeros(2, 4), torch.zeros(6, 4)), dict(gated=True, per_row=False)),  # M = 2 in one program
        ((torch.zeros(1, 4), torch.zeros(5, 4)), dict(gated=True)),  # odd N
        ((torch.zeros(1, 4), torch.zeros(6, 4), torch.zeros(6)), dict(gated=True)),  # bias
        ((torch.zeros(3, 64), torch.zeros(32, 64)), dict(gated=True, use_dot=True, split_k=2, block_k=16)),
        ((torch.zeros(1, 64), torch.zeros(6, 64)), dict(gated=True, split_k=2, block_k=16)),
    ],
)
def test_gated_bad_inputs(args, kwargs):
    with pytest.raises(ValueError, match="gated=True"):
        gemv_triton(*args, **kwargs)


def test_out_and_default_config():
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    x, w, _ = _case(2, 24, 40, torch.float32, gen, bias=False)
    out = torch.full((2, 24), float("nan"))
    y = gemv_triton(x, w, out=out)
    assert y is out
    _check(y, x, w, None, f"seed={seed}")


def test_linear_on_cpu_is_f_linear_bitwise():
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    for dtype in (torch.float32, torch.bfloat16):
        x, w, b = _case(3, 33, 65, dtype, gen, bias=True)
        assert torch.equal(linear(x, w, b), F.linear(x, w, b)), f"seed={seed}"
        assert torch.equal(linear_reference(x, w), F.linear(x, w)), f"seed={seed}"


@pytest.mark.parametrize(
    "kwargs,args,match",
    [
        (dict(), (torch.zeros(2, 3, 4), torch.zeros(5, 4)), r"x must be \[M, K\]"),
        (dict(), (torch.zeros(2, 4), torch.zeros(5, 3)), "disagree on K"),
        (dict(), (torch.zeros(2, 4), torch.zeros(5, 4, dtype=torch.float16)), "dtype"),
        (dict(), (torch.zeros(2, 4, dtype=torch.int32), torch.zeros(5, 4, dtype=torch.int32)), "dtype"),
        (dict(), (torch.zeros(4, 2).t(), torch.zeros(5, 4)), "contiguous in K"),
        (dict(), (torch.zeros(2, 4), torch.zeros(4, 5).t()), "w must be contiguous"),
        (dict(), (torch.zeros(257, 4), torch.zeros(5, 4)), "M <= 256"),
        (dict(), (torch.zeros(0, 4), torch.zeros(5, 4)), "empty"),
        (dict(), (torch.zeros(2, 4), torch.zeros(5, 4), torch.zeros(4)), "bias must be"),
        (dict(use_dot=False), (torch.zeros(5, 4), torch.zeros(5, 4)), "FMA path"),
        (dict(block_n=12), (torch.zeros(2, 4), torch.zeros(5, 4)), "power of 2"),
        (dict(use_dot=True, block_n=8), (torch.zeros(2, 4), torch.zeros(5, 4)), ">= 16"),
        (dict(out=torch.zeros(3, 5)), (torch.zeros(2, 4), torch.zeros(5, 4)), "out must be"),
    ],
)
def test_bad_inputs(kwargs, args, match):
    with pytest.raises(ValueError, match=match):
        gemv_triton(*args, **kwargs)


# ---------------------------------------------------------------------------------------------
# GPU: real sizes, bf16, the dispatcher's configs and a CUDA graph
# ---------------------------------------------------------------------------------------------

GPU_SHAPES = [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192), (6144, 4096), (4096, 14336)]


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("n,k", GPU_SHAPES)
def test_gpu_real_sizes(cuda, n, k, m):
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    for bias in (False, True):
        x, w, b = _case(m, n, k, torch.bfloat16, gen, bias=bias, device=cuda)
        # The dispatcher (Triton or cuBLAS, per select_config) and the kernel's own default config.
        _check(linear(x, w, b), x, w, b, f"seed={seed} m={m} n={n} k={k} bias={bias}")
        _check(gemv_triton(x, w, b), x, w, b, f"gemv_triton seed={seed} m={m} n={n} k={k} bias={bias}")


@pytest.mark.gpu
@pytest.mark.parametrize("m", [17, 64, 96, 256])
@pytest.mark.parametrize("n,k", [(576, 576), (576, 1536)])
def test_gpu_small_matrices_past_16_rows(cuda, n, k, m):
    """SmolLM2's o and down at 17-256 rows: the dispatcher's DOT launch, in row tiles past 64."""
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    x, w, _ = _case(m, n, k, torch.bfloat16, gen, bias=False, device=cuda)
    assert select_config(m, n, k)["use_dot"]
    _check(linear(x, w), x, w, None, f"seed={seed} m={m} n={n} k={k}")


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["fma", "fma_reduce_each", "dot"])
@pytest.mark.parametrize("fused", [False, True])
def test_gpu_paths_and_splits(cuda, path, fused):
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    for m in (1, 3, 4, ROWS_MAX_M):
        x, w, b = _case(m, 2048 + 40, 2048 + 72, torch.bfloat16, gen, bias=True, device=cuda, x_pad=8)
        if path != "dot" and m > 1:  # per row: each row the M = 1 launch's bits, same tiles
            one = dict(block_n=2, block_k=2048, reduce_each=True)
            rows = torch.cat([gemv_triton(x[i : i + 1], w, b, **one) for i in range(m)])
            y = gemv_triton(x, w, b, per_row=True, **one)
            assert torch.equal(y, rows), f"seed={seed} m={m} per_row: {bit_diff(y, rows)}"
        if path != "dot" and m > 4:  # past the FMA path's rows: per row only
            continue
        for split in (1, 3, 8):
            y = gemv_triton(x, w, b, use_dot=path == "dot", reduce_each=path == "fma_reduce_each",
                            split_k=split, fused=fused)
            _check(y, x, w, b, f"seed={seed} m={m} split={split}")


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 4, 16, 24, 64, 96, 256])
@pytest.mark.parametrize("inter,k", [(8192, 2048), (14336, 4096), (1536, 576), (1000, 300)])
def test_gpu_gated_gate_up_is_the_unfused_pair_bitwise(cuda, inter, k, m):
    """The decode MLP at 1 row (one row per program) and at 4-64 (the DOT path where the
    dispatcher takes it; llama-1b / 8b / SmolLM2 gate_up, and an odd size), and SmolLM2's in row
    tiles at 96 and 256: linear_silu_mul gives the bits of the same tiles' GEMV then silu_and_mul,
    and the eager model's values up to rounding."""
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    x, w, _ = _case(m, 2 * inter, k, torch.bfloat16, gen, bias=False, device=cuda)
    got = linear_silu_mul(x, w)
    cfg = select_config(m, 2 * inter, k, gated=True)
    if cfg is not None and cfg["use_dot"]:
        tiles = {key: cfg[key] for key in ("use_dot", "block_n", "block_k", "num_warps", "num_stages")}
        want = silu_and_mul(gemv_triton(x, w, split_k=1, **tiles))
    else:
        want = silu_and_mul(linear(x, w))
    assert torch.equal(got, want), f"seed={seed} inter={inter} k={k} m={m}"
    ref = silu_and_mul_reference(F.linear(x.float(), w.float()))
    torch.testing.assert_close(got.float(), ref, rtol=3e-2, atol=3e-2, msg=lambda s: f"seed={seed}: {s}")
    if cfg is not None:
        assert torch.equal(got, gemv_triton(x, w, gated=True)), f"seed={seed} m={m}"


@pytest.mark.gpu
def test_gpu_cuda_graph_replay_is_deterministic(cuda):
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    x, w, _ = _case(4, 2048, 8192, torch.bfloat16, gen, bias=False, device=cuda)
    linear(x, w)  # compile and allocate the counters outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = linear(x, w)
    for _ in range(5):
        x.copy_(torch.randn(4, 8192, generator=gen).to(torch.bfloat16))
        g.replay()
        torch.cuda.synchronize()
        _check(y, x, w, None, f"seed={seed}")
        again = linear(x, w)
        assert torch.equal(again, y), f"seed={seed}: eager and replay differ"
    assert not counters(x.device, 1).any()


@pytest.mark.gpu
def test_gpu_runtime_bf16_graphs_match_eager(cuda):
    # tests/test_gpu_runtime.py runs fp32 checkpoints, which the dispatcher leaves to F.linear; in
    # bf16 the decode GEMMs take the Triton kernel. One request at a time, so eager and the graph
    # bucket run the same M (and so the same configs): the tokens must match exactly.
    from graphrt import Runtime, SamplingParams
    from graphrt.checkpoint import load_checkpoint
    from tests.helpers import draft_dir, tiny_dir

    target = load_checkpoint(tiny_dir(), dtype=torch.bfloat16, device=cuda)
    draft = load_checkpoint(draft_dir("self"), dtype=torch.bfloat16, device=cuda)
    sp = SamplingParams(max_new_tokens=20, ignore_eos=True)
    for d in (None, draft):
        got = {}
        for graphs in (False, True):
            rt = Runtime(target, d, device=cuda, max_batch_size=4, max_seq_len=64, use_cuda_graphs=graphs)
            got[graphs] = [rt.generate([p], sp)[0].token_ids for p in ([3, 4, 5, 6], [7] * 9)]
        assert got[True] == got[False], f"draft={d is not None}"


def _unfused(monkeypatch):
    """The layers' projections without their GEMV prologue and epilogue fusions: [the norm,] the
    GEMV, then SiLU·mul or rotary + KV store, each its own launch."""
    import graphrt.kernels.linear as linear_mod
    from graphrt.kernels.activation import silu_and_mul
    from graphrt.kernels.qkv_rotary import qkv_rotary_store_reference

    import graphrt.models.layers as layers

    monkeypatch.setattr(linear_mod, "norm_fusable", lambda x: False)
    monkeypatch.setattr(layers, "one_row_product", lambda *a: False)  # no residual add in an epilogue either
    monkeypatch.setattr(layers, "linear_silu_mul",
                        lambda x, w: silu_and_mul(linear_mod.linear(linear_mod.materialized(x), w)))
    monkeypatch.setattr(layers, "qkv_rotary_store",
                        lambda x, *a, **k: qkv_rotary_store_reference(linear_mod.materialized(x), *a, **k))


@pytest.mark.gpu
def test_gpu_runtime_epilogue_fusions_do_not_change_tokens(cuda, monkeypatch):
    # The one-token steps (plain decode, draft decode) take the fused qkv + rotary and gate_up +
    # SiLU·mul kernels; each equals its two-launch pair bit for bit, so whole generations must too.
    from graphrt import Runtime, SamplingParams
    from graphrt.checkpoint import load_checkpoint
    from tests.helpers import draft_dir, tiny_dir

    target = load_checkpoint(tiny_dir(), dtype=torch.bfloat16, device=cuda)
    draft = load_checkpoint(draft_dir("self"), dtype=torch.bfloat16, device=cuda)
    sp = SamplingParams(max_new_tokens=24, ignore_eos=True)
    for d in (None, draft):
        got = {}
        for fused in (True, False):
            with monkeypatch.context() as m:
                if not fused:
                    _unfused(m)
                rt = Runtime(target, d, device=cuda, max_batch_size=2, max_seq_len=64, use_cuda_graphs=True)
                got[fused] = [rt.generate([p], sp)[0].token_ids for p in ([3, 4, 5, 6], [7] * 9)]
        assert got[False] == got[True], f"draft={d is not None}"


def test_env_switch_sends_everything_to_cublas():
    """GRAPHRT_GEMV=0 (read at import) turns the Triton path off for a whole run."""
    import subprocess
    import sys

    code = "from graphrt.kernels import gemv_config; print(gemv_config.MAX_M)"
    env = dict(os.environ, GRAPHRT_GEMV="0")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "0"


def test_env_switch_all_sends_every_decode_product_to_triton():
    """GRAPHRT_GEMV=all: shapes the dispatcher leaves to cuBLAS (N > K at M = 2) get a Triton
    configuration, and so do up to 64 rows (a small prefill graph's); more still go to cuBLAS."""
    import subprocess
    import sys

    code = ("from graphrt.kernels import gemv; "
            "print(gemv.select_config(2, 3072, 2048) is not None, gemv.select_config(2, 16384, 2048) is not None, "
            "gemv.select_config(17, 3072, 2048) is None, gemv.select_config(64, 3072, 2048) is None, "
            "gemv.select_config(65, 3072, 2048) is None)")
    for value, want in (("all", "True True False False True"), ("1", "False False True True True")):
        env = dict(os.environ, GRAPHRT_GEMV=value)
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert out.stdout.strip() == want, (value, out.stdout)
