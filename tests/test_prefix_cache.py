"""Prefix caching (Runtime(prefix_caching=True)): requests whose prompts start alike read the KV
blocks an earlier prefill wrote, and decode exactly as without the cache."""

import pytest
import torch

from graphrt import Runtime, SamplingParams
from graphrt.kv_cache import BlockAllocator
from graphrt.prefix_cache import PrefixCache
from tests.helpers import draft_dir, load, tiny_dir
from tests.seeds import fresh_seed


def _found(cache, prompt):
    return cache.match(cache.keys(prompt))


def test_blocks_are_keyed_by_their_tokens_and_the_next_one():
    cache = PrefixCache(BlockAllocator(9), block_size=4)  # 8 usable blocks
    a = list(range(10))  # two whole blocks with a token after each: 0-3 (4 follows), 4-7 (8 follows)
    blocks = cache.take([], 3)
    cache.remember(cache.keys(a), blocks)
    assert _found(cache, a) == blocks[:2]
    assert _found(cache, a[:9]) == blocks[:2] and _found(cache, a[:8]) == blocks[:1]  # a token must follow
    assert _found(cache, a[:4] + [99] + a[5:]) == [] and _found(cache, a[:8] + [99, 5]) == blocks[:1]
    cache.release(blocks)
    assert cache.num_free == 8  # the cached blocks idle, still counted free
    held = cache.take(_found(cache, a), 6)  # both cached blocks held again, six from the free list
    assert held[:2] == blocks[:2] and cache.num_free == 0
    cache.release(held)
    cache.take([], 7)  # needs one idle cached block: the one released first goes
    assert _found(cache, a) == [] or _found(cache, a) == blocks[:1]
    assert len(_found(cache, a)) <= 1


def test_without_an_eagle_head_a_block_is_keyed_by_its_own_tokens():
    cache = PrefixCache(BlockAllocator(9), block_size=4, next_token=False)
    a = list(range(10))
    blocks = cache.take([], 3)
    cache.remember(cache.keys(a), blocks)
    assert _found(cache, a[:8] + [99]) == blocks[:2]  # another token after the blocks: found all the same
    assert _found(cache, a[:8]) == blocks[:1]  # the prompt's last token is never in a cached block
    assert _found(cache, a[:3] + [99] + a[4:]) == []


def test_idle_blocks_go_oldest_first_and_held_blocks_never():
    cache = PrefixCache(BlockAllocator(5), block_size=2)  # 4 usable blocks
    a, b = [1, 2, 3], [4, 5, 6]
    ba = cache.take([], 1)
    cache.remember(cache.keys(a), ba)
    bb = cache.take([], 1)
    cache.remember(cache.keys(b), bb)
    cache.release(ba)  # a's block idles first
    cache.release(bb)
    held = cache.take(_found(cache, b), 0)  # b's block held again
    assert cache.num_free == 3 and cache.free_after_taking(_found(cache, a)) == 2  # a held would leave 2
    cache.take([], 3)  # two free blocks and one eviction: a's, the only idle one
    assert _found(cache, a) == [] and _found(cache, b) == held


def _case(draft):
    target = load(tiny_dir())
    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    V = target.config.vocab_size
    system = torch.randint(0, V, (37,), generator=g).tolist()  # two whole 16-token blocks and 5 more
    users = [torch.randint(0, V, (int(n),), generator=g).tolist() for n in torch.randint(1, 12, (4,), generator=g)]
    other = (system[32] + 1) % V
    # a token past the blocks; the system prompt alone; the blocks' tokens but another one after them
    prompts = [system + u for u in users] + [system[:33], list(system), system[:32] + [other] + users[0]]
    kinds = [dict(), dict(temperature=0.9), dict(temperature=0.7, top_k=5)]
    params = [SamplingParams(max_new_tokens=9, seed=seed + i, ignore_eos=True, **kinds[i % 3])
              for i in range(len(prompts))]
    return target, load(draft_dir(draft)) if draft else None, seed, prompts, params


