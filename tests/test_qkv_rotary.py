"""kernels/qkv_rotary.py: the qkv GEMV (one token, or a few tokens one per program) with rotary + KV
store in its epilogue, against the two-launch path it replaces (linear.linear then rotary_store_kv).

On CPU the kernel runs under the interpreter in fp32 and fp16 (its in-register cast to bf16
truncates, so bf16 is checked on the GPU only); the `gpu` test asks for equal bits at the llama-1b
and llama-8b shapes with the dispatcher's configuration. Fresh seeds, printed on failure.
"""

from __future__ import annotations

import pytest
import torch
from graphrt.kernels.qkv_rotary import (
    fusable,
    qkv_rotary_store,
    qkv_rotary_store_reference,
    qkv_rotary_store_triton,
)

from graphrt.models.layers import Rotary
from tests.helpers import bit_diff
from tests.seeds import fresh_seed


def _case(hidden, hq, hkv, d, dtype, gen, *, bias, device="cpu", pos=5, slot=3, page=4, blocks=3, tokens=1):
    n_out = (hq + 2 * hkv) * d
    x = torch.randn(tokens, hidden, generator=gen).to(dtype).to(device)
    w = (torch.randn(n_out, hidden, generator=gen) / hidden**0.5).to(dtype).to(device)
    b = torch.randn(n_out, generator=gen).to(dtype).to(device) if bias else None
    rot = Rotary(d, 10000.0, None, 64, device)
    kc = torch.randn(blocks, page, hkv, d, generator=gen).to(dtype).to(device)
    vc = torch.randn(blocks, page, hkv, d, generator=gen).to(dtype).to(device)
    positions = torch.arange(pos, pos + tokens, dtype=torch.int64, device=device)
    slots = torch.arange(slot, slot + tokens, dtype=torch.int64, device=device)
    return x, w, b, positions, rot.cos, rot.sin, kc, vc, slots


def _run_both(args, hq, hkv):
    x, w, b, positions, cos, sin, kc, vc, slots = args
    kc2, vc2 = kc.clone(), vc.clone()
    kw = dict(num_q_heads=hq, num_kv_heads=hkv)
    snap = [t.clone() for t in (x, w, positions, slots)]
    q_fused = qkv_rotary_store_triton(x, w, b, positions, cos, sin, kc, vc, slots, **kw)
    q_ref = qkv_rotary_store_reference(x, w, b, positions, cos, sin, kc2, vc2, slots, **kw)
    for before, after in zip(snap, (x, w, positions, slots)):
        assert torch.equal(before, after), "an input was modified"
    return q_fused, q_ref, (kc, vc), (kc2, vc2)


# (hidden, hq, hkv, head_dim, bias): GQA, MHA, K tails, a head_dim whose half is not a power of 2.
CPU_CASES = [(64, 4, 2, 16, False), (100, 2, 2, 8, True), (48, 6, 1, 12, False)]


