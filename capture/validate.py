"""Graph replay must equal eager execution bit for bit on the same inputs.

For a bucket, each phase runs twice from the same snapshot of every static buffer (decode state
and both KV pools): once eagerly, once as its graph replay. Any buffer that differs afterwards is
reported by name.
"""

from __future__ import annotations

import torch


def state_buffers(rt) -> dict[str, torch.Tensor]:
    bufs = {k: v for k, v in vars(rt.state).items() if isinstance(v, torch.Tensor)}
    for name, pool in (("target_kv", rt.target_kv), ("draft_kv", rt.draft_kv)):
        if pool is not None:
            for i, (k, v) in enumerate(zip(pool.k, pool.v)):
                bufs[f"{name}.k{i}"], bufs[f"{name}.v{i}"] = k, v
    return bufs


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.is_floating_point():  # NaN in ignored rows (garbage KV of padded rows) must match too
        return bool((a.isnan() == b.isnan()).all()) and torch.equal(a.nan_to_num(), b.nan_to_num())
    return torch.equal(a, b)


def compare_replay_to_eager(rt, batch_size: int) -> dict[str, list[str]]:
    """Run each phase of bucket `batch_size` eagerly and as a replay from the same state, with
    the batch rows the runtime would use now (running requests, then padding). Leaves the state
    as the eager run left it. Returns {phase: [buffers that differ]}."""
    s = rt.state
    slots = rt.running_slots()[:batch_size]
    rows = slots + [s.scratch_slot] * (batch_size - len(slots))
    s.batch_slots[:batch_size] = torch.tensor(rows, device=rt.device)
    s.batch_num_drafts[:batch_size] = torch.tensor([rt.K if r != s.scratch_slot else 0 for r in rows],
                                                   device=rt.device)
    s.staged = None
    diffs: dict[str, list[str]] = {}
    for name, fn in rt.cycle.phases():
        graph = rt.cycle.graphs.get(name, batch_size)
        bufs = state_buffers(rt)
        before = {k: v.clone() for k, v in bufs.items()}
        graph.replay()
        torch.cuda.synchronize()
        replayed = {k: v.clone() for k, v in bufs.items()}
        for k, v in bufs.items():
            v.copy_(before[k])
        fn(batch_size)
        torch.cuda.synchronize()
        diffs[name] = [k for k, v in bufs.items() if not _same(v, replayed[k])]
    return diffs
