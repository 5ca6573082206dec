"""Training data for a draft head: the target's own generations, the draft vocabulary, batches.

EAGLE-3 trains on what the target itself writes (its greedy and sampled continuations of a prompt
set), so the head learns the target's distribution, not a data set's.
"""

from __future__ import annotations

import gzip
import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass
class Sequence:
    tokens: list[int]  # prompt + generated
    prompt_len: int
    temperature: float


def load_prompts(path: str | Path) -> list[dict]:
    """JSON lines with at least {"text": ...} (and "category")."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def generate(rt, prompts: list[list[int]], *, max_new_tokens: int, temperature: float, seed: int) -> list[Sequence]:
    """The target's continuations through graphrt itself (plain decoding), stopping at EOS."""
    from graphrt.params import SamplingParams

    params = [SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed + i)
              for i in range(len(prompts))]
    gens = rt.generate(prompts, params)
    return [Sequence(list(p) + list(g.token_ids), len(p), temperature) for p, g in zip(prompts, gens)]


def save_sequences(path: str | Path, groups: dict[str, list[Sequence]]) -> None:
    """Write named groups of sequences (e.g. "train", "heldout") as gzipped JSON lines, so that a
    later run trains on the same generations without generating them again."""
    with gzip.open(path, "wt") as f:
        for name, seqs in groups.items():
            for s in seqs:
                f.write(json.dumps({"group": name, "tokens": s.tokens, "prompt_len": s.prompt_len,
                                    "temperature": s.temperature}) + "\n")


def load_sequences(path: str | Path) -> dict[str, list[Sequence]]:
    """save_sequences' groups, each in the order written."""
    groups: dict[str, list[Sequence]] = {}
    with gzip.open(path, "rt") as f:
        for line in f:
            if line.strip():
                r = json.loads(line)
                groups.setdefault(r["group"], []).append(Sequence(r["tokens"], r["prompt_len"], r["temperature"]))
    return groups


def draft_vocabulary(seqs: list[Sequence], vocab_size: int, size: int) -> tuple[torch.Tensor, dict]:
    """The `size` target ids most frequent in the generated parts (ties by id), sorted, and how much
    of the generated text they cover at a few sizes (what a smaller draft vocabulary would cost:
    a token outside it can never be drafted)."""
    counts = Counter(t for s in seqs for t in s.tokens[s.prompt_len:])
    ranked = sorted(range(vocab_size), key=lambda t: (-counts.get(t, 0), t))
    total = sum(counts.values()) or 1
    coverage = {}
    for n in sorted({1024, 4096, 8192, 16384, 32000, size} - {0}):
        if n <= vocab_size:
            coverage[n] = sum(counts.get(t, 0) for t in ranked[:n]) / total
    return torch.tensor(sorted(ranked[:size]), dtype=torch.int64), coverage


def batches(seqs: list[Sequence], token_budget: int, *, generator: torch.Generator | None = None):
    """Index lists of sequences of similar length whose padded size stays under token_budget, in a
    random order (a fixed one without a generator)."""
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i].tokens))
    out, cur, longest = [], [], 0
    for i in order:
        n = len(seqs[i].tokens)
        if cur and max(longest, n) * (len(cur) + 1) > token_budget:
            out.append(cur)
            cur, longest = [], 0
        cur.append(i)
        longest = max(longest, n)
    if cur:
        out.append(cur)
    if generator is not None:
        out = [out[j] for j in torch.randperm(len(out), generator=generator).tolist()]
    return out


def pad(seqs: list[Sequence], idx: list[int], device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids [B, T] right-padded with 0, lengths [B], prompt_lens [B])."""
    T = max(len(seqs[i].tokens) for i in idx)
    ids = torch.zeros(len(idx), T, dtype=torch.int64)
    for r, i in enumerate(idx):
        ids[r, : len(seqs[i].tokens)] = torch.tensor(seqs[i].tokens)
    lengths = torch.tensor([len(seqs[i].tokens) for i in idx])
    plens = torch.tensor([seqs[i].prompt_len for i in idx])
    return ids.to(device), lengths.to(device), plens.to(device)
