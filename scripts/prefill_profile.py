"""Where a small prefill's GPU time goes: one admission of R prompts through a prefill graph, on CUDA.

    python scripts/prefill_profile.py --out F [--preset smollm2-135m-shape] [--rows 1,8] [--prompt-len 41]

For a plain runtime and one with a random EAGLE-3 head (every prefill graph captured up front, as a
server does), admits R prompts at once, aborts them, and repeats: prints the admission's wall clock
(median of 10) and, from torch.profiler over 5 admissions, the GPU operations a prefill runs
(kernels and copies), their total time, and the kernels that take the most of it. JSON to --out.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from graphrt import Runtime, SamplingParams
from graphrt.presets import ensure_eagle3_head, ensure_preset


def admit_once(rt: Runtime, prompt: list[int], rows: int) -> float:
    """Wall seconds of rt.admit() for `rows` copies of prompt; the requests are dropped after."""
    rids = [rt.add_request(prompt, SamplingParams(max_new_tokens=2)) for _ in range(rows)]
    torch.cuda.synchronize()
    t = time.perf_counter()
    rt.admit()
    torch.cuda.synchronize()
    t = time.perf_counter() - t
    for r in rids:
        rt.abort(r)
        rt.pop_generation(r)
    return t


def gpu_ops(rt: Runtime, prompt: list[int], rows: int, repeats: int = 5) -> tuple[int, float, list]:
    """(GPU operations a prefill, their us, [(name, count, us)] most expensive first), per admission."""
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(repeats):
            admit_once(rt, prompt, rows)
    ops = collections.defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            ops[e.name[:90]][0] += 1
            ops[e.name[:90]][1] += e.device_time_total
    count = sum(c for c, _ in ops.values()) / repeats
    total = sum(us for _, us in ops.values()) / repeats
    top = sorted(((n, c / repeats, us / repeats) for n, (c, us) in ops.items()), key=lambda t: -t[2])
    return count, total, top


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON output path")
    ap.add_argument("--preset", default="smollm2-135m-shape")
    ap.add_argument("--rows", default="1,8", help="prompts per admission")
    ap.add_argument("--prompt-len", type=int, default=41, help="tokens a prompt (the held-out prompts' mean)")
    ap.add_argument("--top", type=int, default=12, help="kernels listed per row")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("prefill_profile needs CUDA")
    target = ensure_preset(args.preset, torch.bfloat16)
    prompt = [100 + (i * 37) % 4000 for i in range(args.prompt_len)]
    report = {}
    for name, draft in (("plain", None), ("eagle3", ensure_eagle3_head(target, torch.bfloat16))):
        # without prefix caching: each admission of the same prompt prefills it whole
        rt = Runtime.from_pretrained(str(target), str(draft) if draft else None, max_batch_size=64, max_seq_len=512,
                                     prefix_caching=False)
        t0 = time.perf_counter()
        rt.capture(prefill=True)
        print(f"{name}: capture {time.perf_counter() - t0:.1f} s", flush=True)
        for rows in (int(r) for r in args.rows.split(",")):
            for _ in range(3):  # warm-up
                admit_once(rt, prompt, rows)
            wall_ms = 1e3 * statistics.median(admit_once(rt, prompt, rows) for _ in range(10))
            count, total, top = gpu_ops(rt, prompt, rows)
            print(f"== {name} R={rows}: wall {wall_ms:.2f} ms, {count:.0f} GPU ops a prefill, {total:.0f} us of "
                  f"kernel time", flush=True)
            for op, c, us in top[: args.top]:
                print(f"  {c:6.1f} x {us / c:7.2f} us = {us:8.1f} us  {op}")
            report[f"{name}_R{rows}"] = dict(wall_ms=wall_ms, ops=count, kernel_us=total, top=top[:40])
        del rt
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
