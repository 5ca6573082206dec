"""One buffer of int32 zeros per device for the kernels that merge in the same launch: the last
program of a group to finish (an atomic counter per group) does the merge and resets the counter.

Used by argmax (per row) and gemv's split-K (per output tile). Every such launch leaves each
counter it used at zero again, so one buffer serves every call and every graph replay of both.
Launches that run concurrently on different streams must not share it: graphrt runs a forward on
one stream, and a programmatic dependent (kernels/pdl.py) touches counters only after waiting for
the kernel before it.
"""

from __future__ import annotations

import torch

COUNTER_SLOTS = 1 << 16
_bufs: dict[torch.device, torch.Tensor] = {}


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