def _run(rt, prompts, params):
    """The first request alone, then the rest while it runs: they find its blocks."""
    first = rt.add_request(prompts[0], params[0])
    rt.step()
    rids = [first] + [rt.add_request(p, sp) for p, sp in zip(prompts[1:], params[1:])]
    while rt.has_unfinished():
        rt.step()
    return [rt.pop_generation(r) for r in rids]


@pytest.mark.parametrize("draft", [None, "self", "eagle-self", "eagle3"])
def test_cached_prefixes_decode_as_without_the_cache(draft):
    target, dckpt, seed, prompts, params = _case(draft)
    kw = dict(max_batch_size=4, max_seq_len=80)
    want = _run(Runtime(target, dckpt, prefix_caching=False, **kw), prompts, params)
    rt = Runtime(target, dckpt, prefix_caching=True, **kw)
    got = _run(rt, prompts, params)
    for a, b in zip(got, want, strict=True):
        assert a.token_ids == b.token_ids, f"seed {seed}: {a.token_ids} != {b.token_ids}"
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=1e-4, atol=1e-4)
        assert (a.num_cycles, a.num_accepted_tokens) == (b.num_cycles, b.num_accepted_tokens)
    st = rt.stats()
    # every prompt after the first found the system prompt's two blocks (the 37-token one too: its
    # last token stays out of the cache), the last one too unless the draft is an EAGLE head, whose
    # KV row at position 31 pairs with token 32, which differs there
    eagle = draft in ("eagle-self", "eagle3")
    assert st.cached_prompt_tokens == 32 * (len(prompts) - 2) + (16 if eagle else 32), st
    assert st.prompt_tokens == sum(map(len, prompts)) - st.cached_prompt_tokens
    assert (st.running, st.kv_blocks_free) == (0, st.kv_blocks_total)  # nothing leaked, cached blocks idle


def test_cached_prefixes_at_a_graph_shape_and_through_eviction():
    """The padded prefill of a graph shape with cached prefixes, and a pool small enough that idle
    cached blocks are taken back: the same tokens as without the cache, and no block leaked."""
    target, dckpt, seed, prompts, params = _case("eagle3")
    kw = dict(max_batch_size=2, max_seq_len=80, kv_budget_tokens=2 * 96)
    want = _run(Runtime(target, dckpt, prefix_caching=False, **kw), prompts, params)
    rt = Runtime(target, dckpt, prefix_caching=True, **kw)
    rt._prefill_shape = lambda n, longest: (2, 16 if longest <= 16 else 48)
    got = _run(rt, prompts, params)
    assert [g.token_ids for g in got] == [g.token_ids for g in want], f"seed {seed}"
    others = [[(7 * i + j) % target.config.vocab_size for j in range(40)] for i in range(6)]
    for p in others:  # fills the pool with other prompts' blocks: the system prompt's are evicted
        rt.generate([p], SamplingParams(max_new_tokens=30, ignore_eos=True))
    cached = rt.stats().cached_prompt_tokens
    again = rt.generate([prompts[1]], params[1])[0]
    assert again.token_ids == want[1].token_ids and rt.stats().cached_prompt_tokens == cached  # found nothing
    assert rt.stats().kv_blocks_free == rt.stats().kv_blocks_total


def test_prefix_caching_is_a_bool_option():
    with pytest.raises(ValueError, match="prefix_caching"):
        Runtime(load(tiny_dir()), None, max_batch_size=1, max_seq_len=32, prefix_caching="yes")


def test_aborting_a_request_that_shares_blocks():
    """Aborting the request whose prefill wrote the shared blocks, and one that reads them, leaves
    the others decoding as without the cache, and every block free at the end."""
    target, dckpt, seed, prompts, params = _case("eagle3")
    kw = dict(max_batch_size=4, max_seq_len=80)
    want = _run(Runtime(target, dckpt, prefix_caching=False, **kw), prompts[:4], params[:4])
    rt = Runtime(target, dckpt, prefix_caching=True, **kw)
    first = rt.add_request(prompts[0], params[0])
    rt.step()
    rids = [first] + [rt.add_request(p, sp) for p, sp in zip(prompts[1:4], params[1:4])]
    rt.step()
    assert rt.stats().cached_prompt_tokens == 3 * 32
    assert rt.abort(first) and rt.abort(rids[2])
    while rt.has_unfinished():
        rt.step()
    for i in (1, 3):
        assert rt.get_generation(rids[i]).token_ids == want[i].token_ids, f"seed {seed}"
    st = rt.stats()
    assert st.kv_blocks_free == st.kv_blocks_total
    again = rt.generate([prompts[2]], params[2])[0]  # the blocks stayed cached after their holders went
    assert again.token_ids == want[2].token_ids and rt.stats().cached_prompt_tokens == 4 * 32


