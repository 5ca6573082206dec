"""The run `graphrt profile` measures: a Runtime with graphs captured for exactly the batch sizes
profiled, decoded greedily at each of them after a warm-up. Every measured run also times each
phase launch with CUDA events (profiling/phase_timer.py), so a trace's wall times always have
an independent clock beside them.
"""

from __future__ import annotations

# CUDA-event times per (phase, batch size), in microseconds per launch
EventTimes = dict[tuple[str, int | None], float]


def keyed_to_json(d: dict) -> dict[str, object]:
    """{(phase, B): x} -> {"PHASE/B": x}, as the inner run's metadata file holds it."""
    return {f"{p}/{b}": v for (p, b), v in sorted(d.items(), key=lambda kv: (kv[0][0], kv[0][1] or 0))}


def keyed_from_json(d: dict) -> dict:
    out = {}
    for key, v in (d or {}).items():
        phase, _, b = key.rpartition("/")
        out[(phase, None if b == "None" else int(b))] = v
    return out


class Workload:
    def __init__(self, args, *, cupti_warmup: bool = False):
        """args: `graphrt profile`'s. cupti_warmup: open an empty profiler session before capturing
        (in-process profiling only; under nsys a second CUPTI client would compete with nsys's)."""
        from graphrt.arg_types import device_and_dtype, draft_kind
        from graphrt.parallel import join_ranks, rank_zero_first
        from graphrt.presets import default_checkpoints
        from graphrt.runtime import Runtime

        self.device, dtype = device_and_dtype(args)
        on_cuda = self.device.type == "cuda"
        self.batch_sizes = args.batch_sizes or ([1, 8, 64] if on_cuda else [1, 4])
        self.prompt_len = args.prompt_len
        self.max_new = args.max_new_tokens or (32 if on_cuda else 8)
        with rank_zero_first(join_ranks(args.tp)):
            target, draft, draft_desc = default_checkpoints(
                args.checkpoint, args.draft, dtype, no_draft=args.no_draft, draft_layers=args.draft_layers,
                preset=args.preset or ("llama-1b-shape" if on_cuda else "tiny"),
                draft_kind=draft_kind(args, self.device))
        self.accept_len = args.accept_len
        self.desc = f"target {target}; draft: {draft_desc}"
        if self.accept_len is not None:
            self.desc += f"; simulated acceptance {self.accept_len:g}"
        max_bs = max(self.batch_sizes)
        seq = self.prompt_len + self.max_new + 8
        graphs = on_cuda and not args.eager
        self.rt = Runtime.from_pretrained(target, draft, num_draft_tokens=args.num_draft_tokens,
                                          device=self.device, dtype=dtype, max_batch_size=max_bs, max_seq_len=seq,
                                          kv_budget_tokens=max_bs * (seq + 64), buckets=tuple(self.batch_sizes),
                                          use_cuda_graphs=graphs, tensor_parallel_size=args.tp,
                                          draft_quantization=args.draft_quantization if draft else None,
                                          simulate_acceptance_length=self.accept_len)
        self.graph_nodes: dict[tuple[str, int], int] = {}
        if graphs:
            if cupti_warmup:
                from graphrt.profiling.torch_profile import init_cupti_for_cuda_graphs

                init_cupti_for_cuda_graphs()
            try:
                recs = self.rt.capture(inspect_kernels=True)
                self.graph_nodes = {(r.phase, r.batch_size): r.num_kernel_nodes for r in recs}
            except (ImportError, RuntimeError):  # no cuda-python / keep_graph: capture without listing
                self.rt.capture(inspect_kernels=False)

    def decode(self, batch_size: int, max_new_tokens: int, seed: int = 0) -> None:
        import torch

        from graphrt.params import SamplingParams

        g = torch.Generator().manual_seed(seed)
        prompts = torch.randint(0, self.rt.vocab_size, (batch_size, self.prompt_len), generator=g).tolist()
        self.rt.generate(prompts, SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True))

    def warm_up(self) -> None:
        for b in self.batch_sizes:
            self.decode(b, min(4, self.max_new))
        self._sync()

    def run(self) -> EventTimes:
        """The measured decode, the same seeds every call; returns its CUDA-event times."""
        from graphrt.profiling.phase_timer import PhaseTimer

        timer = PhaseTimer(self.device)
        self.rt.cycle.timer = timer
        try:
            for b in self.batch_sizes:
                self.decode(b, self.max_new, seed=1)
            self._sync()
        finally:
            self.rt.cycle.timer = None
        return timer.mean_us_by_batch()

    def _sync(self):
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def meta(self) -> dict:
        import torch

        return {"workload": self.desc, "simulated_acceptance": self.accept_len, "batch_sizes": self.batch_sizes,
                "prompt_len": self.prompt_len, "max_new_tokens": self.max_new, "torch": torch.__version__,
                "device": torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu",
                "graph_kernel_nodes": keyed_to_json(self.graph_nodes)}
