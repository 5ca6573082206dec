"""Rejection sampler: reference rules, Triton == reference token for token, sampling law per position."""

import dataclasses
import math

import pytest
import torch
import triton
import triton.language as tl
from graphrt.kernels import rejection_sample
from graphrt.kernels.rejection import launch_config, rejection_sample_reference, rejection_sample_triton
from graphrt.kernels.rng import tl_gumbel, tl_gumbel_upper_bound

from tests.seeds import fresh_seed


def chi2_sf(stat: float, df: int) -> float:
    """Survival function of the chi-squared law (scipy is not a dependency)."""
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64),
                                         torch.tensor(stat / 2.0, dtype=torch.float64)))


# The p-value under which a goodness-of-fit check fails. A run makes about 50 of them (the
# samplers' laws and the RNG's uniformity), so at 1e-4 about one run in 200 failed by chance (one
# did: p = 5e-5 on a correct law, replayed); a wrong law over 10^5 samples gives p near 0.
CHI2_ALPHA = 1e-6


def chi2_pvalue(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    """Goodness of fit of integer samples to probs; cells with expected count < 5 are pooled."""
    n = tokens.numel()
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    expected = probs.double() * n
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum().reshape(1)])
    exp = torch.cat([expected[~small], expected[small].sum().reshape(1)])
    keep = exp > 0
    if bool((counts[expected == 0] > 0).any()):
        return 0.0  # a token with p = 0 was emitted
    obs, exp = obs[keep], exp[keep]
    stat = float(((obs - exp) ** 2 / exp).sum())
    return chi2_sf(stat, max(1, obs.numel() - 1))


def make_inputs(b, k, v, *, gen, temps, full_q=False, ragged=False, hazards=False, dtype=torch.float32):
    """Random logits; drafts drawn from q (or the target argmax) so that many get accepted."""
    target = (torch.randn(b, k + 1, v, generator=gen) * 2).to(dtype)
    qlogits = (target[:, :k].float() + torch.randn(b, k, v, generator=gen)).to(dtype)
    q = torch.softmax(qlogits.float(), -1)
    drafts = torch.multinomial(q.reshape(-1, v), 1, generator=gen).reshape(b, k) if k else \
        torch.zeros(b, 0, dtype=torch.int64)
    if k:
        use_argmax = torch.rand(b, k, generator=gen) < 0.4
        drafts = torch.where(use_argmax, target[:, :k].float().argmax(-1), drafts)
    if hazards and b >= 6 and k >= 2:
        drafts[0, 0] = -1
        drafts[1, 1] = v
        drafts[2, 0] = 2**40
        target[3, 0] = float("nan")  # dead row 0
        target[4, 1, :] = float("-inf")
        target[4, 1, 3] = float("nan")
        target[5, :, :] = float("nan")  # every row dead
        target[0, 1, 2] = float("inf")
        drafts[0, 1] = 2
    temperature = torch.tensor([temps[i % len(temps)] for i in range(b)], dtype=torch.float32)
    seed = torch.randint(-(2**62), 2**62, (b,), generator=gen, dtype=torch.int64)
    position = torch.randint(0, 2**33, (b,), generator=gen, dtype=torch.int64)
    nd = torch.randint(0, k + 1, (b,), generator=gen, dtype=torch.int64) if ragged else None
    return dict(target_logits=target, draft_token_ids=drafts, temperature=temperature, seed=seed,
                position=position, draft_logits=qlogits if full_q else None, num_draft_tokens=nd)


def forced(args, **fields):
    """The default launch for these inputs' shape with some fields forced (tests' small tiles)."""
    b, r, _ = args["target_logits"].shape
    full_q = args.get("draft_logits") is not None and r > 1
    return dataclasses.replace(launch_config(b, r - 1, full_q), **fields)


def clone_args(args):
    return {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in args.items()}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.contiguous(), b.contiguous()
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def assert_same_result(got, ref, msg="", tol=1e-5, counts=None):
    """Triton against reference: tokens and counts bit for bit, logprobs to fp32 rounding;
    counts: (Triton's, the reference's) acceptance counters, equal too."""
    assert torch.equal(got.token_ids, ref.token_ids), msg
    assert torch.equal(got.num_emitted, ref.num_emitted), msg
    torch.testing.assert_close(got.logprobs, ref.logprobs, rtol=tol, atol=tol, msg=msg)
    if counts is not None:
        assert torch.equal(*counts), msg


