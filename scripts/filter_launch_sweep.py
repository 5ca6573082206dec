"""The filtered sampler in CUDA graph replay against its launch knobs (CUDA only): for each B, the
unfiltered one-hot sampler, then top_k 50 + top_p 0.9 and top_k 50 under the default launch and
under each knob set given.

    python scripts/filter_launch_sweep.py 1,2,4,16,64,256 [KNOBS,KNOBS,...] [--flat]

(--flat: top_p 0.9 alone too, whose randn rows take the whole-row search.)

KNOBS is '-' (the default launch) or slash-separated LaunchConfig fields, empty to leave one as it
is: filter_cand_warps / filter_cand_block_v / filter_kept_block_v / filter_stats_block_v /
filter_warps / filter_draw (0 or 1); e.g. '2/256/128' or '/////0'. Fields an older tree's
LaunchConfig lacks are dropped, so the same command times an older checkout's default (this tree's
lacks filter_stats_block_v and filter_warps: scripts/filter_kernel_times.py times those)."""

import dataclasses
import sys

from graphrt.kernels.bench import filter_cases, rejection_sets
from graphrt.kernels.rejection import LaunchConfig, launch_config, rejection_sample_triton
from graphrt.kernels.timing import time_in_graph

KNOB_FIELDS = ("filter_cand_warps", "filter_cand_block_v", "filter_kept_block_v", "filter_stats_block_v",
               "filter_warps", "filter_draw")


def knob_config(cfg: LaunchConfig, knobs: str) -> LaunchConfig:
    if knobs == "-":
        return cfg
    have = {f.name for f in dataclasses.fields(LaunchConfig)}
    vals = [int(x) if x else None for x in knobs.split("/")]
    return dataclasses.replace(cfg, **{k: v for k, v in zip(KNOB_FIELDS, vals) if v is not None and k in have})


def main() -> None:
    batches = [int(x) for x in sys.argv[1].split(",")]
    knob_sets = sys.argv[2].split(",") if len(sys.argv) > 2 else ["-"]
    flat = "--flat" in sys.argv[3:]
    for b in batches:
        sets = rejection_sets(b, 3, 128256, "onehot")
        plain = time_in_graph(lambda t, d, tt, s, p, q: rejection_sample_triton(t, d, tt, s, p), sets)
        cfg = launch_config(b, 3, False)
        for name, fk, fp in list(filter_cases(b))[:None if flat else 2]:
            cells = []
            for knobs in knob_sets:
                c = knob_config(cfg, knobs)
                us = time_in_graph(lambda t, d, tt, s, p, q, c_=c, k_=fk, p_=fp:
                                   rejection_sample_triton(t, d, tt, s, p, top_k=k_, top_p=p_, config=c_), sets)
                cells.append(f"{knobs}={us:.1f}")
            print(f"B={b} {name} unfiltered={plain:.1f} " + " ".join(cells), flush=True)


if __name__ == "__main__":
    main()
