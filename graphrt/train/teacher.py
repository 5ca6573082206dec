"""The target as a teacher: its aux residual streams and next-token logits over whole sequences.

It runs through Hugging Face transformers, built from the weights graphrt loaded, not through
graphrt's own forward: the aux streams (the stream entering layer j, graphrt's aux-id convention)
come from an implementation graphrt does not share, so a head trained on them keeps its
acceptance in graphrt only if graphrt feeds it the same states; the estimate is the check.
"""

from __future__ import annotations

import torch

from graphrt.checkpoint import Checkpoint


def hf_model(ckpt: Checkpoint, *, device, dtype: torch.dtype):
    """A transformers causal LM with `ckpt`'s weights (Llama, Qwen2, Qwen3 configs)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    d = ckpt.config.to_hf_dict()
    config = AutoConfig.for_model(d.pop("model_type"), **{k: v for k, v in d.items() if k != "architectures"})
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    state = {("lm_head.weight" if k == "lm_head.weight" else "model." + k): v for k, v in ckpt.weights.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not (m == "lm_head.weight" and ckpt.config.tie_word_embeddings)]
    if missing or unexpected:
        raise ValueError(f"teacher weights do not fit: missing {missing[:4]}, unexpected {unexpected[:4]}")
    if ckpt.config.tie_word_embeddings:
        model.tie_weights()
    return model.to(device=device, dtype=dtype).eval()


@torch.no_grad()
def features(model, ids: torch.Tensor, lengths: torch.Tensor, aux_ids: tuple[int, ...]):
    """ids: [B, T] right-padded; lengths: [B]. Returns (aux [B, T, 3H] = the streams entering the aux
    layers, final [B, T, H] = the final-norm hidden state the LM head reads), in the model's dtype."""
    T = ids.shape[1]
    mask = (torch.arange(T, device=ids.device)[None, :] < lengths[:, None]).long()
    inner = model.model
    # The stream entering layer j is that layer's input (entering "layer L" is the final norm's
    # input): hooks, because hidden_states[L] is already normalised.
    taps = [*inner.layers, inner.norm]
    seen: dict[int, torch.Tensor] = {}

    def tap(j):
        def hook(module, args, kwargs):
            seen[j] = args[0] if args else kwargs["hidden_states"]
        return hook

    handles = [taps[j].register_forward_pre_hook(tap(j), with_kwargs=True) for j in set(aux_ids)]
    try:
        out = inner(input_ids=ids, attention_mask=mask)
    finally:
        for h in handles:
            h.remove()
    return torch.cat([seen[j] for j in aux_ids], dim=-1), out.last_hidden_state
