"""Compile the decode path's Triton kernels for sm_90 without a GPU (Triton's own ptxas), so CI
catches what the interpreter cannot: frontend and lowering errors that only show when a kernel is
compiled (a second `return` after a taken constexpr branch, say). Launch configurations are the
ones the launchers pick for llama-1b-shape decode; griddepcontrol (PDL) must reach the PTX exactly
when USE_PDL is set. Runs in a subprocess: this test session has TRITON_INTERPRET=1 on a CPU
machine (tests/conftest.py)."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

_GEMV = dict(x_ptr="*bf16", w_ptr="*bf16", scale_ptr="*fp32", bias_ptr="*bf16", y_ptr="*bf16", ws_ptr="*fp32",
             ctr_ptr="*i32", eps="fp32")
_FP8 = dict(w_ptr="*fp8e4nv", scale_ptr="*fp32")  # an FP8 draft's weights (kernels/fp8_weight.py)
_ARGMAX = dict(logits_ptr="*bf16", part_val_ptr="*fp32", part_idx_ptr="*i32", out_val_ptr="*bf16",
               out_idx_ptr="*i64", ctr_ptr="*i32")
_ROTARY = dict(pos_ptr="*i64", slot_ptr="*i64", cos_ptr="*fp32", sin_ptr="*fp32", q_norm_ptr="*fp32",
               k_norm_ptr="*fp32", eps="fp32")
_ATTN = dict(block_tables_ptr="*i32", seq_lens_ptr="*i32", ws_out_ptr="*fp32", ws_lse_ptr="*fp32",
             scale_log2="fp32")
_REJ = dict(logits_ptr="*bf16", qlogits_ptr="*bf16", draft_ptr="*i64", temp_ptr="*fp32", seed_ptr="*i64",
            pos_ptr="*i64", nd_ptr="*i32", fstat_ptr="*fp32", istat_ptr="*i32", tok_ptr="*i64", nemit_ptr="*i32",
            lp_ptr="*fp32", counts_ptr="*i64", race_i_ptr="*i32", race_f_ptr="*fp32", ctr_ptr="*i32",
            part_k_ptr="*fp32", part_i_ptr="*i32", part_x_ptr="*fp32")
_FILTER = dict(_REJ, topk_ptr="*i64", topp_ptr="*fp32", minp_ptr="*fp32", tau_ptr="*fp32", kmax_ptr="*i32",
               mass_ptr="*i64", hist_ptr="*i32", cand_ptr="*fp32", ids_ptr="*i32", kept_ptr="*fp32", kvid_ptr="*i32",
               need_ptr="*i32", flag_ptr="*i32", dstat_i_ptr="*i32",
               dstat_f_ptr="*fp32")
_SPREAD = dict(_FILTER, part_ptr="*i64", state_ptr="*i32", above_ptr="*i64", mins_ptr="*i32", ctr_ptr="*i32",
               wcnt_ptr="*i32")
_CYCLE = dict(slots_ptr="*i64", src_ptr="*i64", tables_ptr="*i32", last_ptr="*i64", drafts_ptr="*i64",
              temp_ptr="*fp32", seed_ptr="*i64", n_ptr="*i64", pos_ptr="*i64", tab_ptr="*i32", seqlen_ptr="*i32",
              smap_ptr="*i64", tok_ptr="*i64", temp_out_ptr="*fp32", seed_out_ptr="*i64", emit_ptr="*i64",
              nemit_ptr="*i32", last_out_ptr="*i64", last_len_ptr="*i32", base_add="i64")
_PUSH = dict(tab_ptr="*i64", seq_ptr="*i32")
_NO_FUSION = dict(num_warps=4, enable_fp_fusion=False)  # as the sampler's launcher compiles them
_PAGED = dict(NUM_KV_HEADS=8, NUM_Q_HEADS=32, GROUP=4, HEAD_DIM=64, BLOCK_D=64, PAGE=16, BLOCK_N=128,
              DOT_PRECISION="tf32", UPCAST_DOT=False)


def _gemv_fma(_stages=1, **constexprs):
    """A gemv launch: the one-row FMA path's M = 1 configuration with PDL, changed by constexprs."""
    return ("gemv", "_gemv_kernel", _GEMV, dict(
        BLOCK_M=1, BLOCK_N=2, BLOCK_K=2048, USE_DOT=False, REDUCE_EACH=True, HAS_BIAS=False, SPLIT=False,
        FUSED=False, RED_M=1, DOT_PRECISION="tf32", USE_PDL=True) | constexprs, dict(num_warps=4, num_stages=_stages))


