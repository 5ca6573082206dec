"""Kernel timing the way kernels run in graphrt: replayed inside a CUDA graph.

Eager timings of microsecond kernels mostly measure launch overhead, so every benchmark here
captures `fn` (called `per_graph` times back to back) into one graph and times its replays with
CUDA events. Inputs that fit in L2 would time the cache, so callers pass several input sets
(`rotate`) and the graph cycles through them.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence

import torch


def graph_of_calls(fn: Callable[..., object], arg_sets: Sequence[tuple], *, per_graph: int,
                   warmup: int = 3) -> torch.cuda.CUDAGraph:
    """A CUDA graph of per_graph `fn(*args)` calls, args taken round-robin from arg_sets, after
    `warmup` eager calls on a side stream (compiles, autotuning and allocations stay out of it)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(warmup):
            fn(*arg_sets[i % len(arg_sets)])
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(per_graph):
            fn(*arg_sets[i % len(arg_sets)])
    return graph


def time_in_graph(
    fn: Callable[..., object], arg_sets: Sequence[tuple], *, per_graph: int = 20, replays: int = 30, warmup: int = 3
) -> float:
    """Median time of one `fn(*args)` call in microseconds, measured from CUDA graph replays.

    arg_sets: one or more argument tuples; the graph calls fn on them round-robin so that the
    working set exceeds L2 when the caller provides enough sets.
    """
    if not torch.cuda.is_available():
        raise RuntimeError("time_in_graph needs CUDA")
    graph = graph_of_calls(fn, arg_sets, per_graph=per_graph, warmup=warmup)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / per_graph)
    return statistics.median(times)


def memory_bandwidth_gbs(nbytes: int = 1 << 31) -> float:
    """Achievable device-memory bandwidth in GB/s, for byte floors of read-mostly kernels: the
    largest of a reduction that only reads (torch.amax over `nbytes`), a device-to-device copy and
    graphrt's own one-row GEMV streaming a weight matrix of nbytes / 8. A copy alone understates
    what a kernel that only reads can reach, and the GEMV has outrun both torch kernels: a floor
    meant to bound the decode phases must not sit below them."""
    from graphrt.kernels.linear import linear

    x = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    read_us = time_in_graph(lambda: torch.amax(x), [()], per_graph=5, replays=10)
    src = x[: x.numel() // 2]
    dst = torch.empty_like(src)
    copy_us = time_in_graph(lambda: dst.copy_(src), [()], per_graph=5, replays=10)
    k = 8192
    w = x[: (x.numel() // 8) // k * k].view(-1, k)  # a weight matrix the L2 cannot hold
    row = torch.randn(1, k, dtype=torch.bfloat16, device="cuda")
    gemv_us = time_in_graph(lambda: linear(row, w), [()], per_graph=5, replays=10)
    return max(nbytes / read_us, 2 * src.numel() * 2 / copy_us, w.numel() * 2 / gemv_us) * 1e-3