def check_outputs_valid(res, args):
    b, r, v = args["target_logits"].shape
    n = res.num_emitted.long()
    assert res.num_emitted.dtype == torch.int32
    assert ((n >= 1) & (n <= r)).all()
    j = torch.arange(r)
    emitted = j[None, :] < n[:, None]
    assert ((res.token_ids >= 0) & (res.token_ids < v))[emitted].all()
    assert (res.token_ids[~emitted] == -1).all()
    assert (res.logprobs[~emitted] == 0).all()


# --- reference rules at temperature 0 vs a plain python loop -------------------------------------


def greedy_loop(target, drafts, nd):
    b, r, v = target.shape
    k = r - 1
    toks, nums, lps = [], [], []
    for i in range(b):
        kb = k if nd is None else int(nd[i])
        out, lp = [], []
        for j in range(kb + 1):
            row = [float(x) for x in target[i, j].float()]
            clean = [-math.inf if math.isnan(x) else x for x in row]
            best, arg = -math.inf, 0
            for t, x in enumerate(clean):
                if x > best:
                    best, arg = x, t
            dead = best == -math.inf
            m = max(min(x, 3.4028234663852886e38) for x in clean)
            lse = -math.inf if dead else m + math.log(sum(math.exp(min(x, 3.4028234663852886e38) - m)
                                                          for x in clean))

            def logp(t, clean=clean, lse=lse, dead=dead):
                return -math.inf if dead else min(clean[t], 3.4028234663852886e38) - lse

            if j < kb:
                d = int(drafts[i, j])
                if 0 <= d < v and not dead and d == arg:
                    out.append(d)
                    lp.append(logp(d))
                    continue
            out.append(arg)
            lp.append(logp(arg))
            break
        nums.append(len(out))
        toks.append(out + [-1] * (r - len(out)))
        lps.append(lp + [0.0] * (r - len(lp)))
    return torch.tensor(toks), torch.tensor(nums, dtype=torch.int32), torch.tensor(lps)


@pytest.mark.parametrize("ragged", [False, True])
def test_reference_greedy_matches_python_loop(ragged):
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    args = make_inputs(12, 3, 40, gen=gen, temps=[0.0], ragged=ragged, hazards=True)
    res = rejection_sample_reference(**args)
    toks, nums, lps = greedy_loop(args["target_logits"], args["draft_token_ids"], args["num_draft_tokens"])
    assert torch.equal(res.token_ids, toks), f"seed {seed}"
    assert torch.equal(res.num_emitted, nums), f"seed {seed}"
    torch.testing.assert_close(res.logprobs, lps.float(), rtol=1e-5, atol=1e-5, msg=f"seed {seed}")
    check_outputs_valid(res, args)


# --- Triton (interpreter) == reference -----------------------------------------------------------

CASES = {
    # name: (temps, full_q, ragged, hazards, k, fuse_race)
    "greedy": ([0.0], False, False, True, 3, None),
    "onehot_fused": ([1.0, 0.7], False, False, True, 3, True),
    "onehot_race_pass": ([1.3], False, True, True, 3, False),
    "fullq": ([0.9, 1.0], True, False, True, 3, None),
    "fullq_ragged": ([1.0], True, True, False, 2, None),
    "mixed": ([0.0, 1.0, float("nan"), 0.5, -0.0], False, True, True, 3, False),
    "mixed_fullq": ([0.0, 0.8], True, True, True, 3, None),
    "k0": ([0.0, 1.0], False, False, False, 0, None),
    "k0_race_pass": ([0.0, 1.0], False, False, False, 0, False),
}


