"""Benchmark: paged attention (Triton split-KV) vs torch SDPA vs the KV-read floor, in CUDA graphs.

Llama-3.1-8B attention shape (Hq 32, Hkv 8, head_dim 128, bf16, block_size 16), contexts 4096
and 32768, B in {1, 8, 64}, query_len 1 (TARGET_DECODE / DRAFT_DECODE) and 4 (TARGET_VERIFY with
K = 3). Every request has the full context; blocks are shuffled across the pool.

    ours_us   paged_attention_triton, timed with time_in_graph (graph replay)
    torch_us  torch SDPA on K/V already gathered into contiguous [B, Hkv, L, D] (the gather is not
              timed), GQA folded into the query length so no K/V expansion happens
    floor_us  K and V bytes of the live context read once, over the measured copy bandwidth
    ratio     ours_us / floor_us (target at 4k context: <= 1.5)

python -m graphrt.kernels.attention_bench [--sweep | --sweep-small | --sweep-short]: the default table,
or one of the SWEEPS grids (the defaults in attention.py come from them).
"""

from __future__ import annotations

import argparse
import itertools
import math

import torch
from graphrt.kernels.attention import attention_workspace, paged_attention_triton
from graphrt.kernels.timing import memory_bandwidth_gbs, time_in_graph

HQ, HKV, HEAD_DIM, PAGE = 32, 8, 128, 16
DTYPE = torch.bfloat16
MAX_BYTES = 20e9  # skip combinations whose KV cache exceeds this
L2_BYTES = 256 << 20  # rotate input sets until the working set is well past any L2


def _kv_bytes(bsz: int, ctx: int) -> int:
    return 2 * bsz * ctx * HKV * HEAD_DIM * torch.finfo(DTYPE).bits // 8


