"""Vocab-parallel sampling against gathering the logits (kernels/vocab_parallel.py).

    torchrun --nproc-per-node 2 scripts/bench_vocab_parallel.py --out DIR            # NCCL, CUDA graphs
    torchrun --nproc-per-node 2 scripts/bench_vocab_parallel.py --out DIR --device cpu   # gloo smoke test

Each rank holds a vocab shard (vocab_shard) of bf16 logits, V = 128256, K = 3, B = 1, 8, 64
(--vocab, --k, --batch-sizes). Per batch size and mode (greedy, one-hot sampled at temperature 1):
  (a) vp:      rejection_sample(shard, group=...): row pass on the shard, one all_gather of stat
               planes, assemble, walk;
  (b) gather:  all_gather of the [B, K+1, shard] logits (shards padded to one size, as
               all_gather needs), the copy to [B, K+1, V], then the single-GPU rejection_sample;
  (c) argmax on [B, V] (the draft's top-1): argmax(shard, group=...) against all_gather + argmax.
Also the single-GPU sampler on full logits already in place ("single": no communication), for
scale. Times: median microseconds per call over graph replays (kernels/timing.time_in_graph,
rotating input sets past L2), the max over ranks; on CPU, median of eager calls. Bytes per row:
what every rank receives per logits row (B*(K+1) rows for the sampler, B for argmax). Prints a
table; rank 0 writes the JSON (--out FILE.json, or DIR/bench_vocab_parallel.json).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from graphrt.kernels import argmax, rejection_sample
from graphrt.kernels import vocab_parallel as vp

_L2_BYTES = 50 << 20


def make_sets(b: int, k: int, v: int, world: int, rank: int, mode: str, dev: torch.device, n: int) -> list[dict]:
    """n input sets, identical on every rank (one seeded generator), each with this rank's shard
    (contiguous, as an LM head shard would write it) and a padded copy for the gather baseline."""
    start, end = vp.vocab_shard(v, world, rank)
    shard = vp.vocab_plan(b, k, v, world, rank).shard  # every shard padded to this for all_gather
    gen = torch.Generator().manual_seed(1234 + b)
    sets = []
    for _ in range(n):
        full = (torch.randn(b, k + 1, v, generator=gen) * 3).to(torch.bfloat16)
        top = full[:, :k].float().argmax(-1)
        rand = torch.randint(0, v, (b, k), generator=gen)
        drafts = torch.where(torch.arange(b)[:, None] % 2 == 0, top, rand)  # half accept, half reject
        padded = torch.full((b, k + 1, shard), float("-inf"), dtype=torch.bfloat16)
        padded[..., : end - start] = full[..., start:end]
        sets.append(dict(
            shard=full[..., start:end].contiguous().to(dev), padded=padded.to(dev), full=full.to(dev),
            drafts=drafts.to(dev),
            temperature=torch.full((b,), 0.0 if mode == "greedy" else 1.0, device=dev),
            seed=torch.randint(0, 2**62, (b,), generator=gen).to(dev),
            position=torch.randint(0, 2**20, (b,), generator=gen).to(dev),
            gathered=torch.empty((world * b, k + 1, shard), dtype=torch.bfloat16, device=dev)))
    return sets


def _gather_full(s: dict, v: int, world: int) -> torch.Tensor:
    """The baseline's all_gather of the padded shards and its copy to [B, K+1, V]."""
    vp._gather_single(s["gathered"], s["padded"], group=None)
    b, r, shard = s["padded"].shape
    g = s["gathered"].view(world, b, r, shard).permute(1, 2, 0, 3).reshape(b, r, world * shard)
    return g[..., :v]


