"""All-reduce latency at decode sizes, captured in a CUDA graph as the TP cycle captures it:
NCCL (torch.distributed.all_reduce) against torch's symmetric-memory one-shot and two-shot
all-reduce (P2P loads over NVLink, no multicast). Run: torchrun --nproc-per-node N
scripts/allreduce_bench.py [--out FILE]."""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist


def timed(fn, reps=65, iters=20):
    """us per call: reps calls in one graph (a decode step's 2 per layer + 1), replayed."""
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    dist.barrier()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        g.replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) * 1e3 / (iters * reps)


def _symm_mem(x, ref, name) -> dict:
    import torch.distributed._symmetric_memory as symm_mem

    ops = torch.ops.symm_mem
    buf = symm_mem.empty(x.numel(), dtype=x.dtype, device=x.device)
    symm_mem.rendezvous(buf, name)
    buf.copy_(x)
    out = ops.one_shot_all_reduce(buf, "sum", name)
    row = {"one_shot_err": float((out.float() - ref.float()).abs().max())}
    row["one_shot_us"] = timed(lambda: ops.one_shot_all_reduce(buf, "sum", name))
    row["copy_one_shot_us"] = timed(lambda: (buf.copy_(x), ops.one_shot_all_reduce(buf, "sum", name)))
    buf.copy_(x)
    ops.two_shot_all_reduce_(buf, "sum", name)
    row["two_shot_err"] = float((buf.float() - ref.float()).abs().max())
    row["two_shot_us"] = timed(lambda: ops.two_shot_all_reduce_(buf, "sum", name))
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    args = ap.parse_args()
    rank = int(os.environ["RANK"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    group = dist.group.WORLD
    import torch.distributed._symmetric_memory as symm_mem

    if hasattr(symm_mem, "enable_symm_mem_for_group"):
        symm_mem.enable_symm_mem_for_group(group.group_name)
    rows = []
    for m in (1, 4, 8, 16, 32, 64, 256):
        n = m * 4096
        x = torch.randn(n, dtype=torch.bfloat16, device="cuda")
        ref = x.clone()
        dist.all_reduce(ref)
        row = {"rows": m, "bytes": 2 * n}
        y = x.clone()
        row["nccl_us"] = timed(lambda y=y: dist.all_reduce(y))
        try:
            row.update(_symm_mem(x, ref, group.group_name))
        except Exception as exc:  # noqa: BLE001 - report what the build lacks
            row["symm_mem_error"] = f"{type(exc).__name__}: {exc}"[:300]
        rows.append(row)
        if rank == 0:
            print(json.dumps(row), flush=True)
    if rank == 0 and args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
