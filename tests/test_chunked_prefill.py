"""Chunked prefill (Runtime(prefill_chunk_tokens=C)): a prompt longer than C tokens is prefilled C
tokens a call, between decode cycles, and decodes exactly as if prefilled at once."""

import pytest
import torch

from graphrt import Runtime, SamplingParams
from graphrt.errors import OptionError
from tests.helpers import draft_dir, load, tiny_dir
from tests.seeds import fresh_seed


def _case(draft, seed):
    target = load(tiny_dir())
    g = torch.Generator().manual_seed(seed)
    V = target.config.vocab_size
    lens = (70, 5, 33, 41, 12)  # longer than the chunks, shorter, a block boundary past one
    prompts = [torch.randint(0, V, (n,), generator=g).tolist() for n in lens]
    prompts.append(prompts[0][:48] + prompts[1])  # the first one's first three blocks, then another turn
    kinds = [dict(), dict(temperature=0.9), dict(temperature=0.7, top_k=5), dict(temperature=1.1, top_p=0.8)]
    params = [SamplingParams(max_new_tokens=8, seed=seed + i, ignore_eos=True, **kinds[i % 4])
              for i in range(len(prompts))]
    return target, load(draft_dir(draft)) if draft else None, prompts, params


def _serve(rt, prompts, params):
    """The first two requests, two steps, then the rest while they run."""
    rids = [rt.add_request(p, sp) for p, sp in zip(prompts[:2], params[:2])]
    rt.step()
    rt.step()
    rids += [rt.add_request(p, sp) for p, sp in zip(prompts[2:], params[2:])]
    while rt.has_unfinished():
        rt.step()
    return [rt.pop_generation(r) for r in rids]


@pytest.mark.parametrize("draft", [None, "self", "eagle-self", "eagle3"])
@pytest.mark.parametrize("chunk,prefix_caching", [(16, False), (24, True)])
def test_chunked_prefill_decodes_as_one_prefill(draft, chunk, prefix_caching):
    """Chunks of a whole block and of a block and a half, with and without prefix caching: the same
    tokens, logprobs and acceptance as one prefill of each prompt, greedy, sampled and filtered."""
    seed = fresh_seed()
    target, dckpt, prompts, params = _case(draft, seed)
    kw = dict(max_batch_size=4, max_seq_len=96, prefix_caching=prefix_caching)
    want = _serve(Runtime(target, dckpt, **kw), prompts, params)
    rt = Runtime(target, dckpt, prefill_chunk_tokens=chunk, **kw)
    got = _serve(rt, prompts, params)
    for a, b in zip(got, want, strict=True):
        assert a.token_ids == b.token_ids, f"seed {seed}: {a.token_ids} != {b.token_ids}"
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=1e-4, atol=1e-4)
        assert (a.num_cycles, a.num_accepted_tokens) == (b.num_cycles, b.num_accepted_tokens), f"seed {seed}"
    st = rt.stats()
    assert st.prompt_tokens + st.cached_prompt_tokens == sum(map(len, prompts)), st
    assert st.prefills > Runtime(target, dckpt, **kw).stats().prefills + 4  # (70 and 41 tokens took chunks)
    assert (st.running, st.waiting, st.kv_blocks_free) == (0, 0, st.kv_blocks_total), st
    if prefix_caching:  # the last prompt found the first one's blocks, which its chunks had keyed (an
        # EAGLE head's keys hold the token after a block too, which differs after the third)
        assert st.cached_prompt_tokens >= (32 if draft in ("eagle-self", "eagle3") else 48), st


def _prompt_kv(rt, rid, n):
    """Every layer's K and V of the request's first n positions, target then draft: [layers, n, ...]."""
    blocks = torch.tensor(rt._requests[rid].blocks)
    pools = [p for p in (rt.target_kv, rt.draft_kv) if p is not None]
    return [torch.stack([t[blocks].flatten(0, 1)[:n] for t in pool.k + pool.v]) for pool in pools]


@pytest.mark.parametrize("draft", [None, "self", "eagle-self", "eagle3"])
def test_chunks_leave_the_kv_one_prefill_leaves(draft):
    """After the last chunk, the target's and the draft's KV of every prompt position equal one
    prefill's: an EAGLE head's row at a chunk's last position pairs it with the prompt's next token."""
    seed = fresh_seed()
    target, dckpt, prompts, params = _case(draft, seed)
    kv = []
    for chunk in (None, 16, 24):
        rt = Runtime(target, dckpt, max_batch_size=1, max_seq_len=96, prefill_chunk_tokens=chunk)
        rid = rt.add_request(prompts[0], params[0])
        while not rt.running_slots():
            rt.admit()
        kv.append(_prompt_kv(rt, rid, len(prompts[0])))
    for got in kv[1:]:
        for a, b in zip(got, kv[0], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m: f"seed {seed}: {m}")