@pytest.mark.parametrize("draft", [None])  # (a draft's cycle slack puts the table's last block past any prompt here)
def test_padding_past_the_table_after_a_cached_prefix(draft):
    """A row that starts past a cached prefix and is padded to another row's length (or a graph's)
    runs past the block table: those positions must store nowhere the row reads (the trash block),
    not into its own last block."""
    target, dckpt, seed, _, _ = _case(draft)
    g = torch.Generator().manual_seed(seed)
    V = target.config.vocab_size
    long = torch.randint(0, V, (58,), generator=g).tolist()
    short = torch.randint(0, V, (30,), generator=g).tolist()
    sp = SamplingParams(max_new_tokens=2, ignore_eos=True)
    kw = dict(max_batch_size=2, max_seq_len=60, num_draft_tokens=1)  # the table: 4 blocks of 16

    def run(rt):
        assert rt.cycle.max_seq_len == 64  # the long prompt reaches into the table's last block
        first = rt.generate([long], sp)[0]  # caches its first three blocks
        # the long prompt again (48 tokens cached, 10 to prefill) beside a 30-token one: its row is
        # padded to 32 positions from 48, past the table's 64, which a clamp would fold back onto
        # its positions 48-63 in its own last block
        rt._prefill_shape = lambda n, longest: (2, max(32, longest))
        return [first] + rt.generate([long, short], [sp, sp])

    want = run(Runtime(target, dckpt, prefix_caching=False, **kw))
    rt = Runtime(target, dckpt, prefix_caching=True, **kw)
    got = run(rt)
    assert rt.stats().cached_prompt_tokens == 48
    assert [g.token_ids for g in got] == [g.token_ids for g in want], f"seed {seed}"
    for a, b in zip(got, want):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=1e-4, atol=1e-4)


def _together(rt, prompts, params):
    rids = [rt.add_request(p, sp) for p, sp in zip(prompts, params)]
    while rt.has_unfinished():
        rt.step()
    return [rt.pop_generation(r) for r in rids]


@pytest.mark.parametrize("draft", [None, "self", "eagle-self", "eagle3"])
def test_requests_prefilled_together_share_blocks(draft):
    """Requests admitted in one prefill read the blocks an earlier row of that same forward writes
    (each layer stores every row's KV before any row attends): the same output as without the
    cache, and the shared prefix computed once."""
    target, dckpt, seed, prompts, params = _case(draft)
    kw = dict(max_batch_size=4, max_seq_len=80)
    want = _together(Runtime(target, dckpt, prefix_caching=False, **kw), prompts[:4], params[:4])
    rt = Runtime(target, dckpt, prefix_caching=True, **kw)
    got = _together(rt, prompts[:4], params[:4])
    for a, b in zip(got, want, strict=True):
        assert a.token_ids == b.token_ids, f"seed {seed}: {a.token_ids} != {b.token_ids}"
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=1e-4, atol=1e-4)
    st = rt.stats()
    assert st.prefills == 1 and st.cached_prompt_tokens == 3 * 32, st
    assert st.kv_blocks_free == st.kv_blocks_total


