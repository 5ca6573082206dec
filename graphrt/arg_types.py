"""Argument types shared by the CLI's parsers (graphrt/cli.py and the profile report's)."""

from __future__ import annotations

import argparse


def int_list(text: str) -> list[int]:
    """'1,8,64' or '1 8 64' -> [1, 8, 64]."""
    try:
        return [int(x) for x in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def positive_int(text: str) -> int:
    """'8' -> 8; zero, negatives and non-integers are an argparse error naming the value."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def decode_tokens(text: str) -> int:
    """A benchmark's tokens per request: at least 2, since the first comes from prefill and the
    timings cover the decode cycles after it."""
    value = positive_int(text)
    if value < 2:
        raise argparse.ArgumentTypeError(f"expected at least 2 (the first token of a request comes from prefill; "
                                         f"the timings cover decoding), got {value}")
    return value


def positive_int_list(text: str) -> list[int]:
    """int_list whose every entry is >= 1 (batch sizes, K values)."""
    values = int_list(text)
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return values


def dtype_arg(name: str | None):
    """--dtype's name as a torch.dtype; None for None."""
    import torch

    return None if name is None else {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


def device_and_dtype(args):
    """--device and --dtype as torch objects: CUDA when there is one; bf16 on CUDA, fp32 elsewhere."""
    import torch

    device = torch.device(getattr(args, "device", None) or ("cuda" if torch.cuda.is_available() else "cpu"))
    default = torch.bfloat16 if device.type == "cuda" else torch.float32
    return device, dtype_arg(getattr(args, "dtype", None)) or default


def draft_kind(args, device) -> str:
    """--draft-kind, or its default on `device`: eagle3 on CUDA, lm on the CPU."""
    return args.draft_kind or ("eagle3" if device.type == "cuda" else "lm")


def add_workload_draft_arguments(p: argparse.ArgumentParser) -> None:
    """--draft-kind and --accept-len, as `graphrt bench` and `graphrt profile` take them."""
    p.add_argument("--draft-kind", choices=["lm", "eagle", "eagle3"],
                   help="embedded draft when no --draft is given: lm, a self-draft as a standalone LM (CPU "
                        "default); eagle, an EAGLE-1/2 head; eagle3, a random EAGLE-3 head (CUDA default)")
    p.add_argument("--accept-len", type=float, metavar="L",
                   help="simulated acceptance: each verify step accepts a drawn number of drafts, mean L tokens per "
                        "cycle (1 <= L <= K + 1); measures cost at a known acceptance")
