"""Per-phase GPU kernel-time attribution: the data model and the algorithm, whatever the source.

Three record kinds come in (from the PyTorch profiler, an Nsight Systems SQLite export, or a test):

  PhaseRange  a phase's host-side range (NVTX push/pop or a torch record_function): name, batch
              size (the NVTX payload), [start_ns, end_ns], the thread that opened it
  Launch      a CUDA API call that started GPU work (cudaLaunchKernel, cudaGraphLaunch,
              cuLaunchKernel, cuLaunchKernelEx, ...): correlation id, [start_ns, end_ns], thread
  Kernel      a GPU kernel execution: correlation id, [start_ns, end_ns], name

A kernel belongs to the launch with its correlation id (every kernel of a replayed CUDA graph
carries the correlation id of its cudaGraphLaunch), and the launch belongs to the innermost phase
range on the launching thread that contains the launch's start. Kernels that match no launch, or
whose launch lies outside every range, land in an explicit UNATTRIBUTED row, so that

    sum over phases of kernel time + unattributed kernel time == total kernel time

exactly, in integer nanoseconds. `attribute` asserts it; so do the tests.

"Kernel time" is the sum of kernel durations (kernels that overlap, under PDL or on several
streams, count twice); memcpy/memset activity is not counted. Beside it each phase launch gets its
wall time and each kernel its exclusive, wait and gap time (critical_path.py), which add up to the
wall time exactly, also asserted here.
"""

from __future__ import annotations

import functools
import heapq
import re
from collections import defaultdict
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field

from graphrt.profiling.critical_path import LaunchPath, critical_paths

UNATTRIBUTED = "unattributed"


class ProfilingError(RuntimeError):
    """A profile could not be taken or read for a reason the user can fix; the message says how."""


@dataclass(frozen=True)
class PhaseRange:
    name: str
    batch_size: int | None
    start_ns: int
    end_ns: int
    tid: Hashable  # the launching thread; compared only with Launch.tid


@dataclass(frozen=True)
class Launch:
    correlation_id: Hashable  # an int, or (pid, id) where ids repeat across processes
    start_ns: int
    end_ns: int
    tid: Hashable
    name: str = ""


@dataclass(frozen=True)
class Kernel:
    correlation_id: Hashable
    start_ns: int
    end_ns: int
    name: str

    @property
    def duration_ns(self) -> int:
        return self.end_ns - self.start_ns


@dataclass
class KernelStat:
    name: str  # shortened
    count: int = 0
    total_ns: int = 0  # sum of durations
    exclusive_ns: int = 0  # critical-path share, gaps before it included (critical_path.py)
    wait_ns: int = 0  # duration overlapped by earlier kernels of its launch
    gap_ns: int = 0  # idle time before it (part of exclusive_ns)


@dataclass
class PhaseStats:
    """One row of the report: a phase (all batch sizes), or one (phase, batch size) cell."""

    name: str
    batch_size: int | None = None  # None: every batch size
    launches: int = 0  # phase ranges (one graph replay or one eager phase call each)
    kernels: int = 0
    total_ns: int = 0  # sum of kernel durations
    wall_ns: int = 0  # sum over launches of first kernel start to last kernel end
    kernels_by_name: dict[str, KernelStat] = field(default_factory=dict)

    @property
    def kernels_per_launch(self) -> float:
        return self.kernels / self.launches if self.launches else float("nan")

    @property
    def mean_ns_per_launch(self) -> float:
        return self.total_ns / self.launches if self.launches else float("nan")

    @property
    def mean_wall_ns_per_launch(self) -> float:
        return self.wall_ns / self.launches if self.launches else float("nan")

    def top_kernels(self, n: int | None = None) -> list[KernelStat]:
        """By exclusive time: a kernel that mostly waits for its producer ranks by what it costs."""
        ranked = sorted(self.kernels_by_name.values(), key=lambda k: (-k.exclusive_ns, -k.total_ns, k.name))
        return ranked if n is None else ranked[:n]

    def _stat(self, name: str) -> KernelStat:
        short = short_kernel_name(name)
        if short not in self.kernels_by_name:
            self.kernels_by_name[short] = KernelStat(short)
        return self.kernels_by_name[short]

    def _add(self, kernel: Kernel) -> None:
        self.kernels += 1
        d = kernel.duration_ns
        self.total_ns += d
        st = self._stat(kernel.name)
        st.count += 1
        st.total_ns += d

    def _add_path(self, path: LaunchPath) -> None:
        self.wall_ns += path.wall_ns
        for k in path.kernels:
            st = self._stat(k.name)
            st.exclusive_ns += k.exclusive_ns
            st.wait_ns += k.wait_ns
            st.gap_ns += k.gap_ns


