"""Fused speculative rejection sampler: accept a prefix of the drafts, emit one correction/bonus token.

The entry points and the Triton path's launch; the rules and their PyTorch reference are in
kernels/rejection_reference.py. The Triton path is two launches, the row pass and the walk
(kernels/rejection_kernels.py), four in full q (kernels/rejection_fullq.py), chained by PDL; with
top_k / top_p / min_p the filters' kernels (kernels/rejection_filter.py) find each row's threshold
before them, and in one-hot mode draw the rows their candidates hold (LaunchConfig.filter_draw).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
from graphrt.kernels.pdl import pdl_enabled, pdl_launch
from graphrt.kernels.rejection_filter import FILTER_CAP, Draws, thresholds_triton
from graphrt.kernels.rejection_fullq import race_and_finish
from graphrt.kernels.rejection_kernels import (
    _NUM_FPLANES,
    WARPS,
    _chunk_splits,
    _row_stats_kernel,
    _splits,
    _walk_kernel,
)
from graphrt.kernels.rejection_reference import (
    RACE_CHUNK,
    RejectionOutput,
    _check_race_chunk,
    _validate,
    rejection_sample_reference,
)

__all__ = ["LaunchConfig", "RACE_CHUNK", "RejectionOutput", "launch_config", "rejection_sample",
           "rejection_sample_reference", "rejection_sample_triton"]


@dataclass(frozen=True)
class LaunchConfig:
    """How one call is launched; never what it draws (every config gives the same tokens).

    block_v: the row pass's tile (vocab entries); num_splits: splits per row (and full q's race
    pass splits) instead of ~PROGRAMS programs in all. fuse_race (one-hot only): the row pass also
    races every split, draft excluded, so the walk reads no logits. race_block_v: the tile of the
    one-hot walk's race over a chunk (cut to the chunk) or of full q's race pass. prune: skip the
    one-hot race's tiles that cannot win (_race_tile), wherever it runs. pdl: programmatic
    dependent launch (kernels/pdl.py): 0 off, 1 dependents released at the start, 2 released only
    after the row pass's and the race pass's hot loops; off where pdl_enabled is not.
    The filters' kernels (kernels/rejection_filter.py), launched only when the call passes filters:
    filter_block_v the weighing's and whole-row search's tile, filter_cand_block_v and filter_cand_warps the
    threshold kernel's tile over the group maxima and the candidates and its warps (None: FILTER_WARPS),
    filter_kept_block_v its tile over what the filters keep of the candidates; filter_cap their
    candidates per row (past it a row's threshold search reads the whole row; 0: every row's does).
    filter_draw (one-hot): a sampled row whose threshold the candidates held is drawn by the
    threshold kernel from them (its lse, argmax, draft's logit and two-level race), and the row
    pass skips it; off: every row is read whole again after its threshold.
    """

    block_v: int = 1024
    num_splits: int | None = None
    fuse_race: bool = False
    race_block_v: int = 1024
    prune: bool = False
    pdl: int = 0
    filter_block_v: int = 1024
    filter_cand_block_v: int = 1024
    filter_cand_warps: int | None = None
    filter_kept_block_v: int = 256
    filter_cap: int = FILTER_CAP
    filter_draw: bool = True


def launch_config(batch: int, k: int, full_q: bool) -> LaunchConfig:
    """The default launch by batch size and rows (B*(K+1)), from scripts/rejection_sweep.py and
    scripts/filter_launch_sweep.py at K = 3, V = 128256 bf16 on the H100 and the H200 (figures in
    docs/notes/benchmarks-history.md).

    - The row pass races too (fuse_race) only up to 8 rows: it costs two logs per entry of every
      row, against one chunk per request in the walk.
    - 1024-entry row tiles; full q past 8 rows keeps 2048 (the sweeps that favoured 1024 were of
      greedy and one-hot).
    - The walk's chunk race: below B = 128 each request's program is alone with its latency, so the
      whole chunk is one unpruned tile on 16 warps (the prune test is a block-wide reduction and a
      branch per tile); from B = 128 programs share SMs and pruned 2048-entry tiles on 8 warps do
      less work. The fused race has one tile per split: pruning there only costs.
    - PDL releases dependents at the start from 9 to 128 rows, late otherwise: late was faster at
      B = 1 and at large B, where an early launch of the next kernel holds SM slots the row pass
      still needs.
    - The filters' whole-row search on 4096-entry tiles up to 8 rows, 2048 beyond; the threshold
      kernel's pass over the maxima and the candidates (at most filter_cap entries, usually a few
      hundred) on 1024-entry tiles: with the whole-row tile it spent its time on masked lanes.
    - The threshold kernel draws the filtered rows from what their filters keep (filter_draw) from 8
      rows (B = 2 at K = 3), where the row pass it spares costs more than the draw; at B = 1 the
      row pass spread over many programs is faster.
    - From 512 rows the threshold kernel runs 2 warps on 256-entry tiles (128 over what the filters
      keep): its programs then share SMs, and a small program per row beat a wide one; at 256 rows
      and below the 8-warp program's latency wins.
    """
    rows = batch * (k + 1)
    few, many, prune = rows <= 8, rows >= 512, batch >= 128
    return LaunchConfig(
        block_v=2048 if full_q and not few else 1024,
        fuse_race=few and not full_q,
        race_block_v=1024 if full_q else 2048 if prune else RACE_CHUNK,
        prune=prune,
        pdl=1 if 8 < rows <= 128 else 2,
        filter_block_v=4096 if few else 2048,
        filter_cand_block_v=256 if many else 1024,
        filter_cand_warps=2 if many else None,
        filter_kept_block_v=128 if many else 256,
        filter_draw=rows >= 8,
    )


def walk_warps(chunk_race: bool, prune: bool, r: int, splits: int) -> int:
    """The walk's warps: 16 for the one-hot chunk race in the walk (8 when pruned, launch_config),
    else 1 or 4 by the number of split stats it merges."""
    if chunk_race:
        return 8 if prune else 16
    return 1 if r * splits <= 256 else 4


def new_outputs(b: int, r: int, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Empty (token_ids [B, K+1] int64, num_emitted [B] int32, logprobs [B, K+1] fp32)."""
    return (torch.empty((b, r), dtype=torch.int64, device=dev), torch.empty((b,), dtype=torch.int32, device=dev),
            torch.empty((b, r), dtype=torch.float32, device=dev))


