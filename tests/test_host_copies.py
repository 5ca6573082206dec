"""What the host moves per cycle (graphrt/packed.py, Runtime._launch): the batch inputs and the
results as one packed buffer each, the inputs only when the batch changed, and no cycle launched
that could only ride along after every request has ended. `target` and `draft`: tests/conftest.py."""

import pytest
import torch

from graphrt import Runtime, SamplingParams
from graphrt.packed import packed


def test_packed_views_are_disjoint_aligned_and_copy_as_twins():
    specs = [((3, 4), torch.int64), ((3,), torch.int32), ((3, 4), torch.float32), ((1,), torch.int8)]
    buf, views = packed(specs, "cpu")
    assert [tuple(v.shape) for v in views] == [s for s, _ in specs]
    assert [v.dtype for v in views] == [d for _, d in specs]
    spans = sorted((v.data_ptr(), v.data_ptr() + v.numel() * v.element_size()) for v in views)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), "views overlap"
    assert all((v.data_ptr() - buf.data_ptr()) % 16 == 0 for v in views)
    assert spans[-1][1] <= buf.data_ptr() + buf.numel()
    twin, tv = packed(specs, "cpu")
    views[0].copy_(torch.arange(12).view(3, 4))
    views[1].copy_(torch.tensor([7, -8, 9], dtype=torch.int32))
    views[2].copy_(torch.full((3, 4), 0.25))
    twin.copy_(buf)  # one copy of the whole buffer lands every view on its counterpart
    for a, b in zip(views, tv):
        assert torch.equal(a, b)


@pytest.mark.parametrize("use_draft", [False, True])
def test_no_ride_along_cycle_after_the_last_request_ends(target, draft, use_draft):
    # On CPU nothing is asynchronous, so overlap is off by default; turned on, the pipelined path
    # runs the same bookkeeping as on CUDA.
    sp = SamplingParams(max_new_tokens=6, ignore_eos=True)
    want = Runtime(target, draft if use_draft else None, max_batch_size=2, max_seq_len=64).generate([[3, 4, 5]], sp)
    rt = Runtime(target, draft if use_draft else None, max_batch_size=2, max_seq_len=64)
    rt.overlap = True
    got = rt.generate([[3, 4, 5]], sp)
    assert got[0].token_ids == want[0].token_ids
    # Every cycle of the run produced tokens for the request: none was launched only to be dropped.
    assert rt.num_cycles == got[0].num_cycles
    if not use_draft:
        assert rt.num_cycles == sp.max_new_tokens - 1  # the first token comes from prefill


def test_inputs_are_copied_only_when_the_batch_changes(target, draft):
    rt = Runtime(target, draft, max_batch_size=4, max_seq_len=64)
    rt.overlap = True
    copies = []
    original = rt.state.inputs.copy_
    rt.state.inputs.copy_ = lambda src, **kw: (copies.append(rt.num_cycles), original(src, **kw))[1]
    a = rt.add_request([3, 4, 5], SamplingParams(max_new_tokens=12, ignore_eos=True))
    while rt.get_generation(a).num_cycles < 3:
        rt.step()
    n_steady = len(copies)
    assert n_steady == 1, copies  # three cycles, one batch: one copy
    # A second request joins the batch: the next cycle must copy again, and its tokens must be the
    # ones it gets alone.
    b = rt.add_request([9, 8, 7, 6], SamplingParams(max_new_tokens=5, ignore_eos=True))
    while rt.has_unfinished():
        rt.step()
    assert len(copies) > n_steady
    alone = Runtime(target, draft, max_batch_size=4, max_seq_len=64).generate(
        [[9, 8, 7, 6]], SamplingParams(max_new_tokens=5, ignore_eos=True))[0]
    assert rt.get_generation(b).token_ids == alone.token_ids


def test_a_prefill_between_cycles_is_read_after_the_next_launch(target, draft):
    """Pipelined (as on CUDA), a request admitted into a slot a cycle's results just freed is
    prefilled at once, but its first token is read only once the next step has launched the cycle
    after it: that step returns it, before any token of that cycle. A request that ends on its first
    token, and one aborted before its first token was read, leave nothing running; every request
    decodes as without the pipeline."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 500, (n,), generator=g).tolist() for n in (4, 6, 3, 5, 7)]
    budgets = (3, 9, 1, 6, 8)
    params = [SamplingParams(max_new_tokens=m, ignore_eos=True) for m in budgets]
    want = Runtime(target, draft, max_batch_size=2, max_seq_len=64).generate(prompts, params)
    rt = Runtime(target, draft, max_batch_size=2, max_seq_len=64)
    rt.overlap = True
    rids = [rt.add_request(p, sp) for p, sp in zip(prompts, params)]
    seen = {r: [] for r in rids}
    deferred = set()
    aborted = None
    while rt.has_unfinished():
        pending = {req.rid for reqs, *_ in rt._admitted for req in reqs}
        if aborted is None and rids[4] in pending:
            aborted = rids[4]
            assert rt.abort(aborted) and rt.get_generation(aborted).token_ids == []
        for rid in pending:
            assert rt.get_generation(rid).token_ids == []  # admitted, its first token not read yet
        deferred |= pending
        for rid, toks in rt.step().items():
            seen[rid] += toks
    assert deferred >= set(rids[2:]), deferred  # every request that waited for a slot
    assert aborted == rids[4] and rt.get_generation(aborted).finish_reason == "abort" and seen[aborted] == []
    for rid, w in zip(rids[:4], want):
        assert seen[rid] == rt.get_generation(rid).token_ids == w.token_ids, rid
    st = rt.stats()
    assert (st.running, st.kv_blocks_free) == (0, st.kv_blocks_total)
