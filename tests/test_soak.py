"""Soak under churn (the CPU version; scripts/soak_gpu.py runs it on CUDA with graphs).

One Runtime serves requests that arrive and finish at random (prompt lengths, max_new_tokens,
temperatures, seeds, stop tokens, greedy and sampled mixed) through add_request/step, with a KV
budget small enough that admissions wait for blocks and batches grow and shrink across buckets.
Every cycle the host bookkeeping is checked (blocks owned once, free + owned = pool, slots unique);
afterwards every block is back in the free pool, every request finished for a valid reason within
its budget, every token is in [0, V), and a sample of seeded requests re-run alone on a fresh
runtime gives the same tokens.

GRAPHRT_SOAK_CYCLES raises the number of cycles (default 300 per draft kind);
GRAPHRT_SOAK_SEED picks the schedule (default: fixed, printed on failure).

The driver (SoakConfig, Soak, rerun_alone) has no pytest dependency: scripts/soak_gpu.py uses it.
"""

from __future__ import annotations

import math
import os
import random
from collections import Counter
from dataclasses import dataclass

import pytest
import torch

from graphrt import Runtime, SamplingParams
from graphrt.errors import CapacityError, RequestError

TEMPERATURES = (0.0, 0.7, 1.3)


@dataclass
class SoakConfig:
    num_draft_tokens: int = 3
    max_batch_size: int = 6
    buckets: tuple[int, ...] = (1, 2, 4, 6)
    max_seq_len: int = 256  # large enough that an oversized request is a CapacityError, not a RequestError
    block_size: int = 16
    kv_blocks: int = 13  # usable blocks (the pool has one more, the trash block): waits happen
    max_prompt: int = 20
    max_new: int = 30
    arrivals: tuple[float, ...] = (0.05, 0.3, 0.8)  # chance that requests arrive before a cycle, by phase
    phase_cycles: int = 25  # the arrival rate changes this often: batches grow and shrink
    max_queue: int = 8  # no arrivals while this many requests wait
    use_cuda_graphs: bool | None = None
    prefill_chunk_tokens: int | None = None

    def runtime(self, target, draft, device=None) -> Runtime:
        return Runtime(target, draft, num_draft_tokens=self.num_draft_tokens, device=device,
                       max_batch_size=self.max_batch_size, max_seq_len=self.max_seq_len,
                       block_size=self.block_size, kv_budget_tokens=self.kv_blocks * self.block_size,
                       buckets=self.buckets, use_cuda_graphs=self.use_cuda_graphs, seed=0,
                       prefill_chunk_tokens=self.prefill_chunk_tokens)


@dataclass
class Submitted:
    rid: int
    prompt: list[int]
    params: SamplingParams
    streamed: list[int]  # tokens step() returned for it, in order


