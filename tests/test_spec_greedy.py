"""Greedy speculative decoding must equal plain greedy decoding of the target, token for token."""

import pytest
import torch

from graphrt import Runtime, SamplingParams
from tests.helpers import draft_dir, load, random_prompts, tiny_dir


@pytest.fixture(scope="module")
def plain_outputs():
    target = load(tiny_dir())
    rt = Runtime(target, None, max_batch_size=8, max_seq_len=96)
    prompts = random_prompts(7, target.config.vocab_size, seed=11)
    # different lengths so requests finish at different cycles
    params = [SamplingParams(max_new_tokens=m, ignore_eos=True) for m in (5, 17, 9, 30, 1, 23, 12)]
    gens = rt.generate(prompts, params)
    return target, prompts, params, [g.token_ids for g in gens]


@pytest.mark.parametrize("kind", ["self", "eagle-self", "lm", "eagle", "eagle3"])
@pytest.mark.parametrize("K", [1, 3, 5])
def test_greedy_spec_equals_plain(plain_outputs, kind, K):
    target, prompts, params, expected = plain_outputs
    draft = load(draft_dir(kind))
    # max_batch_size 8 with buckets (1, 2, 4, 8): 7 requests pad to 8, then shrink as they finish
    rt = Runtime(target, draft, num_draft_tokens=K, max_batch_size=8, max_seq_len=96, buckets=(1, 2, 4, 8))
    gens = rt.generate(prompts, params)
    for i, g in enumerate(gens):
        assert g.token_ids == expected[i], f"request {i} ({kind}, K={K})"
        assert len(g.token_ids) == params[i].max_new_tokens
    if kind in ("self", "eagle-self"):  # accepted drafts, or the accepted path is untested
        assert sum(g.num_accepted_tokens for g in gens) > 0
    # (the accepting EAGLE-3 head is a trained one: tests/test_eagle3_training.py)


@pytest.mark.parametrize("kind", ["self", "eagle-self", "eagle3"])
def test_greedy_spec_with_an_fp8_draft_equals_plain(plain_outputs, kind):
    """An FP8 draft (graphrt.models.quantize_draft) drafts from other weights, never other output;
    the self-drafts still accept, so the accepted path runs with it."""
    from graphrt.kernels.fp8_weight import Fp8Weight

    target, prompts, params, expected = plain_outputs
    draft = load(draft_dir(kind))
    before = {n: w.clone() for n, w in draft.weights.items()}
    rt = Runtime(target, draft, num_draft_tokens=3, max_batch_size=8, max_seq_len=96, buckets=(1, 2, 4, 8),
                 draft_quantization="fp8")
    layer = rt.draft.layers[0]
    assert all(isinstance(w, Fp8Weight) for w in (layer.attn.qkv_weight, layer.attn.o_weight, layer.mlp.gate_up,
                                                   layer.mlp.down))
    assert all(torch.equal(before[n], w) for n, w in draft.weights.items()), "the checkpoint was modified"
    gens = rt.generate(prompts, params)
    assert [g.token_ids for g in gens] == expected
    if kind != "eagle3":
        assert sum(g.num_accepted_tokens for g in gens) > 0


def _proposals(rt, prompt):
    rid = rt.add_request(prompt, SamplingParams(max_new_tokens=20, ignore_eos=True))
    seen = []
    while not rt.finished(rid):
        rt.step()
        seen.append(rt.state.draft_tokens[:-1].tolist())
    return rt.pop_generation(rid).token_ids, seen


@pytest.mark.parametrize("kind,quantization", [("eagle3", None), ("eagle3", "fp8"), ("eagle", None)])
def test_extend_on_the_last_rows_drafts_what_the_whole_block_does(plain_outputs, kind, quantization, monkeypatch):
    """A one-layer EAGLE head's DRAFT_EXTEND stores every row's KV, then attends and projects the
    last emitted row of each request only (extends_last_rows): the same drafts, step by step, and
    the same tokens as running the layer over all K + 1 rows and gathering (fp32). Simulated
    acceptance moves the last emitted row around the block."""
    from graphrt.models.eagle import Eagle3Head, EagleHead

    target, prompts = plain_outputs[:2]
    draft = load(draft_dir(kind))
    runs = []
    for whole in (False, True):
        if whole:
            for cls in (Eagle3Head, EagleHead):
                monkeypatch.setattr(cls, "extends_last_rows", property(lambda self: False))
        rt = Runtime(target, draft, num_draft_tokens=3, max_batch_size=2, max_seq_len=96, seed=5,
                     simulate_acceptance_length=2.5, draft_quantization=quantization)
        assert rt.draft.extends_last_rows is not whole
        runs.append([_proposals(rt, p) for p in prompts[:3]])
    assert runs[0] == runs[1]
    assert len({len(step) for _, steps in runs[0] for step in steps}) == 1  # one draft row per step


def test_draft_quantization_is_checked(plain_outputs):
    target = plain_outputs[0]
    with pytest.raises(ValueError, match="draft_quantization takes one of"):
        Runtime(target, load(draft_dir("lm")), max_batch_size=2, max_seq_len=64, draft_quantization="int4")
    with pytest.raises(ValueError, match="without a draft"):
        Runtime(target, None, max_batch_size=2, max_seq_len=64, draft_quantization="fp8")


def test_batch_larger_than_slots_is_queued(plain_outputs):
    target, prompts, params, expected = plain_outputs
    rt = Runtime(target, load(draft_dir("self")), num_draft_tokens=3, max_batch_size=2, max_seq_len=96)
    gens = rt.generate(prompts, params)
    assert [g.token_ids for g in gens] == expected


def test_step_interface(plain_outputs):
    """step() returns every token once, in order: the first ones too, whether the request was
    prefilled by the first step() or, having waited for a slot, by a later one."""
    target, prompts, params, expected = plain_outputs
    rt = Runtime(target, load(draft_dir("eagle")), num_draft_tokens=2, max_batch_size=2, max_seq_len=96)
    rids = [rt.add_request(p, sp) for p, sp in zip(prompts[:4], params[:4])]  # two of them wait
    seen = {r: [] for r in rids}
    while rt.has_unfinished():
        for rid, toks in rt.step().items():
            seen[rid].extend(toks)
    for i, r in enumerate(rids):
        assert rt.finished(r)
        assert seen[r] == expected[i]
