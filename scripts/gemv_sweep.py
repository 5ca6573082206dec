"""Sweep of graphrt.kernels.gemv against cuBLAS (F.linear) at decode shapes, on CUDA.

    python scripts/gemv_sweep.py --out gemv.json [--budget-s 130] [--shapes 1b.lm_head --ms 1 --all-tiles]

For the projections of the llama-1b and llama-8b shapes (and the 1b lm_head, for reference) and
M in {1, 4, 8, 16}, times F.linear and every Triton config of a pruned grid with
time_in_graph (CUDA graph replay, weights rotated over enough copies to exceed the 50 MB L2), then
prints one row per (shape, M): cuBLAS us, best Triton us and its config, GB/s and % of 4.3 TB/s,
and the dispatcher's time (graphrt.kernels.linear.linear: Triton or cuBLAS as select_config says).
Every config's output is also checked against F.linear (max error relative to max |y|).
--gated (gate_up shapes): the product with the SiLU in its epilogue (gemv_triton(gated=True), DOT
tiles unsplit) against cuBLAS then silu_and_mul, the dispatcher being kernels/linear.linear_silu_mul.
All timings go to the JSON file. The grid is pruned so the whole sweep (compiles included) fits one
device call; past --budget-s the remaining Triton configs are skipped.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F
from graphrt.kernels.activation import silu_and_mul
from graphrt.kernels.bench import num_input_sets
from graphrt.kernels.fp8_weight import dense, quantize_fp8
from graphrt.kernels.gemv import gemv_triton
from graphrt.kernels.gemv_config import _split_for, select_config
from graphrt.kernels.linear import linear, linear_silu_mul
from graphrt.kernels.timing import time_in_graph

PEAK_GBS = 4300.0  # the read bandwidth the "% of peak" column divides by

SHAPES = [  # (name, N, K)
    ("1b.qkv", 3072, 2048), ("1b.o", 2048, 2048), ("1b.gate_up", 16384, 2048), ("1b.down", 2048, 8192),
    ("8b.qkv", 6144, 4096), ("8b.o", 4096, 4096), ("8b.gate_up", 28672, 4096), ("8b.down", 4096, 14336),
    ("1b.lm_head", 128256, 2048),
    # EAGLE-3 heads' 32000-row LM heads (a draft step's one row)
    ("1b.draft_head", 32000, 2048), ("8b.draft_head", 32000, 4096),
    # ... their qkv (over [embedding ; hidden], 2H wide) and fc (3H -> H)
    ("1b.draft_qkv", 3072, 4096), ("1b.draft_fc", 2048, 6144), ("8b.draft_qkv", 6144, 8192),
    ("8b.draft_fc", 4096, 12288),
    # SmolLM2-135M: latency-bound, where a verify step's 4 rows run one program per row (per_row)
    ("135m.qkv", 960, 576), ("135m.o", 576, 576), ("135m.gate_up", 3072, 576), ("135m.down", 576, 1536),
    # llama-8b-shape at TP = 2, one rank's slices (column-parallel qkv, gate_up and LM head; row-parallel o, down)
    ("8b-tp2.qkv", 3072, 4096), ("8b-tp2.o", 4096, 2048), ("8b-tp2.gate_up", 14336, 4096),
    ("8b-tp2.down", 4096, 7168), ("8b-tp2.lm_head", 64128, 4096),
    # ... and at TP = 4
    ("8b-tp4.qkv", 1536, 4096), ("8b-tp4.o", 4096, 1024), ("8b-tp4.gate_up", 7168, 4096),
    ("8b-tp4.down", 4096, 3584), ("8b-tp4.lm_head", 32064, 4096),
]
MS = [1, 2, 4, 8, 16]

# FMA (M <= 2; at M = 4 it is slower than cuBLAS: M x-loads and conversions per weight
# load): (block_n, block_k, num_warps, reduce_each). 16-byte loads per thread per step =
# block_n * block_k / (8 * 32 * warps); reduce_each frees the per-element accumulators for more.
FMA_TILES = [(4, 512, 4, False), (4, 1024, 4, False), (2, 2048, 4, False), (16, 512, 4, False),
             (8, 1024, 4, False), (2, 2048, 4, True), (4, 2048, 4, True), (8, 2048, 4, True),
             (16, 1024, 4, True), (8, 2048, 8, True), (4, 1024, 4, True)]
# ... and for K <= 2048 (SmolLM2's latency-bound matrices): narrower K tiles, fewer warps
FMA_SMALL_K_TILES = [(4, 512, 2, False), (8, 512, 2, False), (16, 512, 4, False), (8, 256, 2, False),
                     (16, 256, 2, False), (32, 256, 4, False), (4, 512, 1, False), (8, 512, 4, True),
                     (16, 512, 4, True), (32, 512, 4, True), (8, 256, 1, True)]
# (block_n, block_k, num_warps, num_stages)
DOT_TILES = [(64, 128, 4, 4), (64, 128, 4, 3), (64, 128, 4, 5), (64, 256, 4, 3), (64, 256, 4, 4), (64, 64, 4, 6),
             (128, 128, 4, 3), (128, 128, 4, 4), (128, 128, 8, 4), (128, 256, 8, 3), (32, 256, 4, 4), (128, 64, 4, 5)]
PROGRAMS_PER_SM = [1, 2, 3, 4, 6]
# --fp8 (kernels/fp8_weight.py): a 16-byte load holds 16 weights, so wider K tiles keep as many bytes in flight
FP8_FMA_TILES = [(2, 2048, 4, True), (4, 2048, 4, True), (2, 4096, 4, True), (4, 4096, 4, True), (4, 4096, 8, True),
                 (8, 4096, 8, True), (8, 2048, 4, True), (4, 1024, 4, False), (8, 1024, 4, False),
                 (4, 2048, 4, False), (16, 1024, 4, True), (4, 2048, 2, True)]


def configs(m: int, n: int, k: int, sms: int, big: bool, fma_max_m: int = 2, fp8: bool = False,
            gated: bool = False) -> list[dict]:
    if gated:  # the activation needs the whole K sum in one program: DOT tiles, unsplit
        return [dict(use_dot=True, reduce_each=False, block_n=bn, block_k=bk, num_warps=w, num_stages=st, split_k=1)
                for bn, bk, w, st in DOT_TILES]
    out = []
    tiles = []
    if m <= fma_max_m:
        fma = FP8_FMA_TILES if fp8 else FMA_TILES + (FMA_SMALL_K_TILES if k <= 2048 else [])
        for bn, bk, warps, red in fma:
            if m > 1 and not red and bn * bk // (8 * 32 * warps) > 4:
                continue  # 8 fp32 partials per 16-byte load and row: spills
            tiles.append(dict(use_dot=False, reduce_each=red, block_n=bn, block_k=bk, num_warps=warps,
                              num_stages=1))
    if m > 1 and not fp8:  # an FP8 tile widened for the MMA measured slower than the bf16 matrix
        for bn, bk, warps, stages in DOT_TILES:
            tiles.append(dict(use_dot=True, reduce_each=False, block_n=bn, block_k=bk, num_warps=warps,
                              num_stages=stages))
    if big:  # lm_head-sized: plenty of tiles, a few configs are enough for a reference point
        tiles = tiles[:2] + [t for t in tiles if t["use_dot"]][:1]
    for t in tiles:
        n_tiles = -(-n // t["block_n"])
        steps = -(-k // t["block_k"])
        # The FMA path measured best unsplit nearly everywhere: one split candidate only.
        pps = PROGRAMS_PER_SM if t["use_dot"] else [8]
        splits = sorted({1} | {_split_for(n_tiles, steps, p, sms) for p in pps})
        for s in splits:
            out.append(dict(t, split_k=s))
    return out


def _rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref).abs().max() / ref.abs().max())


def _write(path, dev, t0, rows) -> None:
    with open(path, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(dev), torch=torch.__version__,
                       triton=__import__("triton").__version__, elapsed_s=time.perf_counter() - t0,
                       peak_gbs=PEAK_GBS, rows=rows), f, indent=1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON output path")
    ap.add_argument("--budget-s", type=float, default=130.0, help="skip remaining Triton configs past this")
    ap.add_argument("--shapes", default=None, help="comma-separated shape names (default: all)")
    ap.add_argument("--ms", default=None, help="comma-separated M values (default: 1,2,4,8,16)")
    ap.add_argument("--all-tiles", action="store_true", help="do not prune the grid for lm_head-sized shapes")
    ap.add_argument("--fma-max-m", type=int, default=2, help="sweep the FMA path (all rows per program) up to this M")
    ap.add_argument("--fp8", action="store_true",
                    help="FP8 weights (kernels/fp8_weight.py); the cuBLAS column is the bf16 matrix's")
    ap.add_argument("--gated", action="store_true",
                    help="gate_up with the SiLU in the epilogue, against cuBLAS then silu_and_mul")
    args = ap.parse_args()
    g = args.gated
    if args.gated and args.fp8:
        raise SystemExit("--gated times bf16 matrices only")
    if not torch.cuda.is_available():
        raise SystemExit("gemv_sweep needs CUDA")
    t0 = time.perf_counter()
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    dtype = torch.bfloat16
    rows = []
    print(f"{'shape':<12} {'N':>6} {'K':>6} {'M':>3} {'cuBLAS us':>9} {'GB/s':>6} {'triton us':>9} {'GB/s':>6} "
          f"{'%4.3T':>6} {'disp us':>8}  best config")
    shapes = [s for s in SHAPES if args.shapes is None or s[0] in args.shapes.split(",")]
    ms = [int(m) for m in args.ms.split(",")] if args.ms else MS
    for name, n, k in shapes:
        big = n * k > 200_000_000 and not args.all_tiles
        wbytes = n * k * (1 if args.fp8 else 2)
        sets_w = [torch.randn(n, k, device=dev, dtype=dtype) * 0.02 for _ in range(num_input_sets(wbytes))]
        if args.fp8:
            sets_w = [quantize_fp8(w) for w in sets_w]
        for m in ms:
            sets = [(torch.randn(m, k, device=dev, dtype=dtype), w) for w in sets_w]
            nbytes = wbytes + 2 * m * k + 2 * m * n
            ref_us = time_in_graph(lambda x, w: silu_and_mul(F.linear(x, w)) if g else F.linear(x, dense(w)), sets,
                                   replays=15)
            ref = F.linear(sets[0][0].float(), dense(sets[0][1]).float())
            if g:
                ref = F.silu(ref[:, : n // 2]) * ref[:, n // 2:]
            # The dispatcher (graphrt.kernels.linear): Triton or cuBLAS, as select_config says.
            heur_us = time_in_graph(lambda x, w: linear_silu_mul(x, w) if g else linear(x, w), sets, replays=15)
            results = []
            for cfg in configs(m, n, k, sms, big, args.fma_max_m, args.fp8, g):
                if time.perf_counter() - t0 > args.budget_s:
                    break
                try:
                    us = time_in_graph(lambda x, w, c=cfg: gemv_triton(x, w, gated=g, **c), sets, replays=15)
                    err = _rel_err(gemv_triton(*sets[0], gated=g, **cfg), ref)
                except Exception as exc:  # a config that does not compile (shared memory, registers)
                    results.append(dict(cfg, error=f"{type(exc).__name__}: {str(exc)[:300]}"))
                    continue
                results.append(dict(cfg, us=us, rel_err=err))
                if err > 1e-2:
                    print(f"  WRONG RESULT {name} M={m} {cfg}: rel err {err:.3g}", flush=True)
            timed = [r for r in results if "us" in r and r["rel_err"] <= 1e-2]
            best = min(timed, key=lambda r: r["us"]) if timed else dict(us=heur_us, note="heuristic only")
            if heur_us < best["us"]:
                best = dict(select_config(m, n, k, gated=g) or dict(use_dot=None), us=heur_us, note="dispatcher")
            row = dict(shape=name, N=n, K=k, M=m, bytes=nbytes, cublas_us=ref_us, heuristic_us=heur_us,
                       best_us=best["us"], best=best, configs=results)
            rows.append(row)
            _write(args.out, dev, t0, rows)  # after every row: a cut-off run keeps what it measured
            path = {True: "dot", False: "fma_r" if best.get("reduce_each") else "fma", None: "cuBLAS"}
            cfg_s = path[best.get("use_dot")] + " " + " ".join(
                f"{key}={best[key]}" for key in ("block_n", "block_k", "num_warps", "num_stages", "split_k")
                if key in best)
            print(f"{name:<12} {n:>6} {k:>6} {m:>3} {ref_us:>9.2f} {nbytes / ref_us / 1e3:>6.0f} "
                  f"{best['us']:>9.2f} {nbytes / best['us'] / 1e3:>6.0f} "
                  f"{100 * nbytes / best['us'] / 1e3 / PEAK_GBS:>5.0f}% {heur_us:>8.2f}  {cfg_s}", flush=True)
        del sets_w, sets
        torch.cuda.empty_cache()
    print(f"sweep took {time.perf_counter() - t0:.0f} s -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
