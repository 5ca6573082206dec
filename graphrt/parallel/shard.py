"""Which slice of each target tensor a tensor-parallel rank holds (Megatron's layout):

  q/k/v_proj (+ bias)   column-parallel: the rank's q heads and KV heads (rows)
  o_proj                row-parallel: the matching input columns; its output is all-reduced
  gate_proj, up_proj    column-parallel: intermediate_size / W rows each
  down_proj             row-parallel: the matching columns; output all-reduced
  embed_tokens, lm_head vocab-parallel: rows [start, end) of kernels/vocab_parallel.vocab_shard
  everything else       replicated (norms, q/k norms)

A rule maps a canonical tensor name to (dim, start, end) or None (whole tensor), so the loader reads
only the rank's bytes from a safetensors file (graphrt/checkpoint.load_checkpoint's `shard`).

An EAGLE-3 head is split the same way (draft_shard_rule): its layer's projections by heads and
intermediate rows, its draft-vocabulary LM head by rows, which the vocab-parallel argmax reads; fc
(3 H -> H, DRAFT_EXTEND only), d2t, the norms and an own embedding table stay whole. A draft step
reads the whole head once per token, as a target step does, so splitting it pays as the target's
split does (a replicated head takes as long per draft step at TP = 4 as at TP = 1). Other drafts
(a standalone LM, an EAGLE-1/2 head, which already projects with the target's vocab-parallel LM
head) are replicated.
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
    return _rule(cfg, tp, cfg.vocab_size, ("embed_tokens.weight", "lm_head.weight"))


def draft_shard_rule(cfg: ModelConfig, tp: TensorParallel) -> ShardRule | None:
    """The slicing rule of rank tp.rank for an EAGLE-3 head with config cfg, or None where the head
    stays replicated (another kind of draft, or a head whose heads, rows or vocabulary the ranks do
    not divide)."""
    if cfg.kind != "eagle3":
        return None
    try:
        return _rule(cfg, tp, cfg.draft_vocab_size, ("lm_head.weight",))
    except ConfigMismatchError:
        return None


def _rule(cfg: ModelConfig, tp: TensorParallel, vocab_size: int, vocab_tensors: tuple[str, ...]) -> ShardRule:
    q0, nq, kv0, nkv = tp.heads(cfg.num_attention_heads, cfg.num_key_value_heads)
    hd, inter = cfg.head_dim, cfg.intermediate_size
    if inter % tp.world_size:
        raise ConfigMismatchError(f"tensor_parallel_size {tp.world_size} does not divide intermediate_size {inter}")
    if vocab_size < tp.world_size:
        raise ConfigMismatchError(f"vocab_size {vocab_size} is smaller than tensor_parallel_size {tp.world_size}")
    i0, ni = tp.rank * inter // tp.world_size, inter // tp.world_size
    v0, v1 = vocab_shard(vocab_size, tp.world_size, tp.rank)
    rows = {"q_proj": (q0 * hd, (q0 + nq) * hd), "k_proj": (kv0 * hd, (kv0 + nkv) * hd),
            "v_proj": (kv0 * hd, (kv0 + nkv) * hd), "gate_proj": (i0, i0 + ni), "up_proj": (i0, i0 + ni)}
    cols = {"o_proj": (q0 * hd, (q0 + nq) * hd), "down_proj": (i0, i0 + ni)}

    def rule(name: str):
        parts = name.split(".")
        if name in vocab_tensors:
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


def shard_checkpoint(ckpt: Checkpoint, tp: TensorParallel, rule: ShardRule | None = None) -> Checkpoint:
    """This rank's slice of an already loaded target, or of a draft under `rule`
    (load_checkpoint(..., shard=rule) reads only the slice from disk instead)."""
    rule = rule or target_shard_rule(ckpt.config, tp)
    weights = {n: shard_tensor(t, rule(n)) for n, t in ckpt.weights.items()}
    if ckpt.weights.get("lm_head.weight") is ckpt.weights.get("embed_tokens.weight"):
        weights["lm_head.weight"] = weights["embed_tokens.weight"]  # tied: one tensor, as loaded
    return replace(ckpt, weights=weights, parallel=rule.parallel)
