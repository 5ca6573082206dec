"""Which launch of kernels/gemv.py the dispatcher picks for a product shape: the tables the sweeps
(scripts/gemv_sweep.py) produced, and the switches that send every product to cuBLAS or to Triton.
Kernel-free, so the launcher and the dispatcher in kernels/gemv.py both read it."""

from __future__ import annotations

import functools
import os

import torch
import triton

__all__ = ["select_config", "row_fma_config", "dot_rotary_config", "MAX_M", "TILED_MAX_M", "ALL_M", "ROWS_MAX_M",
           "ROWS_MAX_BYTES"]

# The dispatcher sends M <= MAX_M rows to Triton on CUDA (module attribute, so a benchmark can set it
# to 0 to time cuBLAS in the same process; GRAPHRT_GEMV=0 does that for a whole run).
# GRAPHRT_GEMV=all: every product with M <= MAX_M (the kernel's 64 rows) on Triton, also where
# cuBLAS measured as fast. For compute-sanitizer's initcheck, which does
# not see the stores of cuBLAS's sm90 bf16 kernels (nvjet, tensor-memory-accelerator stores;
# scripts/initcheck_probe.py) and so reports every read of their output: with this switch a bf16
# decode cycle, and a prefill graph of up to 64 padded tokens, has no cuBLAS writer left.
ALL_M = os.environ.get("GRAPHRT_GEMV") == "all"
# The DOT path's fewest x tile rows: an MMA's N side. (tl.dot pads a smaller tile itself, but 8 and
# 4 rows ran slower on the llama shapes' products: docs/notes/benchmarks-history.md.)
DOT_MIN_M = 16
_DOT_TILE_M = 64  # and its most: a larger fp32 accumulator would cost the MMA loop its pipeline stages
_TUNED_M = 16  # the most rows the tables below were swept at for every product (a verify step at batch 1 to 4)
MAX_M = 0 if os.environ.get("GRAPHRT_GEMV") == "0" else 64  # the most rows of one x tile (the DOT path)
# Past MAX_M rows, up to TILED_MAX_M (a verify step at B = 17-64), the DOT path takes the rows in tiles
# of MAX_M over a grid dimension, on matrices of at most _TILED_ELEMS weights (SmolLM2-135M's): gate_up
# with the SiLU in its epilogue, qkv with the rotary and the KV store, and from 17 rows the o and
# down projections (_SMALL_TALL). There a launch is bound by its latency, not its bytes or FLOPs: four
# row tiles take about one tile's time, and the products alone time as cuBLAS's, but cuBLAS leaves
# the SiLU or the rotary a launch of its own and a gap around each of its kernels (it does not launch
# as a programmatic dependent). RESULTS.md, "Row tiles past 64 rows".
TILED_MAX_M = 256
_TILED_ELEMS = 1 << 21
# Rows and weight bytes served by the per-row FMA path (one program per row and tile, with the
# one-row launch's norm prologue and SiLU epilogue): every row reads the whole matrix through L2,
# so it pays only where launch latency, not bytes, dominates (SmolLM2-135M, every layer projection
# under 4 MiB). Six rows won on smollm2-135m-shape at K = 5, B = 1; eight only matched the DOT path
# and sixteen lost (docs/notes/benchmarks-history.md, `ROWS_MAX_M`).
ROWS_MAX_M = 6
ROWS_MAX_BYTES = 4 << 20


# Defaults of each path for gemv_triton when called directly; select_config starts from them.
_FMA_DEFAULT = dict(use_dot=False, reduce_each=True, block_n=2, block_k=2048, num_warps=4, num_stages=1,
                    programs_per_sm=0)
_DOT_DEFAULT = dict(use_dot=True, reduce_each=False, block_n=64, block_k=256, num_warps=4, num_stages=4,
                    programs_per_sm=1)
