#!/usr/bin/env python3
"""Small driver for compute-sanitizer (scripts/sanitize.sh): every Triton kernel at edge shapes, then
full captured cycles. A few seconds natively; every result is also checked against its reference,
so the driver fails loudly (exit 3) on a wrong answer as well as the sanitizer on a bad access.

    python scripts/sanitize_driver.py --part kernels   # run with PYTORCH_NO_CUDA_MEMORY_CACHING=1
    python scripts/sanitize_driver.py --part cycle     # caching allocator on: CUDA graphs need it

Why two parts: with torch's caching allocator a read past a tensor usually lands inside the same
cudaMalloc segment, where memcheck cannot see it, and initcheck sees memory another tensor already
wrote as initialised. With PYTORCH_NO_CUDA_MEMORY_CACHING=1 every tensor is its own cudaMalloc, so
out-of-bounds and uninitialised reads are exact; but graph capture needs the caching allocator's
private pools, so the captured cycles run in a second process with it on.

Kernels part (inputs allocated at their exact size, V not a multiple of any block):
  argmax         B in {1, 3, 64, 70} x V in {1, 333, 1000, 4099, 128256}: two-launch and fused
                 (last-program merge), NaN / -inf rows, +inf, out= buffers
  rejection      greedy / one-hot (fused race and race pass) / full q, K in {0, 1, 3, 4}, ragged
                 num_draft_tokens, invalid drafts (-1, V, 2**40), NaN and -inf rows, V = 1, fused
                 walk, acceptance counters, out= buffers, B = 9 and 64 (unfused races)
  store_kv       negative slots and slots past the pool (skipped), bf16 and fp32 caches
  paged attn     decode / verify (query_len 4) / prefill (37), GQA 1-4, head_dim 64 and 128, padded
                 rows (seq_len < query_len, 0), tables with -1 / 2**31-1 past the live blocks,
                 1 and several splits
  layer kernels  rms_norm, add_rms_norm, silu_and_mul, rotary_store_kv (+ q/k norm) with padded
                 rows (negative / huge positions, slot -1) -- when kernels/norm.py etc. import
  gemv           M 1..16, N and K not multiples of the tiles, FMA and DOT paths, split K fused and
                 two-launch, bias, with and without PDL
Cycle part: the tiny preset (fp32) with an EAGLE head, K = 3, max_batch_size 4, buckets (2, 4),
use_cuda_graphs=True: requests of different lengths so batches of 3 (bucket 4, one padded row)
and 1 (bucket 2, one padded row) run, a finished request's slot and blocks are reused by a new one;
then the same without a draft (TARGET_DECODE graphs), then in bf16 with the EAGLE head (the Triton
GEMV and PDL launches inside captured graphs).
  SANITIZE_CYCLE_RUNS=fp32-eagle,fp32-none,bf16-eagle (any subset): which of the three to run.
  SANITIZE_TRACE=1: a line before each graph's first replay, so a report made at a graph launch
  names its phase and bucket.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def parse():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--part", choices=["kernels", "cycle", "all"], default="all")
    ap.add_argument("--device", default="cuda", help="cpu: smoke-test the driver under TRITON_INTERPRET=1")
    return ap.parse_args()


ARGS = parse()
if ARGS.device == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

DEV = torch.device(ARGS.device)
CHECKS = []


def check(name, cond, detail=""):
    CHECKS.append(name)
    if not cond:
        print(f"DRIVER FAIL: {name} {detail}", flush=True)
        sys.exit(3)


def exact(shape, dtype=torch.float32, fill=None, gen=None, scale=3.0):
    """A tensor allocated at exactly this size on the device (no view into a bigger buffer)."""
    if fill is not None:
        return torch.full(shape, fill, dtype=dtype, device=DEV)
    return (torch.randn(shape, generator=gen) * scale).to(dtype).to(DEV).contiguous()


# ---------------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------------


def run_argmax(gen):
    from graphrt.kernels.argmax import argmax_reference, argmax_triton

    cases = [(1, 1, {}), (1, 333, dict(block_v=128, num_splits=3)), (3, 1000, dict(fused=True, block_v=256)),
             (3, 1000, dict(fused=False, block_v=256, num_splits=4)), (64, 4099, {}), (70, 333, {}),
             (2, 128256, {})]
    for b, v, kw in cases:
        if DEV.type == "cpu" and b * v > 20000:
            continue  # the interpreter smoke run keeps to small shapes
        for dtype in (torch.bfloat16, torch.float32):
            x = exact((b, v), dtype, gen=gen)
            if b >= 3:
                x[1] = float("nan")
                x[2] = float("-inf")
                x[0, v - 1] = float("inf")
            out = (torch.empty(b, dtype=dtype, device=DEV), torch.empty(b, dtype=torch.int64, device=DEV))
            vals, idx = argmax_triton(x, out=out, **kw)
            rv, ri = argmax_reference(x)
            check(f"argmax B={b} V={v} {dtype} {kw}", torch.equal(idx, ri) and
                  torch.equal(vals.float().nan_to_num(), rv.float().nan_to_num()))


def rejection_inputs(b, k, v, gen, *, dtype=torch.float32, temps=(0.0, 1.0), hazards=True, full_q=False):
    target = exact((b, k + 1, v), dtype, gen=gen)
    drafts = torch.randint(0, v, (b, k), generator=gen)
    if k:
        drafts[:, 0] = target[:, 0].float().cpu().nan_to_num(nan=-1e30).argmax(-1)  # some accepted
    if hazards and k >= 2 and b >= 3:
        drafts[0, 1] = -1
        drafts[1, 0] = v
        drafts[2, 1] = 2**40
        target[1, 0] = float("nan")
        target[2, :, :] = float("-inf")
        target[0, k, v - 1] = float("inf")
    args = dict(
        target_logits=target, draft_token_ids=drafts.to(DEV),
        temperature=torch.tensor([temps[i % len(temps)] for i in range(b)], dtype=torch.float32, device=DEV),
        seed=torch.randint(-(2**62), 2**62, (b,), generator=gen).to(DEV),
        position=torch.randint(0, 2**40, (b,), generator=gen).to(DEV),
        draft_logits=exact((b, k, v), dtype, gen=gen) if full_q else None,
    )
    return args


def run_rejection(gen):
    import dataclasses

    from graphrt.kernels.rejection import launch_config, rejection_sample_reference, rejection_sample_triton

    cases = [  # (name, b, k, v, temps, full_q, launch kwargs)
        ("greedy", 3, 3, 1000, (0.0,), False, {}),
        ("onehot fused race", 3, 3, 1000, (0.7, 1.3), False, dict(fuse_race=True)),
        ("onehot race pass", 3, 3, 1000, (0.0, 1.0), False, dict(fuse_race=False, block_v=256)),
        ("full q", 3, 3, 1000, (1.0, 0.0), True, {}),
        ("full q split", 4, 4, 333, (1.0,), True, dict(block_v=128, num_splits=3)),
        ("K=0", 3, 0, 1000, (0.0, 1.0), False, {}),
        ("K=1 V=1", 3, 1, 1, (0.0, 1.0), False, {}),
        ("B=9", 9, 3, 4099, (0.0, 1.0, 1e-6, 100.0), False, {}),
        ("B=64 real V bf16", 64, 3, 128256, (0.0, 1.0), False, {}),
    ]
    for name, b, k, v, temps, full_q, kw in cases:
        if DEV.type == "cpu" and b * v > 20000:
            continue
        dtype = torch.bfloat16 if "bf16" in name else torch.float32
        args = rejection_inputs(b, k, v, gen, dtype=dtype, temps=temps, full_q=full_q)
        nd = torch.randint(0, k + 1, (b,), generator=gen).to(DEV)
        counts_t = torch.zeros(k, dtype=torch.int64, device=DEV)
        counts_r = counts_t.clone()
        out = (torch.empty((b, k + 1), dtype=torch.int64, device=DEV), torch.empty(b, dtype=torch.int32, device=DEV),
               torch.empty((b, k + 1), dtype=torch.float32, device=DEV))
        config = dataclasses.replace(launch_config(b, k, full_q and k > 0), **kw,
                                     **({"race_block_v": kw["block_v"]} if "block_v" in kw else {}))
        got = rejection_sample_triton(**args, num_draft_tokens=nd, acceptance_counts=counts_t, out=out,
                                      config=config)
        ref = rejection_sample_reference(**args, num_draft_tokens=nd, acceptance_counts=counts_r)
        ok = (torch.equal(got.token_ids, ref.token_ids) and torch.equal(got.num_emitted, ref.num_emitted)
              and torch.equal(counts_t, counts_r))
        check(f"rejection {name}", ok, f"{got.token_ids.tolist()} vs {ref.token_ids.tolist()}")
        check(f"rejection {name} ids in [0, V)", bool(((got.token_ids >= -1) & (got.token_ids < v)).all()))


def paged_case(gen, lens, *, ql, hq, hkv, d, page, dtype):
    live = [-(-s // page) for s in lens]
    nblocks = sum(live) + 2
    width = max(live + [1]) + 2
    perm = torch.randperm(nblocks, generator=gen)
    kc = exact((nblocks, page, hkv, d), dtype, gen=gen, scale=1.0)
    vc = exact((nblocks, page, hkv, d), dtype, gen=gen, scale=1.0)
    table = torch.empty(len(lens), width, dtype=torch.int32)
    used = 0
    for i in range(len(lens)):
        table[i, : live[i]] = perm[used: used + live[i]].to(torch.int32)
        used += live[i]
        table[i, live[i]:] = torch.tensor([-1, 2**31 - 1] * width, dtype=torch.int32)[: width - live[i]]
    q = exact((len(lens) * ql, hq, d), dtype, gen=gen, scale=1.0)
    return q, kc, vc, table.to(DEV), torch.tensor(lens, dtype=torch.int32, device=DEV)


def run_attention(gen):
    from graphrt.kernels.attention import (
        paged_attention_reference,
        paged_attention_triton,
        store_kv_reference,
        store_kv_triton,
    )

    for dtype in (torch.bfloat16, torch.float32):
        kc = exact((5, 16, 2, 64), dtype, fill=0.0)
        vc = exact((5, 16, 2, 64), dtype, fill=0.0)
        key, val = exact((6, 2, 64), dtype, gen=gen), exact((6, 2, 64), dtype, gen=gen)
        slots = torch.tensor([0, 17, -1, 79, 80, 2**40], device=DEV)  # 80, 2**40: past the pool
        store_kv_triton(key, val, kc, vc, slots)
        kr, vr = torch.zeros_like(kc), torch.zeros_like(vc)
        store_kv_reference(key[:4], val[:4], kr, vr, slots[:4])
        check(f"store_kv {dtype}", torch.equal(kc, kr) and torch.equal(vc, vr))
    tol = {torch.bfloat16: 3e-2, torch.float32: 2e-5}
    cases = [  # (lens, query_len, group, head_dim, page, splits)
        ([1, 40, 0, 17], 1, 1, 64, 16, None),
        ([3, 40, 2, 33], 4, 4, 128, 16, 3),
        ([37, 20], 37, 2, 64, 16, None),
        ([5, 1, 70], 4, 2, 64, 4, 2),
    ]
    for lens, ql, group, d, page, splits in cases:
        for dtype in (torch.bfloat16, torch.float32):
            q, kc, vc, bt, sl = paged_case(gen, lens, ql=ql, hq=2 * group, hkv=2, d=d, page=page, dtype=dtype)
            got = paged_attention_triton(q, kc, vc, bt, sl, query_len=ql, scale=d**-0.5, num_splits=splits)
            ref = paged_attention_reference(q, kc, vc, bt, sl, query_len=ql, scale=d**-0.5)
            err = (got.float() - ref.float()).abs().max().item()
            check(f"paged_attention lens={lens} ql={ql} g={group} D={d} {dtype}", err <= tol[dtype] * 4, err)


def run_layer_kernels(gen):
    try:
        from graphrt.kernels.activation import silu_and_mul_reference, silu_and_mul_triton
        from graphrt.kernels.norm import (
            add_rms_norm_reference,
            add_rms_norm_triton,
            rms_norm_reference,
            rms_norm_triton,
        )
        from graphrt.kernels.rotary import rotary_store_kv_reference, rotary_store_kv_triton
    except ImportError as exc:
        print(f"layer kernels not importable, skipped: {exc}")
        return
    for dtype in (torch.bfloat16, torch.float32):
        for n, h in ((1, 64), (7, 96), (3, 4096)):
            x, r, w = exact((n, h), dtype, gen=gen), exact((n, h), dtype, gen=gen), exact((h,), dtype, gen=gen)
            a = rms_norm_triton(x, w, 1e-5)
            check(f"rms_norm {n}x{h} {dtype}", torch.allclose(a.float(), rms_norm_reference(x, w, 1e-5).float(),
                                                              atol=3e-2, rtol=3e-2))
            o, s = add_rms_norm_triton(x, r, w, 1e-5)
            ro, rs = add_rms_norm_reference(x, r, w, 1e-5)
            check(f"add_rms_norm {n}x{h} {dtype}", torch.allclose(o.float(), ro.float(), atol=3e-2, rtol=3e-2)
                  and torch.allclose(s.float(), rs.float(), atol=3e-2, rtol=3e-2))
        for n, inter in ((1, 96), (5, 1000), (2, 11008)):
            gu = exact((n, 2 * inter), dtype, gen=gen)
            check(f"silu_and_mul {n}x{inter} {dtype}", torch.allclose(
                silu_and_mul_triton(gu).float(), silu_and_mul_reference(gu).float(), atol=3e-2, rtol=3e-2))
        for norm in (False, True):
            n, hq, hkv, d, page, maxpos = 5, 4, 2, 64, 16, 128
            q, k, v = exact((n, hq, d), dtype, gen=gen), exact((n, hkv, d), dtype, gen=gen), exact((n, hkv, d), dtype,
                                                                                                  gen=gen)
            ang = torch.rand(maxpos, d // 2, generator=gen) * 6.28
            cos = torch.cat([ang.cos(), ang.cos()], -1).to(DEV).contiguous()
            sin = torch.cat([ang.sin(), ang.sin()], -1).to(DEV).contiguous()
            pos = torch.tensor([0, 127, 5, -3, 2**40], device=DEV)  # the last two: padded rows
            slots = torch.tensor([0, 63, 17, -1, -1], device=DEV)
            kw = dict(q_norm=exact((d,), dtype, gen=gen), k_norm=exact((d,), dtype, gen=gen)) if norm else {}
            kc = exact((4, page, hkv, d), dtype, fill=0.0)
            vc = exact((4, page, hkv, d), dtype, fill=0.0)
            out = rotary_store_kv_triton(q, k, v, pos, cos, sin, kc, vc, slots, **kw)
            kr, vr = torch.zeros_like(kc), torch.zeros_like(vc)
            ref = rotary_store_kv_reference(q[:3], k[:3], v[:3], pos[:3], cos, sin, kr, vr, slots[:3], **kw)
            check(f"rotary_store_kv norm={norm} {dtype}",
                  torch.allclose(out[:3].float(), ref.float(), atol=3e-2, rtol=3e-2)
                  and torch.allclose(kc.float(), kr.float(), atol=3e-2, rtol=3e-2) and torch.equal(vc, vr))


# ---------------------------------------------------------------------------------------------
# captured cycles
# ---------------------------------------------------------------------------------------------


def run_gemv(gen):
    from graphrt.kernels.gemv import gemv_triton

    cases = [(1, 37, 100, dict(block_k=64)), (1, 2048, 2048, {}), (2, 333, 4099, {}), (1, 8, 31, {}),
             (1, 40, 300, dict(use_dot=False, block_k=64, split_k=3)),
             (3, 100, 300, dict(use_dot=True, block_k=64, split_k=3)),
             (5, 33, 129, dict(use_dot=True, block_k=32, split_k=2, fused=False)), (16, 2048, 8192, {})]
    dtype = torch.bfloat16 if DEV.type == "cuda" else torch.float32
    for m, n, k, kw in cases:
        if DEV.type == "cpu" and n * k > 200000:
            continue
        x, w = exact((m, k), dtype, gen=gen, scale=1.0), exact((n, k), dtype, gen=gen, scale=0.05)
        bias = exact((n,), dtype, gen=gen, scale=0.1)
        want = (x.float() @ w.float().T + bias.float())
        for pdl in ((False, True) if DEV.type == "cuda" else (False,)):
            y = gemv_triton(x, w, bias, pdl=pdl, **kw)
            check(f"gemv M={m} N={n} K={k} {kw} pdl={pdl}",
                  torch.allclose(y.float(), want, rtol=2e-2, atol=5e-2), f"{(y.float() - want).abs().max()}")


def trace_first_replays():
    """SANITIZE_TRACE=1: print a line before the first replay of each (phase, bucket) graph, so a
    report the sanitizer prints at a graph launch names its graph."""
    from graphrt.capture.graphs import CycleGraphs

    get, seen = CycleGraphs.get, set()

    def traced(self, phase, batch_size):
        graph = get(self, phase, batch_size)
        if graph is not None and (phase, batch_size) not in seen:
            seen.add((phase, batch_size))
            print(f"  first replay {phase} B={batch_size}", flush=True)
        return graph

    CycleGraphs.get = traced


def run_cycles():
    from graphrt import Runtime, SamplingParams
    from graphrt.checkpoint import load_checkpoint
    from graphrt.checkpoint_writer import write_random_checkpoint

    if os.environ.get("SANITIZE_TRACE") == "1":
        trace_first_replays()

    tmp = Path(tempfile.mkdtemp(prefix="graphrt-sanitize-"))
    write_random_checkpoint(tmp / "t", "tiny", dtype=torch.float32, seed=0)
    write_random_checkpoint(tmp / "e", "tiny", kind="eagle", dtype=torch.float32, seed=1, target=tmp / "t")
    graphs = DEV.type == "cuda"
    # fp32 (EAGLE draft, then none), then bf16: bf16 is what sends the decode projections through
    # the Triton GEMV (kernels/gemv.py) and its PDL launches.
    runs = [(torch.float32, "eagle"), (torch.float32, None)] + ([(torch.bfloat16, "eagle")] if graphs else [])
    # SANITIZE_CYCLE_RUNS=bf16-eagle (say) runs a subset, so a report can be pinned to one run
    names = {(torch.float32, "eagle"): "fp32-eagle", (torch.float32, None): "fp32-none",
             (torch.bfloat16, "eagle"): "bf16-eagle"}
    wanted = os.environ.get("SANITIZE_CYCLE_RUNS")
    if wanted:
        unknown = set(wanted.split(",")) - set(names.values())
        if unknown:
            raise SystemExit(f"SANITIZE_CYCLE_RUNS: unknown run(s) {sorted(unknown)}; known: {sorted(names.values())}")
        runs = [r for r in runs if names[r] in wanted.split(",")]
    for dtype, draft_name in runs:
        print(f"  cycle run {names[(dtype, draft_name)]}", flush=True)
        target = load_checkpoint(tmp / "t", dtype=dtype, device=DEV)
        draft = load_checkpoint(tmp / "e", dtype=dtype, device=DEV) if draft_name else None
        rt = Runtime(target, draft, num_draft_tokens=3, device=DEV, max_batch_size=4, max_seq_len=64,
                     buckets=(2, 4), kv_budget_tokens=4 * 64, use_cuda_graphs=graphs)
        sp = lambda m, t=0.0, s=1: SamplingParams(max_new_tokens=m, temperature=t, seed=s, ignore_eos=True)
        # prompts of <= 16 tokens: with GRAPHRT_GEMV=all the prefill's projections stay on Triton too
        rids = [rt.add_request([5, 6, 7], sp(3)), rt.add_request(list(range(1, 17)), sp(40, 0.8, 2)),
                rt.add_request([9], sp(12, 1.3, 3))]  # 3 rows -> bucket 4 (one padded row)
        buckets = set()
        run = rt.cycle.run

        def counted(B, run=run, buckets=buckets):
            buckets.add(B)
            return run(B)

        rt.cycle.run = counted
        reused = False
        for _ in range(200):
            if not rt.has_unfinished():
                break
            rt.step()
            if rt.finished(rids[0]) and not reused:  # its slot and blocks go to a new request
                rids.append(rt.add_request([11, 12], sp(5, 0.7, 4)))
                reused = True
        check(f"cycle {dtype} draft={draft_name}: finished", not rt.has_unfinished())
        check(f"cycle {dtype} draft={draft_name}: graphs", (rt.cycle.graphs is not None) == graphs)
        check(f"cycle {dtype} draft={draft_name}: buckets {sorted(buckets)}", buckets == {2, 4})
        check(f"cycle {dtype} draft={draft_name}: blocks free",
              rt.allocator.num_free == rt.allocator.num_blocks - 1)
        for r in rids:
            toks = rt.get_generation(r).token_ids
            check(f"cycle request {r} tokens in [0, V)", all(0 <= t < rt.vocab_size for t in toks))
        if graphs:
            torch.cuda.synchronize()


def main():
    t0 = time.perf_counter()
    gen = torch.Generator().manual_seed(1234)
    print(f"sanitize driver: part {ARGS.part}, device {DEV}, PYTORCH_NO_CUDA_MEMORY_CACHING="
          f"{os.environ.get('PYTORCH_NO_CUDA_MEMORY_CACHING', '')}", flush=True)
    if ARGS.part in ("kernels", "all"):
        for fn in (run_argmax, run_rejection, run_attention, run_layer_kernels, run_gemv):
            t = time.perf_counter()
            fn(gen)
            if DEV.type == "cuda":
                torch.cuda.synchronize()
            print(f"  {fn.__name__}: {time.perf_counter() - t:.1f} s", flush=True)
    if ARGS.part in ("cycle", "all"):
        t = time.perf_counter()
        run_cycles()
        print(f"  run_cycles: {time.perf_counter() - t:.1f} s", flush=True)
    print(f"DRIVER OK part={ARGS.part} checks={len(CHECKS)} {time.perf_counter() - t0:.1f} s", flush=True)


if __name__ == "__main__":
    main()
