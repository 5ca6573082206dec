"""Which slice of each target tensor a tensor-parallel rank holds (Megatron's layout):

  q/k/v_proj (+ bias)   column-parallel: the rank's q heads and KV heads (rows)
  o_proj                row-parallel: the matching input columns; its output is all-reduced
  gate_proj, up_proj    column-parallel: intermediate_size / W rows each
  down_proj             row-parallel: the matching columns; output all-reduced
  embed_tokens, lm_head vocab-parallel: rows [start, end) of kernels/vocab_parallel.vocab_shard
  everything else       replicated (norms, q/k norms)

A rule maps a canonical tensor name to (dim, start, end) or None (whole tensor), so the loader reads
only the rank's bytes from a safetensors file (graphrt/checkpoint.load_checkpoint's `shard`).
Drafts are replicated: a draft step is one or a few small layers, where an all-reduce per
projection would cost more than the reads it splits.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from graphrt.checkpoint import Checkpoint
from graphrt.config import ModelConfig
from graphrt.errors import ConfigMismatchError
from graphrt.kernels.vocab_parallel import vocab_shard
from graphrt.parallel.group import TensorParallel

ShardRule = Callable[[str], "tuple[int, int, int] | None"]


def target_shard_rule(cfg: ModelConfig, tp: TensorParallel) -> ShardRule:
    """The slicing rule of rank tp.rank for a target with config cfg."""
    q0, nq, kv0, nkv = tp.heads(cfg.num_attention_heads, cfg.num_key_value_heads)
    hd, inter = cfg.head_dim, cfg.intermediate_size
    if inter % tp.world_size:
        raise ConfigMismatchError(f"tensor_parallel_size {tp.world_size} does not divide intermediate_size {inter}")
    if cfg.vocab_size < tp.world_size:
        raise ConfigMismatchError(f"vocab_size {cfg.vocab_size} is smaller than tensor_parallel_size {tp.world_size}")
    i0, ni = tp.rank * inter // tp.world_size, inter // tp.world_size
    v0, v1 = vocab_shard(cfg.vocab_size, tp.world_size, tp.rank)
    rows = {"q_proj": (q0 * hd, (q0 + nq) * hd), "k_proj": (kv0 * hd, (kv0 + nkv) * hd),
            "v_proj": (kv0 * hd, (kv0 + nkv) * hd), "gate_proj": (i0, i0 + ni), "up_proj": (i0, i0 + ni)}
    cols = {"o_proj": (q0 * hd, (q0 + nq) * hd), "down_proj": (i0, i0 + ni)}

    def rule(name: str):
        parts = name.split(".")
        if name in ("embed_tokens.weight", "lm_head.weight"):
            return 0, v0, v1
        if len(parts) < 2:
            return None
        proj = parts[-2]
        if proj in rows:
            return (0, *rows[proj])
        if proj in cols and parts[-1] == "weight":
            return (1, *cols[proj])
        return None

    rule.parallel = (tp.rank, tp.world_size)
    return rule


def shard_tensor(t, rule_result):
    if rule_result is None:
        return t
    dim, start, end = rule_result
    return t.narrow(dim, start, end - start).contiguous()


def shard_checkpoint(ckpt: Checkpoint, tp: TensorParallel) -> Checkpoint:
    """This rank's slice of an already loaded target (load_checkpoint(..., shard=rule) reads only
    the slice from disk instead)."""
    rule = target_shard_rule(ckpt.config, tp)
    weights = {n: shard_tensor(t, rule(n)) for n, t in ckpt.weights.items()}
    if ckpt.weights.get("lm_head.weight") is ckpt.weights.get("embed_tokens.weight"):
        weights["lm_head.weight"] = weights["embed_tokens.weight"]  # tied: one tensor, as loaded
    return replace(ckpt, weights=weights, parallel=rule.parallel)
