"""Where a projection runs: the dispatchers between kernels/gemv.py's launcher and torch.

linear(x, w) (the product), linear_silu_mul (gate_up and the activation), linear_pushed (a
row-parallel product summed over a tensor-parallel group in its epilogue) and linear_add (a
product added to a residual). Each takes x or a kernels/norm.PendingNorm of it, picks the
launch gemv_config.select_config names (the norm in the prologue, the activation, the push or the
add in the epilogue where that launch takes them) and falls back to the unfused launches, or to
cuBLAS, with the same bits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
from graphrt.kernels import gemv_config
from graphrt.kernels.activation import silu_and_mul
from graphrt.kernels.counters import counters
from graphrt.kernels.fp8_weight import Fp8Weight, dense, for_rows
from graphrt.kernels.gemv import _FAST_DTYPES, gemv_triton
from graphrt.kernels.gemv_config import row_fma_config, select_config
from graphrt.kernels.norm import PendingNorm
from graphrt.kernels.push_reduce import PushTarget
from graphrt.kernels.residual_add import residual_add

__all__ = ["linear", "linear_add", "linear_pushed", "linear_silu_mul", "materialized", "norm_fusable",
           "one_row_product"]


def _triton_ok(x: torch.Tensor, w, bias: torch.Tensor | None, gated: bool = False) -> bool:
    w = dense(w)  # an FP8 matrix goes where its dense form would
    return (
        x.is_cuda and x.dim() == 2 and 1 <= x.shape[0] <= gemv_config.triton_max_m() and x.dtype in _FAST_DTYPES
        and w.dtype == x.dtype and w.dim() == 2 and w.shape[1] == x.shape[1] and w.is_contiguous()
        and x.stride(1) == 1 and w.device == x.device
        and (bias is None or (bias.dtype == x.dtype and bias.is_contiguous() and bias.shape == (w.shape[0],)))
        and select_config(x.shape[0], w.shape[0], w.shape[1], gated=gated) is not None
    )


def norm_fusable(x) -> bool:
    """Whether a consumer given x (a tensor or a PendingNorm) takes the norm in its prologue."""
    return isinstance(x, PendingNorm) and x.fusable()


def one_row_product(x: torch.Tensor, w, bias: torch.Tensor | None = None) -> bool:
    """Whether the product x @ w^T (+ bias) runs on Triton one row per program, on the unsplit FMA
    path: the launches that take a norm in their prologue (a fusable PendingNorm), an add or the
    draft's argmax in their epilogue."""
    w = for_rows(w, x.shape[0])
    return _triton_ok(x, w, bias) and row_fma_config(x.shape[0], *w.shape, isinstance(w, Fp8Weight)) is not None


def materialized(x) -> torch.Tensor:
    """x itself, or the output of the PendingNorm x as its own launch."""
    return x.materialize() if isinstance(x, PendingNorm) else x


def linear_silu_mul(x, w_gate_up: torch.Tensor) -> torch.Tensor:
    """x [M, K] (or a PendingNorm of one), w_gate_up [2I, K] (gate rows, then up rows) ->
    silu(x.gate^T) * (x.up^T), [M, I].

    Where the dispatcher runs the product one row per program on the unsplit FMA path, one launch with the
    activation in the GEMV's epilogue (gemv_triton(gated=True)) and, for a PendingNorm, the norm in
    its prologue; where it runs the unsplit DOT path (3-64 rows, up to gemv_config.TILED_MAX_M on
    small matrices), [the norm, then] one launch with the activation in its epilogue, the bits of the
    same tiles' product then silu_and_mul (past 16 rows a plain product of gate_up's shape runs on
    cuBLAS, which the fused launch beat);
    elsewhere [the norm,] linear, then silu_and_mul.
    """
    xt = x.x if isinstance(x, PendingNorm) else x
    w_gate_up = for_rows(w_gate_up, xt.shape[0])
    if w_gate_up.shape[0] % 2 == 0 and _triton_ok(xt, w_gate_up, None, gated=True):
        cfg = select_config(xt.shape[0], *w_gate_up.shape, isinstance(w_gate_up, Fp8Weight), gated=True)
        one_row = gemv_config.one_row_per_program(cfg, xt.shape[0])
        if one_row and norm_fusable(x):
            return gemv_triton(xt, w_gate_up, gated=True, norm=x)
        if one_row or (cfg["use_dot"] and gemv_config.unsplit(cfg)):
            return gemv_triton(materialized(x), w_gate_up, gated=True)
    return silu_and_mul(linear(materialized(x), w_gate_up))


def linear_pushed(x, w: torch.Tensor, push: PushTarget | None) -> torch.Tensor | None:
    """x [M, K] @ w [N, K]^T summed over a tensor-parallel group (a row-parallel projection) in one
    launch, where the dispatcher runs the product on the unsplit FMA path with both rows in each
    program (M = 1, 2) or on the DOT path (3-16 rows, unsplit or split-K reduced in the same
    launch): the all-reduce then runs in its epilogue (kernels/push_reduce.py). None elsewhere
    (the caller all-reduces)."""
    if push is None or not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[0] > gemv_config.MAX_M:
        return None  # past MAX_M rows the DOT path's row tiles take no push
    w = for_rows(w, x.shape[0])
    if not _triton_ok(x, w, None):
        return None
    m = x.shape[0]
    cfg = select_config(m, *w.shape, isinstance(w, Fp8Weight))
    if cfg is None or not push.fits(w.shape[0], cfg["block_n"], x.dtype, m):
        return None
    fma = not cfg["use_dot"] and gemv_config.unsplit(cfg) and not cfg.get("per_row") and m <= 2
    # a split DOT launch reduces each tile in the same launch only with a counter per tile
    if fma or (cfg["use_dot"] and (gemv_config.unsplit(cfg)
                                   or counters(x.device, triton.cdiv(w.shape[0], cfg["block_n"])) is not None)):
        return gemv_triton(x, w, push=push)
    return None


def linear(x, w: torch.Tensor | Fp8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (or a PendingNorm of one), w [N, K] or Fp8Weight, bias [N] or None -> [M, N], x's dtype.

    CUDA bf16/fp16 with M <= MAX_M (TILED_MAX_M on small matrices), a supported layout and a shape
    where select_config has a configuration -> gemv_triton, with a PendingNorm's norm in its prologue
    where the product runs
    one row per program; anything else (CPU, fp32, prefill-sized M, strided weights, shapes where
    cuBLAS measured as fast) -> [the norm,] F.linear, unchanged (an Fp8Weight's dense matrix).
    """
    w = for_rows(w, (x.x if isinstance(x, PendingNorm) else x).shape[0])
    if isinstance(x, PendingNorm):
        if norm_fusable(x) and one_row_product(x.x, w, bias):
            return gemv_triton(x.x, w, bias, norm=x)
        x = x.materialize()
    if _triton_ok(x, w, bias):
        return gemv_triton(x, w, bias)
    return F.linear(x, dense(w), bias)


def linear_add(x: torch.Tensor, w, add: torch.Tensor, into: torch.Tensor | None = None) -> torch.Tensor:
    """add + linear(x, w) [M, N] (add: [M, N] in x's dtype; into: where the sum goes, a new tensor
    when None): in the GEMV's epilogue where the product runs one row per program on the unsplit
    FMA path, else linear, then residual_add. Both give residual_add(add, linear(x, w))'s bits."""
    if one_row_product(x, w) and add.is_contiguous() and add.dtype == x.dtype:
        return gemv_triton(x, for_rows(w, x.shape[0]), add=add, out=into)
    return residual_add(add, linear(x, w), into)