def timed(fn, sets: list[dict], dev: torch.device, replays: int) -> float:
    """Median us per call, the max over ranks (every rank runs the same collectives in order)."""
    dist.barrier()
    if dev.type == "cuda":
        from graphrt.kernels.timing import time_in_graph

        us = time_in_graph(fn, [(s,) for s in sets], per_graph=min(20, 2 * len(sets)), replays=replays)
    else:
        for s in sets[:2]:
            fn(s)
        times = []
        for i in range(replays):
            t = time.perf_counter()
            fn(sets[i % len(sets)])
            times.append((time.perf_counter() - t) * 1e6)
        us = statistics.median(times)
    t = torch.tensor([us], dtype=torch.float64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="a .json file, or a folder for bench_vocab_parallel.json")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--vocab", type=int, default=None, help="default 128256 (cuda), 1000 (cpu)")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--batch-sizes", default=None, help="default 1,8,64 (cuda), 1,4 (cpu)")
    ap.add_argument("--replays", type=int, default=None)
    args = ap.parse_args()
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dev = torch.device("cuda", torch.cuda.current_device())
        dist.init_process_group("nccl", device_id=dev)
    else:
        dev = torch.device("cpu")
        dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    v = args.vocab or (128256 if cuda else 1000)
    k = args.k
    bss = [int(x) for x in (args.batch_sizes or ("1,8,64" if cuda else "1,4")).split(",")]
    replays = args.replays or (50 if cuda else 5)
    group = dist.group.WORLD
    shard = vp.vocab_plan(1, k, v, world, rank).shard
    rows_out = []
    for b in bss:
        r = k + 1
        n = max(2, min(16, -(-3 * _L2_BYTES // (b * r * shard * 2)))) if cuda else 2
        plan = vp.vocab_plan(b, k, v, world, rank, use_triton=cuda)
        row = dict(batch=b, k=k, vocab=v, world=world, sps=plan.sps, splits=plan.splits,
                   bytes_per_row=dict(vp=world * 4 * 12 * plan.sps, gather=world * shard * 2,
                                      argmax_vp=world * 8, argmax_gather=world * shard * 2))
        for mode in ("greedy", "sampled"):
            sets = make_sets(b, k, v, world, rank, mode, dev, n)

            def vp_call(s):
                return rejection_sample(s["shard"], s["drafts"], s["temperature"], s["seed"], s["position"],
                                        group=group, vocab_size=v)

            def gather_call(s):
                return rejection_sample(_gather_full(s, v, world), s["drafts"], s["temperature"], s["seed"],
                                        s["position"])

            def single_call(s):
                return rejection_sample(s["full"], s["drafts"], s["temperature"], s["seed"], s["position"])

            # Same tokens both ways (the gather baseline races in RACE_CHUNK chunks, vp in
            # vocab_race_chunk(V, W): equal at V >= W * 8192; greedy always).
            if mode == "greedy" or vp.vocab_race_chunk(v, world) == vp.RACE_CHUNK:
                a, g = vp_call(sets[0]), gather_call(sets[0])
                row[f"{mode}_same_tokens"] = bool(torch.equal(a.token_ids, g.token_ids))
            row[f"{mode}_vp_us"] = timed(vp_call, sets, dev, replays)
            row[f"{mode}_gather_us"] = timed(gather_call, sets, dev, replays)
            row[f"{mode}_single_us"] = timed(single_call, sets, dev, replays)
            row[f"{mode}_ratio_gather_over_vp"] = row[f"{mode}_gather_us"] / row[f"{mode}_vp_us"]
        sets = make_sets(b, 0, v, world, rank, "greedy", dev, n)  # [B, 1, V]: one row per request

        def argmax_vp(s):
            return argmax(s["shard"][:, 0], group=group, vocab_size=v)

        def argmax_gather(s):
            return argmax(_gather_full(s, v, world)[:, 0])

        ok = torch.equal(argmax_vp(sets[0])[1], argmax_gather(sets[0])[1])
        row.update(argmax_same=bool(ok), argmax_vp_us=timed(argmax_vp, sets, dev, replays),
                   argmax_gather_us=timed(argmax_gather, sets, dev, replays))
        row["argmax_ratio_gather_over_vp"] = row["argmax_gather_us"] / row["argmax_vp_us"]
        rows_out.append(row)
        if rank == 0:
            print(json.dumps(row), flush=True)

    if rank == 0:
        name = torch.cuda.get_device_name(dev) if cuda else "cpu (gloo, the PyTorch path)"
        print(f"\n{world} x {name}, V = {v}, K = {k}, bf16; us per call (max over ranks), bytes received per row")
        print(f"{'B':>4} {'mode':>8} {'vp':>9} {'gather':>9} {'single':>9} {'gather/vp':>9} {'B/row vp':>9} "
              f"{'B/row gather':>12}")
        for row in rows_out:
            for mode in ("greedy", "sampled"):
                print(f"{row['batch']:>4} {mode:>8} {row[mode + '_vp_us']:>9.1f} {row[mode + '_gather_us']:>9.1f} "
                      f"{row[mode + '_single_us']:>9.1f} {row[mode + '_ratio_gather_over_vp']:>9.2f} "
                      f"{row['bytes_per_row']['vp']:>9} {row['bytes_per_row']['gather']:>12}")
            print(f"{row['batch']:>4} {'argmax':>8} {row['argmax_vp_us']:>9.1f} {row['argmax_gather_us']:>9.1f} "
                  f"{'':>9} {row['argmax_ratio_gather_over_vp']:>9.2f} {row['bytes_per_row']['argmax_vp']:>9} "
                  f"{row['bytes_per_row']['argmax_gather']:>12}")
        out = Path(args.out)
        if out.suffix != ".json":
            out = out / "bench_vocab_parallel.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(dict(device=name, rows=rows_out), indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
