"""`graphrt bench`: decode throughput, acceptance length and per-phase time.

With no arguments it runs an embedded random model (tiny on CPU, llama-1b-shape on CUDA) with a
self-draft, so a fresh machine needs no download.
"""

from __future__ import annotations

import json
import time

import torch
from tqdm import tqdm

from graphrt.errors import GraphrtError
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


def weight_bytes(ckpt, *, shared=None) -> int:
    """Bytes a forward must read for its weights: every tensor once (tied ones once), but not an
    untied embedding table, of which a forward reads only its tokens' rows."""
    seen, total = set(), 0
    skip = None if ckpt.config.tie_word_embeddings else ckpt.weights.get("embed_tokens.weight")
    for t in ckpt.weights.values():
        if t is skip or t.data_ptr() in seen or not t.is_floating_point():
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total + (shared or 0)


def rooflines(rt, bandwidth_gbs: float) -> dict[str, float]:
    """Per-phase floor in microseconds: weight bytes read once over measured bandwidth (the KV
    read at these context lengths is under 1% of it)."""
    t = weight_bytes(rt.target_ckpt)
    us = lambda nbytes: nbytes / (bandwidth_gbs * 1e3)  # noqa: E731
    floors = {"TARGET_VERIFY": us(t), "TARGET_DECODE": us(t)}
    if rt.draft_ckpt is not None:
        shared = rt.target_ckpt.weights["lm_head.weight"] if rt.draft_ckpt.kind == "eagle" else None
        d = weight_bytes(rt.draft_ckpt, shared=shared.numel() * shared.element_size() if shared is not None else 0)
        floors["DRAFT_EXTEND"] = us(d)
        floors["DRAFT_DECODE"] = us(d) * (rt.K - 1)
    return floors


