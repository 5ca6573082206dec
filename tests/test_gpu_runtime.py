"""The runtime on CUDA with the Triton kernels: same invariants as on the CPU."""

import pytest
import torch

from graphrt import Runtime, SamplingParams
from graphrt.checkpoint import load_checkpoint
from tests.helpers import draft_dir, tiny_dir

pytestmark = pytest.mark.gpu


def _load(path):
    return load_checkpoint(path, dtype=torch.float32, device="cuda")


@pytest.mark.parametrize("kind", ["self", "lm", "eagle", "eagle3"])
def test_greedy_spec_equals_plain_on_cuda(kind):
    target = _load(tiny_dir())
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 512, (int(n),), generator=g).tolist() for n in (3, 11, 7, 19, 5)]
    params = [SamplingParams(max_new_tokens=m, ignore_eos=True) for m in (9, 30, 4, 22, 15)]
    plain = Runtime(target, None, device="cuda", max_batch_size=8, max_seq_len=64).generate(prompts, params)
    for K in (1, 3, 5):
        rt = Runtime(target, _load(draft_dir(kind)), num_draft_tokens=K, device="cuda", max_batch_size=8,
                     max_seq_len=64)
        spec = rt.generate(prompts, params)
        assert [s.token_ids for s in spec] == [p.token_ids for p in plain], (kind, K)


def test_seeded_request_same_on_cuda_and_cpu_batching():
    target = _load(tiny_dir())
    sp = SamplingParams(max_new_tokens=24, temperature=0.9, seed=77, ignore_eos=True)
    rt = Runtime(target, _load(draft_dir("self")), device="cuda", max_batch_size=8, max_seq_len=64)
    alone = rt.generate([[3, 4, 5]], sp)[0].token_ids
    mixed = rt.generate([[9, 9], [3, 4, 5], [1]], [SamplingParams(max_new_tokens=5, temperature=1.0), sp,
                                                    SamplingParams(max_new_tokens=40, ignore_eos=True)])
    assert mixed[1].token_ids == alone


def test_filtered_and_unfiltered_cycles_replay_their_own_graphs():
    # Two sets of graphs: without the filters' kernels, replayed while no request of the batch
    # filters, and with them. The filtered set captured up front serves the first filtered request
    # with no new capture, and cycles go back to the unfiltered set once no request filters. Before,
    # after and across that, results must be those of eager mode: a top_k = 1 request is greedy, a
    # seeded unfiltered one is unchanged.
    target = _load(tiny_dir())
    prompts = [[3, 4, 5], [9, 9, 2, 7]]
    free = SamplingParams(max_new_tokens=20, temperature=1.0, seed=8, ignore_eos=True)
    one = SamplingParams(max_new_tokens=20, temperature=1.3, seed=9, top_k=1, ignore_eos=True)
    nucleus = SamplingParams(max_new_tokens=20, temperature=0.9, seed=10, top_p=0.8, top_k=20, ignore_eos=True)
    got = {}
    for graphs in (False, True):
        rt = Runtime(target, _load(draft_dir("eagle3")), num_draft_tokens=3, device="cuda", max_batch_size=4,
                     max_seq_len=64, use_cuda_graphs=graphs)
        if graphs:
            rt.capture(filters=True, inspect_kernels=False)
            assert rt.cycle.graphs is None and set(rt.graph_sets) == {True}
        before = rt.generate(prompts, free)
        assert not rt.state.filtering and set(rt.graph_sets) == ({False, True} if graphs else set())
        sets = rt.graph_sets
        assert rt.cycle.graphs is sets.get(False)
        mixed = rt.generate(prompts + prompts[:1], [one, nucleus, free])
        after = rt.generate(prompts, free)
        assert not rt.state.filtering and rt.graph_sets == sets and rt.cycle.graphs is sets.get(False)
        got[graphs] = [[r.token_ids for r in rs] for rs in (before, mixed, after)]
        greedy = rt.generate(prompts[:1], SamplingParams(max_new_tokens=20, ignore_eos=True))[0].token_ids
        assert mixed[0].token_ids == greedy
        assert after[0].token_ids == before[0].token_ids and mixed[2].token_ids == before[0].token_ids
    assert got[True] == got[False]