# Where N >= 4K (gate_up, LM heads): unsplit; 128-row tiles up to _DOT_WIDE_MAX_ELEMS weights.
_DOT_WIDE = dict(_DOT_DEFAULT, block_n=128, block_k=128, programs_per_sm=0)
_DOT_WIDE_MAX_ELEMS = 1 << 27
# 17-64 rows (a verify step at B = 8 and 16, decoding at B > 16): the o projection (K = N) up to
# _TALL_SQUARE_M rows and down-like products (K >= 2N: down, the EAGLE-3 fc) up to 64 on the DOT path
# with these tiles, K split to fill the SMs; the rest stay on cuBLAS, which measured as fast or
# faster there (scripts/gemv_sweep.py --ms 32,64 on an H200; RESULTS.md, "Projections of 17-64 rows").
# Only matrices of the swept sizes (llama-1b's and 8b's, 4M to 59M weights): SmolLM2's and the 70B
# shape's were not timed.
_DOT_TALL = dict(_DOT_DEFAULT, block_k=128, num_stages=5)
_TALL_SQUARE_M = 32
_TALL_ELEMS = (1 << 22, 1 << 26)
# ... and gate_up at 17-64 rows with the SiLU in its epilogue (gated): _DOT_WIDE unsplit, one launch
# instead of cuBLAS and silu_and_mul, on the swept sizes (SmolLM2's to llama-8b's, 1.8M to 117M
# weights; RESULTS.md, "Projections of 17-64 rows"); K under 1024 (SmolLM2's 576) in 64-wide
# steps, where 128 left a half-empty last step and lost to cuBLAS.
_GATED_TALL_ELEMS = (1 << 20, 1 << 27)
_SMALL_K = 1024
_SMALL_K_STEPS = dict(block_k=64, num_stages=5)
_GATED_SMALL_K = dict(_DOT_WIDE, **_SMALL_K_STEPS)
# ... and qkv at 17-64 rows with the rotary and the KV store in its epilogue (kernels/qkv_rotary.py):
# unsplit, so that one program holds a rotary pair's whole sums; 128-wide K steps keep four stages of
# a 64-row x tile in shared memory; K under 1024 in 64-wide steps, five stages, as gate_up's. Where
# K >= 1024 only up to _QKV_TALL_M rows: at 48 and 64 the llama shapes' verify steps at B = 12 and 16
# lost with it, though the launch alone measured faster (docs/notes/benchmarks-history.md).
_QKV_ROTARY_TALL = dict(_DOT_DEFAULT, block_k=128, programs_per_sm=0)
_QKV_ROTARY_SMALL_K = dict(_QKV_ROTARY_TALL, **_SMALL_K_STEPS)
_QKV_TALL_ELEMS = (1 << 19, 1 << 25)  # the swept: SmolLM2-135M's qkv (0.55M weights) to llama-8b's (25M)
_QKV_TALL_M = 32
# ... and o and down (K >= N) of at most _TILED_ELEMS weights at 17-TILED_MAX_M rows, unsplit (row tiles
# past 64 need whole K sums), K under 1024 in 64-wide steps.
_SMALL_TALL = dict(_DOT_TALL, programs_per_sm=0)
_SMALL_TALL_SMALL_K = dict(_SMALL_TALL, **_SMALL_K_STEPS)
# M = 1 exceptions to the FMA default, by (N, K): the 1b lm_head, the one size where (4, 512)
# tiles without reduce_each beat cuBLAS (the reduce-each variant was not swept there).
_M1_OVERRIDES: dict[tuple[int, int], dict] = {
    (128256, 2048): dict(reduce_each=False, block_n=4, block_k=512),
}
# M = 1 exceptions for one device kind (first matching substring of the device name), on top of the
# above: the tiles scripts/gemv_sweep.py --ms 1 found fastest, each kept only where the decode graph
# measured faster too (RESULTS.md, "GEMV tiles at one row").
_NO_REDUCE = dict(reduce_each=False)
_4X1024 = dict(block_n=4, block_k=1024)
_4X1024_NO_REDUCE = dict(_4X1024, reduce_each=False)
_M1_DEVICE_OVERRIDES: dict[str, dict[tuple[int, int], dict]] = {
    "H100": {(2048, 2048): _NO_REDUCE, (2048, 8192): _NO_REDUCE,
             (6144, 4096): _NO_REDUCE, (4096, 4096): _NO_REDUCE},  # the 8b's qkv and o
    "H200": {
        (3072, 2048): _4X1024_NO_REDUCE, (2048, 2048): _NO_REDUCE, (16384, 2048): _4X1024,
        (2048, 8192): _NO_REDUCE,  # llama-1b: qkv, o, gate_up, down
        (32000, 2048): dict(block_n=8, block_k=256, num_warps=1),  # llama-1b's EAGLE-3 head: its LM head
        (6144, 4096): _4X1024_NO_REDUCE, (4096, 4096): _NO_REDUCE,  # llama-8b: qkv, o
        (3072, 4096): _4X1024_NO_REDUCE, (4096, 2048): _4X1024, (14336, 4096): _4X1024_NO_REDUCE,
        (4096, 7168): _NO_REDUCE,  # llama-8b at TP = 2: qkv, o, gate_up, down
    },
}


