"""Teacher-forced acceptance of an EAGLE-3 head: what graphrt should measure, predicted offline.

`chain_predictions` unrolls the head over a sequence the target generated greedily; row i of step k
is the draft graphrt would propose for position i + k + 2 after accepting everything up to i + k + 1.
`walk` replays graphrt's greedy cycles over those predictions: a cycle that starts with n verified
tokens proposes the chain of row n - 2, accepts while the drafts equal the target's tokens and emits
one more. Its tokens per cycle are graphrt's `mean_acceptance_length` for the same request, exactly,
when the numerics agree; `chain_counts` gives the per-step accuracies the EAGLE papers report.
"""

from __future__ import annotations

import torch


@torch.no_grad()
def chain_predictions(head, aux: torch.Tensor, ids: torch.Tensor, steps: int) -> torch.Tensor:
    """aux [B, T, 3H], ids [B, T] -> [B, steps, T] target ids; [b, k, i] predicts position i + k + 2."""
    preds = [head.draft_to_target(logits.argmax(-1)) for _, logits in head.unroll(aux, ids, steps)]
    return torch.stack(preds, dim=1)


def walk(preds: torch.Tensor, tokens: list[int], prompt_len: int, K: int) -> tuple[int, int]:
    """preds [steps >= K, T] for one sequence; tokens: prompt + generated (the first generated one
    comes from prefill). Returns (decoded tokens after the first, cycles), as graphrt counts them."""
    total, n, decoded, cycles = len(tokens), prompt_len + 1, 0, 0
    p = preds[:K].tolist()
    while n < total:
        a = 0
        while a < K and n + a < total and p[a][n - 2] == tokens[n + a]:
            a += 1
        emitted = min(a + 1, total - n)
        decoded, cycles, n = decoded + emitted, cycles + 1, n + emitted
    return decoded, cycles


def chain_counts(preds: torch.Tensor, ids: torch.Tensor, prompt_lens, lengths, K: int) -> list[list[int]]:
    """For each step k < K: [rows whose steps < k were right, rows whose steps <= k were right], over
    every start row of the generated parts (rows whose whole K-chain lies inside the sequence). Their
    ratios are the per-step chain accuracies; counts add up across batches."""
    B, _, T = preds.shape
    i = torch.arange(T, device=ids.device)
    start = torch.as_tensor(prompt_lens, device=ids.device)[:, None] - 1
    end = torch.as_tensor(lengths, device=ids.device)[:, None] - K - 2
    alive = (i[None, :] >= start) & (i[None, :] <= end)
    out = []
    for k in range(K):
        target = torch.cat([ids[:, k + 2:], ids.new_full((B, k + 2), -1)], dim=1)  # position i + k + 2
        before = int(alive.sum())
        alive = alive & (preds[:, k] == target)
        out.append([before, int(alive.sum())])
    return out


def length_from_accuracy(acc: list[float]) -> float:
    """1 + p1 + p1 p2 + ...: the expected tokens per cycle if every cycle started at a random row."""
    total, run = 1.0, 1.0
    for a in acc:
        run *= a
        total += run
    return total
