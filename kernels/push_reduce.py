"""The all-reduce of a row-parallel projection at one token a step, folded into the two launches
around it: the GEMV that makes each rank's partial pushes it into every rank's buffer, and the
kernel that reads the sum (the next projection's norm prologue, or `PushedSum.materialize`) waits
for the peers' signals and adds the partials itself.

Under tensor parallelism a decode step at batch 1 runs two all-reduces a layer of one hidden row
each (8 KB on llama-8b-shape). A separate all-reduce kernel costs its launch, two cross-GPU barriers
and, being torch's, a break in the programmatic-dependent-launch chain (kernels/pdl.py) on both
sides: about 7 us a call on an H200 pair, against a GEMV of 5-15 us. Here the partial crosses NVLink
as the producer's stores, the only barrier is one flag per peer, and the consumer launches early
and streams its first weight tile while the flags arrive.

Buffers (graphrt/parallel/group.py makes them, in symmetric memory): on each rank, data
[2, W, numel] (slot, source rank, element) and flags [2, W] int32; plus a local seq [1] int32 that
counts the pushes this rank has made, the same count on every rank (they run the same launches).
Push number s (from 1) goes to slot s % 2 and raises each destination's flags[s % 2, rank] to s.

  - producer: every program stores its outputs of push s to data[s % 2, rank] on every rank; the
    last program to finish (a two-level counter) raises the flags (release, system scope) and
    then seq to s.
  - consumer: after its wait for the producer it reads seq = s, spins until every peer's flag in
    slot s % 2 reads s (acquire, system scope), and sums data[s % 2, :] in rank order in fp32,
    rounded once to the model dtype: the same bits on every rank.

Two slots are enough: a rank writes slot s % 2 again only at push s + 2, after its consumer of push
s + 1 saw every peer's flag s + 1, which each peer raised after its own consumer of push s, the
last reader of that slot, had finished (a launch finishes before the next one's wait returns).
Flags only grow, so no one resets them. Every push must be consumed before the next one is made.
CUDA only (symmetric memory and system-scope atomics); under gloo the model all-reduces as before.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from graphrt.kernels.counters import counters, last_to_finish
from graphrt.kernels.pdl import pdl_enabled, pdl_launch, wait_for_producer

__all__ = ["PushTarget", "PushedSum", "settled"]

GROUP = tl.constexpr(64)  # producer programs per first-level counter: 2048 do not queue on one address


@dataclass
class PushTarget:
    """One rank's view of the push buffers of a tensor-parallel group (see the module docstring)."""

    data: torch.Tensor  # [2, W, numel] this rank's buffer, the model dtype
    flags: torch.Tensor  # [2, W] int32, this rank's
    table: torch.Tensor  # [2W] int64: every rank's data address, then every rank's flags address
    seq: torch.Tensor  # [1] int32
    rank: int
    world: int

    @property
    def numel(self) -> int:
        return self.data.shape[-1]

    def fits(self, m: int, n: int, dtype: torch.dtype) -> bool:
        return m * n <= self.numel and dtype == self.data.dtype

    def kernel_args(self) -> tuple:
        """(table, flags, seq, rank, numel): the five runtime arguments of a kernel that pushes or
        pulls (the unused ones of a kernel that does neither may be any tensor and 0)."""
        return self.table, self.flags, self.seq, self.rank, self.numel


def no_push_args(x: torch.Tensor) -> tuple:
    return x, x, x, 0, 0


class PushedSum:
    """The [M, N] sum over the ranks of a product every rank has pushed (PushTarget), not read yet.
    Hand it to a PendingNorm (kernels/norm.py), whose fused consumer reads it in its prologue, or
    call materialize(). `like` is an [M, N] tensor for shape, dtype and device checks and the base
    address kernels offset from; its values are not the sum."""

    def __init__(self, target: PushTarget, m: int, n: int):
        self.target = target
        self.like = target.data.view(-1)[: m * n].view(m, n)
        self._value = None

    @property
    def shape(self):
        return self.like.shape

    def materialize(self) -> torch.Tensor:
        """The sum as a new [M, N] tensor: one launch that waits for the peers and adds."""
        if self._value is None:
            self._value = pushed_sum_triton(self)
        return self._value


def settled(x):
    """x, or the sum a PushedSum stands for."""
    return x.materialize() if isinstance(x, PushedSum) else x


# ---------------------------------------------------------------------------------------------
# Triton pieces, for the producer's epilogue and the consumer's prologue
# ---------------------------------------------------------------------------------------------


@triton.jit
def push_store(vals, offs, mask, tab_ptr, seq_ptr, rank, numel, W: tl.constexpr, DIRECT: tl.constexpr):
    """Producer: store vals (the model dtype) at offs of this rank's part of the next push's slot,
    in this rank's buffer (DIRECT: on every rank). Call after the wait for the producer's own
    producer (seq is settled then)."""
    s = tl.load(seq_ptr) + 1
    dst = ((s % 2) * W + rank) * numel + offs
    if DIRECT:
        for r in tl.static_range(W):
            base = tl.load(tab_ptr + r).to(tl.pointer_type(vals.dtype))
            tl.store(base + dst, vals, mask=mask)
    else:
        base = tl.load(tab_ptr + rank).to(tl.pointer_type(vals.dtype))
        tl.store(base + dst, vals, mask=mask)


