"""Always-on, cheap per-phase GPU timing: a CUDA event pair around each phase launch.

Event pairs come from a preallocated free list and go back to it once the GPU has passed them.
`collect()` folds in only phases whose end event has completed (a non-blocking query), so it can
run while the next cycle is in flight without synchronising. On the CPU the phases run
synchronously and a wall clock is exact.
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager

import torch


class PhaseTimer:
    def __init__(self, device, prealloc: int = 64):
        self.cuda = torch.device(device).type == "cuda"
        self._free = [self._pair() for _ in range(prealloc)] if self.cuda else []
        self._pending: list[tuple[str, int | None, object, object]] = []
        # per (phase, batch size): what a profile's rows are keyed by; summary() sums over B
        self.total_ms: dict[tuple[str, int | None], float] = defaultdict(float)
        self.count: dict[tuple[str, int | None], int] = defaultdict(int)

    @staticmethod
    def _pair():
        return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    @contextmanager
    def phase(self, name: str, batch_size: int | None = None):
        if self.cuda:
            start, end = self._free.pop() if self._free else self._pair()
            start.record()
            yield
            end.record()
            self._pending.append((name, batch_size, start, end))
        else:
            t0 = time.perf_counter()
            yield
            self._pending.append((name, batch_size, t0, time.perf_counter()))

    def collect(self, wait: bool = False) -> None:
        """Fold completed phases into the totals; with wait=True, wait for all pending ones."""
        still = []
        for name, b, start, end in self._pending:
            if self.cuda:
                if not wait and not end.query():
                    still.append((name, b, start, end))
                    continue
                end.synchronize()
                ms = start.elapsed_time(end)
                self._free.append((start, end))
            else:
                ms = (end - start) * 1e3
            self.total_ms[(name, b)] += ms
            self.count[(name, b)] += 1
        self._pending = still

    def summary(self) -> dict[str, dict[str, float]]:
        self.collect(wait=True)
        total: dict[str, float] = defaultdict(float)
        calls: dict[str, int] = defaultdict(int)
        for key, ms in self.total_ms.items():
            total[key[0]] += ms
            calls[key[0]] += self.count[key]
        return {k: {"total_ms": v, "calls": calls[k], "mean_us": 1e3 * v / calls[k]} for k, v in total.items()}

    def mean_us_by_batch(self) -> dict[tuple[str, int | None], float]:
        """Mean time per launch in microseconds, per (phase, batch size)."""
        self.collect(wait=True)
        return {k: 1e3 * v / self.count[k] for k, v in self.total_ms.items()}

    def largest_batch_us(self) -> dict[str, float]:
        """{phase: mean us per launch at the largest batch size it ran}: a batch's own cost. Its later
        cycles may run smaller buckets once some of its requests have finished (under speculation
        they finish cycles apart), and summary()'s mean over all launches mixes those in."""
        best: dict[str, tuple[int, float]] = {}
        for (name, b), us in self.mean_us_by_batch().items():
            if name not in best or (b or 0) > best[name][0]:
                best[name] = (b or 0, us)
        return {name: us for name, (_, us) in best.items()}
