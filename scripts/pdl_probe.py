"""GPU probe: does programmatic dependent launch (kernels/pdl.py) shorten chains of small kernels
inside a CUDA graph, and which argmax launch configuration is fastest at B = 64?

    python scripts/pdl_probe.py --out results.json      (CUDA, Hopper)
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from graphrt.kernels.argmax import argmax_triton
from graphrt.kernels.pdl import pdl_launch
from graphrt.kernels.timing import time_in_graph


@triton.jit
def _scale_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr, WAIT: tl.constexpr, TRIGGER: tl.constexpr):
    if WAIT:
        tl.extra.cuda.gdc_wait()
    if TRIGGER:
        tl.extra.cuda.gdc_launch_dependents()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    tl.store(y_ptr + offs, x * 2, mask=offs < n)


def chain(n_elems, length, wait, trigger, pdl):
    a = torch.randn(n_elems, device="cuda", dtype=torch.bfloat16)
    b = torch.empty_like(a)
    block = 1024
    grid = (triton.cdiv(n_elems, block),)

    def fn():
        src, dst = a, b
        for _ in range(length):
            _scale_kernel[grid](src, dst, n_elems, BLOCK=block, WAIT=wait, TRIGGER=trigger, **pdl_launch(pdl))
            src, dst = dst, src
    return time_in_graph(fn, [()], per_graph=1, replays=50) / length


def after_gemm(pdl, m=1, n=3072, k=2048):
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    z = torch.empty_like(y)
    numel = m * n

    def fn():
        for _ in range(10):
            torch.matmul(x, w.t(), out=y)
            _scale_kernel[(triton.cdiv(numel, 1024),)](y, z, numel, BLOCK=1024, WAIT=pdl, TRIGGER=False,
                                                       **pdl_launch(pdl))
    gemm_only = time_in_graph(lambda: [F.linear(x, w, out=y) for _ in range(10)], [()], per_graph=1) / 10
    return time_in_graph(fn, [()], per_graph=1, replays=50) / 10, gemm_only


def argmax_case(b, v=128256, **kw):
    n_sets = max(2, min(16, 150_000_000 // (b * v * 2)))
    sets = [(torch.randn(b, v, device="cuda", dtype=torch.bfloat16),) for _ in range(n_sets)]
    outs = (torch.empty(b, dtype=torch.bfloat16, device="cuda"), torch.empty(b, dtype=torch.int64, device="cuda"))
    return time_in_graph(lambda x: argmax_triton(x, out=outs, **kw), sets)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="pdl_probe.json")
    args = ap.parse_args()
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    rows = []
    for n_elems in (2048, 65536):
        for wait, trigger, pdl in [(False, False, False), (True, False, True), (True, True, True), (True, True, False)]:
            t = chain(n_elems, 64, wait, trigger, pdl)
            rows.append({"case": "chain", "n": n_elems, "wait": wait, "trigger": trigger, "pdl": pdl, "us": t})
            print(f"chain n={n_elems} wait={wait} trigger={trigger} pdl={pdl}: {t:.2f} us/kernel", flush=True)
    for pdl in (False, True):
        t, g = after_gemm(pdl)
        rows.append({"case": "gemm+scale", "pdl": pdl, "us": t, "gemm_us": g})
        print(f"gemm(1x2048 . 3072x2048) + scale pdl={pdl}: {t:.2f} us/pair (gemm alone {g:.2f})", flush=True)
    for b in (1, 8, 64, 256):
        for pdl in (False, True):
            t = argmax_case(b, pdl=pdl)
            rows.append({"case": "argmax", "B": b, "pdl": pdl, "us": t})
            print(f"argmax B={b} default config pdl={pdl}: {t:.2f} us", flush=True)
    for b in (1, 8, 64):
        best = None
        for block_v, per_row, warps, fused in itertools.product((1024, 2048, 4096), (4, 8, 16, 32, 64, 128),
                                                               (4, 8), (False, True)):
            if b * per_row > 8192 or (b == 1 and per_row < 16):
                continue
            try:
                t = argmax_case(b, block_v=block_v, num_splits=per_row, num_warps=warps, fused=fused, pdl=True)
            except Exception as exc:  # a config Triton cannot compile is skipped, not fatal
                print(f"argmax B={b} {block_v}/{per_row}/{warps}/{fused}: {exc}")
                continue
            rows.append({"case": "argmax_sweep", "B": b, "block_v": block_v, "splits": per_row, "warps": warps,
                         "fused": fused, "us": t})
            if best is None or t < best[0]:
                best = (t, block_v, per_row, warps, fused)
        print(f"argmax B={b} best (pdl): {best[0]:.2f} us block_v={best[1]} splits={best[2]} warps={best[3]} "
              f"fused={best[4]}", flush=True)
    res["rows"] = rows
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
