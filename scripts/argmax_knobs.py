"""Argmax launch knobs at given batch sizes: a sweep, then the default and the best three re-timed,
interleaved, three times each (a single sweep's winner is biased by its own noise).

    python scripts/argmax_knobs.py [--batch-sizes 1,8,64] [--vocab 128256]

Same harness as the kernel table (CUDA-graph replay, input sets rotated past L2, bf16). Configs are
(block_v, chunks per row, num_warps, fused); kernels/argmax._launch_config holds the defaults.
"""

from __future__ import annotations

import argparse
import functools
import itertools

import torch
from graphrt.kernels.argmax import _launch_config, argmax_triton
from graphrt.kernels.bench import num_input_sets
from graphrt.kernels.timing import time_in_graph


def knob_grid(vocab: int) -> list[tuple[int, int, int, bool]]:
    """(block_v, chunks per row, num_warps, fused) configs worth timing at this vocab."""
    return [c for c in itertools.product((1024, 2048, 4096, 8192), (8, 16, 32, 64, 128), (4, 8), (False, True))
            if c[0] * c[1] <= 4 * vocab]


def argmax_inputs(batch: int, vocab: int) -> tuple[list[tuple[torch.Tensor]], tuple[torch.Tensor, torch.Tensor]]:
    """(bf16 logits input sets rotated past L2, preallocated (values, indices) outputs) for timing."""
    sets = [(torch.randn(batch, vocab, device="cuda", dtype=torch.bfloat16),)
            for _ in range(num_input_sets(batch * vocab * 2))]
    outs = (torch.empty(batch, dtype=torch.bfloat16, device="cuda"),
            torch.empty(batch, dtype=torch.int64, device="cuda"))
    return sets, outs


def time_config(cfg, *, outs, sets) -> float:
    """Graph-replay time (us) of argmax_triton with the launch knobs cfg."""
    block_v, per_row, warps, fused = cfg
    fn = functools.partial(argmax_triton, out=outs, block_v=block_v, num_splits=per_row, num_warps=warps,
                           fused=fused)
    return time_in_graph(fn, sets)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch-sizes", default="1,8,64")
    ap.add_argument("--vocab", type=int, default=128256)
    args = ap.parse_args()
    v = args.vocab
    for b in (int(x) for x in args.batch_sizes.split(",")):
        sets, outs = argmax_inputs(b, v)
        timed = functools.partial(time_config, outs=outs, sets=sets)
        swept = sorted((timed(c), c) for c in knob_grid(v))
        default = _launch_config(b)
        print(f"B={b} default {default}; sweep best {[(round(t, 2), c) for t, c in swept[:4]]}")
        cands = [default] + [c for _, c in swept[:4] if c != default][:3]
        times = {c: [] for c in cands}
        for _ in range(3):
            for c in cands:
                times[c].append(timed(c))
        for c in cands:
            print(f"B={b} {c}: " + " ".join(f"{t:.2f}" for t in times[c]) + f"  mean {sum(times[c]) / 3:.2f}")
        del sets, timed


if __name__ == "__main__":
    main()
