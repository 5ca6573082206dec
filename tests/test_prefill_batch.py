"""Requests admitted together share one prefill forward (prompts padded to the longest): every
request must decode as it does when prefilled alone."""

from types import SimpleNamespace

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


def _case(draft, n):
    """(target, draft, seed, n prompts of < 24 tokens, their params, Runtime keywords under which
    they fit one forward)."""
    target = load(tiny_dir())
    seed = fresh_seed()
    return (target, load(draft_dir(draft)) if draft else None, seed, _prompts(n, target.config.vocab_size, seed),
            _params(n, seed), dict(max_batch_size=8, max_seq_len=160))


def _assert_same_decode(got, want, seed):
    for a, b in zip(got, want, strict=True):
        assert a.token_ids == b.token_ids, f"seed {seed}: {a.token_ids} != {b.token_ids}"
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=1e-4, atol=1e-4)
        assert (a.num_cycles, a.num_accepted_tokens) == (b.num_cycles, b.num_accepted_tokens)


@pytest.mark.parametrize("draft", [None, "self", "eagle-self", "eagle3"])
def test_batched_prefill_decodes_as_one_at_a_time(draft):
    target, dckpt, seed, prompts, params, kw = _case(draft, 6)

    together = Runtime(target, dckpt, **kw)
    calls = []
    prefill = together.cycle.prefill
    together.cycle.prefill = lambda slots, ps, *a, **k: calls.append(len(ps)) or prefill(slots, ps, *a, **k)
    batched = together.generate(prompts, params)
    assert calls == [6], f"prefill calls {calls}: the six requests were not prefilled together"

    alone = Runtime(target, dckpt, **kw)
    rids = []
    for p, sp in zip(prompts, params):  # each prefilled alone, by the step after its arrival
        rids.append(alone.add_request(p, sp))
        alone.step()
    while alone.has_unfinished():
        alone.step()
    _assert_same_decode(batched, [alone.pop_generation(r) for r in rids], seed)


@pytest.mark.parametrize("draft", [None, "self", "eagle-self", "eagle3"])
def test_prefill_padded_to_a_graph_shape_decodes_as_unpadded(draft):
    """Under CUDA graphs a prefill runs at its graph's shape: the rows up to a batch bucket (the
    extra ones a one-token prompt on the scratch slot) and the prompts padded to a power of two.
    Eager here, at such shapes: every request decodes as with the exact shape, and the padding rows
    leave the scratch slot as they found it."""
    target, dckpt, seed, prompts, params, kw = _case(draft, 5)
    exact = Runtime(target, dckpt, **kw).generate(prompts, params)

    rt = Runtime(target, dckpt, **kw)
    shapes = []  # the shape each prefill ran at
    # the shape the runtime picks under graphs, but capped at 40 tokens here: not a power of two
    rt._prefill_shape = lambda n, longest: (n + 3 if n < 5 else 8, 40)
    prefill = rt.cycle.prefill
    rt.cycle.prefill = lambda *a: shapes.append(a[5]) or prefill(*a)
    s = rt.state

    def scratch():  # what cycles' padding rows read from the scratch slot
        return [getattr(s, name)[s.scratch_slot].tolist() for name in
                ("num_tokens", "last_token", "block_tables", "temperature", "seed", "top_k", "top_p", "min_p")]

    pinned = scratch()
    padded = rt.generate(prompts, params)
    assert shapes == [(8, 40)]
    assert scratch() == pinned
    _assert_same_decode(padded, exact, seed)
    # and one request alone, padded to 5 rows
    alone = rt.generate(prompts[:1], params[:1])[0]
    assert shapes[-1] == (4, 40) and alone.token_ids == exact[0].token_ids


def test_prefill_attention_is_bounded_by_the_padded_prompt(monkeypatch):
    """A prefill's attention gets the padded prompt length as its static bound on seq_lens (what
    sizes the split-KV grid, so a short prompt runs unsplit, no merge launch), decode phases the
    block table's capacity."""
    import graphrt.models.layers as layers

    seen = []
    real = layers.paged_attention
    monkeypatch.setattr(layers, "paged_attention",
                        lambda *a, **kw: seen.append((kw["query_len"], kw["max_seq_len"])) or real(*a, **kw))
    target, dckpt, seed, prompts, params, kw = _case("eagle3", 3)
    rt = Runtime(target, dckpt, **kw)
    rt._prefill_shape = lambda n, longest: (4, 32)
    rt.generate(prompts, params)
    L = target.config.num_hidden_layers
    assert seen[:L] == [(32, 32)] * L, seen[:L]  # the target over 32 padded positions
    assert seen[L] == (32, 32)  # the EAGLE-3 head over (h_j, t_j+1): as many rows
    cap = rt.cycle.max_seq_len
    assert cap > 32 and {m for q, m in seen[L + 1:]} == {cap}  # the head's drafts and the cycles


