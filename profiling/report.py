"""Per-phase reports (text table, JSON, PNG chart, Perfetto trace) and `graphrt profile`.

    graphrt profile [CKPT]                     in-process: PyTorch profiler (CUPTI) attribution
    graphrt profile [CKPT] --nsys              the same workload under nsys, table from its export
    graphrt profile --from-sqlite FILE         table from a capture the user made with nsys

With no checkpoint the workload is an embedded random preset (llama-1b-shape on CUDA, tiny on the
CPU) with a self-draft, decoded greedily at each --batch-sizes value after a warm-up.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

from graphrt.profiling.attribution import UNATTRIBUTED, Attribution, PhaseStats, ProfilingError, short_kernel_name
from graphrt.profiling.phases import ALL_PHASES

from graphrt.cli import int_list

# ---- text -----------------------------------------------------------------------------------


def _ms(ns) -> str:
    return f"{ns / 1e6:.3f}"


def _us(ns) -> str:
    return "-" if ns is None or (isinstance(ns, float) and math.isnan(ns)) else f"{ns / 1e3:.1f}"


def _num(x, fmt="{:.1f}") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else fmt.format(x)


def _ordered(result: Attribution) -> list[PhaseStats]:
    order = {p: i for i, p in enumerate(ALL_PHASES)}
    return sorted(result.phases.values(), key=lambda p: (order.get(p.name, len(order)), p.name))


def format_table(result: Attribution, *, top: int = 3, expected_nodes: dict | None = None) -> str:
    """The per-phase table. expected_nodes: {(phase, B): kernel nodes of the captured graph}, shown
    beside the measured kernels per launch when given."""
    lines = [f"per-phase GPU kernel time ({result.source}): {result.total_kernels} kernels, "
             f"{_ms(result.total_ns)} ms in all (sum of kernel durations)"]
    head = (f"{'phase':<15} {'launches':>8} {'kernels':>8} {'k/launch':>8} {'total ms':>9} "
            f"{'mean us':>9} {'share':>6}  top kernels (share of the phase)")
    lines += [head, "-" * len(head)]
    for p in [*_ordered(result), result.unattributed]:
        tops = ", ".join(f"{k.name} {100 * k.total_ns / p.total_ns:.0f}%" for k in p.top_kernels(top)
                         if p.total_ns)
        launches = "-" if p.name == UNATTRIBUTED else str(p.launches)
        lines.append(f"{p.name:<15} {launches:>8} {p.kernels:>8} {_num(p.kernels_per_launch):>8} "
                     f"{_ms(p.total_ns):>9} {_us(p.mean_ns_per_launch):>9} "
                     f"{_num(100 * result.share(p), '{:.1f}%'):>6}  {tops}")
    lines.append(f"{'total':<15} {'':>8} {result.total_kernels:>8} {'':>8} {_ms(result.total_ns):>9}")
    if result.unattributed.kernels:
        why = "; ".join(f"{n} {reason}" for reason, n in sorted(result.reasons.items()))
        lines.append(f"unattributed kernels: {why}")

    bs = [b for b in result.batch_sizes()]
    if len(bs) > 1 or (bs and bs[0] is not None):
        lines += ["", "mean GPU time per launch (us) [kernels per launch] by batch size"]
        lines.append(f"{'phase':<15} " + " ".join(f"{'B=' + str(b):>18}" for b in bs))
        for p in _ordered(result):
            cells = []
            for b in bs:
                c = result.by_batch.get((p.name, b))
                if c is None:
                    cells.append(f"{'':>18}")
                    continue
                k = _num(c.kernels_per_launch, "{:.0f}") if c.kernels % max(c.launches, 1) == 0 else \
                    _num(c.kernels_per_launch)
                exp = (expected_nodes or {}).get((p.name, b))
                k = f"{k}/{exp}" if exp is not None else k
                cells.append(f"{_us(c.mean_ns_per_launch) + ' [' + k + ']':>18}")
            lines.append(f"{p.name:<15} " + " ".join(cells))
        if expected_nodes:
            lines.append("[measured kernels per launch/kernel nodes of the captured graph]")
    lines += [f"note: {n}" for n in result.notes]
    return "\n".join(lines)


# ---- JSON -----------------------------------------------------------------------------------


def _clean(x):
    return None if isinstance(x, float) and math.isnan(x) else x


def _stats_json(result: Attribution, p: PhaseStats, top: int | None) -> dict:
    return {
        "phase": p.name,
        "batch_size": p.batch_size,
        "launches": p.launches,
        "kernels": p.kernels,
        "kernels_per_launch": _clean(p.kernels_per_launch),
        "total_ns": p.total_ns,
        "mean_ns_per_launch": _clean(p.mean_ns_per_launch),
        "share": _clean(result.share(p)),
        "top_kernels": [{"name": k.name, "count": k.count, "total_ns": k.total_ns,
                         "share_of_phase": k.total_ns / p.total_ns if p.total_ns else None}
                        for k in p.top_kernels(top)],
    }


def to_json(result: Attribution, *, top: int | None = 10, meta: dict | None = None) -> dict:
    out = {
        "source": result.source,
        "total_ns": result.total_ns,
        "total_kernels": result.total_kernels,
        "phases": [_stats_json(result, p, top) for p in _ordered(result)],
        "unattributed": {**_stats_json(result, result.unattributed, top), "reasons": result.reasons},
        "by_batch": [_stats_json(result, c, top)
                     for _, c in sorted(result.by_batch.items(), key=lambda kv: (kv[0][0], kv[0][1] or 0))],
        "notes": result.notes,
    }
    if meta:
        out["meta"] = meta
    return out


def write_json(result: Attribution, path, **kw) -> None:
    with open(path, "w") as f:
        json.dump(to_json(result, **kw), f, indent=2)


# ---- PNG --------------------------------------------------------------------------------------


def write_png(result: Attribution, path) -> None:
    """Stacked bars: mean GPU time per launch of each phase (one launch of each makes a cycle), one
    bar per batch size."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ProfilingError("the PNG chart needs matplotlib: `pip install matplotlib` (the table and JSON "
                           "do not)") from None
    # PREFILL is once per request, not once per cycle: it would stack a prompt pass onto a cycle
    cycle_phases = [p for p in _ordered(result) if p.name != "PREFILL"]
    bs = [b for b in result.batch_sizes() if any((p.name, b) in result.by_batch for p in cycle_phases)]
    labels = [str(b) if b is not None else "?" for b in bs]
    fig, ax = plt.subplots(figsize=(1.2 * len(bs) + 4, 4.5))
    bottom = [0.0] * len(bs)
    for p in cycle_phases:
        vals = []
        for b in bs:
            c = result.by_batch.get((p.name, b))
            vals.append(c.mean_ns_per_launch / 1e3 if c is not None and c.launches else 0.0)
        ax.bar(labels, vals, bottom=bottom, label=p.name)
        bottom = [x + y for x, y in zip(bottom, vals)]
    ax.set_xlabel("batch size (bucket)")
    ax.set_ylabel("GPU kernel time per launch (µs)")
    ax.set_title(f"graphrt per-phase GPU time per cycle\n{result.source}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---- Perfetto / Chrome trace -----------------------------------------------------------------


def write_perfetto_trace(result: Attribution, path) -> None:
    """Chrome trace JSON (opens in ui.perfetto.dev and chrome://tracing): one row per phase holding
    that phase's kernels (GPU time), an unattributed row, and a host row with the phase ranges."""
    rows = [p.name for p in _ordered(result)] + [UNATTRIBUTED]
    tid = {name: i + 1 for i, name in enumerate(rows)}
    host_tid = len(rows) + 1
    ev: list[dict] = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "graphrt phases"}}]
    for name, t in [*tid.items(), ("host: phase ranges", host_tid)]:
        ev.append({"ph": "M", "name": "thread_name", "pid": 1, "tid": t, "args": {"name": name}})
        ev.append({"ph": "M", "name": "thread_sort_index", "pid": 1, "tid": t, "args": {"sort_index": t}})
    for k, r in result.assignment:
        row = r.name if r is not None else UNATTRIBUTED
        args = {"kernel": k.name}
        if r is not None:
            args["batch_size"] = r.batch_size
        if k.graph_node_id is not None:
            args["graph_node_id"] = k.graph_node_id
        ev.append({"ph": "X", "name": short_kernel_name(k.name), "pid": 1, "tid": tid[row], "ts": k.start_ns / 1e3,
                   "dur": k.duration_ns / 1e3, "cat": "kernel", "args": args})
    for r in result.ranges:
        ev.append({"ph": "X", "name": r.name, "pid": 1, "tid": host_tid, "ts": r.start_ns / 1e3,
                   "dur": (r.end_ns - r.start_ns) / 1e3, "cat": "phase", "args": {"batch_size": r.batch_size}})
    with open(path, "w") as f:
        json.dump({"traceEvents": ev, "displayTimeUnit": "ns"}, f)


