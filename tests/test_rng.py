"""Counter-based RNG: the Triton device functions reproduce the torch bits; the bits look random."""


import pytest
import torch
import triton
import triton.language as tl
from graphrt.kernels import rng

from tests.seeds import fresh_seed
from tests.test_rejection import CHI2_ALPHA, chi2_sf


def chi2_uniform(counts: torch.Tensor) -> float:
    counts = counts.double().flatten()
    expected = counts.sum() / counts.numel()
    stat = float(((counts - expected) ** 2 / expected).sum())
    return chi2_sf(stat, counts.numel() - 1)


@triton.jit
def _rng_probe_kernel(
    seed_ptr,  # [N] int64
    pos_ptr,  # [N] int64
    race_bits_ptr,  # [N, V] int64 out: raw uint32 hashes
    race_u_ptr,  # [N, V] fp32 out
    race_g_ptr,  # [N, V] fp32 out
    acc_u_ptr,  # [N] fp32 out
    V,
    BLOCK_V: tl.constexpr,
):
    n = tl.program_id(0)
    seed = tl.load(seed_ptr + n)
    pos = tl.load(pos_ptr + n)
    rkey = rng.tl_race_key(seed, pos)
    offs = tl.arange(0, BLOCK_V)
    mask = offs < V
    h = rng.tl_race_bits(rkey, offs)
    tl.store(race_bits_ptr + n * V + offs, h.to(tl.int64), mask=mask)
    tl.store(race_u_ptr + n * V + offs, rng.tl_bits_to_uniform(h), mask=mask)
    tl.store(race_g_ptr + n * V + offs, rng.tl_race_gumbel(rkey, offs), mask=mask)
    tl.store(acc_u_ptr + n, rng.tl_accept_uniform(seed, pos))


def test_triton_reproduces_torch_bits():
    seed_value = fresh_seed()
    gen = torch.Generator().manual_seed(seed_value)
    edge = torch.tensor([0, 1, -1, 2**32, 2**32 - 1, -(2**63), 2**63 - 1, 2**40 + 3], dtype=torch.int64)
    rand = torch.randint(-(2**62), 2**62, (8,), generator=gen, dtype=torch.int64)
    seeds = torch.cat([edge, rand])
    positions = torch.cat([edge.flip(0), torch.randint(0, 2**40, (8,), generator=gen, dtype=torch.int64)])
    n, v = seeds.numel(), 70
    bits = torch.empty(n, v, dtype=torch.int64)
    u = torch.empty(n, v)
    g = torch.empty(n, v)
    acc = torch.empty(n)
    _rng_probe_kernel[(n,)](seeds, positions, bits, u, g, acc, v, BLOCK_V=128)
    ref_bits = rng.race_bits(seeds, positions, torch.arange(v))
    msg = f"rng seed {seed_value}"
    assert torch.equal(bits, ref_bits), msg
    assert torch.equal(u, rng.bits_to_uniform(ref_bits)), msg
    assert torch.equal(acc, rng.accept_uniform(seeds, positions)), msg
    # log may differ in the last ulp between libraries; the bits above are what must be identical.
    torch.testing.assert_close(g, rng.race_gumbel(seeds, positions, v), rtol=1e-6, atol=1e-6, msg=msg)


def test_mix32_matches_python_uint32():
    def lowbias32(x):
        x ^= x >> 16
        x = (x * 0x7FEB352D) & 0xFFFFFFFF
        x ^= x >> 15
        x = (x * 0x846CA68B) & 0xFFFFFFFF
        return x ^ (x >> 16)

    xs = [0, 1, 2**31, 2**32 - 1, 0x12345678, 0xDEADBEEF]
    got = rng.mix32(torch.tensor(xs, dtype=torch.int64)).tolist()
    assert got == [lowbias32(x) for x in xs]


def test_uniform_is_exact_and_strictly_inside():
    h = torch.tensor([0, 511, 512, 2**32 - 1, 2**31], dtype=torch.int64)
    u = rng.bits_to_uniform(h)
    assert u.dtype == torch.float32
    assert u[0] == 2.0**-24 and u[1] == 2.0**-24 and u[3] == 1 - 2.0**-24
    assert ((u > 0) & (u < 1)).all()
    g = -torch.log(-torch.log(u))
    assert torch.isfinite(g).all() and g.max() < rng.GUMBEL_MAX


