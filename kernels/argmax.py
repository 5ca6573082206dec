"""Row argmax over the vocabulary: the draft's top-1 (DRAFT_EXTEND / DRAFT_DECODE), no softmax.

Semantics (the reference defines them, the Triton kernel reproduces them exactly):
  - NaN never wins (it counts as -inf); +inf wins;
  - ties go to the lowest index;
  - a row with nothing above -inf returns index 0 and value -inf. The index is always in [0, V):
    an argmax that returns a padding index is a known serving hazard (vLLM GHSA-8wr5-jm2h-8r4f).

Triton: split-vocab reduction. At B = 1 a 128256-entry bf16 row is 256 KB; one program per row
would read it at the speed of one SM, so each row is spread over `splits` programs (grid (B,
splits)) that each reduce a chunk to (max, lowest index); the last program of a row to finish (a
per-row counter) merges the chunks in the same launch, or a second kernel (grid B) does when the
counter buffer is unavailable.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from graphrt.kernels.counters import capturing, counters, last_to_finish
from graphrt.kernels.pdl import pdl_enabled, pdl_launch, wait_for_producer

_SUPPORTED = (torch.bfloat16, torch.float16, torch.float32)
_INT32_MAX = tl.constexpr(2**31 - 1)


# ---------------------------------------------------------------------------------------------
# PyTorch reference
# ---------------------------------------------------------------------------------------------


def lowest_argmax(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(max, lowest index of the max) along the last dim, NaN counted as -inf.

    torch.argmax's tie-breaking is not documented as lowest-index on every backend, so the lowest
    index among the maxima is computed explicitly. Returns (values [...] in x's dtype, int64 [...]).
    """
    x = torch.where(torch.isnan(x), torch.full_like(x, float("-inf")), x)
    m = x.amax(dim=-1, keepdim=True)
    v = x.shape[-1]
    idx = torch.arange(v, device=x.device, dtype=torch.int64).expand_as(x)
    # All -inf: every entry equals the max, so the lowest index (0) wins.
    first = torch.where(x == m, idx, torch.full_like(idx, v)).amin(dim=-1)
    return m.squeeze(-1), first