def test_running_requests_decode_between_chunks():
    """While a long prompt is prefilled a chunk at a time, the running requests go on decoding,
    a token a step at least, and each step launches one chunk; the long request's first token comes
    with its last chunk."""
    target = load(tiny_dir())
    rt = Runtime(target, None, max_batch_size=2, max_seq_len=96, prefill_chunk_tokens=16)
    short = rt.add_request([5, 6, 7], SamplingParams(max_new_tokens=30, ignore_eos=True))
    rt.step()
    long_prompt = [(11 * i) % target.config.vocab_size for i in range(70)]
    long = rt.add_request(long_prompt, SamplingParams(max_new_tokens=4, ignore_eos=True))
    steps, prefills = 0, rt.stats().prefills
    while long not in (out := rt.step()):
        steps += 1
        assert out.get(short), "the running request got no token while the long prompt was prefilled"
        assert rt.stats().waiting == 1 and rt.running_slots() == [rt._requests[short].slot]
        assert rt.stats().prefills == prefills + steps, "a step launched other than one chunk"
    assert steps == 70 // 16 and rt.stats().prefills == prefills + steps + 1
    assert rt.generate([long_prompt], SamplingParams(max_new_tokens=4, ignore_eos=True))[0].token_ids[0] == out[long][0]


def test_requests_behind_a_chunked_prompt_are_admitted_meanwhile():
    """While a long prompt is prefilled a chunk a step, the requests behind it whose prompts need no
    chunks are admitted (in a forward of their own, the same step); a second long prompt waits for
    the first one's last chunk, and the requests behind it wait for it (first come, first served).
    Everything decodes as without chunks."""
    target = load(tiny_dir())
    V = target.config.vocab_size
    g = torch.Generator().manual_seed(fresh_seed())
    lens = (70, 5, 9, 40, 3)  # long, short, short, long, short
    prompts = [torch.randint(0, V, (n,), generator=g).tolist() for n in lens]
    sp = SamplingParams(max_new_tokens=12, ignore_eos=True)
    kw = dict(max_batch_size=6, max_seq_len=96)
    want = Runtime(target, None, prefill_chunk_tokens=None, **kw).generate(prompts, sp)
    rt = Runtime(target, None, prefill_chunk_tokens=16, **kw)
    rids = [rt.add_request(p, sp) for p in prompts]
    first = {}
    for step in range(1, 40):
        for rid, toks in rt.step().items():
            if toks:
                first.setdefault(rid, step)
        if step == 1:  # the first long prompt's first chunk, the two short ones behind it prefilled
            assert sorted(rt._requests[r].slot >= 0 for r in rids) == [False, False, True, True, True]
            assert [r.rid for r in rt._waiting] == [rids[0], rids[3], rids[4]] and rt._waiting[0].done == 16
        if not rt.has_unfinished():
            break
    assert first[rids[1]] == first[rids[2]] == 1 and first[rids[0]] == 70 // 16 + 1  # 5 chunks
    # the second long prompt starts once the first is prefilled, and the short one behind it with it
    assert first[rids[4]] == first[rids[0]] + 1 and first[rids[3]] == first[rids[0]] + 40 // 16 + 1
    assert [rt.pop_generation(r).token_ids for r in rids] == [w.token_ids for w in want]


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_abort_part_way_through_a_chunked_prefill(prefix_caching):
    """Aborting a request between its chunks gives its slot and blocks back; the next request takes
    the slot and decodes as without chunks. Under prefix caching the blocks its launched chunks
    wrote stay found."""
    target = load(tiny_dir())
    kw = dict(max_batch_size=1, max_seq_len=96, prefix_caching=prefix_caching)
    rt = Runtime(target, None, prefill_chunk_tokens=16, **kw)
    prompt = [(7 * i + 3) % target.config.vocab_size for i in range(70)]
    sp = SamplingParams(max_new_tokens=6, temperature=0.8, seed=3, ignore_eos=True)
    rid = rt.add_request(prompt, sp)
    nxt = rt.add_request(prompt[:40] + [9, 9], sp)
    rt.step()
    rt.step()  # two chunks or more launched, none the last
    assert rt.stats().free_slots == 0 and not rt.running_slots()
    assert rt.abort(rid) and rt.get_generation(rid).token_ids == []
    assert rt.stats().free_slots == 1 and rt.stats().kv_blocks_free == rt.stats().kv_blocks_total
    while not rt.finished(nxt):
        rt.step()
    want = Runtime(target, None, **{**kw, "prefix_caching": False}).generate([prompt[:40] + [9, 9]], sp)[0]
    assert rt.pop_generation(nxt).token_ids == want.token_ids
    assert rt.stats().cached_prompt_tokens == (32 if prefix_caching else 0)


