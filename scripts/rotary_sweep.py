"""Sweep of the rotary + KV store kernel's tiles (heads a program, warps), on CUDA.

    python scripts/rotary_sweep.py --out rotary.json [--ns 32,64,256,1024,4096]

For the head layouts of llama-1b-shape, llama-8b-shape and SmolLM2-135M and each token count, times
graphrt.kernels.rotary.rotary_store_kv_triton with launch_tile's pick and with every tile of the grid
(time_in_graph: CUDA graph replay, inputs rotated past the L2), and prints the pick against the
five fastest. The runtime calls the kernel past 32 tokens on the llama shapes (past 256 on
SmolLM2's: gemv_config.dot_rotary_config; a verify step at B > 8, decoding at B > 32, prefill);
below that the qkv GEMV stores the rotated k and v itself (scripts/qkv_rotary_sweep.py times that
launch).
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
from graphrt.kernels import rotary
from graphrt.kernels.timing import time_in_graph

SHAPES = {"1b": (32, 8, 64), "8b": (32, 8, 128), "smollm2": (9, 3, 64)}  # q heads, kv heads, head_dim
PAGE = 16


def _input_sets(n, hq, hkv, d):
    """Enough (q, k, v, positions, cos, sin, caches, slots) sets to exceed the L2 between calls."""
    cos = torch.randn(8192, d, device="cuda")
    sin = torch.randn(8192, d, device="cuda")
    sets = []
    for _ in range(max(2, min(16, (200 << 20) // (n * (hq + 2 * hkv) * d * 4)))):
        qkv = torch.randn(n, (hq + 2 * hkv) * d, device="cuda", dtype=torch.bfloat16)
        q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=1)
        blocks = n // PAGE + 2
        k_cache = torch.zeros(blocks, PAGE, hkv, d, device="cuda", dtype=torch.bfloat16)
        sets.append((q.view(n, hq, d), k.view(n, hkv, d), v.view(n, hkv, d),
                     torch.randint(0, 8192, (n,), device="cuda"), cos, sin, k_cache, torch.zeros_like(k_cache),
                     torch.randperm(blocks * PAGE, device="cuda")[:n]))
    return sets


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--ns", default="32,64,256,1024,4096", help="token counts")
    args = ap.parse_args()
    pick = rotary.launch_tile
    results = {}
    for name, (hq, hkv, d) in SHAPES.items():
        for n in (int(x) for x in args.ns.split(",")):
            sets = _input_sets(n, hq, hkv, d)
            tiles = {pick(n, hq + hkv)} | {(h, w) for h in sorted({1, 4, 8, 16, triton.next_power_of_2(hq + hkv)})
                                           for w in (1, 2, 4)}
            times = {}
            for heads, warps in sorted(tiles):
                rotary.launch_tile = lambda *_, t=(heads, warps): t
                times[f"{heads},{warps}"] = time_in_graph(rotary.rotary_store_kv_triton, sets, per_graph=20,
                                                          replays=15)
            rotary.launch_tile = pick
            chosen = "{},{}".format(*pick(n, hq + hkv))
            best = sorted(times.items(), key=lambda kv: kv[1])[:5]
            print(f"{name} n={n}: launch_tile {chosen} {times[chosen]:.2f} us; fastest (heads,warps: us) "
                  + ", ".join(f"{k}: {t:.2f}" for k, t in best), flush=True)
            results[f"{name}/{n}"] = {"launch_tile": chosen, "us": times}
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
