"""The per-phase report (text table and JSON) and `graphrt profile`.

    graphrt profile [CKPT]                     in-process: PyTorch profiler (CUPTI) attribution
    graphrt profile [CKPT] --nsys              the same workload under nsys, table from its export
    graphrt profile --from-sqlite FILE         table from a capture the user made with nsys
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from graphrt.profiling.attribution import UNATTRIBUTED, Attribution, PhaseStats, ProfilingError
from graphrt.profiling.kernel_families import IDLE, SEGMENTS, family_bars, kernel_family, write_png
from graphrt.profiling.phases import PREFILL, phase_order
from graphrt.profiling.workload import EventTimes, Workload, keyed_from_json, keyed_to_json

from graphrt.arg_types import add_workload_draft_arguments, decode_tokens, positive_int, positive_int_list

# Tracing slows replays (nsys node-level graph tracing the most). Past this, the header says so.
OVERHEAD_LIMIT = 0.05
WALL_DEFINITION = ("wall: first kernel start to last kernel end of each launch, from the trace; events: CUDA "
                   "events around the launch with no profiler attached (traced: the same under the profiler); "
                   "sum: sum of kernel durations (kernels that overlap count twice)")
KERNEL_COLUMNS = ("exclusive: how much later the launch ends because of the kernel (adds up to wall); wait: "
                  "its duration overlapped by earlier kernels (under PDL, waiting for its producer); gap: idle "
                  "GPU time before it (inside exclusive)")

# ---- text -----------------------------------------------------------------------------------


def _ms(ns) -> str:
    return f"{ns / 1e6:.3f}"


def _us(ns) -> str:
    return "-" if ns is None or (isinstance(ns, float) and math.isnan(ns)) else f"{ns / 1e3:.1f}"


def _num(x, fmt="{:.1f}") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else fmt.format(x)


def _ordered(cells) -> list[PhaseStats]:
    return sorted(cells, key=lambda p: phase_order(p.name, p.batch_size))


def _per_launch(c: PhaseStats, expected_nodes: dict | None) -> str:
    k = _num(c.kernels_per_launch, "{:.0f}" if c.kernels % max(c.launches, 1) == 0 else "{:.1f}")
    exp = (expected_nodes or {}).get((c.name, c.batch_size))
    return f"{k}/{exp}" if exp is not None else k


def wall_over_events(c: PhaseStats, events: EventTimes | None) -> float | None:
    ev = (events or {}).get((c.name, c.batch_size))
    if not ev or not c.launches or not c.wall_ns:
        return None
    return c.mean_wall_ns_per_launch / 1e3 / ev - 1


def tracing_overhead(result: Attribution, events: EventTimes | None) -> dict | None:
    """The cell whose traced wall time exceeds its untraced CUDA-event time the most. PREFILL is
    left out: it runs eagerly, so its launches pay the tracer's cost per API call, which graph
    replays do not."""
    worst = None
    for c in result.by_batch.values():
        over = wall_over_events(c, events)
        if c.name != PREFILL and over is not None and (worst is None or over > worst["overhead"]):
            worst = {"phase": c.name, "batch_size": c.batch_size, "wall_us": c.mean_wall_ns_per_launch / 1e3,
                     "events_us": events[(c.name, c.batch_size)], "overhead": over}
    if worst is None:
        return None
    return {"limit": OVERHEAD_LIMIT, "worst": worst, "over_limit": worst["overhead"] > OVERHEAD_LIMIT}


def _overhead_lines(result: Attribution, events: EventTimes | None) -> list[str]:
    t = tracing_overhead(result, events)
    if t is None:
        return []
    w = t["worst"]
    line = (f"tracing overhead: wall under the profiler against CUDA events without it, worst "
            f"{w['phase']} B={w['batch_size']}: {_num(w['wall_us'])} us against {_num(w['events_us'])} us, "
            f"{100 * w['overhead']:+.1f}%")
    if not t["over_limit"]:
        return [line + f" (within {100 * OVERHEAD_LIMIT:.0f}%)"]
    return [line + f": OVER {100 * OVERHEAD_LIMIT:.0f}%, tracing inflates these figures. "
            "`graphrt profile --nsys --graph-trace` traces each replay whole (nsys --cuda-graph-trace=graph): "
            "phase wall times with less overhead, no per-kernel detail"]


def format_table(result: Attribution, *, top: int = 3, expected_nodes: dict | None = None,
                 events: EventTimes | None = None, events_traced: EventTimes | None = None) -> str:
    """The report. expected_nodes: {(phase, B): kernel nodes of the captured graph}, shown beside
    the measured kernels per launch; events / events_traced: CUDA-event microseconds per launch,
    {(phase, B): us}, without and with the profiler attached."""
    lines = [f"graphrt profile ({result.source}): {result.total_kernels} kernels, {_ms(result.total_ns)} ms "
             f"of kernel time in all (sum of durations)"]
    lines += _overhead_lines(result, events)

    lines += ["", f"per launch, us. {WALL_DEFINITION}"]
    head = (f"{'phase':<15} {'B':>4} {'launches':>8} {'kernels':>9} {'wall':>9} {'events':>9} {'traced':>9} "
            f"{'wall/ev':>8} {'sum':>9}")
    lines += [head, "-" * len(head)]
    for c in _ordered(result.by_batch.values()):
        ev = (events or {}).get((c.name, c.batch_size))
        tr = (events_traced or {}).get((c.name, c.batch_size))
        ratio = wall_over_events(c, events)
        lines.append(f"{c.name:<15} {_num(c.batch_size, '{}'):>4} {c.launches:>8} "
                     f"{_per_launch(c, expected_nodes):>9} {_us(c.mean_wall_ns_per_launch):>9} {_num(ev):>9} "
                     f"{_num(tr):>9} {_num(None if ratio is None else 100 * ratio, '{:+.1f}%'):>8} "
                     f"{_us(c.mean_ns_per_launch):>9}")
    if expected_nodes:
        lines.append("kernels: measured per launch/kernel nodes of the captured graph")

    lines += ["", "by phase, all batch sizes, ms: phases + unattributed = total kernel time"]
    head = f"{'phase':<15} {'launches':>8} {'kernels':>8} {'wall':>9} {'sum':>9} {'share':>6}"
    lines += [head, "-" * len(head)]
    for p in [*_ordered(result.phases.values()), result.unattributed]:
        launches = "-" if p.name == UNATTRIBUTED else str(p.launches)
        wall = "-" if p.name == UNATTRIBUTED else _ms(p.wall_ns)
        lines.append(f"{p.name:<15} {launches:>8} {p.kernels:>8} {wall:>9} {_ms(p.total_ns):>9} "
                     f"{_num(100 * result.share(p), '{:.1f}%'):>6}")
    lines.append(f"{'total':<15} {'':>8} {result.total_kernels:>8} {'':>9} {_ms(result.total_ns):>9}")
    if result.unattributed.kernels:
        why = "; ".join(f"{n} {reason}" for reason, n in sorted(result.reasons.items()))
        lines.append(f"unattributed kernels: {why}")

    bars, by_family = family_bars(result)
    if bars:  # compute against communication (family comm) and the rest, for every launch
        shown = [f for f in SEGMENTS if any(v > 0 for v in by_family[f])]
        lines += ["", "by kernel family, exclusive us per launch (they add up to the wall; idle: the GPU idle "
                      "between kernels)"]
        head = f"{'phase':<15} {'B':>4} " + " ".join(f"{'idle' if f == IDLE else f:>11}" for f in shown)
        lines += [head, "-" * len(head)]
        for i, (name, b) in enumerate(bars):
            lines.append(f"{name:<15} {_num(b, '{}'):>4} " + " ".join(f"{by_family[f][i]:>11.1f}" for f in shown))

    if top > 0:
        lines += ["", f"top kernels by exclusive time, us per launch. {KERNEL_COLUMNS}"]
        for c in _ordered(result.by_batch.values()):
            if not c.kernels:
                continue
            lines.append(f"{c.name} B={c.batch_size}: wall {_us(c.mean_wall_ns_per_launch)} us per launch")
            lines.append(f"  {'kernel':<44} {'family':<11} {'n':>5} {'excl':>8} {'wait':>8} {'gap':>7} {'dur':>8} "
                         f"{'excl%':>6}")
            for k in c.top_kernels(top):
                per = c.launches
                lines.append(f"  {k.name[:44]:<44} {kernel_family(k.name):<11} {_num(k.count / per):>5} "
                             f"{_us(k.exclusive_ns / per):>8} {_us(k.wait_ns / per):>8} {_us(k.gap_ns / per):>7} "
                             f"{_us(k.total_ns / per):>8} "
                             f"{_num(100 * k.exclusive_ns / c.wall_ns if c.wall_ns else None, '{:.0f}%'):>6}")
    lines += [f"note: {n}" for n in result.notes]
    return "\n".join(lines)


# ---- JSON -----------------------------------------------------------------------------------


def _clean(x):
    return None if isinstance(x, float) and math.isnan(x) else x


def _stats_json(result: Attribution, p: PhaseStats, top: int | None) -> dict:
    has_wall = p.name != UNATTRIBUTED
    return {
        "phase": p.name, "batch_size": p.batch_size, "launches": p.launches, "kernels": p.kernels,
        "kernels_per_launch": _clean(p.kernels_per_launch), "total_ns": p.total_ns,
        "mean_ns_per_launch": _clean(p.mean_ns_per_launch), "wall_ns": p.wall_ns if has_wall else None,
        "mean_wall_ns_per_launch": _clean(p.mean_wall_ns_per_launch) if has_wall else None,
        "share": _clean(result.share(p)),
        "top_kernels": [{"name": k.name, "family": kernel_family(k.name), "count": k.count, "total_ns": k.total_ns,
                         "share_of_phase": k.total_ns / p.total_ns if p.total_ns else None,
                         "exclusive_ns": k.exclusive_ns, "wait_ns": k.wait_ns, "gap_ns": k.gap_ns,
                         "exclusive_share_of_wall": k.exclusive_ns / p.wall_ns if p.wall_ns else None}
                        for k in p.top_kernels(top)],
    }


def to_json(result: Attribution, *, top: int | None = 10, meta: dict | None = None,
            events: EventTimes | None = None, events_traced: EventTimes | None = None) -> dict:
    bars, by_family = family_bars(result)
    families = {cell: {f: by_family[f][i] for f in SEGMENTS} for i, cell in enumerate(bars)}
    by_batch = []
    for c in _ordered(result.by_batch.values()):
        cell = _stats_json(result, c, top)
        cell["families_us"] = families.get((c.name, c.batch_size))  # exclusive us per launch (not PREFILL)
        cell["cuda_events_us"] = (events or {}).get((c.name, c.batch_size))
        cell["cuda_events_traced_us"] = (events_traced or {}).get((c.name, c.batch_size))
        cell["wall_over_events"] = wall_over_events(c, events)
        by_batch.append(cell)
    out = {
        "source": result.source, "definitions": {"per_launch": WALL_DEFINITION, "kernels": KERNEL_COLUMNS},
        "total_ns": result.total_ns, "total_kernels": result.total_kernels,
        "tracing_overhead": tracing_overhead(result, events),
        "phases": [_stats_json(result, p, top) for p in _ordered(result.phases.values())],
        "unattributed": {**_stats_json(result, result.unattributed, top), "reasons": result.reasons},
        "by_batch": by_batch,
        "notes": result.notes,
    }
    if meta:
        out["meta"] = meta
    return out


# ---- graphrt profile ----------------------------------------------------------------------------


def add_profile_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of `graphrt profile` (the CLI adds --draft, -k, --device, --dtype itself)."""
    p.add_argument("checkpoint", nargs="?", help="target checkpoint (default: an embedded random preset)")
    p.add_argument("--preset", help="embedded preset when no checkpoint: llama-1b-shape (CUDA default), tiny, ...")
    p.add_argument("--draft-layers", type=positive_int, help="self-draft depth when no --draft is given")
    p.add_argument("--no-draft", action="store_true", help="plain decoding (TARGET_DECODE) only")
    add_workload_draft_arguments(p)
    p.add_argument("--eager", action="store_true", help="no CUDA graphs: every phase runs eagerly")
    p.add_argument("--nsys", action="store_true", help="run the workload under nsys and read its SQLite export")
    p.add_argument("--nsys-dir", help="keep the .nsys-rep and .sqlite here (default: a temporary directory)")
    p.add_argument("--graph-trace", action="store_true",
                   help="--nsys: trace each graph replay whole (nsys --cuda-graph-trace=graph), less overhead, "
                        "phase wall times only; --from-sqlite: read such a capture")
    p.add_argument("--from-sqlite", help="attribute kernel time from an existing `nsys export --type sqlite` file")
    p.add_argument("--domain", default="graphrt", help="NVTX domain of the phase ranges (--from-sqlite)")
    p.add_argument("--batch-sizes", type=positive_int_list, help="default 1,8,64 on CUDA; 1,4 on CPU")
    p.add_argument("--prompt-len", type=positive_int, default=32)
    p.add_argument("--max-new-tokens", type=decode_tokens, help="tokens per request (default 32 CUDA / 8 CPU)")
    p.add_argument("--json", dest="json_out", help="write the report's numbers as JSON")
    p.add_argument("--png", help="write a stacked bar per phase and batch size of exclusive time by kernel family "
                                 "(needs matplotlib)")
    p.add_argument("--trace", help="write a Perfetto/Chrome trace: a track per phase, kernels inside their launch, "
                                   "waits as slices of their own")
    p.add_argument("--top", type=positive_int, default=3, help="top kernels by exclusive time per phase and batch size")
    p.add_argument("--_inner", action="store_true", help=argparse.SUPPRESS)  # the run under nsys
    p.add_argument("--_meta", help=argparse.SUPPRESS)  # inner run: write graph node counts here