def test_prefill_graph_shapes():
    """The graph shape for n prompts of up to `longest` tokens: the batch bucket that holds n, the
    next power of two of at least 16 tokens within the block table, none past 4096 padded tokens."""
    rt = Runtime(load(tiny_dir()), None, max_batch_size=64, max_seq_len=200, use_cuda_graphs=False)
    assert rt._prefill_shape(3, 40) is None  # no graphs
    rt.use_cuda_graphs = True
    cap = rt.cycle.max_seq_len - 1
    assert rt._prefill_shape(1, 1) == (1, 16) and rt._prefill_shape(3, 17) == (4, 32)
    assert rt._prefill_shape(5, 64) == (8, 64) and rt._prefill_shape(20, 33) == (24, 64)
    assert rt._prefill_shape(1, 190) == (1, min(256, cap)) and cap < 256
    assert rt._prefill_shape(64, 64) == (64, 64) and rt._prefill_shape(64, 65) is None  # 64 x 128 > 4096
    # capture(prefill=True) captures every shape a prefill can take, each once
    shapes = rt.prefill_shapes()
    assert len(set(shapes)) == len(shapes) and shapes[0] == (64, 64)
    taken = {rt._prefill_shape(n, longest) for n in range(1, 65) for longest in range(1, cap + 1)} - {None}
    assert taken == set(shapes)


@pytest.mark.parametrize("chunk,prefix_caching", [(None, False), (None, True), (16, False), (24, True)])
def test_prefill_graph_keys_hold_every_prefill_served(chunk, prefix_caching):
    """capture(prefill=True) captures prefill_graph_keys(): every (rows, length, cached) graph that
    serving then asks for is among them, chunks after a prompt's first included; under chunked
    prefill none is longer than a chunk."""
    target = load(tiny_dir())
    rt = Runtime(target, None, max_batch_size=4, max_seq_len=96, prefix_caching=prefix_caching,
                 prefill_chunk_tokens=chunk)
    rt.use_cuda_graphs = True  # graphs asked for, none captured (the CPU runs the padded shape eagerly)
    asked = []
    rt._graphs = lambda: SimpleNamespace(prefill=lambda *key, cached, chunk: asked.append((*key, cached, chunk)))
    g = torch.Generator().manual_seed(fresh_seed())
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (70, 5, 33, 41, 12, 3)]
    prompts.append(prompts[0][:40] + prompts[1])
    rt.generate(prompts, SamplingParams(max_new_tokens=4, ignore_eos=True))
    keys = rt.prefill_graph_keys()
    assert len(set(keys)) == len(keys) and set(asked) <= set(keys), (set(asked) - set(keys), keys)
    assert any(cached for _, _, cached, _ in asked) == (chunk is not None or prefix_caching)
    assert any(chunked for *_, chunked in asked) == (chunk is not None)
    if chunk is not None:
        assert max(length for _, length, _, _ in keys) == (16 if chunk == 16 else 32)
    else:  # a chunk as long as the longest prompt chunks nothing: no graphs of its own (the default, 2048)
        unchunked = Runtime(target, None, max_batch_size=4, max_seq_len=96, prefix_caching=prefix_caching)
        unchunked.use_cuda_graphs = True
        assert unchunked.prefill_chunk_tokens == 2048 and unchunked.prefill_graph_keys() == keys


def test_prefill_token_budget_splits_the_forward(monkeypatch):
    import graphrt.admission as admission

    monkeypatch.setattr(admission, "_PREFILL_TOKENS", 40)
    target = load(tiny_dir())
    rt = Runtime(target, None, max_batch_size=8, max_seq_len=64)
    sizes = []
    prefill = rt.cycle.prefill
    rt.cycle.prefill = lambda slots, ps, *a, **k: sizes.append([len(p) for p in ps]) or prefill(slots, ps, *a, **k)
    prompts = [[1] * 10, [2] * 12, [3] * 20, [4] * 5, [5] * 8]
    gens = rt.generate(prompts, SamplingParams(max_new_tokens=3))
    # padded to the longest, a forward holds at most 40 tokens: 2 x 12, then 2 x 20 (3 x 20 > 40)
    assert sizes == [[10, 12], [20, 5], [8]]
    assert all(len(g.token_ids) == 3 for g in gens)


