"""The `graphrt` command line: generate, bench, capture, profile."""

from __future__ import annotations

import argparse
import json
import os
import sys

from graphrt.arg_types import (
    add_workload_draft_arguments,
    decode_tokens,
    dtype_arg,
    int_list,
    positive_int,
    positive_int_list,
)
from graphrt.errors import GraphrtError
from graphrt.named_models import NAMED_MODELS, draft_path, model_path


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--draft", help="draft checkpoint directory (standalone LM, EAGLE or EAGLE-3 head)")
    p.add_argument("-k", "--num-draft-tokens", type=positive_int, default=3, help="draft tokens per cycle (K)")
    p.add_argument("--draft-quantization", choices=["fp8"],
                   help="read the draft's projections as FP8 (e4m3, a power-of-two scale per row): half the bytes "
                        "of a draft step; the target stays in --dtype")
    p.add_argument("--device", help="cuda or cpu (default: cuda when available)")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], help="default: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--tp", type=positive_int, default=1, metavar="N",
                   help="tensor parallelism over N GPUs (N processes, started here unless torchrun started this one)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="graphrt", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate from a local checkpoint or a named model")
    g.add_argument("checkpoint", nargs="?",
                   help="target checkpoint: an HF folder (config.json + *.safetensors) or a .gguf file")
    g.add_argument("--model", choices=sorted(NAMED_MODELS), help="a named real model instead of a path ("
                   + "; ".join(f"{m.name}: {m.description}" for m in NAMED_MODELS.values()) + ")")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="text, tokenized with the checkpoint's tokenizer; the reply streams to stdout")
    src.add_argument("--prompt-ids", type=int_list, help="token ids, e.g. 1,2,3")
    g.add_argument("--chat", action="store_true", help="wrap --prompt in the checkpoint's chat template as a user turn")
    g.add_argument("--max-new-tokens", type=positive_int, default=32)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0: off)")
    g.add_argument("--top-p", type=float, default=1.0, help="keep the most likely tokens holding this mass (1: off)")
    g.add_argument("--min-p", type=float, default=0.0,
                   help="keep tokens at least this times as likely as the most likely one (0: off)")
    g.add_argument("--seed", type=int)
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--json", action="store_true", help="print the result as JSON")
    g.add_argument("--no-draft", action="store_true",
                   help="decode without a draft (a --model's trained draft is otherwise the default)")
    _common(g)

    b = sub.add_parser("bench", help="decode throughput, acceptance and per-phase time (default: embedded model)")
    b.add_argument("what", nargs="?", choices=["decode", "kernels"], default="decode")
    b.add_argument("--target", help="target checkpoint directory (default: an embedded random preset)")
    b.add_argument("--model", choices=sorted(NAMED_MODELS), help="a named real model as the target (smollm2)")
    b.add_argument("--preset",
                   help="embedded preset: tiny (CPU default), llama-1b-shape (CUDA default), llama-8b-shape, "
                        "llama-70b-shape, smollm2-135m-shape")
    b.add_argument("--draft-layers", type=positive_int, help="self-draft depth when no --draft is given")
    b.add_argument("--layers", type=positive_int, metavar="N",
                   help="keep the preset's first N layers (llama-70b-shape: 141 GB whole; times scale per layer)")
    b.add_argument("--batch-sizes", type=positive_int_list, help="default 1,4 on CPU; 1,2,4,8,16,32,64 on CUDA")
    b.add_argument("--prompt-len", type=positive_int, default=32)
    b.add_argument("--max-new-tokens", type=decode_tokens,
                   help="tokens generated per request (default 32 CPU / 128 CUDA)")
    b.add_argument("--no-draft", action="store_true", help="plain decoding only")
    b.add_argument("--eager", action="store_true", help="no CUDA graphs")
    b.add_argument("--damped", type=float, metavar="ALPHA",
                   help="embedded preset with late residual branches scaled by ALPHA (synthetic acceptance)")
    b.add_argument("--peers", action="store_true", help="also time Hugging Face transformers on the same checkpoint")
    b.add_argument("--json", dest="json_out", help="write the results to this JSON file")
    b.add_argument("--png", help="write a tokens/s chart (matplotlib) to this file")
    add_workload_draft_arguments(b)
    b.add_argument("--sweep-accept", action="store_true",
                   help="tokens/s and speedup over plain decoding against simulated acceptance L = 1 .. K + 1")
    b.add_argument("--sweep-k", type=positive_int_list,
                   help="--sweep-accept: the K values (default 3,5 on CUDA, 3 on CPU)")
    b.add_argument("--quick", action="store_true",
                   help="kernels: only V = 128256, K = 3 and 4k-context attention (default: the full sweep)")
    _common(b)

    c = sub.add_parser("capture", help="capture every phase x bucket as CUDA graphs and report")
    c.add_argument("checkpoint", nargs="?", help="target checkpoint (default: embedded llama-1b-shape)")
    c.add_argument("--dot", help="write each graph as a DOT file into this directory")
    c.add_argument("--json", dest="json_out", help="write the report as JSON")
    c.add_argument("--max-batch-size", type=positive_int, default=64, help="largest bucket (default buckets up to it)")
    c.add_argument("--max-seq-len", type=positive_int, default=2048)
    c.add_argument("--no-draft", action="store_true", help="capture TARGET_DECODE only")
    c.add_argument("--prefill", action="store_true",
                   help="also every prefill shape's graph (Runtime.capture(prefill=True)), as a server starts")
    c.add_argument("--no-prefix-caching", action="store_true", help="a runtime without prefix caching")
    c.add_argument("--prefill-chunk-tokens", type=positive_int, default=2048, metavar="C",
                   help="chunked prefill's chunk (Runtime(prefill_chunk_tokens=C), default 2048)")
    _common(c)

    pr = sub.add_parser("profile", help="per-phase GPU kernel time (PyTorch profiler or Nsight Systems)")
    from graphrt.profiling.report import add_profile_arguments

    add_profile_arguments(pr)
    _common(pr)
    return parser