# ---- the workload -------------------------------------------------------------------------------


def add_profile_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of `graphrt profile` (the CLI adds --draft, -k, --device, --dtype itself)."""
    p.add_argument("checkpoint", nargs="?", help="target checkpoint (default: an embedded random preset)")
    p.add_argument("--preset", help="embedded preset when no checkpoint: llama-1b-shape (CUDA default), tiny, ...")
    p.add_argument("--draft-layers", type=int, help="self-draft depth when no --draft is given")
    p.add_argument("--no-draft", action="store_true", help="plain decoding (TARGET_DECODE) only")
    p.add_argument("--eager", action="store_true", help="no CUDA graphs: every phase runs eagerly")
    p.add_argument("--nsys", action="store_true", help="run the workload under nsys and read its SQLite export")
    p.add_argument("--nsys-dir", help="keep the .nsys-rep and .sqlite here (default: a temporary directory)")
    p.add_argument("--from-sqlite", help="attribute kernel time from an existing `nsys export --type sqlite` file")
    p.add_argument("--domain", default="graphrt", help="NVTX domain of the phase ranges (--from-sqlite)")
    p.add_argument("--batch-sizes", type=int_list, help="default 1,8,64 on CUDA; 1,4 on CPU")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, help="tokens per request (default 32 CUDA / 8 CPU)")
    p.add_argument("--json", dest="json_out", help="write the table as JSON")
    p.add_argument("--png", help="write a chart of per-phase time per batch size (needs matplotlib)")
    p.add_argument("--trace", help="write a Chrome/Perfetto trace with one row per phase")
    p.add_argument("--top", type=int, default=3, help="top kernels per phase in the table")
    p.add_argument("--_inner", action="store_true", help=argparse.SUPPRESS)  # the run under nsys
    p.add_argument("--_meta", help=argparse.SUPPRESS)  # inner run: write graph node counts here


class Workload:
    """The profiled run: a Runtime with graphs captured for exactly the batch sizes profiled."""

    def __init__(self, args, *, cupti_warmup: bool = False):
        """cupti_warmup: open an empty profiler session before capturing (in-process profiling only;
        under nsys a second CUPTI client would compete with nsys's)."""
        import torch

        from graphrt.presets import default_checkpoints
        from graphrt.runtime import Runtime

        self.device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        on_cuda = self.device.type == "cuda"
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}.get(
            getattr(args, "dtype", None), torch.bfloat16 if on_cuda else torch.float32)
        self.batch_sizes = list(getattr(args, "batch_sizes", None) or ([1, 8, 64] if on_cuda else [1, 4]))
        self.prompt_len = getattr(args, "prompt_len", 32)
        self.max_new = getattr(args, "max_new_tokens", None) or (32 if on_cuda else 8)
        target, draft, draft_desc = default_checkpoints(
            getattr(args, "checkpoint", None), getattr(args, "draft", None), dtype,
            no_draft=getattr(args, "no_draft", False), draft_layers=getattr(args, "draft_layers", None),
            preset=getattr(args, "preset", None) or ("llama-1b-shape" if on_cuda else "tiny"))
        self.desc = f"target {target}; draft: {draft_desc}"
        max_bs = max(self.batch_sizes)
        seq = self.prompt_len + self.max_new + 8
        graphs = on_cuda and not getattr(args, "eager", False)
        self.rt = Runtime.from_pretrained(target, draft, num_draft_tokens=getattr(args, "num_draft_tokens", 3),
                                          device=self.device, dtype=dtype, max_batch_size=max_bs, max_seq_len=seq,
                                          kv_budget_tokens=max_bs * (seq + 64), buckets=tuple(self.batch_sizes),
                                          use_cuda_graphs=graphs)
        self.graph_nodes: dict[tuple[str, int], int] = {}
        if graphs:
            if cupti_warmup:
                from graphrt.profiling.torch_profile import init_cupti_for_cuda_graphs

                init_cupti_for_cuda_graphs()
            try:
                recs = self.rt.capture(inspect_kernels=True)
                self.graph_nodes = {(r.phase, r.batch_size): r.num_kernel_nodes for r in recs}
            except (ImportError, RuntimeError):  # no cuda-python / keep_graph: capture without listing
                self.rt.capture(inspect_kernels=False)

    def decode(self, batch_size: int, max_new_tokens: int, seed: int = 0) -> None:
        import torch

        from graphrt.params import SamplingParams

        g = torch.Generator().manual_seed(seed)
        prompts = torch.randint(0, self.rt.vocab_size, (batch_size, self.prompt_len), generator=g).tolist()
        self.rt.generate(prompts, SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True))

    def warm_up(self) -> None:
        for b in self.batch_sizes:
            self.decode(b, min(4, self.max_new))
        self._sync()

    def run(self) -> None:
        for b in self.batch_sizes:
            self.decode(b, self.max_new, seed=1)
        self._sync()

    def _sync(self):
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def meta(self) -> dict:
        import torch

        return {"workload": self.desc, "batch_sizes": self.batch_sizes, "prompt_len": self.prompt_len,
                "max_new_tokens": self.max_new, "torch": torch.__version__,
                "device": torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu",
                "graph_kernel_nodes": {f"{p}/{b}": n for (p, b), n in sorted(self.graph_nodes.items())}}