def _make_set(bsz: int, ctx: int, query_len: int, gen: torch.Generator):
    blocks = -(-ctx // PAGE)
    kc = torch.randn(bsz * blocks, PAGE, HKV, HEAD_DIM, device="cuda", dtype=DTYPE, generator=gen)
    vc = torch.randn_like(kc)
    bt = torch.randperm(bsz * blocks, device="cuda", generator=gen).to(torch.int32).view(bsz, blocks)
    sl = torch.full((bsz,), ctx, device="cuda", dtype=torch.int32)
    q = torch.randn(bsz * query_len, HQ, HEAD_DIM, device="cuda", dtype=DTYPE, generator=gen)
    return q, kc, vc, bt, sl


def _sdpa_args(q, kc, vc, bt, ctx: int, query_len: int):
    """Contiguous K/V [B, Hkv, L, D]; query [B, Hkv, G * query_len, D]; bottom-right causal mask."""
    bsz = bt.shape[0]
    group = HQ // HKV
    k = kc[bt.long()].view(bsz, -1, HKV, HEAD_DIM)[:, :ctx].transpose(1, 2).contiguous()
    v = vc[bt.long()].view(bsz, -1, HKV, HEAD_DIM)[:, :ctx].transpose(1, 2).contiguous()
    qq = q.view(bsz, query_len, HKV, group, HEAD_DIM).permute(0, 2, 3, 1, 4)
    qq = qq.reshape(bsz, HKV, group * query_len, HEAD_DIM).contiguous()
    mask = None
    if query_len > 1:
        t = torch.arange(query_len, device="cuda").repeat(group)  # row g * query_len + t
        mask = torch.arange(ctx, device="cuda")[None, :] <= (ctx - query_len + t)[:, None]
    return qq, k, v, mask


def _time(fn, sets, est_us: float) -> float:
    per_graph = int(max(2, min(20, 20000 / max(est_us, 1.0))))
    return time_in_graph(fn, sets, per_graph=per_graph, replays=10 if est_us > 1000 else 30)


def run(contexts=(4096, 32768), batches=(1, 8, 64), query_lens=(1, 4), *, with_torch: bool = True,
        bw_gbs: float | None = None, **kernel_kwargs) -> list[dict]:
    """One row per (context, B, query_len); kernel_kwargs go to paged_attention_triton (tuning)."""
    bw = bw_gbs or memory_bandwidth_gbs()
    gen = torch.Generator(device="cuda").manual_seed(0)
    scale = HEAD_DIM**-0.5
    rows = []
    for ctx, bsz, ql in itertools.product(contexts, batches, query_lens):
        nbytes = _kv_bytes(bsz, ctx)
        if nbytes > MAX_BYTES:
            continue
        floor_us = nbytes / (bw * 1e9) * 1e6
        n_sets = max(1, min(4, math.ceil(L2_BYTES / nbytes)))
        sets = []
        for _ in range(n_sets):
            q, kc, vc, bt, sl = _make_set(bsz, ctx, ql, gen)
            out = torch.empty_like(q)
            ws = attention_workspace(q.shape[0], HQ, HEAD_DIM, 64, "cuda")
            sets.append((q, kc, vc, bt, sl, out, ws))

        def ours(q, kc, vc, bt, sl, out, ws, ql=ql, ctx=ctx):
            paged_attention_triton(
                q, kc, vc, bt, sl, query_len=ql, scale=scale, out=out, workspace=ws, max_seq_len=ctx,
                **kernel_kwargs,
            )  # fmt: skip

        ours_us = _time(ours, sets, floor_us)
        torch_us = float("nan")
        if with_torch:
            try:
                sdpa_sets = [_sdpa_args(s[0], s[1], s[2], s[3], ctx, ql) for s in sets[:1]]
                sdpa = lambda qq, k, v, mask: torch.nn.functional.scaled_dot_product_attention(
                    qq, k, v, attn_mask=mask, scale=scale
                )
                torch_us = _time(sdpa, sdpa_sets, floor_us)
                del sdpa_sets
            except (RuntimeError, torch.cuda.OutOfMemoryError) as e:  # baseline only: report, go on
                print(f"torch baseline failed at B={bsz} ctx={ctx} ql={ql}: {e}")
        rows.append(dict(kernel="paged_attention", B=bsz, query_len=ql, seq_len=ctx, heads=f"{HQ}/{HKV}",
                         head_dim=HEAD_DIM, ours_us=round(ours_us, 2), torch_us=round(torch_us, 2),
                         floor_us=round(floor_us, 2), ratio=round(ours_us / floor_us, 2)))
        del sets
        torch.cuda.empty_cache()
    return rows


# Tuning grids: (contexts, batches, paged_attention_triton keyword sets), each crossed with query_len 1 and 4.
SWEEPS = {
    # KV tile x warps x stages at the split heuristic, then split counts at the default tile
    "sweep": ((4096,), (1, 8), [dict(block_n=bn, num_warps=w, num_stages=st)
                                for bn, w, st in itertools.product((32, 64, 128), (4, 8), (2, 3, 5))]
              + [dict(num_splits=n) for n in (1, 4, 8, 16, 32, 48, 64)]),
    # small batches: split count x KV tile x stages crossed (tokens per split / BLOCK_N is each
    # program's loop, so the two interact)
    "sweep_small": ((4096,), (1, 2), [dict(num_splits=sp, block_n=bn, num_warps=4, num_stages=st)
                                      for sp, bn, st in itertools.product((8, 16, 24, 32, 48, 64), (32, 64), (1, 3))]),
    # short contexts (early in a generation, or a small max_seq_len): where splitting, which adds
    # the merge launch, starts to pay
    "sweep_short": ((160, 256, 512, 1024), (1, 8), [dict(num_splits=sp) for sp in (1, 2, 4, 8)]),
}


def sweep(name: str) -> list[dict]:
    """The rows of grid SWEEPS[name], sorted by (context, B, query_len, time)."""
    contexts, batches, configs = SWEEPS[name]
    rows = []
    bw = memory_bandwidth_gbs()
    for kw in configs:
        try:
            got = run(contexts=contexts, batches=batches, with_torch=False, bw_gbs=bw, **kw)
        except Exception as e:  # e.g. out of shared memory for a large tile x stages
            print(f"{kw}: {type(e).__name__}: {e}")
            continue
        rows += [{"config": " ".join(f"{k}={v}" for k, v in kw.items()), **r} for r in got]
    rows.sort(key=lambda r: (r["seq_len"], r["B"], r["query_len"], r["ours_us"]))
    return rows


def _print(rows: list[dict]) -> None:
    if not rows:
        return
    keys = list(rows[0])
    print("  ".join(f"{k:>15}" for k in keys))
    for r in rows:
        print("  ".join(f"{r[k]!s:>15}" for k in keys))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name in SWEEPS:
        parser.add_argument("--" + name.replace("_", "-"), dest="grid", action="store_const", const=name)
    args = parser.parse_args()
    _print(sweep(args.grid) if args.grid else run())


if __name__ == "__main__":
    main()