# FP8 weights at one row (kernels/fp8_weight.py; no other M reads them), from scripts/gemv_sweep.py
# --fp8 --ms 1 on the EAGLE-3 heads' matrices: (8, 1024) tiles without the per-step reduction, and
# the shapes below took others.
_FP8_M1 = dict(reduce_each=False, block_n=8, block_k=1024)
_FP8_M1_OVERRIDES: dict[tuple[int, int], dict] = {
    (6144, 8192): dict(block_n=4, block_k=2048), (2048, 8192): dict(block_n=4, block_k=2048),
    (2048, 6144): dict(block_n=4, block_k=2048), (3072, 4096): dict(block_n=4),
    (2048, 2048): dict(block_n=4, block_k=2048, num_warps=2, reduce_each=True),
    (32000, 2048): dict(block_n=8, block_k=256, num_warps=1, reduce_each=True),
}

# The per-row launches' tiles (2-6 rows of a latency-bound matrix: a verify step on SmolLM2-135M):
# four output rows a program and fewer warps than the one-row default, so fewer, shorter programs.
# At one row the same tiles slowed the decode graph (longer PDL waits), so one row keeps the
# default, and the rows of a verify step do not carry the decode step's bits.
_SMALL = dict(block_n=4, num_warps=2)
_SMALL_WIDE = dict(block_n=4, block_k=512, num_warps=1, reduce_each=False)  # N >= 4K: gate_up


@functools.cache
def _device_overrides(index: int) -> dict[tuple[int, int], dict]:
    name = torch.cuda.get_device_name(index)
    return next((o for key, o in _M1_DEVICE_OVERRIDES.items() if key in name), {})