def emit(result: Attribution, args, *, expected_nodes=None, meta=None, events=None, events_traced=None,
         out=None) -> None:
    if getattr(args, "accept_len", None) is not None:
        print(f"simulated acceptance {args.accept_len:g}: each verify step accepts a drawn number of drafts (mean "
              f"tokens per cycle {args.accept_len:g}); the phases' costs are the real cycle's", file=out or sys.stdout)
    print(format_table(result, top=getattr(args, "top", 3), expected_nodes=expected_nodes, events=events,
                       events_traced=events_traced), file=out or sys.stdout)
    if getattr(args, "json_out", None):
        with open(args.json_out, "w") as f:
            json.dump(to_json(result, meta=meta, events=events, events_traced=events_traced), f, indent=2)
    if getattr(args, "png", None):
        write_png(result, args.png)
    if getattr(args, "trace", None):
        from graphrt.profiling.perfetto_trace import write_perfetto_trace

        write_perfetto_trace(result, args.trace)


def cli_main(args) -> int:
    """The body of `graphrt profile` (args from add_profile_arguments plus the CLI's common ones).
    Errors the user can fix are raised as GraphrtError with the fix in the message."""
    from pathlib import Path

    from graphrt.profiling import nsys_run
    from graphrt.profiling.nsys_sqlite import read_nsys_sqlite
    from graphrt.profiling.nvtx_ranges import disable_nvtx, enable_nvtx

    from graphrt.errors import GraphrtError

    try:
        if args.from_sqlite:
            emit(read_nsys_sqlite(args.from_sqlite, domain=args.domain or None, graph_trace=args.graph_trace), args)
            return 0
        if args._inner:  # running under nsys: ranges only around the measured run
            w = Workload(args)
            disable_nvtx()
            w.warm_up()
            enable_nvtx(True)
            traced = w.run()
            disable_nvtx()
            if args._meta:
                Path(args._meta).write_text(json.dumps({**w.meta(), "cuda_events_traced_us": keyed_to_json(traced)},
                                                       indent=2))
            return 0
        if args.nsys:
            sqlite, meta = nsys_run.profile_under_nsys(args)
            result = read_nsys_sqlite(sqlite, graph_trace=args.graph_trace)
            # nsys has exited: the same workload in this process is the untraced reference
            print("graphrt profile: timing the same workload with CUDA events, no profiler attached", file=sys.stderr)
            w = Workload(args)
            w.warm_up()
            events = w.run()
            emit(result, args, expected_nodes=keyed_from_json(meta.get("graph_kernel_nodes")),
                 meta={**meta, "cuda_events_us": keyed_to_json(events)}, events=events,
                 events_traced=keyed_from_json(meta.get("cuda_events_traced_us")))
            return 0
        if args.graph_trace:
            raise ProfilingError("--graph-trace is an nsys capture mode: use it with --nsys or --from-sqlite")
        import torch
        from graphrt.profiling.torch_profile import profile_callable

        if (args.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cpu"):
            raise ProfilingError("in-process kernel attribution needs a CUDA device (kernel records come from "
                                 "CUPTI); on a machine without one, read an Nsight export with --from-sqlite FILE")
        # Without the CUPTI warm-up a profiler attached after capture can miscount graph-replay
        # kernels; with it every phase matches its graph's node count.
        w = Workload(args, cupti_warmup=True)
        w.warm_up()
        print(f"graphrt profile: {w.desc}; batch sizes {w.batch_sizes}, {w.max_new} new tokens per request",
              file=sys.stderr)
        events = w.run()  # the same decode, before the profiler attaches
        traced: EventTimes = {}
        result = profile_callable(lambda: traced.update(w.run()))
        emit(result, args, expected_nodes=w.graph_nodes, meta={**w.meta(), "cuda_events_us": keyed_to_json(events)},
             events=events, events_traced=traced)
        return 0
    except (ProfilingError, FileNotFoundError) as exc:
        raise GraphrtError(str(exc)) from None
