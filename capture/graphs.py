"""One CUDA graph per (phase, bucket), captured largest bucket first into one shared memory pool,
and one per prefill shape (rows, padded prompt length), captured into the same pool when first needed.

Every phase function of graphrt.cycle.Cycle reads and writes only the runtime's static buffers,
so a graph captured once replays for any requests: the host changes what the graph sees by
writing `batch_slots` (which slot each batch row serves) and per-slot state, never by changing
shapes. Warm-up and capture run with every batch row on the scratch slot, so they touch no
request's state and no request's KV (the scratch slot's block table is all trash block).
"""

from __future__ import annotations

import gc
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch


@dataclass
class CapturedGraph:
    phase: str
    batch_size: int
    graph: torch.cuda.CUDAGraph
    capture_s: float
    pool_bytes: int  # memory reserved by captures so far (the shared pool's growth)
    kernels: dict[str, int] = field(default_factory=dict)

    @property
    def num_kernel_nodes(self) -> int:
        return sum(self.kernels.values())


@dataclass
class PrefillGraph:
    """The prefill forward (graphrt.cycle.Cycle.prefill_forward) at one padded shape: the host
    writes `inputs` (Cycle.prefill_specs, one packed buffer), replays, and reads `outputs` (first
    tokens [rows], logprobs [rows]; (None, None) for a chunk). cached: its rows may start past a
    cached prefix (prefix caching, or a chunk after a prompt's first), so their attention reaches
    past `length`, up to the table's capacity. chunk: its rows are chunks of longer prompts, which
    draw no first token (Cycle.prefill_forward)."""

    rows: int
    length: int
    cached: bool
    chunk: bool
    graph: torch.cuda.CUDAGraph
    inputs: torch.Tensor
    outputs: tuple
    capture_s: float


def _new_graph() -> torch.cuda.CUDAGraph:
    # keep_graph keeps the cudaGraph_t alive after instantiation so its nodes can be listed.
    try:
        return torch.cuda.CUDAGraph(keep_graph=True)
    except TypeError:  # older torch: the graph is instantiated and its template dropped
        return torch.cuda.CUDAGraph()


