"""graphrt.Runtime: the embedded API.

Host-side bookkeeping lives here (requests, slots, KV blocks, stop conditions) and, for prefill,
in graphrt/admission.py; everything that runs per decode cycle on the device lives in
graphrt/cycle.py. The host touches the device once
per cycle: one non-blocking copy of the emitted tokens, counts and logprobs into pinned memory
(plus one of the batch rows' inputs when the batch changed; graphrt/packed.py).
"""

from __future__ import annotations

import numbers
import random
import time
import warnings
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from graphrt.admission import Admission
from graphrt.checkpoint import Checkpoint, check_draft_compatible, load_checkpoint, load_config
from graphrt.cycle import Cycle, DecodeState
from graphrt.errors import CapacityError, OptionError, RequestError, UnknownRequestError
from graphrt.kv_cache import TRASH_BLOCK, BlockAllocator, KVPool, blocks_for_budget
from graphrt.models import DRAFT_QUANTIZATIONS, build_draft, build_target, quantize_draft
from graphrt.packed import packed
from graphrt.params import Generation, RuntimeStats, SamplingParams, token_ids
from graphrt.prefix_cache import PrefixCache

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64)


@dataclass
class _Request:
    rid: int
    prompt: list[int]
    params: SamplingParams
    seed: int
    gen: Generation
    slot: int = -1
    blocks: list[int] = field(default_factory=list)
    cached: int = 0  # prompt tokens whose KV it found in cached blocks (prefix caching): not prefilled
    done: int = 0  # prompt tokens whose KV is in its blocks or on its way there (cached, then prefill chunks)
    keys: list = field(default_factory=list)  # a chunked prompt's block keys (prefix caching)
    stop_ids: frozenset = frozenset()
    reported: int = 0  # how many of its tokens step() has returned


def _kv_heads(model) -> int:
    """KV heads per layer of a model's cache on this rank (its share under tensor parallelism)."""
    return model.layers[0].attn.num_kv_heads if model.layers else model.cfg.num_key_value_heads


