"""Llama-family decoder LMs (Llama 2/3, Qwen2, Qwen3): the target model and standalone drafts."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from graphrt.kernels.linear import linear
from graphrt.kernels.norm import add_rms_norm, rms_norm
from graphrt.kernels.push_reduce import embedding_pushed, embedding_pushed_reference
from graphrt.kernels.vocab_parallel import vocab_shard
from graphrt.models.layers import AttentionMetadata, DecoderLayer, Rotary


class DecoderLM:
    """forward() returns the final-norm hidden states (what the LM head reads, and what an
    EAGLE-1/2 head pairs with the next token) and, if asked, the residual stream at the input of
    the layers in `aux_layer_ids` (what an EAGLE-3 head fuses).

    tp: a graphrt.parallel.TensorParallel when the weights are this rank's slice
    (graphrt/parallel/shard.py): the layers all-reduce their row-parallel outputs, the embedding
    looks up its vocab shard and all-reduces, and logits() returns the rank's vocab shard, which the
    kernels take with `logits_shard` (argmax, rejection_sample: group and vocab_size)."""

    def __init__(self, cfg, weights: dict, max_positions: int, device, tp=None):
        self.cfg = cfg
        self.tp = tp
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, max_positions, device)
        self.embed = weights["embed_tokens.weight"]
        self.lm_head = weights["lm_head.weight"]
        self.norm = weights["norm.weight"]
        self.layers = [
            DecoderLayer(weights, f"layers.{i}", cfg, self.rotary, tp=tp) for i in range(cfg.num_hidden_layers)
        ]
        self.aux_layer_ids: tuple[int, ...] = ()
        self.logits_shard = {}
        if tp is not None:
            self.vocab_start = vocab_shard(cfg.vocab_size, tp.world_size, tp.rank)[0]
            self.logits_shard = dict(group=tp.group, vocab_size=cfg.vocab_size)

    def embed_tokens(self, tokens):
        """tokens [N] int64 -> [N, H]. Vocab-parallel: each rank gathers the rows it holds, zeros
        elsewhere, and the all-reduce sums one row and zeros: exact."""
        if self.tp is None:
            return F.embedding(tokens, self.embed)
        summed = embedding_pushed(tokens, self.embed, self.vocab_start, self.tp.push)
        if summed is not None:  # one token: the sum in the lookup's own launch
            return summed
        return self.tp.all_reduce(embedding_pushed_reference(tokens, self.embed, self.vocab_start))

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def forward(self, tokens, positions, meta: AttentionMetadata, kv):
        """tokens, positions: [N] int64. Returns (hidden [N, H], aux [N, len(aux)*H] or None)."""
        x = self.embed_tokens(tokens)
        # The stream is carried as (x, residual), summed inside the next layer's fused add + norm
        # (DecoderLayer.forward_residual); residual None means the stream is x itself.
        residual = None
        streams = {}  # residual stream entering layer j (j = num_layers: after the last layer)
        for i, layer in enumerate(self.layers):
            x, residual, entering = layer.forward_residual(x, residual, positions, meta, kv.k[i], kv.v[i])
            if i in self.aux_layer_ids:
                streams[i] = entering
        if residual is None:
            streams[len(self.layers)] = x
            hidden = rms_norm(x, self.norm, self.cfg.rms_norm_eps)
        else:
            hidden, streams[len(self.layers)] = add_rms_norm(x, residual, self.norm, self.cfg.rms_norm_eps)
        aux = [streams[j] for j in self.aux_layer_ids]  # low, mid, high; ids may repeat on tiny targets
        return hidden, (torch.cat(aux, dim=-1) if aux else None)

    def logits(self, hidden):
        """[N, V] ([N, vocab shard] under tensor parallelism)."""
        return linear(hidden, self.lm_head)  # Triton at decode sizes (kernels/gemv.py)

    # The draft interface (see graphrt/models/__init__.py): a standalone LM drafts from its own
    # tokens only, at the tokens' own positions.
    position_offset = 0
    uses_target_hidden = False
    token_map = None  # as a draft: its ids are the target's

    def draft_forward(self, tokens, positions, meta, kv, hidden_in):
        hidden, _ = self.forward(tokens, positions, meta, kv)
        return hidden

    def draft_head(self, state):
        return state, self.lm_head