def _target(path: str | None, model: str | None, what: str = "a checkpoint") -> str | None:
    """The target path: `path` or --model's file."""
    if model is None:
        return path
    if path is not None:
        raise GraphrtError(f"give {what} or --model, not both ({path!r}, --model {model})")
    return str(model_path(model))


def _draft(args) -> str | None:
    """--draft, else the --model's trained draft unless --no-draft or another draft option says
    otherwise (bench: --draft-layers, --draft-kind)."""
    if args.draft is not None and args.no_draft:
        raise GraphrtError("give --draft or --no-draft, not both")
    if args.draft is not None or args.no_draft or args.model is None:
        return args.draft
    if getattr(args, "draft_layers", None) or getattr(args, "draft_kind", None):
        return None
    found = draft_path(args.model)
    return str(found) if found is not None else None


def cmd_generate(args) -> int:
    from graphrt import Runtime, SamplingParams
    from graphrt.tokenizer import TextStream, decode, encode, load_tokenizer

    target = _target(args.checkpoint, args.model)
    draft = _draft(args)
    if target is None:
        raise GraphrtError("name a checkpoint (a folder or .gguf file) or a model (--model smollm2)")
    if not os.path.exists(target):
        raise GraphrtError(f"no checkpoint at {target}: give an HF folder (config.json + *.safetensors) or a .gguf "
                           "file, or a model (--model smollm2)")
    tokenizer = None
    if args.prompt is not None:
        tokenizer = load_tokenizer(target)
        prompt = encode(tokenizer, args.prompt, chat=args.chat)
    elif args.chat:
        raise GraphrtError("--chat applies the chat template to --prompt text, not to --prompt-ids")
    else:
        prompt = args.prompt_ids
    rt = Runtime.from_pretrained(target, draft, num_draft_tokens=args.num_draft_tokens,
                                 draft_quantization=args.draft_quantization,
                                 device=args.device, dtype=dtype_arg(args.dtype), max_batch_size=1,
                                 max_seq_len=len(prompt) + args.max_new_tokens + 1, tensor_parallel_size=args.tp)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed,
                            top_k=args.top_k, top_p=args.top_p, min_p=args.min_p, ignore_eos=args.ignore_eos)
    stream = TextStream(tokenizer) if tokenizer is not None and not args.json else None
    rid = rt.add_request(prompt, params)
    while True:
        if stream is not None:
            sys.stdout.write(stream.update(rt.get_generation(rid).token_ids))
            sys.stdout.flush()
        if rt.finished(rid):
            break
        rt.step()
    gen = rt.pop_generation(rid)
    if stream is not None:
        print(stream.update(gen.token_ids, final=True))
    elif args.json:
        print(json.dumps({"token_ids": gen.token_ids, "text": decode(tokenizer, gen) if tokenizer else None,
                          "finish_reason": gen.finish_reason, "num_cycles": gen.num_cycles,
                          "mean_acceptance_length": gen.mean_acceptance_length,
                          "acceptance_rate": gen.acceptance_rate}))
    else:
        print(" ".join(map(str, gen.token_ids)))
    if draft and not args.json:
        print(f"[{gen.num_cycles} cycles, mean acceptance length {gen.mean_acceptance_length:.2f}, acceptance rate "
              f"{gen.acceptance_rate:.2f} ({gen.num_accepted_tokens}/{gen.num_draft_tokens} drafts accepted)]",
              file=sys.stderr)
    return 0


def cmd_bench(args) -> int:
    if args.what == "kernels":
        from graphrt.kernels import bench as kbench

        kw = dict(Ks=(3,), Vs=(128256,), attention_contexts=(4096,)) if args.quick else {}
        if args.batch_sizes:
            kw["Bs"] = tuple(args.batch_sizes)
        kbench.run(out_json=args.json_out, **kw)
        return 0
    from graphrt import bench

    args.target = _target(args.target, args.model, "--target")
    args.draft = _draft(args)
    bench.main(args)
    return 0


def cmd_capture(args) -> int:
    from graphrt.capture.cli import cli_main

    return cli_main(args)


def cmd_profile(args) -> int:
    from graphrt.profiling.report import cli_main

    return cli_main(args)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.tp > 1 and "WORLD_SIZE" not in os.environ:  # each rank runs this same command line
        from graphrt.parallel.launch import run_ranks

        return run_ranks(args.tp, main, sys.argv[1:] if argv is None else list(argv))
    handler = {"generate": cmd_generate, "bench": cmd_bench, "capture": cmd_capture, "profile": cmd_profile}
    try:
        return handler[args.command](args)
    except GraphrtError as exc:
        print(f"graphrt {args.command}: error: {exc}", file=sys.stderr)
        return 2
