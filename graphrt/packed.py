"""Several small tensors as views of one buffer, so the host moves them in one copy.

A decode cycle's inputs (batch rows' slots, draft counts) and results (tokens, counts, logprobs)
are a few hundred bytes each. Every separate host<->device copy on the stream costs microseconds of
DMA latency between graph launches (on the order of the whole gap between a batch-1 cycle's graph
time and its wall time): packing them makes that one copy in each direction.
"""

from __future__ import annotations

import torch

_ALIGN = 16  # bytes: every view starts aligned for any dtype and for vector loads


def packed(specs: list[tuple[tuple[int, ...], torch.dtype]], device, *, pin_memory: bool = False):
    """specs: [(shape, dtype)]. Returns (buffer, views): a uint8 buffer and one contiguous view of
    it per spec, laid out one after another. Two calls with the same specs give the same layout, so
    a whole buffer copies into its twin with every view landing on its counterpart."""
    nbytes = [torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size() for shape, dtype in specs]
    offsets = [0]
    for n in nbytes:
        offsets.append(offsets[-1] + -(-n // _ALIGN) * _ALIGN)
    buf = torch.zeros(offsets[-1], dtype=torch.uint8, device=device, pin_memory=pin_memory)
    return buf, [buf[off : off + n].view(dtype).view(shape) for (shape, dtype), off, n in zip(specs, offsets, nbytes)]