@triton.jit
def _fence_sys():
    # fence.acq_rel.sys: this thread's stores to the peers are performed before what follows
    tl.inline_asm_elementwise("fence.acq_rel.sys; mov.u32 $0, 0;", "=r,r", [tl.program_id(0)], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def push_done(ctr_ptr, programs, tab_ptr, seq_ptr, rank, numel, n, W: tl.constexpr, DIRECT: tl.constexpr,
              dtype: tl.constexpr):
    """Producer: every program calls it once after its push_store; the last of `programs` to get
    here copies this rank's n pushed elements to the peers (unless DIRECT), raises this rank's
    flag of the push on every rank, then seq. ctr_ptr: 1 + cdiv(programs, GROUP) counter slots
    (kernels/counters.py). The counters' acquire / release at GPU scope carries every program's
    stores to the last one, whose system-scope fence and release carry them on."""
    pid = tl.program_id(0)
    group = pid // GROUP
    in_group = tl.minimum(programs - group * GROUP, GROUP)
    if last_to_finish(ctr_ptr + 1 + group, in_group):
        if last_to_finish(ctr_ptr, tl.cdiv(programs, GROUP)):
            s = tl.load(seq_ptr) + 1
            slot_off = ((s % 2) * W + rank) * numel
            if not DIRECT:
                src = tl.load(tab_ptr + rank).to(tl.pointer_type(dtype)) + slot_off
                for start in range(0, n, 1024):
                    offs = start + tl.arange(0, 1024)
                    v = tl.load(src + offs, mask=offs < n, cache_modifier=".cg")
                    for r in tl.static_range(W):
                        if r != rank:
                            dst = tl.load(tab_ptr + r).to(tl.pointer_type(dtype)) + slot_off
                            tl.store(dst + offs, v, mask=offs < n)
            _fence_sys()
            tl.debug_barrier()
            for r in tl.static_range(W):
                flags = tl.load(tab_ptr + W + r).to(tl.pointer_type(tl.int32))
                tl.atomic_xchg(flags + (s % 2) * W + rank, s, sem="release", scope="sys")
            tl.store(seq_ptr, s)


@triton.jit
def pull_wait(flags_ptr, seq_ptr, rank, W: tl.constexpr):
    """Consumer: wait until every peer has pushed the sum this launch reads; returns its slot.
    Call after the wait for the producer (which wrote seq)."""
    s = tl.load(seq_ptr, volatile=True)
    slot = s % 2
    for r in tl.static_range(W):
        if r != rank:
            f = tl.atomic_add(flags_ptr + slot * W + r, 0, sem="acquire", scope="sys")
            while f != s:
                f = tl.atomic_add(flags_ptr + slot * W + r, 0, sem="acquire", scope="sys")
    return slot


@triton.jit
def pulled(x_ptr, offs, mask, W: tl.constexpr, numel):
    """Consumer: elements offs of the sum whose slot starts at x_ptr, in x's dtype: the W partials
    added in rank order in fp32, rounded once. .cg: other GPUs wrote them."""
    acc = tl.load(x_ptr + offs, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
    for r in tl.static_range(1, W):
        acc += tl.load(x_ptr + r * numel + offs, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
    return acc.to(x_ptr.dtype.element_ty)


@triton.jit
def _pushed_sum_kernel(
    data_ptr,  # [2, W, numel] this rank's push buffer
    y_ptr,  # [total] out, contiguous
    flags_ptr, seq_ptr, rank, numel, total,
    W: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    if USE_PDL:
        wait_for_producer()
    slot = pull_wait(flags_ptr, seq_ptr, rank, W)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < total
    tl.store(y_ptr + offs, pulled(data_ptr + slot * W * numel, offs, mask, W, numel), mask=mask)


def pushed_sum_triton(p: PushedSum) -> torch.Tensor:
    """The [M, N] sum p stands for, as a new tensor."""
    t = p.target
    y = torch.empty_like(p.like)
    total = y.numel()
    block = min(1024, triton.next_power_of_2(total))
    pdl = pdl_enabled(y.device)
    _pushed_sum_kernel[(triton.cdiv(total, block),)](
        t.data, y, t.flags, t.seq, t.rank, t.numel, total, W=t.world, BLOCK=block, USE_PDL=pdl,
        num_warps=4, **pdl_launch(pdl))
    return y


def push_counters(device: torch.device, programs: int) -> torch.Tensor:
    """The counter slots push_done needs for a launch of `programs` programs."""
    ctr = counters(device, 1 + triton.cdiv(programs, GROUP.value))
    if ctr is None:
        raise RuntimeError("pushing needs the counter buffer: make it outside graph capture first")
    return ctr