def test_uniformity_chi2():
    seeds = torch.arange(200, dtype=torch.int64) * 7919 + 3
    positions = torch.arange(200, dtype=torch.int64) * 13
    u = rng.bits_to_uniform(rng.race_bits(seeds, positions, torch.arange(2500)))  # 5e5 draws
    counts = torch.histc(u, bins=100, min=0.0, max=1.0)
    assert chi2_uniform(counts) > CHI2_ALPHA
    ua = rng.accept_uniform(torch.arange(50000, dtype=torch.int64), torch.zeros(50000, dtype=torch.int64))
    assert chi2_uniform(torch.histc(ua, bins=50, min=0.0, max=1.0)) > CHI2_ALPHA


def _pair_chi2(a: torch.Tensor, b: torch.Tensor, bins: int = 16) -> float:
    ia = (a * bins).long().clamp(max=bins - 1)
    ib = (b * bins).long().clamp(max=bins - 1)
    counts = torch.bincount(ia * bins + ib, minlength=bins * bins)
    return chi2_uniform(counts)


def test_independence_across_vocab_positions_and_seeds():
    v = 1000
    seeds = torch.full((300,), 12345, dtype=torch.int64)
    positions = torch.arange(300, dtype=torch.int64)
    u = rng.bits_to_uniform(rng.race_bits(seeds, positions, torch.arange(v)))  # [300, V]
    # neighbouring vocab entries of one row
    assert _pair_chi2(u[:, :-1].flatten(), u[:, 1:].flatten()) > CHI2_ALPHA
    # the same entry at neighbouring positions
    assert _pair_chi2(u[:-1].flatten(), u[1:].flatten()) > CHI2_ALPHA
    # the same (position, entry) under neighbouring seeds
    u2 = rng.bits_to_uniform(rng.race_bits(seeds + 1, positions, torch.arange(v)))
    assert _pair_chi2(u.flatten(), u2.flatten()) > CHI2_ALPHA
    # the acceptance stream against the race stream of the same (seed, position)
    ua = rng.accept_uniform(torch.arange(100000, dtype=torch.int64), torch.zeros(100000, dtype=torch.int64))
    ur = rng.bits_to_uniform(rng.race_bits(torch.arange(100000, dtype=torch.int64),
                                           torch.zeros(100000, dtype=torch.int64), torch.arange(1)))[:, 0]
    assert _pair_chi2(ua, ur) > CHI2_ALPHA
    # correlation sanity on a finer scale
    c = torch.corrcoef(torch.stack([u[:, :-1].flatten(), u[:, 1:].flatten()]))[0, 1]
    assert abs(float(c)) < 0.01


@pytest.mark.gpu
def test_triton_bits_on_gpu(cuda):
    seeds = torch.randint(-(2**62), 2**62, (64,), dtype=torch.int64, device=cuda)
    positions = torch.randint(0, 2**40, (64,), dtype=torch.int64, device=cuda)
    v = 4099
    bits = torch.empty(64, v, dtype=torch.int64, device=cuda)
    u = torch.empty(64, v, device=cuda)
    g = torch.empty(64, v, device=cuda)
    acc = torch.empty(64, device=cuda)
    _rng_probe_kernel[(64,)](seeds, positions, bits, u, g, acc, v, BLOCK_V=8192)
    ref_bits = rng.race_bits(seeds, positions, torch.arange(v, device=cuda))
    assert torch.equal(bits, ref_bits)
    assert torch.equal(u, rng.bits_to_uniform(ref_bits))
    assert torch.equal(acc, rng.accept_uniform(seeds, positions))
    torch.testing.assert_close(g, rng.race_gumbel(seeds, positions, v), rtol=2e-6, atol=2e-6)
    assert torch.equal(ref_bits.cpu(), rng.race_bits(seeds.cpu(), positions.cpu(), torch.arange(v)))
