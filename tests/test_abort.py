"""Runtime.abort: a request stopped while it waits or runs frees what it held, and nobody else's
tokens change."""

import pytest

from graphrt import Runtime, SamplingParams
from graphrt.errors import UnknownRequestError
from tests.helpers import draft_dir, load, random_prompts, tiny_dir
from tests.seeds import fresh_seed


@pytest.mark.parametrize("draft,overlap", [(None, False), ("eagle-self", False), ("eagle-self", True)])
def test_abort_frees_the_slot_and_leaves_the_others_alone(draft, overlap):
    target = load(tiny_dir())
    dckpt = load(draft_dir(draft)) if draft else None
    seed = fresh_seed()
    prompts = random_prompts(5, target.config.vocab_size, seed, hi=16)
    # no EOS and 20 tokens: request 1 is still running after three cycles (at most 1 + 3 x 4 tokens)
    sp = [SamplingParams(max_new_tokens=20, temperature=0.9 * (i % 2), seed=seed + i, ignore_eos=True)
          for i in range(5)]
    kw = dict(max_batch_size=3, max_seq_len=48)
    ref = Runtime(target, dckpt, **kw).generate([prompts[i] for i in (0, 2, 3, 4)], [sp[i] for i in (0, 2, 3, 4)])

    rt = Runtime(target, dckpt, **kw)
    rt.overlap = overlap  # on the CPU nothing is asynchronous; on, the cycle after is launched first
    free0 = rt.kv_blocks.num_free
    rids = [rt.add_request(p, s) for p, s in zip(prompts, sp)]
    assert not rt.running_slots()  # queued: the next step prefills
    rt.step()  # 3 run, 2 wait
    assert len(rt.running_slots()) == 3
    waiting = rids[4]
    assert rt.abort(waiting) and rt.finished(waiting)
    assert rt.get_generation(waiting).finish_reason == "abort" and rt.get_generation(waiting).token_ids == []
    for _ in range(2):
        rt.step()
    running = rids[1]
    before = list(rt.get_generation(running).token_ids)
    assert rt.abort(running)
    assert rt.get_generation(running).finish_reason == "abort"
    assert len(rt.running_slots()) == 2 and not rt.get_generation(rids[3]).token_ids
    rt.step()
    assert rt.get_generation(rids[3]).token_ids  # the next step admitted the waiting request into the freed slot
    while rt.has_unfinished():
        out = rt.step()
        assert running not in out and waiting not in out
    assert rt.get_generation(running).token_ids == before  # a cycle in flight for it adds nothing
    assert not rt.abort(running)  # finished: nothing to do
    got = [rt.pop_generation(rids[i]) for i in (0, 2, 3)]
    assert [g.token_ids for g in got] == [g.token_ids for g in ref[:3]]
    rt.pop_generation(running), rt.pop_generation(waiting)
    with pytest.raises(UnknownRequestError, match=str(running)):
        rt.abort(running)
    assert rt.kv_blocks.num_free == free0 and not rt.running_slots()
    # the runtime stays usable: a new request decodes as on a fresh runtime
    again = rt.generate([prompts[4]], [sp[4]])
    assert again[0].token_ids == ref[3].token_ids
