"""Peers on the same checkpoint: Hugging Face transformers' own decoding, timed the same way.

Each figure is generated tokens over the time of a `generate` call identical to a warm-up call
run just before it: transformers compiles `generate` for static caches (and recompiles for a new
cache length), so timing a call of a different length than the warm-up times the compiler. The
prompt pass is included (a 32-token prompt costs about one decode step). min_new_tokens pins the
length (random weights hit an EOS id by chance).
"""

from __future__ import annotations

import os
import time

import torch


def _timed_generate(model, ids, new_tokens, **kw) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, **kw)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def decode_tokens_per_s(model, ids, new_tokens: int, **kw) -> float:
    _timed_generate(model, ids, new_tokens, **kw)  # warm-up: compilation, caches, allocation
    return ids.shape[0] * new_tokens / _timed_generate(model, ids, new_tokens, **kw)


def hf_from_pretrained(path, **kw):
    """transformers' model of a checkpoint folder or of a GGUF file (transformers dequantizes it)."""
    from transformers import AutoModelForCausalLM

    from graphrt.gguf_checkpoint import find_gguf

    file = find_gguf(path)
    if file is None:
        return AutoModelForCausalLM.from_pretrained(path, **kw)
    file = os.path.abspath(file)
    return AutoModelForCausalLM.from_pretrained(os.path.dirname(file), gguf_file=os.path.basename(file), **kw)


def pad_with_eos(model) -> int:
    """Set the model's pad token to its (first) EOS token, as batched generate needs; returns it."""
    eos = model.generation_config.eos_token_id
    model.generation_config.pad_token_id = eos[0] if isinstance(eos, (list, tuple)) else eos
    return model.generation_config.pad_token_id


def as_assistant(draft, num_draft_tokens: int):
    """Configure an HF model as assisted generation's draft: a fixed num_draft_tokens a step, no
    confidence cut-off (graphrt's K drafts). Returns it."""
    draft.generation_config.num_assistant_tokens = num_draft_tokens
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    draft.generation_config.assistant_confidence_threshold = 0.0
    return draft


def run_hf(target_dir, draft_dir=None, *, batch_sizes=(1, 8, 64), prompt_len=32, new_tokens=64,
           num_draft_tokens=3) -> list[dict]:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    load = dict(dtype=torch.bfloat16)
    model = hf_from_pretrained(target_dir, **load).cuda().eval()
    pad_with_eos(model)
    g = torch.Generator().manual_seed(0)
    rows = []
    with torch.inference_mode():
        for b in batch_sizes:
            ids = torch.randint(0, model.config.vocab_size, (b, prompt_len), generator=g).cuda()
            modes = [("hf-dynamic-cache", {}), ("hf-static-cache", {"cache_implementation": "static"})]
            for name, kw in modes[: 1 if b > 1 else 2]:  # the static cache at batch 1 only
                tps = decode_tokens_per_s(model, ids, new_tokens, **kw)
                rows.append({"mode": name, "batch_size": b, "tokens_per_s": tps})
        if draft_dir is not None:
            draft = as_assistant(hf_from_pretrained(draft_dir, **load).cuda().eval(), num_draft_tokens)
            ids = torch.randint(0, model.config.vocab_size, (1, prompt_len), generator=g).cuda()
            tps = decode_tokens_per_s(model, ids, new_tokens, assistant_model=draft)
            # Acceptance, measured like graphrt's: tokens after the first over target forwards after
            # the prompt pass (each verify forward emits its accepted drafts plus one token).
            calls = [0]
            hook = model.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
            try:
                _timed_generate(model, ids, new_tokens, assistant_model=draft)
            finally:
                hook.remove()
            rows.append({"mode": "hf-assisted", "batch_size": 1, "tokens_per_s": tps,
                         "mean_acceptance_length": (new_tokens - 1) / max(calls[0] - 1, 1),
                         "target_forwards": calls[0]})
            del draft
    del model
    torch.cuda.empty_cache()
    return rows