class CycleGraphs:
    def __init__(self, cycle, buckets: tuple[int, ...], pool=None):
        """pool: the memory pool of graphs that never replay at the same time as these (another
        set of the same cycle), shared; by default capture() makes one."""
        self.cycle = cycle
        self.buckets = tuple(sorted(set(buckets), reverse=True))
        self.graphs: dict[tuple[str, int], CapturedGraph] = {}
        self.pool = pool
        self.precompiled, self.precompile_s = 0, 0.0  # kernel variants compiled up front, and the time it took
        self.prefill_precompiled, self.prefill_precompile_s = 0, 0.0  # the same for capture_prefills
        self.prefills: dict[tuple[int, int, bool, bool], PrefillGraph] = {}  # by (rows, length, cached, chunk)

    def capture(self, progress=None, inspect_kernels: bool = True,
                precompile_kernels: bool = True) -> list[CapturedGraph]:
        from graphrt.capture.inspect import kernel_names
        from graphrt.capture.precompile import precompile

        s = self.cycle.s
        saved_slots, saved_ndrafts = s.batch_slots.clone(), s.batch_num_drafts.clone()
        s.batch_slots.fill_(s.scratch_slot)
        s.batch_num_drafts.zero_()
        try:
            with self._capturing() as stream:
                def run_all():
                    for B in self.buckets:
                        for _, fn in self.cycle.phases():
                            fn(B)

                if precompile_kernels:
                    t0 = time.perf_counter()
                    self.precompiled = precompile(run_all, self._configuration())
                    self.precompile_s = time.perf_counter() - t0
                with torch.cuda.stream(stream):  # compile, autotune and allocate outside any capture
                    run_all()
                torch.cuda.current_stream().wait_stream(stream)
                torch.cuda.synchronize()
                reserved0 = torch.cuda.memory_reserved()
                for B in self.buckets:
                    for name, fn in self.cycle.phases():
                        graph = _new_graph()
                        t0 = time.perf_counter()
                        with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                            fn(B)
                        if hasattr(graph, "instantiate"):
                            try:
                                graph.instantiate()
                            except RuntimeError:
                                pass  # already instantiated (keep_graph=False)
                        torch.cuda.synchronize()
                        rec = CapturedGraph(name, B, graph, time.perf_counter() - t0,
                                            torch.cuda.memory_reserved() - reserved0)
                        if inspect_kernels:
                            rec.kernels = kernel_names(graph)
                        self.graphs[(name, B)] = rec
                        if progress is not None:
                            progress(rec)
        finally:
            s.batch_slots.copy_(saved_slots)
            s.batch_num_drafts.copy_(saved_ndrafts)
        return list(self.graphs.values())

    @contextmanager
    def _capturing(self):
        """Around a capture: a side stream (yielded) that starts after the current one, the shared
        pool, the garbage collector off, and the scratch slot, which warm-ups and captures write,
        pinned again after."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        # A graph object freed by the garbage collector in the middle of a capture (say, one of an
        # earlier runtime) calls cudaGraphExecDestroy on a capturing stream and invalidates it.
        gc.collect()
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            yield stream
        finally:
            if gc_was_enabled:
                gc.enable()
            self.cycle.s.reset_scratch()

    def _configuration(self) -> str:
        """What decides which kernel variants the captures compile (for capture/precompile.py)."""
        c, s = self.cycle, self.cycle.s
        kv = [(tuple(p.k[0].shape), p.k[0].dtype) for p in (c.target_kv, c.draft_kv) if p is not None and p.k]
        # filtering: the sampler's threshold kernel runs once a request has used a filter; the LM
        # head's shape: a tensor-parallel rank's vocab shard
        return repr((c.target.cfg, getattr(c.draft, "cfg", None), c.K, self.buckets, kv, s.filtering,
                     tuple(c.target.lm_head.shape), tuple(s.block_tables.shape), str(s.num_tokens.device)))

    def get(self, phase: str, batch_size: int):
        rec = self.graphs.get((phase, batch_size))
        return rec.graph if rec is not None else None

    def prefill(self, rows: int, length: int, cached: bool = False, chunk: bool = False) -> PrefillGraph:
        """The prefill graph of this kind, captured now if it was not (capture_prefills)."""
        rec = self.prefills.get((rows, length, cached, chunk))
        return rec if rec is not None else self.capture_prefills([(rows, length, cached, chunk)])[0]

    def capture_prefills(self, shapes, precompile_kernels: bool = False) -> list[PrefillGraph]:
        """Capture the prefill graph of each (rows, length, cached, chunk) in shapes, each after a warm-up
        run that compiles its kernels (0.04-0.06 s a shape on a 30-layer model once they are
        compiled). precompile_kernels: first compile every variant the shapes need in parallel
        (capture/precompile.py), as capture() does for the phases. Both run on the scratch slot
        only, after every launched cycle has finished, since cycles read that slot."""
        from graphrt.capture.precompile import precompile

        c, s = self.cycle, self.cycle.s
        todo = list(dict.fromkeys(shape for shape in shapes if shape not in self.prefills))
        inputs = {shape: c.prefill_inputs(*shape[:2], s.num_tokens.device) for shape in todo}  # padding rows only
        torch.cuda.synchronize()
        with self._capturing() as stream:
            if precompile_kernels and todo:
                def run_all():
                    for (_, _, cached, chunk), (_, views) in inputs.items():
                        c.prefill_forward(*views, cached=cached, chunk=chunk)

                t0 = time.perf_counter()
                self.prefill_precompiled = precompile(run_all, f"{self._configuration()}|prefill {todo}")
                self.prefill_precompile_s = time.perf_counter() - t0
            for key in todo:
                t0 = time.perf_counter()
                buf, views = inputs[key]
                kind = dict(cached=key[2], chunk=key[3])
                with torch.cuda.stream(stream):  # compile and allocate outside the capture
                    c.prefill_forward(*views, **kind)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                    outputs = c.prefill_forward(*views, **kind)
                torch.cuda.synchronize()
                self.prefills[key] = PrefillGraph(*key, graph, buf, outputs, time.perf_counter() - t0)
        return [self.prefills[shape] for shape in shapes]
