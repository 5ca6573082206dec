"""What a long prompt's prefill costs the requests already decoding, with and without chunked
prefill (Runtime(prefill_chunk_tokens=C)).

    python scripts/chunked_prefill_bench.py --out F [--preset llama-1b-shape] [--running 63] [--long 1536]
                                            [--chunks 0,256,512] [--short N]

A plain runtime on random weights at the preset's shape (every graph, prefill shapes included,
captured up front on CUDA), `running` requests of 32 tokens decoding greedily, then one request with
a `long`-token prompt arrives. For each chunk size (0: off), alternating over two rounds, it
reports the running requests' time between tokens (step() to step() wall clock) before the long
request arrived and while it was prefilled (mean and worst), and the long request's time to its
first token, in ms. --short N: N requests of 32 tokens arrive right after the long one, and their
times to first token are reported too (with chunks they are admitted while the long one's chunks
run; without, after its whole prefill or with it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from graphrt import Runtime, SamplingParams
from graphrt.presets import ensure_preset


def run(rt: Runtime, running: int, long_len: int, steady_steps: int, short: int = 0) -> dict:
    g = torch.Generator().manual_seed(0)
    V = rt.vocab_size
    sp = SamplingParams(max_new_tokens=rt.max_seq_len - long_len - 8, ignore_eos=True)
    rids = [rt.add_request(torch.randint(0, V, (32,), generator=g).tolist(), sp) for _ in range(running)]
    while not all(rt.get_generation(r).token_ids for r in rids):  # prefilled and read: decoding
        rt.step()
    gaps, t = [], time.perf_counter()
    for _ in range(steady_steps):
        rt.step()
        now = time.perf_counter()
        gaps.append(now - t)
        t = now
    two = SamplingParams(max_new_tokens=2, ignore_eos=True)
    long_rid = rt.add_request(torch.randint(0, V, (long_len,), generator=g).tolist(), two)
    shorts = [rt.add_request(torch.randint(0, V, (32,), generator=g).tolist(), two) for _ in range(short)]
    added = t = time.perf_counter()
    during, first = [], {}  # the gaps up to the long request's first token; each new request's (ms, steps)
    while len(first) < 1 + short:
        out = rt.step()
        now = time.perf_counter()
        if long_rid not in first:
            during.append(now - t)
        first.update((r, (1e3 * (now - added), len(during))) for r in [long_rid, *shorts]
                     if r in out and r not in first)
        t = now
    for r in rids + [long_rid, *shorts]:
        rt.abort(r)
        rt.pop_generation(r)
    while rt.has_unfinished():
        rt.step()
    res = {"before_mean_ms": 1e3 * statistics.mean(gaps), "during_mean_ms": 1e3 * statistics.mean(during),
           "during_worst_ms": 1e3 * max(during), "during_ms": [1e3 * x for x in during],
           "steps_to_first_token": len(during), "ttft_ms": first[long_rid][0]}
    if short:  # (steps counted up to the long request's first token)
        res["short_ttft_ms"], res["short_steps"] = ([first[r][i] for r in shorts] for i in (0, 1))
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON output path")
    ap.add_argument("--preset", default="llama-1b-shape")
    ap.add_argument("--running", type=int, default=63, help="requests decoding when the long one arrives")
    ap.add_argument("--long", type=int, default=1536, help="the long prompt's tokens")
    ap.add_argument("--chunks", default="0,256,512", help="prefill_chunk_tokens values (0: off)")
    ap.add_argument("--short", type=int, default=0,
                    help="requests of 32 tokens that arrive right after the long one (their time to first token)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--device", default=None)
    args = ap.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    target = str(ensure_preset(args.preset, dtype))
    chunks = [int(c) for c in args.chunks.split(",")]
    runtimes = {}
    for c in chunks:
        rt = Runtime.from_pretrained(target, None, device=device, dtype=dtype,
                                     max_batch_size=args.running + 1 + args.short, max_seq_len=args.long + 64,
                                     prefix_caching=False, prefill_chunk_tokens=c or None)
        if device.type == "cuda":
            rt.capture(inspect_kernels=False, prefill=True)
        run(rt, args.running, args.long, 4, args.short)  # warm-up
        runtimes[c] = rt
    report = {str(c): [] for c in chunks}
    for _ in range(args.rounds):
        for c in chunks:
            res = run(runtimes[c], args.running, args.long, 16, args.short)
            report[str(c)].append(res)
            print(f"chunk {c or 'off':>4}: step {res['before_mean_ms']:.2f} ms before, {res['during_mean_ms']:.2f} "
                  f"(worst {res['during_worst_ms']:.2f}) while the {args.long}-token prompt is prefilled over "
                  f"{res['steps_to_first_token']} steps; its first token in {res['ttft_ms']:.1f} ms"
                  + (f"; {args.short} short requests after it: first tokens in {min(res['short_ttft_ms']):.1f}-"
                     f"{max(res['short_ttft_ms']):.1f} ms" if args.short else ""), flush=True)
    Path(args.out).write_text(json.dumps({"preset": args.preset, "running": args.running, "long": args.long,
                                          "short": args.short,
                                          "device": str(device), "runs": report}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
