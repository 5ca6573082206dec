"""The all-reduce inside the row-parallel GEMV (kernels/push_reduce.py) against the GEMV
followed by torch's symmetric-memory one-shot all-reduce, and against no all-reduce at all, in a
chain shaped like decode at batch 1 (or --rows tokens a step): 32 x (row-parallel [H, I] GEMV,
all-reduce, column-parallel [I, H] GEMV), captured in one CUDA graph, replayed. Run: torchrun
--nproc-per-node N scripts/push_bench.py [--hidden H] [--inner I] [--rows R] [--out FILE]."""

from __future__ import annotations

import argparse
import json
import os

import torch
from allreduce_bench import timed  # scripts/ is sys.path[0] under torchrun
from graphrt.kernels.linear import linear, linear_pushed

from graphrt.parallel.group import init_tensor_parallel


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--inner", type=int, default=7168)  # llama-8b-shape's MLP at TP = 2
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--rows", type=int, default=1, help="tokens a step: 1, 2 or 3-16 (the DOT path)")
    ap.add_argument("--out")
    args = ap.parse_args()
    tp = init_tensor_parallel()
    dev = torch.device("cuda", torch.cuda.current_device())
    h, i = args.hidden, args.inner
    os.environ["GRAPHRT_ALLREDUCE"] = "auto"  # the one-shot kernel and the push buffers
    tp.use_symmetric_memory(dev, torch.bfloat16, 64 * h, h)
    gen = torch.Generator(device=dev).manual_seed(tp.rank)
    mk = lambda n, k: (torch.randn(n, k, device=dev, generator=gen) / k**0.5).to(torch.bfloat16)  # noqa: E731
    # one matrix pair per layer, so the chain reads the weights from DRAM as decode does
    down = [mk(h, i) for _ in range(args.layers)]
    up = [mk(i, h) for _ in range(args.layers)]
    v0 = torch.randn(args.rows, i, device=dev, generator=gen).to(torch.bfloat16)

    def chain(reduce):
        v = v0
        for a, b in zip(down, up):
            v = linear(reduce(v, a), b)
        return v

    def pushed(v, a):
        y = linear_pushed(v, a, tp.push)
        if y is None:
            raise SystemExit(f"the push does not take {args.rows} rows of [{h}, {i}]")
        return y

    rows = {
        "no all-reduce": lambda v, a: linear(v, a),
        "GEMV + one-shot all-reduce": lambda v, a: tp.one_shot(linear(v, a)),
        "GEMV with the all-reduce inside": pushed,
    }
    res = {}
    for name, fn in rows.items():
        res[name] = timed(lambda fn=fn: chain(fn), reps=1) / args.layers
    if tp.rank == 0:
        print(f"us per layer ({args.layers} layers of [{h}, {i}] + [{i}, {h}] GEMVs, {args.rows} rows, "
              f"{tp.world_size} ranks):")
        for name, us in res.items():
            print(f"  {name:34s} {us:8.2f}")
        if args.out:
            with open(args.out, "w") as f:
                json.dump(res, f, indent=1)
    os._exit(0)


if __name__ == "__main__":
    main()
