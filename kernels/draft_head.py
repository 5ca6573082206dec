"""A draft step's LM head and top-1 token in one launch.

At batch 1 a draft step ends in a one-row GEMV over the draft vocabulary and an argmax over its
output: two or three launches whose latency, not their bytes, is what they cost. Where the GEMV
runs one row on the unsplit FMA path, its epilogue folds each program's outputs into the row's
argmax (argmax.fold_argmax) and a one-program kernel maps and stores the token: the logits never go
to memory, and the argmax's two launches (a split pass over the logits, then the merge) become that
one. The token is the one argmax_triton picks from the logits the unfused GEMV stores, bit for bit
(same sums, rounded to the same dtype, NaN as -inf, ties to the lowest index). Anywhere else
(several rows, the DOT path or cuBLAS, the CPU, a vocab shard under tensor parallelism) the logits
are made and argmax'd as before.
"""

from __future__ import annotations

import torch
from graphrt.kernels.argmax import Proposal, argmax_keys, propose_tokens
from graphrt.kernels.fp8_weight import for_rows
from graphrt.kernels.gemv import gemv_triton
from graphrt.kernels.linear import linear, one_row_product
from graphrt.kernels.norm import PendingNorm


def propose_from_head(x, w, proposal: Proposal, out: torch.Tensor, *, group=None,
                      vocab_size: int | None = None) -> torch.Tensor:
    """x [B, H] (or a PendingNorm of one): the draft's state; w [V, H] or Fp8Weight: its LM head.
    -> out [B] int64, what propose_tokens(linear(x, w), proposal, out, group=, vocab_size=) gives
    (and stores to proposal.dest), in one launch where the product runs one row per program."""
    xt = x.x if isinstance(x, PendingNorm) else x
    w = for_rows(w, xt.shape[0])
    if group is None and xt.shape[0] == 1 and one_row_product(xt, w) and argmax_keys(xt.device) is not None:
        if isinstance(x, PendingNorm) and not x.fusable():
            x = xt = x.materialize()
        return gemv_triton(xt, w, norm=x if isinstance(x, PendingNorm) else None, propose=proposal, out=out)
    return propose_tokens(linear(x, w), proposal, out, group=group, vocab_size=vocab_size)