@dataclass
class Attribution:
    phases: dict[str, PhaseStats]  # in first-seen order of the phase ranges
    by_batch: dict[tuple[str, int | None], PhaseStats]  # (phase, batch size) cells
    unattributed: PhaseStats
    total_ns: int
    total_kernels: int
    reasons: dict[str, int]  # why kernels went unattributed: reason -> kernel count
    assignment: list[tuple[Kernel, PhaseRange | None]]  # every kernel and its range (for traces)
    paths: list[LaunchPath] = field(default_factory=list)  # per phase launch with kernels, by start
    ranges: list[PhaseRange] = field(default_factory=list)
    source: str = ""
    notes: list[str] = field(default_factory=list)

    def share(self, stats: PhaseStats) -> float:
        return stats.total_ns / self.total_ns if self.total_ns else float("nan")

    def rows(self) -> list[PhaseStats]:
        """Phase rows then the unattributed row (always present, possibly zero)."""
        return [*self.phases.values(), self.unattributed]


def _innermost(ranges_by_tid: dict[Hashable, list[PhaseRange]], launches: list[Launch]
               ) -> dict[Hashable, PhaseRange]:
    """Innermost range (latest start, then shortest) on the launch's thread containing its start.

    Sweep per thread over launches sorted by start with a heap of the ranges opened so far, keyed
    by (-start, length). The heap top that has already ended is dropped for good: launch starts
    only grow. Push/pop ranges nest strictly; start/end ranges may overlap arbitrarily, and the
    latest-starting range still open is then taken as the innermost.
    """
    out: dict[Hashable, PhaseRange] = {}
    launches_by_tid: dict[Hashable, list[Launch]] = defaultdict(list)
    for ln in launches:
        launches_by_tid[ln.tid].append(ln)
    for tid, lns in launches_by_tid.items():
        rs = sorted(ranges_by_tid.get(tid, ()), key=lambda r: r.start_ns)
        lns.sort(key=lambda x: x.start_ns)
        heap: list[tuple[int, int, int, PhaseRange]] = []
        i = 0
        for ln in lns:
            t = ln.start_ns
            while i < len(rs) and rs[i].start_ns <= t:
                r = rs[i]
                heapq.heappush(heap, (-r.start_ns, r.end_ns - r.start_ns, i, r))
                i += 1
            # The top is the latest-starting open range; if it ended before t, an enclosing
            # (earlier) range may still be open: drop ended tops until one contains t.
            # Ranges below a still-open top stay (they may be needed once it ends).
            while heap and heap[0][3].end_ns < t:
                heapq.heappop(heap)
            if heap:
                out[ln.correlation_id] = heap[0][3]
    return out


