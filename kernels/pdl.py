"""Programmatic dependent launch (PDL, Hopper and later) for the Triton kernels of the decode path.

A kernel launched with the programmatic-serialization attribute may be scheduled while the kernel
before it on the stream is still running; it must execute griddepcontrol.wait before it touches
anything that kernel reads or writes. Between the microsecond kernels of a batch-1 decode step this
hides the launch and ramp-up latency between the nodes of a CUDA graph (stream capture keeps the
attribute as a programmatic edge). Each kernel that supports it takes a USE_PDL constexpr
(`wait_for_producer()` before that first access) and its launcher passes `**pdl_launch(pdl)`.

Settled memory. With dependents released before the wait, a kernel that starts guarantees only
that its predecessors on the stream have *started*, back to the nearest node whose incoming edge
is not programmatic (a torch kernel, say): that one started only after everything before it had
finished and its writes were visible. Memory written before that fence is settled and may be read
before the wait. The attention kernels read seq_lens and block_tables before it: the cycle
computes both (kernels/cycle_index.py, launched without the attribute) before the forward's first
kernel, the embedding gather, a torch kernel and so the fence.
tests/test_capture.py checks that in every captured graph (capture/inspect.launch_chain).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

_INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")


@triton.jit
def wait_for_producer():
    """launch_dependents, then griddepcontrol.wait (all of the previous kernel's writes visible).
    Releasing first lets the next kernel be scheduled, and prefetch its weights, while this one still
    waits (plain decode measured faster than releasing after the wait). Safe: before its own wait a
    dependent reads only settled memory and otherwise only forms L2 prefetch addresses, and each
    wait is for a completed producer. Nothing under the interpreter, which runs one grid at a time
    (so the CPU tests still run the code around it)."""
    if not _INTERPRETED:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()


@triton.jit
def prefetch_l2(ptrs, mask):
    """Bring the cache lines at ptrs (where mask) into L2, for a dependent that is about to wait
    for its producer: the DRAM latency then passes while the producer finishes. Safe on any
    address, even one the producer is still writing: a prefetch changes no value anyone can read
    (L2 is the GPU's point of coherence; nothing lands in registers or L1). Nothing under the
    interpreter."""
    if not _INTERPRETED:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
            "=r,l,r", [ptrs.to(tl.int64, bitcast=True), mask.to(tl.int32)], dtype=tl.int32,
            is_pure=False, pack=1)


def pdl_launch(pdl: bool) -> dict:
    """Launch keyword arguments for a Triton kernel call: {'launch_pdl': True} or nothing."""
    return {"launch_pdl": True} if pdl else {}


def pdl_enabled(device: torch.device) -> bool:
    """Whether the decode-path kernels launch as programmatic dependents on `device`: a CUDA device
    of compute capability 9.0+, outside the interpreter, unless GRAPHRT_PDL=0 (read per call, so a
    benchmark can compare both). A Triton kernel after a cuBLAS one gains nothing (cuBLAS
    apparently does not release its dependents early)."""
    if os.environ.get("GRAPHRT_PDL", "1") == "0" or device.type != "cuda":
        return False
    return _supported(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _supported(device_index: int) -> bool:
    """Compute capability 9.0+ (griddepcontrol), never under the Triton interpreter."""
    if os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device_index)[0] >= 9


@triton.jit
def wait_for_producer_release_later():
    """griddepcontrol.wait without releasing the dependents first: for a kernel that calls
    release_dependents() itself once its hot loop is done, so a dependent launched early does not
    hold SM slots that this kernel's own programs still need (the sampler's row pass and race
    pass, where its launch config asks for it). A kernel that never calls release_dependents
    releases them when it exits. Nothing under the interpreter."""
    if not _INTERPRETED:
        tl.extra.cuda.gdc_wait()


@triton.jit
def release_dependents():
    """griddepcontrol.launch_dependents: the next kernel may be scheduled now (see
    wait_for_producer_release_later). Nothing under the interpreter."""
    if not _INTERPRETED:
        tl.extra.cuda.gdc_launch_dependents()
