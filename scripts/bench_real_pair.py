"""The real pair: SmolLM2-135M-Instruct with its trained EAGLE-3 head, on real prompts.

    python scripts/bench_real_pair.py [--target smollm2] [--draft data/smollm2-eagle3] [--json F]

Held-out chat prompts (data/prompts/heldout.jsonl, chat template), each request stopping at the
model's EOS. Per batch size (1, 8, 64): graphrt plain decoding and speculative decoding with the
head (K = 3 and 5, greedy; K = 3 at temperature 0.7), all under CUDA graphs, with tokens/s, mean
acceptance length and per-phase GPU time (per launch at the batch's bucket); the first B prompts
start together, so B = 1 is one prompt. Then the same as a serving engine runs it (--served N: N x
max(B, 8) requests through B slots, a new one joining as one finishes; plain and the first K,
greedy): a batch that starts together ends with its slowest request, and under speculation that is
the one whose drafts were accepted least, so the first table undersells a served batch, and at B = 1
the served rows cover 8N prompts one after another; they count the steady state's tokens over its
decode phases' GPU time (graphrt.bench.run_served; wall clock, prefill included, beside it). Every
graph, the prefill graphs of every shape included, is captured before the first run, as a server
does at start; the prefill rows give what admitting B requests at once costs
(graphrt.bench.run_prefill). Then Hugging Face transformers on the same GGUF and the same prompts:
dynamic cache, static cache (B = 1) and assisted generation (B = 1) with a self-draft (the target's
first 4 layers: transformers has no EAGLE-3 drafting) -- its figures time whole `generate` calls,
warm-up call first, prompt pass included.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from graphrt.bench import run_decode, run_meta, run_prefill, run_served
from graphrt.checkpoint import load_checkpoint
from graphrt.runtime import Runtime
from graphrt.tokenizer import encode, load_tokenizer
from graphrt.train.data import load_prompts

ROOT = Path(__file__).resolve().parent.parent
PHASES = ("TARGET_VERIFY", "DRAFT_EXTEND", "DRAFT_DECODE", "TARGET_DECODE")


def resolve(name: str) -> str:
    if Path(name).exists():
        return name
    from graphrt.named_models import model_path

    return str(model_path(name))


def _dtype(device):
    return torch.bfloat16 if device.type == "cuda" else torch.float32  # the CPU: a smoke run, fp32


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def graphrt_rows(target, draft, prompts, batch_sizes, max_new, Ks, fp8=False, served=0, device=None,
                 prefix_caching=False) -> list[dict]:
    device = device or torch.device("cuda")
    tckpt = load_checkpoint(target, dtype=_dtype(device), device=device)
    dckpt = load_checkpoint(draft, dtype=_dtype(device), device=device)
    # every row without prefix caching (on by default in Runtime) but the one named for it: the runs
    # repeat their prompts, which it would find cached
    kw = dict(device=device, max_batch_size=max(batch_sizes), max_seq_len=max(map(len, prompts)) + max_new + 8,
              prefix_caching=False)
    runs = [("graphrt plain", Runtime(tckpt, None, **kw), 0.0)]
    for K in Ks:
        spec = Runtime(tckpt, dckpt, num_draft_tokens=K, **kw)
        runs.append((f"graphrt EAGLE-3 K={K}", spec, 0.0))
        if K == Ks[0]:
            runs.append((f"graphrt EAGLE-3 K={K} T=0.7", spec, 0.7))
            if fp8:  # the same head read as FP8 (kernels/fp8_weight.py)
                runs.append((f"graphrt EAGLE-3 FP8 K={K}", Runtime(tckpt, dckpt, num_draft_tokens=K,
                                                                   draft_quantization="fp8", **kw), 0.0))
    serve = runs[:2 if served else 0]  # plain and the first K, greedy
    if served and prefix_caching:  # the first K again, reading the prompts' shared blocks (the chat template's)
        serve.append((f"graphrt EAGLE-3 K={Ks[0]} + prefix caching",
                      Runtime(tckpt, dckpt, num_draft_tokens=Ks[0], **{**kw, "prefix_caching": True}), 0.0))
    if device.type == "cuda":  # every graph up front, prefill shapes too, as a server starts: no capture mid-run
        for rt in {id(rt): rt for _, rt, _ in runs + serve}.values():
            rt.capture(inspect_kernels=False, prefill=True)
    rows = []
    for name, rt, temp in runs:
        for b in batch_sizes:
            run_decode(rt, b, prompt_len=0, max_new_tokens=min(8, max_new), prompts=prompts,
                       temperature=temp)  # warm-up
            r = run_decode(rt, b, prompt_len=0, max_new_tokens=max_new, prompts=prompts, temperature=temp)
            rows.append({"mode": name, "batch_size": b, "tokens_per_s": r["tokens_per_s"], "tokens": r["tokens"],
                         "mean_acceptance_length": r["mean_acceptance_length"],
                         "phases_us": {p: r["full_bucket_us"][p] for p in PHASES if p in r["full_bucket_us"]}})
            print(_fmt(rows[-1]), flush=True)
    for name, rt, _ in runs[:2]:  # what admitting b requests at once costs (the first table leaves it out)
        for b in batch_sizes:
            r = run_prefill(rt, prompts, b, repeats=5 if device.type == "cuda" else 1)
            rows.append({"mode": f"{name}, prefill", "batch_size": b, **r})
            print(f"{name + ', prefill':<52} B={b:<3} {r['wall_ms']:8.2f} ms wall, {r['gpu_ms']:8.2f} ms GPU "
                  f"({r['prompt_tokens']:.0f} prompt tokens)", flush=True)
    for name, rt, temp in serve:
        for b in batch_sizes:  # at least 8 slots' worth of requests: B = 1 then covers many prompts, not one
            cached = rt.stats().cached_prompt_tokens
            r = run_served(rt, b, prompts, num_requests=served * max(b, 8), max_new_tokens=max_new,
                           temperature=temp)
            r["cached_prompt_tokens"] = rt.stats().cached_prompt_tokens - cached
            rows.append({"mode": f"{name}, served", "batch_size": b, "tokens_per_s": r["tokens_per_s"],
                         "tokens_per_s_wall": r["tokens_per_s_wall"], "requests": r["requests"], "tokens": r["tokens"],
                         "mean_acceptance_length": r["mean_acceptance_length"],
                         "steady_mean_batch": r["steady"]["mean_batch"],
                         "steady_gpu_us_per_cycle": r["steady"]["gpu_us_per_cycle"],
                         **{k: r[k] for k in ("wall_s", "prefills", "prefill_gpu_s", "decode_gpu_s", "ttft_ms",
                                              "tpot_ms_mean", "cached_prompt_tokens")}})
            print(_fmt(rows[-1]), flush=True)
    return rows


def hf_rows(target, prompts, batch_sizes, max_new, draft_layers=4, device=None) -> list[dict]:
    import copy

    from transformers.utils import logging as hf_logging

    from graphrt.peers import as_assistant, hf_from_pretrained, pad_with_eos

    hf_logging.set_verbosity_error()
    device = device or torch.device("cuda")
    model = hf_from_pretrained(target, dtype=_dtype(device)).to(device).eval()
    pad = pad_with_eos(model)
    rows = []

    def timed(b, **kw):
        batch = prompts[:b]
        width = max(map(len, batch))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch], device=device)  # left-padded
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)
        gen = dict(attention_mask=mask, max_new_tokens=max_new, do_sample=False, **kw)
        model.generate(ids, **gen)  # warm-up: compilation, caches
        _sync(device)
        t0 = time.perf_counter()
        out = model.generate(ids, **gen)
        _sync(device)
        dt = time.perf_counter() - t0
        new = out[:, width:].tolist()
        tokens = sum((row.index(pad) + 1 if pad in row else len(row)) for row in new)
        return tokens / dt

    with torch.inference_mode():
        for b in batch_sizes:
            rows.append({"mode": "transformers dynamic cache", "batch_size": b, "tokens_per_s": timed(b)})
            print(_fmt(rows[-1]), flush=True)
        rows.append({"mode": "transformers static cache", "batch_size": 1,
                     "tokens_per_s": timed(1, cache_implementation="static")})
        print(_fmt(rows[-1]), flush=True)
        draft = copy.deepcopy(model)
        draft.model.layers = draft.model.layers[:draft_layers]
        draft.config.num_hidden_layers = draft_layers
        as_assistant(draft, 3)
        calls = [0]
        hook = model.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
        tps = timed(1, assistant_model=draft)
        hook.remove()
        rows.append({"mode": f"transformers assisted, self-draft of {draft_layers} layers, K=3", "batch_size": 1,
                     "tokens_per_s": tps, "target_forwards_two_calls": calls[0]})
        print(_fmt(rows[-1]), flush=True)
    return rows


def _fmt(r: dict) -> str:
    acc = r.get("mean_acceptance_length")
    phases = " ".join(f"{p}={v:.1f}us" for p, v in r.get("phases_us", {}).items())
    return (f"{r['mode']:<52} B={r['batch_size']:<3} {r['tokens_per_s']:>10.1f} tok/s"
            + (f"  accept {acc:.2f}" if acc is not None else "") + (f"  {phases}" if phases else "")
            + (f"  (wall, prefill included: {r['tokens_per_s_wall']:.1f} tok/s; steady batch "
               f"{r['steady_mean_batch']:.1f}; {r['wall_s']:.2f} s = decode GPU {r['decode_gpu_s']:.2f} + "
               f"{r['prefills']} prefills' GPU {r['prefill_gpu_s']:.2f} + host; time to first token "
               f"p50 {r['ttft_ms']['p50']:.1f} / p99 {r['ttft_ms']['p99']:.1f} ms, then {r['tpot_ms_mean']:.2f} ms "
               f"a token)" if "tokens_per_s_wall" in r else ""))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--draft", default=str(ROOT / "data" / "smollm2-eagle3"))
    ap.add_argument("--prompts", default=str(ROOT / "data" / "prompts" / "heldout.jsonl"))
    ap.add_argument("--batch-sizes", default="1,8,64")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--ks", default="3,5")
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--fp8", action="store_true", help="also the head read as FP8 (--draft-quantization fp8), first K")
    ap.add_argument("--served", type=int, default=4, metavar="N",
                    help="also N x max(B, 8) requests through B slots at each B, a new one joining as one "
                         "finishes (graphrt.bench.run_served), plain and the first K; 0: off")
    ap.add_argument("--prefix-caching", action="store_true",
                    help="also serve the first K with Runtime(prefix_caching=True) (the prompts share the chat "
                         "template's first tokens)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="cpu: a smoke run in fp32 (eager), for tests; its timings mean nothing")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    target = resolve(args.target)
    tok = load_tokenizer(target)
    prompts = [encode(tok, p["text"], chat=True) for p in load_prompts(args.prompts)]
    bs = [int(b) for b in args.batch_sizes.split(",")]
    rows = graphrt_rows(target, args.draft, prompts, bs, args.max_new_tokens, [int(k) for k in args.ks.split(",")],
                        args.fp8, args.served, torch.device(args.device), args.prefix_caching)
    prefill = [r for r in rows if r["mode"].endswith(", prefill")]
    rows = [r for r in rows if not r["mode"].endswith(", prefill")]
    plain = {(r["batch_size"], r["mode"].endswith(", served")): r["tokens_per_s"]
             for r in rows if r["mode"].startswith("graphrt plain")}
    if not args.no_hf:
        rows += hf_rows(target, prompts, bs, args.max_new_tokens, device=torch.device(args.device))
    print("speedup over graphrt plain decoding, same prompts, same run:")
    for r in rows:
        r["vs_graphrt_plain"] = r["tokens_per_s"] / plain[r["batch_size"], r["mode"].endswith(", served")]
        print(f"  {r['mode']:<52} B={r['batch_size']:<3} {r['vs_graphrt_plain']:.2f}x")
    if args.json:
        meta = run_meta(torch.device(args.device), target=target, draft=args.draft, prompts=args.prompts,
                        max_new_tokens=args.max_new_tokens)
        Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows, "prefill": prefill}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
