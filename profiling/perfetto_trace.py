"""`graphrt profile --trace F`: a Chrome trace-event JSON file (opens in ui.perfetto.dev and
chrome://tracing).

    process "graphrt GPU"   one track per phase (named as its NVTX range, as Nsight shows it):
                            a slice per phase launch spanning its wall time, args batch_size and
                            cycle; its kernels nested inside, args exclusive/wait/gap/family; a
                            kernel's wait (the prefix of it that earlier kernels overlap) is a
                            child slice named "wait", so waits share one colour
                            + a track of the kernels no phase owns
    process "graphrt host"  the phase ranges as the host opened them, one track per thread

A track is a stack: slices on it must nest. Under PDL a kernel starts before its producer ends,
so overlapping kernels of a phase go on extra tracks of that phase ("TARGET_VERIFY #2"), each
with its own copy of the launch slice, so every kernel still sits inside its launch.
Times are written relative to the earliest record: absolute Kineto timestamps (epoch ns) as float
microseconds would lose the nanoseconds.
"""

from __future__ import annotations

import gzip
import json
from collections import defaultdict

from graphrt.profiling.attribution import UNATTRIBUTED, Attribution, PhaseRange, short_kernel_name
from graphrt.profiling.critical_path import LaunchPath
from graphrt.profiling.kernel_families import kernel_family
from graphrt.profiling.phases import PREFILL, TARGET_DECODE, TARGET_VERIFY, phase_order

GPU_PID, HOST_PID = 1, 2
CYCLE_STARTS = (TARGET_VERIFY, TARGET_DECODE)  # the first phase of a cycle, with a draft or without


def cycle_numbers(ranges: list[PhaseRange]) -> dict[PhaseRange, int | None]:
    """Per host thread, cycle n runs from the n-th cycle-start phase launch (1, 2, ...) to the
    next one; PREFILL belongs to a request, not a cycle (None)."""
    out: dict[PhaseRange, int | None] = {}
    count: dict[object, int] = defaultdict(int)
    for r in sorted(ranges, key=lambda r: r.start_ns):
        if r.name in CYCLE_STARTS:
            count[r.tid] += 1
        out[r] = None if r.name == PREFILL else count[r.tid]
    return out


def _slice(name: str, cat: str, start: int, end: int, args: dict, depth: int) -> dict:
    return {"name": name, "cat": cat, "start": start, "end": end, "args": args, "depth": depth}


def _kernel_args(name: str) -> dict:
    return {"kernel": name, "family": kernel_family(name)}


def _phase_lanes(paths: list[LaunchPath], cycles: dict) -> list[list[dict]]:
    lanes: list[list[dict]] = []
    launch_end: list[int] = []  # per lane: where the last launch slice on it ends
    for path in sorted(paths, key=lambda p: p.start_ns):
        # the lanes this launch may use (its previous launches ended), and where each is free from
        kernel_end = {i: path.start_ns for i, end in enumerate(launch_end) if end <= path.start_ns}
        used = set()
        for k in path.kernels:  # in start order
            lane = next((i for i in sorted(kernel_end) if kernel_end[i] <= k.start_ns), None)
            if lane is None:
                lane = len(lanes)
                lanes.append([])
                launch_end.append(path.start_ns)
            kernel_end[lane] = k.end_ns
            used.add(lane)
            short = short_kernel_name(k.name)
            lanes[lane].append(_slice(short, "kernel", k.start_ns, k.end_ns, {
                **_kernel_args(k.name), "exclusive_us": k.exclusive_ns / 1e3, "wait_us": k.wait_ns / 1e3,
                "gap_us": k.gap_ns / 1e3}, 1))
            if k.wait_ns:
                lanes[lane].append(_slice("wait", "wait", k.start_ns, k.start_ns + k.wait_ns, {"kernel": short}, 2))
        r = path.launch
        args = {"batch_size": r.batch_size, "cycle": cycles[r], "wall_us": path.wall_ns / 1e3,
                "kernels": len(path.kernels), "kernel_sum_us": sum(k.duration_ns for k in path.kernels) / 1e3}
        for lane in used:
            lanes[lane].append(_slice(r.name, "launch", path.start_ns, path.end_ns, args, 0))
            launch_end[lane] = path.end_ns
    return lanes


