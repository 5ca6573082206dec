"""graphrt.bench.run_served: requests through a fixed number of slots, a new one joining as one finishes."""

import pytest

from graphrt import Runtime, SamplingParams
from graphrt.bench import run_served
from graphrt.errors import GraphrtError
from tests.helpers import draft_dir, load, random_prompts, tiny_dir
from tests.seeds import fresh_seed


@pytest.mark.parametrize("draft", [None, "self"])
def test_served_keeps_the_slots_full_and_emits_what_generate_does(draft):
    target = load(tiny_dir())
    dckpt = load(draft_dir(draft)) if draft else None
    prompts = random_prompts(5, target.config.vocab_size, fresh_seed(), hi=12)
    rt = Runtime(target, dckpt, max_batch_size=4, max_seq_len=64)
    r = run_served(rt, 2, prompts, num_requests=7, max_new_tokens=9)
    ref = Runtime(target, dckpt, max_batch_size=4, max_seq_len=64)
    cycled = [prompts[i % len(prompts)] for i in range(7)]
    gens = ref.generate(cycled, SamplingParams(max_new_tokens=9))
    assert r["tokens"] == sum(len(g.token_ids) - 1 for g in gens)
    assert r["requests"] == 7 and r["concurrency"] == 2
    # on the CPU cycles are not pipelined: every steady cycle runs both slots
    assert r["steady"]["mean_batch"] == pytest.approx(2.0)
    assert 1.0 <= r["mean_batch"] <= 2.0
    assert r["tokens_per_s"] > 0 and r["tokens_per_s_wall"] > 0
    # 7 requests through 2 slots: the first two share a prefill, later ones join as slots free
    assert 2 <= r["prefills"] <= 6
    assert 0 < r["prefill_gpu_s"] and 0 < r["decode_gpu_s"]
    assert r["prefill_gpu_s"] + r["decode_gpu_s"] <= r["wall_s"]
    t = r["ttft_ms"]
    assert 0 < t["p50"] <= t["p99"] <= 1e3 * r["wall_s"] and 0 < t["mean"] <= t["p99"]
    assert 0 < r["tpot_ms_mean"] < 1e3 * r["wall_s"]
    assert 1.0 <= r["mean_acceptance_length"] <= rt.K + 1
    assert not rt.has_unfinished()


def test_served_refuses_a_queue_too_short_for_a_steady_state():
    rt = Runtime(load(tiny_dir()), None, max_batch_size=4, max_seq_len=64)
    with pytest.raises(GraphrtError, match="num_requests"):
        run_served(rt, 4, [[1, 2, 3]], num_requests=7, max_new_tokens=4)
