"""qkv + rotary + KV store at 17-256 tokens, on CUDA: the two-launch path (the qkv product on cuBLAS,
then rotary_store_kv) against the fused DOT launch of kernels/qkv_rotary.py with the dispatcher's
tiles (gemv_config.dot_rotary_config) and with a few others.

    python scripts/qkv_rotary_sweep.py --out qkv_rotary.json [--ms 24,32,48,64]

For the qkv matrices of llama-1b-shape, llama-8b-shape and SmolLM2-135M; time_in_graph (CUDA graph
replay, weights rotated past the L2). Prints one row per (shape, M): the two launches' us, the
dispatcher's pick (where it fuses) and the five fastest tiles.
"""

from __future__ import annotations

import argparse
import json

import torch
from graphrt.kernels import qkv_rotary
from graphrt.kernels.bench import num_input_sets
from graphrt.kernels.timing import time_in_graph

from graphrt.models.layers import Rotary

SHAPES = {"1b": (2048, 32, 8, 64), "8b": (4096, 32, 8, 128), "smollm2": (576, 9, 3, 64)}  # hidden, hq, hkv, d
TILES = [(64, 128, 4, 4), (64, 64, 4, 5), (32, 128, 4, 4), (32, 64, 4, 5), (128, 128, 4, 3), (64, 128, 4, 3),
         (16, 256, 4, 3)]  # block_n (weight rows), block_k, warps, stages


def _row(name: str, m: int, ws, h: int, hq: int, hkv: int, d: int, rot: Rotary, dev) -> dict:
    """Times of one (shape, M): the two launches, the dispatcher's pick, and every tile of TILES."""
    kc = torch.zeros(64, 16, hkv, d, device=dev, dtype=torch.bfloat16)
    vc = torch.zeros_like(kc)
    pos, slots = torch.arange(100, 100 + m, device=dev), torch.arange(7, 7 + m, device=dev)
    args = (None, pos, rot.cos, rot.sin, kc, vc, slots)
    kw = dict(num_q_heads=hq, num_kv_heads=hkv)
    sets = [(torch.randn(m, h, device=dev, dtype=torch.bfloat16), w) for w in ws]
    two = time_in_graph(lambda x, w: qkv_rotary.qkv_rotary_store_reference(x, w, *args, **kw), sets, replays=15)
    pick = qkv_rotary.dot_rotary_config
    chosen = pick(m, *ws[0].shape)
    fused = lambda x, w: qkv_rotary.qkv_rotary_store(x, w, *args, **kw)  # noqa: E731
    picked = time_in_graph(fused, sets, replays=15) if chosen is not None else None
    times = {}
    try:
        for bn, bk, nw, st in TILES:
            tile = dict(use_dot=True, reduce_each=False, block_n=bn, block_k=bk, num_warps=nw, num_stages=st,
                        programs_per_sm=0)
            qkv_rotary.dot_rotary_config = lambda *_, t=tile: dict(t)
            times[f"{bn},{bk},{nw},{st}"] = time_in_graph(fused, sets, replays=15)
    finally:
        qkv_rotary.dot_rotary_config = pick
    best = sorted(times.items(), key=lambda kv: kv[1])[:5]
    tile_s = "none" if chosen is None else "{block_n},{block_k},{num_warps},{num_stages}".format(**chosen)
    picked_s = "-" if picked is None else f"{picked:.2f}"
    print(f"{name:<8} M={m:>2}: two launches {two:6.2f} us; dispatcher ({tile_s}) {picked_s}; fastest "
          + ", ".join(f"{t}: {u:.2f}" for t, u in best), flush=True)
    return {"two_launches_us": two, "dispatcher": chosen, "dispatcher_us": picked, "tiles_us": times}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--ms", default="24,32,48,64", help="token counts (17-256; past 64 in row tiles)")
    args = ap.parse_args()
    dev = torch.device("cuda")
    results = {}
    for name, (h, hq, hkv, d) in SHAPES.items():
        n = (hq + 2 * hkv) * d
        ws = [torch.randn(n, h, device=dev, dtype=torch.bfloat16) / h**0.5 for _ in range(num_input_sets(n * h * 2))]
        rot = Rotary(d, 10000.0, None, 4096, dev)
        for m in (int(x) for x in args.ms.split(",")):
            results[f"{name}/{m}"] = _row(name, m, ws, h, hq, hkv, d, rot, dev)
        del ws
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