@pytest.mark.parametrize("case", CPU_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tokens", [1, 3])
def test_fused_matches_two_launch_path(case, dtype, tokens):
    hidden, hq, hkv, d, bias = case
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    args = _case(hidden, hq, hkv, d, dtype, gen, bias=bias, tokens=tokens)
    q_fused, q_ref, (kc, vc), (kc2, vc2) = _run_both(args, hq, hkv)
    assert q_fused.shape == (tokens, hq, d) and q_fused.dtype == dtype
    # Same sums, same rotation; the interpreter's summation may differ by an ulp from torch's.
    tol = dict(rtol=4e-3, atol=4e-3) if dtype == torch.float16 else dict(rtol=1e-5, atol=1e-5)
    msg = f"seed={seed} case={case} {dtype} tokens={tokens}"
    torch.testing.assert_close(q_fused, q_ref, **tol, msg=lambda m: f"{msg}: q {m}")
    torch.testing.assert_close(kc, kc2, **tol, msg=lambda m: f"{msg}: k cache {m}")
    torch.testing.assert_close(vc, vc2, **tol, msg=lambda m: f"{msg}: v cache {m}")
    # Only slots 3 .. 3 + tokens - 1 changed.
    _, _, _, _, _, _, kc0, vc0, _ = _case(hidden, hq, hkv, d, dtype, torch.Generator().manual_seed(seed), bias=bias,
                                          tokens=tokens)
    changed = (kc != kc0).flatten(2).any(-1).flatten()
    assert changed[3 : 3 + tokens].all() and changed.sum() == tokens, msg


def test_negative_slot_stores_nothing_and_position_wraps():
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    args = list(_case(64, 4, 2, 16, torch.float32, gen, bias=False, pos=-3, slot=-1))
    kc0, vc0 = args[6].clone(), args[7].clone()
    q_fused, q_ref, (kc, vc), _ = _run_both(args, 4, 2)
    assert torch.equal(kc, kc0) and torch.equal(vc, vc0), f"seed={seed}"
    torch.testing.assert_close(q_fused, q_ref, rtol=1e-5, atol=1e-5)


def test_bad_inputs_and_cpu_dispatch():
    gen = torch.Generator().manual_seed(0)
    x, w, b, positions, cos, sin, kc, vc, slots = _case(64, 4, 2, 16, torch.float32, gen, bias=False)
    with pytest.raises(ValueError, match="or unsplit DOT GEMV configuration for 17 tokens"):
        qkv_rotary_store_triton(x.expand(17, -1).contiguous(), w, b, positions.expand(17), cos, sin, kc, vc,
                                slots.expand(17), num_q_heads=4, num_kv_heads=2)
    with pytest.raises(ValueError, match="w_qkv must be"):
        qkv_rotary_store_triton(x, w[:-1], b, positions, cos, sin, kc, vc, slots, num_q_heads=4, num_kv_heads=2)
    # CPU tensors never take the kernel: the dispatcher is the two-launch path, bit for bit.
    assert not fusable(x, w, kc, has_qk_norm=False)
    kc2, vc2 = kc.clone(), vc.clone()
    q1 = qkv_rotary_store(x, w, b, positions, cos, sin, kc, vc, slots, num_q_heads=4, num_kv_heads=2)
    q2 = qkv_rotary_store_reference(x, w, b, positions, cos, sin, kc2, vc2, slots, num_q_heads=4, num_kv_heads=2)
    assert torch.equal(q1, q2) and torch.equal(kc, kc2) and torch.equal(vc, vc2)


@pytest.mark.gpu
@pytest.mark.parametrize("hidden,hq,hkv,d,tokens", [(2048, 32, 8, 64, 1), (4096, 32, 8, 128, 1), (896, 14, 2, 64, 1),
                                                   (896, 14, 2, 64, 4), (576, 9, 3, 64, 4), (576, 9, 3, 64, 3),
                                                   (576, 9, 3, 64, 6),
                                                   (2048, 32, 8, 64, 4), (4096, 32, 8, 128, 16)])
@pytest.mark.parametrize("bias", [False, True])
def test_gpu_fused_is_the_two_launch_path_bitwise(cuda, hidden, hq, hkv, d, bias, tokens):
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    args = _case(hidden, hq, hkv, d, torch.bfloat16, gen, bias=bias, device=cuda, pos=37, slot=9, page=16,
                 tokens=tokens)
    assert fusable(args[0], args[1], args[6], has_qk_norm=False)
    q_fused, q_ref, (kc, vc), (kc2, vc2) = _run_both(args, hq, hkv)
    msg = f"seed={seed} hidden={hidden} heads={hq}/{hkv} d={d} bias={bias} tokens={tokens}"
    assert torch.equal(q_fused, q_ref), f"{msg}: q {bit_diff(q_fused, q_ref)}"
    assert torch.equal(kc, kc2), f"{msg}: k cache {bit_diff(kc, kc2)}"
    assert torch.equal(vc, vc2), f"{msg}: v cache {bit_diff(vc, vc2)}"


_LLAMA_QKV = [(2048, 32, 8, 64), (4096, 32, 8, 128)]
_SMOLLM2_QKV = (576, 9, 3, 64)


def test_dot_rotary_config_past_16_tokens():
    """The fused qkv launch past 16 tokens: up to 32 on the llama shapes, up to 256 on SmolLM2's (K <
    1024, in 64-wide K steps, in row tiles past 64), never on matrices outside the swept sizes."""
    from graphrt.kernels import gemv_config

    def pick(m, hidden, hq, hkv, d):
        return gemv_config.dot_rotary_config(m, (hq + 2 * hkv) * d, hidden)

    for shape in _LLAMA_QKV:
        assert [pick(m, *shape) is not None for m in (17, 24, 32, 33, 48, 64)] == [True] * 3 + [False] * 3
        assert pick(24, *shape)["block_k"] == 128
    assert all(pick(m, *_SMOLLM2_QKV)["block_k"] == 64 for m in (17, 32, 48, 64, 65, 128, 256))  # row tiles past 64
    assert pick(257, *_SMOLLM2_QKV) is None
    assert pick(32, 8192, 64, 8, 128) is None  # llama-70b's qkv: 10240 x 8192 weights, not swept


@pytest.mark.gpu
@pytest.mark.parametrize("hidden,hq,hkv,d,tokens", [(*s, t) for s in _LLAMA_QKV for t in (17, 24, 32)]
                         + [(*_SMOLLM2_QKV, t) for t in (17, 24, 48, 64, 96, 256)])
def test_gpu_fused_past_16_tokens_is_the_same_tiles_two_launch_path_bitwise(cuda, hidden, hq, hkv, d, tokens):
    """17-32 tokens (17-64 on SmolLM2's shape; a verify step at B = 5-8, decoding at B = 17-32): the
    fused launch gives the bits of the DOT GEMV with the dispatcher's tiles, then rotary_store_kv
    (the plain product runs on cuBLAS)."""
    from graphrt.kernels.gemv import gemv_triton
    from graphrt.kernels.gemv_config import dot_rotary_config
    from graphrt.kernels.rotary import rotary_store_kv

    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    x, w, b, positions, cos, sin, kc, vc, slots = _case(hidden, hq, hkv, d, torch.bfloat16, gen, bias=False,
                                                        device=cuda, pos=37, slot=9, page=16, blocks=6, tokens=tokens)
    cfg = dot_rotary_config(tokens, *w.shape)
    assert cfg is not None and fusable(x, w, kc, has_qk_norm=False), (tokens, tuple(w.shape))
    kc2, vc2 = kc.clone(), vc.clone()
    q = qkv_rotary_store(x, w, None, positions, cos, sin, kc, vc, slots, num_q_heads=hq, num_kv_heads=hkv)
    tiles = {key: cfg[key] for key in ("block_n", "block_k", "num_warps", "num_stages")}
    qkv = gemv_triton(x, w, use_dot=True, split_k=1, **tiles)
    q_ref = rotary_store_kv(qkv[:, : hq * d].view(tokens, hq, d), qkv[:, hq * d : (hq + hkv) * d].view(tokens, hkv, d),
                            qkv[:, (hq + hkv) * d :].view(tokens, hkv, d), positions, cos, sin, kc2, vc2, slots)
    msg = f"seed={seed} hidden={hidden} tokens={tokens}"
    assert torch.equal(q, q_ref), f"{msg}: q {bit_diff(q, q_ref)}"
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2), msg


