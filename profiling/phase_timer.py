"""Always-on, cheap per-phase GPU timing: a CUDA event pair around each phase launch.

Events come from a preallocated ring and are read only after the cycle's own completion event has
been waited on, so timing adds no synchronisation. On the CPU the phases run synchronously and a
wall clock is exact.
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager

import torch


class PhaseTimer:
    def __init__(self, device, ring: int = 64):
        self.cuda = torch.device(device).type == "cuda"
        if self.cuda:
            self._ring = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                          for _ in range(ring)]
        self._next = 0
        self._pending: list[tuple[str, object, object]] = []
        self.total_ms: dict[str, float] = defaultdict(float)
        self.count: dict[str, int] = defaultdict(int)

    @contextmanager
    def phase(self, name: str):
        if self.cuda:
            if self._next == len(self._ring):  # ring full: results must be collected first
                self.collect()
            start, end = self._ring[self._next]
            self._next += 1
            start.record()
            yield
            end.record()
            self._pending.append((name, start, end))
        else:
            t0 = time.perf_counter()
            yield
            self._pending.append((name, t0, time.perf_counter()))

    def collect(self) -> None:
        """Fold finished phases into the totals. Call after the cycle's completion event was waited
        on (then no event query blocks); collecting earlier synchronises on the pending events."""
        for name, start, end in self._pending:
            if self.cuda:
                end.synchronize()  # already complete when called after the cycle's own event
            ms = start.elapsed_time(end) if self.cuda else (end - start) * 1e3
            self.total_ms[name] += ms
            self.count[name] += 1
        self._pending.clear()
        self._next = 0

    def reset(self) -> None:
        self.collect()
        self.total_ms.clear()
        self.count.clear()

    def summary(self) -> dict[str, dict[str, float]]:
        self.collect()
        return {k: {"total_ms": v, "calls": self.count[k], "mean_us": 1e3 * v / self.count[k]}
                for k, v in self.total_ms.items()}
