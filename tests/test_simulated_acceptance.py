"""kernels/simulated_acceptance.py: reference vs Triton (interpreter), the mean it is set to, its caps."""

from __future__ import annotations

import pytest
import torch
from graphrt.kernels.simulated_acceptance import (
    acceptance_rate_for,
    simulate_acceptance_reference,
    simulate_acceptance_triton,
    simulate_uniforms,
)

from graphrt.errors import OptionError
from tests.seeds import fresh_seed


def _case(B, K, V, gen, *, nan_rows=0, dtype=torch.float32, sliced=False):
    logits = torch.randn(B, K + 1, V, generator=gen).to(dtype)
    logits[:nan_rows] = float("nan")
    # sliced: the drafts as TARGET_VERIFY passes them, the columns 1.. of its [B, K+1] tokens
    drafts = torch.randint(0, V, (B, K + 1), generator=gen)
    drafts = drafts[:, 1:] if sliced else drafts[:, :K].contiguous()
    num_drafts = torch.randint(0, K + 1, (B,), generator=gen)
    seed = torch.randint(-(2**62), 2**62, (B,), generator=gen)
    position = torch.randint(0, 10**6, (B,), generator=gen)
    return logits, drafts, num_drafts, seed, position


def _out(B, K):
    return (torch.zeros(B, K + 1, dtype=torch.int64), torch.zeros(B, dtype=torch.int32),
            torch.zeros(B, K + 1), torch.zeros(K, dtype=torch.int64))


@pytest.mark.parametrize("sliced", [False, True])
@pytest.mark.parametrize("B,K,V,L", [(1, 1, 37, 1.5), (5, 3, 1000, 2.5), (9, 5, 777, 6.0), (4, 3, 64, 1.0)])
def test_triton_equals_reference(B, K, V, L, sliced):
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    args = _case(B, K, V, gen, nan_rows=1, sliced=sliced)
    alpha = torch.tensor([acceptance_rate_for(L, K)])
    snap = [a.clone() for a in args]
    ref = simulate_acceptance_reference(*args, alpha, out=_out(B, K))
    tri = simulate_acceptance_triton(*args, alpha, out=_out(B, K), block_v=128)
    msg = f"seed={seed} B={B} K={K} V={V} L={L} sliced={sliced}"
    for r, t in zip(ref, tri):
        assert torch.equal(r.nan_to_num(-7.0), t.nan_to_num(-7.0)), msg
    for before, after in zip(snap, args):
        assert torch.equal(before.nan_to_num(0.0), after.nan_to_num(0.0)), f"an input was modified; {msg}"
    emitted, num, _, counts = ref
    a = num.long() - 1
    assert bool(((a >= 0) & (a <= args[2])).all()), msg  # never more than the request's drafts + 1
    rows = torch.arange(B)
    assert bool(((emitted[rows, a] >= 0) & (emitted[rows, a] < V)).all()), msg  # NaN rows included
    for b in range(B):
        assert emitted[b, : a[b]].tolist() == args[1][b, : a[b]].tolist(), msg
        assert (emitted[b, a[b] + 1 :] == -1).all(), msg
    assert counts.tolist() == [int((a > j).sum()) for j in range(K)], msg


def test_given_top_tokens_replace_the_logits_argmax():
    """A tensor-parallel rank passes every row's top-1 (its logits are a vocab shard): the token at
    row a is then top[b, a], in both versions, and the counts are the same draws."""
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    B, K, V = 6, 3, 50
    args = _case(B, K, V, gen)
    top = torch.randint(0, 10 * V, (B, K + 1), generator=gen)  # ids no argmax of these logits gives
    alpha = torch.tensor([acceptance_rate_for(2.5, K)])
    plain = simulate_acceptance_reference(*args, alpha, out=_out(B, K))
    ref = simulate_acceptance_reference(*args, alpha, out=_out(B, K), top=top)
    tri = simulate_acceptance_triton(*args, alpha, out=_out(B, K), top=top, block_v=16)
    for r, t in zip(ref, tri):
        assert torch.equal(r.nan_to_num(-7.0), t.nan_to_num(-7.0)), f"seed={seed}"
    assert torch.equal(ref[1], plain[1]) and torch.equal(ref[3], plain[3]), f"seed={seed}"
    a = ref[1].long() - 1
    assert torch.equal(ref[0][torch.arange(B), a], top[torch.arange(B), a]), f"seed={seed}"


