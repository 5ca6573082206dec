"""kernels/cycle_index.py: the cycle's gathers and metadata in one launch, and the advance, Triton
(interpreter) against the torch reference."""

from __future__ import annotations

import pytest
import torch
from graphrt.kernels.cycle_index import (
    advance_reference,
    advance_triton,
    cycle_inputs_reference,
    cycle_inputs_triton,
)

from tests.seeds import fresh_seed


def _state(S, MB, K, gen, block_size):
    """S slots, the last the scratch slot; positions up to past the table (the clamp)."""
    num_tokens = torch.randint(1, MB * block_size + 3 * block_size, (S,), generator=gen)
    num_tokens[-1] = 2
    tables = torch.randint(0, 10**5, (S, MB), generator=gen).to(torch.int32)
    last = torch.randint(0, 5000, (S,), generator=gen)
    drafts = torch.randint(0, 5000, (S, max(K, 1)), generator=gen)
    temperature = torch.rand(S, generator=gen)
    seed = torch.randint(-(2**62), 2**62, (S,), generator=gen)
    return num_tokens, tables, last, drafts, temperature, seed


@pytest.mark.parametrize("B,T,MB,block_size,by_slot,base_add,step_major", [
    (1, 1, 3, 16, True, -1, False),  # the plain step
    (5, 4, 7, 16, True, -1, False),  # TARGET_VERIFY at K = 3
    (6, 6, 1030, 8, True, -1, False),  # more blocks than one tile of the table copy
    (3, 4, 5, 16, False, -1, False),  # DRAFT_EXTEND of an EAGLE head (batch_n per row, one behind)
    (4, 3, 9, 4, False, 0, False),
    (5, 2, 7, 16, True, -1, True),  # DRAFT_DECODE's K - 1 = 2 steps of an EAGLE head
    (3, 4, 6, 4, True, 0, True),  # a standalone draft's 4 steps, crossing blocks
])
def test_cycle_inputs_triton_equals_reference(B, T, MB, block_size, by_slot, base_add, step_major):
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    S = B + 3
    num_tokens, tables, last, drafts, temperature, seeds = _state(S, MB, T - 1, gen, block_size)
    slots = torch.randperm(S - 1, generator=gen)[:B]
    slots[-1] = S - 1  # a padded row on the scratch slot
    src = num_tokens if by_slot else torch.randint(1, MB * block_size, (B,), generator=gen)
    inputs = (slots, src, tables, last, drafts, temperature, seeds)
    snap = [t.clone() for t in inputs]
    kw = dict(T=T, block_size=block_size, base_add=base_add, by_slot=by_slot, step_major=step_major)
    emitted = num_emitted = None
    if by_slot and not step_major:
        kw.update(tokens=(last, drafts), sampling=(temperature, seeds))
    elif not by_slot:  # DRAFT_EXTEND: the verify step's tokens, -1 past each request's count
        num_emitted = torch.randint(1, T + 1, (B + 2,), generator=gen).to(torch.int32)
        emitted = torch.randint(0, 5000, (B + 2, T), generator=gen)
        emitted[torch.arange(T)[None, :] >= num_emitted.long()[:, None]] = -1
        kw.update(emitted=(emitted, num_emitted))
        inputs += (emitted, num_emitted)
    n_ref, n_tri = torch.full((B,), -7), torch.full((B,), -7)
    ref = cycle_inputs_reference(slots, src, tables, **kw, n_out=n_ref if by_slot and not step_major else None)
    tri = cycle_inputs_triton(slots, src, tables, **kw, n_out=n_tri if by_slot and not step_major else None)
    msg = f"seed {seed}"
    for name in ("positions", "block_tables", "seq_lens", "slot_mapping", "tokens", "temperature", "seed", "last",
                 "last_seq_lens"):
        a, b = getattr(ref, name), getattr(tri, name)
        assert (a is None) == (b is None), f"{msg}: {name}"
        if a is not None:
            assert a.dtype == b.dtype and torch.equal(a, b), f"{msg}: {name}\n{a}\n{b}"
    assert torch.equal(n_ref, n_tri), msg
    if by_slot and not step_major:
        assert torch.equal(n_ref, num_tokens[slots]), msg
    # the metadata's own rule, checked apart from the reference's code
    pos = ref.positions.T if step_major else ref.positions  # [B, T]
    assert torch.equal(pos, (src[slots] if by_slot else src)[:, None] + base_add + torch.arange(T)), msg
    blk = (pos // block_size).clamp(max=MB - 1)
    want = tables[slots].long().gather(1, blk) * block_size + pos % block_size
    if step_major:  # T one-token steps: each step's row of seq_lens and slot_mapping
        assert torch.equal(tri.seq_lens.long(), pos.T + 1) and torch.equal(tri.slot_mapping, want.T), msg
    else:
        assert torch.equal(tri.seq_lens.long(), pos[:, -1] + 1) and torch.equal(tri.slot_mapping, want.flatten()), msg
    if emitted is not None:
        assert torch.equal(tri.tokens, emitted[:B].clamp(min=0)), msg
        assert torch.equal(tri.last, torch.arange(B) * T + num_emitted[:B].long() - 1), msg
        # the KV length at the last emitted token: its position + 1
        assert torch.equal(tri.last_seq_lens.long(), pos.flatten()[tri.last] + 1), msg
        assert int(tri.tokens.min()) >= 0, msg
    snap += [t.clone() for t in inputs[len(snap):]]
    assert all(torch.equal(a, b) for a, b in zip(snap, inputs)), f"{msg}: an input was modified"


@pytest.mark.parametrize("B,W", [(1, 1), (5, 4), (37, 6), (130, 4)])  # 130: past one 64-row block
def test_advance_triton_equals_reference(B, W):
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    S = B + 4
    slots = torch.randperm(S - 1, generator=gen)[:B]
    slots[B // 2 :: 3] = S - 1  # padded rows: the scratch slot, several times
    n = torch.randint(1, 10**4, (B,), generator=gen)
    num_emitted = torch.randint(1, W + 1, (B,), generator=gen).to(torch.int32)
    emitted = torch.randint(0, 5000, (B, W), generator=gen)
    num_tokens = torch.randint(1, 10**4, (S,), generator=gen)
    last = torch.randint(0, 5000, (S,), generator=gen)
    want_nt, want_last = num_tokens.clone(), last.clone()
    advance_reference(slots, n, num_emitted, emitted, want_nt, want_last, S - 1)
    got_nt, got_last = num_tokens.clone(), last.clone()
    advance_triton(slots, n, num_emitted, emitted, got_nt, got_last, S - 1)
    msg = f"seed {seed}"
    assert torch.equal(got_nt, want_nt) and torch.equal(got_last, want_last), msg
    assert got_nt[-1] == 2 and got_last[-1] == 0, msg
    real = slots != S - 1
    ne = num_emitted.long()
    assert torch.equal(got_nt[slots[real]], (n + ne)[real]), msg
    assert torch.equal(got_last[slots[real]], emitted[torch.arange(B), ne - 1][real]), msg
    untouched = torch.ones(S, dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(got_nt[untouched], num_tokens[untouched]), msg


def test_bad_sources_are_named():
    slots = torch.zeros(1, dtype=torch.int64)
    tables = torch.zeros(2, 3, dtype=torch.int32)
    src = torch.ones(2, dtype=torch.int64)
    for fn in (cycle_inputs_reference, cycle_inputs_triton):
        with pytest.raises(ValueError, match="sampling"):
            fn(slots, src, tables, T=1, block_size=4,
               sampling=(torch.zeros(2, dtype=torch.float64), torch.zeros(2, dtype=torch.int64)))
        with pytest.raises(ValueError, match="tokens and emitted"):
            fn(slots, src, tables, T=1, block_size=4, tokens=(src, src[:, None]),
               emitted=(src[:, None], src.to(torch.int32)))
