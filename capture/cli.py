"""`graphrt capture`: capture every phase x bucket, report, validate against eager, dump DOT."""

from __future__ import annotations

import json
import os
import time

import torch
from tqdm import tqdm

from graphrt.errors import GraphrtError


def cli_main(args) -> int:
    if not torch.cuda.is_available() or (args.device and torch.device(args.device).type != "cuda"):
        raise GraphrtError("graphrt capture needs a CUDA device (CUDA graphs); none is available")
    from graphrt.capture.inspect import write_dot
    from graphrt.capture.validate import compare_replay_to_eager

    from graphrt import Runtime, SamplingParams
    from graphrt.arg_types import device_and_dtype
    from graphrt.parallel import join_ranks, rank_zero_first
    from graphrt.presets import default_checkpoints

    _, dtype = device_and_dtype(args)  # on CUDA, as checked above: bf16 by default
    with rank_zero_first(join_ranks(args.tp)):
        target, draft, desc = default_checkpoints(args.checkpoint, args.draft, dtype, no_draft=args.no_draft)
    rt = Runtime.from_pretrained(target, draft, num_draft_tokens=args.num_draft_tokens, device="cuda",
                                 dtype=dtype, max_batch_size=args.max_batch_size, max_seq_len=args.max_seq_len,
                                 use_cuda_graphs=True, tensor_parallel_size=args.tp,
                                 draft_quantization=args.draft_quantization if draft else None,
                                 prefix_caching=not args.no_prefix_caching,
                                 prefill_chunk_tokens=args.prefill_chunk_tokens)
    phases = [p for p, _ in rt.cycle.phases()]
    print(f"graphrt capture: target {target}; draft: {desc}; K = {rt.K}; buckets {list(rt.buckets)}")
    t0 = time.perf_counter()
    with tqdm(total=len(phases) * len(rt.buckets), desc="capture", unit="graph") as bar:
        records = rt.capture(progress=lambda r: bar.update(1), prefill=args.prefill)
    total_s = time.perf_counter() - t0
    graphs = rt.cycle.graphs
    print(f"precompile: {graphs.precompiled} kernel variants in {graphs.precompile_s:.1f} s")
    prefill_s = sum(p.capture_s for p in graphs.prefills.values())
    if args.prefill:
        cached = sum(key[2] for key in graphs.prefills)  # (rows, length, past a cached prefix, chunk)
        chunks = sum(key[3] for key in graphs.prefills)
        print(f"prefill graphs: {len(graphs.prefills)} ({cached} of them past a cached prefix, {chunks} for chunks "
              f"before a prompt's last) in {prefill_s:.1f} s, "
              f"after precompiling {graphs.prefill_precompiled} kernel variants in {graphs.prefill_precompile_s:.1f} s "
              "(within the total below)")

    # Validate with real state: a few requests decoded for a few cycles, then every bucket's
    # phases replayed and re-run eagerly from the same buffers.
    g = torch.Generator().manual_seed(0)
    for i in range(min(rt.max_batch_size, 5)):
        rt.add_request(torch.randint(0, rt.vocab_size, (16,), generator=g).tolist(),
                       SamplingParams(max_new_tokens=64, temperature=0.0 if i % 2 else 0.8, seed=i, ignore_eos=True))
    for _ in range(3):
        rt.step()
    exact = {}
    for b in rt.buckets:
        diffs = compare_replay_to_eager(rt, b)
        for phase, bad in diffs.items():
            exact[(phase, b)] = bad

    rows = []
    print(f"{'phase':<14} {'bucket':>6} {'capture ms':>10} {'kernel nodes':>12} {'pool MiB':>9}  replay == eager")
    for r in sorted(records, key=lambda r: (phases.index(r.phase), r.batch_size)):
        bad = exact.get((r.phase, r.batch_size))
        verdict = "bit-exact" if bad == [] else f"DIFFERS in {', '.join(bad)}"
        print(f"{r.phase:<14} {r.batch_size:>6} {1e3 * r.capture_s:>10.1f} {r.num_kernel_nodes:>12} "
              f"{r.pool_bytes / 2**20:>9.1f}  {verdict}")
        rows.append({"phase": r.phase, "batch_size": r.batch_size, "capture_ms": 1e3 * r.capture_s,
                     "kernel_nodes": r.num_kernel_nodes, "kernels": r.kernels, "pool_bytes": r.pool_bytes,
                     "bit_exact": bad == []})
        if args.dot:
            os.makedirs(args.dot, exist_ok=True)
            write_dot(r.graph, os.path.join(args.dot, f"{r.phase}_B{r.batch_size}.dot"))
    all_exact = all(row["bit_exact"] for row in rows)
    pool = max((r.pool_bytes for r in records), default=0)
    print(f"{len(records)} graphs in {total_s:.1f} s (one shared pool, {pool / 2**20:.0f} MiB); "
          f"replay {'equals' if all_exact else 'DOES NOT equal'} eager bit for bit in every graph")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"target": str(target), "draft": desc, "num_draft_tokens": rt.K, "total_s": total_s,
                       "precompiled": graphs.precompiled, "precompile_s": graphs.precompile_s,
                       "pool_bytes": pool, "all_bit_exact": all_exact, "graphs": rows,
                       "prefill_shapes": sorted(graphs.prefills), "prefill_capture_s": prefill_s,
                       "prefill_precompiled": graphs.prefill_precompiled,
                       "prefill_precompile_s": graphs.prefill_precompile_s}, f, indent=2)
    return 0 if all_exact else 1