@pytest.mark.parametrize("K,L", [(3, 1.0), (3, 2.0), (3, 3.0), (3, 4.0), (5, 3.5)])
def test_mean_length_is_what_was_set(K, L):
    n = 100_000
    gen = torch.Generator().manual_seed(fresh_seed())
    seed = torch.randint(-(2**62), 2**62, (n,), generator=gen)
    position = torch.randint(0, 10**6, (n,), generator=gen)
    alpha = acceptance_rate_for(L, K)
    u = simulate_uniforms(seed, position, K)
    a = (u < alpha).to(torch.int64).cumprod(dim=1).sum(dim=1)
    assert float((a + 1).float().mean()) == pytest.approx(L, rel=0.01)
    assert int(a.max()) <= K


def test_rate_bounds_and_bad_length():
    assert acceptance_rate_for(1.0, 3) == 0.0 and acceptance_rate_for(4.0, 3) == 1.0
    a = acceptance_rate_for(2.5, 3)
    assert 1 + a + a * a + a**3 == pytest.approx(2.5, abs=1e-9)
    for bad in (0.5, 4.5):
        with pytest.raises(ValueError, match=r"\[1, K \+ 1\]"):
            acceptance_rate_for(bad, 3)


def _write_tiny_pair(path, dtype):
    """The tiny target at path / "t" and a one-layer EAGLE self-draft of it at path / "d"."""
    from graphrt.checkpoint_writer import self_draft, write_random_checkpoint

    write_random_checkpoint(path / "t", "tiny", dtype=dtype, seed=5)
    self_draft(path / "t", path / "d", 1, kind="eagle")


def _simulating_runtime(path, device, dtype, max_seq_len, L):
    """The tiny target with a one-layer EAGLE self-draft, K = 3, 16 slots, simulating acceptance L."""
    from graphrt import Runtime

    _write_tiny_pair(path, dtype)
    # seeded (the requests' seeds, hence the draws, follow from it): a failure replays with the run's seed
    return Runtime.from_pretrained(path / "t", path / "d", num_draft_tokens=3, device=device, max_batch_size=16,
                                   max_seq_len=max_seq_len, simulate_acceptance_length=L, seed=fresh_seed())


