"""Where the filtered sampler's threshold kernels spend their time: each kernel of
kernels/rejection_filter.py timed alone by the torch profiler (device time per call), for top_k 50
+ top_p 0.9, top_k 50 and top_p 0.9 on randn bf16 rows (K = 3, V = 128256), at B = 1, 64, 256, with
the launch the sampler uses (draws included from 8 rows, as filter_stage makes them) and with each
(kernel 1 tile, warps, tile) given on the command line.

    python scripts/filter_kernel_times.py [--config SBV,WARPS,BV ...]
"""

import argparse
import dataclasses
from collections import defaultdict
from functools import partial

import torch
from graphrt.kernels.bench import filter_cases
from graphrt.kernels.rejection import RACE_CHUNK, filter_stage, launch_config
from graphrt.kernels.rejection_filter import FILTER_WARPS
from torch.profiler import ProfilerActivity, profile


def kernel_times(fn, reps=10) -> dict[str, float]:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    out = defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            out[e.name] += e.device_time / reps
    return dict(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", action="append", default=[], help="SBV,WARPS,BV: kernel 1's tile, warps, tile")
    args = ap.parse_args()
    k, v = 3, 128256
    for b in (1, 64, 256):
        gen = torch.Generator(device="cuda").manual_seed(b)
        logits = torch.randn(b, k + 1, v, device="cuda", generator=gen).to(torch.bfloat16)
        temp = torch.ones(b, device="cuda")
        ids, seed = logits[:, :k].float().argmax(-1), torch.arange(b, device="cuda")
        cfg = launch_config(b, k, False)
        configs = [(8192, FILTER_WARPS, cfg.filter_block_v)] + [tuple(map(int, c.split(","))) for c in args.config]
        for name, fk, fp in filter_cases(b):
            for sbv, warps, bv in configs:
                c = dataclasses.replace(cfg, filter_block_v=bv, pdl=0)
                t = kernel_times(partial(filter_stage, logits, ids, temp, seed, seed, None, fk, fp, None, c, False,
                                         RACE_CHUNK, stats_block_v=sbv, num_warps=warps))
                cols = " ".join(f"{n.strip('_').removesuffix('_kernel')}={us:.1f}" for n, us in sorted(t.items()))
                print(f"B={b:<4d}{name:16s}kernel 1 tile {sbv}, {warps} warps, tile {bv}: {cols} (us)", flush=True)


if __name__ == "__main__":
    main()