def argmax_reference(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] bf16/fp16/fp32 -> (values [B] same dtype, indices [B] int64)."""
    _validate(logits)
    return lowest_argmax(logits)


# ---------------------------------------------------------------------------------------------
# Triton
# ---------------------------------------------------------------------------------------------


@triton.jit
def _argmax_combine(row, part_val_ptr, part_idx_ptr, out_val_ptr, out_idx_ptr, SPLITS,
                    SPLITS_POW2: tl.constexpr, map_ptr, slots_ptr, dest_ptr, dest_stride, column,
                    PROPOSE: tl.constexpr, HAS_MAP: tl.constexpr):
    s = tl.arange(0, SPLITS_POW2)
    base = row.to(tl.int64) * SPLITS
    vals = tl.load(part_val_ptr + base + s, mask=s < SPLITS, other=float("-inf"), cache_modifier=".cg")
    idxs = tl.load(part_idx_ptr + base + s, mask=s < SPLITS, other=_INT32_MAX, cache_modifier=".cg")
    m = tl.max(vals, axis=0)
    # Chunks are in index order and each reports its lowest max, so the min index among equal
    # maxima is the global lowest; all -inf gives chunk 0's start, index 0.
    i = tl.min(tl.where(vals == m, idxs, _INT32_MAX), axis=0).to(tl.int64)
    # m is the winner widened to fp32, so narrowing it back is exact (-inf for a row of NaN/-inf):
    # no dependent load of the logits at the end of the chain.
    tl.store(out_val_ptr + row, m.to(out_val_ptr.dtype.element_ty))
    if PROPOSE:  # a draft step's token: mapped into the target vocabulary, stored to its slot's column too
        if HAS_MAP:
            i = tl.load(map_ptr + i)
        slot = tl.load(slots_ptr + row)
        tl.store(dest_ptr + slot * dest_stride + column, i)
    tl.store(out_idx_ptr + row, i.to(out_idx_ptr.dtype.element_ty))


@triton.jit
def _argmax_step(x, t, best_val, best_t):
    take = x > best_val  # NaN compares false: it never wins
    return tl.maximum(best_val, x), tl.where(take, t, best_t)


# A draft step's column (0 .. K-1) is not specialised: one compiled variant serves every step.
@triton.jit(do_not_specialize=["dest_stride", "column"])
def _argmax_split_kernel(
    logits_ptr,  # [B, V] bf16/fp16/fp32, last dim contiguous
    part_val_ptr,  # [B, SPLITS] fp32: max of each chunk
    part_idx_ptr,  # [B, SPLITS] int32: lowest index of that max within the chunk
    out_val_ptr,  # [B] (FUSED only)
    out_idx_ptr,  # [B] int64 (FUSED only)
    ctr_ptr,  # [>= B] int32 zeros (FUSED only): chunks of the row done
    stride_row, V, SPLITS, TILES_PER_SPLIT,
    map_ptr, slots_ptr, dest_ptr, dest_stride, column,  # the proposal (PROPOSE only), see argmax_triton
    BLOCK_V: tl.constexpr,  # vocab entries loaded per tile
    FUSED: tl.constexpr = False,  # the last chunk of a row to finish merges the row
    SPLITS_POW2: tl.constexpr = 1,
    USE_PDL: tl.constexpr = False,  # launched as a programmatic dependent: wait for the producer
    PROPOSE: tl.constexpr = False,
    HAS_MAP: tl.constexpr = False,
):
    if USE_PDL:  # a programmatic dependent: nothing before this line touches memory
        wait_for_producer()
    row = tl.program_id(0)
    split = tl.program_id(1)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    tile0 = split * TILES_PER_SPLIT
    chunk_start = tile0 * BLOCK_V
    n_tiles = tl.minimum(TILES_PER_SPLIT, tl.cdiv(V, BLOCK_V) - tile0)
    n_full = tl.maximum(tl.minimum(n_tiles, V // BLOCK_V - tile0), 0)
    offs0 = tl.arange(0, BLOCK_V)
    # Per-lane running (max, first tile): each lane sees increasing indices, so a strict `>`
    # keeps the lowest one, and the expensive cross-lane reduction happens once, at the end.
    best_val = tl.full([BLOCK_V], float("-inf"), tl.float32)
    best_t = tl.full([BLOCK_V], _INT32_MAX, tl.int32)
    # Whole tiles without a mask, two loads in flight; then the odd and the partial tile.
    for t in range(0, n_full - 1, 2):
        p = row_ptr + chunk_start + t * BLOCK_V + offs0
        xa = tl.load(p).to(tl.float32)
        xb = tl.load(p + BLOCK_V).to(tl.float32)
        best_val, best_t = _argmax_step(xa, t, best_val, best_t)
        best_val, best_t = _argmax_step(xb, t + 1, best_val, best_t)
    for t in range(n_full - (n_full % 2), n_tiles):
        offs = chunk_start + t * BLOCK_V + offs0
        x = tl.load(row_ptr + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        best_val, best_t = _argmax_step(x, t, best_val, best_t)
    m = tl.max(best_val, axis=0)
    lane_idx = tl.where(best_t == _INT32_MAX, _INT32_MAX, chunk_start + best_t * BLOCK_V + offs0)
    i = tl.min(tl.where(best_val == m, lane_idx, _INT32_MAX), axis=0)
    # Nothing above -inf in this chunk: its lowest index stands for it.
    i = tl.where(i == _INT32_MAX, chunk_start, i)
    out = row.to(tl.int64) * SPLITS + split
    tl.store(part_val_ptr + out, m)
    tl.store(part_idx_ptr + out, i)
    if FUSED:
        if last_to_finish(ctr_ptr + row, SPLITS):
            _argmax_combine(row, part_val_ptr, part_idx_ptr, out_val_ptr, out_idx_ptr, SPLITS, SPLITS_POW2,
                            map_ptr, slots_ptr, dest_ptr, dest_stride, column, PROPOSE, HAS_MAP)


@triton.jit(do_not_specialize=["dest_stride", "column"])
def _argmax_combine_kernel(
    part_val_ptr,  # [B, SPLITS] fp32
    part_idx_ptr,  # [B, SPLITS] int32
    out_val_ptr,  # [B] input dtype
    out_idx_ptr,  # [B] int64
    SPLITS,
    map_ptr, slots_ptr, dest_ptr, dest_stride, column,  # the proposal (PROPOSE only)
    SPLITS_POW2: tl.constexpr,  # all chunks of a row in one tile
    USE_PDL: tl.constexpr = False,
    PROPOSE: tl.constexpr = False,
    HAS_MAP: tl.constexpr = False,
):
    if USE_PDL:
        wait_for_producer()
    _argmax_combine(tl.program_id(0), part_val_ptr, part_idx_ptr, out_val_ptr, out_idx_ptr, SPLITS, SPLITS_POW2,
                    map_ptr, slots_ptr, dest_ptr, dest_stride, column, PROPOSE, HAS_MAP)


# The GEMV epilogue's argmax (kernels/draft_head.py): each program folds its outputs into one int64
# and maxes it, without waiting, into one of FOLD_SLOTS keys of the row (a cache line apart, so that
# thousands of programs do not queue on one address); a one-program kernel then merges the slots.
# Key: high word, the value's fp32 bits made signed-monotone; low word, 0xFFFFFFFF - index, so equal
# values keep the lowest index. NaN enters as -inf, -0.0 as +0.0; every real key is above
# _KEY_EMPTY, a slot's resting value.
FOLD_SLOTS = tl.constexpr(32)
_SLOT_STRIDE = tl.constexpr(16)  # int64s: 128 bytes
_KEY_EMPTY = tl.constexpr(-(2**63))
_LOW_WORD = tl.constexpr(0xFFFFFFFF)
_keys: dict[torch.device, torch.Tensor] = {}


def argmax_keys(dev: torch.device) -> torch.Tensor | None:
    """The device's FOLD_SLOTS slots of one row ([FOLD_SLOTS * 16] int64, at rest: -2**63), left at
    rest by fold_finish, or None inside a capture before they exist."""
    buf = _keys.get(dev)
    if buf is None and not capturing():
        size = FOLD_SLOTS.value * _SLOT_STRIDE.value
        buf = _keys[dev] = torch.full((size,), _KEY_EMPTY.value, dtype=torch.int64, device=dev)
    return buf


@triton.jit
def fold_argmax(vals, offs, V, key_ptr, program):
    """vals [BLOCK] fp32 (already rounded to the logits' dtype) at vocab indices offs (masked past V)
    of one row; key_ptr: the row's FOLD_SLOTS slots (at rest, _KEY_EMPTY); program: this program's
    number, which picks its slot."""
    vals = tl.where(vals != vals, float("-inf"), tl.where(vals == 0.0, 0.0, vals))
    bits = vals.to(tl.int32, bitcast=True)
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64)
    keys = (ordered << 32) | (offs.to(tl.int64) ^ _LOW_WORD)
    best = tl.max(tl.where(offs < V, keys, _KEY_EMPTY), axis=0)
    tl.atomic_max(key_ptr + (program % FOLD_SLOTS) * _SLOT_STRIDE, best, sem="relaxed", scope="gpu")


@triton.jit(do_not_specialize=["dest_stride", "column"])
def _fold_finish_kernel(
    key_ptr,  # [FOLD_SLOTS * 16] int64: one row's slots, left at rest
    out_idx_ptr,  # [1] int64
    map_ptr, slots_ptr, dest_ptr, dest_stride, column,  # the proposal, as _argmax_combine's
    HAS_MAP: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    if USE_PDL:
        wait_for_producer()
    s = tl.arange(0, FOLD_SLOTS) * _SLOT_STRIDE
    won = tl.max(tl.atomic_xchg(key_ptr + s, tl.full([FOLD_SLOTS], _KEY_EMPTY, tl.int64), sem="relaxed",
                                scope="gpu"), axis=0)
    i = (won & _LOW_WORD) ^ _LOW_WORD  # no key at all (V = 0) cannot happen: index 0 then too
    if HAS_MAP:
        i = tl.load(map_ptr + i)
    tl.store(dest_ptr + tl.load(slots_ptr) * dest_stride + column, i)
    tl.store(out_idx_ptr, i)


def fold_finish(keys: torch.Tensor, out: torch.Tensor, propose: Proposal, pdl: bool) -> None:
    """The token of the row whose slots fold_argmax filled: out [1] int64 and propose.dest, mapped."""
    token_map, dest, slots, column = propose
    _fold_finish_kernel[(1,)](keys, out, token_map if token_map is not None else dest, slots, dest, dest.stride(0),
                              column, HAS_MAP=token_map is not None, USE_PDL=pdl, num_warps=1, **pdl_launch(pdl))


def _launch_config(batch: int) -> tuple[int, int, int, bool]:
    """(block_v, chunks per row, num_warps, fused) by batch size, V = 128256 bf16, with PDL. From
    sweeps over block_v x chunks x warps x fused (the same-call re-timing in
    docs/notes/benchmarks-history.md), kept where the H100 and the H200 agree. Small batches want many
    programs per row; up to B = 64 the two-launch merge (a PDL dependent) beats the in-launch one;
    B >= 128 keeps ~1024 programs and merges in launch."""
    if batch <= 4:
        return 1024, 128, 4, False
    if batch <= 16:
        return 1024, 32, 8, False
    if batch <= 64:
        return 1024, 16, 8, False
    return 2048, triton.cdiv(1024, batch), 4, True


def _validate(logits: torch.Tensor) -> None:
    if not isinstance(logits, torch.Tensor):
        raise ValueError(f"logits must be a torch.Tensor, got {type(logits).__name__}")
    if logits.dim() != 2:
        raise ValueError(f"logits must be [B, V], got shape {tuple(logits.shape)}")
    if logits.shape[0] < 1 or logits.shape[1] < 1:
        raise ValueError(f"logits must have B >= 1 and V >= 1, got shape {tuple(logits.shape)}")
    if logits.dtype not in _SUPPORTED:
        raise ValueError(f"logits dtype must be bf16/fp16/fp32, got {logits.dtype}")
    if logits.stride(1) != 1:
        raise ValueError(f"logits must be contiguous in the vocab dim, got strides {logits.stride()}")


def argmax_triton(
    logits: torch.Tensor, *, out: tuple[torch.Tensor, torch.Tensor] | None = None, block_v: int | None = None,
    num_splits: int | None = None, num_warps: int | None = None, fused: bool | None = None, pdl: bool | None = None,
    wide_out: bool = False, propose: Proposal | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """logits [B, V] bf16/fp16/fp32 -> (values [B] logits.dtype, indices [B] int64).

    out: optional preallocated (values, indices) so the call allocates nothing but the stage-1
    workspace. That workspace ([B, splits] fp32 + int32, a few KB) comes from torch's caching
    allocator; under CUDA graph capture it comes from the graph's private pool and stays fixed
    for every replay, so the kernel is capturable as is.
    block_v / num_splits / num_warps: override the launch heuristics (tests use small blocks to
    exercise the split logic at small V); unset ones come from _launch_config. fused: one launch,
    the last chunk of each row to finish merges the row; without the
    counter buffer (first call inside a capture) the two-launch path runs (kernels/counters.py). pdl: launch as
    programmatic dependents (default: kernels/pdl.pdl_enabled). wide_out: `out` is (fp32 [B], int32
    [B]) instead (kernels/vocab_parallel.py writes its send buffer so; the fp32 max is exact).
    propose: the indices come back mapped through propose.token_map and are also stored to
    propose.dest[propose.slots[b], propose.column] (a draft step's tokens, see propose_tokens).
    """
    _validate(logits)
    if propose is not None:
        _validate_proposal(propose, logits.shape[0], logits.shape[1], logits.device)
        if wide_out:
            raise ValueError("propose and wide_out do not combine")
    batch, vocab = logits.shape
    if out is None:
        values = torch.empty(batch, dtype=logits.dtype, device=logits.device)
        indices = torch.empty(batch, dtype=torch.int64, device=logits.device)
    else:
        values, indices = out
        # wide_out: fp32 values, int32 indices (the vocab-parallel argmax's send buffer)
        val_dtype, idx_dtype = (torch.float32, torch.int32) if wide_out else (logits.dtype, torch.int64)
        if values.shape != (batch,) or values.dtype != val_dtype or values.device != logits.device:
            raise ValueError(f"out[0] (values) must be [{batch}] {val_dtype} on {logits.device}")
        if indices.shape != (batch,) or indices.dtype != idx_dtype or indices.device != logits.device:
            raise ValueError(f"out[1] (indices) must be [{batch}] {idx_dtype} on {logits.device}")
        if not (values.is_contiguous() and indices.is_contiguous()):
            raise ValueError("out tensors must be contiguous")
    cfg_block, cfg_splits, cfg_warps, cfg_fused = _launch_config(batch)
    block_v = block_v or cfg_block
    num_warps = num_warps or cfg_warps
    pdl = pdl_enabled(logits.device) if pdl is None else pdl
    tiles = triton.cdiv(vocab, block_v)
    splits = max(1, min(num_splits or cfg_splits, tiles))
    tiles_per_split = triton.cdiv(tiles, splits)
    splits = triton.cdiv(tiles, tiles_per_split)  # no empty chunk: each starts below V
    part_val = torch.empty(batch, splits, dtype=torch.float32, device=logits.device)
    part_idx = torch.empty(batch, splits, dtype=torch.int32, device=logits.device)
    want = cfg_fused if fused is None else fused
    ctr = counters(logits.device, batch) if want else None
    if fused and ctr is None:
        raise RuntimeError("fused=True needs the per-device counter buffer (first call outside capture)")
    if propose is None:
        prop_args, prop_flags = (indices, indices, indices, 0, 0), dict(PROPOSE=False, HAS_MAP=False)
    else:
        token_map, dest, slots, column = propose
        prop_args = (indices if token_map is None else token_map, slots, dest, dest.stride(0), column)
        prop_flags = dict(PROPOSE=True, HAS_MAP=token_map is not None)
    _argmax_split_kernel[(batch, splits)](
        logits, part_val, part_idx, values, indices, ctr if ctr is not None else part_idx,
        logits.stride(0), vocab, splits, tiles_per_split, *prop_args,
        BLOCK_V=block_v, FUSED=ctr is not None, SPLITS_POW2=triton.next_power_of_2(splits),
        USE_PDL=pdl, num_warps=num_warps, **prop_flags, **pdl_launch(pdl),
    )
    if ctr is None:
        _argmax_combine_kernel[(batch,)](
            part_val, part_idx, values, indices, splits, *prop_args,
            SPLITS_POW2=triton.next_power_of_2(splits), num_warps=1 if splits <= 128 else 4,
            USE_PDL=pdl, **prop_flags, **pdl_launch(pdl),
        )
    return values, indices


class Proposal(NamedTuple):
    """Where a draft step's argmax goes besides its output: token_map [V] int64 (the target id of
    each index, or None: the index itself), dest [S, W] int64 with unit column stride, slots [B]
    int64 (row b's row of dest, each in [0, S)), column (in [0, W))."""

    token_map: torch.Tensor | None
    dest: torch.Tensor
    slots: torch.Tensor
    column: int


def _validate_proposal(p: Proposal, batch: int, vocab: int, device) -> None:
    if p.token_map is not None and (p.token_map.shape != (vocab,) or p.token_map.dtype != torch.int64
                                    or p.token_map.device != device or not p.token_map.is_contiguous()):
        raise ValueError(f"token_map must be a contiguous [{vocab}] int64 tensor on {device}")
    if p.dest.dim() != 2 or p.dest.dtype != torch.int64 or p.dest.device != device or p.dest.stride(1) != 1:
        raise ValueError(f"dest must be [S, W] int64 on {device} with unit column stride")
    if p.slots.shape != (batch,) or p.slots.dtype != torch.int64 or p.slots.device != device \
            or not p.slots.is_contiguous():
        raise ValueError(f"slots must be a contiguous [{batch}] int64 tensor on {device}")
    if not 0 <= p.column < p.dest.shape[1]:
        raise ValueError(f"column {p.column} is outside dest's {p.dest.shape[1]} columns")


def propose_tokens(logits: torch.Tensor, proposal: Proposal, out: torch.Tensor, *, group=None,
                   vocab_size: int | None = None) -> torch.Tensor:
    """A draft step's top-1 tokens: logits [B, V] (draft vocabulary) -> out [B] int64 =
    token_map[argmax(logits)] (the argmax itself without a map), also stored to
    dest[slots[b], column]. On CUDA one argmax launch does it all (its last step maps and stores);
    elsewhere, or vocab-parallel (group, vocab_size as argmax's), the same in torch after argmax.
    Returns out."""
    _validate(logits)
    if logits.is_cuda and group is None:  # argmax_triton checks the proposal and out
        values = torch.empty(logits.shape[0], dtype=logits.dtype, device=logits.device)
        return argmax_triton(logits, out=(values, out), propose=proposal)[1]
    _validate_proposal(proposal, logits.shape[0], vocab_size or logits.shape[1], logits.device)
    if out.shape != (logits.shape[0],) or out.dtype != torch.int64 or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous [{logits.shape[0]}] int64 tensor")
    ids = argmax(logits, group=group, vocab_size=vocab_size)[1]
    if proposal.token_map is not None:
        ids = proposal.token_map[ids]
    out.copy_(ids)
    proposal.dest[proposal.slots, proposal.column] = ids
    return out


def argmax(
    logits: torch.Tensor, *, out: tuple[torch.Tensor, torch.Tensor] | None = None, group=None,
    vocab_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] bf16/fp16/fp32 -> (values [B] logits.dtype, indices [B] int64).

    CUDA tensors run the Triton kernel, anything else the PyTorch reference. With a process group
    (vocab parallel, kernels/vocab_parallel.py): logits is this rank's shard [B, end - start] of
    vocab_shard(vocab_size, W, rank), vocab_size the full V; every rank gets the full rows' result
    (global indices) through one all_gather of 8 bytes a row.
    """
    if group is not None:
        from graphrt.kernels.vocab_parallel import argmax_vocab_parallel

        return argmax_vocab_parallel(logits, group=group, vocab_size=vocab_size, out=out)
    if vocab_size is not None and isinstance(logits, torch.Tensor) and logits.dim() == 2 \
            and vocab_size != logits.shape[1]:
        raise ValueError(f"vocab_size {vocab_size} != logits' last dim {logits.shape[1]} (no process group)")
    if isinstance(logits, torch.Tensor) and logits.is_cuda:
        return argmax_triton(logits, out=out)
    values, indices = argmax_reference(logits)
    if out is not None:
        out[0].copy_(values)
        out[1].copy_(indices)
        return out
    return values, indices
