"""Programmatic dependent launch switch (kernels/pdl.py) and its effect on results."""

import pytest
import torch
from graphrt.kernels.argmax import argmax_reference, argmax_triton
from graphrt.kernels.pdl import pdl_enabled, pdl_launch


def test_pdl_off_on_cpu_and_by_env(monkeypatch):
    assert pdl_launch(True) == {"launch_pdl": True} and pdl_launch(False) == {}
    assert not pdl_enabled(torch.device("cpu"))
    monkeypatch.setenv("GRAPHRT_PDL", "0")
    assert not pdl_enabled(torch.device("cuda", 0))


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 8, 64])
def test_gpu_argmax_same_with_and_without_pdl_in_a_graph(cuda, batch):
    """Kernels launched as programmatic dependents must still see their producer's writes: the
    producer here is a copy into the static input, captured in the same graph before the argmax."""
    g = torch.Generator(device="cuda").manual_seed(torch.seed() % 2**31)
    src = [torch.randn(batch, 128256, device=cuda, dtype=torch.bfloat16, generator=g) for _ in range(3)]
    static = torch.empty_like(src[0])
    outs = {}
    for pdl in (False, True):
        res = (torch.empty(batch, dtype=torch.bfloat16, device=cuda),
               torch.empty(batch, dtype=torch.int64, device=cuda))
        static.copy_(src[0])
        argmax_triton(static, out=res, pdl=pdl)  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static.mul_(2.0)  # the producer the argmax must wait for
            argmax_triton(static, out=res, pdl=pdl)
        got = []
        for s in src:
            static.copy_(s)
            graph.replay()
            torch.cuda.synchronize()
            got.append(res[1].clone())
        outs[pdl] = got
    for s, a, b in zip(src, outs[False], outs[True]):
        want = argmax_reference(s * 2.0)[1]
        assert torch.equal(a, want) and torch.equal(b, want)


@pytest.mark.parametrize("m,n,k,block_k,split_k,use_dot", [
    (1, 37, 100, 64, 1, False),  # peeled first tile + masked tail
    (1, 8, 31, 64, 1, False),  # the peeled tile is the only (partial) tile
    (1, 16, 64, 64, 1, False),  # exactly one full tile
    (2, 37, 300, 64, 1, False),
    (1, 40, 300, 64, 3, False),  # split K: each split peels its own first tile
    (4, 33, 129, 32, 2, False),
    (5, 33, 129, 32, 2, True),
])
def test_gemv_pdl_path_matches_plain_path(m, n, k, block_k, split_k, use_dot):
    """The PDL variant of gemv reads its first weight tile before waiting for the producer of x:
    a different loop shape, which must give the same bits (under the interpreter the wait itself is
    a no-op, the peeled code runs)."""
    from graphrt.kernels.gemv import gemv_triton

    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    kw = dict(use_dot=use_dot, block_k=block_k, block_n=16 if use_dot else 4, split_k=split_k)
    a = gemv_triton(x, w, pdl=False, **kw)
    b = gemv_triton(x, w, pdl=True, **kw)
    assert torch.equal(a, b)
    torch.testing.assert_close(b, x @ w.T, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(1, 2048, 2048), (1, 2048, 8192), (2, 2048, 8192), (8, 2048, 8192)])
def test_gpu_gemv_same_with_and_without_pdl_in_a_graph(cuda, m, n, k):
    from graphrt.kernels.gemv import gemv_triton

    g = torch.Generator(device="cuda").manual_seed(torch.seed() % 2**31)
    w = torch.randn(n, k, device=cuda, dtype=torch.bfloat16, generator=g)
    src = [torch.randn(m, k, device=cuda, dtype=torch.bfloat16, generator=g) for _ in range(3)]
    static = torch.empty_like(src[0])
    got = {}
    for pdl in (False, True):
        y = torch.empty(m, n, device=cuda, dtype=torch.bfloat16)
        static.copy_(src[0])
        gemv_triton(static, w, out=y, pdl=pdl)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static.mul_(0.5)  # the producer of x the gemv must wait for
            gemv_triton(static, w, out=y, pdl=pdl)
        got[pdl] = []
        for s in src:
            static.copy_(s)
            graph.replay()
            got[pdl].append(y.clone())
    torch.cuda.synchronize()
    for s, a, b in zip(src, got[False], got[True]):
        assert torch.equal(a, b)
        torch.testing.assert_close(a.float(), (s * 0.5).float() @ w.float().T, rtol=2e-2, atol=2e-1)
