"""Inspect captured graphs through cuda-python: kernel nodes by function name, DOT files.

Names come from the graph itself (node -> kernel node params -> CUfunction/CUkernel -> name), not
from graphrt's source, so a check such as "no softmax kernel in the draft graphs" tests what will
actually run.
"""

from __future__ import annotations

from collections import Counter

import torch


def _driver():
    from cuda.bindings import driver

    return driver


def _check(result):
    err, *rest = result
    driver = _driver()
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"CUDA driver call failed: {err}")
    return rest[0] if len(rest) == 1 else rest


def raw_graph(graph: torch.cuda.CUDAGraph):
    if not hasattr(graph, "raw_cuda_graph"):
        raise RuntimeError("this torch has no CUDAGraph.raw_cuda_graph(): graph inspection needs torch >= 2.6")
    try:
        ptr = graph.raw_cuda_graph()
    except RuntimeError as exc:
        raise RuntimeError("graph was captured without keep_graph=True; its nodes are gone") from exc
    return _driver().CUgraph(ptr)


def graph_nodes(graph: torch.cuda.CUDAGraph) -> list:
    driver = _driver()
    g = raw_graph(graph)
    _, count = _check(driver.cuGraphGetNodes(g, 0))
    nodes, _ = _check(driver.cuGraphGetNodes(g, count))
    return list(nodes)


def _kernel_name(node) -> str:
    driver = _driver()
    params = _check(driver.cuGraphKernelNodeGetParams(node))
    func = getattr(params, "func", None)
    if func is not None and int(func) != 0:
        name = _check(driver.cuFuncGetName(func))
    else:
        name = _check(driver.cuKernelGetName(params.kern))
    return name.decode() if isinstance(name, bytes) else str(name)


def kernel_names(graph: torch.cuda.CUDAGraph) -> dict[str, int]:
    """{kernel function name: number of kernel nodes} of a captured graph."""
    driver = _driver()
    counts: Counter[str] = Counter()
    for node in graph_nodes(graph):
        kind = _check(driver.cuGraphNodeGetType(node))
        if kind == driver.CUgraphNodeType.CU_GRAPH_NODE_TYPE_KERNEL:
            counts[_kernel_name(node)] += 1
    return dict(counts)


def node_count(graph: torch.cuda.CUDAGraph) -> int:
    return len(graph_nodes(graph))


def write_dot(graph: torch.cuda.CUDAGraph, path: str) -> None:
    driver = _driver()
    flags = driver.CUgraphDebugDot_flags.CU_GRAPH_DEBUG_DOT_FLAGS_VERBOSE
    _check(driver.cuGraphDebugDotPrint(raw_graph(graph), path.encode(), flags))