@pytest.mark.parametrize("kind", [None, "eagle3"])
def test_batched_prefill_and_abort_under_graphs(kind):
    """On CUDA (graphs, cycles pipelined): prompts prefilled in one forward decode as when each is
    prefilled alone, and a request aborted while its next cycle is in flight changes nobody's tokens."""
    target = _load(tiny_dir())
    draft = _load(draft_dir(kind)) if kind else None
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 512, (int(n),), generator=g).tolist() for n in (2, 17, 9, 30, 5, 12)]
    params = [SamplingParams(max_new_tokens=20, temperature=0.8 * (i % 2), seed=i, ignore_eos=True) for i in range(6)]
    kw = dict(device="cuda", max_batch_size=8, max_seq_len=96)
    together = Runtime(target, draft, **kw).generate(prompts, params)
    alone = Runtime(target, draft, **kw)
    rids = []
    for p, sp in zip(prompts, params):  # each prefilled alone, by the step after its arrival
        rids.append(alone.add_request(p, sp))
        alone.step()
    assert alone.abort(rids[2])
    while alone.has_unfinished():
        alone.step()
    for i, rid in enumerate(rids):
        gen = alone.pop_generation(rid)
        if i == 2:
            assert gen.finish_reason == "abort" and together[2].token_ids[: len(gen.token_ids)] == gen.token_ids
        else:
            assert gen.token_ids == together[i].token_ids, i


@pytest.mark.parametrize("kind", [None, "self", "eagle", "eagle3"])
def test_prefill_graphs_decode_as_eager_prefill(kind):
    """Under graphs a prefill replays the graph of its padded shape, captured the first time that
    shape comes: requests prefilled together or one at a time decode as in eager mode, greedy,
    sampled and filtered, and each shape is captured once."""
    target = _load(tiny_dir())
    draft = _load(draft_dir(kind)) if kind else None
    g = torch.Generator().manual_seed(13)
    prompts = [torch.randint(0, 512, (int(n),), generator=g).tolist() for n in (1, 2, 17, 9, 30, 5, 40)]
    kinds = [dict(), dict(temperature=0.8), dict(temperature=1.1, top_k=5), dict(temperature=0.7, top_p=0.8)]
    params = [SamplingParams(max_new_tokens=12, seed=i, ignore_eos=True, **kinds[i % 4]) for i in range(7)]
    kw = dict(device="cuda", max_batch_size=8, max_seq_len=96)
    eager = Runtime(target, draft, use_cuda_graphs=False, **kw).generate(prompts, params)
    rt = Runtime(target, draft, prefix_caching=False, **kw)  # (its prompts come again: no cached prefills)
    together = rt.generate(prompts, params)
    assert set(rt.graph_sets[True].prefills) == {(8, 64, False, False)}  # the batch filters: the filtered set's graph
    rids = []
    for p, sp in zip(prompts, params):
        rids.append(rt.add_request(p, sp))
        rt.step()
    alone = []
    while rt.has_unfinished():
        rt.step()
    alone = [rt.pop_generation(r) for r in rids]
    shapes = set(rt.graph_sets[False].prefills) | set(rt.graph_sets[True].prefills)
    assert shapes >= {(1, 16, False, False), (1, 32, False, False), (1, 64, False, False), (8, 64, False, False)}
    assert all(r.length <= 64 for s in rt.graph_sets.values() for r in s.prefills.values())
    for got in (together, alone):
        for a, b in zip(got, eager):
            assert a.token_ids == b.token_ids
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=1e-4, atol=1e-4)


def test_capture_with_prefill_captures_every_prefill_shape_up_front():
    """capture(prefill=True), as a server does before it takes requests: no prefill captures a graph
    afterwards, and the requests decode as in eager mode."""
    target = _load(tiny_dir())
    draft = _load(draft_dir("eagle3"))
    kw = dict(device="cuda", max_batch_size=8, max_seq_len=96)
    rt = Runtime(target, draft, prefix_caching=False, **kw)
    rt.capture(inspect_kernels=False, prefill=True)
    shapes = set(rt.cycle.graphs.prefills)  # without prefix caching, no row starts past 0
    assert shapes == {(*shape, False, False) for shape in rt.prefill_shapes()} and (8, 64, False, False) in shapes
    cached = Runtime(target, draft, **kw)  # (prefix caching, the default)
    cached.capture(inspect_kernels=False, prefill=True)
    assert set(cached.cycle.graphs.prefills) == shapes | {(*shape, True, False) for shape in rt.prefill_shapes()}
    del cached
    g = torch.Generator().manual_seed(17)
    prompts = [torch.randint(0, 512, (int(n),), generator=g).tolist() for n in (3, 70, 12, 33, 1)]
    params = [SamplingParams(max_new_tokens=10, temperature=0.9 * (i % 2), seed=i, ignore_eos=True) for i in range(5)]
    got = rt.generate(prompts, params) + rt.generate(prompts[1:2], params[1:2])
    assert set(rt.cycle.graphs.prefills) == shapes
    eager = Runtime(target, draft, use_cuda_graphs=False, **kw)
    want = eager.generate(prompts, params) + eager.generate(prompts[1:2], params[1:2])
    assert [x.token_ids for x in got] == [x.token_ids for x in want]


