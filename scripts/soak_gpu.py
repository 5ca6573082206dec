#!/usr/bin/env python3
"""GPU soak: >= 20,000 decode cycles under CUDA graphs with requests arriving and
finishing at random, then memory, KV-pool and reproducibility checks.

    python scripts/soak_gpu.py --cycles 20000

Choice of model: the `tiny` preset (V = 512, 2 layers, H = 64) in fp32 with a self-draft (default)
or an EAGLE-1 head, K = 3, written at random into a temp folder. A captured cycle of it replays in
well under a millisecond, so 20,000 cycles fit the time budget while still walking every bucket,
slot and KV block many thousands of times; a bigger model would test the same host/device
bookkeeping more slowly. fp32 because the re-run check compares tokens exactly: in bf16 a random
model's argmax ties often and GEMMs of different batch sizes may round differently (`--dtype bf16`
runs it anyway and reports any mismatch as a failure).

The runtime: max_batch_size 12, buckets (1, 2, 4, 8, 12), a KV pool of 40 usable blocks of 16
(so admissions wait for blocks), pipelined cycles (cycle n+1 launched before cycle n is read, as
in production). Arrival rates change every 25 cycles (0.05 / 0.3 / 0.8 per cycle, 1-3 requests at
a time) so batches grow and shrink across every bucket; prompts 1..20 tokens, max_new_tokens 1..30,
temperatures {0, 0.7, 1.3}, 85% seeded, 30% with 40 stop tokens, half ignoring EOS. The driver is
tests/test_soak.py's (the CPU version of the same soak); it checks the host bookkeeping after
every cycle (each KV block owned once or free, slots unique).

Checks at the end (each printed; any failure -> FAIL and exit status 1):
  1. torch.cuda.memory_allocated() after the soak drains == its value after warm-up + capture
     (both printed, with the peak and memory_reserved);
  2. every KV block back in the free pool, every slot free, nothing running or waiting;
  3. every request finished ("stop"/"length") within max_new_tokens, every token in [0, V), the
     tokens step() streamed == the generation's;
  4. a sample of seeded requests (greedy and sampled) re-run alone on a fresh runtime (graphs too)
     gives identical tokens.
Last line: "SOAK PASS ..." or "SOAK FAIL ...".
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from graphrt.checkpoint import load_checkpoint  # noqa: E402
from graphrt.checkpoint_writer import self_draft, write_random_checkpoint  # noqa: E402
from graphrt.params import SamplingParams  # noqa: E402
from tests.test_soak import Soak, SoakConfig  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cycles", type=int, default=20000)
    ap.add_argument("--draft", choices=["self", "eagle"], default="self")
    ap.add_argument("--dtype", choices=list(DTYPES), default="fp32")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--max-batch-size", type=int, default=12)
    ap.add_argument("--buckets", default="1,2,4,8,12")
    ap.add_argument("--kv-blocks", type=int, default=40)
    ap.add_argument("--prefill-chunk-tokens", type=int, default=None,
                    help="chunked prefill: prompts longer than this prefill in chunks between cycles")
    ap.add_argument("--rerun", type=int, default=16, help="seeded requests re-run alone at the end")
    ap.add_argument("--seed", type=int, default=20261122)
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs (for comparison)")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of this script (eager, no memory check)")
    args = ap.parse_args()
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("SOAK FAIL: no CUDA device")
        return 2
    cuda = dev.type == "cuda"
    args.eager = args.eager or not cuda
    dtype = DTYPES[args.dtype]
    tmp = Path(tempfile.mkdtemp(prefix="graphrt-soak-"))
    write_random_checkpoint(tmp / "target", args.preset, dtype=dtype, seed=0)
    if args.draft == "self":
        self_draft(tmp / "target", tmp / "draft", 1, kind="lm")
    else:
        write_random_checkpoint(tmp / "draft", args.preset, kind="eagle", dtype=dtype, seed=1,
                                target=tmp / "target")
    target = load_checkpoint(tmp / "target", dtype=dtype, device=dev)
    draft = load_checkpoint(tmp / "draft", dtype=dtype, device=dev)
    buckets = tuple(int(b) for b in args.buckets.split(","))
    cfg = SoakConfig(max_batch_size=args.max_batch_size, buckets=buckets, kv_blocks=args.kv_blocks,
                     max_queue=2 * args.max_batch_size, use_cuda_graphs=not args.eager,
                     prefill_chunk_tokens=args.prefill_chunk_tokens)
    print(f"soak: preset {args.preset} {args.dtype}, draft {args.draft}, K={cfg.num_draft_tokens}, "
          f"max_batch_size {cfg.max_batch_size}, buckets {buckets}, {cfg.kv_blocks} KV blocks of "
          f"{cfg.block_size}, graphs {not args.eager}, prefill chunks {args.prefill_chunk_tokens}, "
          f"{args.cycles} cycles, seed {args.seed}", flush=True)
    failures: list[str] = []

    def memory() -> int:
        if not cuda:
            return 0
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated()

    info: dict[str, object] = {}
    try:
        rt = cfg.runtime(target, draft, dev)
        assert rt.overlap or not cuda, "expected pipelined cycles on CUDA"
        if not args.eager:  # every graph up front, as a server does: none is captured during the soak,
            # where its memory would count as the soak's (prefix caching's prefills have graphs of their own)
            rt.capture(inspect_kernels=False, prefill=True)
        # Warm-up: every prompt length and budget extreme once, graphs captured, then idle.
        warm = Soak(rt, cfg, seed=args.seed ^ 0x5A5A)
        for p_len, m in ((1, 1), (cfg.max_prompt, cfg.max_new), (7, 13)):
            warm.submit([3] * p_len, SamplingParams(max_new_tokens=m, ignore_eos=True))
        warm.run(200)
        warm.drain()
        warm.check_final()
        mem_base = memory()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        captured = rt.cycle.graphs is not None
        print(f"warm-up done: graphs captured {captured}, memory_allocated {mem_base} B, "
              f"reserved {torch.cuda.memory_reserved() if cuda else 0} B", flush=True)
        if not args.eager:
            assert captured, "graphs were not captured"

        soak = Soak(rt, cfg, seed=args.seed)
        t0 = time.perf_counter()
        report = max(1, args.cycles // 10)

        def progress(s, i):
            if i and i % report == 0:
                el = time.perf_counter() - t0
                print(f"  cycle {i}: {len(s.requests)} requests, running {len(rt._running)}, waiting "
                      f"{len(rt._waiting)}, free blocks {rt.allocator.num_free}, {el:.1f} s "
                      f"({1e3 * el / i:.3f} ms/cycle)", flush=True)

        soak.run(args.cycles, on_cycle=progress)
        soak.drain()
        elapsed = time.perf_counter() - t0
        mem_end = memory()
        peak = torch.cuda.max_memory_allocated() if cuda else 0
        reasons = {r: sum(rt.get_generation(s.rid).finish_reason == r for s in soak.requests.values())
                   for r in ("stop", "length")}
        info.update(cycles=soak.cycles, requests=len(soak.requests), buckets=sorted(soak.buckets_seen),
                    kv_waits=soak.kv_waits, chunks=soak.chunks, seconds=round(elapsed, 1))
        print(f"soak done: {soak.cycles} cycles in {elapsed:.1f} s ({1e3 * elapsed / soak.cycles:.3f} ms/cycle "
              f"incl. prefill and checks), {len(soak.requests)} requests {reasons}, buckets "
              f"{sorted(soak.buckets_seen)}, {soak.kv_waits} cycles with a KV wait, {soak.chunks} prefill chunks",
              flush=True)
        print(f"memory_allocated: after warm-up {mem_base} B, after soak {mem_end} B "
              f"(diff {mem_end - mem_base:+d} B), peak during soak {peak} B, reserved "
              f"{torch.cuda.memory_reserved() if cuda else 0} B")
        info.update(mem_base=mem_base, mem_end=mem_end)
        if mem_end != mem_base:
            failures.append(f"memory_allocated {mem_end} B after the soak != {mem_base} B after warm-up")
        free = rt.allocator.num_free
        print(f"KV blocks free: {free} / {rt.allocator.num_blocks - 1}")
        info["blocks_free"] = f"{free}/{rt.allocator.num_blocks - 1}"
        if soak.buckets_seen != set(rt.buckets):
            failures.append(f"buckets used {sorted(soak.buckets_seen)}, expected all of {rt.buckets}")
        try:
            soak.check_final()
        except AssertionError as exc:
            failures.append(f"final state: {exc}")
        try:
            fresh = cfg.runtime(target, draft, dev)
            n = soak.rerun_sample(lambda: fresh, args.rerun)  # one fresh runtime, one request at a time
            print(f"re-run alone: {n} seeded requests identical")
            info["rerun"] = f"{n}/{n}"
        except AssertionError as exc:
            failures.append(f"re-run alone: {exc}")
    except Exception as exc:  # noqa: BLE001 - any crash is a soak failure, reported as such
        traceback.print_exc()
        failures.append(f"{type(exc).__name__}: {exc}")
    summary = " ".join(f"{k}={v}" for k, v in info.items())
    if failures:
        for f in failures:
            print(f"FAIL: {f}")
        print(f"SOAK FAIL {summary} failures={len(failures)}")
        return 1
    print(f"SOAK PASS {summary}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
