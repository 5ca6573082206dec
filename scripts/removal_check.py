"""Does the profile's top kernel cost the most? `graphrt profile` ranks each phase's kernels by
exclusive time; this checks that ranking the slow way, by removing each candidate from the captured
graph and timing what the phase loses.

    python scripts/removal_check.py [--preset llama-1b-shape] [--batch 1] [--rounds 2] [--out F]

Speculative decoding, K = 3, simulated acceptance 3.0 (so every variant runs the same number of
cycles), with a self-draft of a quarter of the target's layers (same projection shapes; `graphrt
profile --draft-kind lm`) or --draft-kind eagle3. Per variant, the projections of one
kind (matched by weight shape, in the target and the draft alike) are replaced, for the capture, by a
stand-in that materializes its input (a pending RMSNorm still runs) and launches nothing: the
GEMV or GEMM, and what is fused into it (SiLU-mul after gate_up, rotary + KV store after a one-row
qkv; at several rows qkv's rotary launch stays). "attention" replaces the paged attention as
scripts/attention_share.py does. Tokens of the ablated runs are garbage; the other kernels' times
are not. The saving is the phase's CUDA-event time per launch, normal minus ablated; normal and
ablated runs alternate in one process. Which weights a variant covers is printed, so each row can
be matched to the profile's kernel names (cuBLAS kernels are named by tile, not by layer).
"""

from __future__ import annotations

import argparse
import contextlib
import json

import graphrt.kernels.linear as lin
import graphrt.kernels.qkv_rotary as qkv_rotary
import torch
from graphrt.kernels.norm import PendingNorm

import graphrt.models.decoder_lm as decoder_lm
import graphrt.models.eagle as eagle
import graphrt.models.layers as layers
from graphrt.bench import run_decode
from graphrt.presets import default_checkpoints
from graphrt.runtime import Runtime

PHASES = ("TARGET_VERIFY", "DRAFT_EXTEND", "DRAFT_DECODE")


def projection_shapes(cfg) -> dict[str, set[tuple[int, int]]]:
    """Weight shapes [N, K] of the target's projections, by kind."""
    h, d = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    return {"qkv": {(q + 2 * kv, h)}, "o": {(h, q)}, "gate_up": {(2 * cfg.intermediate_size, h)},
            "down": {(h, cfg.intermediate_size)}, "lm_head": {(cfg.vocab_size, h)}}


@contextlib.contextmanager
def removed(shapes: set[tuple[int, int]] | None, attention: bool = False):
    """Within: projections whose weight has one of `shapes` launch nothing; `attention`: neither
    does the paged attention (its query is handed on as its output)."""
    shapes = shapes or set()
    real_linear, real_gated, real_qkv = lin.linear, layers.linear_silu_mul, layers.qkv_rotary_store
    real_attention = layers.paged_attention

    def stand_in(x, rows_out):
        x = lin.materialized(x)
        return torch.empty(x.shape[0], *rows_out, dtype=x.dtype, device=x.device)

    def linear(x, w, bias=None):
        return stand_in(x, (w.shape[0],)) if tuple(w.shape) in shapes else real_linear(x, w, bias)

    def linear_silu_mul(x, w):
        return stand_in(x, (w.shape[0] // 2,)) if tuple(w.shape) in shapes else real_gated(x, w)

    def qkv_rotary_store(x, w, bias, positions, cos, sin, k_cache, v_cache, slots, **kw):
        xt = x.x if isinstance(x, PendingNorm) else x
        one_launch = qkv_rotary.fusable(xt, w, k_cache, has_qk_norm=kw.get("q_norm") is not None, bias=bias)
        if tuple(w.shape) in shapes and one_launch:
            heads = kw["num_q_heads"]
            return stand_in(x, (heads, w.shape[0] // (heads + 2 * kw["num_kv_heads"])))
        return real_qkv(x, w, bias, positions, cos, sin, k_cache, v_cache, slots, **kw)

    owners = (lin, layers, qkv_rotary, decoder_lm, eagle)
    try:
        for m in owners:
            m.linear = linear
        layers.linear_silu_mul, layers.qkv_rotary_store = linear_silu_mul, qkv_rotary_store
        if attention:
            layers.paged_attention = lambda q, *a, **k: q
        yield
    finally:
        for m in owners:
            m.linear = real_linear
        layers.linear_silu_mul, layers.qkv_rotary_store = real_gated, real_qkv
        layers.paged_attention = real_attention


def measure(preset: str, batch: int, new_tokens: int, rounds: int, draft_kind: str = "lm") -> dict:
    target, draft, desc = default_checkpoints(None, None, torch.bfloat16, preset=preset, draft_kind=draft_kind)
    rt = Runtime.from_pretrained(target, draft, num_draft_tokens=3, max_batch_size=batch, max_seq_len=64 + new_tokens,
                                 buckets=(batch,), simulate_acceptance_length=3.0)
    shapes = projection_shapes(rt.target_ckpt.config)
    variants = {"none": (None, False), **{k: (v, False) for k, v in shapes.items()},
                "o+down": (shapes["o"] | shapes["down"], False),
                "all but qkv": (shapes["o"] | shapes["gate_up"] | shapes["down"] | shapes["lm_head"], False),
                "attention": (None, True)}
    times = {name: {p: [] for p in PHASES} for name in variants}
    for _ in range(rounds):
        for name, (sh, attn) in variants.items():
            with removed(sh, attn):
                if rt.device.type == "cuda":
                    rt.capture(inspect_kernels=False)
                run_decode(rt, batch, prompt_len=32, max_new_tokens=8)  # warm-up
                r = run_decode(rt, batch, prompt_len=32, max_new_tokens=new_tokens)
            for p in PHASES:
                times[name][p].append(r["phases"][p]["mean_us"])
    mean = {name: {p: sum(v) / len(v) for p, v in t.items()} for name, t in times.items()}
    rows = [{"removed": name, "weights": sorted(variants[name][0] or []),
             **{f"{p}_us": mean[name][p] for p in PHASES},
             **{f"{p}_saving_us": mean["none"][p] - mean[name][p] for p in PHASES}} for name in variants]
    return {"preset": preset, "batch": batch, "draft": desc, "new_tokens": new_tokens, "rounds": rounds,
            "runs_us": times, "rows": rows}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="llama-1b-shape")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--draft-kind", choices=["lm", "eagle3"], default="lm")
    ap.add_argument("--out")
    args = ap.parse_args()
    res = measure(args.preset, args.batch, args.new_tokens, args.rounds, args.draft_kind)
    print(f"{args.preset}, B = {args.batch}, draft: {res['draft']}; per launch, us; saving = none - removed")
    print(f"{'removed':<12} {'TARGET_VERIFY':>14} {'saving':>8} {'DRAFT_EXTEND':>13} {'saving':>8} "
          f"{'DRAFT_DECODE':>13} {'saving':>8}  weights")
    for r in sorted(res["rows"], key=lambda r: -r["TARGET_VERIFY_saving_us"]):
        print(f"{r['removed']:<12} " + " ".join(f"{r[p + '_us']:>13.1f} {r[p + '_saving_us']:>8.1f}" for p in PHASES)
              + f"  {r['weights']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