def attribute(ranges: Iterable[PhaseRange], launches: Iterable[Launch], kernels: Iterable[Kernel], *,
              source: str = "") -> Attribution:
    ranges = list(ranges)
    ranges_by_tid: dict[Hashable, list[PhaseRange]] = defaultdict(list)
    for r in ranges:
        if r.end_ns < r.start_ns:
            raise ValueError(f"phase range {r.name} ends before it starts ({r.start_ns} > {r.end_ns})")
        ranges_by_tid[r.tid].append(r)

    # Several API records can share one correlation id (kineto reports cudaLaunchKernel and the
    # cuLaunchKernel it makes); keep the earliest, the outermost call.
    first: dict[Hashable, Launch] = {}
    for ln in launches:
        prev = first.get(ln.correlation_id)
        if prev is None or ln.start_ns < prev.start_ns:
            first[ln.correlation_id] = ln
    owner = _innermost(ranges_by_tid, list(first.values()))

    phases: dict[str, PhaseStats] = {}
    by_batch: dict[tuple[str, int | None], PhaseStats] = {}
    for r in sorted(ranges, key=lambda r: r.start_ns):
        phases.setdefault(r.name, PhaseStats(r.name)).launches += 1
        by_batch.setdefault((r.name, r.batch_size), PhaseStats(r.name, r.batch_size)).launches += 1

    un = PhaseStats(UNATTRIBUTED)
    reasons: dict[str, int] = defaultdict(int)
    assignment: list[tuple[Kernel, PhaseRange | None]] = []
    total_ns = 0
    n = 0
    for k in kernels:
        if k.end_ns < k.start_ns:
            raise ValueError(f"kernel {k.name!r} ends before it starts ({k.start_ns} > {k.end_ns})")
        n += 1
        total_ns += k.duration_ns
        r = owner.get(k.correlation_id)
        if r is None:
            un._add(k)
            reasons["launch outside every phase range" if k.correlation_id in first
                    else "no launch record with its correlation id"] += 1
        else:
            phases[r.name]._add(k)
            by_batch[(r.name, r.batch_size)]._add(k)
        assignment.append((k, r))

    paths = sorted(critical_paths((r, k.start_ns, k.end_ns, k.name) for k, r in assignment if r is not None).values(),
                   key=lambda p: (p.launch.start_ns, p.start_ns))
    for path in paths:
        r = path.launch
        phases[r.name]._add_path(path)
        by_batch[(r.name, r.batch_size)]._add_path(path)

    # Conservation, in integer ns: every kernel is counted exactly once, and the exclusive times
    # of every cell add up to its wall time.
    phase_sum = sum(p.total_ns for p in phases.values())
    assert phase_sum + un.total_ns == total_ns, (phase_sum, un.total_ns, total_ns)
    assert sum(c.total_ns for c in by_batch.values()) == phase_sum
    assert sum(p.kernels for p in phases.values()) + un.kernels == n
    for cell in (*phases.values(), *by_batch.values()):
        assert sum(k.exclusive_ns for k in cell.kernels_by_name.values()) == cell.wall_ns, cell.name
    return Attribution(phases=phases, by_batch=by_batch, unattributed=un, total_ns=total_ns, total_kernels=n,
                       reasons=dict(reasons), assignment=assignment, paths=paths, ranges=ranges, source=source)


# ---- kernel names ----------------------------------------------------------------------------

_MANGLED_ID = re.compile(r"(\d+)")


def _demangle_last_identifier(name: str) -> str | None:
    """The innermost plain identifier of an Itanium-mangled name (`_ZN2at6native8mykernelEv` ->
    `mykernel`), without a full demangler: enough to label a kernel. None if it does not parse."""
    if not name.startswith("_Z"):
        return None
    i = 2
    if name.startswith("N", i):
        i += 1
    last = None
    while i < len(name):
        c = name[i]
        if c in "KVrL":  # cv-qualifiers and the local-name marker
            i += 1
            continue
        if c == "S" and i + 1 < len(name) and name[i + 1] in "ta":  # std::, std::allocator
            i += 2
            continue
        m = _MANGLED_ID.match(name, i)
        if not m:
            break
        n = int(m.group(1))
        start = m.end()
        if n == 0 or start + n > len(name):
            break
        last = name[start:start + n]
        i = start + n
    return last


@functools.lru_cache(maxsize=4096)  # called per kernel; a run has a few dozen distinct names
def short_kernel_name(name: str, max_len: int = 64) -> str:
    """A readable label for a kernel: `void at::native::foo<4, at::native::Bar>(int, ...)` -> `foo`,
    mangled `_Z...` names -> their innermost identifier, plain names (Triton, nvjet, cutlass
    `sm90_xmma_...`) unchanged; truncated to max_len characters."""
    s = name.strip()
    if s.startswith("_Z"):
        s = _demangle_last_identifier(s) or s
    else:
        s = s.replace("(anonymous namespace)", "anon")
        # Drop everything inside <...> and the first top-level (...) (the argument list).
        out, depth = [], 0
        for ch in s:
            if ch == "<":
                depth += 1
            elif ch == ">" and depth:
                depth -= 1
            elif depth == 0:
                if ch == "(":
                    break
                out.append(ch)
        s = "".join(out).strip() or s
        s = s.split()[-1] if s.split() else s  # drop the return type ("void ")
        s = s.rsplit("::", 1)[-1] or s
    return s if len(s) <= max_len else s[: max_len - 1] + "…"
