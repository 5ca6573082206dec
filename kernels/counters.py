"""One buffer of int32 zeros per device for the kernels that merge in the same launch: the last
program of a group to finish (an atomic counter per group) does the merge and resets the counter.
And the rule every such per-device workspace follows (shared_workspace): made outside captures,
grown by doubling, the old one kept alive for the graphs that point at it.

Used by argmax (per row), gemv's split-K (per output tile) and the filters' whole-row search (per
row). Every such launch leaves each
counter it used at zero again, so one buffer serves every call and every graph replay of both.
Launches that run concurrently on different streams must not share it: graphrt runs a forward on
one stream, and a programmatic dependent (kernels/pdl.py) touches counters only after waiting for
the kernel before it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

COUNTER_SLOTS = 1 << 16
_bufs: dict[torch.device, torch.Tensor] = {}
_retired: list[tuple[torch.Tensor, ...]] = []


def capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def counters(dev: torch.device, n: int) -> torch.Tensor | None:
    """The device's [COUNTER_SLOTS] int32 zeros, or None when n exceeds it or when called inside a
    CUDA graph capture before the buffer exists (allocating there would tie it to the graph's
    pool): the caller then takes its two-launch path."""
    if n > COUNTER_SLOTS:
        return None
    buf = _bufs.get(dev)
    if buf is None:
        if capturing():
            return None
        buf = torch.zeros(COUNTER_SLOTS, dtype=torch.int32, device=dev)
        _bufs[dev] = buf
    return buf


def shared_workspace(table: dict, key, rows: int, make) -> tuple[torch.Tensor, ...] | None:
    """table[key]: tensors whose first has rows' >= rows rows, shared by every call and graph replay;
    made by make(rows') when missing or too small, rows' = max(rows, twice the old, 1024) (the old
    one kept alive: graphs captured before may still point at it). None inside a capture when it
    would have to be made (allocating there would tie it to that graph's pool)."""
    ws = table.get(key)
    if ws is None or ws[0].shape[0] < rows:
        if capturing():
            return None
        if ws is not None:
            _retired.append(ws)
        ws = table[key] = make(max(rows, 2 * ws[0].shape[0] if ws is not None else 1024))
    return ws


@triton.jit
def last_to_finish(ctr_ptr, n):
    """In a group of n programs counting at ctr_ptr (a slot of counters()), whether this one is the
    last to finish. The counter's release / acquire makes every program's writes before the call
    visible to the last one, which also resets the slot for the next launch or graph replay."""
    tl.debug_barrier()
    last = tl.atomic_add(ctr_ptr, 1, sem="acq_rel", scope="gpu") == n - 1
    if last:
        tl.atomic_xchg(ctr_ptr, 0, sem="relaxed", scope="gpu")
    return last