# (hidden, hq, hkv, head_dim, bias, tokens, block_n rows, block_k): GQA, MHA, a K tail, 16 tokens,
# pairs past the last head, 40 tokens (a 64-row x tile), 100 (row tiles)
DOT_CASES = [(64, 4, 2, 16, False, 3, 16, 32), (100, 2, 2, 8, True, 5, 32, 32), (48, 6, 1, 12, False, 16, 32, 16),
             (64, 4, 2, 16, False, 40, 32, 32), (64, 4, 2, 16, True, 100, 32, 32)]  # the last: two row tiles


@pytest.mark.parametrize("case", DOT_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_dot_form_matches_two_launch_path_on_the_dot_path(case, dtype, monkeypatch):
    """3-64 tokens: the DOT kernel (the weight tile interleaving each rotary pair's rows) against the
    GEMV's DOT path with the same tiles, then rotary_store_kv."""
    from graphrt.kernels import qkv_rotary
    from graphrt.kernels.gemv import gemv_triton
    from graphrt.kernels.rotary import rotary_store_kv

    hidden, hq, hkv, d, bias, tokens, bn, bk = case
    cfg = dict(use_dot=True, reduce_each=False, block_n=bn, block_k=bk, num_warps=4, num_stages=1, split_k=1)
    monkeypatch.setattr(qkv_rotary, "dot_rotary_config", lambda m, n, k: dict(cfg))
    monkeypatch.setattr(qkv_rotary, "row_fma_config", lambda m, n, k, fp8=False: None)
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    x, w, b, positions, cos, sin, kc, vc, slots = _case(hidden, hq, hkv, d, dtype, gen, bias=bias, tokens=tokens,
                                                        blocks=max(6, tokens // 4 + 2))
    slots[1] = -1  # a skipped store
    kc2, vc2 = kc.clone(), vc.clone()
    snap = [t.clone() for t in (x, w, positions, slots)]
    q = qkv_rotary.qkv_rotary_store_triton(x, w, b, positions, cos, sin, kc, vc, slots, num_q_heads=hq,
                                           num_kv_heads=hkv)
    for before, after in zip(snap, (x, w, positions, slots)):
        assert torch.equal(before, after), "an input was modified"
    qkv = gemv_triton(x, w, b, use_dot=True, block_n=bn, block_k=bk, split_k=1)
    q_ref = rotary_store_kv(qkv[:, : hq * d].view(tokens, hq, d), qkv[:, hq * d : (hq + hkv) * d].view(tokens, hkv, d),
                            qkv[:, (hq + hkv) * d :].view(tokens, hkv, d), positions, cos, sin, kc2, vc2, slots)
    tol = dict(rtol=4e-3, atol=4e-3) if dtype == torch.float16 else dict(rtol=1e-5, atol=1e-5)
    msg = f"seed={seed} case={case} {dtype}"
    assert q.shape == (tokens, hq, d) and q.dtype == dtype, msg
    torch.testing.assert_close(q, q_ref, **tol, msg=lambda m: f"{msg}: q {m}")
    torch.testing.assert_close(kc, kc2, **tol, msg=lambda m: f"{msg}: k cache {m}")
    torch.testing.assert_close(vc, vc2, **tol, msg=lambda m: f"{msg}: v cache {m}")
