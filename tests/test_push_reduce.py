"""The all-reduce inside the row-parallel GEMV (kernels/push_reduce.py): one row, two rows on the
FMA path, 3-16 on the DOT path, and the one-token embedding lookup.

- CPU (interpreter): the LL words' packing; two and four ranks simulated in one process (the others'
  words written into rank 0's buffer by the test); the refusals and the switch's values.
- one GPU: one rank in a CUDA graph replayed many times, against the GEMV without the push.
- two GPUs: at 2 ranks the sum of two bf16 partials rounded once is the same bits whichever way it
  is taken, so the GEMV's sum must equal NCCL's all-reduce of its partial exactly, and a runtime
  that pushes must decode the same tokens as one that all-reduces through NCCL. Chains of
  layer-like pairs (pushing GEMV, then a GEMV with the norm) of 1, 2, 4 and 8 rows, replayed in one
  CUDA graph many times while the ranks drift apart, catch a slot reused too early or a word read too soon: either
  gives wrong values (or a hang, which the timeout turns into a failure).
- four GPUs: the same chains against the partials all-gathered and added in rank order in fp32 (the
  push's order; NCCL's ring gives other bits), and the runtime again."""

from __future__ import annotations

import os

import pytest
import torch
import triton
import triton.language as tl
from graphrt.kernels.gemv import gemv_triton
from graphrt.kernels.linear import linear, linear_pushed
from graphrt.kernels.push_reduce import PushTarget, _pack, _unpack, embedding_pushed, embedding_pushed_reference

from graphrt.parallel.launch import run_ranks
from tests.seeds import fresh_seed


