"""Tensor parallelism on the CPU: 2 and 4 gloo processes against one process.

Each check spawns the ranks once (graphrt.parallel.launch.run_ranks, the launcher behind `graphrt
--tp N`); every rank writes what it saw and the parent compares it with a single-process run."""

from __future__ import annotations

import sys
import time

import pytest
import torch

from graphrt import Runtime, SamplingParams
from graphrt.errors import ConfigMismatchError
from graphrt.parallel.launch import run_ranks
from tests.helpers import draft_dir, prompt_forward, tiny_dir

PROMPTS = [[1, 5, 9, 33, 7], [4, 4, 8, 100, 250, 17, 3]]
# two prompts sharing two whole 16-token KV blocks, for prefix caching
_SYSTEM = [(17 * i + 5) % 500 for i in range(33)]
SHARED = [_SYSTEM + [3, 1, 4], _SYSTEM + [2, 7, 1, 8, 2]]
DRAFTS = {"lm": "self", "eagle": "eagle-self", "eagle3": "eagle3", "eagle3-fp8": "eagle3"}  # -> draft_dir kind
# kinds run with Runtime options of their own: the EAGLE-3 head read as FP8, split over the ranks.
# Each rank scales its slice's rows, so a row-parallel slice's FP8 values differ from one process's
_KIND_KW = {"eagle3-fp8": dict(draft_quantization="fp8")}
_RT = dict(device="cpu", dtype=torch.float32, max_batch_size=2, max_seq_len=64, num_draft_tokens=3)
_GREEDY = SamplingParams(max_new_tokens=12, ignore_eos=True)


def _run(target, draft, tp_size, **kw):
    """(greedy tokens, sampled tokens, accepted drafts, the drafts proposed at each step of one greedy
    request, whether the draft is split over the ranks)."""
    rt = Runtime.from_pretrained(target, draft, tensor_parallel_size=tp_size, **{**_RT, **kw})
    sampled = SamplingParams(max_new_tokens=12, temperature=0.8, seed=7, ignore_eos=True)
    greedy = [g.token_ids for g in rt.generate(PROMPTS, _GREEDY)]
    accepted = sum(rt.acceptance_counts)
    proposals = []
    if draft is not None:
        rid = rt.add_request(PROMPTS[0], _GREEDY)
        while not rt.finished(rid):
            rt.step()
            proposals.append(rt.state.draft_tokens[:-1].tolist())
        rt.pop_generation(rid)
    split = rt.draft_ckpt is not None and rt.draft_ckpt.parallel is not None
    return greedy, [g.token_ids for g in rt.generate(PROMPTS, sampled)], accepted, proposals, split


def _worker(out_dir, world, target, drafts, kw):
    torch.set_num_threads(1)
    t0 = time.monotonic()
    rt = Runtime.from_pretrained(target, None, tensor_parallel_size=world, **{**_RT, **kw})
    res = {"forward": [t.cpu() for t in prompt_forward(rt, PROMPTS[1])], "rank": rt.tp.rank,
           "all_reduce": rt.all_reduce_path, "device": rt.device.type}
    for kind, path in {"plain": None, **drafts}.items():
        # progress on stderr: on GPUs each kind compiles and captures for a while
        print(f"rank {rt.tp.rank} {time.monotonic() - t0:.0f} s: {kind}", file=sys.stderr, flush=True)
        res[kind] = _run(target, path, world, **kw, **_KIND_KW.get(kind, {}))
    # filters under TP (the sampler gathers the logits): top_k = 1 samples the argmax, and a
    # seeded top_k + top_p request draws the same tokens on every rank
    params = [SamplingParams(max_new_tokens=12, temperature=1.0, seed=3, top_k=1, ignore_eos=True),
              SamplingParams(max_new_tokens=12, temperature=0.9, seed=5, top_k=4, top_p=0.8, ignore_eos=True)]
    res["filtered"] = [g.token_ids for g in rt.generate([PROMPTS[0], PROMPTS[1]], params)]
    # prefix caching and chunked prefill: every rank keys and shares the same blocks (each runs the
    # same scheduler), the first prompt prefilled 16 tokens a step, the second reading its blocks,
    # then both reading them again
    pc = Runtime.from_pretrained(target, drafts.get("eagle3"), tensor_parallel_size=world, prefix_caching=True,
                                 prefill_chunk_tokens=16, **{**_RT, **kw})
    gens = pc.generate(SHARED, _GREEDY) + pc.generate(SHARED, _GREEDY)
    res["prefix"] = ([g.token_ids for g in gens], pc.stats().cached_prompt_tokens)
    torch.save(res, f"{out_dir}/rank{rt.tp.rank}.pt")
    return 0


