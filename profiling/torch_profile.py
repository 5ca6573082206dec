"""In-process per-phase attribution with the PyTorch profiler (Kineto over CUPTI).

profile_callable(workload) runs the workload under torch.profiler with phase record_functions on,
exports Kineto's Chrome trace and reads it back:

  cat "user_annotation", name graphrt/<PHASE>/<B>        -> PhaseRange (pid, tid)
  cat "cuda_runtime" / "cuda_driver", args.correlation    -> Launch (cudaLaunchKernel,
                                                             cudaGraphLaunch, cuLaunchKernel, ...)
  cat "kernel", args.correlation                          -> Kernel

The Chrome trace is the parsing surface because its layout has stayed put from torch 2.4 to 2.13,
whereas the Python accessors of kineto_results events have changed names across releases. Times
are parsed as decimals (µs with ns digits; absolute epoch timestamps would lose ns as floats) and
converted to integer ns, so conservation holds exactly.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from decimal import ROUND_HALF_EVEN, Decimal
from pathlib import Path

from graphrt.profiling.attribution import Attribution, Kernel, Launch, PhaseRange, ProfilingError, attribute
from graphrt.profiling.nvtx_ranges import parse_torch_range_name, torch_ranges


def _ns(us) -> int:
    return int((Decimal(str(us)) * 1000).to_integral_value(ROUND_HALF_EVEN))


def load_chrome_trace(path) -> list[dict]:
    with open(path) as f:
        return json.load(f, parse_float=Decimal)["traceEvents"]


def records_from_chrome_trace(events: list[dict]) -> tuple[list[PhaseRange], list[Launch], list[Kernel]]:
    ranges, launches, kernels = [], [], []
    for e in events:
        if e.get("ph") not in (None, "X"):
            continue
        cat = e.get("cat")
        if cat not in ("user_annotation", "kernel", "cuda_runtime", "cuda_driver"):
            continue
        name = e.get("name", "")
        start = _ns(e.get("ts", 0))
        end = start + _ns(e.get("dur", 0))
        args = e.get("args") or {}
        if cat == "user_annotation":
            parsed = parse_torch_range_name(name)
            if parsed is not None:
                ranges.append(PhaseRange(parsed[0], parsed[1], start, end, (e.get("pid"), e.get("tid"))))
            continue
        corr = args.get("correlation")
        if corr is None:
            continue
        if cat == "kernel":
            kernels.append(Kernel(int(corr), start, end, name))
        else:
            launches.append(Launch(int(corr), start, end, (e.get("pid"), e.get("tid")), name))
    return ranges, launches, kernels


def attribute_chrome_trace(path, *, source: str | None = None) -> Attribution:
    ranges, launches, kernels = records_from_chrome_trace(load_chrome_trace(path))
    if not ranges:
        raise ValueError("the trace holds no graphrt phase ranges (user annotations named graphrt/<PHASE>/<B>): "
                         "was the workload run through a Runtime while torch_ranges() was active?")
    return attribute(ranges, launches, kernels, source=source or f"torch profiler trace {Path(path).name}")


def init_cupti_for_cuda_graphs() -> None:
    """Load CUPTI with an empty profiler session before any graph is captured (what
    torch.profiler._utils._init_for_cuda_graphs does). Some driver/CUDA stacks need it for a
    profiler attached after capture to see graph replays; on others (reported for CUDA 13 with
    torch 2.13) the empty session leaves kernel collection dead. `graphrt profile` calls it before
    capturing: without it a profiler attached later can count graph-replay kernels the graph does
    not hold."""
    try:
        from torch.profiler._utils import _init_for_cuda_graphs
    except ImportError:
        return
    _init_for_cuda_graphs()


def profile_callable(workload: Callable[[], object], *, trace_path=None) -> Attribution:
    """Run workload() under the PyTorch profiler with phase annotations on and attribute every
    CUDA kernel it ran to its phase. trace_path: keep Kineto's raw Chrome trace there.
    Raises ProfilingError when the profile holds no GPU kernel at all (CUPTI collected nothing)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    if not torch.cuda.is_available():
        raise ProfilingError("in-process kernel attribution needs a CUDA device: kernel records come from CUPTI")
    torch.cuda.synchronize()
    with torch_ranges(), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                                 record_shapes=False, with_stack=False) as prof:
        workload()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory(prefix="graphrt-kineto-") as tmp:
        path = trace_path or Path(tmp) / "kineto.json"
        prof.export_chrome_trace(str(path))
        result = attribute_chrome_trace(path, source="torch profiler (in process)")
    if result.total_kernels == 0:
        raise ProfilingError(
            "the PyTorch profiler recorded phase ranges but no CUDA kernel: CUPTI collected nothing "
            "(another CUPTI client such as nsys or a profiler session opened before graph capture can do "
            "this). Try --eager or --nsys.")
    return result
