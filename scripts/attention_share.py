"""The attention share of a decode step, measured inside the step the way it runs (CUDA graph, PDL,
the L2 prefetch before the wait), against its KV-read floor.

    python scripts/attention_share.py [--preset llama-8b-shape] [--prompt-len 4064] [--out f.json]

Plain decode (no draft) of B requests with a long prompt; TARGET_DECODE's graph time per step
(CUDA events around each replay) is measured twice over: with the real paged attention, and with
paged_attention replaced, for the capture, by a stand-in that launches nothing and hands the
query on as its output. The tokens of the ablated runs are garbage; the time of every other kernel
of the step is not, so the difference is what attention adds to the step, launches, merge and
overlap included. Normal and ablated runs alternate (twice each) in one process, on one runtime.

Per-kernel durations (nsys, PDL off) or an isolated benchmark miss two things a decode step does:
PDL lets the attention kernels' launch and the L2 prefetch of their first KV step overlap the
qkv GEMV, and the o projection's weight loads overlap the merge.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from graphrt.kernels.timing import memory_bandwidth_gbs

import graphrt.models.layers as layers
from graphrt.bench import run_decode
from graphrt.presets import default_checkpoints
from graphrt.runtime import Runtime


def _skip_attention(q, *args, **kwargs):
    return q  # [N, Hq, D]: what the o projection reads; no kernel launched


def measure(preset: str, batch: int, prompt_len: int, new_tokens: int, rounds: int, bw_gbs: float) -> dict:
    target, _, _ = default_checkpoints(None, None, torch.bfloat16, no_draft=True, preset=preset)
    rt = Runtime.from_pretrained(target, None, max_batch_size=batch, max_seq_len=prompt_len + new_tokens + 8,
                                 buckets=(batch,))
    cfg = rt.target_ckpt.config
    real = layers.paged_attention
    normal, ablated = [], []
    try:
        for _ in range(rounds):
            for patched, sink in ((False, normal), (True, ablated)):
                layers.paged_attention = _skip_attention if patched else real
                rt.capture(inspect_kernels=False)
                run_decode(rt, batch, prompt_len=prompt_len, max_new_tokens=4)  # warm-up
                r = run_decode(rt, batch, prompt_len=prompt_len, max_new_tokens=new_tokens)
                sink.append(r["phases"]["TARGET_DECODE"]["mean_us"])
    finally:
        layers.paged_attention = real
    # Each decode step reads the K and V of every live position: prompt + tokens so far (+1 new).
    mean_ctx = prompt_len + (new_tokens - 1) / 2 + 1
    elem = torch.finfo(torch.bfloat16).bits // 8
    kv_layer = 2 * batch * mean_ctx * cfg.num_key_value_heads * cfg.head_dim * elem
    floor_layer_us = kv_layer / (bw_gbs * 1e3)
    n_layers = cfg.num_hidden_layers
    share_us = (sum(normal) / len(normal) - sum(ablated) / len(ablated)) / n_layers
    return dict(preset=preset, batch=batch, prompt_len=prompt_len, new_tokens=new_tokens, layers=n_layers,
                target_decode_us=normal, target_decode_ablated_us=ablated, share_per_layer_us=share_us,
                kv_floor_per_layer_us=floor_layer_us, ratio=share_us / floor_layer_us, bandwidth_gbs=bw_gbs)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", default="llama-8b-shape,llama-1b-shape")
    ap.add_argument("--batch-sizes", default="1")
    ap.add_argument("--prompt-len", type=int, default=4064)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("attention_share.py needs CUDA")
    bw = memory_bandwidth_gbs()
    rows = []
    print(f"{'preset':<16} {'B':>3} {'ctx':>6} {'step us':>18} {'no attn us':>18} {'attn/layer':>11} "
          f"{'floor/layer':>12} {'ratio':>6}")
    for preset in args.presets.split(","):
        for b in (int(x) for x in args.batch_sizes.split(",")):
            r = measure(preset, b, args.prompt_len, args.new_tokens, args.rounds, bw)
            rows.append(r)
            fmt = lambda xs: "/".join(f"{x:.1f}" for x in xs)  # noqa: E731
            print(f"{preset:<16} {b:>3} {args.prompt_len:>6} {fmt(r['target_decode_us']):>18} "
                  f"{fmt(r['target_decode_ablated_us']):>18} {r['share_per_layer_us']:>9.2f}us "
                  f"{r['kv_floor_per_layer_us']:>10.2f}us {r['ratio']:>5.2f}x", flush=True)
            torch.cuda.empty_cache()
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, date=time.strftime("%Y-%m-%d"),
                bandwidth_gbs=bw)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
