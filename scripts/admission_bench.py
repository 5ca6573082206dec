"""What admitting requests costs the host's wall clock, on CUDA: RESULTS.md's admission tables.

    python scripts/admission_bench.py --out F [--preset smollm2-135m-shape] [--served]

A plain runtime (and one with prefix caching) on random weights at the preset's shape, every prefill
graph captured up front as a server does. Each case admits its prompts at once, reads their first
tokens (Runtime.admit) and drops them: graphrt.bench.run_prefill's mean wall clock of 5 admissions
after a warm-up. The cases, with and without prefix caching (which finds nothing but what the
requests of one forward share): 1, 8 and 64 new prompts of 41 tokens; 64 new prompts of 20-100
tokens; 64 prompts that share a 64-token system prompt, new at each admission; and without it the
same 64 prompts of 20-100 tokens each time. --served adds
graphrt.bench.run_served at B = 1, 8 and 64 (4 x max(B, 8) requests of 25-60 tokens, 64 new tokens)
on a runtime with the default options.
For an A/B, run it in each checkout, alternating.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch

from graphrt import Runtime
from graphrt.bench import run_prefill, run_served
from graphrt.presets import ensure_preset

ADMISSIONS = 6  # run_prefill's warm-up and its 5 timed admissions, each taking the next n prompts


def prompt(n: int, r: random.Random) -> list[int]:
    return [100 + r.randrange(4000) for _ in range(n)]


def cases(prefix_caching: bool) -> dict[str, tuple[int, list[list[int]]]]:
    """name -> (prompts an admission takes, the prompts the admissions take in turn). Each admission
    takes new prompts (with prefix caching, nothing it caches is found again but the shared system
    prompt's blocks within one admission), but for the last case, run without prefix caching."""
    r = random.Random(11)  # the same prompts with and without prefix caching

    def new(n: int, lengths) -> list[list[int]]:
        return [prompt(lengths(), r) for _ in range(n * ADMISSIONS)]

    out = {"64 prompts sharing a new 64-token system prompt + 8-30 tokens":
           (64, [p for _ in range(ADMISSIONS) for system in [prompt(64, r)]
                 for p in [system + prompt(r.randrange(8, 31), r) for _ in range(64)]])}
    for n in (1, 8, 64):
        out[f"{n} new prompt{'s' * (n > 1)} of 41 tokens"] = (n, new(n, lambda: 41))
    out["64 new prompts of 20-100 tokens"] = (64, new(64, lambda: r.randrange(20, 101)))
    if prefix_caching:
        return {f"{name}, prefix caching": case for name, case in out.items()}
    return {**out, "64 prompts of 20-100 tokens, the same each time": (64, new(64, lambda: r.randrange(20, 101))[:64])}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON output path")
    ap.add_argument("--preset", default="smollm2-135m-shape")
    ap.add_argument("--served", action="store_true", help="also the served runs at B = 1, 8, 64")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("admission_bench needs CUDA")
    target = str(ensure_preset(args.preset, torch.bfloat16))
    report = {}
    for pc in (False, True):
        rt = Runtime.from_pretrained(target, None, max_batch_size=64, max_seq_len=512, prefix_caching=pc)
        rt.capture(prefill=True)
        for name, (n, prompts) in cases(pc).items():
            report[name] = run_prefill(rt, prompts, n)
            print(f"{name}: {report[name]['wall_ms']:.2f} ms wall, {report[name]['gpu_ms']:.2f} ms GPU", flush=True)
        del rt
    if args.served:  # the runtime's defaults, as a user gets them
        rt = Runtime.from_pretrained(target, None, max_batch_size=64, max_seq_len=512)
        rt.capture(prefill=True)
        r = random.Random(3)
        prompts = [prompt(r.randrange(25, 60), r) for _ in range(64)]
        for B in (1, 8, 64):
            for _ in range(2):  # the first run warms up
                res = run_served(rt, B, prompts, num_requests=4 * max(B, 8), max_new_tokens=64)
            report[f"served B={B}"] = {k: res[k] for k in ("tokens_per_s", "tokens_per_s_wall", "wall_s",
                                                           "prefills", "ttft_ms")}
            print(f"served B={B}: wall {res['tokens_per_s_wall']:.0f} tok/s, decode {res['tokens_per_s']:.0f} "
                  f"tok/s, time to first token p50 {res['ttft_ms']['p50']:.2f} ms", flush=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
