"""The attention share of a decode step, measured inside the step the way it runs (CUDA graph, PDL,
the L2 prefetch before the wait), against its KV-read floor.

    python scripts/attention_share.py [--presets llama-8b-shape] [--prompt-len 4064] [--out f.json]
        [--variants 'default;w8:num_warps=8;nomerge:merge=0;off:env.GRAPHRT_PDL=0']

Plain decode (no draft) of B requests with a long prompt; TARGET_DECODE's graph time per step
(CUDA events around each replay) is measured twice over: with the real paged attention, and with
paged_attention replaced, for the capture, by a stand-in that launches nothing and hands the
query on as its output. The tokens of the ablated runs are garbage; the time of every other kernel
of the step is not, so the difference is what attention adds to the step, launches, merge and
overlap included. Normal and ablated runs alternate (twice each) in one process, on one runtime;
--variants measures several attention settings (kernel keywords, environment switches) in the same
rounds against the same ablated runs.

Per-kernel durations (nsys, PDL off) or an isolated benchmark miss two things a decode step does:
PDL lets the attention kernels' launch and the L2 prefetch of their first KV step overlap the
qkv GEMV, and the o projection's weight loads overlap the merge.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import time
from unittest import mock

import graphrt.kernels.attention as attention
import torch
from graphrt.kernels.timing import memory_bandwidth_gbs

import graphrt.models.layers as layers
from graphrt.bench import run_decode
from graphrt.presets import default_checkpoints
from graphrt.runtime import Runtime


def _skip_attention(q, *args, **kwargs):
    return q  # [N, Hq, D]: what the o projection reads; no kernel launched


class _NoLaunch:
    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def parse_variants(text: str) -> list[tuple[str, dict]]:
    """'default;w8:num_warps=8;off:env.GRAPHRT_PDL=0' -> [(name, settings)]: integer
    paged_attention_triton keywords, environment variables (env.NAME, set for the capture), and
    merge=0, which skips the merge launch (a timing probe only: the output is then wrong)."""
    out = []
    for item in filter(None, (t.strip() for t in text.split(";"))):
        name, _, spec = item.partition(":")
        kw = {}
        for pair in filter(None, spec.split(",")):
            k, _, v = pair.partition("=")
            k = k.strip()
            kw[k] = v.strip() if k.startswith("env.") else int(v)
        out.append((name, kw))
    return out


@contextlib.contextmanager
def _variant(kw: dict):
    """For the captures inside: layers.paged_attention bound to paged_attention_triton with kw's
    keywords (the dispatcher itself when there are none), kw's env.NAME variables set, the merge
    launch skipped on merge=0. All undone on exit."""
    kw = dict(kw)
    env = {k[4:]: kw.pop(k) for k in list(kw) if k.startswith("env.")}
    skip_merge = kw.pop("merge", 1) == 0
    real_attn, real_merge = layers.paged_attention, attention._paged_attn_merge_kernel
    if kw:
        layers.paged_attention = functools.partial(attention.paged_attention_triton, **kw)
    if skip_merge:
        attention._paged_attn_merge_kernel = _NoLaunch()
    try:
        with mock.patch.dict(os.environ, env):
            yield
    finally:
        layers.paged_attention, attention._paged_attn_merge_kernel = real_attn, real_merge


def measure(preset: str, batch: int, prompt_len: int, new_tokens: int, rounds: int, bw_gbs: float,
            variants: list[tuple[str, dict]] | None = None) -> list[dict]:
    target, _, _ = default_checkpoints(None, None, torch.bfloat16, no_draft=True, preset=preset)
    rt = Runtime.from_pretrained(target, None, max_batch_size=batch, max_seq_len=prompt_len + new_tokens + 8,
                                 buckets=(batch,))
    cfg = rt.target_ckpt.config
    real = layers.paged_attention
    variants = variants or [("default", {})]
    normal = {name: [] for name, _ in variants}
    ablated = []

    def step_us() -> float:
        rt.capture(inspect_kernels=False)
        run_decode(rt, batch, prompt_len=prompt_len, max_new_tokens=4)  # warm-up
        r = run_decode(rt, batch, prompt_len=prompt_len, max_new_tokens=new_tokens)
        return r["phases"]["TARGET_DECODE"]["mean_us"]

    try:
        for _ in range(rounds):
            for name, kw in variants:
                with _variant(kw):
                    normal[name].append(step_us())
            layers.paged_attention = _skip_attention
            ablated.append(step_us())
            layers.paged_attention = real
    finally:
        layers.paged_attention = real
    # Each decode step reads the K and V of every live position: prompt + tokens so far (+1 new).
    mean_ctx = prompt_len + (new_tokens - 1) / 2 + 1
    elem = torch.finfo(torch.bfloat16).bits // 8
    kv_layer = 2 * batch * mean_ctx * cfg.num_key_value_heads * cfg.head_dim * elem
    floor_layer_us = kv_layer / (bw_gbs * 1e3)
    n_layers = cfg.num_hidden_layers
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    rows = []
    for name, _ in variants:
        share_us = (mean(normal[name]) - mean(ablated)) / n_layers
        rows.append(dict(preset=preset, batch=batch, prompt_len=prompt_len, new_tokens=new_tokens, layers=n_layers,
                         variant=name, target_decode_us=normal[name], target_decode_ablated_us=ablated,
                         share_per_layer_us=share_us, kv_floor_per_layer_us=floor_layer_us,
                         ratio=share_us / floor_layer_us, bandwidth_gbs=bw_gbs))
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", default="llama-8b-shape,llama-1b-shape")
    ap.add_argument("--batch-sizes", default="1")
    ap.add_argument("--prompt-len", type=int, default=4064)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--variants", default="",
                    help="paged_attention_triton keyword sets measured alternately in one process, e.g. "
                         "'default;w2:num_warps=2;nomerge:merge=0' (merge=0 skips the merge launch: timing only)")
    ap.add_argument("--out")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("attention_share.py needs CUDA")
    bw = memory_bandwidth_gbs()
    rows = []
    variants = parse_variants(args.variants) or None
    print(f"{'preset':<16} {'variant':<10} {'B':>3} {'ctx':>6} {'step us':>18} {'no attn us':>18} {'attn/layer':>11} "
          f"{'floor/layer':>12} {'ratio':>6}")
    for preset in args.presets.split(","):
        for b in (int(x) for x in args.batch_sizes.split(",")):
            fmt = lambda xs: "/".join(f"{x:.1f}" for x in xs)  # noqa: E731
            for r in measure(preset, b, args.prompt_len, args.new_tokens, args.rounds, bw, variants):
                rows.append(r)
                print(f"{preset:<16} {r['variant']:<10} {b:>3} {args.prompt_len:>6} {fmt(r['target_decode_us']):>18} "
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
