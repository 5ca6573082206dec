"""Kernel families (GEMV, GEMM, attention, norm, rotary, sampler, argmax, bookkeeping (the
cycle's own index launches), comm, other), each launch's exclusive time by family, and the chart
of it (`graphrt profile --png F`).

Classified from the kernel's name alone (the trace has nothing else), first match wins. The order
matters where graphrt fuses: `_qkv_rotary_kernel` is the M = 1 qkv projection with rotary and the
KV store in its epilogue, so it streams weights like a GEMV and is counted as one, while
`_rotary_store_kv_kernel` (rotary + KV store after a cuBLAS qkv) is rotary. cuBLAS's skinny
products (`nvjet_*`, `gemv*`) keep the family their name says, whatever M was.
"""

from __future__ import annotations

import functools
import re
from collections import defaultdict

from graphrt.profiling.attribution import Attribution, ProfilingError, short_kernel_name
from graphrt.profiling.phases import PREFILL, phase_order

FAMILIES = ("GEMV", "GEMM", "attention", "norm", "rotary", "sampler", "argmax", "bookkeeping", "comm", "other")

_RULES = [
    # tensor parallelism's collectives: NCCL's kernels are ncclDevKernel_AllReduce_Sum_bf16_RING_LL...
    ("comm", r"^nccl|all_?reduce|all_?gather|reduce_?scatter|cross_device"),
    ("GEMV", r"gemv|qkv_rotary"),
    ("rotary", r"rotary|rope"),
    ("attention", r"attn|attention|flash|fmha|store_kv|kv_cache"),
    ("norm", r"rms_?norm|layer_?norm|norm_kernel"),
    ("argmax", r"argmax"),
    # kernels/rejection.py and kernels/simulated_acceptance.py name theirs _row_stats, _walk,
    # _race, _finish and _simulate, kernels/vocab_parallel_kernels.py _assemble; softmax and top-k
    # only ever run to sample here
    ("sampler", r"rejection|sampl|gumbel|multinomial|softmax|topk|top_k"
                r"|^_(row_stats|walk|race|finish|simulate|assemble)_kernel"),
    ("GEMM", r"gemm|nvjet|cutlass|xmma|cublas|matmul|wgmma|^sm\d+_"),
    # kernels/cycle_index.py: each phase's inputs by slot, and the requests' advance after the sampler
    ("bookkeeping", r"^_(cycle_inputs|advance)_kernel"),
]
_COMPILED = [(family, re.compile(pattern, re.IGNORECASE)) for family, pattern in _RULES]
# Generic kernels named by their template arguments: torch.argmax runs a reduce_kernel over
# ArgMaxOps, CUTLASS GEMMs are cutlass::Kernel2<...gemm...>
_TEMPLATE_RULES = [("argmax", re.compile(r"ArgMaxOps")), ("GEMM", re.compile(r"gemm|cutlass", re.IGNORECASE))]


@functools.lru_cache(maxsize=4096)
def kernel_family(name: str) -> str:
    """The family of a kernel, from its full (demangled) or short name. The rules read the short
    name first: template arguments of torch's elementwise kernels name whatever functor they apply."""
    short = short_kernel_name(name)
    for family, rx in _COMPILED:
        if rx.search(short):
            return family
    for family, rx in _TEMPLATE_RULES:
        if rx.search(name):
            return family
    return "other"


IDLE = "idle (gaps)"
SEGMENTS = (*FAMILIES, IDLE)


def family_bars(result: Attribution) -> tuple[list[tuple[str, int | None]], dict[str, list[float]]]:
    """The bars, (phase, batch size) in phase order, and per segment (each family, then IDLE) its
    mean time per launch in microseconds in each bar. Exclusive times add up to the wall time, so
    a bar's height is the launch's mean wall time; a kernel that mostly waits under PDL adds
    little, as it should. The idle gaps between kernels (inside exclusive times) are a segment of
    their own: they are launch latency, not the work of the kernel that follows. PREFILL is left
    out: it runs eagerly, once per request, and its wall time is mostly the host launching kernels
    one by one, which would flatten every other bar. Families come from the full kernel names (the
    short name of torch.argmax's reduce_kernel does not say argmax)."""
    ns: dict[tuple[str, int | None], dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for path in result.paths:
        if path.launch.name == PREFILL:
            continue
        cell = ns[(path.launch.name, path.launch.batch_size)]
        for k in path.kernels:
            cell[kernel_family(k.name)] += k.exclusive_ns - k.gap_ns
            cell[IDLE] += k.gap_ns
    bars = sorted(ns, key=lambda c: phase_order(*c))
    launches = {c: result.by_batch[c].launches for c in bars}
    return bars, {f: [ns[c][f] / launches[c] / 1e3 for c in bars] for f in SEGMENTS}


def write_png(result: Attribution, path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ProfilingError("the PNG chart needs matplotlib: `pip install matplotlib` or "
                             "`pip install 'graphrt[plot]'` (the table, JSON and trace do not)") from None
    bars, by_family = family_bars(result)
    labels = [f"{phase}\nB={b}" for phase, b in bars]
    fig, ax = plt.subplots(figsize=(0.9 * len(bars) + 3, 4.8))
    bottom = [0.0] * len(bars)
    for family in SEGMENTS:
        vals = by_family[family]
        if any(vals):
            ax.bar(labels, vals, bottom=bottom, label=family, **({"color": "lightgrey"} if family == IDLE else {}))
            bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_ylabel("exclusive time per launch (µs); bar = wall time")
    ax.set_title(f"graphrt: where each decode-cycle phase launch's wall time goes, by kernel family\n"
                 f"{result.source}", fontsize=9)
    ax.tick_params(axis="x", labelsize=7)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