def draft_args(draft_token_ids, seed, num_draft_tokens, acceptance_counts) -> tuple:
    """The kernels' (draft ids, their strides, num_draft_tokens, acceptance_counts), seed standing
    in for what is absent (a valid pointer; a K = 0 tensor may carry no storage)."""
    if draft_token_ids.shape[1] > 0:
        ids, strides = draft_token_ids, (draft_token_ids.stride(0), draft_token_ids.stride(1))
    else:
        ids, strides = seed, (0, 0)
    return (ids, strides, num_draft_tokens if num_draft_tokens is not None else seed,
            acceptance_counts if acceptance_counts is not None else seed)


def filter_stage(target_logits, ids, temperature, seed, position, num_draft_tokens, top_k, top_p, min_p,
                 cfg: LaunchConfig, full_q: bool, chunk: int, **launch) -> tuple[torch.Tensor | None, Draws | None]:
    """The filters' kernels as the sampler launches them -> (tau or None without filters, the rows
    drawn from their candidates or None: one-hot with filter_draw only). ids: the draft ids, any [B]
    tensor at K = 0; chunk: the race chunk; launch: more of thresholds_triton's keywords
    (scripts/filter_kernel_times.py times other tiles and warps)."""
    if top_k is None and top_p is None and min_p is None:
        return None, None
    b, r, _ = target_logits.shape
    dev = target_logits.device
    draws = None
    if cfg.filter_draw and not full_q:
        draws = Draws(ids, num_draft_tokens, seed, position, chunk,
                      torch.empty((3, b * r), dtype=torch.int32, device=dev),
                      torch.empty((4, b * r), dtype=torch.float32, device=dev))
    launch = {"block_v": cfg.filter_block_v, "cand_block_v": cfg.filter_cand_block_v,
              "cand_warps": cfg.filter_cand_warps, "kept_block_v": cfg.filter_kept_block_v, "cap": cfg.filter_cap,
              "pdl": cfg.pdl if pdl_enabled(dev) else 0, **launch}
    return thresholds_triton(target_logits, temperature, top_k, top_p, min_p, **launch, draws=draws), draws


def _on_gpu(dev: torch.device) -> bool:
    """A real CUDA launch (not the interpreter): inline PTX is available."""
    return dev.type == "cuda" and os.environ.get("TRITON_INTERPRET") != "1"


def _vocab_parallel(target_logits, draft_token_ids, temperature, seed, position, draft_logits, num_draft_tokens,
                    acceptance_counts, out, top_k, top_p, min_p, group, vocab_size, impl=None, config=None):
    from graphrt.kernels.vocab_parallel import rejection_sample_vocab_parallel

    return rejection_sample_vocab_parallel(
        target_logits, draft_token_ids, temperature, seed, position, group=group, vocab_size=vocab_size,
        draft_logits=draft_logits, num_draft_tokens=num_draft_tokens, acceptance_counts=acceptance_counts, out=out,
        top_k=top_k, top_p=top_p, min_p=min_p, config=config, impl=impl)