class Soak:
    """Random arrivals driven through add_request/step, with host-side invariants every cycle."""

    def __init__(self, rt: Runtime, cfg: SoakConfig, seed: int):
        self.rt, self.cfg = rt, cfg
        self.rng = random.Random(seed)
        self.vocab = rt.vocab_size
        self.requests: dict[int, Submitted] = {}
        self.cycles = 0
        self.kv_waits = 0  # cycles that started with a free slot but a request waiting for blocks
        self.buckets_seen: set[int] = set()
        self.rate = cfg.arrivals[0]
        # a system prompt of one whole block and the token after it (graphrt/prefix_cache.py's key) that
        # some prompts start with: under prefix caching (the default) their requests share its block, and
        # churn evicts and refills it
        self.shares = random.Random(seed + 1)
        self.system = [self.shares.randrange(self.vocab) for _ in range(cfg.block_size + 1)]
        run = rt.cycle.run

        def counted_run(B):  # the bucket of every launched cycle
            self.buckets_seen.add(B)
            return run(B)

        rt.cycle.run = counted_run
        self.chunks = 0  # chunked prefill's calls (prefill_chunk_tokens)
        chunk = rt._prefill_chunk

        def counted_chunk(req):
            self.chunks += 1
            return chunk(req)

        rt._prefill_chunk = counted_chunk

    # ---- arrivals -----------------------------------------------------------------------------
    def random_request(self) -> tuple[list[int], SamplingParams]:
        r, c = self.rng, self.cfg
        prompt = [r.randrange(self.vocab) for _ in range(r.randint(1, c.max_prompt))]
        if c.max_prompt > c.block_size + 1 and self.shares.random() < 0.3:  # (the other draws as without it)
            prompt = self.system + prompt[: self.shares.randint(1, c.max_prompt - c.block_size - 1)]
        temp = r.choice(TEMPERATURES)
        seed = r.getrandbits(63) if r.random() < 0.85 else None  # unseeded: drawn by the runtime
        stop = ()
        if r.random() < 0.3:  # ~40 of 512 ids: a good share of these requests finishes on a stop token
            stop = tuple(r.sample(range(self.vocab), min(40, self.vocab)))
        params = SamplingParams(max_new_tokens=r.randint(1, c.max_new), temperature=temp, seed=seed,
                                stop_token_ids=stop, ignore_eos=r.random() < 0.5)
        return prompt, params

    def submit(self, prompt, params) -> int:
        rid = self.rt.add_request(list(prompt), params)
        self.requests[rid] = Submitted(rid, list(prompt), params, [])
        return rid

    def maybe_arrive(self) -> None:
        if self.cycles % self.cfg.phase_cycles == 0:
            self.rate = self.rng.choice(self.cfg.arrivals)
        if len(self.rt._waiting) >= self.cfg.max_queue or self.rng.random() >= self.rate:
            return
        for _ in range(self.rng.choice((1, 1, 1, 2, 3))):
            self.submit(*self.random_request())

    # ---- one cycle ----------------------------------------------------------------------------
    def step(self) -> None:
        rt = self.rt
        if rt._waiting and rt._free_slots:
            self.kv_waits += 1
        out = rt.step()
        self.cycles += 1
        for rid, toks in out.items():
            assert all(0 <= t < self.vocab for t in toks), (rid, toks)
            self.requests[rid].streamed.extend(toks)
        self.check_bookkeeping()

    def check_bookkeeping(self) -> None:
        """Each block held by the running requests that list it (several only for a cached prompt
        block, prefix caching), idle in the prefix cache, or free, and only one of these; slots
        held by one running request or free."""
        rt = self.rt
        cache = rt.kv_blocks
        # the running requests, and one part way through a chunked prefill (first in the queue)
        holding = list(rt._running.values()) + [req for req in rt._waiting if req.slot >= 0]
        assert all(req is rt._waiting[0] for req in rt._waiting if req.slot >= 0), "a chunked prefill not first"
        holders = Counter(b for req in holding for b in req.blocks)
        shared = {b for b, n in holders.items() if n > 1}
        assert shared <= set(cache._key_of), "a KV block that no prompt keys is held by two requests"
        assert holders == Counter(cache._holders), "a block's holder count is not the requests that hold it"
        free, idle = set(rt.allocator._free), set(cache._idle)
        assert len(free) == len(rt.allocator._free), "a KV block is on the free list twice"
        assert not (holders.keys() & free or holders.keys() & idle or free & idle), "a KV block in two states"
        assert len(holders) + len(free) + len(idle) == rt.allocator.num_blocks - 1, (len(holders), len(free), len(idle))
        assert 0 not in holders and 0 not in free | idle, "the trash block was handed out"
        slots = [req.slot for req in holding]
        assert sorted(slots + rt._free_slots) == list(range(rt.max_batch_size)), (slots, rt._free_slots)
        assert all(rt._running[s].slot == s for s in rt._running)

    def run(self, cycles: int, *, on_cycle=None) -> None:
        for i in range(cycles):
            self.maybe_arrive()
            if on_cycle is not None:
                on_cycle(self, i)
            self.step()

    def drain(self, max_cycles: int = 10_000) -> None:
        for _ in range(max_cycles):
            if not self.rt.has_unfinished():
                return
            self.step()
        raise AssertionError(f"requests still unfinished after {max_cycles} drain cycles")

    # ---- afterwards ---------------------------------------------------------------------------
    def check_final(self) -> None:
        rt = self.rt
        assert not rt.has_unfinished() and not rt._running and not rt._waiting
        assert rt.kv_blocks.num_free == rt.allocator.num_blocks - 1, "KV blocks leaked"
        assert sorted(rt._free_slots) == list(range(rt.max_batch_size)), "slots leaked"
        for sub in self.requests.values():
            gen = rt.get_generation(sub.rid)
            p = sub.params
            toks = gen.token_ids
            stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(rt.eos_token_ids))
            assert gen.finish_reason in ("stop", "length"), (sub.rid, gen.finish_reason)
            assert 1 <= len(toks) <= p.max_new_tokens, (sub.rid, len(toks), p.max_new_tokens)
            assert all(0 <= t < self.vocab for t in toks), (sub.rid, toks)
            assert not any(t in stops for t in toks[:-1]), (sub.rid, "tokens after a stop token")
            if gen.finish_reason == "stop":
                assert toks[-1] in stops, sub.rid
            else:
                assert len(toks) == p.max_new_tokens and toks[-1] not in stops, sub.rid
            assert len(gen.logprobs) == len(toks)
            assert all(math.isfinite(lp) and lp <= 1e-4 for lp in gen.logprobs), (sub.rid, gen.logprobs)
            assert gen.prompt_token_ids == sub.prompt, "prompt modified"
            # every token, the first (from prefill) too, came through step() once
            assert sub.streamed == toks, (sub.rid, sub.streamed, toks)

    def rerun_sample(self, make_runtime, n: int) -> int:
        """Re-run up to n seeded (or greedy) requests, each alone on a fresh runtime; returns how
        many were compared. Greedy and sampled are both represented when the soak had both."""
        rt = self.rt
        eligible = [s for s in self.requests.values()
                    if s.params.seed is not None or s.params.temperature == 0]
        greedy = [s for s in eligible if s.params.temperature == 0]
        sampled = [s for s in eligible if s.params.temperature > 0]
        pick = random.Random(1).sample(greedy, min(len(greedy), n // 2))
        pick += random.Random(2).sample(sampled, min(len(sampled), n - len(pick)))
        for sub in pick:
            alone = make_runtime().generate([sub.prompt], sub.params)[0]
            gen = rt.get_generation(sub.rid)
            assert alone.token_ids == gen.token_ids, (
                f"request {sub.rid} ({sub.params}) gave {gen.token_ids} in the soak, {alone.token_ids} alone")
            assert alone.finish_reason == gen.finish_reason
            assert alone.logprobs == pytest.approx(gen.logprobs, abs=1e-3)
        return len(pick)


def soak_cycles(default: int = 300) -> int:
    return int(os.environ.get("GRAPHRT_SOAK_CYCLES", default))


def soak_seed(default: int = 20261122) -> int:
    return int(os.environ.get("GRAPHRT_SOAK_SEED", default))


# ---------------------------------------------------------------------------------------------
# tests (CPU: eager, reference kernels)
# ---------------------------------------------------------------------------------------------


def _draft(kind):
    from tests.helpers import draft_dir, load

    return load(draft_dir(kind))


@pytest.mark.parametrize("kind", ["self", "eagle"])
def test_soak_churn(target, kind):
    # the EAGLE run prefills prompts of over 12 tokens in chunks, between cycles
    cfg = SoakConfig(prefill_chunk_tokens=12 if kind == "eagle" else None)
    draft = _draft(kind)
    seed = soak_seed() + (kind == "eagle")
    soak = Soak(cfg.runtime(target, draft), cfg, seed)
    where = f"GRAPHRT_SOAK_SEED={seed - (kind == 'eagle')} draft={kind}"
    try:
        soak.run(soak_cycles())
        soak.drain()
        soak.check_final()
        compared = soak.rerun_sample(lambda: cfg.runtime(target, draft), n=12)
    except AssertionError as exc:
        raise AssertionError(f"{where}: {exc}") from exc
    finished = len(soak.requests)
    reasons = {r: sum(soak.rt.get_generation(s.rid).finish_reason == r for s in soak.requests.values())
               for r in ("stop", "length")}
    cached = soak.rt.stats().cached_prompt_tokens
    print(f"{where}: {soak.cycles} cycles, {finished} requests {reasons}, {soak.kv_waits} KV waits, "
          f"buckets {sorted(soak.buckets_seen)}, {cached} prompt tokens from cached blocks, {compared} re-run alone")
    # the schedule really exercised what it is meant to
    assert finished >= soak.cycles // 10, where
    assert soak.kv_waits > 0, f"{where}: no admission ever waited for KV blocks"
    assert soak.buckets_seen == set(cfg.buckets), f"{where}: buckets {soak.buckets_seen}"
    assert reasons["stop"] > 0 and reasons["length"] > 0, where
    assert compared >= 8, where
    assert cached >= 4 * cfg.block_size, f"{where}: prefix caching found {cached} prompt tokens"
    assert (soak.chunks > 10) == bool(cfg.prefill_chunk_tokens), f"{where}: {soak.chunks} prefill chunks"


def test_request_that_can_never_fit_is_refused_and_runtime_keeps_serving(target):
    cfg = SoakConfig()
    rt = cfg.runtime(target, _draft("self"))
    soak = Soak(rt, cfg, seed=5)
    soak.run(15)
    free_before = rt.kv_blocks.num_free
    waiting_before = len(rt._waiting)
    prompt = list(range(1, 21))
    big = SamplingParams(max_new_tokens=200)  # 20 + 200 + slack > 13 blocks of 16, < max_seq_len
    with pytest.raises(CapacityError, match="KV blocks"):
        rt.add_request(prompt, big)
    assert prompt == list(range(1, 21))
    assert rt.kv_blocks.num_free == free_before and len(rt._waiting) == waiting_before
    soak.run(30)
    soak.drain()
    soak.check_final()
    # and the largest request that does fit still runs once the pool is free
    fits = SamplingParams(max_new_tokens=cfg.kv_blocks * cfg.block_size - 20 - rt.slack)
    gen = rt.generate([prompt], fits)[0]
    assert len(gen.token_ids) <= fits.max_new_tokens and gen.finish_reason in ("stop", "length")
    assert rt.kv_blocks.num_free == rt.allocator.num_blocks - 1


def _bad_requests(vocab):
    """(prompt, params, error, message fragment): each must be refused at add_request."""
    neg = SamplingParams(temperature=0.5)
    object.__setattr__(neg, "temperature", -1.0)  # smuggled past the constructor's check
    nan = SamplingParams(temperature=0.5)
    object.__setattr__(nan, "temperature", float("nan"))
    return [
        ([], SamplingParams(), RequestError, "empty"),
        ([1, vocab], SamplingParams(), RequestError, "vocabulary"),
        ([-1, 3], SamplingParams(), RequestError, "vocabulary"),
        ([2**40], SamplingParams(), RequestError, "vocabulary"),
        ([1, 2], neg, RequestError, "temperature"),
        ([1, 2], nan, RequestError, "temperature"),
        (["a", 2], SamplingParams(), RequestError, "token ids"),
        ([1, 2], {"temperature": 0.5}, RequestError, "SamplingParams"),
        ([1] * 250, SamplingParams(max_new_tokens=10), RequestError, "max_seq_len"),
        (list(range(1, 21)), SamplingParams(max_new_tokens=200), CapacityError, "KV blocks"),
    ]


def _scripted_run(target, draft, *, with_bad: bool):
    """A fixed schedule of seeded requests (the same in both runs), optionally with bad requests
    thrown in while others run. Returns {schedule index: (tokens, logprobs, finish_reason)}."""
    cfg = SoakConfig()
    rt = cfg.runtime(target, draft)
    soak = Soak(rt, cfg, seed=77)  # only its request generator is used: same stream in both runs
    schedule = {}
    for cycle in range(60):
        if cycle % 3 == 0:
            prompt, params = soak.random_request()
            if params.seed is None:
                params = SamplingParams(max_new_tokens=params.max_new_tokens, temperature=params.temperature,
                                        seed=cycle, stop_token_ids=params.stop_token_ids,
                                        ignore_eos=params.ignore_eos)
            schedule[len(schedule)] = soak.submit(prompt, params)
        if with_bad and cycle % 4 == 1:
            for prompt, params, err, msg in _bad_requests(rt.vocab_size):
                before = list(prompt)
                with pytest.raises(err, match=msg):
                    rt.add_request(prompt, params)
                assert prompt == before, "a refused prompt was modified"
                soak.check_bookkeeping()
        soak.step()
    soak.drain()
    soak.check_final()
    out = {}
    for i, rid in schedule.items():
        g = rt.get_generation(rid)
        out[i] = (g.token_ids, g.logprobs, g.finish_reason)
    return out


def test_bad_requests_mid_soak_do_not_disturb_running_ones(target):
    draft = _draft("eagle")
    clean = _scripted_run(target, draft, with_bad=False)
    noisy = _scripted_run(target, draft, with_bad=True)
    assert clean.keys() == noisy.keys()
    for i in clean:
        assert noisy[i][0] == clean[i][0], f"request {i}: tokens changed by bad requests"
        assert noisy[i][2] == clean[i][2]
        assert noisy[i][1] == pytest.approx(clean[i][1], abs=1e-5)


def test_sampling_params_constructor_refuses_negative_temperature():
    with pytest.raises(RequestError, match="temperature"):
        SamplingParams(temperature=-0.1)
    with pytest.raises(RequestError, match="temperature"):
        SamplingParams(temperature=float("inf"))


if __name__ == "__main__":  # quick manual run: python tests/test_soak.py
    torch.set_num_threads(2)
    pytest.main([__file__, "-q", "-s"])