@pytest.mark.parametrize("kind", [None, "eagle3"])
def test_prefix_caching_under_graphs_decodes_as_without_it(kind):
    """Prefix caching with the Triton kernels and prefill graphs: requests sharing a system prompt,
    prefilled together (reading a block another row of the same forward writes) and then again
    (reading the cached blocks), decode as the eager runtime without the cache; so does a prompt
    that shares nothing, through the graph of a prefill with no cached prefix."""
    target = _load(tiny_dir())
    draft = _load(draft_dir(kind)) if kind else None
    g = torch.Generator().manual_seed(19)
    system = torch.randint(0, 512, (37,), generator=g).tolist()
    prompts = [system + torch.randint(0, 512, (int(n),), generator=g).tolist() for n in (1, 6, 11, 3)]
    prompts.append(torch.randint(0, 512, (21,), generator=g).tolist())  # alone, first
    params = [SamplingParams(max_new_tokens=10, temperature=0.8 * (i % 2), seed=i, ignore_eos=True)
              for i in range(5)]
    kw = dict(device="cuda", max_batch_size=8, max_seq_len=96)
    eager = Runtime(target, draft, use_cuda_graphs=False, prefix_caching=False, **kw)
    want = eager.generate(prompts[4:], params[4:]) + eager.generate(prompts[:4], params[:4])
    rt = Runtime(target, draft, prefix_caching=True, **kw)
    got = rt.generate(prompts[4:], params[4:]) + rt.generate(prompts[:4], params[:4])
    got += rt.generate(prompts[:4], params[:4])
    assert rt.stats().cached_prompt_tokens == 3 * 32 + 4 * 32
    assert set(rt.cycle.graphs.prefills) == {(1, 32, False, False), (4, 64, True, False), (4, 16, True, False)}
    for a, b in zip(got, want + want[1:]):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind,prefix_caching", [(None, False), ("eagle3", True)])
def test_chunked_prefill_under_graphs_decodes_as_one_eager_prefill(kind, prefix_caching):
    """Chunked prefill with prefill graphs captured up front: a long prompt's later chunks replay
    graphs of a prefill that starts past a cached prefix, while other requests decode; everything
    decodes as the eager runtime that prefills each prompt at once."""
    target = _load(tiny_dir())
    draft = _load(draft_dir(kind)) if kind else None
    g = torch.Generator().manual_seed(23)
    prompts = [torch.randint(0, 512, (int(n),), generator=g).tolist() for n in (5, 70, 12, 41, 33)]
    params = [SamplingParams(max_new_tokens=10, temperature=0.8 * (i % 2), seed=i, ignore_eos=True)
              for i in range(5)]
    kw = dict(device="cuda", max_batch_size=4, max_seq_len=96)
    want = Runtime(target, draft, use_cuda_graphs=False, prefix_caching=False, **kw).generate(prompts, params)
    rt = Runtime(target, draft, prefix_caching=prefix_caching, prefill_chunk_tokens=16, **kw)
    rt.capture(inspect_kernels=False, prefill=True)
    captured = set(rt.cycle.graphs.prefills)
    assert captured == set(rt.prefill_graph_keys()) and {(1, 16, False, True), (1, 16, True, True)} <= captured
    rids = [rt.add_request(prompts[0], params[0])]
    rt.step()
    rids += [rt.add_request(p, sp) for p, sp in zip(prompts[1:], params[1:])]
    while rt.has_unfinished():
        rt.step()
    got = [rt.pop_generation(r) for r in rids]
    assert set(rt.cycle.graphs.prefills) == captured  # none captured while serving
    assert rt.stats().prefills >= 1 + 70 // 16 + 41 // 16 + 33 // 16
    for a, b in zip(got, want, strict=True):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=1e-4, atol=1e-4)