@triton.jit
def _round_trip_kernel(x_ptr, s_ptr, word_ptr, y_ptr, BLOCK: tl.constexpr):
    vals = tl.load(x_ptr + tl.arange(0, BLOCK))
    words = _pack(vals, tl.load(s_ptr + tl.arange(0, BLOCK // 2)))
    tl.store(word_ptr + tl.arange(0, BLOCK // 2), words)
    tl.store(y_ptr + tl.arange(0, BLOCK), _unpack(words, vals.dtype).to(vals.dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_words_carry_two_outputs_and_the_number(dtype):
    """The LL words: outputs of either sign, zeros and infinities come back bit for bit, NaN as NaN,
    and the number sits whole in the high half whatever the outputs' sign bits."""
    gen = torch.Generator().manual_seed(fresh_seed())
    x = (torch.randn(64, generator=gen) * torch.logspace(-4, 4, 64)).to(dtype)
    x[:6] = torch.tensor([-0.0, 0.0, float("inf"), -float("inf"), float("nan"), -1.0])
    bits = x.view(torch.int16)
    s = torch.randint(1, 2**31 - 1, (32,), generator=gen, dtype=torch.int32)
    words = torch.empty(32, dtype=torch.int64)
    y = torch.empty_like(x)
    _round_trip_kernel[(1,)](x, s, words, y, BLOCK=64)
    nan = x.isnan()  # NaN payloads do not survive the fp32 the sum is taken in
    assert torch.equal(y.view(torch.int16)[~nan], bits[~nan]) and y[nan].isnan().all()
    assert torch.equal((words >> 32).to(torch.int32), s)
    low = (bits.to(torch.int64) & 0xFFFF).view(32, 2)
    assert torch.equal(words & 0xFFFFFFFF, low[:, 0] | (low[:, 1] << 16))


def _local_target(world, words, device, dtype=torch.bfloat16):
    """A PushTarget whose W ranks' buffers all live in this process (rank 0 is this one): what the
    others 'pushed' is whatever the test writes into buffer 0."""
    data = [torch.zeros(2, world, words, dtype=torch.int64, device=device) for _ in range(world)]
    table = torch.tensor([d.data_ptr() for d in data], dtype=torch.int64, device=device)
    return PushTarget(data[0], table, torch.zeros(words, dtype=torch.int32, device=device), 0, world, dtype), data


@pytest.mark.parametrize("world", [2, 4])
def test_push_in_one_process_sums_and_sends_words(world):
    """W ranks simulated in one process (interpreter on CPU): the other ranks' words already sit in
    rank 0's buffer as +0.0, so rank 0's sum is its own product bit for bit; rank 0's words reach
    every other rank's buffer with number 1, and every word's count moves to 1."""
    gen = torch.Generator().manual_seed(fresh_seed())
    device = "cuda" if torch.cuda.is_available() else "cpu"
    n, k = 256, 96
    x = torch.randn(1, k, generator=gen).to(torch.bfloat16).to(device)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(torch.bfloat16).to(device)
    target, data = _local_target(world, n // 2, device)
    data[0][1, 1:] = 1 << 32  # the other ranks' push 1: number 1, outputs +0.0
    y = gemv_triton(x, w, push=target)
    plain = gemv_triton(x, w)
    assert torch.equal(y, plain)
    for r in range(1, world):
        assert torch.equal(data[r][1, 0].cpu(), _words(plain.view(-1).cpu(), 1))  # number 1, the outputs
        assert not data[r][0].any() and not data[r][1, 1:].any()  # nothing else written there
    assert torch.equal(target.seq.cpu(), torch.ones(n // 2, dtype=torch.int32))


_FMA2 = dict(use_dot=False, per_row=False, reduce_each=False, block_n=4, block_k=32)  # the M = 2 launch's shape


@pytest.mark.parametrize("rows,knobs", [
    (2, _FMA2),
    (4, dict(use_dot=True, block_n=32, block_k=32, split_k=1)),
    (3, dict(use_dot=True, block_n=32, block_k=32, split_k=3)),
    (16, dict(use_dot=True, block_n=32, block_k=32, split_k=2)),
])
def test_push_of_several_rows_in_one_process(rows, knobs):
    """Two rows on the FMA path (both in each program) and 3-16 on the DOT path (unsplit, or split
    K and reduced by the last split of each tile), two ranks simulated in one process as above,
    fp16 (the interpreter's dot takes it whole): rank 0's sum is its own product bit for bit, its
    words reach rank 1 with number 1, tile by tile and row by row, and the counts of the words used
    move to 1."""
    gen = torch.Generator().manual_seed(fresh_seed())
    device = "cuda" if torch.cuda.is_available() else "cpu"
    n, k, block_n = 96, 96, knobs["block_n"]
    x = torch.randn(rows, k, generator=gen).to(torch.float16).to(device)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(torch.float16).to(device)
    target, data = _local_target(2, rows * n // 2, device, dtype=torch.float16)
    data[0][1, 1] = 1 << 32  # rank 1's push 1: number 1, outputs +0.0
    y = gemv_triton(x, w, push=target, **knobs)
    plain = gemv_triton(x, w, **knobs)
    assert torch.equal(y, plain)
    order = plain.view(rows, n // block_n, block_n).transpose(0, 1).reshape(-1)  # [tiles, rows, block_n]
    assert torch.equal(data[1][1, 0].cpu(), _words(order.cpu(), 1))
    assert not data[1][0].any() and not data[1][1, 1].any()
    assert torch.equal(target.seq.cpu(), torch.ones(rows * n // 2, dtype=torch.int32))


def test_push_refuses_what_its_launches_do_not_sum():
    """Rows the push does not take (three or four on the FMA path, per-row programs) are an error
    naming the problem, and nothing is pushed."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    target, data = _local_target(2, 4 * 96 // 2, device, dtype=torch.float16)
    w = torch.randn(96, 96).to(torch.float16).to(device)
    for rows, knobs in ((3, dict(_FMA2)), (2, dict(_FMA2, per_row=True))):
        with pytest.raises(ValueError, match="push= takes one or two rows on the unsplit FMA path"):
            gemv_triton(torch.randn(rows, 96).to(torch.float16).to(device), w, push=target, **knobs)
    assert not any(d.any() for d in data) and not target.seq.any()


def _words(row: torch.Tensor, number: int) -> torch.Tensor:
    """A [H] 16-bit row as the LL words a rank pushes with that number (the test's stand-in peer)."""
    low = row.view(torch.int16).to(torch.int64) & 0xFFFF
    return (number << 32) | low[0::2] | (low[1::2] << 16)


@pytest.mark.parametrize("owner", [0, 1])
def test_embedding_lookup_sums_over_two_ranks_in_one_process(owner):
    """The vocab-parallel lookup of one token (interpreter on CPU, rank 1 simulated by the test):
    whichever rank holds the token's row, rank 0 ends with that row bit for bit, pushes its own
    part (the row or zeros: the reference's), and every count moves to 1."""
    gen = torch.Generator().manual_seed(fresh_seed())
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows, h = 40, 96
    tables = [torch.randn(rows, h, generator=gen).to(torch.bfloat16).to(device) for _ in range(2)]
    token = int(torch.randint(0, rows, (1,), generator=gen)) + owner * rows
    tokens = torch.tensor([token], device=device)
    target, data = _local_target(2, h // 2, device)
    peer = embedding_pushed_reference(tokens, tables[1], rows)[0]  # rank 1's part
    data[0][1, 1] = _words(peer.cpu(), 1).to(device)
    before = tokens.clone()
    y = embedding_pushed(tokens, tables[0], 0, target)
    assert torch.equal(y[0], tables[owner][token - owner * rows])
    assert torch.equal(data[1][1, 0].cpu(), _words(embedding_pushed_reference(tokens, tables[0], 0)[0].cpu(), 1))
    assert torch.equal(target.seq.cpu(), torch.ones(h // 2, dtype=torch.int32))
    assert torch.equal(tokens, before)
    # what it does not take goes back to the caller's all-reduce
    assert embedding_pushed(torch.tensor([1, 2], device=device), tables[0], 0, target) is None
    assert embedding_pushed(tokens, tables[0].float(), 0, target) is None
    assert embedding_pushed(tokens, tables[0], 0, None) is None


def test_allreduce_switch_names_its_values(monkeypatch):
    """GRAPHRT_ALLREDUCE takes auto or nccl; anything else (the retired A/B values `push` and `one-shot`
    included) is an error naming the variable, and a CPU group stays on its own backend."""
    from graphrt.parallel.group import TensorParallel

    tp = TensorParallel(group=None, rank=0, world_size=1)
    for mode in ("auto", "nccl"):
        monkeypatch.setenv("GRAPHRT_ALLREDUCE", mode)
        assert tp.use_symmetric_memory(torch.device("cpu"), torch.bfloat16, 64, 64) == "nccl"
    for retired in ("push", "one-shot"):
        monkeypatch.setenv("GRAPHRT_ALLREDUCE", retired)
        with pytest.raises(ValueError, match=f"GRAPHRT_ALLREDUCE must be auto or nccl, got '{retired}'"):
            tp.use_symmetric_memory(torch.device("cpu"), torch.bfloat16, 64, 64)
    assert tp.one_shot is None and tp.push is None


@pytest.mark.gpu
def test_one_rank_push_in_graph_replays_matches_plain_gemv():
    """One GPU, one rank (W = 1: the sum is the product itself, bit for bit): a chain of pushing
    GEMVs and norm-prologue GEMVs replayed in a CUDA graph, under PDL, against the same chain
    without the push. Every word's count is read and advanced by different programs and launches,
    so a stale count gives another slot's data, and the comparison catches it."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    gen = torch.Generator(device="cuda").manual_seed(fresh_seed())
    hidden, inner, steps = 1024, 768, 24
    target, _ = _local_target(1, hidden // 2, "cuda")
    bf = torch.bfloat16
    v = torch.randn(1, inner, device="cuda", generator=gen).to(bf)
    a = (torch.randn(hidden, inner, device="cuda", generator=gen) / inner**0.5).to(bf)
    b = (torch.randn(inner, hidden, device="cuda", generator=gen) / hidden**0.5).to(bf)
    res = torch.randn(1, hidden, device="cuda", generator=gen).to(bf)
    g = (1 + 0.1 * torch.randn(hidden, device="cuda", generator=gen)).to(bf)
    want, _ = _layer_chain(v, a, b, res, g, gemv_triton, steps)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _layer_chain(v, a, b, res, g, _pushed(target), 2)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, _ = _layer_chain(v, a, b, res, g, _pushed(target), steps)
    for i in range(200):
        graph.replay()
        if i % 20 == 19:
            torch.cuda.synchronize()
            assert torch.equal(out, want), f"replay {i}"


def _layer_chain(v, a, b, res, g, summed_product, steps, sleeps=None):
    """steps x (summed_product(v, a): the row-parallel product summed over the ranks; then b with
    the RMSNorm of that sum + res in its prologue). sleeps: {pair: GPU cycles} to spin before a
    pair (torch.cuda._sleep), so that ranks drift apart."""
    from graphrt.kernels.norm import PendingNorm

    streams = []
    for step in range(steps):
        if sleeps and step in sleeps:
            torch.cuda._sleep(sleeps[step])
        summed = summed_product(v, a)
        norm = PendingNorm(summed, res, g, 1e-5)
        v = linear(norm, b)  # the norm in the GEMV's prologue where it runs one row a program
        streams.append(norm.stream)
    return v, streams


def _pushed(push):
    def summed(v, a):  # through the layers' dispatcher, which must take these rows
        y = linear_pushed(v, a, push)
        assert y is not None, f"linear_pushed declined {tuple(v.shape)} x {tuple(a.shape)}"
        return y

    return summed


def _reference_summed(v, a):
    """The product summed over the ranks as the push must sum it: at two ranks NCCL's all-reduce
    (two bf16 partials rounded once: the same bits in either order); past two, the partials
    all-gathered and added in rank order in fp32, rounded once (NCCL's ring order differs)."""
    import torch.distributed as dist

    part = gemv_triton(v, a)
    world = dist.get_world_size()
    if world == 2:
        dist.all_reduce(part)
        return part
    parts = [torch.empty_like(part) for _ in range(world)]
    dist.all_gather(parts, part)
    acc = torch.zeros(part.shape, dtype=torch.float32, device=part.device)
    for p in parts:
        acc += p.float()
    return acc.to(part.dtype)


# (rows, hidden, inner): a decode step's one-row FMA path; two rows in each FMA program (a down
# projection at B = 2); four rows on the unsplit DOT path (llama-8b's o projection at TP = 2); eight
# on the DOT path split over K, summed by each tile's last split (its down projection)
_CHAINS = [(1, 1024, 768), (2, 2048, 4096), (4, 4096, 2048), (8, 4096, 7168)]


def _kernel_worker(out_dir, seed):
    import random

    import torch.distributed as dist
    from graphrt.kernels.push_reduce import MAX_ROWS

    from graphrt.parallel.group import init_tensor_parallel

    tp = init_tensor_parallel()
    dev = torch.device("cuda", torch.cuda.current_device())
    fails = []
    try:
        steps = 24
        assert tp.use_symmetric_memory(dev, torch.bfloat16, 64 * 4096, 4096) == "push + one-shot"
        assert tp.push.seq.numel() * 2 >= MAX_ROWS * 4096
        gen = torch.Generator(device=dev).manual_seed(seed + 1000 * tp.rank)  # each rank its own partials
        gen_shared = torch.Generator(device=dev).manual_seed(seed)  # the same residuals and norms on every rank
        bf = torch.bfloat16
        chains = []
        for rows, hidden, inner in _CHAINS:
            v = torch.randn(rows, inner, device=dev, generator=gen).to(bf)
            a = (torch.randn(hidden, inner, device=dev, generator=gen) / inner**0.5).to(bf)
            b = (torch.randn(inner, hidden, device=dev, generator=gen) / hidden**0.5).to(bf)
            res = torch.randn(rows, hidden, device=dev, generator=gen_shared).to(bf)
            g = (1 + 0.1 * torch.randn(hidden, device=dev, generator=gen_shared)).to(bf)
            # one product: the reference's sum exactly
            if not torch.equal(_pushed(tp.push)(v, a), _reference_summed(v, a)):
                fails.append(f"{rows} rows: the GEMV's sum differs from the all-reduced one")
            # a chain of layer-like pairs, eager
            want, want_streams = _layer_chain(v, a, b, res, g, _reference_summed, steps)
            got, got_streams = _layer_chain(v, a, b, res, g, _pushed(tp.push), steps)
            if not torch.equal(got, want) or not all(map(torch.equal, got_streams, want_streams)):
                fails.append(f"{rows} rows: eager chain differs from the all-reduced one")
            chains.append(((v, a, b, res, g), want, want_streams))
        # every chain in one graph (the words of one- and several-row launches interleave), replayed
        # many times, each rank spinning before its own random pairs so that one runs ahead
        rng = random.Random(seed * 7 + tp.rank)
        sleeps = [{k: rng.randrange(10_000, 200_000) for k in range(steps) if rng.random() < 0.25} for _ in chains]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for args, _, _ in chains:
                _layer_chain(*args, _pushed(tp.push), 2)  # warm
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = [_layer_chain(*args, _pushed(tp.push), steps, sl) for (args, _, _), sl in zip(chains, sleeps)]
        for i in range(50):
            graph.replay()
            if i % 10 != 9:
                continue
            torch.cuda.synchronize()
            for (rows, _, _), (out, out_streams), (_, want, want_streams) in zip(_CHAINS, outs, chains):
                if not torch.equal(out, want) or not torch.equal(out_streams[-1], want_streams[-1]):
                    # the first pair whose sum + residual differs says where a wrong sum entered
                    first = next((k for k, (o, w) in enumerate(zip(out_streams, want_streams))
                                  if not torch.equal(o, w)), None)
                    where = "only the last GEMV" if first is None else (
                        f"first at pair {first} of {steps}: "
                        f"{int((out_streams[first] != want_streams[first]).sum())} outputs")
                    fails.append(f"{rows} rows: graph replay {i} differs ({where})")
            if fails:
                break
        torch.cuda.synchronize()
        # every rank ran the same pushes, so every word's count must agree across the ranks
        counts = [torch.empty_like(tp.push.seq) for _ in range(tp.world_size)]
        dist.all_gather(counts, tp.push.seq)
        if not all(torch.equal(c, counts[0]) for c in counts):
            fails.append("the ranks' push counts differ")
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        fails.append(f"{type(exc).__name__}: {exc}")
    (__import__("pathlib").Path(out_dir) / f"fails{tp.rank}.txt").write_text("\n".join(fails))
    return 0


def _runtime_worker(out_dir, world):
    from graphrt import Runtime, SamplingParams
    from tests.helpers import draft_dir, prompt_forward, tiny_dir

    results = {}
    for path in ("nccl", "auto"):
        os.environ["GRAPHRT_ALLREDUCE"] = path
        for draft in (None, draft_dir("eagle3")):  # plain, then EAGLE-3 (its split head pushes too)
            rt = Runtime.from_pretrained(tiny_dir(), draft, tensor_parallel_size=world, device="cuda",
                                         dtype=torch.bfloat16, max_batch_size=2, max_seq_len=64,
                                         num_draft_tokens=3, use_cuda_graphs=True)
            params = SamplingParams(max_new_tokens=16, ignore_eos=True)
            prompts = [[1, 5, 9, 33, 7], [4, 4, 8, 100, 250]]
            # five rows through the DOT path's push: this rank's vocab shard of the logits
            logits = prompt_forward(rt, prompts[1])[1].float().cpu()
            # one request at a time (batch 1: one-token steps push, the lookup included), then both
            gens = [rt.generate([p], params)[0] for p in prompts] + rt.generate(prompts, params)
            results[path, draft is not None] = ([g.token_ids for g in gens], [g.logprobs for g in gens],
                                                rt.all_reduce_path, logits)
    torch.save(results, f"{out_dir}/rank{int(os.environ['RANK'])}.pt")
    return 0


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4])
def test_pushed_sum_matches_the_reference_in_chains_and_graph_replays(tmp_path, world):
    """At two ranks against NCCL; at four against the partials added in rank order."""
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    seed = fresh_seed()
    assert run_ranks(world, _kernel_worker, str(tmp_path), seed, quiet=False, timeout_s=240) == 0
    for r in range(world):
        fails = (tmp_path / f"fails{r}.txt").read_text()
        assert not fails, f"seed {seed} rank {r}: {fails}"


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4])
def test_runtime_that_pushes_decodes_as_nccl(tmp_path, world):
    """At two ranks the same logits and tokens as NCCL. At four the push adds in rank order and
    NCCL in its ring's, so a bf16 sum may round the other way: the logits must agree to bf16's
    precision, and the greedy tokens until a position where the two choices were nearly tied (their
    logprobs within 0.05)."""
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    assert run_ranks(world, _runtime_worker, str(tmp_path), world, quiet=False, timeout_s=300) == 0
    for r in range(world):
        res = torch.load(tmp_path / f"rank{r}.pt")
        for spec in (False, True):
            (got, got_lp, got_path, got_logits), (want, want_lp, want_path, want_logits) = \
                res["auto", spec], res["nccl", spec]
            assert got_path == "push + one-shot" and want_path == "nccl"
            # bf16 logits of a few tenths: a rank's partial lost or added twice moves them far more
            torch.testing.assert_close(got_logits, want_logits, rtol=0, atol=0 if world == 2 else 0.02)
            if world == 2:
                assert got == want, f"rank {r}, speculative {spec}"
                continue
            for req, (g, w, glp, wlp) in enumerate(zip(got, want, got_lp, want_lp)):
                where = f"rank {r}, speculative {spec}, request {req}"
                same = next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), len(g))
                assert len(g) == len(w) and same > 0, where
                torch.testing.assert_close(torch.tensor(glp[:same]), torch.tensor(wlp[:same]), rtol=0, atol=0.05,
                                           msg=lambda m, where=where: f"{where}: {m}")
                if same < len(g):
                    assert abs(glp[same] - wlp[same]) < 0.05, f"{where}: token {same} differs without a near tie"
