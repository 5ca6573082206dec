"""Requests admitted together share one prefill forward (prompts padded to the longest): every
request must decode as it does when prefilled alone."""

import pytest
import torch

from graphrt import Runtime, SamplingParams
from tests.helpers import draft_dir, load, tiny_dir
from tests.seeds import fresh_seed


def _prompts(n, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    lens = [1, 2] + [int(torch.randint(3, 24, (1,), generator=g)) for _ in range(n - 2)]
    return [torch.randint(0, vocab, (n_,), generator=g).tolist() for n_ in lens]


def _params(n, seed):
    kinds = [dict(), dict(temperature=0.8), dict(temperature=1.1, top_k=5), dict(temperature=0.7, top_p=0.8),
             dict(temperature=1.0, min_p=0.2)]
    return [SamplingParams(max_new_tokens=7, seed=seed + i, **kinds[i % len(kinds)]) for i in range(n)]


@pytest.mark.parametrize("draft", [None, "self", "eagle-self", "eagle3"])
def test_batched_prefill_decodes_as_one_at_a_time(draft):
    target = load(tiny_dir())
    dckpt = load(draft_dir(draft)) if draft else None
    seed = fresh_seed()
    prompts = _prompts(6, target.config.vocab_size, seed)
    params = _params(6, seed)
    kw = dict(max_batch_size=8, max_seq_len=160)  # 6 prompts of < 24 tokens fit one forward

    together = Runtime(target, dckpt, **kw)
    calls = []
    prefill = together.cycle.prefill
    together.cycle.prefill = lambda slots, ps: calls.append(len(ps)) or prefill(slots, ps)
    batched = together.generate(prompts, params)
    assert calls == [6], f"prefill calls {calls}: the six requests were not prefilled together"

    alone = Runtime(target, dckpt, **kw)
    rids = []
    for p, sp in zip(prompts, params):  # each prefilled alone, by the step after its arrival
        rids.append(alone.add_request(p, sp))
        alone.step()
    while alone.has_unfinished():
        alone.step()
    single = [alone.pop_generation(r) for r in rids]

    for b, s in zip(batched, single):
        assert b.token_ids == s.token_ids, f"seed {seed}: {b.token_ids} != {s.token_ids}"
        torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(s.logprobs), rtol=1e-4, atol=1e-4)
        assert (b.num_cycles, b.num_accepted_tokens) == (s.num_cycles, s.num_accepted_tokens)


def test_prefill_token_budget_splits_the_forward(monkeypatch):
    import graphrt.runtime as runtime

    monkeypatch.setattr(runtime, "_PREFILL_TOKENS", 40)
    target = load(tiny_dir())
    rt = Runtime(target, None, max_batch_size=8, max_seq_len=64)
    sizes = []
    prefill = rt.cycle.prefill
    rt.cycle.prefill = lambda slots, ps: sizes.append([len(p) for p in ps]) or prefill(slots, ps)
    prompts = [[1] * 10, [2] * 12, [3] * 20, [4] * 5, [5] * 8]
    gens = rt.generate(prompts, SamplingParams(max_new_tokens=3))
    # padded to the longest, a forward holds at most 40 tokens: 2 x 12, then 2 x 20 (3 x 20 > 40)
    assert sizes == [[10, 12], [20, 5], [8]]
    assert all(len(g.token_ids) == 3 for g in gens)


def test_prefill_never_pads_past_max_seq_len():
    """A forward holds at most max_seq_len padded tokens: the activations of one full-length prompt."""
    target = load(tiny_dir())
    rt = Runtime(target, None, max_batch_size=8, max_seq_len=32)
    sizes = []
    prefill = rt.cycle.prefill
    rt.cycle.prefill = lambda slots, ps: sizes.append(len(ps)) or prefill(slots, ps)
    rt.generate([[7] * 12] * 5, SamplingParams(max_new_tokens=2))
    assert sizes == [2, 2, 1]


def test_a_failed_prefill_leaves_the_runtime_usable():
    """A prefill that raises (out of memory, say) puts its requests back at the head of the queue
    with their slots and blocks free; the next step admits them again and they decode as usual."""
    target = load(tiny_dir())
    rt = Runtime(target, load(draft_dir("eagle3")), max_batch_size=4, max_seq_len=64)
    free0, slots0 = rt.allocator.num_free, sorted(rt._free_slots)
    prompts = [[3, 1, 4], [1, 5, 9, 2, 6], [5, 3]]
    sp = SamplingParams(max_new_tokens=6)
    ref = Runtime(target, load(draft_dir("eagle3")), max_batch_size=4, max_seq_len=64).generate(prompts, sp)
    prefill = rt.cycle.prefill
    fail = [True]

    def flaky(slots, ps):
        if fail.pop() if fail else False:
            raise torch.cuda.OutOfMemoryError("simulated")
        return prefill(slots, ps)

    rt.cycle.prefill = flaky
    with pytest.raises(torch.cuda.OutOfMemoryError):
        rt.generate(prompts, sp)
    assert rt.allocator.num_free == free0 and sorted(rt._free_slots) == slots0 and not rt.running_slots()
    assert [r.prompt for r in rt._waiting] == prompts  # still first come, first served
    while rt.has_unfinished():
        rt.step()
    assert [rt.get_generation(r).token_ids for r in range(3)] == [g.token_ids for g in ref]
