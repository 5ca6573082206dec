"""The decode cycle, top to bottom.

Per speculative cycle with K drafts (docs/design.md, "The cycle"):

  TARGET_VERIFY  target over [last verified token, d_1 .. d_K] -> fused rejection -> 1..K+1 tokens
  DRAFT_EXTEND   draft over the K+1 emitted positions -> argmax at the last emitted one: next d_1
                 (a one-layer EAGLE head: KV for all K+1, the rest of the layer on the last one)
  DRAFT_DECODE   K-1 more argmax steps: next d_2 .. d_K

TARGET_DECODE is the draft-less step and PREFILL the prompt pass (the requests admitted together
in one forward, captured per padded shape). Every phase reads and writes only the static buffers of
`DecodeState` (sliced to the bucket size), so each one can be captured once per bucket as a CUDA
graph and replayed: no host sync, no `.item()`, no shape that depends on data.

State invariant at the start of a cycle, for a request with n verified tokens t_0 .. t_{n-1}:
  target KV holds positions [0, n-1); t_{n-1} is `last_token`;
  a standalone draft's KV holds [0, n); an EAGLE head's holds [0, n-1) (its row i pairs the hidden
  state of position i with token i+1, so it runs one position behind: `position_offset` = -1);
  `draft_tokens` holds d_1 .. d_K, the guesses for positions n .. n+K-1.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from graphrt.kernels import argmax, rejection_sample
from graphrt.kernels.argmax import Proposal
from graphrt.kernels.cycle_index import (
    SCRATCH_NUM_TOKENS,
    CycleInputs,
    advance,
    cycle_inputs,
    cycle_inputs_reference,
    pin_scratch,
)
from graphrt.kernels.draft_head import propose_from_head
from graphrt.kernels.residual_add import summed
from graphrt.kernels.simulated_acceptance import simulate_acceptance
from graphrt.kv_cache import TRASH_BLOCK, KVPool
from graphrt.models.layers import AttentionMetadata
from graphrt.packed import packed
from graphrt.profiling.nvtx_ranges import PhaseHooks
from graphrt.profiling.phases import DRAFT_DECODE, DRAFT_EXTEND, PREFILL, TARGET_DECODE, TARGET_VERIFY


class DecodeState:
    """Static device buffers, allocated once at the maximum batch size.

    Per slot (max_batch_size request slots + one scratch slot, the last, that padded batch rows
    use) and per batch row (a batch row names its slot through `batch_slots`).
    """

    def __init__(self, *, max_batch_size, num_draft_tokens, max_blocks, target_hidden_size, draft_state_size,
                 hidden_dtype=torch.float32, device, simulate_acceptance: bool = False):
        S, B, K = max_batch_size, max_batch_size, max(num_draft_tokens, 1)
        i64 = dict(dtype=torch.int64, device=device)
        self.scratch_slot = S
        # per slot
        self.num_tokens = torch.full((S + 1,), SCRATCH_NUM_TOKENS, **i64)  # as the scratch slot is held
        self.last_token = torch.zeros(S + 1, **i64)
        self.draft_tokens = torch.zeros(S + 1, K, **i64)
        # per batch row: the draft token each row last proposed (the next draft step's input), so
        # DRAFT_DECODE starts from DRAFT_EXTEND's token without a gather by slot
        self.proposed = torch.zeros(B, **i64)
        self.temperature = torch.zeros(S + 1, dtype=torch.float32, device=device)
        self.seed = torch.zeros(S + 1, **i64)
        # the filters (SamplingParams.top_k / top_p / min_p; off by default), passed to the sampler
        # only once a request has used one: until then the phases launch no threshold kernel
        self.top_k = torch.zeros(S + 1, **i64)
        self.top_p = torch.ones(S + 1, dtype=torch.float32, device=device)
        self.min_p = torch.zeros(S + 1, dtype=torch.float32, device=device)
        self.filtering = False
        self.block_tables = torch.full((S + 1, max_blocks), TRASH_BLOCK, dtype=torch.int32, device=device)
        # per batch row. The host writes the inputs and reads the results each cycle, each group as
        # one packed buffer (graphrt/packed.py): one copy per direction.
        self.inputs, (self.batch_slots, self.batch_num_drafts) = packed(self.input_specs(B), device)
        self.batch_slots.fill_(S)  # batch_num_drafts: 0 on padded rows, which count no acceptances
        # What the host last copied into `inputs`, so an unchanged batch needs no copy; anything
        # else that writes batch_slots or batch_num_drafts sets it to None.
        self.staged = None
        self.batch_n = torch.zeros(B, **i64)  # n at the start of this cycle
        self.results, (self.emitted, self.num_emitted, self.logprobs) = packed(
            self.result_specs(B, num_draft_tokens), device)
        self.emitted.fill_(-1)
        self.acceptance_counts = torch.zeros(K, **i64)
        hid = dict(dtype=hidden_dtype, device=device)
        self.target_hidden = None if target_hidden_size is None else torch.zeros(
            B * (K + 1), target_hidden_size, **hid)
        self.draft_state = None if draft_state_size is None else torch.zeros(B, draft_state_size, **hid)
        # simulated acceptance (kernels/simulated_acceptance.py): its per-draft acceptance rate,
        # a buffer so that a new rate needs no new graphs
        self.simulated_rate = torch.zeros(1, dtype=torch.float32, device=device) if simulate_acceptance else None

    @staticmethod
    def input_specs(max_batch_size):
        """batch_slots [B] int64, batch_num_drafts [B] int64."""
        return [((max_batch_size,), torch.int64)] * 2

    @staticmethod
    def result_specs(max_batch_size, num_draft_tokens):
        """emitted [B, K+1] int64, num_emitted [B] int32, logprobs [B, K+1] fp32 (K = 0: plain decoding)."""
        W = num_draft_tokens + 1
        return [((max_batch_size, W), torch.int64), ((max_batch_size,), torch.int32),
                ((max_batch_size, W), torch.float32)]

    def filters(self, slots=None, values: dict | None = None) -> dict:
        """rejection_sample's filter arguments for these slots, or none while no request filters.
        values: the rows' top_k, top_p and min_p tensors by name, where the caller has them already
        (a prefill's inputs), instead of gathering the slots' buffers."""
        if not self.filtering:
            return {}
        names = ("top_k", "top_p", "min_p")
        return {n: values[n] for n in names} if values is not None else {n: getattr(self, n)[slots] for n in names}

    def reset_scratch(self):
        pin_scratch(self.num_tokens, self.last_token, self.scratch_slot)


class Cycle:
    def __init__(self, *, target, draft, target_kv: KVPool, draft_kv: KVPool | None, state: DecodeState,
                 num_draft_tokens: int):
        self.target, self.draft = target, draft
        self.target_kv, self.draft_kv = target_kv, draft_kv
        self.s = state
        self.K = num_draft_tokens
        self.block_size = target_kv.block_size
        self.max_seq_len = state.block_tables.shape[1] * self.block_size  # what a block table can address
        self.no_drafts = torch.zeros(state.batch_slots.shape[0], 0, dtype=torch.int64, device=state.num_tokens.device)
        self.offset = draft.position_offset if draft is not None else 0
        # NVTX range (+ PhaseTimer, + torch profiler range when one runs) around every phase launch
        self.hooks = PhaseHooks()
        # graphrt.capture.graphs.CycleGraphs once captured, by whether their sampler runs the filters'
        # kernels (DecodeState.filtering); `graphs` is the set the state's flag picks
        self.graph_sets: dict = {}

    @property
    def graphs(self):
        """The captured set of graphs the cycles replay now (None: run eagerly)."""
        return self.graph_sets.get(self.s.filtering)

    def _inputs(self, slots, T: int, **kw) -> CycleInputs:
        """The rows' positions, attention metadata and (by request) tokens and sampling state, in
        one launch (kernels/cycle_index.py). By default row b starts at num_tokens[slots[b]] - 1."""
        s = self.s
        kw.setdefault("src", s.num_tokens)
        kw.setdefault("base_add", -1)
        return cycle_inputs(slots, block_tables=s.block_tables, T=T, block_size=self.block_size, **kw)

    def _meta(self, inputs: CycleInputs, step: int | None = None) -> AttentionMetadata:
        """inputs' attention metadata; step: that one-token step of step-major inputs (a row view)."""
        seq_lens, slot_mapping, query_len = inputs.seq_lens, inputs.slot_mapping, inputs.positions.shape[1]
        if step is not None:
            seq_lens, slot_mapping, query_len = seq_lens[step], slot_mapping[step], 1
        return AttentionMetadata(block_tables=inputs.block_tables, seq_lens=seq_lens, slot_mapping=slot_mapping,
                                 query_len=query_len, max_seq_len=self.max_seq_len)

    def _prompt_inputs(self, slots, T: int, starts, cached: bool) -> tuple[torch.Tensor, AttentionMetadata]:
        """(positions [n * T], attention metadata) of positions starts .. starts + T - 1 of each
        slot's request (slots, starts: [n]; starts: the prompt tokens already in cached KV blocks),
        once per prefill: the torch reference, as the Triton launch (T a constant of its kernel) would
        compile a variant for every prompt length the eager forward meets. cached: some row starts
        past 0 (prefix caching). Without one every row's keys end at T, so T bounds the attention's
        KV range (a short prompt runs unsplit, with no merge launch); with one a row's keys reach its
        start + T, up to the table's capacity."""
        x = cycle_inputs_reference(slots, starts, self.s.block_tables, T=T, block_size=self.block_size, by_slot=False)
        meta = self._meta(x)
        positions = x.positions.flatten()
        if not cached:
            return positions, replace(meta, max_seq_len=T)
        # A row padded from past a cached prefix can run past the table, where the slot mapping's
        # clamp to the last column would store onto the row's own positions: those store nowhere.
        return positions, replace(meta, slot_mapping=torch.where(positions < self.max_seq_len, meta.slot_mapping, -1))

    def _advance(self, slots, n, B):
        s = self.s
        advance(slots, n, s.num_emitted[:B], s.emitted[:B], s.num_tokens, s.last_token, s.scratch_slot)

    # ---- TARGET_VERIFY ------------------------------------------------------------------------
    def target_verify(self, B: int) -> None:
        s, K = self.s, self.K
        slots = s.batch_slots[:B]
        n = s.batch_n[:B]  # num_tokens at the rows' slots, written by _inputs into the static buffer
        x = self._inputs(slots, K + 1, n_out=n, tokens=(s.last_token, s.draft_tokens),
                         sampling=(s.temperature, s.seed))
        drafts = x.tokens[:, 1:]  # [B, K]
        hidden, aux = self.target.forward(x.tokens.flatten(), x.positions.flatten(), self._meta(x),
                                          self.target_kv)
        logits = self.target.logits(hidden).view(B, K + 1, -1)
        simulated = s.simulated_rate is not None
        seed = x.seed
        shard = self.target.logits_shard  # under tensor parallelism: the rank's vocab shard
        rejection_sample(  # writes the cycle's results straight into the static buffers
            logits, drafts, x.temperature, seed, n,
            num_draft_tokens=s.batch_num_drafts[:B], acceptance_counts=None if simulated else s.acceptance_counts,
            out=(s.emitted[:B], s.num_emitted[:B], s.logprobs[:B]), **s.filters(slots), **shard,
        )
        if simulated:  # benchmarking: the same cycle, with the accepted counts drawn at a set rate
            # a vocab shard cannot give the row's top-1 alone: every row's, vocab-parallel
            top = argmax(logits.flatten(0, 1), **shard)[1].view(B, K + 1) if shard else None
            simulate_acceptance(logits, drafts, s.batch_num_drafts[:B], seed, n, s.simulated_rate, top=top,
                                out=(s.emitted[:B], s.num_emitted[:B], s.logprobs[:B], s.acceptance_counts))
        if s.target_hidden is not None:
            s.target_hidden[: B * (K + 1)] = aux if self.draft.target_hidden == "aux" else hidden
        self._advance(slots, n, B)

    # ---- DRAFT_EXTEND -------------------------------------------------------------------------
    def draft_extend(self, B: int) -> None:
        s, K = self.s, self.K
        slots = s.batch_slots[:B]
        # -1 marks "not emitted"; those rows are computed and ignored, but must not index the
        # embedding with -1: the tokens read it as 0.
        x = self._inputs(slots, K + 1, src=s.batch_n, by_slot=False, base_add=self.offset,
                         emitted=(s.emitted, s.num_emitted))
        hidden_in = s.target_hidden[: B * (K + 1)] if s.target_hidden is not None else None
        last = x.last  # [B]: the row of each request's last emitted token
        meta = self._meta(x)
        rows = {}
        if getattr(self.draft, "extends_last_rows", False):  # past the KV store, the last rows only
            rows = dict(rows=(last, replace(meta, seq_lens=x.last_seq_lens, query_len=1)),
                        into=s.draft_state[:B] if s.draft_state is not None else None)
        state = self.draft.draft_forward(x.tokens.flatten(), x.positions.flatten(), meta, self.draft_kv,
                                         hidden_in, **rows)
        if not rows:  # (with rows the state is [B, H], in draft_state once _propose's LM head has run)
            # Gathered straight into the static buffer (one kernel, no copy node). A copy node here
            # drew initcheck reports on its source at the graph's first replay although the gather
            # before it writes every byte (docs/notes/benchmarks-history.md, Reliability).
            state = summed(state)
            state = state[last] if s.draft_state is None else torch.index_select(state, 0, last,
                                                                                 out=s.draft_state[:B])
        self._propose(slots, state, column=0)

    # ---- DRAFT_DECODE -------------------------------------------------------------------------
    def draft_decode(self, B: int, slots=None) -> None:
        """slots: the batch rows' slots, default batch_slots[:B] (what the captured graph reads)."""
        s = self.s
        if self.K < 2:  # one draft token: DRAFT_EXTEND proposed it
            return
        slots = s.batch_slots[:B] if slots is None else slots
        # The K-1 one-token steps, the first at num_tokens + offset: positions [K-1, B] and metadata made
        # in one launch and handed out as row views, so the unrolled steps launch no metadata kernels.
        x = self._inputs(slots, self.K - 1, base_add=self.offset, step_major=True)
        positions, metas = x.positions, [self._meta(x, i) for i in range(self.K - 1)]
        # Each step feeds the next its token and (EAGLE) state straight from the tensors it made;
        # only DRAFT_EXTEND's hand-over goes through the static buffers.
        tokens = s.proposed[:B]
        hidden_in = s.draft_state[:B] if s.draft_state is not None else None
        for i in range(1, self.K):
            state = self.draft.draft_forward(tokens, positions[i - 1], metas[i - 1], self.draft_kv, hidden_in)
            tokens = self._propose(slots, state, column=i)
            hidden_in = summed(state) if s.draft_state is not None else None  # its sum: made in _propose's LM head

    def _propose(self, slots, state, *, column: int) -> torch.Tensor:
        """Top-1 draft token from the draft's state rows [B, H]: argmax, never a softmax, mapped to
        target ids in the argmax's last step. Writes it to draft_tokens[slots, column] and to
        proposed[:B], which it returns ([B] int64)."""
        proposal = Proposal(self.draft.token_map, self.s.draft_tokens, slots, column)
        return propose_from_head(*self.draft.draft_head(state), proposal, self.s.proposed[: slots.shape[0]],
                                 **self.draft.logits_shard)

    # ---- TARGET_DECODE ------------------------------------------------------------------------
    def target_decode(self, B: int) -> None:
        s = self.s
        slots = s.batch_slots[:B]
        n = s.batch_n[:B]
        x = self._inputs(slots, 1, n_out=n, tokens=(s.last_token, s.draft_tokens), sampling=(s.temperature, s.seed))
        hidden, _ = self.target.forward(x.tokens[:, 0], x.positions[:, 0], self._meta(x), self.target_kv)
        logits = self.target.logits(hidden).view(B, 1, -1)
        rejection_sample(logits, self.no_drafts[:B], x.temperature, x.seed, n,  # results straight to the buffers
                         out=(s.emitted[:B], s.num_emitted[:B], s.logprobs[:B]), **s.filters(slots),
                         **self.target.logits_shard)
        self._advance(slots, n, B)

    # ---- one cycle ----------------------------------------------------------------------------
    @property
    def timer(self):
        """A graphrt.profiling.phase_timer.PhaseTimer while phases are being timed, else None."""
        return self.hooks.timer

    @timer.setter
    def timer(self, timer):
        self.hooks.timer = timer

    def phases(self):
        """The phase launches of one cycle, in order: [(name, function of the bucket size)]."""
        if self.draft is None:
            return [(TARGET_DECODE, self.target_decode)]
        phases = [(TARGET_VERIFY, self.target_verify), (DRAFT_EXTEND, self.draft_extend)]
        if self.K > 1:
            phases.append((DRAFT_DECODE, self.draft_decode))
        return phases

    def run(self, B: int) -> None:
        """One cycle at bucket size B: each phase replays its CUDA graph when one was captured for
        this bucket, else runs eagerly. Either way it sits inside one timer/NVTX phase."""
        for name, fn in self.phases():
            graph = self.graphs.get(name, B) if self.graphs is not None else None
            with self.hooks.phase(name, B):
                if graph is not None:
                    graph.replay()
                else:
                    fn(B)

    # ---- PREFILL (the requests admitted together, one forward) ---------------------------------
    # Each request's sampling parameters, as prefill_forward writes them to its slot's buffers.
    SAMPLING = ("temperature", "seed", "top_k", "top_p", "min_p")

    def prefill_specs(self, rows: int, length: int):
        """prefill_forward's inputs as one packed buffer: tokens [rows, length + 1] int64 (prompts
        padded at their ends, a last column for the first token), lens [rows] int64, starts [rows]
        int64 (the tokens before each prompt's, in cached KV blocks), nexts [rows] int64 (-1, or
        the prompt token after a chunk that is not its prompt's last), slots [rows] int64, the
        slots' block tables [rows, max_blocks] int32, then their sampling parameters (SAMPLING)
        [rows] each in its state buffer's dtype."""
        s = self.s
        return ([((rows, length + 1), torch.int64), ((rows,), torch.int64), ((rows,), torch.int64),
                 ((rows,), torch.int64), ((rows,), torch.int64), ((rows, s.block_tables.shape[1]), torch.int32)]
                + [((rows,), getattr(s, name).dtype) for name in self.SAMPLING])

    def prefill_inputs(self, rows: int, length: int, device):
        """(buffer, views) of prefill_specs on device, every row a padding row: a one-token prompt
        on the scratch slot, whose block table (the trash block) and sampling (greedy, no filter)
        it writes back unchanged."""
        buf, views = packed(self.prefill_specs(rows, length), device)
        _, lens, _, nexts, slots, table, *sampling = views
        lens.fill_(1)
        nexts.fill_(-1)
        slots.fill_(self.s.scratch_slot)
        table.fill_(TRASH_BLOCK)
        dict(zip(self.SAMPLING, sampling, strict=True))["top_p"].fill_(1.0)  # the others' defaults are 0
        return buf, views

    def prefill(self, slots: list[int], prompts: list[list[int]], starts: list[int], blocks: list[list[int]],
                sampling: list[tuple], shape: tuple[int, int] | None = None, graph=None,
                nexts: list[int] | None = None):
        """slots: the n requests' slots; prompts: their n lists of token ids; starts: each one's
        first position (past the prompt tokens its cached KV blocks hold); blocks: their KV block
        ids; sampling: their SAMPLING values; nexts: per prompt, -1, or when it is a chunk of a longer
        prompt (default none), the prompt token after it, which the draft reads at the chunk's last
        position instead of the drawn token (the slot's state is then not yet a cycle's: a later
        chunk, the last, leaves it so). One forward over the prompts, each padded at its end
        to the longest, or to shape = (rows, length), a prefill graph's (graph: that
        graphrt.capture.graphs.PrefillGraph, replayed instead of running the forward; captured with
        `cached` set where some start is past 0): rows past n prefill a one-token prompt on the
        scratch slot. Everything goes to the device in one copy. Leaves each slot in the cycle-start
        state and returns the first generated tokens and their logprobs, [n] device tensors each;
        (None, None) for a chunk (nexts given), which draws none."""
        n = len(prompts)
        rows, length = shape or (n, max(map(len, prompts)))
        cached, chunk = any(starts), nexts is not None
        # another kind's attention would miss or overreach keys; it would draw no first token, or one
        if graph is not None and (graph.cached, graph.chunk) != (cached, chunk):
            raise ValueError(f"a prefill graph captured with cached={graph.cached}, chunk={graph.chunk} for starts "
                             f"{starts}, nexts {nexts}")
        host, views = self.prefill_inputs(rows, length, "cpu")
        tokens, lens, row_starts, row_nexts, row_slots, table, *params = views
        if nexts is not None:
            row_nexts.numpy()[:n] = nexts
        # through numpy views of the host buffer: a tensor per row cost ~30 us a request on the host
        tokens_np, table_np = tokens.numpy(), table.numpy()
        for i, (p, b) in enumerate(zip(prompts, blocks, strict=True)):
            tokens_np[i, : len(p)] = p
            table_np[i, : len(b)] = b
        lens.numpy()[:n] = [len(p) for p in prompts]
        row_slots.numpy()[:n] = slots
        row_starts.numpy()[:n] = starts
        for buf, values in zip(params, zip(*sampling)):
            buf.numpy()[:n] = values
        with self.hooks.phase(PREFILL, n):  # (the phase's timer and NVTX range: from the copy on)
            if graph is not None:
                graph.inputs.copy_(host)
                graph.graph.replay()
                first, logprobs = graph.outputs
            else:
                buf, views = packed(self.prefill_specs(rows, length), self.s.num_tokens.device)
                buf.copy_(host)
                first, logprobs = self.prefill_forward(*views, cached=cached, chunk=chunk)
        return (None, None) if chunk else (first[:n], logprobs[:n])

    def prefill_forward(self, tokens: torch.Tensor, lens: torch.Tensor, starts: torch.Tensor, nexts: torch.Tensor,
                        slots: torch.Tensor, table: torch.Tensor, *sampling: torch.Tensor, cached: bool = False,
                        chunk: bool = False):
        """tokens [R, P + 1], lens [R], starts [R], nexts [R], slots [R], table [R, max_blocks],
        sampling [R] each (prefill_specs): prompt r is tokens[r, :lens[r]] at positions starts[r] on
        (the KV of the positions before it already in its table's blocks), its slot's block table
        and sampling parameters are written first. cached: some start may be past 0 (without it each
        must be 0, and the attention reads keys up to P only). A padding row sits at a position
        after its prompt, which no row of its own prompt attends to (causal), and stores its KV
        where the first cycles write before they read (past the request's blocks: the trash block).
        chunk: every row is a chunk that is not its prompt's last (nexts set) or padding: no LM head,
        no first token and no draft proposal, only the KV of its positions (the last chunk leaves the
        slot's state). Every shape is static, so a prefill graph captures it. Returns (first tokens
        [R] int64, their logprobs [R] fp32), or (None, None) for chunks."""
        s, dev = self.s, tokens.device
        s.block_tables[slots] = table
        params = dict(zip(self.SAMPLING, sampling, strict=True))
        for name, values in params.items():
            getattr(s, name)[slots] = values
        R, P = tokens.shape[0], tokens.shape[1] - 1
        rows = torch.arange(R, device=dev)
        hidden, aux = self.target.forward(tokens[:, :P].flatten(), *self._prompt_inputs(slots, P, starts, cached),
                                          self.target_kv)
        if chunk:
            first = out = None
        else:
            logits = self.target.logits(hidden[rows * P + lens - 1]).view(R, 1, -1)  # each prompt's last row
            out = rejection_sample(logits, self.no_drafts[:R], params["temperature"], params["seed"], starts + lens,
                                   **s.filters(values=params), **self.target.logits_shard)
            first = out.token_ids[:, 0]  # [R]
            s.num_tokens[slots] = starts + lens + 1
            s.last_token[slots] = first
        if self.draft is not None:  # the token after each prompt: drawn, or a chunk's next prompt token
            # (nexts is -1 in every row of an ordinary prefill: no select there)
            tokens[rows, lens] = torch.where(nexts >= 0, nexts, tokens[rows, lens]) if chunk else first
            if self.draft.uses_target_hidden:  # rows (h_j, t_{j+1}) at positions 0 .. P-1
                hidden_in = aux if self.draft.target_hidden == "aux" else hidden
                tokens, T, last = tokens[:, 1:], P, lens - 1
            else:  # rows t_0 .. t_P at positions 0 .. P
                hidden_in, T, last = None, P + 1, lens
            state = summed(self.draft.draft_forward(tokens.flatten(), *self._prompt_inputs(slots, T, starts, cached),
                                                    self.draft_kv, hidden_in))
            if not chunk:  # (a chunk's drafts would be thrown away: the last chunk proposes)
                state = state[rows * T + last]  # each request's row at its last real position
                if s.draft_state is not None:
                    s.draft_state[:R] = state  # batch rows 0 .. R-1: what draft_decode(R, slots) reads
                self._propose(slots, state, column=0)
                self.draft_decode(R, slots)
        s.reset_scratch()  # the padding rows' slot
        return (None, None) if chunk else (first, out.logprobs[:, 0])