def _check_ranks(ranks, single, kinds):
    hidden, logits = single["forward"]
    # each rank's logits are its vocab shard, in rank order
    torch.testing.assert_close(torch.cat([res["forward"][1] for res in ranks], dim=-1), logits, rtol=1e-5, atol=1e-5)
    for res in ranks:
        # what the bench header reports: gloo on CPUs, the symmetric-memory kernel between GPUs
        assert res["all_reduce"] == ("one-shot" if res["device"] == "cuda" else "gloo")
        # fp32; the row-parallel partial sums add in another order than one GEMM's
        torch.testing.assert_close(res["forward"][0], hidden, rtol=1e-5, atol=1e-5)
        # greedy: every draft kind's speculative output is plain greedy decoding, token for token
        for kind in ["plain", *kinds]:
            assert res[kind][0] == single["plain"][0], kind
        # seeded sampling: every rank draws the same tokens (the schedulers never diverge)
        for kind in ["plain", *kinds]:
            assert res[kind][1] == ranks[0][kind][1], kind
        assert res["filtered"][0] == single["plain"][0][0] and res["filtered"] == ranks[0]["filtered"]
        assert res["prefix"] == (single["shared"] * 2, 32 + 2 * 32)
        # the self-drafts agree with the target, so the accepted-token path ran under TP too
        assert all(res[k][2] > 0 for k in ("lm", "eagle") if k in kinds)
        # the EAGLE-3 head is split over the ranks (the others are replicated), and proposes the
        # drafts the whole head proposes in one process, step by step
        for kind in kinds:
            assert res[kind][4] == kind.startswith("eagle3"), kind
            if kind not in _KIND_KW:
                assert res[kind][3] == single[kind][3], kind


def _single(kinds=tuple(DRAFTS), **kw):
    target = tiny_dir()
    rt = Runtime.from_pretrained(target, None, **{**_RT, **kw})
    res = {"forward": [t.cpu() for t in prompt_forward(rt, PROMPTS[1])],
           "shared": [g.token_ids for g in rt.generate(SHARED, _GREEDY)]}
    for kind, path in {"plain": None, **{k: draft_dir(DRAFTS[k]) for k in kinds}}.items():
        res[kind] = _run(target, path, None, **kw, **_KIND_KW.get(kind, {}))
    return res


@pytest.fixture(scope="module")
def single():
    """One process: forward and greedy/sampled outputs per draft kind."""
    return _single()


def _ranks(world, tmp_path, kinds=tuple(DRAFTS), timeout_s=300, **kw):
    drafts = {k: draft_dir(DRAFTS[k]) for k in kinds}
    code = run_ranks(world, _worker, str(tmp_path), world, tiny_dir(), drafts, kw, quiet=False, timeout_s=timeout_s,
                     start_method="spawn" if kw.get("device") == "cuda" else "fork")
    assert code == 0, "timed out" if code == 124 else f"a rank exited with {code}"
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]


@pytest.mark.parametrize("world", [2, 4])
def test_tensor_parallel_matches_one_process(world, single, tmp_path):
    kinds = tuple(k for k in DRAFTS if world == 2 or k not in _KIND_KW)  # the FP8 head on two ranks
    _check_ranks(_ranks(world, tmp_path, kinds), single, kinds)


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4])
def test_nccl_with_graphs_matches_one_gpu(world, tmp_path):
    """The same on 2 and 4 GPUs: NCCL and the symmetric-memory all-reduce inside the captured
    graphs, fp32 for exact greedy; the EAGLE-1/2 head drafts through the vocab-parallel argmax, the
    EAGLE-3 head split over the ranks. Each runtime compiles its own kernel variants (cold Triton
    cache: minutes)."""
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    kw = dict(device="cuda", use_cuda_graphs=True)
    kinds = ("eagle", "eagle3")
    _check_ranks(_ranks(world, tmp_path, kinds=kinds, timeout_s=300, **kw), _single(kinds=kinds, **kw), kinds)


def _failing_worker(out_dir, world, target):
    from graphrt.errors import ParallelError

    torch.set_num_threads(1)
    rank = int(__import__("os").environ["RANK"])
    path = target if rank != 1 else f"{target}-missing"
    try:
        Runtime.from_pretrained(path, None, tensor_parallel_size=world, **_RT)
    except ParallelError as exc:
        (__import__("pathlib").Path(out_dir) / f"rank{rank}.txt").write_text(str(exc))
        return 0
    return 1