def _device(device) -> torch.device:
    """The runtime's device: CUDA when there is one unless named; a CUDA device on a machine without
    CUDA is an OptionError rather than torch's assertion at the first allocation."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise OptionError(f"device {device} asked for, but this torch sees no CUDA device")
    return device


def _simulated_rate(mean_length, num_draft_tokens: int) -> float:
    """The per-draft acceptance rate of a simulated acceptance length (kernels/simulated_acceptance,
    which checks L in [1, K + 1]); its range error as an OptionError."""
    from graphrt.kernels.simulated_acceptance import acceptance_rate_for

    try:
        return acceptance_rate_for(float(mean_length), num_draft_tokens)
    except ValueError as exc:
        raise OptionError(str(exc)) from None


def _budget_left(req: _Request) -> int:
    """Tokens the request may still generate (max_new_tokens counts the prefill's first one)."""
    return req.params.max_new_tokens - len(req.gen.token_ids)


class Runtime(Admission):
    """Speculative (or plain) decoding of a target model with an optional draft.

    from_pretrained() is the usual entry point. generate() runs a list of prompts to completion;
    add_request() / step() / finished() let an engine schedule its own batches.
    """

    def __init__(self, target: Checkpoint, draft: Checkpoint | None = None, *, num_draft_tokens: int = 3,
                 device=None, max_batch_size: int = 64, max_seq_len: int = 2048, block_size: int = 16,
                 kv_budget_tokens: int | None = None, kv_memory_fraction: float | None = None,
                 buckets: tuple[int, ...] | None = None, use_cuda_graphs: bool | None = None,
                 seed: int | None = None, simulate_acceptance_length: float | None = None,
                 draft_quantization: str | None = None, tensor_parallel=None, prefix_caching: bool = True,
                 prefill_chunk_tokens: int | None = 2048):
        device = _device(device)
        if not isinstance(prefix_caching, bool):
            raise OptionError(f"prefix_caching must be True or False, got {prefix_caching!r}")
        self.prefix_caching = prefix_caching
        if prefill_chunk_tokens is not None and (not isinstance(prefill_chunk_tokens, int)
                                                 or isinstance(prefill_chunk_tokens, bool) or prefill_chunk_tokens < 1):
            raise OptionError(f"prefill_chunk_tokens must be a positive int or None, got {prefill_chunk_tokens!r}")
        self.prefill_chunk_tokens = prefill_chunk_tokens
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())  # a rank's own GPU under torchrun
        if use_cuda_graphs and device.type != "cuda":
            raise OptionError(f"use_cuda_graphs=True needs a CUDA device, got device {device}")
        # graphs are captured lazily, before the first decode cycle, or by capture()
        self.use_cuda_graphs = device.type == "cuda" if use_cuda_graphs is None else use_cuda_graphs
        for name, value, least in (("num_draft_tokens", num_draft_tokens, 1), ("max_batch_size", max_batch_size, 1),
                                   ("max_seq_len", max_seq_len, 2), ("block_size", block_size, 1)):
            if value < least:
                raise OptionError(f"{name} must be >= {least}, got {value}")
        if buckets is not None and any(not isinstance(b, numbers.Integral) or b < 1 for b in buckets):
            raise OptionError(f"buckets must be batch sizes >= 1, got {tuple(buckets)}")
        if draft is not None:
            check_draft_compatible(target.config, draft.config)
        if max_seq_len > target.config.max_position_embeddings:
            warnings.warn(f"max_seq_len {max_seq_len} is past the target's max_position_embeddings "
                          f"({target.config.max_position_embeddings}): positions beyond it are extrapolated, "
                          "which the model was not trained for", stacklevel=2)
        if draft_quantization is not None and (draft is None or draft_quantization not in DRAFT_QUANTIZATIONS):
            raise OptionError(f"draft_quantization takes one of {DRAFT_QUANTIZATIONS} and a draft; got "
                             f"{draft_quantization!r}{'' if draft is not None else ' without a draft'}")
        if simulate_acceptance_length is not None:
            if draft is None:
                raise OptionError("simulate_acceptance_length needs a draft (it sets how many drafts are accepted)")
            _simulated_rate(simulate_acceptance_length, num_draft_tokens)  # the range, before anything is built
        self.device = device
        self.draft_quantization = draft_quantization
        self.K = num_draft_tokens if draft is not None else 0
        self.max_batch_size = max_batch_size
        self.max_seq_len = max_seq_len
        self.block_size = block_size
        self.buckets = tuple(sorted({b for b in (buckets or DEFAULT_BUCKETS) if b < max_batch_size}
                                    | {max_batch_size}))
        # A request reserves its whole budget at admission (prompt + max_new_tokens) plus the
        # positions a cycle may touch past its last token: verify K+1, extend K+1, decode K-1,
        # and one more cycle in flight.
        self.slack = 3 * (self.K + 1) + 1
        max_positions = max_seq_len + self.slack
        self.max_blocks = -(-max_positions // block_size)

        # Tensor parallelism (graphrt/parallel/): the target is this rank's slice, and so is an
        # EAGLE-3 head the ranks divide (shard.draft_shard_rule); other drafts are replicated.
        self.tp = tensor_parallel
        if self.tp is not None:
            from graphrt.parallel import draft_shard_rule, shard_checkpoint

            if target.parallel is None:
                target = shard_checkpoint(target, self.tp)
            if draft is not None and draft.parallel is None and (rule := draft_shard_rule(draft.config, self.tp)):
                draft = shard_checkpoint(draft, self.tp, rule)
            for name, ckpt in (("target", target), ("draft", draft)):
                if ckpt is not None and ckpt.parallel not in (None, (self.tp.rank, self.tp.world_size)):
                    raise OptionError(f"the {name} checkpoint is the slice {ckpt.parallel} (rank, world size), "
                                     f"not rank {self.tp.rank} of {self.tp.world_size}")
        self.target_ckpt, self.draft_ckpt = target, draft
        self.target = build_target(target, max_positions, device, self.tp)
        self.draft = None if draft is None else build_draft(draft, self.target, max_positions, device,
                                                            self.tp if draft.parallel else None)
        if draft_quantization is not None:  # (checked above: there is a draft)
            quantize_draft(self.draft, draft_quantization)
        tcfg = target.config
        self.vocab_size = tcfg.vocab_size
        self.eos_token_ids = frozenset(tcfg.eos_token_ids or ())

        dtype = target.weights["embed_tokens.weight"].dtype
        # one KV pool per model (target, then draft), both of num_blocks: (layers, KV heads, head_dim)
        kv_shapes = [(m.num_layers, _kv_heads(m), m.cfg.head_dim) for m in (self.target, self.draft) if m is not None]
        per_block = sum(KVPool.bytes_per_block(n, block_size, heads, dim, dtype) for n, heads, dim in kv_shapes)
        if kv_budget_tokens is None and kv_memory_fraction is None:
            # enough for every slot at full length, each rounded up to whole blocks as it is
            # allocated; ask for a memory fraction to oversubscribe slots
            kv_budget_tokens = max_batch_size * self.max_blocks * block_size
        num_blocks = blocks_for_budget(block_size=block_size, bytes_per_block=per_block,
                                       token_budget=kv_budget_tokens, memory_fraction=kv_memory_fraction,
                                       device=device)
        self.allocator = BlockAllocator(num_blocks)
        # who holds which block; with prefix_caching, also the whole prompt blocks kept for reuse
        self.kv_blocks = PrefixCache(self.allocator, block_size,
                                     next_token=self.draft is not None and self.draft.uses_target_hidden)
        pools = [KVPool.allocate(n, num_blocks, block_size, heads, dim, dtype, device) for n, heads, dim in kv_shapes]
        self.target_kv, self.draft_kv = pools[0], (pools[1] if self.draft is not None else None)
        target_hidden = draft_state = None
        if self.draft is not None and self.draft.uses_target_hidden:
            aux = self.draft.target_hidden == "aux"
            if aux:  # EAGLE-3: the target keeps the residual streams the head reads
                self.target.aux_layer_ids = self.draft.aux_layer_ids
            target_hidden = tcfg.hidden_size * (len(self.target.aux_layer_ids) if aux else 1)
            draft_state = self.draft.cfg.hidden_size
        self.state = DecodeState(max_batch_size=max_batch_size, num_draft_tokens=self.K,
                                 max_blocks=self.max_blocks, target_hidden_size=target_hidden,
                                 draft_state_size=draft_state, hidden_dtype=dtype, device=device,
                                 simulate_acceptance=simulate_acceptance_length is not None)
        if simulate_acceptance_length is not None:
            self.set_simulated_acceptance(simulate_acceptance_length)
        self.cycle = Cycle(target=self.target, draft=self.draft, target_kv=self.target_kv, draft_kv=self.draft_kv,
                           state=self.state, num_draft_tokens=max(self.K, 1))
        # tensor parallelism's all-reduces: the group's backend (NCCL, gloo) until capture() sets up the
        # one-shot path
        self.all_reduce_path = None if self.tp is None else str(dist.get_backend(self.tp.group))

        pin = device.type == "cuda"

        def host_buffers():
            # pinned twins of DecodeState.inputs / .results: each moves in one copy
            inputs, (slots, ndrafts) = packed(DecodeState.input_specs(max_batch_size), "cpu", pin_memory=pin)
            results, (emitted, num, logprobs) = packed(
                DecodeState.result_specs(max_batch_size, self.K), "cpu", pin_memory=pin)
            return {"inputs": inputs, "slots": slots, "ndrafts": ndrafts, "results": results, "emitted": emitted,
                    "num": num, "logprobs": logprobs, "event": torch.cuda.Event() if pin else None}

        # two sets: cycle n+1 is launched into one while the host reads cycle n from the other
        self._host_buffers = [host_buffers(), host_buffers()]
        self._next_buffer = 0
        self._inflight = None
        self.overlap = device.type == "cuda"  # on the CPU nothing runs asynchronously
        # prefills launched whose first tokens the host has not read: (requests, first tokens, their
        # logprobs, the event after their copy to the host or None, whether it is a chunked prompt's last chunk)
        self._admitted: list[tuple[list[_Request], torch.Tensor, torch.Tensor, torch.cuda.Event | None, bool]] = []
        self.num_cycles = 0
        self.host_seconds = 0.0  # host time spent in step() outside waiting for the GPU
        self._counts = dict(prefills=0, prompt_tokens=0, cached_prompt_tokens=0, generated_tokens=0, draft_tokens=0,
                            accepted_tokens=0)

        self._free_slots = list(range(max_batch_size - 1, -1, -1))
        self._running: dict[int, _Request] = {}  # slot -> request
        self._waiting: deque[_Request] = deque()
        self._unreported: dict[int, _Request] = {}  # requests with tokens step() has not returned yet
        self._requests: dict[int, _Request] = {}
        self._next_id = 0
        self._rng = random.Random(seed)  # draws the seeds of requests that bring none

    @classmethod
    def from_pretrained(cls, target, draft=None, *, num_draft_tokens: int = 3, device=None, dtype=None,
                        max_batch_size: int = 64, max_seq_len: int = 2048, tensor_parallel_size: int | None = None,
                        **kwargs) -> Runtime:
        """target, draft: local Hugging Face directories (or already loaded Checkpoints).
        dtype defaults to bf16 on CUDA and fp32 on the CPU.

        tensor_parallel_size N: this process is one of N ranks (launched by torchrun or `graphrt ...
        --tp N`; graphrt.parallel.init_tensor_parallel joins the group). Each rank reads only its
        slice of the target from a safetensors checkpoint, runs on cuda:LOCAL_RANK, and every rank
        runs the same requests: call the same methods with the same arguments on every rank. A rank
        that fails to load makes every rank raise the same ParallelError."""
        tp = None
        if tensor_parallel_size is not None and tensor_parallel_size < 1:
            raise OptionError(f"tensor_parallel_size must be >= 1, got {tensor_parallel_size}")
        if tensor_parallel_size is not None and tensor_parallel_size > 1:
            from graphrt.parallel import draft_shard_rule, init_tensor_parallel, target_shard_rule

            tp = init_tensor_parallel(tensor_parallel_size)
        device = _device(device)
        if dtype is None:
            dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        if device.type == "cuda" and kwargs.get("use_cuda_graphs") is not False:
            from graphrt.capture.precompile import start_early

            start_early()  # a cold capture's compile workers, importing while the checkpoint loads
        error = None
        try:
            if isinstance(target, (str, Path)):
                shard = None if tp is None else target_shard_rule(load_config(target), tp)
                target = load_checkpoint(target, dtype=dtype, device=device, shard=shard)
            if isinstance(draft, (str, Path)):
                shard = None if tp is None else draft_shard_rule(load_config(draft), tp)
                draft = load_checkpoint(draft, dtype=dtype, device=device, shard=shard)
            rt = cls(target, draft, num_draft_tokens=num_draft_tokens, device=device, max_batch_size=max_batch_size,
                     max_seq_len=max_seq_len, tensor_parallel=tp, **kwargs)
        except Exception as exc:
            if tp is None:
                raise
            error = exc
        if tp is not None:
            tp.agree(error)
        return rt

    # ---- requests -----------------------------------------------------------------------------
    def add_request(self, prompt, params: SamplingParams | None = None) -> int:
        """Queue a request; the next step() prefills it once a slot and its KV blocks are free,
        in one forward with every other request admitted then (those added since the last step).
        Raises RequestError for bad input and CapacityError if it could never fit."""
        params = params or SamplingParams()
        return self._enqueue(self._check_request(prompt, params), params)

    def _enqueue(self, prompt: list[int], params: SamplingParams) -> int:
        """Queue a request _check_request has passed."""
        rid = self._next_id
        self._next_id += 1
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        stop = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_token_ids)
        req = _Request(rid, prompt, params, seed, Generation(rid, list(prompt)), stop_ids=stop)
        self._requests[rid] = req
        self._waiting.append(req)
        return rid

    def _request(self, request_id: int) -> _Request:
        req = self._requests.get(request_id)
        if req is None:
            raise UnknownRequestError(f"no request {request_id!r} here: never added, or its generation was popped")
        return req

    def finished(self, request_id: int) -> bool:
        return self._request(request_id).gen.finish_reason is not None

    def get_generation(self, request_id: int) -> Generation:
        return self._request(request_id).gen

    def pop_generation(self, request_id: int) -> Generation:
        """Return a finished request's Generation and forget the request (an engine driving
        add_request/step calls this, or the host keeps every finished request)."""
        if not self.finished(request_id):
            raise RequestError(f"request {request_id} has not finished")
        self._unreported.pop(request_id, None)
        return self._requests.pop(request_id).gen

    def abort(self, request_id: int) -> bool:
        """Stop a request now (its client went away): a waiting request is never prefilled, a
        running one gives its slot and KV blocks back at once, for the next step() to admit a waiting
        request into (a cycle already in flight for it runs, and its tokens are dropped, as for a
        request that finished in the cycle before).
        Its Generation keeps the tokens it had, with finish_reason "abort"; pop_generation forgets
        it. Returns False, changing nothing, when the request had already finished. Under tensor
        parallelism, call it on every rank, as add_request."""
        req = self._request(request_id)
        if req.gen.finish_reason is not None:
            return False
        req.gen.finish_reason = "abort"
        if self._running.get(req.slot) is req:
            self._release(req)
        else:  # waiting, or part way through a chunked prefill (holding its slot and blocks)
            self._waiting = deque(r for r in self._waiting if r is not req)
            if req.slot >= 0:
                self._free(req)
        return True

    def has_unfinished(self) -> bool:
        return bool(self._running or self._waiting)

    def stats(self) -> RuntimeStats:
        """Queue, slots, KV blocks and what has run so far (RuntimeStats), without a GPU sync: what
        an engine exports as metrics between steps."""
        return RuntimeStats(waiting=len(self._waiting), running=len(self._running), free_slots=len(self._free_slots),
                            kv_blocks_free=self.kv_blocks.num_free, kv_blocks_total=self.allocator.num_blocks - 1,
                            cycles=self.num_cycles, host_seconds=self.host_seconds, **self._counts)

    def running_slots(self) -> list[int]:
        """The batch slots of the admitted, unfinished requests, ascending."""
        return sorted(self._running)

    def _check_request(self, prompt, params) -> list[int]:
        """The prompt as token ids; RequestError for bad params or a prompt that can't run,
        CapacityError for a request the KV pool could never hold."""
        if not isinstance(params, SamplingParams):
            raise RequestError(f"params must be a SamplingParams, got {type(params).__name__}")
        params.validate()
        prompt = token_ids(prompt, "prompt")
        if not prompt:
            raise RequestError("prompt is empty: give at least one token id")
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError(f"prompt token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        if len(prompt) + params.max_new_tokens > self.max_seq_len:
            raise RequestError(
                f"prompt length {len(prompt)} + max_new_tokens {params.max_new_tokens} exceeds "
                f"max_seq_len {self.max_seq_len}")
        need = self._blocks_needed(len(prompt), params)
        if need > self.allocator.num_blocks - 1:
            raise CapacityError(
                f"request needs {need} KV blocks (prompt {len(prompt)} + max_new_tokens {params.max_new_tokens}) "
                f"but the pool has {self.allocator.num_blocks - 1}")
        return prompt

    def _emit(self, req: _Request, tokens: list[int], logprobs: list[float]) -> None:
        gen = req.gen
        self._unreported[req.rid] = req
        for tok, lp in zip(tokens, logprobs):
            gen.token_ids.append(tok)
            gen.logprobs.append(lp)
            self._counts["generated_tokens"] += 1
            if tok in req.stop_ids:
                gen.finish_reason = "stop"
            elif _budget_left(req) <= 0:
                gen.finish_reason = "length"
            if gen.finish_reason:
                self._release(req)
                return

    def _release(self, req: _Request) -> None:
        del self._running[req.slot]
        self._free(req)

    def _free(self, req: _Request) -> None:
        """Give the request's slot and KV blocks back."""
        self.state.block_tables[req.slot] = TRASH_BLOCK  # stray writes can't reach reused blocks
        self.kv_blocks.release(req.blocks)
        self._free_slots.append(req.slot)
        req.blocks, req.slot, req.cached, req.done = [], -1, 0, 0

    # ---- CUDA graphs --------------------------------------------------------------------------
    def capture(self, progress=None, inspect_kernels: bool = True, filters: bool | None = None,
                prefill: bool = False):
        """Capture every phase x bucket as a CUDA graph (largest bucket first, one shared pool).
        Returns the list of graphrt.capture.graphs.CapturedGraph records.

        There are two sets of graphs: without the filters' kernels (top_k, top_p, min_p), which
        cycles replay while no request in the batch filters, and with them. filters: which set to
        capture (None: the one the requests running now need, at first the unfiltered one). A set
        not captured beforehand is captured before the first cycle that needs it; capturing the
        filtered set up front (filters=True) spares the first filtered request that pause.

        A prefill replays the set's graph for its padded shape (prefill_shapes), captured the first
        time that shape comes (about 0.1 s on a 30-layer model); prefill=True captures every shape
        now, as a server does before it takes requests (prefill_graph_keys: with prefix caching, each
        shape twice, as a prefill past cached blocks attends past its padded length and has graphs
        of its own; under chunked prefill, the chunks' shapes)."""
        if self.device.type != "cuda":
            raise OptionError(f"CUDA graph capture needs a CUDA device, this runtime is on {self.device}")
        from graphrt.capture.graphs import CycleGraphs

        if self.tp is not None:
            # NCCL sets up its communicator at the first collective, which must not be inside a capture
            self.tp.agree(None)
            if self.tp.one_shot is None:  # collective too: here, where every rank surely arrives
                # the decode phases' all-reduces: at most B * (K + 1) rows of the hidden size
                numel = self.max_batch_size * (self.K + 1) * self.target.cfg.hidden_size
                self.all_reduce_path = self.tp.use_symmetric_memory(self.device, self.target.embed.dtype, numel,
                                                            self.target.cfg.hidden_size)
            else:
                self.all_reduce_path = self.tp.symmetric_path
        s, sets = self.state, self.cycle.graph_sets
        want = s.filtering if filters is None else bool(filters)
        sets.pop(want, None)  # a capture that fails leaves that set to eager mode
        other = sets.get(not want)
        # the sets never replay at once, so they share one memory pool
        graphs = CycleGraphs(self.cycle, self.buckets, pool=other.pool if other is not None else None)
        filtering, s.filtering = s.filtering, want
        try:
            records = graphs.capture(progress=progress, inspect_kernels=inspect_kernels)
            if prefill:
                graphs.capture_prefills(self.prefill_graph_keys(), precompile_kernels=True)
        finally:
            s.filtering = filtering
        sets[want] = graphs
        return records

    def _graphs(self):
        """The set of graphs that the state's filtering flag picks, captured now if it was not."""
        if self.cycle.graphs is None:
            torch.cuda.synchronize(self.device)  # the capture's warm-up writes what a cycle in flight reads
            self.capture(inspect_kernels=False)
        return self.cycle.graphs

    @property
    def graph_sets(self) -> dict:
        """The captured sets of graphs (graphrt.capture.graphs.CycleGraphs), by whether their
        sampler runs the filters' kernels (see capture)."""
        return dict(self.cycle.graph_sets)

    # ---- decoding -----------------------------------------------------------------------------
    def step(self) -> dict[int, list[int]]:
        """One decode cycle over every running request. Returns {request id: tokens} with every
        token each request gained since step() last returned it, in order and once: the cycle's
        tokens and the first token of every request prefilled since (by admit(), or by this call,
        which first admits what waits and fits; a request admitted into a slot this call frees is
        prefilled at once, and on CUDA its first token comes with the next call, read once the cycle
        after its prefill is launched; a chunked prompt's, once its last chunk is launched after the
        cycle a call reads, with the call after).

        On CUDA the cycles are pipelined: cycle n+1 is launched (for the same requests plus any
        newly admitted) before the host reads cycle n's results, so the GPU never waits for Python.
        A request that finished in cycle n rides along in cycle n+1 inside its reserved slack and
        that cycle's tokens for it are dropped; when cycle n surely ends every running request (its
        token budget), cycle n+1 is not launched at all.
        """
        t0 = time.perf_counter()
        self._admit()
        if self._inflight is None:
            if not self._running:
                return self._report()
            self._inflight = self._launch()
        done = self._inflight
        # No cycle n+1 when cycle n ends every running request anyway (each cycle emits at least
        # one token per request): it would only ride along.
        in_done = {r.rid for r in done[0]}
        ends_all = all(r.rid in in_done and _budget_left(r) <= 1 for r in self._running.values())
        self._inflight = self._launch() if self.overlap and self._running and not ends_all else None
        self.host_seconds += time.perf_counter() - t0
        self._first_tokens(done[0])
        self._collect(done)
        return self._report()

    def _report(self) -> dict[int, list[int]]:
        out = {}
        for rid, req in self._unreported.items():
            out[rid] = req.gen.token_ids[req.reported:]
            req.reported = len(req.gen.token_ids)
        self._unreported.clear()
        return out

    def _launch(self):
        """Enqueue one cycle for the running requests; returns what _collect needs. No sync."""
        reqs = sorted(self._running.values(), key=lambda r: r.slot)
        B = len(reqs)
        Bk = next(b for b in self.buckets if b >= B)  # the smallest bucket that holds the batch
        s = self.state
        h = self._host_buffers[self._next_buffer]
        self._next_buffer ^= 1
        rows = tuple(r.slot for r in reqs) + (s.scratch_slot,) * (Bk - B)
        # the filters' kernels run only in cycles whose batch has a request that filters
        s.filtering = any(r.params.filters for r in reqs)
        if self.use_cuda_graphs:
            self._graphs()
        if s.staged != rows:  # a steady batch keeps its device inputs: no copy
            h["slots"][:Bk] = torch.tensor(rows)
            h["ndrafts"][:Bk] = 0
            h["ndrafts"][:B] = self.K
            s.inputs.copy_(h["inputs"], non_blocking=True)
            s.staged = rows
        self.cycle.run(Bk)
        h["results"].copy_(s.results, non_blocking=True)
        if h["event"] is not None:
            h["event"].record()
        self.num_cycles += 1
        return reqs, h

    def _collect(self, launched) -> None:
        reqs, h = launched
        if h["event"] is not None:
            h["event"].synchronize()
        t0 = time.perf_counter()
        if self.cycle.timer is not None:
            self.cycle.timer.collect()  # completed phases only: reading them costs no sync
        emitted, nums, lps = h["emitted"].tolist(), h["num"].tolist(), h["logprobs"].tolist()
        for i, req in enumerate(reqs):
            if req.gen.finish_reason is not None:  # finished in the previous cycle: a ride-along
                continue
            n = nums[i]
            req.gen.num_cycles += 1
            if self.K:
                req.gen.num_draft_tokens += self.K
                req.gen.num_accepted_tokens += n - 1
                self._counts["draft_tokens"] += self.K
                self._counts["accepted_tokens"] += n - 1
            self._emit(req, emitted[i][:n], lps[i][:n])
        # into the slots just freed (under overlap their first tokens come with the next step); a
        # chunked prefill's next chunk waits for the next step, so that cycles and chunks alternate
        self._admit(chunks=False)
        self.host_seconds += time.perf_counter() - t0

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None) -> list[Generation]:
        """Run every prompt to completion. Prompts beyond the free slots or KV wait their turn."""
        if prompts and isinstance(prompts[0], int):
            raise RequestError("prompts must be a list of token-id lists (wrap a single prompt in a list)")
        if not isinstance(params, list):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise RequestError(f"got {len(prompts)} prompts but {len(params)} SamplingParams")
        checked = [self._check_request(p, sp) for p, sp in zip(prompts, params)]  # all, before queueing any
        rids = [self._enqueue(p, sp) for p, sp in zip(checked, params)]  # the first step prefills them together
        while not all(self.finished(r) for r in rids):
            self.step()
        return [self.pop_generation(r) for r in rids]

    def set_simulated_acceptance(self, mean_length: float) -> None:
        """Benchmarking: from now on each verify step accepts a drawn number of drafts whose mean
        emitted length is `mean_length` (1 <= L <= K + 1), whatever the draft proposes; the target
        forward and rejection kernel still run (kernels/simulated_acceptance.py). Needs a runtime
        made with simulate_acceptance_length; changing L needs no new graphs. Output tokens are then
        not the target's distribution: for cost measurements only."""
        if self.state.simulated_rate is None:
            raise OptionError("this runtime was made without simulate_acceptance_length")
        self.state.simulated_rate.fill_(_simulated_rate(mean_length, self.K))

    @property
    def acceptance_counts(self) -> list[int]:
        """Per draft position j, how many times draft j was accepted (device counter, read now)."""
        return self.state.acceptance_counts.tolist()[: self.K]
