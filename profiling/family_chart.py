"""`graphrt profile --png F`: a stacked bar per phase and batch size of exclusive time by kernel
family. Exclusive times add up to the wall time, so each bar's height is the launch's mean wall
time and each segment what that family costs it; a kernel that mostly waits under PDL adds
little, as it should. The idle gaps between kernels (inside exclusive times) are a segment of
their own: they are launch latency, not the work of the kernel that follows.

PREFILL is left out: it runs eagerly, once per request, and its wall time is mostly the host
launching kernels one by one, tens of times a cycle phase's, which would flatten every other bar.
"""

from __future__ import annotations

from collections import defaultdict

from graphrt.profiling.attribution import Attribution, ProfilingError
from graphrt.profiling.kernel_families import FAMILIES, kernel_family
from graphrt.profiling.phases import PREFILL, phase_order

IDLE = "idle (gaps)"
SEGMENTS = (*FAMILIES, IDLE)


def family_bars(result: Attribution) -> tuple[list[tuple[str, int | None]], dict[str, list[float]]]:
    """The bars, (phase, batch size) in phase order, and per segment (each family, then IDLE) its
    mean time per launch in microseconds in each bar. Families come from the full kernel names (the
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