def test_a_rank_that_fails_to_load_fails_every_rank(tmp_path):
    assert run_ranks(2, _failing_worker, str(tmp_path), 2, str(tiny_dir()), quiet=False, timeout_s=120,
                     start_method="fork") == 0
    messages = {(tmp_path / f"rank{r}.txt").read_text() for r in range(2)}
    assert len(messages) == 1
    (message,) = messages
    assert "rank 1 of 2" in message and "missing" in message


def _hanging_worker():
    time.sleep(60)  # a collective that never completes
    return 0


def test_a_hung_rank_prints_its_stack_at_the_timeout(capfd):
    assert run_ranks(2, _hanging_worker, timeout_s=4.0, start_method="fork") == 124
    err = capfd.readouterr().err
    assert err.count("in _hanging_worker") == 2, err  # both ranks, at the line they wait on


def test_shard_rule():
    from graphrt.checkpoint import load_config
    from graphrt.parallel import TensorParallel, target_shard_rule

    cfg = load_config(tiny_dir())  # 4 q heads, 2 KV heads of 16, intermediate 128, vocab 512
    rule = target_shard_rule(cfg, TensorParallel(None, 1, 2))
    assert rule("layers.0.self_attn.q_proj.weight") == (0, 32, 64)
    assert rule("layers.0.self_attn.k_proj.weight") == (0, 16, 32)
    assert rule("layers.1.self_attn.o_proj.weight") == (1, 32, 64)
    assert rule("layers.0.mlp.gate_proj.weight") == (0, 64, 128)
    assert rule("layers.0.mlp.down_proj.weight") == (1, 64, 128)
    assert rule("lm_head.weight") == (0, 256, 512)
    assert rule("layers.0.input_layernorm.weight") is None
    # 4 ranks over 2 KV heads: ranks 2 and 3 share KV head 1
    rule = target_shard_rule(cfg, TensorParallel(None, 3, 4))
    assert rule("layers.0.self_attn.q_proj.weight") == (0, 48, 64)
    assert rule("layers.0.self_attn.v_proj.weight") == (0, 16, 32)
    with pytest.raises(ConfigMismatchError, match="num_attention_heads"):
        target_shard_rule(cfg, TensorParallel(None, 0, 3))


def test_draft_shard_rule(tmp_path):
    """An EAGLE-3 head splits as a target layer does, its LM head over the draft vocabulary; fc, d2t
    and the norms stay whole. Other drafts, and heads the ranks do not divide, stay replicated."""
    from graphrt.checkpoint import load_config
    from graphrt.checkpoint_writer import write_random_checkpoint
    from graphrt.parallel import TensorParallel, draft_shard_rule

    cfg = load_config(draft_dir("eagle3"))  # the tiny target's shape: 4 q heads of 16, intermediate 128
    rule = draft_shard_rule(cfg, TensorParallel(None, 1, 2))
    v = cfg.draft_vocab_size
    assert rule("lm_head.weight") == (0, v // 2, v)
    assert rule("layers.0.self_attn.q_proj.weight") == (0, 32, 64)
    assert rule("layers.0.mlp.down_proj.weight") == (1, 64, 128)
    for whole in ("fc.weight", "d2t", "norm.weight", "layers.0.hidden_norm.weight", "embed_tokens.weight"):
        assert rule(whole) is None, whole
    assert draft_shard_rule(load_config(draft_dir("eagle")), TensorParallel(None, 0, 2)) is None
    odd = write_random_checkpoint(tmp_path / "odd", "tiny", kind="eagle3", dtype=torch.float32,
                                  target=tiny_dir(), draft_vocab_size=3)
    assert draft_shard_rule(odd, TensorParallel(None, 0, 4)) is None  # 3 draft ids over 4 ranks


def test_sliced_load_reads_the_rank_slice():
    """load_checkpoint(shard=rule) gives what slicing the whole checkpoint gives, for every rank
    of 2 and 4, and records which slice it holds."""
    from graphrt.checkpoint import load_checkpoint, load_config
    from graphrt.parallel import TensorParallel, shard_checkpoint, target_shard_rule

    path = tiny_dir("tiny-tied")  # tied: the LM head is the embedding's slice, one tensor
    whole = load_checkpoint(path)
    for world in (2, 4):
        for rank in range(world):
            tp = TensorParallel(None, rank, world)
            part = load_checkpoint(path, shard=target_shard_rule(load_config(path), tp))
            ref = shard_checkpoint(whole, tp)
            assert part.parallel == ref.parallel == (rank, world)
            assert part.weights.keys() == ref.weights.keys()
            for name, t in ref.weights.items():
                assert torch.equal(part.weights[name], t), name
            assert part.weights["lm_head.weight"] is part.weights["embed_tokens.weight"]
            assert part.weights["layers.0.mlp.down_proj.weight"].shape[1] == 128 // world
