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


def write_dot(graph: torch.cuda.CUDAGraph, path: str) -> None:
    driver = _driver()
    flags = driver.CUgraphDebugDot_flags.CU_GRAPH_DEBUG_DOT_FLAGS_VERBOSE
    _check(driver.cuGraphDebugDotPrint(raw_graph(graph), path.encode(), flags))


def launch_chain(graph: torch.cuda.CUDAGraph) -> list[tuple[str, bool]]:
    """The graph's nodes in dependency order as (name, early): name is the kernel function's name
    ('' for nodes that are not kernels); early says that an incoming edge is programmatic, so the
    node may start while the node before it still runs. A node without one starts only after
    everything before it has finished and its writes are visible."""
    driver = _driver()
    default = int(driver.CUgraphDependencyType.CU_GRAPH_DEPENDENCY_TYPE_DEFAULT)
    nodes = graph_nodes(graph)
    deps = {}
    for node in nodes:
        # cuda-python 13: (deps, edge data, count); the count comes last in every version with edge data
        count = _check(driver.cuGraphNodeGetDependencies(node, 0))[-1]
        parents, edges = (_check(driver.cuGraphNodeGetDependencies(node, count))[:2] if count else ([], []))
        # a programmatic edge (another type or a non-zero port) lets the node start early (PDL)
        early = any(int(e.type) != default or int(e.from_port) != 0 for e in edges if e is not None)
        deps[int(node)] = ([int(p) for p in parents], early)
    order, done = [], set()
    pending = list(nodes)
    while pending:  # Kahn's order (stream capture gives a chain, in node-list order: one pass)
        rest = []
        for node in pending:
            if all(p in done for p in deps[int(node)][0]):
                order.append(node)
                done.add(int(node))
            else:
                rest.append(node)
        if len(rest) == len(pending):
            raise RuntimeError("graph has a cycle")
        pending = rest
    out = []
    for node in order:
        kind = _check(driver.cuGraphNodeGetType(node))
        name = _kernel_name(node) if kind == driver.CUgraphNodeType.CU_GRAPH_NODE_TYPE_KERNEL else ""
        out.append((name, deps[int(node)][1]))
    return out
