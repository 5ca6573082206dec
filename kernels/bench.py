"""Benchmarks of the sampling kernels, timed the way they run: replayed inside a CUDA graph.

    python -m graphrt.kernels.bench [out.json]

For each (B, V): argmax (ours vs torch.argmax vs the bytes-read floor); for each (B, K, V):
rejection_sample greedy / one-hot q / full q (ours vs a plain-torch sampler vs the bf16 read-once
floor); the filtered one-hot sampler (_filter_rows; `--filters`: these rows only); then
graphrt.kernels.attention_bench.run()'s rows. Inputs rotate over enough sets to exceed L2 (50 MB).
"""

from __future__ import annotations

import dataclasses
import json
import sys

import torch
from graphrt.kernels import attention_bench
from graphrt.kernels.argmax import argmax_triton
from graphrt.kernels.rejection import filter_stage, launch_config, rejection_sample_triton
from graphrt.kernels.rejection_reference import RACE_CHUNK, apply_thresholds, thresholds_reference
from graphrt.kernels.timing import memory_bandwidth_gbs, time_in_graph

_L2_BYTES = 50 << 20


def num_input_sets(bytes_per_set: int) -> int:
    """How many input sets of bytes_per_set a timing rotates through: enough to exceed L2 three times."""
    return max(2, min(16, -(-3 * _L2_BYTES // max(1, bytes_per_set))))


def torch_rejection_baseline(target, drafts, temperature, seed, position, draft_logits=None):
    """Plain-torch sampler with the same logic: fp32 softmax of every row, then the walk in torch ops.

    Uses torch's global-state exponential noise (not our counter RNG): it measures cost, not bits.
    """
    b, r, v = target.shape
    k = r - 1
    greedy = ~(temperature > 0)
    inv_t = torch.where(greedy, torch.ones_like(temperature), 1.0 / temperature)
    x = target.float() * inv_t[:, None, None]
    p = torch.softmax(x, -1)
    amax = x.argmax(-1)
    p_d = p[:, :k].gather(-1, drafts[..., None]).squeeze(-1)
    u = torch.rand(b, k, device=target.device)
    if draft_logits is not None:
        q = torch.softmax(draft_logits.float() * inv_t[:, None, None], -1)
        q_d = q.gather(-1, drafts[..., None]).squeeze(-1)
        accept = u * q_d < p_d
    else:
        accept = u < p_d
    accept = torch.where(greedy[:, None], drafts == amax[:, :k], accept)
    j = torch.arange(k, device=target.device)
    n_acc = torch.where(~accept, j, k).amin(-1)
    rows = torch.arange(b, device=target.device)
    pr = p[rows, n_acc]
    if draft_logits is not None:
        pr = torch.where((n_acc < k)[:, None], (pr - q[rows, n_acc.clamp(max=k - 1)]).clamp(min=0), pr)
    noise = torch.empty_like(pr).exponential_()
    tok = torch.where(greedy, amax[rows, n_acc], (pr / noise).argmax(-1))
    return tok, n_acc + 1


def _argmax_rows(bw_gbs, Bs, Vs):
    rows = []
    for v in Vs:
        for b in Bs:
            nbytes = b * v * 2
            sets = [(torch.randn(b, v, device="cuda", dtype=torch.bfloat16),)
                    for _ in range(num_input_sets(nbytes))]
            ours = time_in_graph(lambda x: argmax_triton(x), sets)
            ref = time_in_graph(lambda x: torch.argmax(x, dim=-1), sets)
            floor = nbytes / (bw_gbs * 1e3)
            rows.append(dict(kernel="argmax", B=b, K=None, V=v, dtype="bf16", ours_us=ours, torch_us=ref,
                             floor_us=floor))
    return rows


def rejection_sets(b, k, v, mode, dtype=torch.bfloat16):
    """Enough input sets to exceed L2, each rejection_sample's positional arguments plus draft
    logits: (target [b, k+1, v], drafts [b, k] (every other request's drafts the target's argmax,
    the rest random), temperature (0 for greedy, else 1), seed, position, draft logits (full q) or
    None). Also used by scripts/vllm_rejection_peer.py, so both samplers see the same inputs."""
    n = num_input_sets(b * (k + 1) * v * torch.finfo(dtype).bits // 8 * 2)
    temp = 0.0 if mode == "greedy" else 1.0
    sets = []
    for _ in range(n):
        target = torch.randn(b, k + 1, v, device="cuda", dtype=dtype)
        qlog = torch.randn(b, k, v, device="cuda", dtype=dtype) if mode == "fullq" else None
        drafts = target[:, :k].argmax(-1)
        drafts[::2] = torch.randint(0, v, drafts[::2].shape, device="cuda")
        sets.append((target, drafts, torch.full((b,), temp, device="cuda"),
                     torch.arange(b, device="cuda"), torch.arange(b, device="cuda"), qlog))
    return sets


def _rejection_rows(bw_gbs, Bs, Ks, Vs):
    rows = []
    for v in Vs:
        for k in Ks:
            for b in Bs:
                floor = b * (k + 1) * v * 2 / (bw_gbs * 1e3)
                for mode in ("greedy", "onehot", "fullq"):
                    sets = rejection_sets(b, k, v, mode)
                    ours = time_in_graph(lambda t, d, tt, s, p, q: rejection_sample_triton(
                        t, d, tt, s, p, draft_logits=q), sets)
                    ref = time_in_graph(torch_rejection_baseline, sets)
                    rows.append(dict(kernel=f"rejection_{mode}", B=b, K=k, V=v, dtype="bf16", ours_us=ours,
                                     torch_us=ref, floor_us=floor))
    return rows


FILTER_CASES = (("topk50_topp0.9", 50, 0.9), ("topk50", 50, None), ("topp0.9", None, 0.9))


def filter_cases(b: int):
    """(name, top_k [b] int64 or None, top_p [b] fp32 or None) on CUDA per case of FILTER_CASES."""
    for name, top_k, top_p in FILTER_CASES:
        yield (name, None if top_k is None else torch.full((b,), top_k, dtype=torch.int64, device="cuda"),
               None if top_p is None else torch.full((b,), top_p, dtype=torch.float32, device="cuda"))


def _filter_rows(bw_gbs, Bs=(1, 64, 256), k=3, v=128256):
    """One-hot rejection sampling with FILTER_CASES on every request: ours (ours_us; unfiltered_us:
    without the filters; whole_rows_us: filter_draw off; thresholds_us: the filters' kernels alone)
    vs torch (torch_us: the reference's sort-based thresholds, then the plain-torch sampler). The logits are
    randn: flat enough that top_p alone keeps most of the vocabulary, so its rows overflow the
    candidate buffer and take the whole-row search (kernels/rejection_filter.py): its worst case.
    topp0.9_oneflat (B > 1): top_p = 0.9 on every request, all but the first request's logits scaled
    6x (peaked rows: few candidates), so one request's rows take the whole-row search."""
    rows = []
    for b in Bs:
        sets = rejection_sets(b, k, v, "onehot")
        plain = time_in_graph(lambda t, d, tt, s, p, q: rejection_sample_triton(t, d, tt, s, p), sets)
        cfg = launch_config(b, k, False)
        whole_cfg = dataclasses.replace(cfg, filter_draw=False)
        cases = [(name, fk, fp, sets) for name, fk, fp in filter_cases(b)]
        if b > 1:
            cases.append(("topp0.9_oneflat", None, torch.full((b,), 0.9, device="cuda"), _one_flat(sets)))
        for name, fk, fp, inputs in cases:
            ours = time_in_graph(lambda t, d, tt, s, p, q, k_=fk, p_=fp: rejection_sample_triton(
                t, d, tt, s, p, top_k=k_, top_p=p_), inputs)
            whole = time_in_graph(lambda t, d, tt, s, p, q, k_=fk, p_=fp, c_=whole_cfg: rejection_sample_triton(
                t, d, tt, s, p, top_k=k_, top_p=p_, config=c_), inputs)
            alone = time_in_graph(lambda t, d, tt, s, p, q, k_=fk, p_=fp, c_=cfg: filter_stage(
                t, d, tt, s, p, None, k_, p_, None, c_, False, RACE_CHUNK), inputs)
            ref = time_in_graph(lambda t, d, tt, s, p, q, k_=fk, p_=fp: torch_rejection_baseline(
                apply_thresholds(t, thresholds_reference(t, tt, k_, p_, None)), d, tt, s, p), inputs)
            rows.append(dict(kernel=f"rejection_onehot_{name}", B=b, K=k, V=v, dtype="bf16", ours_us=ours,
                             torch_us=ref, floor_us=b * (k + 1) * v * 2 / (bw_gbs * 1e3), unfiltered_us=plain,
                             whole_rows_us=whole, thresholds_us=alone))
    return rows


def _one_flat(sets):
    """The input sets with every request's logits but the first's scaled 6x."""
    out = []
    for target, *rest in sets:
        peaked = target * 6
        peaked[0] = target[0]
        out.append((peaked, *rest))
    return out


def run(out_json=None, Bs=(1, 8, 64, 256), Ks=(1, 3, 5), Vs=(32000, 128256, 151936),
        attention_contexts=(4096, 32768)) -> list[dict]:
    if not torch.cuda.is_available():
        raise RuntimeError("the kernel benchmarks need CUDA")
    bw = memory_bandwidth_gbs()
    rows = _argmax_rows(bw, Bs, Vs) + _rejection_rows(bw, Bs, Ks, Vs) + _filter_rows(bw)
    return _report(rows, bw, out_json, attention_bench.run(contexts=attention_contexts))


def run_filters(out_json=None, Bs=(1, 64, 256)) -> list[dict]:
    """Only the filtered sampler's rows (and the unfiltered call beside each)."""
    bw = memory_bandwidth_gbs()
    return _report(_filter_rows(bw, Bs), bw, out_json)


def _report(rows, bw, out_json, extra=()) -> list[dict]:
    """rows (with their ratio to the byte floor) and extra, printed and written to out_json."""
    for row in rows:
        row["ours/floor"] = row["ours_us"] / row["floor_us"] if row["floor_us"] else None
        row["bandwidth_gbs"] = bw
    rows = rows + list(extra)
    print_table(rows)
    if out_json is not None:
        with open(out_json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


def print_table(rows) -> None:
    cols = ["kernel", "B", "K", "V", "dtype", "ours_us", "torch_us", "floor_us", "ours/floor", "unfiltered_us",
            "whole_rows_us", "thresholds_us"]
    print(" ".join(f"{c:>18}" if i == 0 else f"{c:>10}" for i, c in enumerate(cols)))
    for row in rows:
        cells = []
        for i, c in enumerate(cols):
            val = row.get(c)
            text = f"{val:.2f}" if isinstance(val, float) else ("-" if val is None else str(val))
            cells.append(f"{text:>18}" if i == 0 else f"{text:>10}")
        print(" ".join(cells))


def main() -> None:
    """python -m graphrt.kernels.bench [--filters] [out.json]"""
    args = sys.argv[1:]
    fn = run_filters if args[:1] == ["--filters"] else run
    args = args[1:] if fn is run_filters else args
    fn(out_json=args[0] if args else None)


if __name__ == "__main__":
    main()
