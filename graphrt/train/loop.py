"""The EAGLE-3 distillation loss and training loop.

Row i of TTT step k is trained on the target's next-token distribution at position j = i + k + 1
(soft labels over the draft vocabulary, forward KL up to a constant), where position j predicts a
generated token (prompt tokens are context only) and the target's own argmax at j lies in the draft
vocabulary (a token outside it cannot be drafted; EAGLE-3 masks those rows too). Steps are weighted
0.8^k as in SafeAILab/EAGLE's traineagle3.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from graphrt.train.data import Sequence, batches, pad
from graphrt.train.teacher import features


@dataclass
class Batch:
    ids: torch.Tensor  # [B, T]
    lengths: torch.Tensor  # [B]
    prompt_lens: torch.Tensor  # [B]
    aux: torch.Tensor  # [B, T, 3H] teacher aux streams
    final: torch.Tensor  # [B, T, H] teacher final-norm hidden
    usable: torch.Tensor  # [B, T] bool: position j's distribution is a training label


@dataclass
class TrainLog:
    steps: int = 0
    epochs: int = 0
    seconds: float = 0.0
    loss: list[float] = field(default_factory=list)  # per logged interval, weighted TTT loss
    step_acc: list[list[float]] = field(default_factory=list)  # per interval: top-1 agreement per TTT step


def prepare(teacher, seqs: list[Sequence], aux_ids, draft_ids: torch.Tensor, lm_head: torch.Tensor, *,
            token_budget: int, device) -> list[Batch]:
    """Teacher features for every batch, computed once and kept on the device."""
    in_draft = torch.zeros(lm_head.shape[0], dtype=torch.bool, device=device)
    in_draft[draft_ids.to(device)] = True
    out = []
    for idx in batches(seqs, token_budget):
        ids, lengths, plens = pad(seqs, idx, device)
        aux, final = features(teacher, ids, lengths, aux_ids)
        j = torch.arange(ids.shape[1], device=device)[None, :]
        top = (final @ lm_head.to(final.dtype).T).argmax(-1)
        usable = (j >= plens[:, None] - 1) & (j <= lengths[:, None] - 2) & in_draft[top]
        out.append(Batch(ids, lengths, plens, aux, final, usable))
    return out


def batch_loss(head, b: Batch, steps: int, draft_lm_head: torch.Tensor, decay: float = 0.8):
    """Weighted TTT loss and per-step top-1 agreement with the target on the usable rows."""
    target_logits = (b.final @ draft_lm_head.to(b.final.dtype).T).float()  # [B, T, Vd]
    target_p = torch.softmax(target_logits, dim=-1)
    target_top = target_logits.argmax(-1)
    del target_logits
    T, Vd = b.ids.shape[1], draft_lm_head.shape[0]
    total, accs = 0.0, []
    for k, logits in head.unroll(b.aux, b.ids, steps):
        rows = T - k - 1  # row i learns position i + k + 1: slices, not shifted copies
        m = b.usable[:, k + 1:]
        n = m.sum().clamp(min=1)
        ce = F.cross_entropy(logits[:, :rows].reshape(-1, Vd), target_p[:, k + 1:].reshape(-1, Vd),
                             reduction="none").view_as(m)
        total = total + decay**k * (ce * m).sum() / n
        with torch.no_grad():
            accs.append(((logits[:, :rows].argmax(-1) == target_top[:, k + 1:]) & m).sum().item() / n.item())
    return total, accs


def train(head, data: list[Batch], draft_lm_head: torch.Tensor, *, steps: int, epochs: int | None,
          max_seconds: float, lr: float, seed: int, log_every: int = 50, autocast: bool = False,
          say=print) -> TrainLog:
    """AdamW, linear warm-up over 3% of an epoch, cosine decay to 10% at the last step. epochs None:
    as many whole epochs as fit `max_seconds`, judged from the first epoch's time, during which the
    rate holds (the log records the count, so a rerun with that count repeats the run)."""
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    g = torch.Generator().manual_seed(seed)
    log = TrainLog()
    t0 = time.perf_counter()
    planned = epochs or 1
    total_steps = planned * len(data) if epochs else 10**12
    warm = max(1, int(0.03 * len(data)))
    run_loss, run_acc, n_run = 0.0, [0.0] * steps, 0
    epoch = 0
    while epoch < planned:
        for bi in torch.randperm(len(data), generator=g).tolist():
            s = log.steps
            scale = s / warm if s < warm else 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, (s - warm) /
                                                                                       max(1, total_steps - warm))))
            for group in opt.param_groups:
                group["lr"] = lr * scale
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                loss, accs = batch_loss(head, data[bi], steps, draft_lm_head)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 0.5)
            opt.step()
            log.steps += 1
            run_loss += loss.item()
            run_acc = [a + b for a, b in zip(run_acc, accs)]
            n_run += 1
            if log.steps % log_every == 0:
                log.loss.append(run_loss / n_run)
                log.step_acc.append([a / n_run for a in run_acc])
                of = f"/{total_steps}" if total_steps < 10**12 else ""
                say(f"step {log.steps}{of} epoch {epoch + 1}/{planned} loss {run_loss / n_run:.4f} "
                    f"acc {' '.join(f'{a / n_run:.3f}' for a in run_acc)} "
                    f"({time.perf_counter() - t0:.0f} s)")
                run_loss, run_acc, n_run = 0.0, [0.0] * steps, 0
        epoch += 1
        if epochs is None and epoch == 1:
            per_epoch = time.perf_counter() - t0
            planned = max(1, int(max_seconds // per_epoch))
            total_steps = planned * len(data)
            say(f"first epoch {per_epoch:.1f} s: {planned} epochs fit {max_seconds:.0f} s")
    log.epochs = epoch
    log.seconds = time.perf_counter() - t0
    return log
