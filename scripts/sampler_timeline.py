"""Each kernel of one sampler call, start and length, from a CUDA graph replay (CUDA only): the
unfiltered one-hot sampler, then top_k 50 + top_p 0.9 and top_k 50, at each B (K = 3, V = 128256,
bf16 randn logits). The torch profiler records one replay of a graph of 8 calls; the middle call's
kernels are printed, times in us from its first kernel's start.

    python scripts/sampler_timeline.py 1,64,256
"""

import sys

import torch
from graphrt.kernels.bench import filter_cases, rejection_sets
from graphrt.kernels.rejection import rejection_sample_triton
from graphrt.kernels.timing import graph_of_calls
from torch.profiler import ProfilerActivity, profile


def timeline(fn, sets, tag: str, per_graph: int = 8) -> None:
    graph = graph_of_calls(fn, sets, per_graph=per_graph)
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    ev = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                key=lambda e: e.time_range.start)
    if not ev:
        print(f"{tag}: the profiler recorded no kernels")
        return
    n = len(ev) // per_graph
    mid = ev[n * (per_graph // 2): n * (per_graph // 2 + 1)]
    t0 = mid[0].time_range.start
    print(f"{tag}: {n} kernels a call, the call {mid[-1].time_range.end - t0:.1f} us", flush=True)
    for e in mid:
        print(f"  +{e.time_range.start - t0:7.1f} {e.time_range.end - e.time_range.start:7.1f}  {e.name[:60]}")


def main() -> None:
    for b in [int(x) for x in sys.argv[1].split(",")]:
        sets = rejection_sets(b, 3, 128256, "onehot")
        timeline(lambda t, d, tt, s, p, q: rejection_sample_triton(t, d, tt, s, p), sets, f"B={b} unfiltered")
        for name, fk, fp in list(filter_cases(b))[:2]:
            timeline(lambda t, d, tt, s, p, q, k_=fk, p_=fp:
                     rejection_sample_triton(t, d, tt, s, p, top_k=k_, top_p=p_), sets, f"B={b} {name}")


if __name__ == "__main__":
    main()