def main(args) -> list[dict]:
    from graphrt.presets import default_checkpoints

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    on_cuda = device.type == "cuda"
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}.get(
        args.dtype, torch.bfloat16 if on_cuda else torch.float32)
    batch_sizes = args.batch_sizes or ([1, 2, 4, 8, 16, 32, 64] if on_cuda else [1, 4])
    max_new = args.max_new_tokens or (128 if on_cuda else 32)
    if args.target is None:
        preset = args.preset or ("llama-1b-shape" if on_cuda else "tiny")
        print(f"graphrt bench: embedded random preset {preset!r} ({str(dtype).split('.')[-1]}, {device})")
    target, draft, draft_desc = default_checkpoints(args.target, args.draft, dtype, no_draft=args.no_draft,
                                                    draft_layers=args.draft_layers, preset=args.preset,
                                                    damped=args.damped, draft_kind=args.draft_kind)
    max_bs = max(batch_sizes)
    seq = args.prompt_len + max_new + 8
    kw = dict(device=device, dtype=dtype, max_batch_size=max_bs, max_seq_len=seq)
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
                                                   max_batch_size=max_bs, max_seq_len=seq)))
    else:
        base = target
    plain = Runtime.from_pretrained(base, None, use_cuda_graphs=graphs, **kw)
    runtimes.append(("plain-graphs" if graphs else "plain-eager", plain))
    for name, rt in runtimes:
        if rt.use_cuda_graphs:
            t0 = time.perf_counter()
            recs = rt.capture(inspect_kernels=False)
            print(f"{name}: captured {len(recs)} graphs in {time.perf_counter() - t0:.1f} s")

    results = []
    jobs = [(m, rt, b) for m, rt in runtimes for b in batch_sizes]
    for mode, rt, b in tqdm(jobs, desc="bench", unit="run", disable=len(jobs) < 3):
        run_decode(rt, b, prompt_len=args.prompt_len, max_new_tokens=min(8, max_new))  # warm-up
        r = run_decode(rt, b, prompt_len=args.prompt_len, max_new_tokens=max_new)
        r["mode"] = mode
        results.append(r)

    bandwidth = None
    if on_cuda:
        from graphrt.kernels.timing import memory_bandwidth_gbs

        bandwidth = memory_bandwidth_gbs()
        for r in results:
            rt = dict(runtimes)[r["mode"]]
            for phase, floor in rooflines(rt, bandwidth).items():
                if phase in r["phases"]:
                    r["phases"][phase]["floor_us"] = floor
                    r["phases"][phase]["roofline_share"] = floor / r["phases"][phase]["mean_us"]

    print(f"draft: {draft_desc or 'none'}; K = {args.num_draft_tokens}; prompt {args.prompt_len}, "
          f"{max_new} new tokens per request, greedy" + (f"; bandwidth {bandwidth:.0f} GB/s" if bandwidth else ""))
    phase_names = ["TARGET_VERIFY", "DRAFT_EXTEND", "DRAFT_DECODE", "TARGET_DECODE"]
    head = (f"{'mode':<12} {'B':>4} {'tok/s':>10} {'cycle ms':>9} {'host us':>8} {'gpu us':>8} {'accept len':>10}  "
            + "  ".join(f"{p + ' us (roof)':>24}" for p in phase_names))
    print(head)
    for r in results:
        cells = []
        for p in phase_names:
            ph = r["phases"].get(p)
            if ph is None:
                cells.append(f"{'-':>24}")
            elif "roofline_share" in ph:
                cells.append(f"{ph['mean_us']:>15.1f} ({100 * ph['roofline_share']:>4.0f}%)")
            else:  # no bandwidth on the CPU, so no roofline
                cells.append(f"{ph['mean_us']:>24.1f}")
        print(f"{r['mode']:<12} {r['batch_size']:>4} {r['tokens_per_s']:>10.1f} {r['cycle_ms']:>9.2f} "
              f"{r['host_us_per_cycle']:>8.0f} {r['gpu_us_per_cycle']:>8.0f} {r['mean_acceptance_length']:>10.2f}  "
              + "  ".join(cells))

    peers = []
    if args.peers and on_cuda:
        from graphrt.peers import run_hf

        peers = run_hf(target, draft, batch_sizes=[b for b in batch_sizes if b in (1, 8, 64)],
                       prompt_len=args.prompt_len, new_tokens=max_new, num_draft_tokens=args.num_draft_tokens)
        ours = {(r["mode"], r["batch_size"]): r["tokens_per_s"] for r in results}
        print(f"{'peer':<18} {'B':>4} {'tok/s':>10} {'accept len':>10}  graphrt plain-graphs / peer   "
              "spec-graphs / peer")
        for p in peers:
            pl, sp = ours.get(("plain-graphs", p["batch_size"])), ours.get(("spec-graphs", p["batch_size"]))
            r_pl, r_sp = ((x or float("nan")) / p["tokens_per_s"] for x in (pl, sp))
            acc = p.get("mean_acceptance_length")
            acc = f"{acc:>10.2f}" if acc is not None else f"{'-':>10}"
            print(f"{p['mode']:<18} {p['batch_size']:>4} {p['tokens_per_s']:>10.1f} {acc}  {r_pl:>27.2f}x  "
                  f"{r_sp:>17.2f}x")
    if bandwidth:
        t_bytes = weight_bytes(plain.target_ckpt)
        print(f"weight-read roofline for plain decode at B=1: {bandwidth * 1e9 / t_bytes:.0f} tok/s "
              f"({t_bytes / 2**30:.2f} GiB of weights)")
    if args.png:
        write_png(results, args.png, title=f"graphrt bench: {target}\ndraft: {draft_desc}")
    if args.json_out:
        meta = {"device": torch.cuda.get_device_name(device) if on_cuda else "cpu", "torch": torch.__version__,
                "draft": draft_desc, "num_draft_tokens": args.num_draft_tokens, "target": str(target),
                "bandwidth_gbs": bandwidth, "date": time.strftime("%Y-%m-%d")}
        try:
            import triton

            meta["triton"] = triton.__version__
        except ImportError:
            pass
        with open(args.json_out, "w") as f:
            json.dump({"meta": meta, "results": results, "peers": peers}, f, indent=2)
    return results


def write_png(results: list[dict], path, *, title: str = "") -> None:
    """Tokens/s against batch size, one line per mode."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise GraphrtError("--png needs matplotlib: `pip install matplotlib`") from None
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for mode in dict.fromkeys(r["mode"] for r in results):
        rows = sorted((r for r in results if r["mode"] == mode), key=lambda r: r["batch_size"])
        ax.plot([r["batch_size"] for r in rows], [r["tokens_per_s"] for r in rows], marker="o", label=mode)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    sizes = sorted({r["batch_size"] for r in results})
    ax.set_xticks(sizes, [str(b) for b in sizes])
    ax.set_xlabel("batch size")
    ax.set_ylabel("decode tokens/s")
    ax.set_title(title, fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
