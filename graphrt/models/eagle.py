"""EAGLE draft heads. Each drafts from (token, hidden state) pairs: the row at position i pairs
a hidden state for position i with the token at i+1, and its output predicts the token at i+2.
That is why an EAGLE draft runs one position behind the tokens it consumes (position_offset -1).
In DRAFT_DECODE the head feeds its own output hidden state back in place of the target's."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from graphrt.kernels.eagle3_input import eagle3_input, eagle3_input_unfused
from graphrt.kernels.linear import linear, one_row_product
from graphrt.kernels.norm import PendingNorm
from graphrt.kernels.residual_add import PendingAdd, summed
from graphrt.models.layers import DecoderLayer, Rotary


class _EagleBase:
    """What both EAGLE generations share: one position behind, the target's hidden states as
    input, and the target's embedding table unless the head ships its own. Published heads have one
    layer; a head with more runs them all (layers 1.. are plain pre-norm decoder layers)."""

    position_offset = -1
    uses_target_hidden = True

    def __init__(self, cfg, weights: dict, target, max_positions: int, device):
        self.cfg = cfg
        self.num_layers = cfg.num_hidden_layers
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, max_positions, device)
        # A head without its own table looks tokens up in the target's, vocab-parallel included.
        own = weights.get("embed_tokens.weight")
        self.embed = target.embed if own is None else own
        self.embed_tokens = target.embed_tokens if own is None else (lambda tokens: F.embedding(tokens, own))
        self.fc_weight = weights["fc.weight"]
        self.logits_shard = {}
        self.token_map = None  # draft ids are target ids

    @property
    def extends_last_rows(self) -> bool:
        """Whether draft_forward takes rows=: with one layer (the published heads), a row's layer
        output feeds only the next token's draft, so past the KV store DRAFT_EXTEND needs each
        request's last emitted row alone: attention, o, the MLP and the LM head run at B rows, not
        B * (K + 1), and at B = 1 on the one-row paths (their fusions, FP8 weights)."""
        return self.num_layers == 1

    def _run_layers(self, first_args, positions, meta, kv, rows, into):
        """The first layer on first_args, then the rest; with rows (extends_last_rows), the one layer's
        KV for every row and only those rows' states, written into `into` when given."""
        if rows is not None:
            return self.layers[0](*first_args, positions, meta, kv.k[0], kv.v[0], rows, into)
        x = self.layers[0](*first_args, positions, meta, kv.k[0], kv.v[0])
        for i, layer in enumerate(self.layers[1:], start=1):
            x = layer(x, positions, meta, kv.k[i], kv.v[i])
        return x

    def draft_head(self, state):
        return state, self.lm_head


class EagleHead(_EagleBase):
    """EAGLE-1/2: fc([token embedding ; target final hidden state]) -> one decoder layer (the
    published heads have no input norm on it) -> the target's LM head, with no final norm."""

    target_hidden = "final"

    def __init__(self, cfg, weights: dict, target, max_positions: int, device):
        super().__init__(cfg, weights, target, max_positions, device)
        # the target's LM head, vocab shard and all (logits_shard tells argmax which)
        self.lm_head, self.logits_shard = target.lm_head, target.logits_shard
        self.fc_bias = weights.get("fc.bias")
        self.layers = [DecoderLayer(weights, f"layers.{i}", cfg, self.rotary,
                                    has_input_norm=i > 0 or cfg.has_input_layernorm)
                       for i in range(cfg.num_hidden_layers)]

    def draft_forward(self, tokens, positions, meta, kv, hidden_in, rows=None, into=None):
        """rows (extends_last_rows): (indices [B], their one-query metadata); see _run_layers."""
        x = linear(torch.cat([self.embed_tokens(tokens), hidden_in], dim=-1), self.fc_weight, self.fc_bias)
        return self._run_layers((x,), positions, meta, kv, rows, into)


