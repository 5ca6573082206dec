"""Admission: which waiting requests a prefill forward takes, its launch, and the reading of the
first tokens it draws. graphrt.Runtime's, as a mixin: these methods work on the runtime's queue,
slots, KV blocks (with prefix caching, the cached ones) and cycle, which graphrt/runtime.py sets up.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from graphrt.cycle import Cycle

if TYPE_CHECKING:
    from graphrt.runtime import _Request

# Padded prompt tokens a prefill forward takes at most: the requests admitted together share one
# forward (its launches, or its graph's replay, paid once) while padding them to the longest stays
# within max_seq_len or _PREFILL_GRAPH_TOKENS, whichever is more (one prompt may take max_seq_len
# anyway), and within _PREFILL_TOKENS.
_PREFILL_TOKENS = 8192
# Under CUDA graphs a prefill of up to this many padded tokens replays a graph captured for its
# shape: rows a batch bucket, the prompts padded to a power of two of at least 16 tokens. The eager
# forward's launches cost the host more than the forward's GPU time at these sizes (25-40 ms on a
# 30-layer model against about 1 ms replayed: RESULTS.md). Larger prefills run eagerly: their GPU
# time outweighs the launches, and their graphs would keep that much more activation memory.
_PREFILL_GRAPH_TOKENS = 4096


class Admission:
    """The prefill side of graphrt.Runtime (its base class)."""

    def admit(self) -> None:
        """Prefill now the waiting requests that a free slot and their KV blocks admit, first come
        first served, in one forward (padded to the longest prompt; for the tokens a forward takes at
        most, see _PREFILL_TOKENS; under graphs, a prefill that a graph's shape holds only grows while
        one still does). A prompt longer than prefill_chunk_tokens takes one chunk a call, in a
        forward of its own; the requests behind it whose prompts need no chunks are admitted
        meanwhile, one that does waits for it.
        step() does it first; an engine calls it to have their first tokens, and pay the prefill,
        before the next cycle."""
        self._admit()
        self._first_tokens()

    def _admit(self, chunks: bool = True) -> None:
        """admit() up to the prefills' launches; _first_tokens reads what they drew. chunks=False:
        no chunk of a chunked prefill (step() launches one, before its cycle)."""
        budget = min(_PREFILL_TOKENS, max(self.max_seq_len, _PREFILL_GRAPH_TOKENS))
        chunk = self.prefill_chunk_tokens
        batch: list[_Request] = []
        longest = 0
        held = None  # a prompt part way through its chunks, out of the queue while the ones behind it are admitted
        try:
            while self._waiting:
                req = self._waiting[0]
                if req.slot >= 0:  # part way through a chunked prefill: its next chunk (it heads the queue)
                    if chunks:
                        self._prefill_chunk(req)
                        chunks = False  # one chunk a call: another long prompt starts at the next
                    if self._waiting and self._waiting[0] is req:  # more chunks to come
                        held = self._waiting.popleft()
                    continue
                if not self._free_slots:
                    break
                keys = self.kv_blocks.keys(req.prompt) if self.prefix_caching else []
                matched = self.kv_blocks.match(keys)
                need = self._blocks_needed(len(req.prompt), req.params) - len(matched)
                if need > self.kv_blocks.free_after_taking(matched):
                    break  # wait for running requests to free blocks (first come, first served)
                rest = len(req.prompt) - len(matched) * self.block_size  # what the prefill computes
                chunked = chunk is not None and rest > chunk
                if chunked and not chunks:
                    break
                grown = max(longest, rest)
                # A batch whose padded shape has a prefill graph does not grow past every graph: the
                # eager forward would cost the host tens of ms of launches (_PREFILL_GRAPH_TOKENS)
                if batch and (chunked or (len(batch) + 1) * grown > budget
                              or self._prefill_shape(len(batch) + 1, grown) is None
                              and self._prefill_shape(len(batch), longest) is not None):
                    self._prefill(batch)
                    batch, longest = [], 0
                req.slot = self._free_slots.pop()
                req.blocks = self.kv_blocks.take(matched, need)
                req.cached = req.done = len(matched) * self.block_size
                if chunked:  # a chunk a call, between cycles, so that running requests keep decoding
                    req.keys = keys
                    continue  # (its first chunk, at the head of the queue)
                longest = max(longest, rest)
                self._waiting.popleft()
                if self.prefix_caching:  # the next requests of this batch find these blocks too
                    self.kv_blocks.remember(keys, req.blocks)
                batch.append(req)
            if batch:
                self._prefill(batch)
        finally:  # (also when a prefill failed: its requests wait again behind this one)
            if held is not None:
                self._waiting.appendleft(held)

    def _prefill_chunk(self, req: _Request) -> None:
        """The next prefill_chunk_tokens of a long prompt, whose request heads the queue holding its
        slot and blocks; the last chunk is an ordinary prefill (its first token, then the cycles)."""
        end = req.done + self.prefill_chunk_tokens
        last = end >= len(req.prompt)
        self._waiting.popleft()
        if self.prefix_caching:  # the whole blocks written once this chunk has run
            n = len(req.keys) if last else end // self.block_size
            self.kv_blocks.remember(req.keys[:n], req.blocks[:n])
        self._prefill([req], None if last else end)

    def _blocks_needed(self, prompt_len, params) -> int:
        return -(-(prompt_len + params.max_new_tokens + self.slack) // self.block_size)

    def _prefill(self, reqs: list[_Request], end: int | None = None) -> None:
        """Launch the requests' prefill (end: the one request's chunk ends there, short of its
        prompt's end; it heads the queue again for its next chunk) and queue its first tokens."""
        try:
            first, logprob = self._prefill_launch(reqs, end)
            done = None
            # into host memory in stream order: a later prefill reuses its graph's outputs
            if end is None and self.overlap:
                first, logprob = (torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda).copy_(t, non_blocking=True)
                                  for t in (first, logprob))
                if first.is_pinned():
                    done = torch.cuda.Event()
                    done.record()
        except BaseException:
            # (out of memory, an interrupt): the requests wait again at the head of the queue, first
            # come first served, and their slots and blocks are free, so the runtime stays usable (a
            # chunked one starts over). The blocks past what each one's cached prefix or launched
            # chunks hold were new to it: unkeyed, as their KV is unwritten
            if self.prefix_caching:
                self.kv_blocks.forget([b for r in reqs for b in r.blocks[r.done // self.block_size:]])
            for req in reqs:
                self._free(req)
            self._waiting.extendleft(reversed(reqs))
            raise
        self._counts["prefills"] += 1
        self._counts["prompt_tokens"] += sum((len(r.prompt) if end is None else end) - r.done for r in reqs)
        if end is not None:  # a chunk's drawn token is dropped
            reqs[0].done = end
            self._waiting.appendleft(reqs[0])
            return
        self._counts["cached_prompt_tokens"] += sum(r.cached for r in reqs)
        for req in reqs:
            self._running[req.slot] = req
        last_chunk = reqs[0].done > reqs[0].cached  # (chunks before it: a prefill of one request)
        self._admitted.append((reqs, first, logprob, done, last_chunk))
        if not self.overlap:
            self._first_tokens()

    def _prefill_launch(self, reqs: list[_Request], end: int | None = None):
        """Launch the prefill of each request's prompt from req.done on (to end, see _prefill)."""
        s = self.state
        # the prompt's token honours the requests' filters (the graphs of the set that runs them)
        filtering, s.filtering = s.filtering, s.filtering or any(r.params.filters for r in reqs)
        try:
            prompts = [r.prompt[r.done:end] for r in reqs]
            shape = self._prefill_shape(len(reqs), max(map(len, prompts)))
            graph = None
            if shape is not None and self.use_cuda_graphs:  # (a shape alone pads, as tests do on the CPU)
                # a prefill past cached blocks has keys past its padded length: a graph of its own
                graph = self._graphs().prefill(*shape, cached=any(r.done for r in reqs), chunk=end is not None)
            sampling = [tuple(r.seed if name == "seed" else getattr(r.params, name) for name in Cycle.SAMPLING)
                        for r in reqs]
            chunk = {} if end is None else {"nexts": [reqs[0].prompt[end]]}
            return self.cycle.prefill([r.slot for r in reqs], prompts, [r.done for r in reqs], [r.blocks for r in reqs],
                                      sampling, shape, graph, **chunk)
        finally:
            s.filtering = filtering

    def _prefill_shape(self, n: int, longest: int) -> tuple[int, int] | None:
        """The padded shape (rows, length) of the prefill graph for n prompts of up to `longest`
        tokens; None: this prefill runs eagerly."""
        if not self.use_cuda_graphs or self.tp is not None:
            return None
        rows = next(b for b in self.buckets if b >= n)
        length = self._padded_length(longest)
        return (rows, length) if rows * length <= _PREFILL_GRAPH_TOKENS else None

    def _padded_length(self, tokens: int) -> int:
        """A prefill graph's length for prompts of up to `tokens` tokens: the next power of two of
        at least 16, within the block table (a padding row's position must stay inside it: the
        draft's last one is `length`)."""
        return min(max(16, 1 << (tokens - 1).bit_length()), self.cycle.max_seq_len - 1)

    def prefill_shapes(self) -> list[tuple[int, int]]:
        """Every (rows, padded length) a prefill graph of this runtime can have, largest first; none
        without CUDA graphs or under tensor parallelism (prefill is eager there). Under chunked
        prefill no prefill computes more than prefill_chunk_tokens of a prompt."""
        cap = self._padded_length(self.prefill_chunk_tokens if self._chunks() else self.cycle.max_seq_len)
        lengths = {min(cap, 1 << i) for i in range(4, max(cap - 1, 1).bit_length() + 1)}
        shapes = {self._prefill_shape(rows, length) for rows in self.buckets for length in lengths}
        return sorted((x for x in shapes if x is not None), key=lambda x: (-x[0] * x[1], -x[0]))

    def prefill_graph_keys(self) -> list[tuple[int, int, bool, bool]]:
        """Every prefill graph this runtime can replay: (rows, length, cached, chunk). cached: some
        row starts past its prompt's first token (past cached blocks, or a chunk after the first:
        its attention reaches past its padded length). chunk: a chunk that is not its prompt's last,
        alone and prefill_chunk_tokens long, which draws no first token; the last chunk is a prefill
        past the others (cached)."""
        shapes = self.prefill_shapes()
        keys = [(*shape, False, False) for shape in shapes]
        if self.prefix_caching:
            keys += [(*shape, True, False) for shape in shapes]
        if self._chunks():
            if not self.prefix_caching:
                keys += [(*shape, True, False) for shape in shapes if shape[0] == self.buckets[0]]
            chunk = self._prefill_shape(1, self.prefill_chunk_tokens)
            if chunk is not None:
                keys += [(*chunk, cached, True) for cached in (False, True)]
        return keys

    def _chunks(self) -> bool:
        """Whether some prompt can be longer than prefill_chunk_tokens (then it is chunked)."""
        return self.prefill_chunk_tokens is not None and self.prefill_chunk_tokens < self.cycle.max_seq_len - 1

    def _first_tokens(self, cycle: list[_Request] | None = None) -> None:
        """Emit the first tokens of the prefills launched since the last call (a request aborted
        since gets none), once they have run. step() calls it once the next cycle is launched, so
        that the GPU does not wait for the host between a prefill and the cycle after, with the
        requests of the cycle it reads next (cycle): a chunked prompt's last chunk that runs after
        that cycle is not waited for (else that step would wait for two chunks, the one before the
        cycle and this one), its first token comes with the next call. (Not whether it has run by
        now: under tensor parallelism every rank must emit the same tokens at the same call.)"""
        if not self._admitted:
            return
        n = len(self._admitted)
        if cycle is not None:
            rids = {r.rid for r in cycle}
            n = next((n - i for i, (reqs, *_, last_chunk) in enumerate(reversed(self._admitted))
                      if not last_chunk or any(r.rid in rids for r in reqs)), 0)
        if n and self._admitted[n - 1][3] is not None:
            self._admitted[n - 1][3].synchronize()
        t0 = time.perf_counter()
        admitted, self._admitted = self._admitted[:n], self._admitted[n:]
        for reqs, first, logprob, *_ in admitted:
            for req, tok, lp in zip(reqs, first.tolist(), logprob.tolist()):
                if req.gen.finish_reason is None:
                    self._emit(req, [tok], [lp])
        self.host_seconds += time.perf_counter() - t0