def _stray_lanes(kernels) -> list[list[dict]]:
    lanes: list[list[dict]] = []
    ends: list[int] = []
    for k in sorted(kernels, key=lambda k: k.start_ns):
        lane = next((i for i, end in enumerate(ends) if end <= k.start_ns), len(lanes))
        if lane == len(lanes):
            lanes.append([])
            ends.append(0)
        ends[lane] = k.end_ns
        lanes[lane].append(_slice(short_kernel_name(k.name), "kernel", k.start_ns, k.end_ns, _kernel_args(k.name), 0))
    return lanes


def _host_lanes(ranges: list[PhaseRange], cycles: dict) -> list[list[dict]]:
    """NVTX push/pop ranges nest and share a lane; start/end ranges that cross go on another."""
    lanes: list[list[dict]] = []
    open_ends: list[list[int]] = []  # per lane: ends of the slices still open, innermost last
    for r in sorted(ranges, key=lambda r: (r.start_ns, -r.end_ns)):
        for stack in open_ends:
            while stack and stack[-1] <= r.start_ns:
                stack.pop()
        lane = next((i for i, stack in enumerate(open_ends) if not stack or r.end_ns <= stack[-1]), len(lanes))
        if lane == len(lanes):
            lanes.append([])
            open_ends.append([])
        open_ends[lane].append(r.end_ns)
        lanes[lane].append(_slice(r.name, "phase", r.start_ns, r.end_ns,
                                  {"batch_size": r.batch_size, "cycle": cycles[r]}, 0))
    return lanes


def trace_events(result: Attribution) -> list[dict]:
    """The trace's events (ts and dur in microseconds, relative to the earliest record)."""
    cycles = cycle_numbers(result.ranges)
    by_phase: dict[str, list[LaunchPath]] = defaultdict(list)
    for path in result.paths:
        by_phase[path.launch.name].append(path)
    gpu = {phase: _phase_lanes(by_phase[phase], cycles)
           for phase in sorted(by_phase, key=phase_order)}
    stray = [k for k, r in result.assignment if r is None]
    if stray:
        gpu[UNATTRIBUTED] = _stray_lanes(stray)
    by_thread: dict[object, list[PhaseRange]] = defaultdict(list)
    for r in result.ranges:
        by_thread[r.tid].append(r)
    host = {f"host thread {i + 1}": _host_lanes(rs, cycles) for i, rs in enumerate(by_thread.values())}

    t0 = min((s["start"] for group in (*gpu.values(), *host.values()) for lane in group for s in lane), default=0)
    events: list[dict] = []
    tid = 0
    for pid, (pname, groups) in ((GPU_PID, ("graphrt GPU", gpu)), (HOST_PID, ("graphrt host", host))):
        events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": pname}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}})
        for name, lanes in groups.items():
            for i, lane in enumerate(lanes):
                tid += 1
                events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                               "args": {"name": name if i == 0 else f"{name} #{i + 1}"}})
                events.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid,
                               "args": {"sort_index": tid}})
                # parents before children at an equal start: viewers nest in file order
                for s in sorted(lane, key=lambda s: (s["start"], -s["end"], s["depth"])):
                    events.append({"ph": "X", "name": s["name"], "cat": s["cat"], "pid": pid, "tid": tid,
                                   "ts": (s["start"] - t0) / 1e3, "dur": (s["end"] - s["start"]) / 1e3,
                                   "args": s["args"]})
    return events


def write_perfetto_trace(result: Attribution, path) -> None:
    """path ending in .gz: gzip-compressed (both viewers open it; a decode at B = 64 makes tens of MB)."""
    with (gzip.open if str(path).endswith(".gz") else open)(path, "wt") as f:
        json.dump({"traceEvents": trace_events(result), "displayTimeUnit": "ns",
                   "otherData": {"source": result.source}}, f)
