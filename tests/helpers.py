"""Small shared fixtures for the runtime tests: tiny random checkpoints in the real on-disk format."""

from __future__ import annotations

import functools
import importlib.util
import tempfile
from pathlib import Path

import torch

import graphrt
from graphrt.checkpoint import load_checkpoint
from graphrt.checkpoint_writer import self_draft, write_random_checkpoint

_ROOT = Path(tempfile.mkdtemp(prefix="graphrt-test-ckpts-"))


@functools.cache
def tiny_dir(preset: str = "tiny", seed: int = 0) -> Path:
    path = _ROOT / f"{preset}-{seed}"
    write_random_checkpoint(path, preset, dtype=torch.float32, seed=seed)
    return path


@functools.cache
def draft_dir(kind: str, target_preset: str = "tiny", seed: int = 1) -> Path:
    """kind: 'lm' (an independent 1-layer LM), 'self' (the target's first layer), 'eagle-self' (an
    EAGLE-1/2 head that computes the target's first layer, so it is accepted), 'eagle', 'eagle3'
    (random heads)."""
    target = tiny_dir(target_preset)
    path = _ROOT / f"draft-{kind}-{target_preset}-{seed}"
    if kind == "self":
        self_draft(target, path, 1, kind="lm")
    elif kind == "eagle-self":
        self_draft(target, path, 1, kind="eagle")
    elif kind == "lm":
        write_random_checkpoint(path, target_preset, dtype=torch.float32, seed=seed, num_layers=1)
    else:
        write_random_checkpoint(path, target_preset, kind=kind, dtype=torch.float32, seed=seed, target=target)
    return path


def random_prompts(n: int, vocab: int, seed: int, lo: int = 3, hi: int = 20) -> list[list[int]]:
    """n prompts of random ids below vocab, each of a random length in [lo, hi)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def load(path):
    return load_checkpoint(path, dtype=torch.float32, device="cpu")


def prefill_logits(ckpt, ids: torch.Tensor) -> torch.Tensor:
    """[P, V] logits of one prompt of at most 64 tokens through graphrt's model (CPU, fp32 KV, the
    cache's blocks out of order on purpose)."""
    from graphrt.kv_cache import KVPool
    from graphrt.models import build_target
    from graphrt.models.layers import AttentionMetadata

    c = ckpt.config
    model = build_target(ckpt, 256, "cpu")
    kv = KVPool.allocate(c.num_hidden_layers, 8, 16, c.num_key_value_heads, c.head_dim, torch.float32, "cpu")
    P = ids.shape[0]
    table = torch.tensor([[3, 1, 5, 0]], dtype=torch.int32)
    pos = torch.arange(P)
    meta = AttentionMetadata(block_tables=table, seq_lens=torch.tensor([P], dtype=torch.int32),
                             slot_mapping=table[0, pos // 16].long() * 16 + pos % 16, query_len=P, max_seq_len=64)
    hidden, _ = model.forward(ids, pos, meta, kv)
    return model.logits(hidden)


def load_script(name: str):
    """scripts/<name>.py imported as a module (scripts/ is no package)."""
    path = Path(__file__).resolve().parents[1] / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def bit_diff(a: torch.Tensor, b: torch.Tensor) -> str:
    """Where two tensors that should be bit-equal differ: count, largest difference, first index."""
    if a.shape != b.shape:
        return f"shapes {tuple(a.shape)} vs {tuple(b.shape)}"
    ne = (a != b) & ~(a.isnan() & b.isnan())
    if not bool(ne.any()):
        return "equal"
    idx = ne.nonzero()[0].tolist()
    d = (a.float() - b.float()).abs()[ne]
    return (f"{int(ne.sum())} of {a.numel()} elements differ, max |diff| {float(d.max()):.3g}, "
            f"first at {idx}: {a[tuple(idx)].item()} vs {b[tuple(idx)].item()}")


def prompt_forward(rt, prompt):
    """(final hidden [P, H], logits [P, V]) of the target over the prompt, through the paged KV."""
    rid = rt.add_request(prompt, graphrt.SamplingParams(max_new_tokens=4))
    rt.admit()  # its prefill, without a cycle after it
    slot = rt.running_slots()[0]
    zero = torch.zeros(1, dtype=torch.int64, device=rt.device)
    positions, meta = rt.cycle._prompt_inputs(torch.tensor([slot], device=rt.device), len(prompt), zero, False)
    hidden, _ = rt.target.forward(torch.tensor(prompt, device=rt.device), positions, meta, rt.target_kv)
    logits = rt.target.logits(hidden)
    while not rt.finished(rid):
        rt.step()
    rt.pop_generation(rid)
    return hidden, logits