def test_a_prefill_that_a_graph_holds_does_not_grow_past_it():
    """Under graphs, a batch whose padded shape has a graph stops taking requests where the next one
    would pad it past every graph (an eager forward): it prefills, and the request starts the next
    batch. Each request decodes as with the exact shapes."""
    target, dckpt, seed, _, params, kw = _case(None, 5)
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, target.config.vocab_size, (n,), generator=g).tolist() for n in (10, 12, 14, 30, 5)]
    exact = Runtime(target, dckpt, **kw).generate(prompts, params)
    rt = Runtime(target, dckpt, **kw)

    def shape(n, longest):  # graphs of up to 64 padded tokens
        length = max(16, 1 << (longest - 1).bit_length())
        return (n, length) if n * length <= 64 else None

    rt._prefill_shape = shape
    ran = []
    prefill = rt.cycle.prefill
    rt.cycle.prefill = lambda *a: ran.append(([len(p) for p in a[1]], a[5])) or prefill(*a)
    got = rt.generate(prompts, params)
    # 3 x 16 padded tokens, then 4 x 32 would pass 64: the 30-token prompt starts the next batch
    assert ran == [([10, 12, 14], (3, 16)), ([30, 5], (2, 32))], ran
    _assert_same_decode(got, exact, seed)


def test_prefill_budget_is_max_seq_len_or_the_graph_tokens(monkeypatch):
    """A forward holds at most max(max_seq_len, _PREFILL_GRAPH_TOKENS) padded tokens: one full-length
    prompt's activations, or a prefill graph's largest shape's."""
    import graphrt.admission as admission

    target = load(tiny_dir())
    for graph_tokens, want in ((4096, [5]), (24, [2, 2, 1])):  # 5 x 12 = 60 tokens; then max_seq_len 32 binds
        monkeypatch.setattr(admission, "_PREFILL_GRAPH_TOKENS", graph_tokens)
        rt = Runtime(target, None, max_batch_size=8, max_seq_len=32)
        sizes = []
        prefill = rt.cycle.prefill
        rt.cycle.prefill = lambda slots, ps, *a, sizes=sizes, prefill=prefill, **k: sizes.append(len(ps)) or prefill(
            slots, ps, *a, **k)
        rt.generate([[7] * 12] * 5, SamplingParams(max_new_tokens=2))
        assert sizes == want, graph_tokens


def test_a_failed_prefill_leaves_the_runtime_usable():
    """A prefill that raises (out of memory, say) puts its requests back at the head of the queue
    with their slots and blocks free; the next step admits them again and they decode as usual."""
    target = load(tiny_dir())
    rt = Runtime(target, load(draft_dir("eagle3")), max_batch_size=4, max_seq_len=64)
    free0, slots0 = rt.kv_blocks.num_free, sorted(rt._free_slots)
    prompts = [[3, 1, 4], [1, 5, 9, 2, 6], [5, 3]]
    sp = SamplingParams(max_new_tokens=6)
    ref = Runtime(target, load(draft_dir("eagle3")), max_batch_size=4, max_seq_len=64).generate(prompts, sp)
    prefill = rt.cycle.prefill
    fail = [True]

    def flaky(slots, ps, *a, **k):
        if fail.pop() if fail else False:
            raise torch.cuda.OutOfMemoryError("simulated")
        return prefill(slots, ps, *a, **k)

    rt.cycle.prefill = flaky
    with pytest.raises(torch.cuda.OutOfMemoryError):
        rt.generate(prompts, sp)
    assert rt.kv_blocks.num_free == free0 and sorted(rt._free_slots) == slots0 and not rt.running_slots()
    assert [r.prompt for r in rt._waiting] == prompts  # still first come, first served
    while rt.has_unfinished():
        rt.step()
    assert [rt.get_generation(r).token_ids for r in range(3)] == [g.token_ids for g in ref]


def test_add_request_queues_and_admit_prefills_now():
    """add_request only queues; admit() prefills, in one forward, what a free slot admits (first
    come, first served), and the next step() returns those first tokens once, then the cycle's."""
    rt = Runtime(load(tiny_dir()), None, max_batch_size=2, max_seq_len=64)
    calls = []
    prefill = rt.cycle.prefill
    rt.cycle.prefill = lambda slots, ps, *a, **k: calls.append(len(ps)) or prefill(slots, ps, *a, **k)
    sp = SamplingParams(max_new_tokens=4, ignore_eos=True)
    a, b, c = (rt.add_request(p, sp) for p in ([1, 2, 3], [4, 5], [6]))
    assert not rt.running_slots() and not calls and rt.get_generation(a).token_ids == []
    rt.admit()
    assert calls == [2] and len(rt.running_slots()) == 2
    firsts = {r: list(rt.get_generation(r).token_ids) for r in (a, b)}
    assert all(len(t) == 1 for t in firsts.values()) and rt.get_generation(c).token_ids == []
    out = rt.step()
    assert {r: out[r][:1] for r in (a, b)} == firsts and len(out[a]) >= 2 and c not in out
    rt.admit()  # nothing freed yet: c still waits, no forward
    assert calls == [2]
