"""The cycle's index bookkeeping, one launch each instead of a dozen small torch kernels.

Before its forward, a phase gathers each batch row's state by slot and derives the attention
metadata from it (cycle_inputs: positions, block tables, seq_lens, slot_mapping, and optionally
the rows' tokens and sampling parameters); after the target's rejection kernel, it advances each
request by the tokens it emitted (advance). Written with torch ops that is about twenty
one-thread-block kernels per phase, each costing a launch and a hand-off on the GPU. The
references (cycle_inputs_reference, advance_reference) state what each computes.

Positions are never negative (the cycle's state invariant), so floor and truncating division agree.
Static shapes, no host sync: both sit inside the captured phase graphs. Triton on CUDA, the torch
reference elsewhere. cycle_inputs launches without PDL, so it is the fence that settles the metadata
before the forward (kernels/pdl.py); advance, the phase's last kernel, is a programmatic dependent.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from graphrt.kernels.pdl import pdl_enabled, pdl_launch, wait_for_producer

# The scratch slot (the last; padded batch rows use it) is held at num_tokens 2, last token 0: its
# positions stay small and inside block 0 however many cycles pad with it.
SCRATCH_NUM_TOKENS, SCRATCH_LAST_TOKEN = 2, 0
_TL_SCRATCH_NUM_TOKENS = tl.constexpr(SCRATCH_NUM_TOKENS)
_TL_SCRATCH_LAST_TOKEN = tl.constexpr(SCRATCH_LAST_TOKEN)


def pin_scratch(num_tokens, last_token, scratch_slot: int) -> None:
    """Put the scratch slot back to its pinned state (fill_ on a view: a device-side fill,
    capturable, where item assignment copies from the host)."""
    num_tokens[scratch_slot:].fill_(SCRATCH_NUM_TOKENS)
    last_token[scratch_slot:].fill_(SCRATCH_LAST_TOKEN)


@dataclass
class CycleInputs:
    """What cycle_inputs returns for B rows of T positions each."""

    positions: torch.Tensor  # [B, T] int64 ([T, B] step_major)
    block_tables: torch.Tensor  # [B, MB] int32, the rows' tables
    seq_lens: torch.Tensor  # [B] int32 ([T, B] step_major)
    slot_mapping: torch.Tensor  # [B * T] int64 ([T, B] step_major)
    tokens: torch.Tensor | None = None  # [B, T] int64 (with_tokens)
    temperature: torch.Tensor | None = None  # [B] fp32 (with_sampling)
    seed: torch.Tensor | None = None  # [B] int64 (with_sampling)
    last: torch.Tensor | None = None  # [B] int64 (emitted): the row of each request's last emitted token
    last_seq_lens: torch.Tensor | None = None  # [B] int32 (emitted): the KV length at that token


def _check_sources(sampling, tokens, emitted):
    if sampling is not None and (len(sampling) != 2 or sampling[0].dtype != torch.float32
                                 or sampling[1].dtype != torch.int64):
        raise ValueError("sampling must be (temperature [S] fp32, seed [S] int64)")
    if tokens is not None and emitted is not None:
        raise ValueError("tokens and emitted both make the rows' tokens: pass one")


def cycle_inputs_reference(slots, src, block_tables, *, T: int, block_size: int, base_add: int = 0,
                           by_slot: bool = True, n_out=None, tokens=None, sampling=None,
                           step_major: bool = False, emitted=None) -> CycleInputs:
    """slots [B] int64; src [S] int64 (by_slot: read at the rows' slots) or [B] (read per row);
    block_tables [S, MB] int32; n_out: [B] int64 to receive src at the rows (by_slot only);
    tokens: (last_token [S] int64, draft_tokens [S, >= T-1] int64) or None; sampling:
    (temperature [S] fp32, seed [S] int64) or None; emitted: (emitted [>= B, T] int64,
    num_emitted [>= B] int32, >= 1) or None."""
    _check_sources(sampling, tokens, emitted)
    B = slots.shape[0]
    src_rows = src[slots] if by_slot else src[:B]
    if n_out is not None:
        n_out.copy_(src_rows)
    positions = (src_rows + base_add)[:, None] + torch.arange(T, device=slots.device)
    tables = block_tables[slots]
    mb = tables.shape[1]
    blk = (positions // block_size).clamp(max=mb - 1)
    slot_mapping = tables.gather(1, blk).to(torch.int64) * block_size + positions % block_size
    if step_major:
        out = CycleInputs(positions=positions.T.contiguous(), block_tables=tables,
                          seq_lens=(positions.T + 1).to(torch.int32), slot_mapping=slot_mapping.T.contiguous())
    else:
        out = CycleInputs(positions=positions, block_tables=tables, seq_lens=(positions[:, -1] + 1).to(torch.int32),
                          slot_mapping=slot_mapping.flatten())
    if tokens is not None:
        last, drafts = tokens
        out.tokens = torch.cat([last[slots][:, None], drafts[slots, : T - 1]], dim=1)
    if sampling is not None:
        out.temperature, out.seed = sampling[0][slots], sampling[1][slots]
    if emitted is not None:
        out.tokens = emitted[0][:B].clamp(min=0)
        out.last = torch.arange(B, device=slots.device) * T + emitted[1][:B].to(torch.int64) - 1
        out.last_seq_lens = (src_rows + base_add + emitted[1][:B]).to(torch.int32)
    return out


# B and base_add change with the bucket and the phase: specialising on them (B = 1, say) would compile
# a variant per bucket for nothing
@triton.jit(do_not_specialize=["base_add", "B"])
def _cycle_inputs_kernel(
    slots_ptr,  # [B] int64
    src_ptr,  # [S] int64 (BY_SLOT) or [B] int64
    tables_ptr,  # [S, MB] int32 contiguous
    last_ptr,  # [S] int64 (TOKENS)
    drafts_ptr,  # [S, KD] int64 contiguous (TOKENS, T > 1)
    temp_ptr,  # [S] fp32 (SAMPLING)
    seed_ptr,  # [S] int64 (SAMPLING)
    n_ptr,  # [B] int64 out (N_OUT)
    pos_ptr,  # [B, T] int64 out ([T, B] STEP_MAJOR)
    tab_ptr,  # [B, MB] int32 out
    seqlen_ptr,  # [B] int32 out ([T, B] STEP_MAJOR)
    smap_ptr,  # [B * T] int64 out ([T, B] STEP_MAJOR)
    tok_ptr,  # [B, T] int64 out (TOKENS)
    temp_out_ptr,  # [B] fp32 out (SAMPLING)
    seed_out_ptr,  # [B] int64 out (SAMPLING)
    emit_ptr,  # [>= B, T] int64 contiguous (EMITTED)
    nemit_ptr,  # [>= B] int32 (EMITTED)
    last_out_ptr,  # [B] int64 out (EMITTED)
    last_len_ptr,  # [B] int32 out (EMITTED)
    base_add,
    block_size,
    MB,
    KD,
    B,
    T: tl.constexpr,
    TP: tl.constexpr,  # next power of 2 >= T
    BLOCK_MB: tl.constexpr,
    BY_SLOT: tl.constexpr,
    N_OUT: tl.constexpr,
    TOKENS: tl.constexpr,
    SAMPLING: tl.constexpr,
    STEP_MAJOR: tl.constexpr = False,
    EMITTED: tl.constexpr = False,
):
    b = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + b)
    if BY_SLOT:
        src = tl.load(src_ptr + slot)
    else:
        src = tl.load(src_ptr + b)
    if N_OUT:
        tl.store(n_ptr + b, src)
    j = tl.arange(0, TP)
    live = j < T
    pos = src + base_add + j
    at = j * B + b if STEP_MAJOR else b * T + j
    tl.store(pos_ptr + at, pos, mask=live)
    blk = tl.minimum(pos // block_size, MB - 1)
    block = tl.load(tables_ptr + slot * MB + blk, mask=live, other=0).to(tl.int64)
    tl.store(smap_ptr + at, block * block_size + pos % block_size, mask=live)
    if STEP_MAJOR:
        tl.store(seqlen_ptr + at, (pos + 1).to(tl.int32), mask=live)
    else:
        tl.store(seqlen_ptr + b, (src + base_add + T).to(tl.int32))
    for start in range(0, MB, BLOCK_MB):
        c = start + tl.arange(0, BLOCK_MB)
        tl.store(tab_ptr + b * MB + c, tl.load(tables_ptr + slot * MB + c, mask=c < MB), mask=c < MB)
    if TOKENS:
        d = tl.load(drafts_ptr + slot * KD + (j - 1), mask=(j >= 1) & live, other=0)
        tok = tl.where(j == 0, tl.load(last_ptr + slot), d)
        tl.store(tok_ptr + b * T + j, tok, mask=live)
    if SAMPLING:
        tl.store(temp_out_ptr + b, tl.load(temp_ptr + slot))
        tl.store(seed_out_ptr + b, tl.load(seed_ptr + slot))
    if EMITTED:
        e = tl.load(emit_ptr + b * T + j, mask=live, other=0)
        tl.store(tok_ptr + b * T + j, tl.maximum(e, 0), mask=live)
        ne = tl.load(nemit_ptr + b).to(tl.int64)
        tl.store(last_out_ptr + b, b * T + ne - 1)
        tl.store(last_len_ptr + b, (src + base_add + ne).to(tl.int32))


def cycle_inputs_triton(slots, src, block_tables, *, T: int, block_size: int, base_add: int = 0,
                        by_slot: bool = True, n_out=None, tokens=None, sampling=None,
                        step_major: bool = False, emitted=None) -> CycleInputs:
    """Same contract as cycle_inputs_reference. One launch, one program per batch row."""
    _check_sources(sampling, tokens, emitted)
    if not block_tables.is_contiguous() or (tokens is not None and not tokens[1].is_contiguous()) or (
            emitted is not None and not emitted[0].is_contiguous()):
        raise ValueError("block_tables, draft_tokens and emitted must be contiguous")
    B, MB = slots.shape[0], block_tables.shape[1]
    dev = slots.device
    out = CycleInputs(positions=torch.empty((T, B) if step_major else (B, T), dtype=torch.int64, device=dev),
                      block_tables=torch.empty(B, MB, dtype=block_tables.dtype, device=dev),
                      seq_lens=torch.empty((T, B) if step_major else (B,), dtype=torch.int32, device=dev),
                      slot_mapping=torch.empty((T, B) if step_major else (B * T,), dtype=torch.int64, device=dev))
    last, drafts = tokens if tokens is not None else (None, None)
    temp, seed = sampling if sampling is not None else (None, None)
    emit, nemit = emitted if emitted is not None else (None, None)
    if tokens is not None or emitted is not None:
        out.tokens = torch.empty(B, T, dtype=torch.int64, device=dev)
    if sampling is not None:
        out.temperature = torch.empty(B, dtype=torch.float32, device=dev)
        out.seed = torch.empty(B, dtype=torch.int64, device=dev)
    if emitted is not None:
        out.last = torch.empty(B, dtype=torch.int64, device=dev)
        out.last_seq_lens = torch.empty(B, dtype=torch.int32, device=dev)
    if B == 0:
        return out

    def ptr(t):  # a valid pointer for the arguments a variant does not read
        return out.positions if t is None else t

    _cycle_inputs_kernel[(B,)](
        slots, src, block_tables, ptr(last), ptr(drafts), ptr(temp), ptr(seed), ptr(n_out), out.positions,
        out.block_tables, out.seq_lens, out.slot_mapping, ptr(out.tokens), ptr(out.temperature), ptr(out.seed),
        ptr(emit), ptr(nemit), ptr(out.last), ptr(out.last_seq_lens), base_add, block_size, MB,
        1 if drafts is None else drafts.shape[1], B, T=T, TP=triton.next_power_of_2(T),
        BLOCK_MB=min(1024, triton.next_power_of_2(MB)), BY_SLOT=by_slot, N_OUT=n_out is not None,
        TOKENS=tokens is not None, SAMPLING=sampling is not None, STEP_MAJOR=step_major,
        EMITTED=emitted is not None, num_warps=1,
    )
    return out


def cycle_inputs(slots, src, block_tables, **kw) -> CycleInputs:
    """Triton on CUDA, the reference elsewhere (contract: cycle_inputs_reference)."""
    fn = cycle_inputs_triton if slots.is_cuda else cycle_inputs_reference
    return fn(slots, src, block_tables, **kw)


def advance_reference(slots, n, num_emitted, emitted, num_tokens, last_token, scratch_slot: int) -> None:
    """slots, n [B] int64; num_emitted [B] int32 (>= 1); emitted [B, W] int64; num_tokens,
    last_token [S] int64, updated in place."""
    ne = num_emitted.to(torch.int64)
    num_tokens[slots] = n + ne
    last_token[slots] = emitted.gather(1, (ne - 1)[:, None]).squeeze(1)
    pin_scratch(num_tokens, last_token, scratch_slot)  # padded rows advanced it like any request


@triton.jit(do_not_specialize=["B"])
def _advance_kernel(
    slots_ptr,  # [B] int64
    n_ptr,  # [B] int64
    nemit_ptr,  # [B] int32
    emit_ptr,  # [B, W] int64 contiguous
    num_tokens_ptr,  # [S] int64, in place
    last_ptr,  # [S] int64, in place
    B,
    W,
    scratch,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    if USE_PDL:  # the phase's last kernel, after the sampler: a programmatic dependent of it
        wait_for_producer()
    # one program, BLOCK rows at a time whatever the bucket (one compiled variant for all of them):
    # rows on the scratch slot are never written, so no two lanes store to one slot
    for start in range(0, B, BLOCK):
        r = start + tl.arange(0, BLOCK)
        m = r < B
        slot = tl.load(slots_ptr + r, mask=m, other=scratch)
        ne = tl.maximum(tl.load(nemit_ptr + r, mask=m, other=1).to(tl.int64), 1)
        n = tl.load(n_ptr + r, mask=m, other=0)
        last = tl.load(emit_ptr + r.to(tl.int64) * W + ne - 1, mask=m, other=0)
        real = m & (slot != scratch)
        tl.store(num_tokens_ptr + slot, n + ne, mask=real)
        tl.store(last_ptr + slot, last, mask=real)
    tl.store(num_tokens_ptr + scratch, tl.full((), _TL_SCRATCH_NUM_TOKENS, tl.int64))
    tl.store(last_ptr + scratch, tl.full((), _TL_SCRATCH_LAST_TOKEN, tl.int64))


def advance_triton(slots, n, num_emitted, emitted, num_tokens, last_token, scratch_slot: int) -> None:
    """Same contract as advance_reference (the scratch slot is the last of num_tokens' slots).
    One launch, one program."""
    if not emitted.is_contiguous() or scratch_slot != num_tokens.shape[0] - 1:
        raise ValueError("emitted must be contiguous and the scratch slot the last one")
    B = slots.shape[0]
    pdl = pdl_enabled(slots.device)
    _advance_kernel[(1,)](slots, n, num_emitted, emitted, num_tokens, last_token, B, emitted.shape[1],
                          scratch_slot, BLOCK=64, USE_PDL=pdl, num_warps=2, **pdl_launch(pdl))


def advance(slots, n, num_emitted, emitted, num_tokens, last_token, scratch_slot: int) -> None:
    """Triton on CUDA, the reference elsewhere (contract: advance_reference)."""
    fn = advance_triton if slots.is_cuda else advance_reference
    fn(slots, n, num_emitted, emitted, num_tokens, last_token, scratch_slot)
