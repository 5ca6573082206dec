"""CUDA graph capture: replay equals eager bit for bit; decoding under graphs gives eager's tokens;
the draft graphs contain no softmax kernel (read from the captured graphs themselves)."""

import pytest
import torch
from graphrt.capture.validate import compare_replay_to_eager

from graphrt import Runtime, SamplingParams
from graphrt.checkpoint import load_checkpoint
from tests.helpers import draft_dir, tiny_dir

pytestmark = pytest.mark.gpu


def _load(path, dtype=torch.float32):
    return load_checkpoint(path, dtype=dtype, device="cuda")


def _runtime(kind="self", K=3, graphs=True, max_batch_size=8, dtype=torch.float32, **kw):
    draft = _load(draft_dir(kind), dtype) if kind else None
    return Runtime(_load(tiny_dir(), dtype), draft, num_draft_tokens=K, device="cuda", max_batch_size=max_batch_size,
                   max_seq_len=96, buckets=(1, 2, 4, 8), use_cuda_graphs=graphs, **kw)


def _prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 512, (int(torch.randint(2, 20, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


@pytest.mark.parametrize("kind,dtype", [("self", torch.float32), ("eagle", torch.float32),
                                        ("eagle3", torch.float32), (None, torch.float32),
                                        ("eagle", torch.bfloat16), (None, torch.bfloat16)])
def test_replay_equals_eager_bit_for_bit(kind, dtype):
    """bf16 puts the Triton GEMV, bf16 cuBLAS kernels and PDL launches inside the graphs; every static
    buffer is compared, the target hidden rows the EAGLE head reads included, so a kernel whose writes
    a replay lost would show as stale rows here (the bf16 cycles drew initcheck reports on the H200)."""
    rt = _runtime(kind, K=3, dtype=dtype)
    sp = [SamplingParams(max_new_tokens=60, temperature=t, seed=i, ignore_eos=True)
          for i, t in enumerate((0.0, 1.0, 0.0, 0.7, 0.0))]
    for p, s in zip(_prompts(5), sp):
        rt.add_request(p, s)
    rt.capture()
    for _ in range(3):  # get some real state into the buffers
        rt.step()
    for B in (8, 4, 1):  # padded (5 -> 8), exact-ish and a single row
        diffs = compare_replay_to_eager(rt, B)
        assert diffs and not any(diffs.values()), f"B={B}: {diffs}"


@pytest.mark.parametrize("kind", ["self", "eagle3"])
def test_greedy_under_graphs_equals_plain_eager(kind):
    prompts = _prompts(6, seed=3)
    params = [SamplingParams(max_new_tokens=m, ignore_eos=True) for m in (7, 33, 12, 1, 25, 18)]
    plain = _runtime(None, graphs=False).generate(prompts, params)
    spec = _runtime(kind, K=4).generate(prompts, params)
    assert [g.token_ids for g in spec] == [g.token_ids for g in plain]


def test_seeded_sampling_same_eager_graphs_and_buckets():
    probe = [7, 7, 1, 300]
    sp = SamplingParams(max_new_tokens=30, temperature=0.9, seed=4242, ignore_eos=True)
    eager = _runtime("eagle", graphs=False).generate([probe], sp)[0].token_ids
    rt = _runtime("eagle")
    alone = rt.generate([probe], sp)[0].token_ids  # bucket 1
    others = [SamplingParams(max_new_tokens=m, temperature=1.0, seed=i, ignore_eos=True)
              for i, m in enumerate((5, 40, 3, 22, 9))]
    mixed = rt.generate(_prompts(5, seed=9)[:2] + [probe] + _prompts(5, seed=9)[2:], others[:2] + [sp] + others[2:])
    assert alone == eager
    assert mixed[2].token_ids == eager


def test_draft_graphs_have_no_softmax_and_stable_node_counts():
    from graphrt.capture.inspect import graph_nodes, kernel_names

    rt = _runtime("eagle3", K=3)
    records = rt.capture()
    assert {(r.phase, r.batch_size) for r in records} == {
        (p, b) for p in ("TARGET_VERIFY", "DRAFT_EXTEND", "DRAFT_DECODE") for b in (1, 2, 4, 8)}
    for r in records:
        assert r.num_kernel_nodes > 0, r.phase
        if r.phase.startswith("DRAFT"):
            names = " ".join(r.kernels).lower()
            assert "softmax" not in names, (r.phase, r.batch_size, r.kernels)
            assert "argmax" in names, (r.phase, r.kernels)
    g = rt.cycle.graphs.get("DRAFT_DECODE", 4)
    n0, k0 = len(graph_nodes(g)), kernel_names(g)
    rt.generate(_prompts(4), SamplingParams(max_new_tokens=20, ignore_eos=True))
    assert len(graph_nodes(g)) == n0 and kernel_names(g) == k0


def test_slots_reused_under_graphs_match_eager():
    waves = [_prompts(5, seed=s) for s in (1, 2, 3)]
    params = [SamplingParams(max_new_tokens=m, temperature=t, seed=m, ignore_eos=True)
              for m, t in zip((11, 4, 26, 8, 15), (0.0, 0.8, 0.0, 1.2, 0.5))]
    rt_g, rt_e = _runtime("self", max_batch_size=4), _runtime("self", max_batch_size=4, graphs=False)
    for w in waves:  # 5 requests through 4 slots, three times: slots and blocks are reused
        assert [g.token_ids for g in rt_g.generate(w, params)] == [g.token_ids for g in rt_e.generate(w, params)]
    assert rt_g.kv_blocks.num_free == rt_e.kv_blocks.num_free == rt_g.allocator.num_blocks - 1


def _is_gemm(name: str) -> bool:
    return name.startswith("nvjet") or any(t in name.lower() for t in ("gemm", "xmma", "cutlass"))


def _is_forward_input(name: str) -> bool:
    """The embedding gather (index_select) and the EAGLE head's torch.cat of its inputs."""
    return "indexSelect" in name or "CatArrayBatchedCopy" in name


@pytest.mark.parametrize("kind", ["eagle", "eagle3", None])
def test_attention_starts_only_after_the_metadata_fence(kind):
    """kernels/pdl.py, "Settled memory": the attention reads seq_lens and block_tables before its
    PDL wait, so every kernel that may still run when it starts (from the last node without a
    programmatic incoming edge on) must be one that writes neither: graphrt's own Triton kernels,
    cuBLAS GEMMs (which launch as programmatic dependents too and write only their product), the
    embedding gather that opens each forward and the EAGLE head's concatenation of embedding and
    hidden state after it. Any other torch kernel there (the cycle computes the metadata with torch
    gather, index and elementwise kernels) fails this."""
    import importlib
    import pkgutil

    import graphrt.kernels
    import triton
    from graphrt.capture.inspect import launch_chain

    ours = set()
    for mod in pkgutil.iter_modules(graphrt.kernels.__path__):
        m = importlib.import_module(f"graphrt.kernels.{mod.name}")
        ours |= {f.__name__ for f in vars(m).values() if isinstance(f, triton.runtime.JITFunction)}
    rt = _runtime(kind, K=3, dtype=torch.bfloat16)
    rt.capture()
    checked = 0
    for (phase, batch), rec in rt.cycle.graphs.graphs.items():
        chain = launch_chain(rec.graph)
        assert any(early for _, early in chain), (phase, batch, "no PDL edge: the check would be vacuous")
        for i, (name, _) in enumerate(chain):
            if name != "_paged_attn_partial_kernel":
                continue
            fence = max(j for j in range(i + 1) if not chain[j][1])  # may still run: chain[fence:i]
            running = [n for n, _ in chain[fence:i]]
            others = [n for n in running if n not in ours and not _is_gemm(n) and not _is_forward_input(n)]
            assert not others, (phase, batch, running)
            checked += 1
    assert checked > 0