def test_runtime_decodes_at_the_set_acceptance(tmp_path):
    from graphrt import Runtime, SamplingParams

    rt = _simulating_runtime(tmp_path, "cpu", torch.float32, 128, 2.5)
    prompts = torch.randint(3, 500, (16, 5), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(max_new_tokens=64, ignore_eos=True)
    for L in (2.5, 1.0, 4.0):
        rt.set_simulated_acceptance(L)
        before = rt.acceptance_counts
        # L = 2.5 is a mean over draws: 4 rounds (about 1600 cycles) put the 6% bound at about 4.4
        # standard deviations (one round: 0.068 over 40 seeds)
        gens = [g for _ in range(4 if L == 2.5 else 1) for g in rt.generate(prompts, params)]
        counts = [a - b for a, b in zip(rt.acceptance_counts, before)]
        assert all(len(g.token_ids) == 64 for g in gens), L
        assert all(0 <= t < 512 for g in gens for t in g.token_ids), L
        decoded, cycles = sum(len(g.token_ids) - 1 for g in gens), sum(g.num_cycles for g in gens)
        if L == 1.0:
            assert decoded == cycles and counts == [0, 0, 0]
        elif L == 4.0:  # all accepted; only the last cycle of a request may be cut by its budget
            assert cycles == 16 * -(-63 // 4) and counts[0] == cycles
        else:
            # counted from the draws (a last cycle may accept past its request's budget, which the
            # tokens kept would understate, by about 0.05 here)
            assert 1 + sum(counts) / cycles == pytest.approx(2.5, rel=0.06)
            # every accepted draft counted once; a request's last cycle may accept past its budget
            assert decoded - cycles <= sum(counts) <= decoded - cycles + len(gens) * 3
    with pytest.raises(OptionError, match=r"\[1, K \+ 1\]"):
        rt.set_simulated_acceptance(4.5)
    rt.set_simulated_acceptance(1.0)  # the refused value left the runtime as it was
    assert all(g.num_accepted_tokens == 0 for g in rt.generate(prompts[:2], params))
    plain = Runtime.from_pretrained(tmp_path / "t", tmp_path / "d", num_draft_tokens=3, device="cpu")
    with pytest.raises(OptionError, match="without simulate_acceptance_length"):
        plain.set_simulated_acceptance(2.0)


@pytest.mark.gpu
@pytest.mark.parametrize("B,K,V,L", [(1, 3, 32000, 3.0), (64, 3, 49152, 2.0), (8, 5, 128256, 3.5)])
def test_gpu_triton_equals_reference(cuda, B, K, V, L):
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    args = [a.to(cuda) for a in _case(B, K, V, gen, nan_rows=1, dtype=torch.bfloat16)]
    alpha = torch.tensor([acceptance_rate_for(L, K)], device=cuda)
    ref = simulate_acceptance_reference(*args, alpha, out=[o.to(cuda) for o in _out(B, K)])
    tri = simulate_acceptance_triton(*args, alpha, out=[o.to(cuda) for o in _out(B, K)])
    for r, t in zip(ref, tri):
        assert torch.equal(r.nan_to_num(-7.0), t.nan_to_num(-7.0)), f"seed={seed} B={B} K={K} V={V}"


@pytest.mark.gpu
def test_gpu_graphs_decode_at_the_set_acceptance(cuda, tmp_path):
    from graphrt import SamplingParams

    rt = _simulating_runtime(tmp_path, "cuda", torch.bfloat16, 160, 3.0)
    prompts = torch.randint(3, 500, (16, 5), generator=torch.Generator().manual_seed(1)).tolist()
    params = SamplingParams(max_new_tokens=128, ignore_eos=True)
    for L in (3.0, 1.5):
        rt.set_simulated_acceptance(L)
        gens = rt.generate(prompts, params)
        decoded, cycles = sum(len(g.token_ids) - 1 for g in gens), sum(g.num_cycles for g in gens)
        assert decoded / cycles == pytest.approx(L, rel=0.06), L
        assert all(0 <= t < 512 for g in gens for t in g.token_ids), L


@pytest.mark.parametrize("mode", ["simulated", "drafted", "plain"])
def test_runtime_on_the_triton_cycle_kernels_decodes_as_on_the_references(tmp_path, monkeypatch, mode):
    """The cycle's launches as CUDA runs them (kernels/cycle_index.py, this module's kernel, the
    drafts' argmax and the rejection sampler, through the interpreter) against their references,
    in a runtime with several requests a batch: the tensors the cycle hands them (column slices,
    row views of step-major buffers) are the GPU's, which kernel tests with fresh tensors do not
    see. Greedy and seeded sampled requests mixed; simulated acceptance, real acceptance, and plain
    decoding (TARGET_DECODE)."""
    from graphrt.kernels import cycle_index
    from graphrt.kernels.argmax import argmax_triton
    from graphrt.kernels.rejection import rejection_sample_triton

    import graphrt.cycle as cycle
    from graphrt import Runtime, SamplingParams

    _write_tiny_pair(tmp_path, torch.float32)
    prompts = torch.randint(3, 500, (5, 4), generator=torch.Generator().manual_seed(1)).tolist()
    params = [SamplingParams(max_new_tokens=10, ignore_eos=True, temperature=0.0 if i % 2 else 0.9, seed=i)
              for i in range(len(prompts))]
    seed = fresh_seed()

    def run():
        draft = None if mode == "plain" else tmp_path / "d"
        rt = Runtime.from_pretrained(tmp_path / "t", draft, num_draft_tokens=3, device="cpu", max_batch_size=8,
                                     max_seq_len=64, seed=seed,
                                     simulate_acceptance_length=2.5 if mode == "simulated" else None)
        gens = rt.generate(prompts, params)
        return [g.token_ids for g in gens], [g.num_cycles for g in gens], list(rt.acceptance_counts)

    want = run()
    monkeypatch.setattr(cycle, "cycle_inputs", cycle_index.cycle_inputs_triton)
    monkeypatch.setattr(cycle, "advance", cycle_index.advance_triton)
    monkeypatch.setattr(cycle, "simulate_acceptance", simulate_acceptance_triton)
    monkeypatch.setattr(cycle, "argmax", lambda logits, **shard: argmax_triton(logits))
    monkeypatch.setattr(cycle, "rejection_sample", lambda *a, **kw: rejection_sample_triton(*a, **kw))
    assert run() == want, f"seed={seed} mode={mode}"
