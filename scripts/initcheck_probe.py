#!/usr/bin/env python3
"""Minimal cases for compute-sanitizer initcheck, to tell its blind spots from graphrt bugs.

The bf16 captured-cycle runs of scripts/sanitize_driver.py draw ~10^5 "uninitialized __global__
memory read" reports, the first in the rotary kernel's q/k loads during an eager prefill, whatever
GRAPHRT_PDL and GRAPHRT_GEMV say; the fp32 runs draw one "cudaMemcpy source" report at a graph
launch. Each case here isolates one suspect in a few launches, with nothing of graphrt but the
Triton kernel that reads:

  cublas_bf16   y = x @ W^T by cuBLAS in bf16 (on Hopper its GEMMs store through the tensor memory
                accelerator), then a Triton kernel and a torch kernel read y
  cublas_fp32   the same in fp32 (SIMT GEMMs, ordinary stores)
  triton_bf16   y written by graphrt's Triton GEMV (ordinary stores), then the same reads
  graph_copy    a CUDA graph in which a kernel writes a fresh pool tensor and a copy node copies it
                into a static buffer; replayed three times

Run each case in its own sanitized process and count the reports:
    compute-sanitizer --tool initcheck python scripts/initcheck_probe.py --case cublas_bf16
Natively (no sanitizer) it prints the kernels each case launched (PyTorch profiler), so the log
says which cuBLAS kernel wrote y.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CASES = ("cublas_bf16", "cublas_fp32", "triton_bf16", "graph_copy")


def read_twice(y):
    """A Triton kernel (graphrt's RMSNorm) and a torch reduction read every element of y."""
    from graphrt.kernels.norm import rms_norm

    w = torch.ones(y.shape[1], dtype=y.dtype, device=y.device)
    out = rms_norm(y, w, 1e-6)
    return out.float().sum() + y.float().sum()


def run(case):
    torch.manual_seed(0)
    dev = torch.device("cuda")
    # tiny-preset qkv shape at a 3-token prefill, and a decode-sized one
    shapes = [(3, 64, 192), (16, 2048, 3072)]
    if case == "graph_copy":
        static = torch.zeros(64, device=dev)
        src = torch.randn(64, device=dev)
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fresh = src * 2.0  # warm-up outside the graph
            torch.cuda.synchronize()
            with torch.cuda.graph(g):
                fresh = src * 2.0  # a kernel writes a tensor of the graph's private pool
                static.copy_(fresh)  # a memcpy node reads it
        torch.cuda.current_stream().wait_stream(s)
        for _ in range(3):
            g.replay()
        torch.cuda.synchronize()
        assert torch.equal(static, src * 2.0)
        return
    for m, k, n in shapes:
        dtype = torch.float32 if case == "cublas_fp32" else torch.bfloat16
        x = torch.randn(m, k, device=dev, dtype=dtype)
        w = torch.randn(n, k, device=dev, dtype=dtype)
        if case == "triton_bf16":
            from graphrt.kernels.gemv import gemv_triton

            y = gemv_triton(x, w, None)
        else:
            y = torch.nn.functional.linear(x, w)
        r = read_twice(y)
        torch.cuda.synchronize()
        assert torch.isfinite(r), r


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--case", choices=CASES, required=True)
    ap.add_argument("--kernels", action="store_true", help="list the kernels the case launched (native runs)")
    args = ap.parse_args()
    if args.kernels:
        from torch.profiler import ProfilerActivity, profile

        run(args.case)  # warm-up: compilation and cuBLAS handles outside the listing
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            run(args.case)
        names = sorted({e.name for e in prof.events() if e.device_type.name == "CUDA"})
        print(f"PROBE {args.case} kernels: " + " | ".join(n[:90] for n in names))
    else:
        run(args.case)
    print(f"PROBE {args.case} done", flush=True)


if __name__ == "__main__":
    main()
