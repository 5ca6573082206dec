#!/usr/bin/env python3
"""graphrt's fused rejection sampler beside vLLM's, timed in the same run on the same inputs.

vLLM's code is not in this repository. Extract the few files its sampler needs from the published
wheel into a git-ignored folder, with empty package __init__ files and a stand-in
vllm/triton_utils that exports triton, tl, tldevice and HAS_TRITON (the real one imports the engine):

    pip download --no-deps --only-binary=:all: --python-version 3.12 \
        --platform manylinux_2_28_x86_64 vllm==0.33.0 -d /tmp/vllm
    unzip the wheel's vllm/v1/worker/gpu/spec_decode/rejection_sampler_utils.py,
        vllm/v1/worker/gpu/sample/{gumbel,watermark}.py, vllm/v1/spec_decode/fly.py,
        vllm/v1/watermarking/prfs/{philox,base}.py into .vllm_src/  (see docs/notes/benchmarks-history.md)

    PYTHONPATH=.vllm_src python scripts/vllm_rejection_peer.py [--json F]
    PYTHONPATH=.vllm_src python scripts/vllm_rejection_peer.py --filters [--json F]

(scripts/vllm_peer_src.sh builds .vllm_src from the wheel, with stand-ins for the engine modules.)
--filters: one-hot q with top_k / top_p on every request (kernels/bench.FILTER_CASES). vLLM 0.33's
verify path then copies the logits to fp32, applies the temperature (skipped at 0 and 1, as its
sampler skips it), gathers each row's top_k and top_p, masks the logits with its Triton top-k /
top-p (v1/sample/ops/topk_topp_triton.py, pivot-based, no sort), and runs the same rejection
sampler on them: all of it timed, as one step of its model runner runs it. Checked before timing:
at most top_k entries kept per row, and every emitted token kept.

Inputs follow vLLM 0.33's model-runner layout (flattened [B * (K + 1), V] target logits; per row the
input token, i.e. the last verified token then the K drafts; cu_num_logits; per-row request index
and local position). vLLM's pipeline hands its sampler fp32 logits; graphrt's reads the LM head's
bf16. Both are timed on fp32 and on bf16 logits, so the table has the same-dtype comparison and
the as-deployed one. Greedy results on fp32 logits are checked to agree token for token before
timing; the sampled modes draw from different random streams, so only their shapes and accepted
lengths' range are checked.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def vllm_inputs(target, drafts, temperature, seed, position, draft_logits):
    """graphrt's arguments -> vLLM 0.33 rejection_sample's keyword arguments."""
    b, r, v = target.shape
    k = r - 1
    dev = target.device
    rows = torch.arange(r, device=dev)
    last = torch.zeros(b, 1, dtype=torch.int64, device=dev)  # the verified token: never compared
    return dict(
        target_logits=target.view(b * r, v),
        draft_logits=draft_logits,
        draft_sampled=torch.cat([last, drafts], 1).flatten(),
        cu_num_logits=torch.arange(b + 1, device=dev, dtype=torch.int32) * r,
        pos=((position - 1)[:, None] + rows).flatten(),
        idx_mapping=torch.arange(b, device=dev, dtype=torch.int32),
        expanded_idx_mapping=torch.arange(b, device=dev, dtype=torch.int32).repeat_interleave(r),
        expanded_local_pos=rows.to(torch.int32).repeat(b),
        temperature=temperature,
        seed=seed,
        num_speculative_steps=k,
    )


def check(mode, dtype, b, k, mine, sampled, num):
    """Shapes and ranges always; greedy on fp32 logits token for token (bf16 rows may tie, and ties
    may break differently; the sampled modes draw from different random streams)."""
    assert sampled.shape[0] == b and num.shape == (b,), (sampled.shape, num.shape)
    assert bool(((num >= 1) & (num <= k + 1)).all()), f"{mode}: vLLM num_sampled out of range"
    if mode == "greedy" and dtype == torch.float32:
        assert torch.equal(num.to(torch.int64), mine.num_emitted.to(torch.int64)), (
            f"greedy B={b}: accepted lengths differ: graphrt {mine.num_emitted.tolist()[:8]} vLLM {num.tolist()[:8]}")
        for i in range(b):
            n_i = int(num[i])
            assert torch.equal(sampled[i, :n_i].to(torch.int64), mine.token_ids[i, :n_i]), f"greedy B={b} row {i}"


def vllm_filtered(kw, scale, top_k, top_p):
    """vLLM 0.33's verify step with filters (RejectionSampler._verify after apply_sampling_params)
    on rejection_sample's keyword arguments kw; scale: whether a temperature is neither 0 nor 1
    (vLLM decides that on the host). Returns (sampled, num_sampled, the masked fp32 logits)."""
    from vllm.v1.sample.ops.topk_topp_triton import apply_top_k_top_p_triton
    from vllm.v1.worker.gpu.sample.gumbel import apply_temperature
    from vllm.v1.worker.gpu.spec_decode.rejection_sampler_utils import rejection_sample

    eim = kw["expanded_idx_mapping"]
    logits = torch.empty_like(kw["target_logits"], dtype=torch.float32).copy_(kw["target_logits"])
    if scale:
        apply_temperature(logits, eim, kw["temperature"])
    k_rows = None if top_k is None else top_k[eim]
    p_rows = None if top_p is None else top_p[eim]
    logits = apply_top_k_top_p_triton(logits, k_rows, p_rows, has_topp_only_rows=top_k is None and top_p is not None)
    sampled, num = rejection_sample(**dict(kw, target_logits=logits))
    return sampled, num, logits


def filter_rows(args, k, v, bw):
    """--filters: graphrt's filtered one-hot sampler against vLLM 0.33's filtered verify path."""
    from graphrt.kernels.bench import filter_cases, rejection_sets
    from graphrt.kernels.rejection import rejection_sample_triton
    from graphrt.kernels.timing import time_in_graph

    rows = []
    print(f"{'filters':16} {'dtype':5} {'B':>4} {'graphrt us':>11} {'unfiltered us':>14} {'vLLM 0.33 us':>13} "
          f"{'vLLM/graphrt':>13}")
    for dtype in (torch.bfloat16, torch.float32):
        for b in (int(x) for x in args.batch_sizes.split(",")):
            sets = rejection_sets(b, k, v, "onehot", dtype)
            plain = time_in_graph(lambda t, d, tt, s, p, q: rejection_sample_triton(t, d, tt, s, p), sets)
            for name, fk, fp in filter_cases(b):
                ours = lambda t, d, tt, s, p, q, k_=fk, p_=fp: rejection_sample_triton(t, d, tt, s, p, top_k=k_,
                                                                                      top_p=p_)
                us_ours = time_in_graph(ours, sets)
                vsets = [(vllm_inputs(*st), not bool(((st[2] == 0) | (st[2] == 1)).all())) for st in sets]
                kt = None if fk is None else fk.to(torch.int32)
                theirs = lambda kw, scale, k_=kt, p_=fp: vllm_filtered(kw, scale, k_, p_)[:2]
                try:
                    sampled, num, masked = vllm_filtered(*vsets[0], kt, fp)
                    torch.cuda.synchronize()
                    kept = masked > float("-inf")
                    if fk is not None:
                        assert int(kept.sum(1).max()) <= int(fk.max()), "vLLM kept more than top_k"
                    rows_of = torch.arange(b * (k + 1), device="cuda").view(b, k + 1)
                    for i in range(b):
                        n_i = int(num[i])
                        ok = kept[rows_of[i, :n_i], sampled[i, :n_i].long()].all()
                        assert bool(ok), f"vLLM emitted a masked token (row {i})"
                    us_vllm = time_in_graph(theirs, vsets)
                except Exception as e:  # the peer only: report it, keep the row
                    print(f"vLLM {name} {dtype} B={b}: {type(e).__name__}: {str(e)[:200]}")
                    us_vllm = float("nan")
                dname = "fp32" if dtype == torch.float32 else "bf16"
                rows.append(dict(mode="onehot", filters=name, dtype=dname, B=b, K=k, V=v, graphrt_us=us_ours,
                                 unfiltered_us=plain, vllm_us=us_vllm, bandwidth_gbs=bw))
                print(f"{name:16} {dname:5} {b:>4} {us_ours:>11.2f} {plain:>14.2f} {us_vllm:>13.2f} "
                      f"{us_vllm / us_ours:>12.2f}x", flush=True)
    return rows


def main():
    from graphrt.kernels.bench import rejection_sets
    from graphrt.kernels.rejection import rejection_sample_triton
    from graphrt.kernels.timing import memory_bandwidth_gbs, time_in_graph
    from vllm.v1.worker.gpu.spec_decode.rejection_sampler_utils import rejection_sample as vllm_rejection_sample

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch-sizes", default="1,8,64,256")
    ap.add_argument("-k", type=int, default=3)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--filters", action="store_true", help="the filtered one-hot sampler against vLLM's filtered path")
    args = ap.parse_args()
    bw = memory_bandwidth_gbs()
    torch.manual_seed(0)
    k, v = args.k, args.vocab
    if args.filters:
        rows = filter_rows(args, k, v, bw)
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1))
        return
    rows = []
    print(f"{'mode':8} {'dtype':5} {'B':>4} {'graphrt us':>11} {'vLLM 0.33 us':>13} {'vLLM/graphrt':>13} "
          f"{'bf16 floor us':>14}")
    for mode in ("greedy", "onehot", "fullq"):
        for dtype in (torch.float32, torch.bfloat16):
            for b in (int(x) for x in args.batch_sizes.split(",")):
                sets = rejection_sets(b, k, v, mode, dtype)
                ours = lambda t, d, tt, s, p, q: rejection_sample_triton(t, d, tt, s, p, draft_logits=q)
                # vLLM's model runner prepares its metadata tensors once per step: outside the timing
                vsets = [(vllm_inputs(*st),) for st in sets]
                theirs = lambda kw: vllm_rejection_sample(**kw)
                mine = ours(*sets[0])
                us_ours = time_in_graph(ours, sets)
                try:
                    sampled, num = theirs(*vsets[0])
                    torch.cuda.synchronize()
                    check(mode, dtype, b, k, mine, sampled, num)
                    us_vllm = time_in_graph(theirs, vsets)
                except Exception as e:  # the peer only: report it, keep the row
                    print(f"vLLM {mode} {dtype} B={b}: {type(e).__name__}: {str(e)[:200]}")
                    us_vllm = float("nan")
                floor = b * (k + 1) * v * 2 / (bw * 1e3)
                name = "fp32" if dtype == torch.float32 else "bf16"
                rows.append(dict(mode=mode, dtype=name, B=b, K=k, V=v, graphrt_us=us_ours, vllm_us=us_vllm,
                                 bf16_floor_us=floor, bandwidth_gbs=bw))
                print(f"{mode:8} {name:5} {b:>4} {us_ours:>11.2f} {us_vllm:>13.2f} {us_vllm / us_ours:>12.2f}x "
                      f"{floor:>14.2f}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
