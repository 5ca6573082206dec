"""The all-reduce of a row-parallel projection at one token a step, inside the GEMV that makes the
partial sums: no launch of its own.

Under tensor parallelism a decode step at batch 1 runs two all-reduces a layer of one hidden row
each (8 KB on llama-8b-shape). As a kernel of its own, an all-reduce costs its launch, two barriers
across the GPUs and, being torch's, a break in the programmatic-dependent-launch chain
(kernels/pdl.py) on both sides: 6-7 us a call between two H200s, next to GEMVs of 5-15 us.

Here the GEMV's programs form groups of GROUP (64 programs, 128 outputs at the M = 1 tiles). The
last program of a group to finish sends the group's outputs to every peer over NVLink, raises one
flag per peer, waits for the peers' flags for the same group, adds the W partials in rank order in
fp32 (rounded once: the same bits on every rank) and stores them to y. Groups proceed independently,
so the exchange of the first groups overlaps the weight reads of the last.

Buffers (graphrt/parallel/group.py makes them, in symmetric memory): on each rank, data
[2, W, numel] (slot, source rank, element) and flags [2, W, cdiv(numel, GROUP)] int32; plus a local
seq [1] int32 that counts the pushes this rank has made, the same count on every rank (they run
the same launches). Push number s (from 1) uses slot s % 2 and raises each peer's
flags[s % 2, rank, group] to s; the last group to finish sets seq to s.

Two slots are enough: a rank writes a slot's data again only at push s + 2, inside a launch that
started after its push s + 1 had seen every peer's flags s + 1, which each peer raised inside a
launch that started after its push s, the last reader of that slot, had finished (under PDL too:
a producer writes only after its wait, and a wait returns only when the launch before has
finished). Flags only grow, so no one resets them. CUDA only (symmetric memory, system-scope
atomics and fences); the CPU and gloo all-reduce as before.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from graphrt.kernels.counters import counters, last_to_finish

__all__ = ["PushTarget", "push_reduce_row", "push_counters", "no_push_args", "GROUP"]

GROUP = tl.constexpr(64)  # programs per group: one flag per group, one group counter


@dataclass
class PushTarget:
    """One rank's view of the push buffers of a tensor-parallel group (see the module docstring)."""

    data: torch.Tensor  # [2, W, numel] this rank's buffer, the model dtype
    flags: torch.Tensor  # [2, W, cdiv(numel, GROUP)] int32, this rank's
    table: torch.Tensor  # [2W] int64: every rank's data address, then every rank's flags address
    seq: torch.Tensor  # [1] int32
    rank: int
    world: int

    @property
    def numel(self) -> int:
        return self.data.shape[-1]

    def fits(self, n: int, dtype: torch.dtype) -> bool:
        """Whether a one-row product of n outputs in dtype can be summed through these buffers."""
        return n <= self.numel and dtype == self.data.dtype

    def kernel_args(self) -> tuple:
        """(table, flags, seq, rank, numel): the runtime arguments of a kernel that pushes."""
        return self.table, self.flags, self.seq, self.rank, self.numel


def no_push_args(x: torch.Tensor) -> tuple:
    """Placeholders for the five push arguments of a kernel that does not push."""
    return x, x, x, 0, 0


def push_counters(device: torch.device, programs: int) -> torch.Tensor:
    """The counter slots (kernels/counters.py) push_reduce_row needs in a launch of `programs`."""
    ctr = counters(device, 1 + triton.cdiv(programs, GROUP.value))
    if ctr is None:
        raise RuntimeError("pushing needs the counter buffer: make it outside graph capture first")
    return ctr


@triton.jit
def _fence_sys():
    # fence.acq_rel.sys: this thread's stores to the peers are performed before what follows
    tl.inline_asm_elementwise("fence.acq_rel.sys; mov.u32 $0, 0;", "=r,r", [tl.program_id(0)], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def push_reduce_row(vals, pid, BLOCK_N: tl.constexpr, n, y_ptr, ctr_ptr, tab_ptr, flags_ptr, seq_ptr, rank, numel,
                    W: tl.constexpr):
    """The epilogue of program pid of a one-row product: vals [BLOCK_N] (y's dtype) are outputs
    pid * BLOCK_N + arange(BLOCK_N) of this rank's partial; y_ptr [n] gets the sum over the W ranks.
    Every program of the launch calls it once, after the wait for its producer (seq is settled
    then). ctr_ptr: 1 + cdiv(programs, GROUP) zeroed counter slots, left zeroed."""
    s = tl.load(seq_ptr) + 1
    slot = s % 2
    groups = tl.cdiv(numel, GROUP)
    part = (slot * W + rank) * numel  # this rank's partial in a slot
    offs = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    mine = tl.load(tab_ptr + rank).to(tl.pointer_type(vals.dtype))
    tl.store(mine + part + offs, vals, mask=offs < n)
    group = pid // GROUP
    programs = tl.num_programs(0)
    if last_to_finish(ctr_ptr + 1 + group, tl.minimum(programs - group * GROUP, GROUP)):
        # The group counter's acquire made the group's stores visible here.
        GE: tl.constexpr = GROUP * BLOCK_N
        g_offs = group * GE + tl.arange(0, GE)
        gmask = g_offs < n
        v = tl.load(mine + part + g_offs, mask=gmask, cache_modifier=".cg")
        for r in tl.static_range(W):
            if r != rank:
                peer = tl.load(tab_ptr + r).to(tl.pointer_type(vals.dtype))
                tl.store(peer + part + g_offs, v, mask=gmask)
        _fence_sys()  # every thread's stores to the peers, before any flag
        tl.debug_barrier()
        flag = (slot * W + rank) * groups + group
        for r in tl.static_range(W):
            if r != rank:
                peer_flags = tl.load(tab_ptr + W + r).to(tl.pointer_type(tl.int32))
                tl.atomic_xchg(peer_flags + flag, s, sem="release", scope="sys")
        for r in tl.static_range(W):
            if r != rank:
                their = flags_ptr + (slot * W + r) * groups + group
                f = tl.atomic_add(their, 0, sem="acquire", scope="sys")
                while f != s:
                    f = tl.atomic_add(their, 0, sem="acquire", scope="sys")
        acc = tl.zeros([GE], tl.float32)
        for r in tl.static_range(W):  # rank order, fp32: every rank the same bits
            acc += tl.load(mine + (slot * W + r) * numel + g_offs, mask=gmask, other=0.0,
                           cache_modifier=".cg").to(tl.float32)
        tl.store(y_ptr + g_offs, acc.to(y_ptr.dtype.element_ty), mask=gmask)
        if last_to_finish(ctr_ptr, tl.cdiv(programs, GROUP)):
            tl.store(seq_ptr, s)  # every program has read seq by now
