"""`graphrt bench`: decode throughput, acceptance length and per-phase time.

With no arguments it runs an embedded random model (tiny on CPU, llama-1b-shape on CUDA) with a
self-draft, so a fresh machine needs no download.
"""

from __future__ import annotations

import json
import time

import torch
from tqdm import tqdm

from graphrt.params import SamplingParams
from graphrt.profiling.phase_timer import PhaseTimer
from graphrt.runtime import Runtime


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_decode(rt: Runtime, batch_size: int, *, prompt_len: int, max_new_tokens: int, seed: int = 0) -> dict:
    """Greedy decode of `batch_size` random prompts; timing covers the decode cycles only."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, rt.vocab_size, (batch_size, prompt_len), generator=g).tolist()
    params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    rids = [rt.add_request(p, params) for p in prompts]
    timer = PhaseTimer(rt.device)
    rt.cycle.timer = timer
    _sync(rt.device)
    host0, cycles0 = rt.host_seconds, rt.num_cycles
    t0 = time.perf_counter()
    while rt.has_unfinished():
        rt.step()
    _sync(rt.device)
    elapsed = time.perf_counter() - t0
    rt.cycle.timer = None
    cycles = rt.num_cycles - cycles0
    host_us = 1e6 * (rt.host_seconds - host0) / max(cycles, 1)
    phases = timer.summary()
    gens = [rt.get_generation(r) for r in rids]
    decoded = sum(len(x.token_ids) - 1 for x in gens)  # the first token of each came from prefill
    gpu_cycles = sum(x.num_cycles for x in gens) / len(gens)
    return {
        "batch_size": batch_size,
        "tokens": decoded,
        "seconds": elapsed,
        "tokens_per_s": decoded / elapsed,
        "cycles": cycles,
        "cycle_ms": 1e3 * elapsed / max(cycles, 1),
        "mean_acceptance_length": decoded / max(gpu_cycles * len(gens), 1),
        "host_us_per_cycle": host_us,
        "gpu_us_per_cycle": 1e3 * sum(p["total_ms"] for p in phases.values()) / max(cycles, 1),
        "phases": phases,
    }


def main(args) -> list[dict]:
    from graphrt.presets import ensure_preset, ensure_self_draft

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    on_cuda = device.type == "cuda"
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}.get(
        args.dtype, torch.bfloat16 if on_cuda else torch.float32)
    batch_sizes = args.batch_sizes or ([1, 2, 4, 8, 16, 32, 64] if on_cuda else [1, 4])
    max_new = args.max_new_tokens or (128 if on_cuda else 32)
    if args.target:
        target, draft_desc = args.target, None
    else:
        preset = args.preset or ("llama-1b-shape" if on_cuda else "tiny")
        print(f"graphrt bench: embedded random preset {preset!r} ({str(dtype).split('.')[-1]}, {device})")
        target = ensure_preset(preset, dtype)
    draft = None
    if args.draft:
        draft, draft_desc = args.draft, f"checkpoint {args.draft}"
    elif not args.no_draft:
        from graphrt.config import load_config

        layers = args.draft_layers or max(1, load_config(target).num_hidden_layers // 4)
        draft = ensure_self_draft(target, layers)
        draft_desc = f"self-draft: the target's first {layers} layer(s), shared embeddings and LM head"

    max_bs = max(batch_sizes)
    seq = args.prompt_len + max_new + 8
    kw = dict(device=device, dtype=dtype, max_batch_size=max_bs, max_seq_len=seq,
              kv_budget_tokens=max_bs * (seq + 64))
    graphs = on_cuda and not args.eager
    runtimes = []
    if draft:
        spec = Runtime.from_pretrained(target, draft, num_draft_tokens=args.num_draft_tokens,
                                       use_cuda_graphs=graphs, **kw)
        runtimes.append(("spec-graphs" if graphs else "spec-eager", spec))
        base = spec.target_ckpt
        if graphs:  # the same cycle without graphs, for the graph speed-up
            runtimes.append(("spec-eager", Runtime(spec.target_ckpt, spec.draft_ckpt, use_cuda_graphs=False,
                                                   num_draft_tokens=args.num_draft_tokens, device=device,
                                                   max_batch_size=max_bs, max_seq_len=seq,
                                                   kv_budget_tokens=max_bs * (seq + 64))))
    else:
        base = target
    plain = Runtime.from_pretrained(base, None, use_cuda_graphs=graphs, **kw)
    runtimes.append(("plain-graphs" if graphs else "plain-eager", plain))
    for name, rt in runtimes:
        if rt.use_cuda_graphs:
            t0 = time.perf_counter()
            recs = rt.capture(inspect_kernels=False)
            print(f"{name}: captured {len(recs)} graphs in {time.perf_counter() - t0:.1f} s, "
                  f"pool {torch.cuda.memory_reserved(device) / 2**20:.0f} MiB reserved")

    results = []
    jobs = [(m, rt, b) for m, rt in runtimes for b in batch_sizes]
    for mode, rt, b in tqdm(jobs, desc="bench", unit="run", disable=len(jobs) < 3):
        run_decode(rt, b, prompt_len=args.prompt_len, max_new_tokens=min(8, max_new))  # warm-up
        r = run_decode(rt, b, prompt_len=args.prompt_len, max_new_tokens=max_new)
        r["mode"] = mode
        results.append(r)

    print(f"draft: {draft_desc or 'none'}; K = {args.num_draft_tokens}; prompt {args.prompt_len}, "
          f"{max_new} new tokens per request, greedy")
    phase_names = ["TARGET_VERIFY", "DRAFT_EXTEND", "DRAFT_DECODE", "TARGET_DECODE"]
    head = (f"{'mode':<12} {'B':>4} {'tok/s':>10} {'cycle ms':>9} {'host us':>8} {'gpu us':>8} {'accept len':>10}  "
            + "  ".join(f"{p + ' us':>17}" for p in phase_names))
    print(head)
    for r in results:
        ph = "  ".join(f"{r['phases'].get(p, {}).get('mean_us', float('nan')):>17.1f}" for p in phase_names)
        print(f"{r['mode']:<12} {r['batch_size']:>4} {r['tokens_per_s']:>10.1f} {r['cycle_ms']:>9.2f} "
              f"{r['host_us_per_cycle']:>8.0f} {r['gpu_us_per_cycle']:>8.0f} "
              f"{r['mean_acceptance_length']:>10.2f}  {ph}")
    if args.json_out:
        meta = {"device": torch.cuda.get_device_name(device) if on_cuda else "cpu", "torch": torch.__version__,
                "draft": draft_desc, "num_draft_tokens": args.num_draft_tokens, "target": str(target)}
        with open(args.json_out, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=2)
    return results