# ---- graphrt profile ----------------------------------------------------------------------------


def emit(result: Attribution, args, *, expected_nodes=None, meta=None, out=None) -> None:
    print(format_table(result, top=getattr(args, "top", 3), expected_nodes=expected_nodes), file=out or sys.stdout)
    if getattr(args, "json_out", None):
        write_json(result, args.json_out, meta=meta)
    if getattr(args, "png", None):
        write_png(result, args.png)
    if getattr(args, "trace", None):
        write_perfetto_trace(result, args.trace)


def cli_main(args) -> int:
    """The body of `graphrt profile` (args from add_profile_arguments plus the CLI's common ones).
    Errors the user can fix are raised as GraphrtError with the fix in the message."""
    from graphrt.profiling import nsys_run
    from graphrt.profiling.nsys_sqlite import NsysCaptureError, read_nsys_sqlite
    from graphrt.profiling.nvtx_ranges import disable_nvtx, enable_nvtx

    from graphrt.errors import GraphrtError

    try:
        if getattr(args, "from_sqlite", None):
            emit(read_nsys_sqlite(args.from_sqlite, domain=args.domain or None), args)
            return 0
        if getattr(args, "_inner", False):  # running under nsys: ranges only around the measured run
            w = Workload(args)
            disable_nvtx()
            w.warm_up()
            enable_nvtx(True)
            w.run()
            disable_nvtx()
            if getattr(args, "_meta", None):
                Path(args._meta).write_text(json.dumps(w.meta(), indent=2))
            return 0
        if getattr(args, "nsys", False):
            sqlite, meta = nsys_run.profile_under_nsys(args)
            nodes = {tuple(k.rsplit("/", 1)): v for k, v in meta.get("graph_kernel_nodes", {}).items()}
            nodes = {(p, int(b)): v for (p, b), v in nodes.items()}
            emit(read_nsys_sqlite(sqlite), args, expected_nodes=nodes, meta=meta)
            return 0
        import torch
        from graphrt.profiling.torch_profile import profile_callable

        if (getattr(args, "device", None) or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cpu"):
            raise ProfilingError("in-process kernel attribution needs a CUDA device (kernel records come from "
                                 "CUPTI); on a machine without one, read an Nsight export with --from-sqlite FILE")
        # On by default: measured on an H200 (torch 2.11, CUDA 13), without it the profiler counted one
        # kernel more per TARGET_VERIFY replay than the graph has (192 vs 191 at B = 1), with it
        # every phase matched its graph's node count. GRAPHRT_CUPTI_GRAPH_WARMUP=0 turns it off.
        w = Workload(args, cupti_warmup=os.environ.get("GRAPHRT_CUPTI_GRAPH_WARMUP", "1") != "0")
        w.warm_up()
        print(f"graphrt profile: {w.desc}; batch sizes {w.batch_sizes}, {w.max_new} new tokens per request",
              file=sys.stderr)
        result = profile_callable(w.run)
        emit(result, args, expected_nodes=w.graph_nodes, meta=w.meta())
        return 0
    except (NsysCaptureError, ProfilingError, FileNotFoundError) as exc:
        raise GraphrtError(str(exc)) from None
