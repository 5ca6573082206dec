"""Model construction from loaded checkpoints.

A draft is anything with the draft interface: `draft_forward(tokens, positions, meta, kv,
hidden_in) -> state [N, H]` (a tensor, or a kernels/residual_add.PendingAdd whose sum draft_head's
norm computes and stores), `draft_head(state) -> (x, w)` (its LM head's input, a tensor or a
kernels/norm.PendingNorm, and weight [V_draft, H]: the draft logits are linear(x, w)), `token_map`
(the target id of each draft id, [V_draft] int64, or None where they are the same),
`position_offset`, `uses_target_hidden` (and then `target_hidden` in {"final", "aux"}), `num_layers`,
`cfg` and `logits_shard` (argmax's group and vocab_size when w is a tensor-parallel vocab shard,
else {}). A draft whose `extends_last_rows` is true also takes draft_forward(...,
rows=(indices, metadata), into=buffer): every row's KV, then only those rows' states.
"""

from __future__ import annotations

from graphrt.kernels.fp8_weight import quantize_fp8
from graphrt.models.decoder_lm import DecoderLM
from graphrt.models.eagle import Eagle3Head, EagleHead

DRAFT_QUANTIZATIONS = ("fp8",)


def build_target(ckpt, max_positions: int, device, tp=None) -> DecoderLM:
    """tp: this rank's graphrt.parallel.TensorParallel when ckpt holds its slice of the target."""
    return DecoderLM(ckpt.config, ckpt.weights, max_positions, device, tp=tp)


def build_draft(ckpt, target: DecoderLM, max_positions: int, device, tp=None):
    """tp: this rank's graphrt.parallel.TensorParallel when ckpt holds its slice of an EAGLE-3 head
    (graphrt/parallel/shard.draft_shard_rule); other drafts are whole on every rank."""
    if ckpt.kind == "lm":
        return DecoderLM(ckpt.config, ckpt.weights, max_positions, device)
    if ckpt.kind == "eagle":
        return EagleHead(ckpt.config, ckpt.weights, target, max_positions, device)
    if ckpt.kind == "eagle3":
        return Eagle3Head(ckpt.config, ckpt.weights, target, max_positions, device,
                          aux_layer_ids=ckpt.config.aux_layer_ids_for(target.cfg), tp=tp)
    raise ValueError(f"unknown draft kind {ckpt.kind!r}")


def quantize_draft(draft, method: str) -> None:
    """Make the draft read its projections as `method` (DRAFT_QUANTIZATIONS; kernels/fp8_weight.py):
    every layer's qkv, o, gate_up and down, an EAGLE head's fc and the draft's own LM head. What
    a draft borrows from the target (an EAGLE-1/2 head's LM head, a shared embedding) stays as it
    is, and so do embeddings and norms, which a step reads a row or a vector of. Runtime checks
    `method` against DRAFT_QUANTIZATIONS."""
    for layer in draft.layers:
        attn, mlp = layer.attn, layer.mlp
        attn.qkv_weight, attn.o_weight = quantize_fp8(attn.qkv_weight), quantize_fp8(attn.o_weight)
        mlp.gate_up, mlp.down = quantize_fp8(mlp.gate_up), quantize_fp8(mlp.down)
    if hasattr(draft, "fc_weight"):
        draft.fc_weight = quantize_fp8(draft.fc_weight)
    if not isinstance(draft, EagleHead):  # an EAGLE-1/2 head's LM head is the target's
        draft.lm_head = quantize_fp8(draft.lm_head)


__all__ = ["DecoderLM", "EagleHead", "Eagle3Head", "build_target", "build_draft", "quantize_draft",
           "DRAFT_QUANTIZATIONS"]