class Eagle3Layer(DecoderLayer):
    """The EAGLE-3 decoder layer: attention reads [norm(embedding) ; hidden_norm(hidden)] (2H wide)
    while the residual carries the un-normalised hidden state."""

    def __init__(self, weights, prefix, cfg, rotary, tp=None, last=False):
        """last: the head's only layer, whose residual add goes into the down GEMV's epilogue or
        the final norm's launch (a PendingAdd)."""
        super().__init__(weights, prefix, cfg, rotary, tp=tp)
        self.hidden_norm = weights[f"{prefix}.hidden_norm.weight"]
        self.norm_before_residual = cfg.norm_before_residual
        self.last = last

    def __call__(self, tokens, table, hidden, positions, meta, k_cache, v_cache, rows=None, into=None):
        """table: the embedding table [V, H] the tokens index, or a function of the tokens (a
        vocab-parallel lookup); with a table, the gather and both norms run in one launch
        (kernels/eagle3_input.py). rows: as AttentionBlock's (every row's KV, then those rows
        only); into: where the output stream goes (a new tensor when None), added in the down
        GEMV's epilogue where it can; elsewhere the last layer returns a PendingAdd, which the
        final norm's launch adds."""
        # the residual: of every row, or gathered for rows (in the same launch where it can)
        args = (hidden, self.input_norm, self.hidden_norm, self.eps, self.norm_before_residual,
                None if rows is None else rows[0])
        if isinstance(table, torch.Tensor):
            x, residual = eagle3_input(tokens, table, *args)
        else:
            x, residual = eagle3_input_unfused(table(tokens), *args)
        # the residual add and post-attention norm run in the gate_up GEMV's prologue where it can
        h = PendingNorm(self.attn(x, positions, meta, k_cache, v_cache, rows), residual, self.post_norm, self.eps)
        total = self.mlp(h, residual=lambda: h.stream, into=into)
        return total if self.last else summed(total)


class Eagle3Head(_EagleBase):
    """EAGLE-3: fc fuses the target's low/mid/high residual streams (3H -> H) on the first step;
    later steps feed back the head's own pre-norm output. Its LM head covers a reduced draft
    vocabulary; d2t maps a draft id to a target id (target = draft + d2t[draft]).

    tp: a graphrt.parallel.TensorParallel when the weights are this rank's slice
    (graphrt/parallel/shard.draft_shard_rule): the layers all-reduce as the target's do, and
    its LM head is the rank's shard of the draft vocabulary, which argmax takes with logits_shard."""

    target_hidden = "aux"

    def __init__(self, cfg, weights: dict, target, max_positions: int, device, *, aux_layer_ids: tuple[int, ...],
                 tp=None):
        super().__init__(cfg, weights, target, max_positions, device)
        if tp is not None:
            self.logits_shard = dict(group=tp.group, vocab_size=cfg.draft_vocab_size)
        self.aux_layer_ids = aux_layer_ids  # the target layers whose entering streams it reads
        # what the first layer gathers embeddings from: the table when whole (the head's own or an
        # unsharded target's), else the target's vocab-parallel lookup
        own = "embed_tokens.weight" in weights
        self.embed_source = self.embed if own or target.tp is None else self.embed_tokens
        self.norm = weights["norm.weight"]
        self.lm_head = weights["lm_head.weight"]
        # draft id -> target id as one table (target = draft + d2t[draft]), read by the argmax's last step
        self.token_map = torch.arange(cfg.draft_vocab_size, device=device) + weights["d2t"].to(torch.int64)
        self.layers = [Eagle3Layer(weights, "layers.0", cfg, self.rotary, tp, last=cfg.num_hidden_layers == 1)] + [
            DecoderLayer(weights, f"layers.{i}", cfg, self.rotary, tp=tp) for i in range(1, cfg.num_hidden_layers)]

    def draft_forward(self, tokens, positions, meta, kv, hidden_in, rows=None, into=None):
        """rows, into: as EagleHead.draft_forward's."""
        if hidden_in.shape[-1] != self.cfg.hidden_size:  # the target's fused aux states
            hidden_in = linear(hidden_in, self.fc_weight)
        return self._run_layers((tokens, self.embed_source, hidden_in), positions, meta, kv, rows, into)

    def draft_head(self, state):
        # The final norm in the draft LM head GEMV's prologue where it can. A one-layer head's
        # residual add, where its down GEMV did not take it (a PendingAdd), goes there too only
        # where the norm runs a launch of its own (add_rms_norm): in the one-row GEMV's prologue
        # (its programs each read x and the residual) it measured slower than the add's own launch
        # (docs/notes/benchmarks-history.md, 2026-11-27).
        eps = self.cfg.rms_norm_eps
        if isinstance(state, PendingAdd):
            if not one_row_product(state.out, self.lm_head):
                return state.normed(self.norm, eps), self.lm_head
            state = state.materialize()
        return PendingNorm(state, None, self.norm, eps), self.lm_head