def _check_no_group(vocab_size, target_logits) -> None:
    if vocab_size is not None and isinstance(target_logits, torch.Tensor) and target_logits.dim() == 3 \
            and vocab_size != target_logits.shape[2]:
        raise ValueError(f"vocab_size {vocab_size} != target_logits' last dim {target_logits.shape[2]} "
                         "(no process group)")


def rejection_sample_triton(target_logits, draft_token_ids, temperature, seed, position, *, draft_logits=None,
                            num_draft_tokens=None, acceptance_counts=None, out=None, top_k=None, top_p=None,
                            min_p=None, config: LaunchConfig | None = None, race_chunk: int | None = None,
                            group=None, vocab_size: int | None = None) -> RejectionOutput:
    """Triton rejection sampler; same arguments and results as `rejection_sample`.

    Capturable in a CUDA graph: no host sync, no value-dependent Python branch. The workspaces
    (stat planes [_NUM_FPLANES, B*(K+1), splits] fp32 + [2, B*(K+1), splits] int32, race state
    [B, 3] int32 + [B, 3] fp32 (written in full q only), full q's race partials [2, B, race splits]
    fp32 / int32 / fp32) come from torch's caching allocator; under capture they live in the
    graph's private pool and stay fixed for every replay. Every workspace slot a later kernel reads
    is written by an earlier one in the same call, so nothing needs zeroing.
    config: the launch (launch_config(B, K, full q) by default; tests force every path with it,
    scripts/rejection_sweep.py times variants). race_chunk: the two-level race's chunk (a power of
    two, RACE_CHUNK by default); it changes which tokens a seed draws, so the reference must get
    the same. group / vocab_size: vocab parallel, as in `rejection_sample` (config: the row pass's
    launch there; race_chunk is then vocab_race_chunk(V, W)).
    """
    if group is not None:
        return _vocab_parallel(target_logits, draft_token_ids, temperature, seed, position, draft_logits,
                               num_draft_tokens, acceptance_counts, out, top_k, top_p, min_p, group, vocab_size,
                               impl="triton", config=config)
    _check_no_group(vocab_size, target_logits)
    _validate(target_logits, draft_token_ids, temperature, seed, position, draft_logits,
              num_draft_tokens, acceptance_counts, out, top_k, top_p, min_p)
    b, r, v = target_logits.shape
    k = r - 1
    dev = target_logits.device
    full_q = draft_logits is not None and k > 0
    rows = b * r
    cfg = config if config is not None else launch_config(b, k, full_q)
    fuse_race = cfg.fuse_race and not full_q  # the residual needs lse first
    chunk = _check_race_chunk(race_chunk, v)
    block_v, race_block_v = cfg.block_v, cfg.race_block_v
    if not full_q:  # tiles and the walk's race tiles both lie inside one chunk
        block_v, race_block_v = min(block_v, chunk), min(race_block_v, chunk)
    vec = min(4 if target_logits.dtype == torch.float32 else 8, block_v, race_block_v)  # 16-byte loads
    pdl = cfg.pdl if pdl_enabled(dev) else 0
    launch = pdl_launch(bool(pdl))
    if full_q:
        splits, tiles_per_split = _splits(rows, v, block_v, cfg.num_splits)
        spc = 1
    else:
        splits, tiles_per_split, spc = _chunk_splits(rows, v, block_v, chunk, cfg.num_splits)
    nc_pow2 = triton.next_power_of_2(triton.cdiv(splits, spc))
    # One-hot: the walk views a row's splits as [chunks, SPC] (a power of two >= splits).
    splits_pow2 = triton.next_power_of_2(splits) if full_q else nc_pow2 * spc
    tok, nemit, lp = out if out is not None else new_outputs(b, r, dev)
    fstat = torch.empty((_NUM_FPLANES, rows, splits), dtype=torch.float32, device=dev)
    istat = torch.empty((2, rows, splits), dtype=torch.int32, device=dev)
    race_i = torch.empty((b, 3), dtype=torch.int32, device=dev)
    race_f = torch.empty((b, 3), dtype=torch.float32, device=dev)
    q = draft_logits if full_q else target_logits  # a valid pointer when unused
    ids, ids_strides, nd, counts = draft_args(draft_token_ids, seed, num_draft_tokens, acceptance_counts)
    tau, draws = filter_stage(target_logits, ids, temperature, seed, position, num_draft_tokens, top_k, top_p,
                              min_p, cfg, full_q, chunk)
    common = dict(HAS_ND=num_draft_tokens is not None, FULL_Q=full_q, VEC=vec, FAST=_on_gpu(dev), PDL=pdl,
                  FILTER=tau is not None)
    if draws is not None:
        common.update(DRAWN=True, dstat_i_ptr=draws.stats_i)
    tau_arg = tau if tau is not None else race_f  # a valid pointer when unused
    # No FMA contraction: x * inv_t + g must round like the reference's two torch ops, or race
    # keys drift by an ulp and near-ties could pick different tokens.
    _row_stats_kernel[(rows, splits)](
        target_logits, q, ids, temperature, seed, position, nd, fstat, istat, tau_arg,
        target_logits.stride(0), target_logits.stride(1), q.stride(0), q.stride(1), *ids_strides,
        r, v, splits, tiles_per_split, 0, v,
        FUSE_RACE=fuse_race, BLOCK_V=block_v, XSUM=not full_q, PRUNE=cfg.prune and fuse_race,
        num_warps=WARPS, enable_fp_fusion=False, **common, **launch,
    )
    _walk_kernel[(b,)](
        target_logits, ids, temperature, seed, position, nd, fstat, istat, tok, nemit, lp, counts,
        race_i, race_f, tau_arg, target_logits.stride(0), target_logits.stride(1), *ids_strides,
        r, v, splits,
        HAS_COUNTS=acceptance_counts is not None, FUSE_RACE=fuse_race,
        R_POW2=triton.next_power_of_2(r), SPLITS_POW2=splits_pow2, CHUNK=chunk, SPC=spc, NC_POW2=nc_pow2,
        RACE_BLOCK_V=race_block_v, PRUNE=cfg.prune, enable_fp_fusion=False,
        num_warps=walk_warps(not (full_q or fuse_race), cfg.prune, r, splits),
        **common, **({} if draws is None else dict(dstat_f_ptr=draws.stats_f)), **launch,
    )
    if full_q:
        race_and_finish(target_logits, q, temperature, seed, position, race_i, race_f, tok, lp, tau,
                        block_v=race_block_v, vec=vec, num_splits=cfg.num_splits, pdl=pdl)
    return RejectionOutput(tok, nemit, lp)


