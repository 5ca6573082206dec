"""Where the fused rejection sampler's time goes, and which launch knobs are fastest (CUDA only).

    python scripts/rejection_sweep.py --out rej.json [--baseline old_rejection.py] [--budget 120]

(an older version to compare: git show 354951a:kernels/rejection.py > scripts/_old_rejection.py;
the whole sweep takes ~60 s on an H200, compiles included)

K = 3, V = 128256, bf16 target logits, B in 1 / 8 / 64 / 256, inputs as in kernels/bench.py (drafts:
the target argmax, every other request a random id; temperature 0 for greedy, 1 otherwise),
rotating enough input sets to exceed L2. Every figure is graphrt.kernels.timing.time_in_graph
(CUDA-graph replay, median us per call):
  - "call": the whole call, greedy / one-hot / full q (and the same for --baseline, a copy of an
    older kernels/rejection.py, so before/after come from one run);
  - "knobs": the whole call with some fields of its default LaunchConfig changed.
Stops adding knob rows once --budget seconds have passed (compiles dominate), and rewrites --out
after every row so a cut-off run still leaves its results.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import time

import torch
from graphrt.kernels.rejection import launch_config, rejection_sample_triton
from graphrt.kernels.timing import time_in_graph

K, V = 3, 128256
BS = (1, 8, 64, 256)
_L2_BYTES = 50 << 20


def make_sets(b: int, mode: str) -> list[tuple]:
    nbytes = b * (K + 1) * V * 2 * (2 if mode == "fullq" else 1)
    n = max(2, min(16, -(-3 * _L2_BYTES // nbytes)))
    temp = 0.0 if mode == "greedy" else 1.0
    sets = []
    for i in range(n):
        g = torch.Generator(device="cuda").manual_seed(1000 * b + i)
        target = torch.randn(b, K + 1, V, device="cuda", dtype=torch.bfloat16, generator=g)
        qlog = (torch.randn(b, K, V, device="cuda", dtype=torch.bfloat16, generator=g)
                if mode == "fullq" else None)
        drafts = target[:, :K].argmax(-1)
        drafts[::2] = torch.randint(0, V, drafts[::2].shape, device="cuda", generator=g)
        sets.append((target, drafts, torch.full((b,), temp, device="cuda"),
                     torch.arange(b, device="cuda"), torch.arange(b, device="cuda"), qlog))
    return sets


def timed(fn, sets, **kw) -> float | str:
    def call(t, d, tt, s, p, q):
        return fn(t, d, tt, s, p, draft_logits=q, **kw)
    try:
        return round(time_in_graph(call, sets), 2)
    except Exception as exc:  # a knob the device or Triton version does not take
        return f"error: {type(exc).__name__}: {str(exc)[:200]}"


# (label, modes, batch sizes, LaunchConfig fields) in priority order: the first rows matter most.
KNOBS = [
    ("prune=False", ("onehot",), BS, dict(prune=False)),
    ("prune=False,race_block_v=4096", ("onehot",), (8, 64, 256), dict(prune=False, race_block_v=4096)),
    ("prune=False,race_block_v=8192", ("onehot",), (8, 64, 256), dict(prune=False, race_block_v=8192)),
    ("prune=False,fuse_race=False,race_block_v=4096", ("onehot",), (1,),
     dict(prune=False, fuse_race=False, race_block_v=4096)),
    ("prune=False,fuse_race=False,race_block_v=8192", ("onehot",), (1,),
     dict(prune=False, fuse_race=False, race_block_v=8192)),
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--baseline", default=None, help="path of an older rejection.py to time beside")
    ap.add_argument("--budget", type=float, default=120.0, help="seconds; knob rows stop after it")
    args = ap.parse_args()
    t0 = time.time()
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "K": K, "V": V,
           "call": [], "knobs": []}
    import triton
    res["triton"] = triton.__version__

    def dump():
        res["elapsed_s"] = round(time.time() - t0, 1)
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)

    base = None
    if args.baseline:
        spec = importlib.util.spec_from_file_location("rejection_baseline", args.baseline)
        base = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(base)
    sets = {}
    for b in BS:
        for mode in ("greedy", "onehot", "fullq"):
            sets[b, mode] = make_sets(b, mode)
            row = {"B": b, "mode": mode, "ours": timed(rejection_sample_triton, sets[b, mode])}
            if base is not None:
                row["baseline"] = timed(base.rejection_sample_triton, sets[b, mode])
            res["call"].append(row)
            print(row, flush=True)
            dump()
            if mode == "fullq" and b != 64:
                del sets[b, mode]
    for label, modes, bs, kw in KNOBS:
        for b in bs:
            for mode in modes:
                if time.time() - t0 > args.budget:
                    res["cut_off_at"] = label
                    dump()
                    return
                config = dataclasses.replace(launch_config(b, K, mode == "fullq"), **kw)
                us = timed(rejection_sample_triton, sets[b, mode], config=config)
                row = {"knob": label, "B": b, "mode": mode, "us": us}
                res["knobs"].append(row)
                print(row, flush=True)
                dump()
    dump()


if __name__ == "__main__":
    main()
