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