def test_a_failed_prefill_forgets_the_blocks_it_keyed():
    """A prefill that fails (here before its launch) leaves no key to blocks whose KV it never
    wrote: the requests wait again, every block is free, and the retry prefills them in full."""
    target, dckpt, seed, prompts, params = _case(None)
    kw = dict(max_batch_size=4, max_seq_len=80)
    want = _together(Runtime(target, dckpt, prefix_caching=False, **kw), prompts[:3], params[:3])
    rt = Runtime(target, dckpt, prefix_caching=True, **kw)
    rids = [rt.add_request(p, sp) for p, sp in zip(prompts[:3], params[:3])]
    launch = rt._prefill_launch

    def fail(reqs, end=None):
        assert [r.cached for r in reqs] == [0, 32, 32]  # the batch had found the first one's blocks
        raise RuntimeError("injected")

    rt._prefill_launch = fail
    with pytest.raises(RuntimeError, match="injected"):
        rt.step()
    st = rt.stats()
    assert (st.waiting, st.running, st.kv_blocks_free) == (3, 0, st.kv_blocks_total)
    assert rt.kv_blocks.match(rt.kv_blocks.keys(prompts[0])) == []
    rt._prefill_launch = launch
    while rt.has_unfinished():
        rt.step()
    assert [rt.pop_generation(r).token_ids for r in rids] == [w.token_ids for w in want], f"seed {seed}"
    assert rt.stats().cached_prompt_tokens == 2 * 32


def test_prefill_attention_reaches_past_its_padded_length_only_past_a_cached_prefix(monkeypatch):
    """Under prefix caching a prefill whose rows all start at 0 keeps the padded prompt length as
    its attention's bound (a short prompt runs unsplit, no merge launch); one with a cached prefix
    gets the table's capacity, as its keys reach past its padded length. Both decode as without the
    cache."""
    import graphrt.models.layers as layers

    seen = []
    real = layers.paged_attention
    monkeypatch.setattr(layers, "paged_attention", lambda *a, **kw: seen.append(kw["max_seq_len"]) or real(*a, **kw))
    target, _, seed, prompts, params = _case(None)
    kw = dict(max_batch_size=4, max_seq_len=96)
    want = Runtime(target, None, prefix_caching=False, **kw).generate(prompts[:2], params[:2])
    rt = Runtime(target, None, prefix_caching=True, **kw)
    rt._prefill_shape = lambda n, longest: (4, 16 if longest <= 16 else 64)
    bounds = []
    real_forward = rt.cycle.prefill_forward

    def prefill_forward(*args, **kwargs):
        seen.clear()
        out = real_forward(*args, **kwargs)
        bounds.append(seen[: target.config.num_hidden_layers])  # the target's layers
        return out

    rt.cycle.prefill_forward = prefill_forward
    L, cap = target.config.num_hidden_layers, rt.cycle.max_seq_len
    got = rt.generate(prompts[:1], params[:1]) + rt.generate(prompts[1:2], params[1:2])
    assert bounds == [[64] * L, [cap] * L] and cap > 64, f"seed {seed}"  # nothing cached, then 32 tokens
    assert rt.stats().cached_prompt_tokens == 32
    assert [g.token_ids for g in got] == [g.token_ids for g in want], f"seed {seed}"


def test_a_prefill_refuses_a_graph_captured_for_the_other_kind_of_rows():
    """A prefill graph captured for rows that all start at 0 attends to keys up to its padded length
    only: a prefill past a cached prefix must not replay it (nor the reverse), a chunk must not
    replay a graph that draws a first token (nor the reverse), and the refusal leaves the decode
    state unwritten."""
    from types import SimpleNamespace

    rt = Runtime(load(tiny_dir()), None, max_batch_size=2, max_seq_len=64)
    c = rt.cycle
    before = c.s.block_tables.clone()
    sampling = [(0.0, 1, 0, 1.0, 0.0)]
    for starts, graph_cached in (([16], False), ([0], True)):
        with pytest.raises(ValueError, match=f"cached={graph_cached}"):
            c.prefill([0], [[5, 6, 7]], starts, [[1, 2]], sampling, (1, 16),
                      SimpleNamespace(cached=graph_cached, chunk=False))
    # nor does a chunk replay a graph that draws a first token, or a whole prompt one that draws none
    for nexts, graph_chunk in (([9], False), (None, True)):
        with pytest.raises(ValueError, match=f"chunk={graph_chunk}"):
            c.prefill([0], [[5, 6, 7]], [16], [[1, 2]], sampling, (1, 16),
                      SimpleNamespace(cached=True, chunk=graph_chunk), nexts=nexts)
    assert torch.equal(c.s.block_tables, before)