def rejection_sample(
    target_logits: torch.Tensor,
    draft_token_ids: torch.Tensor,
    temperature: torch.Tensor,
    seed: torch.Tensor,
    position: torch.Tensor,
    *,
    draft_logits: torch.Tensor | None = None,
    num_draft_tokens: torch.Tensor | None = None,
    acceptance_counts: torch.Tensor | None = None,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
    group=None,
    vocab_size: int | None = None,
) -> RejectionOutput:
    """Speculative rejection sampling (rules in kernels/rejection_reference.py).

    target_logits [B, K+1, V] bf16/fp16/fp32 (K >= 0; K = 0 samples one token from row 0),
    draft_token_ids [B, K] integer, temperature [B] fp32 (0 = greedy), seed [B] int64,
    position [B] int64 (absolute position of the token row 0 predicts), draft_logits [B, K, V]
    (full-q mode), num_draft_tokens [B] int32/int64 (ragged k_b <= K), acceptance_counts [K] int64
    (accumulated in place: += number of requests whose draft j was accepted), out = preallocated
    (token_ids, num_emitted, logprobs), top_k [B] int32/int64 (0: off), top_p [B] fp32 (1: off),
    min_p [B] fp32 (0: off): per request, applied to sampled rows after the temperature, in that
    order (a value threshold per row; ties at it are all kept). None: off for every request.
    Returns RejectionOutput(token_ids [B, K+1] int64 (-1 after the last emitted),
    num_emitted [B] int32, logprobs [B, K+1] fp32 (0.0 after the last emitted)).

    Value checks (temperature >= 0, 0 <= num_draft_tokens <= K, top_k >= 0, 0 < top_p <= 1,
    0 <= min_p < 1) run only on CPU tensors outside
    graph capture: checking a CUDA tensor's values would sync the host. On the GPU a negative or
    NaN temperature is greedy and num_draft_tokens is clamped to [0, K].
    CUDA tensors run the Triton kernels, anything else the PyTorch reference.

    group (a torch.distributed process group) with vocab_size (the full V): vocab parallel
    (kernels/vocab_parallel.py). target_logits is then this rank's shard [B, K+1, end - start] of
    vocab_shard(vocab_size, W, rank), every other argument replicated; every rank returns the
    single-process result on the full logits with race_chunk = vocab_race_chunk(V, W), through one
    all_gather of per-row statistics; with draft_logits (sharded like target_logits) or a filter,
    through one all_gather of the logits and the single-process sampler.
    """
    if group is not None:
        return _vocab_parallel(target_logits, draft_token_ids, temperature, seed, position, draft_logits,
                               num_draft_tokens, acceptance_counts, out, top_k, top_p, min_p, group, vocab_size)
    _check_no_group(vocab_size, target_logits)
    fn = rejection_sample_triton if target_logits.is_cuda else rejection_sample_reference
    return fn(target_logits, draft_token_ids, temperature, seed, position, draft_logits=draft_logits,
              num_draft_tokens=num_draft_tokens, acceptance_counts=acceptance_counts, out=out,
              top_k=top_k, top_p=top_p, min_p=min_p)