def select_config(m: int, n: int, k: int, fp8: bool = False, gated: bool = False) -> dict | None:
    """The dispatcher's launch configuration for an [m, k] x [n, k]^T bf16/fp16 product, or None
    where cuBLAS measured as fast or faster; fp8: the weights are FP8 (one row only); gated: w is a
    gate_up matrix whose launch takes the SiLU in its epilogue (kernels/linear.linear_silu_mul). Keys are
    gemv_triton's keyword arguments, plus programs_per_sm (split K until N tiles x splits reach
    that many programs per SM; 0: never).

    Tuned with scripts/gemv_sweep.py (graph replays, weights rotated past L2) over the llama-1b
    and llama-8b projections, M in 1, 2, 4, 8, 16 (figures: docs/notes/benchmarks-history.md):
      - M = 1: FMA path with per-step reduction, (2, 2048) tiles, unsplit.
      - 2 <= M <= ROWS_MAX_M on matrices of at most ROWS_MAX_BYTES (latency-bound): the FMA path
        one row per program (per_row) with the _SMALL / _SMALL_WIDE tiles.
      - M = 2: FMA path, (4, 1024), without per-step reduction, where K >= N (o_proj, down_proj);
        qkv and gate_up stay on cuBLAS.
      - 3 <= M <= 16: DOT path. Where K >= N (o, down): (64, 256) tiles, K split to one program
        per SM. Where N >= 4K (gate_up, LM heads): unsplit (128, 128) tiles, (64, 128) for an LM
        head, so that a gate_up launch takes the SiLU into its epilogue. qkv: unsplit (64, 256),
        so that its launch takes the rotary (kernels/qkv_rotary.py).
      - 17 <= M <= 64 (swept at 32 and 64): _DOT_TALL for o up to 32 rows and for down-like
        products (K >= 2N), 4M to 64M weights; gated gate_up on _DOT_WIDE unsplit, 1M to 128M
        weights (swept at 24-64 rows); everything else on cuBLAS.
      - 17 <= M <= TILED_MAX_M on matrices of at most _TILED_ELEMS weights (SmolLM2-135M's): o and
        down unsplit (_SMALL_TALL), gated gate_up as above, in 64-row tiles past 64 rows (RESULTS.md,
        "Row tiles past 64 rows"); past 64 rows everything else on cuBLAS.
      (The FMA path at M = 4 is bound by L1 and ALU, not DRAM: each weight load needs M x loads and
      conversions. The DOT path with the norm in its prologue lost to norm + cuBLAS: the normalised
      x tile breaks the dot's load pipelining.)
    """
    if fp8:
        if m != 1:
            raise ValueError(f"FP8 weights are read at one row only, got {m} (kernels/fp8_weight.for_rows)")
        return _fma_config(k, _FP8_M1, _FP8_M1_OVERRIDES.get((n, k), {}))
    if m == 1 or (m <= min(ROWS_MAX_M, MAX_M) and 2 * n * k <= ROWS_MAX_BYTES):
        if m == 1:
            return _m1_config(n, k)
        return dict(_fma_config(k, _SMALL_WIDE if n >= 4 * k else _SMALL), per_row=True)
    small = n * k <= _TILED_ELEMS and m <= TILED_MAX_M  # latency-bound at these rows
    gated_tiles = dict(_GATED_SMALL_K if k < _SMALL_K else _DOT_WIDE)
    small_tall = dict(_SMALL_TALL_SMALL_K if k < _SMALL_K else _SMALL_TALL) if k >= n else None
    if m > MAX_M:
        if not (MAX_M and small):
            return None
        return gated_tiles if gated else small_tall
    if m > _TUNED_M:
        if ALL_M:  # every product: 64-row tiles in four stages overflow shared memory
            return dict(select_config(_TUNED_M, n, k), num_stages=2)
        if small and small_tall is not None and not gated:
            return small_tall
        if gated:
            return gated_tiles if _GATED_TALL_ELEMS[0] <= n * k <= _GATED_TALL_ELEMS[1] else None
        tall = _TALL_ELEMS[0] <= n * k <= _TALL_ELEMS[1] and (k >= 2 * n or (k == n and m <= _TALL_SQUARE_M))
        return dict(_DOT_TALL) if tall else None
    if k < n:
        if m == 2:
            return dict(_DOT_DEFAULT) if ALL_M else None
        if n < 4 * k:  # qkv: unsplit, so that its launch can take the rotary (kernels/qkv_rotary.py)
            return dict(_DOT_DEFAULT, programs_per_sm=0)
        return dict(_DOT_WIDE) if n * k <= _DOT_WIDE_MAX_ELEMS else dict(_DOT_WIDE, block_n=64)
    if m == 2:
        return dict(_FMA_DEFAULT, reduce_each=False, block_n=4, block_k=min(1024, triton.next_power_of_2(k)))
    return dict(_DOT_DEFAULT)


def _m1_config(n: int, k: int, device_overrides: dict[tuple[int, int], dict] | None = None) -> dict:
    """The one-row configuration: the FMA default, the shape's exception, then the device kind's
    (device_overrides: a kind's table of _M1_DEVICE_OVERRIDES; the current device's by default)."""
    if device_overrides is None:
        device_overrides = _device_overrides(torch.cuda.current_device()) if torch.cuda.is_available() else {}
    return _fma_config(k, _M1_OVERRIDES.get((n, k), {}), device_overrides.get((n, k), {}))