@pytest.mark.parametrize("name", list(CASES))
def test_triton_matches_reference(name):
    temps, full_q, ragged, hazards, k, fuse = CASES[name]
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    dtype = [torch.float32, torch.bfloat16, torch.float16][seed % 3]
    args = make_inputs(6, k, 75, gen=gen, temps=temps, full_q=full_q, ragged=ragged, hazards=hazards,
                       dtype=dtype)
    before = clone_args(args)
    counts_ref = torch.arange(k, dtype=torch.int64)
    counts_tri = counts_ref.clone()
    # 3-5 race chunks of 16-32 entries at V = 75, split into tiles of 16 (the last one partial);
    # the default single chunk runs in the tests below
    chunk = [16, 32][(seed // 3) % 2]
    ref = rejection_sample_reference(**args, acceptance_counts=counts_ref, race_chunk=chunk)
    fuse = {} if fuse is None else {"fuse_race": fuse}
    got = rejection_sample_triton(**args, acceptance_counts=counts_tri, race_chunk=chunk,
                                  config=forced(args, block_v=16, race_block_v=16, num_splits=3, **fuse))
    msg = f"seed {seed} dtype {dtype} race_chunk {chunk}"
    assert_same_result(got, ref, msg, counts=(counts_tri, counts_ref))
    check_outputs_valid(got, args)
    for key, value in before.items():
        if isinstance(value, torch.Tensor):
            assert same_bits(args[key], value), f"{key} modified"


def _pruning_inputs(gen, kind, dtype):
    """Rows built so that the race prunes: a logit far above the rest (100 vs randn) makes every
    later tile's bound (x + ~16.7) lose to the best key, unless a near peak sits in it."""
    b, k, v = 4, 2, 512
    target = torch.randn(b, k + 1, v, generator=gen)
    drafts = torch.randint(0, v, (b, k), generator=gen)
    for i in range(b):
        for j in range(k + 1):
            row = target[i, j]
            peak = int(torch.randint(0, v, (1,), generator=gen))
            if kind == "first_tile":
                peak = int(torch.randint(0, 32, (1,), generator=gen))
            elif kind == "last_tile":
                peak = v - 1 - int(torch.randint(0, 8, (1,), generator=gen))
            row[peak] = 100.0
            if kind == "two_peaks":  # the draft is a peak with p = 1/2: the race excludes it half the time
                other = (peak + 1 + int(torch.randint(0, v - 1, (1,), generator=gen))) % v
                row[other] = 100.0
                if j < k:
                    drafts[i, j] = peak
            elif kind == "near_peak":  # a second peak in a later tile, close enough to win sometimes
                row[(peak + 300) % v] = 99.0
            elif kind == "sparse":  # one live entry (or none) per row
                row[:] = float("-inf")
                if (i + j) % 3:
                    row[peak] = 1.0
                if i % 2 == 0:
                    row[(peak + 7) % v] = float("nan")
    temperature = torch.tensor([1.0, 0.5, 2.0, 1.0])
    seed = torch.randint(0, 2**62, (b,), generator=gen)
    position = torch.randint(0, 2**31, (b,), generator=gen)
    return dict(target_logits=target.to(dtype), draft_token_ids=drafts, temperature=temperature, seed=seed,
                position=position)


@pytest.mark.parametrize("kind", ["first_tile", "last_tile", "two_peaks", "near_peak", "sparse"])
def test_triton_race_pruning_matches_reference(kind):
    """Race pruning (skip a tile whose keys cannot beat the best so far) is exact: same tokens as the
    reference, fused and separate race (2 chunks of 4 tiles each)."""
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    dtype = [torch.float32, torch.bfloat16][seed % 2]
    args = _pruning_inputs(gen, kind, dtype)
    ref = rejection_sample_reference(**args, race_chunk=256)
    for fuse in (False, True):
        # 2 chunks of 256, a split each; the separate race runs 4 tiles of 64 over the winning one
        got = rejection_sample_triton(**args, race_chunk=256, config=forced(
            args, fuse_race=fuse, prune=True, block_v=64, race_block_v=64, num_splits=2))
        msg = f"seed {seed} dtype {dtype} fuse {fuse}"
        assert_same_result(got, ref, msg)


@triton.jit
def _gumbel_bound_kernel(u_ptr, g_ptr, b_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    u = tl.load(u_ptr + offs, mask=offs < n, other=0.5)
    tl.store(g_ptr + offs, tl_gumbel(u), mask=offs < n)
    tl.store(b_ptr + offs, tl_gumbel_upper_bound(u, False), mask=offs < n)


def test_gumbel_upper_bound():
    """tl_gumbel_upper_bound(u) >= the race's Gumbel value, over the whole range of uniforms."""
    m = torch.cat([torch.arange(0, 4096), torch.arange(2**23 - 4096, 2**23),
                   torch.randint(0, 2**23, (8192,))]).to(torch.float64)
    u = ((m + 0.5) * 2.0**-23).float()  # every value the RNG can produce lies in this grid
    g, bound = torch.empty_like(u), torch.empty_like(u)
    _gumbel_bound_kernel[(triton.cdiv(u.numel(), 1024),)](u, g, bound, u.numel(), BLOCK=1024)
    torch.testing.assert_close(g, -torch.log(-torch.log(u)))
    assert bool((bound >= g).all()) and float((bound - g).min()) > 5e-4


def test_triton_out_buffers_and_vocab_of_one():
    args = make_inputs(3, 2, 1, gen=torch.Generator().manual_seed(1), temps=[0.0, 1.0, 2.0])
    out = (torch.empty(3, 3, dtype=torch.int64), torch.empty(3, dtype=torch.int32), torch.empty(3, 3))
    got = rejection_sample_triton(**args, out=out, config=forced(args, block_v=16, race_block_v=16))
    assert got.token_ids is out[0] and got.num_emitted is out[1] and got.logprobs is out[2]
    ref = rejection_sample_reference(**args)
    assert torch.equal(out[0], ref.token_ids) and torch.equal(out[1], ref.num_emitted)
    assert (out[1] == 3).all()  # V = 1: every draft is the only token


# --- batch invariance, inputs untouched, validation ----------------------------------------------


def test_seeded_request_independent_of_batch_and_slot():
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    one = make_inputs(1, 3, 30, gen=gen, temps=[0.9])
    expected = rejection_sample_reference(**one)
    for b, slot in [(5, 0), (5, 3), (9, 8)]:
        batch = make_inputs(b, 3, 30, gen=gen, temps=[0.0, 1.2])
        for key in ("target_logits", "draft_token_ids", "temperature", "seed", "position"):
            batch[key][slot] = one[key][0]
        for fn in (rejection_sample_reference,
                   lambda **a: rejection_sample_triton(**a, config=forced(a, block_v=16, race_block_v=16,
                                                                          num_splits=1))):
            res = fn(**batch)
            assert torch.equal(res.token_ids[slot], expected.token_ids[0]), f"seed {seed}"
            assert res.num_emitted[slot] == expected.num_emitted[0]


def test_validation_errors():
    args = make_inputs(2, 3, 10, gen=torch.Generator().manual_seed(0), temps=[1.0])
    bad = [
        (dict(target_logits=args["target_logits"][0]), "target_logits"),
        (dict(draft_token_ids=args["draft_token_ids"][:, :2]), "draft_token_ids"),
        (dict(draft_token_ids=args["draft_token_ids"].float()), "draft_token_ids"),
        (dict(temperature=torch.tensor([1.0, -0.5])), "temperature"),
        (dict(temperature=torch.ones(3)), "temperature"),
        (dict(seed=torch.zeros(2, dtype=torch.int32)), "seed"),
        (dict(position=torch.zeros(3, dtype=torch.int64)), "position"),
        (dict(num_draft_tokens=torch.tensor([4, 0])), "num_draft_tokens"),
        (dict(draft_logits=torch.randn(2, 2, 10)), "draft_logits"),
        (dict(acceptance_counts=torch.zeros(4, dtype=torch.int64)), "acceptance_counts"),
    ]
    for override, name in bad:
        with pytest.raises(ValueError, match=name):
            rejection_sample(**{**args, **override})
        with pytest.raises(ValueError, match=name):
            rejection_sample_triton(**{**args, **override})


# --- the sampling law, per position (reference, vectorized over 1e5 requests) --------------------


def _processed_probs(target, temperature):
    x = target.double() / temperature
    return torch.softmax(x, -1)


@pytest.mark.parametrize("mode", ["onehot", "fullq", "mixed"])
def test_reference_follows_target_distribution(mode):
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    n, k, v = 100_000, 3, 12
    temp = 0.8
    frac_sampled = 0.5 if mode == "mixed" else 1.0
    while True:
        # Peaked rows so that enough one-hot drafts (accepted with probability p(d)) reach position K.
        row_logits = torch.randn(k + 1, v, generator=gen) * 1.5
        row_logits[torch.arange(k + 1), torch.randint(0, v, (k + 1,), generator=gen)] += 4.0
        row_logits[1, 5] = float("-inf")  # p = 0 tokens are never emitted
        q_logits = row_logits[:k] + 0.3 * torch.randn(k, v, generator=gen)
        # The draft proposes a p = 0 token now and then: it must always be rejected.
        q_logits[1, 5] = row_logits[1][torch.isfinite(row_logits[1])].mean()
        q = torch.softmax(q_logits / temp, -1)
        # About 1 draw in 70 leaves under 1000 requests expected to reach position K (seen on CI):
        # such draws are redrawn, so every position gets a chi-square test with some power.
        p_rows, q_rows = _processed_probs(row_logits, temp)[:k], q.double()
        accept = (p_rows * q_rows).sum(-1) if mode != "fullq" else torch.minimum(p_rows, q_rows).sum(-1)
        if n * frac_sampled * float(accept.prod()) >= 3000:
            break
    drafts = torch.stack([torch.multinomial(q[j], n, replacement=True, generator=gen) for j in range(k)], 1)
    temps = torch.full((n,), temp)
    if mode == "mixed":
        temps[::2] = 0.0
    args = dict(target_logits=row_logits.expand(n, k + 1, v), draft_token_ids=drafts, temperature=temps,
                seed=torch.randint(-(2**62), 2**62, (n,), generator=gen, dtype=torch.int64),
                position=torch.randint(0, 2**31, (n,), generator=gen, dtype=torch.int64),
                draft_logits=q_logits.expand(n, k, v) if mode == "fullq" else None)
    res = rejection_sample_reference(**args, race_chunk=4)  # one-hot: a two-level race over 3 chunks
    p = _processed_probs(row_logits, temp)
    sampled = temps > 0
    for j in range(k + 1):
        reached = sampled & (res.num_emitted > j)
        tokens = res.token_ids[reached, j]
        assert tokens.numel() > 1000
        pv = chi2_pvalue(tokens, p[j])
        assert pv > CHI2_ALPHA, f"seed {seed} position {j} p-value {pv}"
    if mode == "mixed":
        greedy = rejection_sample_reference(**{**args, "temperature": torch.zeros(n)}, race_chunk=4)
        assert torch.equal(res.token_ids[~sampled], greedy.token_ids[~sampled])


# --- GPU: real sizes, both computed on the device ------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("v", [32000, 128256, 151936])
@pytest.mark.parametrize("b", [1, 8, 64, 256])
@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("mode", ["greedy", "onehot", "fullq", "mixed"])
def test_triton_matches_reference_gpu(cuda, mode, k, b, v, dtype):
    if mode == "fullq" and (v != 128256 or dtype != torch.bfloat16):
        pytest.skip("full q: one vocab/dtype is enough")
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    temps = {"greedy": [0.0], "onehot": [1.0, 0.7], "fullq": [1.0], "mixed": [0.0, 1.0]}[mode]
    args = make_inputs(b, k, 8, gen=gen, temps=temps)  # small CPU draft of the inputs, then real size
    target = (torch.randn(b, k + 1, v, device=cuda) * 3).to(dtype)
    qlogits = (target[:, :k].float() + torch.randn(b, k, v, device=cuda)).to(dtype)
    drafts = torch.multinomial(torch.softmax(qlogits.float(), -1).reshape(-1, v), 1).reshape(b, k)
    drafts[::3] = target[::3, :k].float().argmax(-1)
    args = {key: (val.to(cuda) if isinstance(val, torch.Tensor) else val) for key, val in args.items()}
    args.update(target_logits=target, draft_token_ids=drafts,
                draft_logits=qlogits if mode == "fullq" else None)
    counts_ref = torch.zeros(k, dtype=torch.int64, device=cuda)
    counts_tri = counts_ref.clone()
    ref = rejection_sample_reference(**args, acceptance_counts=counts_ref)
    got = rejection_sample(**args, acceptance_counts=counts_tri)
    msg = f"seed {seed}"
    assert_same_result(got, ref, msg, tol=1e-4, counts=(counts_tri, counts_ref))


@pytest.mark.gpu
def test_triton_int64_offsets_gpu(cuda):
    b, k, v = 4200, 3, 128256  # B*(K+1)*V > 2**31 entries: ~4.3 GB of bf16
    need = b * (k + 1) * v * 2 * 1.3
    if torch.cuda.mem_get_info()[0] < need:
        pytest.skip("not enough GPU memory")
    target = torch.randn(b, k + 1, v, device=cuda, dtype=torch.bfloat16)
    drafts = target[:, :k].argmax(-1)
    drafts[-1] = target[-1, :k].float().argmax(-1)
    target[-1, -1, v - 1] = 100.0  # the bonus token of the last request, past 2**31 entries
    temps = torch.zeros(b, device=cuda)
    temps[: b // 2] = 1.0
    args = dict(target_logits=target, draft_token_ids=drafts, temperature=temps,
                seed=torch.arange(b, device=cuda), position=torch.arange(b, device=cuda))
    got = rejection_sample(**args)
    assert int(got.token_ids[-1, -1]) == v - 1
    ref = rejection_sample_reference(**args)
    assert torch.equal(got.token_ids, ref.token_ids)
    assert torch.equal(got.num_emitted, ref.num_emitted)
