"""graphrt/floors.py: each phase's weight bytes, against hand counts for the presets."""

from __future__ import annotations

from graphrt.checkpoint_writer import draft_config, preset_config
from graphrt.floors import phase_bytes


def _layer(H, q, kv, inter, in_features=None):
    """One Llama layer's parameters: q, k, v, o, gate, up, down, two norms."""
    i = in_features or H
    return q * i + 2 * kv * i + H * q + 3 * inter * H + 2 * H


def test_llama_1b_shape_with_eagle3_head():
    t = preset_config("llama-1b-shape")
    V, H, inter = 128256, 2048, 8192
    layer = _layer(H, 32 * 64, 8 * 64, inter)
    target = 2 * (16 * layer + H + V * H)  # tied: the embedding is the LM head, read once
    d = draft_config(t, t, "eagle3", draft_vocab_size=32000)
    step = 2 * (_layer(H, 2048, 512, inter, in_features=2 * H) + H + H + 32000 * H)  # + hidden_norm, final norm
    fc = 2 * 3 * H * H
    assert phase_bytes(t, d, 3) == {"TARGET_DECODE": target, "TARGET_VERIFY": target, "DRAFT_EXTEND": step + fc,
                                    "DRAFT_DECODE": 2 * step}
    assert abs(target / 2**30 - 2.30) < 0.01  # the 2.30 GiB the benchmark history quotes
    # over 4 ranks: the target and a split head's step by 4 (its norms, under 0.01%, rounded in),
    # fc whole; a replicated head whole
    split = phase_bytes(t, d, 3, tensor_parallel=4, draft_split=True)
    assert split == {"TARGET_DECODE": target // 4, "TARGET_VERIFY": target // 4, "DRAFT_EXTEND": step // 4 + fc,
                     "DRAFT_DECODE": 2 * (step // 4)}
    assert phase_bytes(t, d, 3, tensor_parallel=4)["DRAFT_DECODE"] == 2 * step
    # an FP8 head: one byte per weight of its own, the target's bytes unchanged
    fp8 = phase_bytes(t, d, 3, draft_weight_bytes=1)
    assert fp8 == {"TARGET_DECODE": target, "TARGET_VERIFY": target, "DRAFT_EXTEND": (step + fc) // 2,
                   "DRAFT_DECODE": step}


def test_llama_8b_shape_with_eagle_head_and_k1():
    t = preset_config("llama-8b-shape")
    V, H, inter = 128256, 4096, 14336
    layer = _layer(H, 32 * 128, 8 * 128, inter)
    target = 2 * (32 * layer + H + V * H)  # untied: the LM head is read, the embedding table only by rows
    d = draft_config(t, t, "eagle").with_(has_input_layernorm=False)
    step = 2 * (2 * H * H + layer - H + V * H)  # fc, a layer without input norm, the target's LM head
    assert phase_bytes(t, d, 1) == {"TARGET_DECODE": target, "TARGET_VERIFY": target, "DRAFT_EXTEND": step}
    # an FP8 EAGLE-1/2 head reads its own weights at one byte, the target's LM head at two
    assert phase_bytes(t, d, 1, draft_weight_bytes=1)["DRAFT_EXTEND"] == step // 2 + V * H


def test_plain_and_standalone_draft():
    t = preset_config("tiny")  # untied
    V, H = 512, 64
    layer = _layer(H, 4 * 16, 2 * 16, 128)
    target = 4 * (2 * layer + H + V * H)
    assert phase_bytes(t, None, dtype_bytes=4) == {"TARGET_DECODE": target}
    d = t.with_(num_hidden_layers=1)
    draft = 4 * (layer + H + V * H)
    assert phase_bytes(t, d, 4, dtype_bytes=4) == {"TARGET_DECODE": target, "TARGET_VERIFY": target,
                                                    "DRAFT_EXTEND": draft, "DRAFT_DECODE": 3 * draft}