def _fma_config(k: int, *changes: dict) -> dict:
    """The FMA path's defaults with changes applied in order, the K tile no wider than K needs."""
    cfg = dict(_FMA_DEFAULT)
    for c in changes:
        cfg.update(c)
    cfg["block_k"] = min(cfg["block_k"], triton.next_power_of_2(k))
    return cfg


def _path_default(use_dot: bool) -> dict:
    return dict(_DOT_DEFAULT if use_dot else _FMA_DEFAULT)


def _split_for(tiles: int, steps: int, programs_per_sm: int, num_sms: int) -> int:
    # Split K only when the N tiles alone leave SMs short of programs (0: never).
    target = programs_per_sm * num_sms
    return 1 if tiles >= target else max(1, min(steps, target // tiles))


def unsplit(cfg: dict) -> bool:
    """Whether a configuration's launch keeps K whole, so that its epilogue sees the final sums."""
    return cfg.get("split_k", 1) <= 1 and not cfg.get("programs_per_sm", 0)


def one_row_per_program(cfg: dict | None, m: int) -> bool:
    """Whether cfg (select_config's for m rows) runs one row per program on the unsplit FMA path
    (M = 1, or per row): the launches a norm prologue can ride on."""
    return cfg is not None and not cfg["use_dot"] and unsplit(cfg) and (m == 1 or cfg.get("per_row", False))


def triton_max_m() -> int:
    """The most rows the dispatcher may send to Triton (select_config decides which shapes): TILED_MAX_M,
    or 0 where MAX_M is (GRAPHRT_GEMV=0, or a benchmark timing cuBLAS)."""
    return TILED_MAX_M if MAX_M else 0


def dot_block_m(m: int) -> int:
    """Rows of the DOT path's x tile for an m-row product (gemv.py and qkv_rotary.py): a power of 2
    >= m, at least DOT_MIN_M and at most 64 (past 64 rows the launch tiles them, TILED_MAX_M);
    padding rows load nothing and are never stored."""
    return min(_DOT_TILE_M, max(DOT_MIN_M, 1 << (m - 1).bit_length()))


def row_tiles(m: int) -> int:
    """How many x tiles of dot_block_m(m) rows an m-row DOT launch takes (its grid's row dimension)."""
    return triton.cdiv(m, dot_block_m(m))


def dot_rotary_config(m: int, n: int, k: int) -> dict | None:
    """The unsplit DOT configuration whose launch kernels/qkv_rotary.py extends with the rotary and
    the KV store: select_config(m, n, k)'s at 3-16 tokens of a qkv projection; at 17-32 tokens (17-64
    where K < 1024, up to TILED_MAX_M in row tiles on matrices of at most _TILED_ELEMS weights), where
    a plain product of that shape runs on cuBLAS, _QKV_ROTARY_TALL's (or _QKV_ROTARY_SMALL_K's) on
    matrices of _QKV_TALL_ELEMS's sizes; None elsewhere."""
    if m > _TUNED_M:
        qkv = k < n < 4 * k and _QKV_TALL_ELEMS[0] <= n * k <= _QKV_TALL_ELEMS[1]
        most = (TILED_MAX_M if n * k <= _TILED_ELEMS else MAX_M) if k < _SMALL_K else _QKV_TALL_M
        if not qkv or not MAX_M or m > most or ALL_M:
            return None
        return dict(_QKV_ROTARY_SMALL_K if k < _SMALL_K else _QKV_ROTARY_TALL)
    cfg = select_config(m, n, k)
    return cfg if cfg is not None and cfg["use_dot"] and unsplit(cfg) else None


def row_fma_config(m: int, n: int, k: int, fp8: bool = False) -> dict | None:
    """select_config(m, n, k, fp8) when it runs one row per program on the unsplit FMA path (M = 1,
    or per row), else None: the configurations an epilogue or prologue fusion can reuse so that its
    sums are the unfused GEMV's."""
    if fp8 and m != 1:
        return None
    cfg = select_config(m, n, k, fp8)
    return cfg if one_row_per_program(cfg, m) else None