def _gemv_dot(_stages=4, **constexprs):
    """A gemv launch on the DOT path (16 rows, padded), changed by constexprs."""
    return _gemv_fma(_stages, **(dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, USE_DOT=True, REDUCE_EACH=False, RED_M=16,
                                      PAD_M=True) | constexprs))


# name: (module, kernel, pointer/scalar types that differ from bf16 pointers / i32 scalars, constexprs,
#        compile options)
CASES = {
    "gemv-fma-m1-pdl": _gemv_fma(),
    # FP8 weights: the one-row launches of an FP8 draft step (gate_up with the norm prologue, qkv
    # with the rotary)
    "gemv-fma-m1-fp8-gated-norm-pdl": ("gemv", "_gemv_kernel", _GEMV | _FP8, _gemv_fma()[3] | dict(
        BLOCK_N=8, BLOCK_K=1024, REDUCE_EACH=False, GATED=True, NORM=True, NORM_RES=True, BLOCK_H=4096,
        HAS_SCALE=True), dict(num_warps=4, num_stages=1)),
    # a draft step's LM head with the argmax in its epilogue (kernels/draft_head.py)
    "gemv-fma-m1-fp8-norm-argmax-pdl": ("gemv", "_gemv_kernel", _GEMV | _FP8 | dict(
        y_ptr="*i64"), _gemv_fma()[3] | dict(
        BLOCK_N=8, BLOCK_K=1024, REDUCE_EACH=False, NORM=True, BLOCK_H=2048, HAS_SCALE=True, ARGMAX=True),
        dict(num_warps=4, num_stages=1)),
    # ... and with a one-layer EAGLE-3 head's residual add in that prologue (kernels/residual_add.PendingAdd)
    "gemv-fma-m1-norm-res-argmax-pdl": ("gemv", "_gemv_kernel", _GEMV | dict(y_ptr="*i64"), _gemv_fma()[3] | dict(
        BLOCK_N=8, BLOCK_K=256, REDUCE_EACH=False, NORM=True, NORM_RES=True, BLOCK_H=2048, ARGMAX=True),
        dict(num_warps=1, num_stages=1)),
    # a one-layer EAGLE-3 head's down projection with the residual add in its epilogue (gemv_triton(add=))
    "gemv-fma-m1-add-pdl": _gemv_fma(HAS_ADD=True),
    "qkv-rotary-m1-fp8-pdl": ("qkv_rotary", "_qkv_rotary_kernel", _ROTARY | _FP8,
                              dict(NUM_Q_HEADS=32, NUM_KV_HEADS=8, HEAD_DIM=128, PAGE=16, BLOCK_N=4, BLOCK_K=2048,
                                   REDUCE_EACH=False, HAS_BIAS=False, USE_PDL=True, HAS_SCALE=True),
                              dict(num_warps=4, num_stages=1)),
    "gemv-fma-m1-gated-pdl": _gemv_fma(GATED=True),
    # the RMSNorm prologue (kernels/norm.PendingNorm): PDL with one K tile, no PDL with several
    "gemv-fma-m1-gated-norm-pdl": _gemv_fma(GATED=True, NORM=True, NORM_RES=True, BLOCK_H=2048),
    "gemv-fma-m1-norm-tiles": _gemv_fma(BLOCK_N=4, BLOCK_K=512, REDUCE_EACH=False, USE_PDL=False, NORM=True,
                                        NORM_RES=False, BLOCK_H=2048),
    "qkv-rotary-m1-norm-pdl": ("qkv_rotary", "_qkv_rotary_kernel", dict(_ROTARY, pos_ptr="*i64", slot_ptr="*i64"), dict(
        NUM_Q_HEADS=32, NUM_KV_HEADS=8, HEAD_DIM=64, PAGE=16, BLOCK_N=2, BLOCK_K=2048, REDUCE_EACH=True,
        HAS_BIAS=False, USE_PDL=True, NORM=True, NORM_RES=True, BLOCK_H=2048), dict(num_warps=4, num_stages=1)),
    "qkv-rotary-m1-pdl": ("qkv_rotary", "_qkv_rotary_kernel", dict(_ROTARY, pos_ptr="*i64", slot_ptr="*i64"), dict(
        NUM_Q_HEADS=32, NUM_KV_HEADS=8, HEAD_DIM=64, PAGE=16, BLOCK_N=2, BLOCK_K=2048, REDUCE_EACH=True,
        HAS_BIAS=False, USE_PDL=True), dict(num_warps=4, num_stages=1)),
    "qkv-rotary-dot-pdl": ("qkv_rotary", "_qkv_rotary_dot_kernel", dict(_ROTARY, pos_ptr="*i64", slot_ptr="*i64"),
                           dict(NUM_Q_HEADS=32, NUM_KV_HEADS=8, HEAD_DIM=64, PAGE=16, BLOCK_N=32, BLOCK_K=256,
                                BLOCK_M=16, PAD_M=True, HAS_BIAS=False, USE_PDL=True), dict(num_warps=4, num_stages=4)),
    # ... at 17-64 tokens: a full 64-row tile
    "qkv-rotary-dot-full": ("qkv_rotary", "_qkv_rotary_dot_kernel", dict(_ROTARY, pos_ptr="*i64", slot_ptr="*i64"),
                            dict(NUM_Q_HEADS=32, NUM_KV_HEADS=8, HEAD_DIM=64, PAGE=16, BLOCK_N=32, BLOCK_K=128,
                                 BLOCK_M=64, PAD_M=False, HAS_BIAS=False, USE_PDL=True),
                            dict(num_warps=4, num_stages=4)),
    # ... past 64 tokens: 64-token tiles over the grid's second dimension, the last one ragged
    "qkv-rotary-dot-tiles": ("qkv_rotary", "_qkv_rotary_dot_kernel", dict(_ROTARY, pos_ptr="*i64", slot_ptr="*i64"),
                             dict(NUM_Q_HEADS=9, NUM_KV_HEADS=3, HEAD_DIM=64, PAGE=16, BLOCK_N=32, BLOCK_K=64,
                                  BLOCK_M=64, PAD_M=True, HAS_BIAS=False, USE_PDL=True, TILE_M=True),
                             dict(num_warps=4, num_stages=5)),
    # one M = 1 program per row of a verify step (PER_ROW), with the norm prologue and the gated epilogue
    "gemv-fma-rows-gated-norm-pdl": _gemv_fma(GATED=True, NORM=True, NORM_RES=True, BLOCK_H=2048, PER_ROW=True),
    # the same at a latency-bound gate_up's tiles (gemv_config._SMALL_WIDE: K = 576 past one 512 tile)
    "gemv-fma-rows-gated-norm-small": ("gemv", "_gemv_kernel", _GEMV, _gemv_fma()[3] | dict(
        BLOCK_N=4, BLOCK_K=512, REDUCE_EACH=False, GATED=True, NORM=True, NORM_RES=True, BLOCK_H=1024, PER_ROW=True),
        dict(num_warps=1, num_stages=1)),
    # tensor parallelism at one token: the row-parallel GEMV sums its result over the ranks in its
    # epilogue (kernels/push_reduce.py)
    "gemv-fma-m1-push-pdl": ("gemv", "_gemv_kernel", _GEMV | _PUSH, _gemv_fma()[3] | dict(PUSH_W=2),
                             dict(num_warps=4, num_stages=1)),
    # ... and of two rows on the FMA path (both in each program)
    "gemv-fma-m2-push-pdl": ("gemv", "_gemv_kernel", _GEMV | _PUSH, _gemv_fma()[3] | dict(
        BLOCK_M=2, BLOCK_N=4, BLOCK_K=1024, REDUCE_EACH=False, RED_M=2, PUSH_W=2), dict(num_warps=4, num_stages=1)),
    # ... and of 3-16 rows on the DOT path: unsplit, and in the last split's reduction of a tile
    "gemv-dot-push-pdl": ("gemv", "_gemv_kernel", _GEMV | _PUSH, _gemv_dot()[3] | dict(PUSH_W=2),
                          dict(num_warps=4, num_stages=4)),
    "gemv-dot-split-push-pdl": ("gemv", "_gemv_kernel", _GEMV | _PUSH,
                                _gemv_dot()[3] | dict(BLOCK_K=256, SPLIT=True, FUSED=True, PUSH_W=2),
                                dict(num_warps=4, num_stages=4)),
    # ... and the vocab-parallel embedding lookup of one token, launched without PDL
    "embedding-push": ("push_reduce", "_embedding_push_kernel", dict(_PUSH, tok_ptr="*i64", vocab_start="i64"),
                       dict(BLOCK_N=8, W=2), dict(num_warps=4)),
    "gemv-fma-m2-split": _gemv_fma(BLOCK_M=2, BLOCK_N=4, BLOCK_K=1024, REDUCE_EACH=False, HAS_BIAS=True, SPLIT=True,
                                   FUSED=True, RED_M=2, USE_PDL=False),
    "gemv-dot-m16-pdl": _gemv_dot(BLOCK_K=256, SPLIT=True, FUSED=True),
    "gemv-dot-wide": _gemv_dot(BLOCK_N=128),
    "gemv-dot-gated": _gemv_dot(GATED=True),
    "gemv-dot-gated-tiles": _gemv_dot(5, BLOCK_M=64, BLOCK_K=64, RED_M=64, GATED=True, TILE_M=True),
    "gemv-dot-full": _gemv_dot(PAD_M=False),
    "argmax-split-pdl": ("argmax", "_argmax_split_kernel", _ARGMAX, dict(
        BLOCK_V=1024, FUSED=False, SPLITS_POW2=128, USE_PDL=True), dict(num_warps=4)),
    "argmax-split-fused": ("argmax", "_argmax_split_kernel", _ARGMAX, dict(
        BLOCK_V=1024, FUSED=True, SPLITS_POW2=8, USE_PDL=False), dict(num_warps=8)),
    "argmax-combine-pdl": ("argmax", "_argmax_combine_kernel", _ARGMAX, dict(
        SPLITS_POW2=128, USE_PDL=True), dict(num_warps=1)),
    # a draft step's proposal: the merge maps the index and stores it to the row's slot
    "argmax-combine-propose-pdl": ("argmax", "_argmax_combine_kernel", dict(
        _ARGMAX, map_ptr="*i64", slots_ptr="*i64", dest_ptr="*i64"), dict(
        SPLITS_POW2=128, USE_PDL=True, PROPOSE=True, HAS_MAP=True), dict(num_warps=1)),
    "add-rms-norm-pdl": ("norm", "_rms_norm_kernel", dict(eps="fp32"), dict(
        HAS_RESIDUAL=True, BLOCK_H=2048, USE_PDL=True), dict(num_warps=4)),
    # the EAGLE-3 layer's input, DRAFT_EXTEND's last rows' residuals gathered by extra programs
    "eagle3-input-rows-pdl": ("eagle3_input", "_eagle3_input_kernel", dict(tok_ptr="*i64", rows_ptr="*i64",
                              eps="fp32"), dict(BLOCK_H=2048, RES=2, RES_NORMED=False, USE_PDL=True),
                              dict(num_warps=4)),
    "residual-add-pdl": ("residual_add", "_residual_add_kernel", dict(a_ptr="*bf16"), dict(BLOCK=1024, USE_PDL=True),
                         dict(num_warps=4)),
    "silu-mul-pdl": ("activation", "_silu_and_mul_kernel", {}, dict(BLOCK_I=1024, USE_PDL=True),
                     dict(num_warps=4)),
    "rotary-store-kv-pdl": ("rotary", "_rotary_store_kv_kernel", _ROTARY, dict(
        NUM_Q_HEADS=32, NUM_KV_HEADS=8, HEAD_DIM=64, PAGE=16, HAS_NORM=False, BLOCK_HALF=32, USE_PDL=True,
        HEADS=64), dict(num_warps=4)),
    "attn-decode-split-pdl": ("attention", "_paged_attn_partial_kernel", _ATTN, dict(
        _PAGED, BLOCK_Q=1, BLOCK_M=16, NUM_SPLITS=32, USE_PDL=True, PF_LINES=2), dict(num_warps=4)),
    "attn-decode-split64-pdl-noprefetch": ("attention", "_paged_attn_partial_kernel", _ATTN, dict(
        _PAGED, BLOCK_Q=1, BLOCK_M=16, NUM_SPLITS=64, USE_PDL=True), dict(num_warps=4)),
    # DRAFT_EXTEND's last rows: each request's query picked from its block (q_rows)
    "attn-decode-split-qrows": ("attention", "_paged_attn_partial_kernel", _ATTN | dict(q_rows_ptr="*i64"), dict(
        _PAGED, BLOCK_Q=1, BLOCK_M=16, NUM_SPLITS=32, USE_PDL=False, PF_LINES=2, Q_ROWS=True), dict(num_warps=4)),
    "attn-verify": ("attention", "_paged_attn_partial_kernel", _ATTN, dict(
        _PAGED, BLOCK_Q=4, BLOCK_M=16, NUM_SPLITS=1, USE_PDL=False), dict(num_warps=4)),
    "attn-merge-pdl": ("attention", "_paged_attn_merge_kernel", dict(ws_out_ptr="*fp32", ws_lse_ptr="*fp32",
                                                                      seq_lens_ptr="*i32"), dict(
        NUM_Q_HEADS=32, HEAD_DIM=64, PAGE=16, BLOCK_N=128, NUM_SPLITS=32, SPLITS_P2=32, BLOCK_H=2, BLOCK_DM=64,
        USE_PDL=True), dict(num_warps=4)),
    "attn-merge-pdl-d128": ("attention", "_paged_attn_merge_kernel", dict(ws_out_ptr="*fp32", ws_lse_ptr="*fp32",
                                                                            seq_lens_ptr="*i32"), dict(
        NUM_Q_HEADS=32, HEAD_DIM=128, PAGE=16, BLOCK_N=64, NUM_SPLITS=64, SPLITS_P2=64, BLOCK_H=1, BLOCK_DM=64,
        USE_PDL=True), dict(num_warps=4)),
    # the sampler: PDL is a mode there (0 off, 1 early release, 2 late release)
    "rej-row-stats-prune-late": ("rejection_kernels", "_row_stats_kernel", _REJ, dict(
        HAS_ND=True, FULL_Q=False, FUSE_RACE=False, BLOCK_V=2048, VEC=8, PRUNE=True, FAST=True, PDL=2,
        XSUM=True), _NO_FUSION),
    "rej-row-stats-fused-race-fullq": ("rejection_kernels", "_row_stats_kernel", _REJ, dict(
        HAS_ND=False, FULL_Q=True, FUSE_RACE=False, BLOCK_V=1024, VEC=8, FAST=True, PDL=1), _NO_FUSION),
    "rej-row-stats-small": ("rejection_kernels", "_row_stats_kernel", _REJ, dict(
        HAS_ND=False, FULL_Q=False, FUSE_RACE=True, BLOCK_V=1024, VEC=8, PRUNE=True, FAST=True, PDL=0,
        XSUM=True), _NO_FUSION),
    "rej-walk": ("rejection_kernels", "_walk_kernel", _REJ, dict(
        HAS_ND=True, HAS_COUNTS=True, FULL_Q=False, FUSE_RACE=False, R_POW2=4, SPLITS_POW2=16, PDL=2,
        CHUNK=8192, SPC=1, NC_POW2=16, RACE_BLOCK_V=1024, VEC=8, PRUNE=True, FAST=True), _NO_FUSION),
    "rej-walk-fullq": ("rejection_kernels", "_walk_kernel", _REJ, dict(
        HAS_ND=False, HAS_COUNTS=False, FULL_Q=True, FUSE_RACE=False, R_POW2=4, SPLITS_POW2=32, PDL=1),
        dict(num_warps=1, enable_fp_fusion=False)),
    "rej-race": ("rejection_fullq", "_race_kernel", _REJ, dict(
        BLOCK_V=1024, VEC=8, PDL=1), _NO_FUSION),
    "rej-finish": ("rejection_fullq", "_finish_kernel", _REJ, dict(SPLITS_POW2=32, PDL=0), dict(num_warps=1)),
    # the filters: their threshold kernel and the passes that apply its thresholds
    "rej-filter-stats": ("rejection_filter", "_filter_stats_kernel", _FILTER, dict(
        HAS_K=True, HAS_P=True, HAS_M=True, SHIFT=16, BLOCK_V=8192, GROUP=16, SUPER=16, PDL=2),
        dict(num_warps=8, enable_fp_fusion=False)),
    "rej-filter-weigh": ("rejection_filter", "_filter_weigh_kernel", _FILTER, dict(
        HAS_K=True, HAS_P=True, HAS_M=True, SHIFT=16, BLOCK_V=2048, PDL=1),
        dict(num_warps=8, enable_fp_fusion=False)),
    "rej-threshold": ("rejection_filter", "_threshold_kernel", _FILTER, dict(
        HAS_K=True, HAS_P=True, HAS_M=True, SHIFT=16, CAND_BLOCK_V=1024, KEPT_BLOCK_V=256, GROUP=16, SUPER=16, PDL=1),
        dict(num_warps=8, enable_fp_fusion=False)),
    # the one-hot sampler's launch: sampled rows whose candidates hold their threshold are drawn there
    "rej-threshold-draw": ("rejection_filter", "_threshold_kernel", _FILTER, dict(
        HAS_K=True, HAS_P=True, HAS_M=False, SHIFT=16, CAND_BLOCK_V=1024, KEPT_BLOCK_V=256, GROUP=16, SUPER=16, PDL=2,
        DRAW=True, HAS_ND=True, CHUNK=8192, NC_POW2=16), dict(num_warps=8, enable_fp_fusion=False)),
    # no candidate workspace: thresholds_triton passes tau (fp32) for every buffer of it
    "rej-threshold-no-candidates": ("rejection_filter", "_threshold_kernel", dict(
        _FILTER, **dict.fromkeys(("kmax_ptr", "mass_ptr", "hist_ptr", "gmax_ptr", "smax_ptr", "cand_ptr", "ids_ptr",
                                  "kept_ptr", "kvid_ptr", "flag_ptr"), "*fp32")), dict(
        HAS_K=False, HAS_P=True, HAS_M=False, SHIFT=16, CAND_BLOCK_V=1024, KEPT_BLOCK_V=256, GROUP=16, SUPER=16,
        CAND=False, PDL=0),
        dict(num_warps=8, enable_fp_fusion=False)),
    # the rows the threshold kernel flags, searched whole, spread over programs: B <= 2 (4096-entry
    # tiles, each row its own programs) and beyond (2048, the rows shared out from the threshold
    # kernel's list); bf16 keys take two passes of 16 pivots, fp32 five of 32
    "rej-pivots": ("rejection_filter_whole", "_pivot_kernel", _SPREAD, dict(
        HAS_K=True, HAS_P=True, HAS_M=True, SHIFT=16, BLOCK_V=2048, LISTED=True, NP=16, PASS=0, STEP=512, PDL=2),
        dict(num_warps=8, enable_fp_fusion=False)),
    "rej-pivots-fp32-later": ("rejection_filter_whole", "_pivot_kernel", dict(_SPREAD, logits_ptr="*fp32"), dict(
        HAS_K=False, HAS_P=True, HAS_M=True, SHIFT=0, BLOCK_V=2048, LISTED=True, NP=32, PASS=4, STEP=256, PDL=1),
        dict(num_warps=8, enable_fp_fusion=False)),
    "rej-window-small": ("rejection_filter_whole", "_window_kernel", _SPREAD, dict(
        HAS_K=True, HAS_P=True, HAS_M=True, SHIFT=16, BLOCK_V=4096,
        SPREAD=True, PASSES=2, NP_SPREAD=16, CAND=True, LISTED=False, PDL=2),
        dict(num_warps=8, enable_fp_fusion=False)),
    "rej-window": ("rejection_filter_whole", "_window_kernel", _SPREAD, dict(
        HAS_K=False, HAS_P=True, HAS_M=False, SHIFT=16, BLOCK_V=2048,
        SPREAD=True, PASSES=2, NP_SPREAD=16, CAND=True, LISTED=True, PDL=1),
        dict(num_warps=8, enable_fp_fusion=False)),
    "rej-window-fp32": ("rejection_filter_whole", "_window_kernel", dict(_SPREAD, logits_ptr="*fp32"), dict(
        HAS_K=True, HAS_P=True, HAS_M=True, SHIFT=0, BLOCK_V=2048,
        SPREAD=True, PASSES=5, NP_SPREAD=32, CAND=True, LISTED=True, PDL=1),
        dict(num_warps=8, enable_fp_fusion=False)),
    # no spread search (no workspace: state None, or a capture that would have to grow it):
    # whole_row_search passes tau (fp32) for every buffer the search does not use
    "rej-window-unspread": ("rejection_filter_whole", "_window_kernel", dict(
        _SPREAD, logits_ptr="*fp32", part_ptr="*fp32", state_ptr="*fp32", above_ptr="*fp32", mins_ptr="*fp32",
        ctr_ptr="*fp32", wcnt_ptr="*fp32"), dict(
        HAS_K=True, HAS_P=True, HAS_M=True, SHIFT=0, BLOCK_V=2048,
        SPREAD=False, PASSES=5, NP_SPREAD=32, CAND=True, LISTED=False, PDL=1),
        dict(num_warps=8, enable_fp_fusion=False)),
    "rej-window-no-candidates": ("rejection_filter_whole", "_window_kernel", dict(
        _SPREAD, part_ptr="*fp32", state_ptr="*fp32", above_ptr="*fp32", mins_ptr="*fp32", ctr_ptr="*fp32",
        wcnt_ptr="*fp32", kmax_ptr="*fp32", mass_ptr="*fp32", hist_ptr="*fp32", flag_ptr="*fp32"), dict(
        HAS_K=False, HAS_P=True, HAS_M=False, SHIFT=16, BLOCK_V=2048,
        SPREAD=False, PASSES=2, NP_SPREAD=16, CAND=False, LISTED=False, PDL=0),
        dict(num_warps=8, enable_fp_fusion=False)),
    "rej-row-stats-filter": ("rejection_kernels", "_row_stats_kernel", dict(_REJ, tau_ptr="*fp32"), dict(
        HAS_ND=True, FULL_Q=False, FUSE_RACE=True, BLOCK_V=1024, VEC=8, PRUNE=False, FAST=True, PDL=2,
        XSUM=True, FILTER=True), _NO_FUSION),
    "rej-walk-filter": ("rejection_kernels", "_walk_kernel", dict(_REJ, tau_ptr="*fp32"), dict(
        HAS_ND=True, HAS_COUNTS=True, FULL_Q=False, FUSE_RACE=False, R_POW2=4, SPLITS_POW2=16, PDL=1,
        CHUNK=8192, SPC=1, NC_POW2=16, RACE_BLOCK_V=2048, VEC=8, PRUNE=True, FAST=True, FILTER=True), _NO_FUSION),
    # the rows the threshold kernel drew: the row pass skips them, the walk takes their results
    "rej-row-stats-drawn": ("rejection_kernels", "_row_stats_kernel", _FILTER, dict(
        HAS_ND=True, FULL_Q=False, FUSE_RACE=True, BLOCK_V=1024, VEC=8, PRUNE=False, FAST=True, PDL=2,
        XSUM=True, FILTER=True, DRAWN=True), _NO_FUSION),
    "rej-walk-drawn": ("rejection_kernels", "_walk_kernel", _FILTER, dict(
        HAS_ND=True, HAS_COUNTS=True, FULL_Q=False, FUSE_RACE=False, R_POW2=4, SPLITS_POW2=16, PDL=2,
        CHUNK=8192, SPC=1, NC_POW2=16, RACE_BLOCK_V=2048, VEC=8, PRUNE=True, FAST=True, FILTER=True, DRAWN=True),
        _NO_FUSION),
    "rej-race-filter": ("rejection_fullq", "_race_kernel", dict(_REJ, tau_ptr="*fp32"), dict(
        BLOCK_V=1024, VEC=8, PDL=2, FILTER=True), _NO_FUSION),
    # the cycle's bookkeeping: TARGET_VERIFY's inputs, DRAFT_EXTEND's, DRAFT_DECODE's steps, the advance
    "cycle-inputs-verify": ("cycle_index", "_cycle_inputs_kernel", _CYCLE, dict(
        T=4, TP=4, BLOCK_MB=256, BY_SLOT=True, N_OUT=True, TOKENS=True, SAMPLING=True), dict(num_warps=1)),
    "cycle-inputs-extend": ("cycle_index", "_cycle_inputs_kernel", _CYCLE, dict(
        T=4, TP=4, BLOCK_MB=256, BY_SLOT=False, N_OUT=False, TOKENS=False, SAMPLING=False, EMITTED=True),
        dict(num_warps=1)),
    "cycle-inputs-steps": ("cycle_index", "_cycle_inputs_kernel", _CYCLE, dict(
        T=2, TP=2, BLOCK_MB=256, BY_SLOT=True, N_OUT=False, TOKENS=False, SAMPLING=False, STEP_MAJOR=True),
        dict(num_warps=1)),
    "cycle-advance": ("cycle_index", "_advance_kernel", dict(
        slots_ptr="*i64", n_ptr="*i64", nemit_ptr="*i32", emit_ptr="*i64", num_tokens_ptr="*i64", last_ptr="*i64"),
        dict(BLOCK=64, USE_PDL=True), dict(num_warps=2)),
}

