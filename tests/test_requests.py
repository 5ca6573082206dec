"""Request handling: seeded reproducibility, bad input, stop conditions, slot reuse."""

import copy

import pytest
import torch

from graphrt import Runtime, SamplingParams
from graphrt.errors import (
    CapacityError,
    ConfigMismatchError,
    GraphrtError,
    OptionError,
    RequestError,
    UnknownRequestError,
)
from tests.helpers import draft_dir, load


def _rand_prompts(n, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (int(torch.randint(2, 16, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


@pytest.mark.parametrize("use_draft", [True, False])
def test_seeded_request_independent_of_batch_and_slot(target, draft, use_draft):
    V = target.config.vocab_size
    probe = [5, 17, 99, 3]
    sp = SamplingParams(max_new_tokens=20, temperature=0.8, seed=1234, ignore_eos=True)
    d = draft if use_draft else None
    alone = Runtime(target, d, num_draft_tokens=3, max_batch_size=8, max_seq_len=64).generate([probe], sp)[0]
    others = _rand_prompts(5, V, seed=3)
    other_params = [SamplingParams(max_new_tokens=m, temperature=t, seed=s, ignore_eos=True)
                    for m, t, s in zip((3, 30, 7, 12, 25), (0.0, 1.0, 0.5, 0.0, 2.0), (1, 2, None, 4, 5))]
    rt = Runtime(target, d, num_draft_tokens=3, max_batch_size=8, max_seq_len=64)
    # the probe lands in a later slot and shares buckets of changing size with the others
    gens = rt.generate(others[:3] + [probe] + others[3:], other_params[:3] + [sp] + other_params[3:])
    assert gens[3].token_ids == alone.token_ids
    assert gens[3].logprobs == pytest.approx(alone.logprobs, abs=1e-4)


def test_sampled_requests_differ_by_seed(target, draft):
    rt = Runtime(target, draft, num_draft_tokens=2, max_batch_size=4, max_seq_len=64)
    sps = [SamplingParams(max_new_tokens=24, temperature=1.5, seed=s, ignore_eos=True) for s in (1, 2)]
    a, b = rt.generate([[1, 2, 3], [1, 2, 3]], sps)
    assert a.token_ids != b.token_ids


def test_bad_input_is_rejected_and_runtime_stays_usable(target, draft):
    rt = Runtime(target, draft, num_draft_tokens=3, max_batch_size=2, max_seq_len=32)
    V = target.config.vocab_size
    with pytest.raises(RequestError, match="max_seq_len"):
        rt.generate([[1] * 30], SamplingParams(max_new_tokens=5))
    with pytest.raises(RequestError, match="temperature"):
        SamplingParams(temperature=-0.5)
    with pytest.raises(RequestError, match="temperature"):
        SamplingParams(temperature=float("nan"))
    with pytest.raises(RequestError, match="empty"):
        rt.generate([[]], SamplingParams())
    with pytest.raises(RequestError, match="vocabulary"):
        rt.generate([[1, V]], SamplingParams())
    with pytest.raises(RequestError, match="vocabulary"):
        rt.add_request([-1, 2])
    with pytest.raises(RequestError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=0)
    with pytest.raises(RequestError):
        rt.generate([[1, 2]], [SamplingParams(), SamplingParams()])
    # stop ids: an iterable of ints >= 0 (a string's characters, floats, bools, negatives refused)
    for bad in ("12", 7, [2.0], [True], [3, -1]):
        with pytest.raises(RequestError, match="stop_token_ids"):
            SamplingParams(stop_token_ids=bad)
    assert SamplingParams(stop_token_ids=(torch.tensor(4), 5)).stop_token_ids == (4, 5)
    # a failed batch admits nothing: the next one runs normally, and inputs are not modified
    prompts = [[4, 5, 6], [7, 8]]
    before = copy.deepcopy(prompts)
    gens = rt.generate(prompts, SamplingParams(max_new_tokens=6, ignore_eos=True))
    assert prompts == before
    assert [len(g.token_ids) for g in gens] == [6, 6]
    assert not rt.has_unfinished()


@pytest.mark.parametrize("options, names", [
    (dict(max_batch_size=0), "max_batch_size must be >= 1, got 0"),
    (dict(max_seq_len=1), "max_seq_len must be >= 2, got 1"),
    (dict(num_draft_tokens=0), "num_draft_tokens must be >= 1, got 0"),
    (dict(block_size=-2), "block_size must be >= 1, got -2"),
    (dict(simulate_acceptance_length=4.5), "[1, K + 1] = [1, 4], got 4.5"),
    (dict(simulate_acceptance_length=0.9), "[1, K + 1] = [1, 4], got 0.9"),
    (dict(draft_quantization="int4"), "draft_quantization takes one of"),
    (dict(buckets=(0, 2)), "buckets must be batch sizes >= 1, got (0, 2)"),
])
def test_runtime_options_out_of_range_are_option_errors(target, draft, options, names):
    """A Runtime option out of range is an OptionError (a GraphrtError, still a ValueError) that
    names the option and the value, raised before anything is built."""
    kw = dict(num_draft_tokens=3, max_batch_size=2, max_seq_len=64) | options
    with pytest.raises(OptionError) as exc:
        Runtime(target, draft, **kw)
    assert names in str(exc.value)
    assert isinstance(exc.value, GraphrtError) and isinstance(exc.value, ValueError)


def test_sequence_budget_past_the_models_positions_warns(target):
    """A max_seq_len past max_position_embeddings runs (rope extrapolates) but says so."""
    limit = target.config.max_position_embeddings
    with pytest.warns(UserWarning, match=f"max_seq_len {limit + 1} is past the target's max_position_embeddings"):
        Runtime(target, None, max_batch_size=1, max_seq_len=limit + 1, kv_budget_tokens=64)


def test_from_pretrained_options_out_of_range():
    from tests.helpers import tiny_dir

    with pytest.raises(OptionError, match="tensor_parallel_size must be >= 1, got 0"):
        Runtime.from_pretrained(tiny_dir(), device="cpu", tensor_parallel_size=0)
    if not torch.cuda.is_available():  # torch's own assertion before, at the first allocation
        with pytest.raises(OptionError, match="sees no CUDA device"):
            Runtime.from_pretrained(tiny_dir(), device="cuda")


def test_capacity_error_names_the_budget(target):
    rt = Runtime(target, None, max_batch_size=2, max_seq_len=512, kv_budget_tokens=64, block_size=16)
    with pytest.raises(CapacityError, match="KV blocks"):
        rt.add_request([1] * 100, SamplingParams(max_new_tokens=10))
    assert rt.generate([[1, 2]], SamplingParams(max_new_tokens=3, ignore_eos=True))[0].token_ids


def test_kv_blocks_are_shared_fairly_and_returned(target, draft):
    # a pool that holds two requests at once: the rest wait, and every block comes back
    rt = Runtime(target, draft, num_draft_tokens=2, max_batch_size=4, max_seq_len=40, kv_budget_tokens=96,
                 block_size=8)
    free0 = rt.kv_blocks.num_free
    gens = rt.generate([[1, 2, 3]] * 5, SamplingParams(max_new_tokens=20, ignore_eos=True))
    assert all(len(g.token_ids) == 20 for g in gens)
    assert rt.kv_blocks.num_free == free0
    assert len({tuple(g.token_ids) for g in gens}) == 1  # greedy: the same prompt gives the same tokens


def test_stop_tokens_and_eos(target):
    rt = Runtime(target, None, max_batch_size=2, max_seq_len=64)
    full = rt.generate([[9, 8, 7]], SamplingParams(max_new_tokens=12, ignore_eos=True))[0].token_ids
    stop = full[4]
    g = rt.generate([[9, 8, 7]], SamplingParams(max_new_tokens=12, stop_token_ids=[stop], ignore_eos=True))[0]
    assert g.token_ids == full[: full.index(stop) + 1]
    assert g.finish_reason == "stop"


def test_mismatched_draft_is_refused(target, tmp_path):
    from graphrt.checkpoint_writer import preset_config, write_random_checkpoint

    write_random_checkpoint(tmp_path / "v", preset_config("tiny", vocab_size=300, num_hidden_layers=1),
                            dtype=torch.float32)
    with pytest.raises(ConfigMismatchError, match="vocab"):
        Runtime(target, load(tmp_path / "v"), max_batch_size=1, max_seq_len=16)
    wide = preset_config("tiny", hidden_size=96)
    write_random_checkpoint(tmp_path / "e", wide, kind="eagle", dtype=torch.float32, target=wide)
    with pytest.raises(ConfigMismatchError, match="hidden"):
        Runtime(target, load(tmp_path / "e"), max_batch_size=1, max_seq_len=16)
    # the refused pairs leave nothing behind: a good pair still works
    rt = Runtime(target, load(draft_dir("self")), max_batch_size=1, max_seq_len=16)
    assert len(rt.generate([[1, 2]], SamplingParams(max_new_tokens=4, ignore_eos=True))[0].token_ids) == 4


def test_tiny_temperature_is_greedy_and_finished_requests_can_be_dropped(target):
    assert SamplingParams(temperature=1e-40).temperature == 0.0
    assert SamplingParams(temperature=0.5).temperature == 0.5
    rt = Runtime(target, None, max_batch_size=2, max_seq_len=32)
    rid = rt.add_request([1, 2, 3], SamplingParams(max_new_tokens=3, temperature=1e-30, ignore_eos=True))
    with pytest.raises(RequestError, match="not finished"):
        rt.pop_generation(rid)
    while rt.has_unfinished():
        rt.step()
    greedy = rt.generate([[1, 2, 3]], SamplingParams(max_new_tokens=3, ignore_eos=True))[0].token_ids
    assert rt.pop_generation(rid).token_ids == greedy
    # a popped (or never issued) id: a RequestError that says so, still the KeyError it used to be
    for call in (rt.get_generation, rt.pop_generation, rt.finished):
        with pytest.raises(UnknownRequestError, match=f"no request {rid} here") as exc:
            call(rid)
        assert isinstance(exc.value, KeyError) and isinstance(exc.value, RequestError)
    with pytest.raises(KeyError, match="never added"):
        rt.get_generation(10**6)



def test_default_pool_holds_every_slot_at_full_length(target):
    """The default KV budget admits max_batch_size requests of max_seq_len together: a per-request
    rounding to whole blocks once left the last one waiting (graphrt bench at B = 8 then ran its
    batch in two waves)."""
    rt = Runtime(target, None, max_batch_size=8, max_seq_len=32 + 64 + 8)
    sp = SamplingParams(max_new_tokens=64, ignore_eos=True)
    for p in _rand_prompts(8, target.config.vocab_size, seed=5):
        rt.add_request((p * 32)[:32], sp)
    rt.step()
    assert len(rt._running) == 8 and not rt._waiting


def test_sampling_filters_reach_the_sampler(target, draft):
    """top_k / top_p / min_p: validated, and passed per request to the sampler; a filter that
    leaves one token samples the greedy tokens (p = 1 there, so logprob 0) while the other
    requests of the batch keep their own distribution."""
    for bad, name in [(dict(top_k=-1), "top_k"), (dict(top_k=2.0), "top_k"), (dict(top_k=True), "top_k"),
                      (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(top_p=float("nan")), "top_p"),
                      (dict(min_p=1.0), "min_p"), (dict(min_p=-0.1), "min_p")]:
        with pytest.raises(RequestError, match=name):
            SamplingParams(**bad)
    assert not SamplingParams(top_k=0, top_p=1.0, min_p=0.0).filters
    rt = Runtime(target, draft, num_draft_tokens=3, max_batch_size=4, max_seq_len=64)
    prompts = _rand_prompts(3, target.config.vocab_size, seed=11)
    greedy = rt.generate(prompts[:2], SamplingParams(max_new_tokens=16, ignore_eos=True))
    free = SamplingParams(max_new_tokens=16, temperature=1.0, seed=3, ignore_eos=True)
    alone = rt.generate(prompts[2:], free)[0]
    gens = rt.generate(prompts, [SamplingParams(max_new_tokens=16, temperature=1.3, seed=1, top_k=1, ignore_eos=True),
                                 SamplingParams(max_new_tokens=16, temperature=0.8, seed=2, top_p=1e-6, min_p=0.5,
                                                ignore_eos=True), free])
    for got, want in zip(gens[:2], greedy):
        assert got.token_ids == want.token_ids
        assert got.logprobs == pytest.approx([0.0] * len(got.logprobs), abs=1e-6)
    assert gens[2].token_ids == alone.token_ids


def test_filters_run_only_in_cycles_that_need_them(target, draft):
    """The filters' kernels run in a cycle only while a request of its batch filters: a filtered
    request joining a running batch gets filtered tokens from its first (the prompt's) on, and once it
    is gone the cycles run without them; the unfiltered request beside it is unchanged throughout."""
    rt = Runtime(target, draft, num_draft_tokens=3, max_batch_size=4, max_seq_len=96)
    prompts = _rand_prompts(2, target.config.vocab_size, seed=12)
    free = SamplingParams(max_new_tokens=40, temperature=1.0, seed=5, ignore_eos=True)
    alone = rt.generate(prompts[:1], free)[0].token_ids
    greedy = rt.generate(prompts[1:], SamplingParams(max_new_tokens=8, ignore_eos=True))[0].token_ids
    a = rt.add_request(prompts[0], free)
    rt.step()
    assert not rt.state.filtering
    b = rt.add_request(prompts[1], SamplingParams(max_new_tokens=8, temperature=1.3, seed=4, top_k=1,
                                                  ignore_eos=True))
    seen = []
    while not rt.finished(a):
        rt.step()
        seen.append(rt.state.filtering)
    assert rt.pop_generation(b).token_ids == greedy
    assert rt.pop_generation(a).token_ids == alone
    assert seen[0] and not seen[-1], seen


def test_stats_count_what_ran(target, draft):
    """Runtime.stats(): the queue, slots and KV blocks as requests wait, run and finish, and counts
    that equal the sums over the requests' generations."""
    rt = Runtime(target, draft, num_draft_tokens=3, max_batch_size=2, max_seq_len=64)
    V = target.config.vocab_size
    prompts = _rand_prompts(3, V, seed=7)
    params = [SamplingParams(max_new_tokens=m, ignore_eos=True) for m in (5, 9, 4)]
    st = rt.stats()
    total = st.kv_blocks_total
    assert (st.waiting, st.running, st.free_slots, st.kv_blocks_free, st.cycles, st.prefills) == (0, 0, 2, total, 0, 0)
    rids = [rt.add_request(p, sp) for p, sp in zip(prompts, params)]
    assert (rt.stats().waiting, rt.stats().running) == (3, 0)  # add_request only queues
    rt.admit()
    st = rt.stats()
    assert (st.waiting, st.running, st.free_slots, st.prefills) == (1, 2, 0, 1)
    assert st.prompt_tokens == len(prompts[0]) + len(prompts[1]) and st.generated_tokens == 2
    assert 0 < st.kv_usage < 1 and st.kv_blocks_free < total
    while rt.has_unfinished():
        rt.step()
    gens = [rt.pop_generation(r) for r in rids]
    st = rt.stats()
    assert (st.waiting, st.running, st.free_slots, st.kv_blocks_free, st.kv_usage) == (0, 0, 2, total, 0.0)
    assert st.prefills == 2 and st.prompt_tokens == sum(map(len, prompts))
    assert st.generated_tokens == sum(len(g.token_ids) for g in gens) == 5 + 9 + 4
    assert st.draft_tokens == sum(g.num_draft_tokens for g in gens) > 0
    assert st.accepted_tokens == sum(g.num_accepted_tokens for g in gens)
    assert st.acceptance_rate == st.accepted_tokens / st.draft_tokens
    assert st.cycles >= max(g.num_cycles for g in gens) and st.host_seconds > 0
