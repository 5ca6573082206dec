"""Wall time of a phase launch and each kernel's share of it, when kernels overlap.

Under programmatic dependent launch (PDL) a kernel is scheduled while its producer still runs and
waits inside its own duration, so kernel durations add up to more than the launch took. This
splits a launch's wall
time, first kernel start to last kernel end, among its kernels so that the parts add up exactly:

    kernels in start order; covered = the latest end among the kernels before this one
    wait      = the part of its duration before `covered`: overlapped by earlier kernels (under
                PDL, waiting for its producer; on several streams, running beside them)
    gap       = idle GPU time between `covered` and its start (launch latency between nodes)
    exclusive = gap + the part of its duration after `covered`: how much later the launch ends
                because of this kernel (its critical-path share)

    per kernel:  duration + gap == wait + exclusive
    per launch:  sum of exclusive == wall                      (integer ns, exactly)

The overlapped part of a kernel is always a prefix of it: every earlier kernel started no later,
so their union past this kernel's start is one interval ending at `covered`.

One pure function over (launch, start, end, name) records, so the Nsight SQLite path and the
PyTorch-profiler path (through attribution.attribute) compute the same figures the same way.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class KernelShare:
    name: str
    start_ns: int
    end_ns: int
    exclusive_ns: int
    wait_ns: int
    gap_ns: int

    @property
    def duration_ns(self) -> int:
        return self.end_ns - self.start_ns


@dataclass(frozen=True)
class LaunchPath:
    """One phase launch (a graph replay or an eager phase call): its kernels in start order."""

    launch: Hashable
    start_ns: int  # first kernel start
    end_ns: int  # last kernel end
    kernels: tuple[KernelShare, ...]

    @property
    def wall_ns(self) -> int:
        return self.end_ns - self.start_ns


def split_launch(launch: Hashable, kernels: Iterable[tuple[int, int, str]]) -> LaunchPath:
    """kernels: (start_ns, end_ns, name) of one launch, in any order (at least one)."""
    ordered = sorted(kernels, key=lambda k: (k[0], k[1]))
    if not ordered:
        raise ValueError(f"launch {launch!r} has no kernels")
    covered = ordered[0][0]
    shares = []
    for start, end, name in ordered:
        if end < start:
            raise ValueError(f"kernel {name!r} ends before it starts ({start} > {end})")
        gap = max(0, start - covered)
        wait = max(0, min(end, covered) - start)
        exclusive = max(0, end - covered)
        shares.append(KernelShare(name, start, end, exclusive, wait, gap))
        covered = max(covered, end)
    path = LaunchPath(launch, ordered[0][0], covered, tuple(shares))
    assert sum(s.exclusive_ns for s in shares) == path.wall_ns, launch
    return path


def critical_paths(records: Iterable[tuple[Hashable, int, int, str]]) -> dict[Hashable, LaunchPath]:
    """records: (launch, start_ns, end_ns, name), one per kernel; launch is any hashable key (a
    PhaseRange in graphrt). Returns each launch's path, in first-seen order of the launches."""
    by_launch: dict[Hashable, list[tuple[int, int, str]]] = {}
    for launch, start, end, name in records:
        by_launch.setdefault(launch, []).append((start, end, name))
    return {launch: split_launch(launch, ks) for launch, ks in by_launch.items()}