_SCRIPT = textwrap.dedent("""
    import importlib, inspect, json, sys
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    out = {}
    for name, (mod, kernel, types, constexprs, options) in json.loads(sys.argv[1]).items():
        fn = getattr(importlib.import_module("graphrt.kernels." + mod), kernel)
        names = [p.name for p in fn.params]
        for p in fn.params:  # constexprs a case leaves out take the kernel's defaults
            if p.is_constexpr and p.name not in constexprs and p.default is not inspect.Parameter.empty:
                constexprs[p.name] = p.default
        sig = {}
        for p in fn.params:
            sig[p.name] = ("constexpr" if p.is_constexpr else
                           types.get(p.name, "*bf16" if p.name.endswith("_ptr") else "i32"))
        src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in constexprs.items()})
        try:
            k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
        except Exception as exc:
            out[name] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
            continue
        ptx = k.asm["ptx"]
        out[name] = {"sm_90": ".target sm_90" in ptx, "griddepcontrol": "griddepcontrol.wait" in ptx,
                     "prefetch": "prefetch.global.L2" in ptx,
                     "loads_before_wait": ptx.split("griddepcontrol.wait")[0].count("ld.global")}
    print(json.dumps(out))
""")


@pytest.fixture(scope="module")
def compiled():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    names = list(CASES)
    # one compiler process per core (two on CI): compiling is single-threaded
    parts = [{n: CASES[n] for n in names[i::2]} for i in range(2)]
    procs = [subprocess.Popen([sys.executable, "-c", _SCRIPT, json.dumps(part)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for part in parts]
    out = {}
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=900)
        if proc.returncode != 0:
            if "ptxas" in stderr.lower() or "No module named 'triton" in stderr:
                pytest.skip(f"Triton cannot compile for sm_90 here: {stderr[-500:]}")
            raise AssertionError(stderr[-3000:])
        out.update(json.loads(stdout.strip().splitlines()[-1]))
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_compiles_for_sm90(compiled, name):
    res = compiled[name]
    assert "error" not in res, res.get("error")
    assert res["sm_90"]
    constexprs = CASES[name][3]
    assert res["griddepcontrol"] == bool(constexprs.get("USE_PDL", constexprs.get("PDL", 0)))
    # the L2 prefetch before the wait, where a case asks for it
    assert res["prefetch"] == (constexprs.get("PF_LINES", 0) > 0 and constexprs.get("USE_PDL", False))
    if name.startswith("attn") and res["griddepcontrol"]:
        # seq_lens (and the prefetch's table entries) are settled: read before the wait
        assert res["loads_before_wait"] > 0, res


# Launches that must share one compiled variant (cold start: every variant of `graphrt capture`'s
# buckets compiles once): llama-1b shapes on CPU tensors, the JIT cache key computed as
# JITFunction.run computes it, nothing launched.
_SHARED = textwrap.dedent("""
    import json, sys
    import torch
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature
    import graphrt.kernels.attention as att, graphrt.kernels.gemv as gemv, graphrt.kernels.qkv_rotary as qr
    from graphrt.kernels.norm import PendingNorm

    backend = make_backend(GPUTarget("cuda", 90, 32))
    keys, group = {}, [None]
    for mod, name in ((att, "_paged_attn_partial_kernel"), (att, "_paged_attn_merge_kernel"),
                      (gemv, "_gemv_kernel"), (qr, "_qkv_rotary_kernel")):
        mod.pdl_enabled = lambda dev: True
        fn = getattr(mod, name)
        def run(*args, grid, warmup, _b=create_function_from_signature(fn.signature, fn.params, backend), _n=name,
                **kw):
            keys.setdefault(f"{group[0]} {_n}", set()).add(str(_b(*args, **kw)[1:]))
        fn.run = run
    att._device_sm_count = lambda dev: 132
    bf = torch.bfloat16
    kc = torch.empty(200, 16, 8, 64, dtype=bf)
    cos = torch.empty(2100, 64)
    steps = [torch.empty(2, b, dtype=dt) for b in (1, 2) for dt in (torch.int32, torch.int64, torch.int64)]
    group[0] = "decode B=1,2 (both steps) and verify B=1:"
    for sl, pos, slot in zip(steps[0::3], steps[1::3], steps[2::3]):
        b = sl.shape[1]
        for i in range(2):  # row 1 of a [2, 1] tensor is not 16-byte aligned
            att.paged_attention_triton(torch.empty(b, 32, 64, dtype=bf), kc, kc, torch.empty(b, 129, dtype=torch.int32),
                                       sl[i], query_len=1, scale=0.125, max_seq_len=2064)
            if b == 1:
                x = torch.empty(1, 2048, dtype=bf)
                qr.qkv_rotary_store_triton(x, torch.empty(3072, 2048, dtype=bf), None, pos[i], cos, cos, kc, kc,
                                           slot[i], num_q_heads=32, num_kv_heads=8,
                                           norm=PendingNorm(x, torch.empty_like(x), torch.empty(2048, dtype=bf), 1e-5))
    att.paged_attention_triton(torch.empty(4, 32, 64, dtype=bf), kc, kc, torch.empty(1, 129, dtype=torch.int32),
                               torch.empty(1, dtype=torch.int32), query_len=4, scale=0.125, max_seq_len=2064)
    group[0] = "o_proj and down_proj at M = 1:"
    for k in (2048, 8192):
        gemv.gemv_triton(torch.empty(1, k, dtype=bf), torch.empty(2048, k, dtype=bf))
    for group[0], ms in (("o_proj and down_proj at M = 4, 8:", (4, 8)), ("o_proj and down_proj at M = 16:", (16,))):
        for k in (2048, 8192):
            for m in ms:
                gemv.gemv_triton(torch.empty(m, k, dtype=bf), torch.empty(2048, k, dtype=bf))
    print(json.dumps({k: len(v) for k, v in keys.items()}))
""")


def test_bucket_launches_share_compiled_variants():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _SHARED], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    counts = json.loads(proc.stdout.strip().splitlines()[-1])
    # one variant each, but the attention's partial kernel: one for decode, one for verify (BLOCK_Q).
    # The 16-row DOT tile compiles twice: with padding rows (M = 4, 8), whose x loads are masked, and
    # full (M = 16), whose loads need no mask (PAD_M).
    want = {"decode B=1,2 (both steps) and verify B=1: _paged_attn_partial_kernel": 2,
            "decode B=1,2 (both steps) and verify B=1: _paged_attn_merge_kernel": 1,
            "decode B=1,2 (both steps) and verify B=1: _qkv_rotary_kernel": 1,
            "o_proj and down_proj at M = 1: _gemv_kernel": 1, "o_proj and down_proj at M = 4, 8: _gemv_kernel": 1,
            "o_proj and down_proj at M = 16: _gemv_kernel": 1}
    assert counts == want
