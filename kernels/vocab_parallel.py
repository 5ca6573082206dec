"""Vocab-parallel argmax and rejection sampling: each rank holds a vocab shard of the logits and
nothing gathers them.

Under tensor parallelism the LM head is split by vocabulary rows, so rank r's logits are
[..., V_local], the entries [start, end) of vocab_shard(V, W, r). Gathering them costs 2*N*V bytes
per step; instead each rank reduces its own shard in kernels, ONE all_gather exchanges per-row
statistics, and a finishing step on the gathered statistics decides identically on every rank.

  argmax: each rank's (max widened to fp32, lowest local index), 8 bytes a row; the first rank
  holding the global max wins (shards are in vocab order), so ties and dead rows resolve exactly as
  the single-process argmax does.

  rejection sampling (greedy, one-hot sampled, K = 0): the sampler's row pass with FUSE_RACE
  races every split (which race a row runs is fixed before the walk), so its walk reads no logits.
  Shards start on race-chunk boundaries (vocab_shard), every rank splits its shard alike (SPS
  splits; the last rank's splits past V store identity stats) and uses global ids for everything
  that leaves the kernel or seeds the RNG, so the gathered planes, in rank order, are those one GPU
  computes over the full row with the same split layout (single_gpu_config): the unchanged
  _walk_kernel finishes, bit for bit the single-GPU Triton path. W * 48 * SPS bytes a row. On CPU
  tensors the same plan runs in PyTorch (kernels/vocab_parallel_kernels.py), and tokens equal
  rejection_sample_reference's on the full logits with race_chunk = vocab_race_chunk(V, W).

Capturable in a CUDA graph: no host sync, no data-dependent shape; the collective is a plain
torch.distributed.all_gather_into_tensor on the given group (NCCL; gloo on CPU). Every rank must
call with the same replicated arguments (drafts, temperature, seed, position, ...).
"""

from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass

import torch
import torch.distributed as dist
import triton
from graphrt.kernels.argmax import argmax_reference, argmax_triton
from graphrt.kernels.pdl import pdl_enabled, pdl_launch
from graphrt.kernels.rejection import (
    LaunchConfig,
    _on_gpu,
    draft_args,
    launch_config,
    new_outputs,
    rejection_sample_triton,
    walk_warps,
)
from graphrt.kernels.rejection_kernels import _NUM_FPLANES, WARPS, _chunk_splits, _row_stats_kernel, _walk_kernel
from graphrt.kernels.rejection_reference import (
    RACE_CHUNK,
    RejectionOutput,
    _validate,
    drafts_per_request,
    rejection_sample_reference,
)
from graphrt.kernels.vocab_parallel_kernels import (
    _NPLANES,
    argmax_finish_reference,
    argmax_finish_triton,
    assemble_reference,
    assemble_triton,
    shard_stats_reference,
    walk_reference,
)

__all__ = ["VocabPlan", "argmax_vocab_parallel", "rejection_sample_vocab_parallel", "single_gpu_config",
           "vocab_plan", "vocab_race_chunk", "vocab_shard"]


# ---------------------------------------------------------------------------------------------
# The shard rule
# ---------------------------------------------------------------------------------------------


def _as_int(name: str, n) -> int:
    """Any integral value (a config's numpy int too), never a bool or a float."""
    try:
        if isinstance(n, bool):
            raise TypeError
        return operator.index(n)
    except TypeError:
        raise ValueError(f"{name} must be an int, got {n!r}") from None


def _check_sizes(vocab_size, world_size) -> tuple[int, int]:
    vocab_size, world_size = _as_int("vocab_size", vocab_size), _as_int("world_size", world_size)
    for name, n in (("vocab_size", vocab_size), ("world_size", world_size)):
        if n < 1:
            raise ValueError(f"{name} must be >= 1, got {n}")
    if vocab_size < world_size:
        raise ValueError(f"vocab_size {vocab_size} < world_size {world_size}: every rank needs a vocab entry")
    return vocab_size, world_size