def test_a_chunk_that_fails_starts_the_request_over():
    """A chunk's launch that raises (out of memory, say) frees the request's slot and blocks and
    leaves it first in the queue; the next step prefills it from the start, and it decodes as if
    nothing had happened."""
    target = load(tiny_dir())
    kw = dict(max_batch_size=2, max_seq_len=96)
    prompt = [(5 * i + 1) % target.config.vocab_size for i in range(60)]
    sp = SamplingParams(max_new_tokens=5, temperature=0.9, seed=11, ignore_eos=True)
    want = Runtime(target, None, **kw).generate([prompt], sp)[0]
    rt = Runtime(target, None, prefill_chunk_tokens=16, **kw)
    rid = rt.add_request(prompt, sp)
    rt.step()  # the first chunk
    real, calls = rt.cycle.prefill, []

    def failing(*a, **k):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("out of memory (injected)")
        return real(*a, **k)

    rt.cycle.prefill = failing
    with pytest.raises(RuntimeError, match="injected"):
        rt.step()
    st = rt.stats()
    assert (st.waiting, st.free_slots, st.kv_blocks_free) == (1, 2, st.kv_blocks_total)
    while not rt.finished(rid):
        rt.step()
    assert rt.pop_generation(rid).token_ids == want.token_ids


@pytest.mark.parametrize("bad", [0, -16, 2.5, True, "16"])
def test_prefill_chunk_tokens_must_be_a_positive_int(bad):
    with pytest.raises(OptionError, match="prefill_chunk_tokens"):
        Runtime(load(tiny_dir()), None, max_batch_size=1, max_seq_len=32, prefill_chunk_tokens=bad)


def test_chunked_prefill_bench_runs_on_the_cpu(tmp_path):
    """scripts/chunked_prefill_bench.py end to end on the CPU (its timings mean nothing here): the
    long prompt's first token takes one step without chunks and one a chunk with them; the short
    requests that arrive after it (--short) have theirs at the first step either way."""
    import json

    from tests.helpers import load_script

    out = tmp_path / "cp.json"
    mod = load_script("chunked_prefill_bench")
    assert mod.main(["--out", str(out), "--preset", "tiny", "--running", "2", "--long", "100", "--chunks", "0,32",
                     "--rounds", "1", "--device", "cpu", "--short", "2"]) == 0
    runs = json.loads(out.read_text())["runs"]
    assert runs["0"][0]["steps_to_first_token"] == 1 and runs["32"][0]["steps_to_first_token"] == 4
    assert runs["0"][0]["short_steps"] == runs["32"][0]["short_steps"] == [1, 1]  # (32 tokens: no chunks)
    for res in runs["0"] + runs["32"]:
        assert 0 < res["before_mean_ms"] and 0 < res["during_mean_ms"] <= res["during_worst_ms"] <= res["ttft_ms"]


def test_a_step_does_not_wait_for_a_last_chunk_after_the_cycle_it_reads():
    """Under pipelined cycles (CUDA) a step reads the cycle launched before it while the one it
    launched runs. It waits for every prefill whose first token it has not read, but for a chunked
    prompt's last chunk that the cycle it reads does not hold (that wait would add a second chunk to
    the step): such a chunk's first token comes with the next step, whether or not the chunk has
    run (every rank of a tensor-parallel runtime emits it at the same step), in launch order."""
    from types import SimpleNamespace

    class Event:
        def __init__(self, ran):
            self.ran, self.waited = ran, False

        def synchronize(self):
            self.waited = self.ran = True

    rt = Runtime(load(tiny_dir()), None, max_batch_size=4, max_seq_len=64)
    emitted = []
    rt._emit = lambda req, toks, lps: emitted.append((req.rid, toks[0]))
    reqs = [SimpleNamespace(rid=i, gen=SimpleNamespace(finish_reason=None)) for i in range(6)]

    def launched(kinds):  # (ran, last chunk) per prefill, request i's first token 10 + i
        events = [Event(ran) for ran, _ in kinds]
        rt._admitted = [([r], torch.tensor([10 + r.rid]), torch.zeros(1), e, last)
                        for r, e, (_, last) in zip(reqs, events, kinds)]
        emitted.clear()
        return events

    # the cycle read holds request 0; 1 is a whole prompt; 2 and 3 last chunks, 3 has run
    events = launched([(False, False), (False, False), (False, True), (True, True)])
    rt._first_tokens([reqs[0]])
    assert emitted == [(0, 10), (1, 11)] and events[1].waited and not events[2].waited
    assert [a[0][0].rid for a in rt._admitted] == [2, 3]
    rt._first_tokens([reqs[0], reqs[3]])  # the next step's cycle holds 3: 2 and 3 come, in order
    assert emitted[2:] == [(2, 12), (3, 13)] and not rt._admitted and events[3].waited
    # a whole prompt's prefill after a last chunk: both waited for, in order
    events = launched([(False, True), (False, False)])
    rt._first_tokens([reqs[5]])
    assert emitted == [(0, 10), (1, 11)] and events[1].waited and not rt._admitted
    # a last chunk that the cycle read holds (it was launched before it): waited for
    events = launched([(False, True)])
    rt._first_tokens([reqs[0]])
    assert emitted == [(0, 10)] and events[0].waited
    events = launched([(False, True)])
    rt._first_tokens()  # admit(): waits for every prefill
    assert emitted == [(0, 10)] and events[0].waited and not rt._admitted
