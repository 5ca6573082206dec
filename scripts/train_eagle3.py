"""Distill an EAGLE-3 head from a target's own generations, save it in the published layout, and
measure it: the trainer's teacher-forced acceptance estimate beside graphrt's measured acceptance.

    python scripts/train_eagle3.py --target smollm2 --out data/smollm2-eagle3 --seed 0

Stages (each prints its time): the target (graphrt, plain decoding) continues every training prompt
greedily and at each --temperatures; the draft vocabulary is the --draft-vocab most frequent tokens of
those continuations; the teacher (transformers, built from the same weights) gives the aux streams;
the head trains with the training-time test (graphrt/train); then on the held-out prompts the
script reports its teacher-forced estimate and graphrt's own acceptance at K = 3 and 5, greedy and
at temperature 0.7, and records everything in OUT/training.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from graphrt.checkpoint import load_checkpoint
from graphrt.named_models import model_path
from graphrt.params import SamplingParams
from graphrt.runtime import Runtime
from graphrt.tokenizer import encode, load_tokenizer
from graphrt.train import acceptance, data, loop, teacher
from graphrt.train.head import Eagle3Trainable

ROOT = Path(__file__).resolve().parent.parent


def _log(msg: str) -> None:
    print(msg, flush=True)


def resolve_target(name: str) -> str:
    return name if os.path.exists(name) else str(model_path(name))


def _aux_ids(cfg):
    from graphrt.config import default_eagle3_aux_layer_ids

    return default_eagle3_aux_layer_ids(cfg.num_hidden_layers)


def _runtime(ckpt, draft=None, *, K=3, batch, seq, device):
    return Runtime(ckpt, draft, num_draft_tokens=K, device=device, max_batch_size=batch, max_seq_len=seq)


def _acceptance(gens) -> float:
    decoded = sum(len(g.token_ids) - 1 for g in gens)
    return decoded / max(1, sum(g.num_cycles for g in gens))


def estimate(head, teach, seqs, aux_ids, Ks, device) -> dict:
    """Teacher-forced walk and per-step chain accuracy over sequences the target wrote greedily."""
    out = {f"K{K}": {"decoded": 0, "cycles": 0, "counts": [[0, 0] for _ in range(K)]} for K in Ks}
    per_seq = {}
    for idx in data.batches(seqs, 8192):
        ids, lengths, plens = data.pad(seqs, idx, device)
        aux, _ = teacher.features(teach, ids, lengths, aux_ids)
        preds = acceptance.chain_predictions(head, aux.to(head.fc.weight.dtype), ids, max(Ks))
        for K in Ks:
            o = out[f"K{K}"]
            for c, n in zip(o["counts"], acceptance.chain_counts(preds, ids, plens, lengths, K)):
                c[0], c[1] = c[0] + n[0], c[1] + n[1]
            for r, i in enumerate(idx):
                dec, cyc = acceptance.walk(preds[r], seqs[i].tokens, seqs[i].prompt_len, K)
                o["decoded"], o["cycles"] = o["decoded"] + dec, o["cycles"] + cyc
                per_seq.setdefault(i, {})[f"K{K}"] = dec / max(cyc, 1)
    for K in Ks:
        o = out[f"K{K}"]
        o["acceptance_length"] = o["decoded"] / max(1, o["cycles"])
        o["chain_accuracy"] = [after / max(1, before) for before, after in o.pop("counts")]
        o["length_from_chain_accuracy"] = acceptance.length_from_accuracy(o["chain_accuracy"])
    out["per_sequence"] = [per_seq[i] for i in sorted(per_seq)]
    return out


def measure(target_ckpt, head_dir, prompts, *, Ks, temperatures, max_new, device, dtype, seed) -> dict:
    """graphrt's own acceptance with the saved head (loaded as any user would load it)."""
    draft = load_checkpoint(head_dir, dtype=dtype, device=device)
    seq = max(len(p) for p in prompts) + max_new + 1
    res = {}
    for K in Ks:
        rt = _runtime(target_ckpt, draft, K=K, batch=min(64, len(prompts)), seq=seq, device=device)
        for T in temperatures:
            params = [SamplingParams(max_new_tokens=max_new, temperature=T, seed=seed + i) for i in range(len(prompts))]
            t0 = time.perf_counter()
            gens = rt.generate(prompts, params)
            res[f"K{K}_T{T:g}"] = {"acceptance_length": _acceptance(gens),
                                   "acceptance_rate": sum(g.num_accepted_tokens for g in gens)
                                   / max(1, sum(g.num_draft_tokens for g in gens)),
                                   "per_sequence": [g.mean_acceptance_length for g in gens],
                                   "token_ids": [g.token_ids for g in gens] if T == 0 else None,
                                   "seconds": time.perf_counter() - t0}
        del rt
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2", help="target checkpoint (folder, .gguf) or a named model")
    ap.add_argument("--out", required=True, help="folder for the head (published EAGLE-3 layout) and training.json")
    ap.add_argument("--prompts", default=str(ROOT / "data/prompts/train.jsonl"))
    ap.add_argument("--heldout", default=str(ROOT / "data/prompts/heldout.jsonl"))
    ap.add_argument("--num-prompts", type=int, help="use only the first N training prompts")
    ap.add_argument("--num-heldout", type=int, default=128)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--temperatures", default="0.7,1.0", help="sampled continuations per prompt, besides greedy")
    ap.add_argument("--draft-vocab", type=int, default=16384)
    ap.add_argument("--ttt-steps", type=int, default=5)
    ap.add_argument("--epochs", type=int, help="default: as many as fit --minutes")
    ap.add_argument("--minutes", type=float, default=3.0, help="training time budget when --epochs is not given")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--token-budget", type=int, default=16384, help="padded tokens per training batch")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--ci-new-tokens", type=int, default=48, help="greedy tokens of the two recorded CI prompts")
    ap.add_argument("--save-sequences", help="also write the generated sequences here (.jsonl.gz), for --sequences")
    ap.add_argument("--sequences", help="train on the sequences a --save-sequences run wrote instead of generating "
                                        "them (the prompts' order and the held-out set come from that run)")
    ap.add_argument("--only-generate", action="store_true",
                    help="stop once --save-sequences has written them (a device call of its own)")
    args = ap.parse_args(argv)
    if args.only_generate and not args.save_sequences:
        ap.error("--only-generate needs --save-sequences")
    device = torch.device(args.device)
    on_cuda = device.type == "cuda"
    run_dtype = torch.bfloat16 if on_cuda else torch.float32
    torch.manual_seed(args.seed)
    record = {"command": "python " + " ".join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])]),
              "seed": args.seed, "device": torch.cuda.get_device_name(device) if on_cuda else "cpu",
              "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "timings_s": {}}
    t_all = time.perf_counter()

    def stage(name, t0):
        record["timings_s"][name] = round(time.perf_counter() - t0, 1)
        _log(f"[{name}] {record['timings_s'][name]} s")

    # -- the target and its generations ---------------------------------------------------------------
    t0 = time.perf_counter()
    target_path = resolve_target(args.target)
    ckpt = load_checkpoint(target_path, dtype=run_dtype, device=device)
    cfg = ckpt.config
    tok = load_tokenizer(target_path)
    train_prompts = data.load_prompts(args.prompts)[: args.num_prompts]
    held_prompts = data.load_prompts(args.heldout)[: args.num_heldout]
    enc = lambda ps: [encode(tok, p["text"], chat=True) for p in ps]  # noqa: E731
    train_ids, held_ids = enc(train_prompts), enc(held_prompts)
    if args.sequences:  # generated by an earlier run: its temperatures and held-out continuations
        saved_seqs = data.load_sequences(args.sequences)
        seqs, held = saved_seqs["train"], saved_seqs["heldout"]
        temps = sorted({s.temperature for s in seqs})
        if [s.tokens[: s.prompt_len] for s in held] != held_ids:
            raise SystemExit(f"{args.sequences}: its held-out prompts are not --heldout's first {len(held_ids)}")
    else:
        seq_len = max(len(p) for p in train_ids + held_ids) + args.max_new_tokens + 1
        plain = _runtime(ckpt, batch=64 if on_cuda else 8, seq=seq_len, device=device)
        temps = [0.0] + [float(t) for t in args.temperatures.split(",") if t.strip()]
        seqs = []
        for i, T in enumerate(temps):
            seqs += data.generate(plain, train_ids, max_new_tokens=args.max_new_tokens, temperature=T,
                                  seed=args.seed * 1000003 + i * 100003)
        held = data.generate(plain, held_ids, max_new_tokens=args.max_new_tokens, temperature=0.0, seed=0)
    if args.save_sequences:
        data.save_sequences(args.save_sequences, {"train": seqs, "heldout": held})
    gen_tokens = sum(len(s.tokens) - s.prompt_len for s in seqs)
    record["data"] = {"train_prompts": len(train_ids), "heldout_prompts": len(held_ids), "temperatures": temps,
                      "train_sequences": len(seqs), "generated_tokens": gen_tokens,
                      "max_new_tokens": args.max_new_tokens, "sequences_from": args.sequences}
    stage("generate", t0)
    _log(f"{len(seqs)} training sequences, {gen_tokens} generated tokens")
    if args.only_generate:
        return 0

    # -- draft vocabulary, teacher features -------------------------------------------------------------
    t0 = time.perf_counter()
    draft_ids, coverage = data.draft_vocabulary(seqs, cfg.vocab_size, args.draft_vocab)
    record["draft_vocab"] = {"size": args.draft_vocab, "coverage_of_generated_tokens": coverage}
    _log("draft-vocabulary coverage of the generated tokens: "
         + ", ".join(f"{n}: {100 * c:.2f}%" for n, c in coverage.items()))
    teach = teacher.hf_model(ckpt, device=device, dtype=run_dtype)
    aux_ids = _aux_ids(cfg)
    lm_head = ckpt.weights["lm_head.weight"]
    train_data = loop.prepare(teach, seqs, aux_ids, draft_ids, lm_head, token_budget=args.token_budget,
                              device=device)
    stage("teacher", t0)

    # -- train ------------------------------------------------------------------------------------------
    t0 = time.perf_counter()
    head = Eagle3Trainable.for_target(cfg, {k: v.float() for k, v in ckpt.weights.items()
                                            if k in ("embed_tokens.weight", "lm_head.weight", "norm.weight")},
                                      draft_ids, seed=args.seed).to(device)
    draft_lm_head = lm_head[draft_ids.to(device)]
    log = loop.train(head, train_data, draft_lm_head, steps=args.ttt_steps, epochs=args.epochs,
                     max_seconds=60 * args.minutes, lr=args.lr, seed=args.seed, autocast=on_cuda, say=_log)
    record["train"] = {"steps": log.steps, "epochs": log.epochs, "batches_per_epoch": len(train_data),
                       "seconds": round(log.seconds, 1), "ttt_steps": args.ttt_steps, "lr": args.lr,
                       "token_budget": args.token_budget, "loss_curve": [round(x, 4) for x in log.loss],
                       "final_loss": log.loss[-1] if log.loss else None,
                       "final_step_accuracy": log.step_acc[-1] if log.step_acc else None}
    del train_data
    out = Path(args.out)
    head.save(out, dtype=torch.bfloat16)
    stage("train", t0)
    size = (out / "model.safetensors").stat().st_size
    record["head_bytes"] = size
    _log(f"head: {size / 2**20:.1f} MiB at {out}")

    # -- evaluate: the trainer's estimate and graphrt's measurement on held-out prompts -----------------
    t0 = time.perf_counter()
    saved = Eagle3Trainable(head.cfg, head.embed, draft_ids).to(device)  # the bf16 weights as saved
    saved.load_canonical({k: v.to(device, torch.bfloat16).float() for k, v in head.state_dict_canonical().items()})
    saved = saved.to(run_dtype)
    est = estimate(saved, teach, held, aux_ids, (3, 5), device)
    meas = measure(ckpt, out, held_ids, Ks=(3, 5), temperatures=(0.0, 0.7), max_new=args.max_new_tokens,
                   device=device, dtype=run_dtype, seed=args.seed)
    same = [m == s.tokens[s.prompt_len:] for m, s in zip(meas["K3_T0"]["token_ids"], held)]
    for m in meas.values():
        m.pop("token_ids")
    record["heldout"] = {"estimate": {k: v for k, v in est.items() if k != "per_sequence"},
                         "graphrt": {k: {kk: vv for kk, vv in v.items() if kk != "per_sequence"}
                                     for k, v in meas.items()},
                         "spec_equals_plain_greedy": f"{sum(same)}/{len(same)}"}
    for K in (3, 5):
        e, m = est[f"K{K}"]["acceptance_length"], meas[f"K{K}_T0"]["acceptance_length"]
        record["heldout"][f"K{K}_relative_difference"] = round(abs(m - e) / e, 4)
        _log(f"held-out, K = {K}, greedy: trainer estimate {e:.3f} (chain accuracy "
             f"{', '.join(f'{a:.3f}' for a in est[f'K{K}']['chain_accuracy'])}), graphrt {m:.3f}; "
             f"temperature 0.7: graphrt {meas[f'K{K}_T0.7']['acceptance_length']:.3f}")
    stage("evaluate", t0)

    # -- the two prompts CI checks ----------------------------------------------------------------------
    t0 = time.perf_counter()
    record["ci"] = ci_record(target_path, out, held_prompts[:2], tok, new_tokens=args.ci_new_tokens)
    stage("ci_prompts", t0)
    record["timings_s"]["total"] = round(time.perf_counter() - t_all, 1)
    (out / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    _log(json.dumps({k: record[k] for k in ("heldout", "ci", "timings_s")}, indent=2))
    return 0


def ci_record(target_path, head_dir, prompts, tok, *, new_tokens) -> dict:
    """The estimate for the fixed prompts CI decodes, from the saved head, where CI decodes them:
    on the CPU in fp32, K = 3, greedy."""
    device = torch.device("cpu")
    ckpt = load_checkpoint(target_path, dtype=torch.float32, device=device)
    ids = [encode(tok, p["text"], chat=True) for p in prompts]
    plain = _runtime(ckpt, batch=2, seq=max(map(len, ids)) + new_tokens + 1, device=device)
    seqs = data.generate(plain, ids, max_new_tokens=new_tokens, temperature=0.0, seed=0)
    teach = teacher.hf_model(ckpt, device=device, dtype=torch.float32)
    dckpt = load_checkpoint(head_dir, dtype=torch.float32, device=device)
    draft_ids = torch.arange(dckpt.config.draft_vocab_size, device=device) + dckpt.weights["d2t"]
    head = Eagle3Trainable(dckpt.config, ckpt.weights["embed_tokens.weight"], draft_ids).to(device)
    head.load_canonical(dckpt.weights)
    est = estimate(head, teach, seqs, _aux_ids(ckpt.config), (3,), device)
    meas = measure(ckpt, head_dir, ids, Ks=(3,), temperatures=(0.0,), max_new=new_tokens, device=device,
                   dtype=torch.float32, seed=0)
    return {"prompts": [p["text"] for p in prompts], "new_tokens": new_tokens, "K": 3, "dtype": "float32",
            "estimate_per_prompt": [r["K3"] for r in est["per_sequence"]],
            "graphrt_per_prompt": meas["K3_T0"]["per_sequence"]}


if __name__ == "__main__":
    sys.exit(main())
