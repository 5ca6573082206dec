"""A trainable EAGLE-3 head with the training-time test (TTT) of the EAGLE-3 paper.

The head is the one graphrt runs (graphrt/models/eagle.py), written as a differentiable module:

  step 0   h = fc(cat(low, mid, high))              the target's aux residual streams, [.., 3H] -> H
  step k   x = cat(input_norm(embed(token)), hidden_norm(h));  h' = h + o(attn(x));  h' += mlp(post_norm(h'))
           logits = lm_head(norm(h'))  over the draft vocabulary;  h <- h' for step k + 1

Row i of a sequence pairs the target's features at position i with token i+1 and predicts the token
at i+2, at rotary position i (one behind the tokens, graphrt's `position_offset` -1). Step k of the
TTT unrolls what DRAFT_DECODE does at inference: row i takes token i+1+k and its own step k-1 output,
sits at position i+k, and attends to the step-0 keys of rows 0..i (what DRAFT_EXTEND stored from the
target's features) plus its own keys of steps 1..k (what the earlier draft steps stored). That mask,
and positions that advance with the step, are those of SafeAILab/EAGLE's traineagle3 and of graphrt's
cycle, so teacher-forced chain accuracy predicts graphrt's acceptance.

Attention is eager (scores materialised, [B, heads, T, T]): training sequences are short and the
diagonal keys of steps >= 1 do not fit a fused causal kernel.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from graphrt.checkpoint_writer import draft_config, stored_name
from graphrt.config import ModelConfig
from graphrt.kernels.norm import rms_norm_reference as _rms
from graphrt.kernels.rotary import rotate_reference as _rotate
from graphrt.models.layers import rope_inv_freq


class Eagle3Trainable(nn.Module):
    """Parameters under the canonical names graphrt loads (`state_dict_canonical`)."""

    def __init__(self, cfg: ModelConfig, embed: torch.Tensor, draft_ids: torch.Tensor):
        """cfg: an eagle3 ModelConfig (graphrt.checkpoint_writer.draft_config); embed: the target's
        token embedding [V, H] (frozen, not saved: published heads use the target's); draft_ids:
        [draft_vocab] int64, sorted target ids of the draft vocabulary."""
        super().__init__()
        if cfg.kind != "eagle3":
            raise ValueError(f"need an eagle3 config, got {cfg.architecture!r}")
        H, Ht, nh, nkv, D = (cfg.hidden_size, cfg.target_hidden_size, cfg.num_attention_heads,
                             cfg.num_key_value_heads, cfg.head_dim)
        self.cfg = cfg
        self.nh, self.nkv, self.D = nh, nkv, D
        self.register_buffer("embed", embed.detach(), persistent=False)
        self.register_buffer("draft_ids", draft_ids.to(torch.int64), persistent=False)
        self.fc = nn.Linear(3 * Ht, H, bias=False)
        self.input_norm = nn.Parameter(torch.ones(H))
        self.hidden_norm = nn.Parameter(torch.ones(H))
        self.q_proj = nn.Linear(2 * H, nh * D, bias=False)
        self.k_proj = nn.Linear(2 * H, nkv * D, bias=False)
        self.v_proj = nn.Linear(2 * H, nkv * D, bias=False)
        self.o_proj = nn.Linear(nh * D, H, bias=False)
        self.post_norm = nn.Parameter(torch.ones(H))
        self.gate_proj = nn.Linear(H, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(H, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, H, bias=False)
        self.norm = nn.Parameter(torch.ones(H))
        self.lm_head = nn.Linear(H, cfg.draft_vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(D, cfg.rope_theta, cfg.rope_scaling), persistent=False)

    # -- published layout ---------------------------------------------------------------------------

    _CANONICAL = {"fc": "fc.weight", "input_norm": "layers.0.input_layernorm.weight",
                  "hidden_norm": "layers.0.hidden_norm.weight", "post_norm": "layers.0.post_attention_layernorm.weight",
                  **{p: f"layers.0.self_attn.{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "o_proj")},
                  **{p: f"layers.0.mlp.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")},
                  "norm": "norm.weight", "lm_head": "lm_head.weight"}

    def state_dict_canonical(self) -> dict[str, torch.Tensor]:
        out = {}
        for attr, name in self._CANONICAL.items():
            p = getattr(self, attr)
            out[name] = (p.weight if isinstance(p, nn.Linear) else p).detach()
        return out

    def load_canonical(self, weights: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for attr, name in self._CANONICAL.items():
                p = getattr(self, attr)
                (p.weight if isinstance(p, nn.Linear) else p).copy_(weights[name])

    def d2t_t2d(self) -> tuple[torch.Tensor, torch.Tensor]:
        """d2t [draft_vocab] int64 (target = draft + d2t[draft]) and t2d [V] bool."""
        ids = self.draft_ids.cpu()
        t2d = torch.zeros(self.cfg.vocab_size, dtype=torch.bool)
        t2d[ids] = True
        return ids - torch.arange(ids.numel()), t2d

    def save(self, path: str | Path, *, dtype: torch.dtype = torch.bfloat16, extra: dict | None = None) -> Path:
        """Write the published EAGLE-3 layout: config.json (LlamaForCausalLMEagle3, draft_vocab_size,
        target_hidden_size), model.safetensors with midlayer.* / fc / norm / lm_head / d2t / t2d."""
        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        name = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}[dtype]
        cfg = self.cfg.with_(torch_dtype=name)
        (path / "config.json").write_text(json.dumps(cfg.to_hf_dict(), indent=2) + "\n")
        tensors = {stored_name(k, "eagle3"): v.to(dtype).contiguous().cpu() for k, v in
                   self.state_dict_canonical().items()}
        tensors["d2t"], tensors["t2d"] = self.d2t_t2d()
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt", **(extra or {})})
        return path

    @classmethod
    def for_target(cls, target_cfg: ModelConfig, target_weights: dict, draft_ids: torch.Tensor, *,
                   seed: int = 0) -> Eagle3Trainable:
        """A fresh head for a graphrt target: the layer at HF's initialisation (normal, std 0.02),
        the LM head started from the target's own LM head rows of the draft vocabulary and the final
        norm from the target's, so step 0 starts near "predict what the fused state would"."""
        cfg = draft_config(target_cfg, target_cfg, "eagle3", draft_vocab_size=int(draft_ids.numel()))
        embed = target_weights["embed_tokens.weight"].float()
        torch.manual_seed(seed)
        head = cls(cfg, embed, draft_ids)
        for mod in head.modules():
            if isinstance(mod, nn.Linear):
                nn.init.normal_(mod.weight, std=0.02)
        with torch.no_grad():
            head.lm_head.weight.copy_(target_weights["lm_head.weight"].float()[draft_ids.cpu()])
            head.norm.copy_(target_weights["norm.weight"].float())
        return head

    # -- forward ------------------------------------------------------------------------------------

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[..., None] * self.inv_freq.float()  # [B, T, D/2]
        emb = torch.cat([freqs, freqs], dim=-1)[:, None]  # [B, 1, T, D]
        return emb.cos(), emb.sin()

    def step(self, tokens, hidden, positions, cache_k, cache_v, causal_mask):
        """One TTT step. tokens [B, T] int64 (target ids); hidden [B, T, H]; positions [B, T];
        cache_k/v: lists of earlier steps' keys/values [B, nkv, T, D] (step 0 first); causal_mask
        [T, T] bool. Returns (h' [B, T, H], logits [B, T, draft_vocab] fp32); appends to the caches."""
        B, T, _ = hidden.shape
        eps = self.cfg.rms_norm_eps
        emb = F.embedding(tokens, self.embed).to(hidden.dtype)
        x = torch.cat([_rms(emb, self.input_norm, eps), _rms(hidden, self.hidden_norm, eps)], dim=-1)
        q = self.q_proj(x).view(B, T, self.nh, self.D).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.nkv, self.D).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.nkv, self.D).transpose(1, 2)
        cos, sin = self._rope(positions)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        cache_k.append(k)
        cache_v.append(v)
        rep = self.nh // self.nkv
        kk = [c.repeat_interleave(rep, dim=1) for c in cache_k]
        vv = [c.repeat_interleave(rep, dim=1) for c in cache_v]
        scale = self.D**-0.5
        s0 = (q @ kk[0].transpose(2, 3)).float() * scale  # [B, nh, T, T]
        s0 = s0.masked_fill(~causal_mask, float("-inf"))
        diag = [((q * kj).sum(-1).float() * scale)[..., None] for kj in kk[1:]]  # [B, nh, T, 1] each
        p = torch.softmax(torch.cat([s0, *diag], dim=-1), dim=-1).to(q.dtype)
        out = p[..., :T] @ vv[0]
        for j, vj in enumerate(vv[1:]):
            out = out + p[..., T + j, None] * vj
        out = out.transpose(1, 2).reshape(B, T, self.nh * self.D)
        h = hidden + self.o_proj(out)
        m = _rms(h, self.post_norm, eps)
        h = h + self.down_proj(F.silu(self.gate_proj(m)) * self.up_proj(m))
        logits = self.lm_head(_rms(h, self.norm, eps)).float()
        return h, logits

    def unroll(self, aux: torch.Tensor, ids: torch.Tensor, steps: int):
        """The TTT chain over whole sequences. aux: [B, T, 3*Ht] target aux streams at each position;
        ids: [B, T] token ids (right-padded). Yields (k, logits_k [B, T, draft_vocab]) for k < steps;
        row i of step k predicts the token at position i + k + 2."""
        B, T, _ = aux.shape
        device = aux.device
        hidden = self.fc(aux.to(self.fc.weight.dtype))
        causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()
        base = torch.arange(T, device=device)[None, :].expand(B, T)
        pad = torch.zeros(B, steps + 1, dtype=ids.dtype, device=device)
        shifted = torch.cat([ids, pad], dim=1)
        cache_k, cache_v = [], []
        for k in range(steps):
            tokens = shifted[:, 1 + k : 1 + k + T]  # row i: token i+1+k
            hidden, logits = self.step(tokens, hidden, base + k, cache_k, cache_v, causal)
            yield k, logits

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return self.draft_ids[draft_ids]