def vocab_race_chunk(vocab_size: int, world_size: int) -> int:
    """The two-level race's chunk under W-way vocab parallelism: RACE_CHUNK for real vocabularies
    (V >= W * RACE_CHUNK), else the next power of two >= ceil(V / W), so shards stay chunk-aligned
    at test sizes. The single-process sampler draws the same tokens with race_chunk = this."""
    vocab_size, world_size = _check_sizes(vocab_size, world_size)
    return min(RACE_CHUNK, triton.next_power_of_2(-(-vocab_size // world_size)))


def _shard_size(vocab_size: int, world_size: int, chunk: int) -> int:
    per_rank = -(-vocab_size // world_size)
    return -(-per_rank // chunk) * chunk


def vocab_shard(vocab_size: int, world_size: int, rank: int) -> tuple[int, int]:
    """[start, end) of the vocabulary that rank owns: every part of graphrt (the LM head's and the
    embedding's rows, the samplers) uses this rule. Shards are ceil(ceil(V / W) / chunk) * chunk
    entries (chunk = vocab_race_chunk(V, W)), in rank order; the last is shorter, and in degenerate
    cases (e.g. V = 5, W = 4) a last rank owns nothing: (V, V). Every kernel here handles that."""
    vocab_size, world_size = _check_sizes(vocab_size, world_size)
    rank = _as_int("rank", rank)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must lie in [0, {world_size}), got {rank}")
    s = _shard_size(vocab_size, world_size, vocab_race_chunk(vocab_size, world_size))
    return min(rank * s, vocab_size), min((rank + 1) * s, vocab_size)


def _group_layout(group, vocab_size) -> tuple[int, int, int]:
    """(vocab_size, W, this rank) of a call under a process group."""
    if vocab_size is None:
        raise ValueError("vocab_size (the full vocabulary) is required with a process group")
    if group is None:
        raise ValueError("a process group is required")
    return _as_int("vocab_size", vocab_size), dist.get_world_size(group), dist.get_rank(group)


# torch 2.13 renames all_gather_into_tensor (and deprecates the old name); older torch has only it.
_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _all_gather(send: torch.Tensor, group, world: int) -> torch.Tensor:
    """send [n, ...] -> [W, n, ...] in rank order: the one collective of each call. The output is
    allocated as the concatenation [W * n, ...], the one form gloo accepts (NCCL takes both)."""
    out = torch.empty((world * send.shape[0], *send.shape[1:]), dtype=send.dtype, device=send.device)
    _gather_single(out, send, group=group)
    return out.view(world, *send.shape)


def _use_triton(dev: torch.device, impl: str | None) -> bool:
    if impl not in (None, "triton", "reference"):
        raise ValueError(f"impl must be None, 'triton' or 'reference', got {impl!r}")
    return dev.type == "cuda" if impl is None else impl == "triton"


# ---------------------------------------------------------------------------------------------
# argmax
# ---------------------------------------------------------------------------------------------


def argmax_shard(logits: torch.Tensor, use_triton: bool) -> torch.Tensor:
    """This rank's part: logits [B, V_local] -> [2, B] int32 (max widened to fp32, as bits; its
    lowest local index). An empty shard sends (-inf, 0): it wins only where every rank is -inf,
    and rank 0 comes first then."""
    b = logits.shape[0]
    send = torch.empty((2, b), dtype=torch.int32, device=logits.device)
    vals = send[0].view(torch.float32)
    if logits.shape[1] == 0:
        vals.fill_(float("-inf"))
        send[1].zero_()
    elif use_triton:
        argmax_triton(logits, out=(vals, send[1]), wide_out=True)
    else:
        v, i = argmax_reference(logits)
        vals.copy_(v)
        send[1].copy_(i)
    return send


def argmax_vocab_parallel(
    logits: torch.Tensor, *, group, vocab_size: int, out: tuple[torch.Tensor, torch.Tensor] | None = None,
    impl: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, end - start] bf16/fp16/fp32, this rank's shard (vocab_shard(vocab_size, W, rank))
    -> (values [B] logits.dtype, global indices [B] int64), the same on every rank and equal to the
    single-process argmax of the full rows (kernels/argmax.py's NaN / -inf / tie rules).
    impl: None (Triton on CUDA, PyTorch elsewhere), "triton" or "reference"."""
    vocab_size, world, rank = _group_layout(group, vocab_size)
    start, end = vocab_shard(vocab_size, world, rank)
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or logits.shape[1] != end - start:
        shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise ValueError(f"logits must be this rank's shard [B, {end - start}] (vocab [{start}, {end}) of "
                         f"{vocab_size}, rank {rank} of {world}), got {shape}")
    b = logits.shape[0]
    if out is None:
        out = (torch.empty(b, dtype=logits.dtype, device=logits.device),
               torch.empty(b, dtype=torch.int64, device=logits.device))
    use_triton = _use_triton(logits.device, impl)
    gathered = _all_gather(argmax_shard(logits, use_triton), group, world)
    shard = _shard_size(vocab_size, world, vocab_race_chunk(vocab_size, world))
    finish = argmax_finish_triton if use_triton else argmax_finish_reference
    finish(gathered, vocab_size, shard, out[0], out[1])
    return out[0], out[1]


# ---------------------------------------------------------------------------------------------
# rejection sampling
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class VocabPlan:
    """How a call is split: identical on every rank (nothing here depends on the rank but start/end).

    chunk: the race chunk; shard: entries per full shard (a multiple of chunk); split_len: entries
    per split (chunk / spc); sps: splits per shard; splits: splits of the full row (the walk's);
    block_v, tiles_per_split: the Triton row pass's tile; config: its launch (fuse_race on)."""

    vocab: int
    world: int
    rank: int
    start: int
    end: int
    chunk: int
    shard: int
    spc: int
    split_len: int
    sps: int
    splits: int
    block_v: int
    tiles_per_split: int
    config: LaunchConfig


def vocab_plan(batch: int, k: int, vocab: int, world: int, rank: int, *, config: LaunchConfig | None = None,
               use_triton: bool = True, race_chunk: int | None = None) -> VocabPlan:
    """The plan of one call. race_chunk: tests only, a smaller chunk (a power of two) for several
    chunks per shard at small V; shards then follow it (not vocab_shard's rule)."""
    chunk = vocab_race_chunk(vocab, world) if race_chunk is None else race_chunk
    shard = _shard_size(vocab, world, chunk)
    start, end = min(rank * shard, vocab), min((rank + 1) * shard, vocab)
    rows = batch * (k + 1)
    cfg = dataclasses.replace(config or launch_config(batch, k, False), fuse_race=True)
    block_v = min(cfg.block_v, chunk)
    if use_triton:
        # The splits per chunk follow from the shard size, the same on every rank.
        _, tps, spc = _chunk_splits(rows, shard, block_v, chunk, cfg.num_splits)
    else:
        tps, spc = chunk // block_v, 1  # PyTorch: one split per chunk
    split_len = block_v * tps
    return VocabPlan(vocab, world, rank, start, end, chunk, shard, spc, split_len, shard // split_len,
                     -(-vocab // split_len), block_v, tps, cfg)


def single_gpu_config(plan: VocabPlan) -> LaunchConfig:
    """The single-GPU launch whose split layout is the plan's: rejection_sample_triton(full logits,
    config=this, race_chunk=plan.chunk) gives the vocab-parallel Triton path's results bit for bit."""
    return dataclasses.replace(plan.config, block_v=plan.block_v,
                               num_splits=plan.spc * -(-plan.vocab // plan.chunk))


def shard_stats(shard: torch.Tensor, drafts: torch.Tensor, temperature: torch.Tensor, seed: torch.Tensor,
                position: torch.Tensor, num_draft_tokens: torch.Tensor | None, plan: VocabPlan,
                use_triton: bool) -> torch.Tensor:
    """This rank's send buffer: [_NPLANES, B*(K+1), plan.sps] int32 (layout in
    kernels/vocab_parallel_kernels.py)."""
    b, r, vl = shard.shape
    k = r - 1
    dev = shard.device
    if not use_triton:
        return shard_stats_reference(shard, drafts, temperature, seed, position,
                                     drafts_per_request(num_draft_tokens, b, k, dev), plan.start, plan.vocab,
                                     plan.split_len, plan.sps)
    cfg = plan.config
    send = torch.empty((_NPLANES, b * r, plan.sps), dtype=torch.int32, device=dev)
    fstat = send[:_NUM_FPLANES].view(torch.float32)
    istat = send[_NUM_FPLANES:]
    logits = shard if vl > 0 else torch.full((b, r, 1), float("-inf"), dtype=shard.dtype, device=dev)
    race_block_v = min(cfg.race_block_v, plan.chunk)
    vec = min(4 if shard.dtype == torch.float32 else 8, plan.block_v, race_block_v)
    pdl = cfg.pdl if pdl_enabled(dev) else 0
    ids, ids_strides, nd, _ = draft_args(drafts, seed, num_draft_tokens, None)
    # Grid: every split of a full shard, so the last rank's splits past V store identity stats.
    _row_stats_kernel[(b * r, plan.sps)](
        logits, logits, ids, temperature, seed, position, nd, fstat, istat, fstat,
        logits.stride(0), logits.stride(1), 0, 0, *ids_strides,
        r, vl, plan.sps, plan.tiles_per_split, plan.start, plan.vocab,
        HAS_ND=num_draft_tokens is not None, FULL_Q=False, FUSE_RACE=True, BLOCK_V=plan.block_v, VEC=vec,
        PRUNE=cfg.prune, FAST=_on_gpu(dev), PDL=pdl, XSUM=True, FILTER=False, SHARDED=True,
        num_warps=WARPS, enable_fp_fusion=False, **pdl_launch(bool(pdl)),
    )
    return send


def finish(gathered: torch.Tensor, drafts: torch.Tensor, temperature: torch.Tensor, seed: torch.Tensor,
           position: torch.Tensor, num_draft_tokens: torch.Tensor | None, acceptance_counts: torch.Tensor | None,
           out: tuple[torch.Tensor, torch.Tensor, torch.Tensor], plan: VocabPlan, use_triton: bool) -> None:
    """gathered [W, _NPLANES, B*(K+1), sps] int32 -> out (token_ids, num_emitted, logprobs), counts."""
    b, k = drafts.shape
    r = k + 1
    tok, nemit, lp = out
    if not use_triton:
        planes = assemble_reference(gathered, plan.splits)
        kb = drafts_per_request(num_draft_tokens, b, k, planes.device)
        t, n, p = walk_reference(planes, drafts, temperature, seed, position, kb, plan.vocab, plan.spc,
                                 acceptance_counts)
        tok.copy_(t)
        nemit.copy_(n)
        lp.copy_(p)
        return
    cfg = plan.config
    planes = assemble_triton(gathered, plan.splits)
    fstat = planes[:_NUM_FPLANES].view(torch.float32)
    istat = planes[_NUM_FPLANES:]
    dev = planes.device
    race_block_v = min(cfg.race_block_v, plan.chunk)
    vec = min(8, plan.block_v, race_block_v)  # the walk loads no logits with FUSE_RACE
    ids, ids_strides, nd, counts = draft_args(drafts, seed, num_draft_tokens, acceptance_counts)
    race_i = torch.empty((b, 3), dtype=torch.int32, device=dev)  # full q only: never written here
    nc_pow2 = triton.next_power_of_2(-(-plan.splits // plan.spc))
    _walk_kernel[(b,)](
        fstat, ids, temperature, seed, position, nd, fstat, istat, tok, nemit, lp, counts,
        race_i, fstat, fstat, 0, 0, *ids_strides, r, plan.vocab, plan.splits,
        HAS_ND=num_draft_tokens is not None, HAS_COUNTS=acceptance_counts is not None, FULL_Q=False,
        FUSE_RACE=True, R_POW2=triton.next_power_of_2(r), SPLITS_POW2=nc_pow2 * plan.spc, CHUNK=plan.chunk,
        SPC=plan.spc, NC_POW2=nc_pow2, RACE_BLOCK_V=race_block_v, VEC=vec, PRUNE=cfg.prune,
        FAST=_on_gpu(dev), PDL=0, FILTER=False, num_warps=walk_warps(False, cfg.prune, r, plan.splits),
        enable_fp_fusion=False,
    )


def rejection_sample_vocab_parallel(target_logits, draft_token_ids, temperature, seed, position, *, group,
                                    vocab_size: int, draft_logits=None, num_draft_tokens=None, acceptance_counts=None,
                                    out=None, top_k=None, top_p=None, min_p=None, config: LaunchConfig | None = None,
                                    impl: str | None = None, race_chunk: int | None = None) -> RejectionOutput:
    """rejection_sample on this rank's shard: target_logits [B, K+1, end - start] (vocab_shard's
    [start, end) of vocab_size; draft_logits [B, K, end - start] likewise); every other argument is
    replicated, identical on every rank. Returns the same RejectionOutput on every rank: the
    single-process sampler's on the full logits with race_chunk = vocab_race_chunk(V, W). Greedy
    and one-hot rows exchange per-row statistics only; with draft_logits (full q) or a filter
    (top_k / top_p / min_p) every rank gathers the full logits (2 bytes x V per row in bf16) and
    runs the single-process sampler on them. config: the row pass's launch (fuse_race is forced
    on); impl: None (Triton on CUDA, PyTorch elsewhere), "triton" or "reference"; race_chunk: tests
    only (vocab_plan)."""
    vocab_size, world, rank = _group_layout(group, vocab_size)
    if not isinstance(target_logits, torch.Tensor) or target_logits.dim() != 3:
        raise ValueError("target_logits must be this rank's shard [B, K+1, V_local]")
    b, r, vl = target_logits.shape
    k = r - 1
    dev = target_logits.device
    use_triton = _use_triton(dev, impl)
    plan = vocab_plan(b, k, vocab_size, world, rank, config=config, use_triton=use_triton, race_chunk=race_chunk)
    if vl != plan.end - plan.start:
        raise ValueError(f"target_logits must be this rank's shard [B, K+1, {plan.end - plan.start}] (vocab "
                         f"[{plan.start}, {plan.end}) of {vocab_size}, rank {rank} of {world}), got "
                         f"{tuple(target_logits.shape)}")
    if draft_logits is not None or top_k is not None or top_p is not None or min_p is not None:
        return _sample_gathered(target_logits, draft_token_ids, temperature, seed, position, draft_logits,
                                num_draft_tokens, acceptance_counts, out, top_k, top_p, min_p, group, plan,
                                use_triton, config)
    # An empty shard is checked through a one-entry stand-in (the checks need V >= 1).
    _validate(target_logits if vl > 0 else target_logits.new_empty((b, r, 1)), draft_token_ids, temperature,
              seed, position, None, num_draft_tokens, acceptance_counts, out)
    out = out if out is not None else new_outputs(b, r, dev)
    send = shard_stats(target_logits, draft_token_ids, temperature, seed, position, num_draft_tokens, plan,
                       use_triton)
    finish(_all_gather(send, group, world), draft_token_ids, temperature, seed, position, num_draft_tokens,
           acceptance_counts, out, plan, use_triton)
    return RejectionOutput(*out)


def _gather_vocab(shard: torch.Tensor, group, plan: VocabPlan) -> torch.Tensor:
    """This rank's [B, R, end - start] -> the full [B, R, V] on every rank: one all_gather of the
    shards, each padded to the full shard width (shards lie in rank order). The result is a view
    with the vocab dim contiguous, which is all the samplers ask."""
    b, r, vl = shard.shape
    send = shard.new_zeros((b, r, plan.shard))
    send[..., :vl] = shard
    full = _all_gather(send, group, plan.world)  # [W, B, R, shard]
    return full.permute(1, 2, 0, 3).reshape(b, r, plan.world * plan.shard)[..., :plan.vocab]


def _sample_gathered(target_logits, draft_token_ids, temperature, seed, position, draft_logits, num_draft_tokens,
                     acceptance_counts, out, top_k, top_p, min_p, group, plan, use_triton, config) -> RejectionOutput:
    """Full q and the filters under a process group: the single-process sampler on the gathered
    logits (target and draft rows in one collective where their dtypes agree), the same on every rank (it is
    deterministic), with the shards' race chunk."""
    r = target_logits.shape[1]
    if draft_logits is not None:
        if not isinstance(draft_logits, torch.Tensor) or draft_logits.dim() != 3 \
                or draft_logits.shape[-1] != plan.end - plan.start:
            raise ValueError(f"draft_logits must be this rank's shard [B, K, {plan.end - plan.start}] (vocab "
                             f"[{plan.start}, {plan.end}) of {plan.vocab})")
        if draft_logits.dtype == target_logits.dtype:
            full = _gather_vocab(torch.cat([target_logits, draft_logits], dim=1), group, plan)
            target, q = full[:, :r], full[:, r:]
        else:  # no rounding of either to the other's dtype
            target, q = _gather_vocab(target_logits, group, plan), _gather_vocab(draft_logits, group, plan)
    else:
        target, q = _gather_vocab(target_logits, group, plan), None
    kw = dict(draft_logits=q, num_draft_tokens=num_draft_tokens, acceptance_counts=acceptance_counts, out=out,
              top_k=top_k, top_p=top_p, min_p=min_p, race_chunk=plan.chunk)
    if use_triton:
        return rejection_sample_triton(target, draft_token_ids, temperature, seed, position, config=config, **kw)
    return rejection_sample_reference(target, draft_token_ids, temperature, seed, position, **kw)
