"""Weight bytes each phase of a cycle must read: the floor its time is judged against.

Counted from the configs (graphrt.checkpoint.expected_shapes), per launch of the phase:
  - a tied embedding is the LM head: read once, whole; an untied embedding table only by the rows
    a step looks up (a few KB): not counted;
  - TARGET_VERIFY and TARGET_DECODE read every target weight once, whatever the batch;
  - an EAGLE-1/2 head projects with the target's LM head: its bytes belong to every draft step;
  - an EAGLE-3 head's fc (3 H_target -> H) runs only on the target's features, in DRAFT_EXTEND;
    each DRAFT_DECODE step reads its layers, norm and own (draft-vocabulary) LM head;
  - DRAFT_DECODE is K - 1 such steps;
  - a draft quantized to FP8 (graphrt.models.quantize_draft) reads one byte per weight of its own
    (draft_weight_bytes), its per-row scales (under 0.1%) left out, a borrowed target LM head at
    the target's width;
  - under tensor parallelism over W ranks, per rank: the target's bytes (and an EAGLE-1/2 head's
    share of its LM head) / W, an EAGLE-3 head's split weights / W and its fc whole (when the
    ranks divide it: graphrt/parallel/shard.draft_shard_rule), any other draft's whole (the
    replicated norms, under 0.01% of the weights, are left out: the floor stays a lower bound).
KV-cache reads are left out: at the context lengths the bench runs they are under 1% of the bytes.
"""

from __future__ import annotations

from math import prod

from graphrt.checkpoint import expected_shapes
from graphrt.config import ModelConfig


def _bytes(cfg: ModelConfig, dtype_bytes: int, keep=lambda name: True) -> int:
    """Every weight a forward reads (an untied embedding table not at all) whose name `keep` takes."""
    shapes = expected_shapes(cfg)
    return dtype_bytes * sum(prod(shape) for n, shape in shapes.items()
                             if keep(n) and (n != "embed_tokens.weight" or cfg.tie_word_embeddings))


def lm_bytes(cfg: ModelConfig, dtype_bytes: int = 2) -> int:
    """One forward of a decoder LM: every weight once."""
    return _bytes(cfg, dtype_bytes)


def phase_bytes(target: ModelConfig, draft: ModelConfig | None = None, num_draft_tokens: int = 3,
                dtype_bytes: int = 2, tensor_parallel: int = 1, draft_split: bool = False,
                draft_weight_bytes: int | None = None) -> dict[str, int]:
    """{phase: weight bytes per launch (per rank)} for the phases a runtime with this target and
    draft runs. draft_split: the ranks hold slices of an EAGLE-3 head. draft_weight_bytes: the
    draft's bytes per weight (default dtype_bytes; 1 for an FP8 draft)."""
    t = lm_bytes(target, dtype_bytes) // tensor_parallel
    out = {"TARGET_DECODE": t}
    if draft is None:
        return out
    out["TARGET_VERIFY"] = t
    db = dtype_bytes if draft_weight_bytes is None else draft_weight_bytes
    if draft.kind == "lm":
        extend = step = _bytes(draft, db)
    elif draft.kind == "eagle":
        head = dtype_bytes * target.vocab_size * target.hidden_size // tensor_parallel
        extend = step = _bytes(draft, db) + head
    else:  # eagle3
        step = _bytes(draft, db, lambda n: n != "fc.weight") // (tensor_parallel if draft_split else 1)
        extend = step + _bytes(draft, db, lambda n: n == "fc.weight")
    out["DRAFT_EXTEND"] = extend
    if num_draft_tokens > 1:
        out["DRAFT_DECODE"] = (num_draft_tokens - 1) * step
    return out
