"""Checkpoint config parsing, strict loading, the random writer and self-drafts (CPU, fast).

Every error test asserts that the message names the offending file and the field or tensor key.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from graphrt import checkpoint_writer as cw
from graphrt.checkpoint import (
    Checkpoint,
    check_draft_compatible,
    expected_shapes,
    load_checkpoint,
    load_config,
    scan_weight_shapes,
)
from graphrt.checkpoint_writer import PRESETS, preset_config, random_d2t, self_draft, write_random_checkpoint
from graphrt.config import ModelConfig, default_eagle3_aux_layer_ids
from graphrt.errors import CheckpointError, ConfigMismatchError

LM_PRESETS = ["tiny", "tiny-tied", "tiny-qwen2", "tiny-qwen3"]


def _raw_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a folder read straight from its safetensors files, under stored names."""
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _rewrite(file: Path, edit) -> None:
    sd = load_file(str(file))
    edit(sd)
    save_file(sd, str(file), metadata={"format": "pt"})


def _edit_config(path: Path, edit) -> None:
    d = json.loads((path / "config.json").read_text())
    edit(d)
    (path / "config.json").write_text(json.dumps(d))


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("target") / "tiny"
    write_random_checkpoint(path, "tiny", dtype=torch.float32, seed=3)
    return path


# -- round trips ------------------------------------------------------------------------------------


@pytest.mark.parametrize("preset", LM_PRESETS)
@pytest.mark.parametrize("num_shards", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_lm_round_trip(tmp_path, preset, num_shards, dtype):
    written = write_random_checkpoint(tmp_path, preset, dtype=dtype, num_shards=num_shards, seed=7)
    files = sorted(os.listdir(tmp_path))
    if num_shards == 1:
        assert files == ["config.json", "model.safetensors"]
    else:
        assert "model.safetensors.index.json" in files
        assert "model-00003-of-00003.safetensors" in files
    ckpt = load_checkpoint(tmp_path)
    cfg = ckpt.config
    assert ckpt.kind == "lm" and cfg == written and cfg.torch_dtype == str(dtype).replace("torch.", "")
    for field, value in PRESETS[preset].items():
        assert getattr(cfg, field) == value, field

    raw = _raw_tensors(tmp_path)
    # stored names: "model."-prefixed, lm_head unprefixed and absent when tied
    assert ("lm_head.weight" in raw) == (not cfg.tie_word_embeddings)
    assert all(k.startswith("model.") for k in raw if k != "lm_head.weight")
    expected = expected_shapes(cfg)
    assert set(ckpt.weights) == set(expected) | {"lm_head.weight"}
    for name, t in ckpt.weights.items():
        assert t.dtype == dtype, name
        stored = "lm_head.weight" if name == "lm_head.weight" else "model." + name
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            assert t is ckpt.weights["embed_tokens.weight"]  # the same tensor, not a copy
        else:
            assert torch.equal(t, raw[stored]), name
    # architecture-specific tensors
    assert ("layers.1.self_attn.q_proj.bias" in ckpt.weights) == (preset == "tiny-qwen2")
    assert ("layers.1.self_attn.o_proj.bias" in ckpt.weights) is False
    assert ("layers.1.self_attn.k_norm.weight" in ckpt.weights) == (preset == "tiny-qwen3")
    if preset == "tiny-qwen3":  # q_size (4 heads x 32) differs from hidden (64)
        assert ckpt.weights["layers.0.self_attn.q_proj.weight"].shape == (128, 64)
        assert ckpt.weights["layers.0.self_attn.o_proj.weight"].shape == (64, 128)


def test_writer_is_deterministic_and_sharding_independent(tmp_path):
    a = write_random_checkpoint(tmp_path / "a", "tiny", seed=5)
    write_random_checkpoint(tmp_path / "b", "tiny", seed=5, num_shards=2)
    write_random_checkpoint(tmp_path / "c", "tiny", seed=6)
    ra, rb, rc = (_raw_tensors(tmp_path / n) for n in "abc")
    assert a.num_hidden_layers == 2 and set(ra) == set(rb) == set(rc)
    assert all(torch.equal(ra[k], rb[k]) for k in ra)
    assert not torch.equal(ra["model.embed_tokens.weight"], rc["model.embed_tokens.weight"])
    emb = ra["model.embed_tokens.weight"].float()
    assert 0.015 < emb.std().item() < 0.025  # init_std 0.02
    assert torch.equal(ra["model.norm.weight"], torch.ones(64, dtype=torch.bfloat16))


def test_writer_pooled_path_for_big_tensors(tmp_path, monkeypatch):
    # The big presets fill tensors above _POOL_SIZE elements from a pool; exercise it at tiny size.
    monkeypatch.setattr(cw, "_POOL_SIZE", 2048)
    monkeypatch.setattr(cw, "_CHUNK", 512)
    monkeypatch.setattr(cw, "_pools", {})
    write_random_checkpoint(tmp_path / "a", "tiny", dtype=torch.float32, seed=1, init_std=0.5)
    write_random_checkpoint(tmp_path / "b", "tiny", dtype=torch.float32, seed=1, init_std=0.5, num_shards=2)
    a, b = load_checkpoint(tmp_path / "a"), load_checkpoint(tmp_path / "b")
    emb = a.weights["embed_tokens.weight"]  # 32768 elements: pooled
    assert torch.equal(emb, b.weights["embed_tokens.weight"])
    assert 0.4 < emb.std().item() < 0.6 and emb.unique().numel() > 1000


def test_num_layers_override(tmp_path):
    cfg = write_random_checkpoint(tmp_path, "tiny-qwen3", num_layers=1, dtype=torch.float32)
    ckpt = load_checkpoint(tmp_path)
    assert cfg.num_hidden_layers == 1 and not any(k.startswith("layers.1.") for k in ckpt.weights)


def test_load_casts_dtype(tmp_path, tiny_target):
    ckpt = load_checkpoint(tiny_target, dtype=torch.bfloat16)
    assert {t.dtype for t in ckpt.weights.values()} == {torch.bfloat16}
    write_random_checkpoint(tmp_path, "tiny", kind="eagle3", target=tiny_target, dtype=torch.float32)
    head = load_checkpoint(tmp_path, dtype=torch.float16)
    assert head.weights["d2t"].dtype == torch.int64 and head.weights["t2d"].dtype == torch.bool
    assert head.weights["fc.weight"].dtype == torch.float16
    with pytest.raises(CheckpointError, match="dtype"):
        load_checkpoint(tmp_path, dtype=torch.int32)


@pytest.mark.parametrize("fc_bias", [False, True])
def test_eagle_round_trip(tmp_path, tiny_target, fc_bias):
    written = write_random_checkpoint(
        tmp_path, "tiny", kind="eagle", target=tiny_target, fc_bias=fc_bias, dtype=torch.float32
    )
    raw = _raw_tensors(tmp_path)
    # published EAGLE-1/2 layout: unprefixed names, no layer-0 input norm, config says LlamaForCausalLM
    assert "fc.weight" in raw and "layers.0.self_attn.q_proj.weight" in raw
    assert "layers.0.input_layernorm.weight" not in raw and not any(k.startswith("model.") for k in raw)
    cfg_json = json.loads((tmp_path / "config.json").read_text())
    assert cfg_json["architectures"] == ["LlamaForCausalLM"] and cfg_json["num_hidden_layers"] == 1
    assert cfg_json["bias"] is fc_bias
    ckpt = load_checkpoint(tmp_path)
    cfg = ckpt.config
    assert ckpt.kind == "eagle" and cfg == written
    assert cfg.eagle_fc_bias is fc_bias and cfg.has_input_layernorm is False and cfg.has_embed_tokens
    assert ckpt.weights["fc.weight"].shape == (64, 128)
    assert ("fc.bias" in ckpt.weights) is fc_bias
    assert all(torch.equal(ckpt.weights[k], raw[k]) for k in raw)
    check_draft_compatible(load_checkpoint(tiny_target), ckpt)


def test_eagle3_round_trip(tmp_path, tiny_target):
    written = write_random_checkpoint(
        tmp_path, "tiny", kind="eagle3", target=tiny_target, draft_vocab_size=100, dtype=torch.bfloat16
    )
    raw = _raw_tensors(tmp_path)
    assert "midlayer.hidden_norm.weight" in raw and "midlayer.self_attn.q_proj.weight" in raw
    assert not any(k.startswith("layers.") or k.startswith("model.") for k in raw)
    assert raw["d2t"].dtype == torch.int64 and raw["t2d"].dtype == torch.bool
    ckpt = load_checkpoint(tmp_path)
    cfg, w = ckpt.config, ckpt.weights
    assert ckpt.kind == "eagle3" and cfg == written
    assert cfg.draft_vocab_size == 100 and cfg.target_hidden_size == 64 and not cfg.has_embed_tokens
    # the 2-layer target is too small for (2, L//2, L-3): the writer pins ids that fit it
    assert cfg.eagle_aux_layer_ids == (0, 1, 2)
    assert json.loads((tmp_path / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]
    assert w["fc.weight"].shape == (64, 192)
    assert w["layers.0.self_attn.q_proj.weight"].shape == (64, 128)  # reads [norm(emb) ; hidden_norm(h)]
    assert w["layers.0.self_attn.k_proj.weight"].shape == (32, 128)
    assert w["lm_head.weight"].shape == (100, 64) and w["t2d"].shape == (512,)
    assert torch.equal(w["layers.0.hidden_norm.weight"], raw["midlayer.hidden_norm.weight"])
    # d2t semantics: target_id = draft_id + d2t[draft_id]; distinct, sorted, in range; t2d marks them
    tgt = torch.arange(100) + w["d2t"]
    assert tgt.min() >= 0 and tgt.max() < 512 and bool((tgt[1:] > tgt[:-1]).all())
    assert torch.equal(torch.nonzero(w["t2d"]).flatten(), tgt)
    check_draft_compatible(load_checkpoint(tiny_target), ckpt)


def test_eagle3_without_d2t_gets_identity_map(tmp_path, tiny_target):
    write_random_checkpoint(tmp_path, "tiny", kind="eagle3", target=tiny_target, draft_vocab_size=512)
    _rewrite(tmp_path / "model.safetensors", lambda sd: (sd.pop("d2t"), sd.pop("t2d")))
    ckpt = load_checkpoint(tmp_path)
    assert torch.equal(ckpt.weights["d2t"], torch.zeros(512, dtype=torch.int64))


def test_random_d2t_is_valid():
    d2t, t2d = random_d2t(1000, 300, seed=4)
    ids = torch.arange(300) + d2t
    assert ids.unique().numel() == 300 and ids.min() >= 0 and ids.max() < 1000
    assert int(t2d.sum()) == 300 and bool(t2d[ids].all())


def test_bin_checkpoints_load_weights_only(tmp_path):
    single = write_random_checkpoint(
        tmp_path / "single", "tiny-qwen2", dtype=torch.float32, file_format="bin"
    )
    write_random_checkpoint(
        tmp_path / "sharded", "tiny-qwen2", dtype=torch.float32, file_format="bin", num_shards=2
    )
    write_random_checkpoint(tmp_path / "st", "tiny-qwen2", dtype=torch.float32)
    assert (tmp_path / "single" / "pytorch_model.bin").exists()
    assert (tmp_path / "sharded" / "pytorch_model.bin.index.json").exists()
    ref = load_checkpoint(tmp_path / "st")
    for name in ("single", "sharded"):
        ckpt = load_checkpoint(tmp_path / name)
        assert ckpt.config == single and set(ckpt.weights) == set(ref.weights)
        assert all(torch.equal(ckpt.weights[k], ref.weights[k]) for k in ref.weights)
        assert ckpt.weights["lm_head.weight"] is ckpt.weights["embed_tokens.weight"]


class _Payload:
    """Unpickling this would call Path.touch(marker): weights_only loading must refuse it."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def test_bin_with_pickled_callable_is_refused(tmp_path):
    write_random_checkpoint(tmp_path, "tiny", dtype=torch.float32, file_format="bin")
    sd = torch.load(tmp_path / "pytorch_model.bin", weights_only=True)
    marker = tmp_path / "executed"
    sd["model.embed_tokens.weight"] = _Payload(marker)
    torch.save(sd, tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(tmp_path)
    msg = str(e.value)
    assert "pytorch_model.bin" in msg and "weights_only=True" in msg and "Unsupported global" in msg
    assert "weights_only=False" not in msg and "add_safe_globals" not in msg  # no advice to run it anyway
    assert not marker.exists()


# -- checkpoints written by transformers ------------------------------------------------------------


def _hf_model(arch: str):
    transformers = pytest.importorskip("transformers")
    kw = dict(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        eos_token_id=[5, 6],
        bos_token_id=4,
    )
    if arch == "llama":
        cfg = transformers.LlamaConfig(
            **kw,
            tie_word_embeddings=True,
            rope_theta=500000.0,
            rms_norm_eps=1e-5,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 32.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 128,
            },
        )
        return cfg, transformers.LlamaForCausalLM
    if arch == "qwen2":
        return transformers.Qwen2Config(**kw, tie_word_embeddings=False), transformers.Qwen2ForCausalLM
    return transformers.Qwen3Config(
        **kw, head_dim=32, tie_word_embeddings=False
    ), transformers.Qwen3ForCausalLM


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_transformers_save_pretrained_loads_equal(tmp_path, arch):
    hf_cfg, cls = _hf_model(arch)
    torch.manual_seed(0)
    model = cls(hf_cfg).to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    ckpt = load_checkpoint(tmp_path)
    cfg = ckpt.config
    assert cfg.architecture == arch and ckpt.kind == "lm"
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers, cfg.num_key_value_heads) == (
        300,
        64,
        2,
        2,
    )
    assert cfg.head_dim == (32 if arch == "qwen3" else 16)
    assert cfg.eos_token_ids == (5, 6) and cfg.bos_token_id == 4 and cfg.torch_dtype == "bfloat16"
    assert cfg.attention_bias == (arch == "qwen2") and cfg.qk_norm == (arch == "qwen3")
    if arch == "llama":
        assert cfg.tie_word_embeddings and cfg.rope_theta == 500000.0
        assert cfg.rope_scaling == {
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 128,
        }
        assert ckpt.weights["lm_head.weight"] is ckpt.weights["embed_tokens.weight"]
    else:
        assert cfg.rope_scaling is None
    sd = model.state_dict()
    for k, v in sd.items():
        canon = k[len("model.") :] if k.startswith("model.") else k
        assert torch.equal(ckpt.weights[canon], v), k
    assert set(ckpt.weights) == {k[len("model.") :] if k.startswith("model.") else k for k in sd}


@pytest.mark.parametrize("preset", LM_PRESETS)
def test_writer_output_loads_in_transformers(tmp_path, preset):
    transformers = pytest.importorskip("transformers")
    write_random_checkpoint(tmp_path, preset, dtype=torch.float32, num_shards=2)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    ckpt = load_checkpoint(tmp_path)
    assert type(model).__name__ == json.loads((tmp_path / "config.json").read_text())["architectures"][0]
    for k, v in model.state_dict().items():
        canon = k[len("model.") :] if k.startswith("model.") else k
        assert torch.equal(ckpt.weights[canon], v), k
    assert model.config.tie_word_embeddings == ckpt.config.tie_word_embeddings


# -- config parsing ---------------------------------------------------------------------------------


def _llama_dict(**over):
    d = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 131072,
        "torch_dtype": "bfloat16",
        "eos_token_id": [128001, 128008, 128009],
        "bos_token_id": 128000,
    }
    d.update(over)
    return d


def test_rope_spellings_transformers4_and_5_agree():
    scaling = {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    v4 = ModelConfig.from_hf_dict(
        _llama_dict(rope_theta=500000.0, rope_scaling={"rope_type": "llama3", **scaling})
    )
    v4_old = ModelConfig.from_hf_dict(
        _llama_dict(rope_theta=500000.0, rope_scaling={"type": "llama3", **scaling})
    )
    d5 = _llama_dict(
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, **scaling}, dtype="bfloat16"
    )
    del d5["torch_dtype"]
    v5 = ModelConfig.from_hf_dict(d5)
    assert v4 == v5 == v4_old and v4.rope_theta == 500000.0 and v4.rope_scaling["factor"] == 8.0
    plain = ModelConfig.from_hf_dict(_llama_dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4}))
    assert plain.rope_scaling is None and plain.rope_theta == 1e4 and plain.head_dim == 128


def test_eos_and_generation_config(tmp_path):
    assert ModelConfig.from_hf_dict(_llama_dict(eos_token_id=7)).eos_token_ids == (7,)
    write_random_checkpoint(tmp_path, "tiny")
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 9]}))
    assert load_config(tmp_path).eos_token_ids == (2, 9)


def test_config_round_trips_through_hf_dict():
    for name in PRESETS:
        cfg = preset_config(name)
        assert ModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg, name


def test_preset_shapes_match_published_parameter_counts():
    def params(name):
        return sum(math.prod(s) for s in expected_shapes(preset_config(name)).values())

    # Llama-3.2-1B: 1,235,814,400 parameters (tied); Llama-3.1-8B: 8,030,261,248; SmolLM2-135M: 134,515,008.
    assert params("llama-1b-shape") == 1_235_814_400
    assert params("llama-8b-shape") == 8_030_261_248
    assert params("smollm2-135m-shape") == 134_515_008  # SmolLM2-135M (tied)


def test_eagle3_aux_layer_ids():
    assert default_eagle3_aux_layer_ids(32) == (2, 16, 29)
    for n in range(1, 8):  # tiny targets: clamped into [0, n], ordered low <= mid <= high
        ids = default_eagle3_aux_layer_ids(n)
        assert len(ids) == 3 and list(ids) == sorted(ids) and 0 <= ids[0] and ids[-1] <= n
    base = dict(architectures=["LlamaForCausalLMEagle3"], num_hidden_layers=1, draft_vocab_size=32000)
    top = ModelConfig.from_hf_dict(_llama_dict(**base, eagle_aux_hidden_state_layer_ids=[2, 16, 29]))
    nested = ModelConfig.from_hf_dict(
        _llama_dict(**base, eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 15, 28]})
    )
    none = ModelConfig.from_hf_dict(_llama_dict(**base))
    target = ModelConfig.from_hf_dict(_llama_dict())
    # top level (vLLM): "entering layer j" as is; nested (SpecForge/SGLang): "output of layer k" -> k + 1
    assert top.eagle_aux_layer_ids == nested.eagle_aux_layer_ids == (2, 16, 29)
    assert none.eagle_aux_layer_ids is None and none.aux_layer_ids_for(target) == (2, 16, 29)
    assert top.kind == "eagle3" and top.target_hidden_size == 4096 and top.draft_vocab_size == 32000


def test_detection_by_weights(tmp_path, tiny_target):
    # A yuhuili-style EAGLE-3 config says LlamaForCausalLM: the midlayer.* weights decide.
    write_random_checkpoint(tmp_path / "e3", "tiny", kind="eagle3", target=tiny_target)
    _edit_config(tmp_path / "e3", lambda d: d.update(architectures=["LlamaForCausalLM"]))
    assert load_checkpoint(tmp_path / "e3").kind == "eagle3"
    # target_hidden_size absent from the config: the fc width says it
    _edit_config(tmp_path / "e3", lambda d: d.pop("target_hidden_size"))
    assert load_config(tmp_path / "e3").target_hidden_size == 64
    # An EAGLE-1 head and a 1-layer Llama share a config; fc.weight [H, 2H] decides.
    write_random_checkpoint(tmp_path / "e1", "tiny", kind="eagle", target=tiny_target)
    write_random_checkpoint(tmp_path / "lm1", "tiny", num_layers=1)
    assert load_checkpoint(tmp_path / "e1").kind == "eagle"
    assert load_checkpoint(tmp_path / "lm1").kind == "lm"
    assert ModelConfig.from_hf_dict(json.loads((tmp_path / "e1/config.json").read_text())).kind == "lm"
    assert set(scan_weight_shapes(tmp_path / "e1")) == set(_raw_tensors(tmp_path / "e1"))


# -- error cases: each names the file and the field/key --------------------------------------------


def _tiny(tmp_path, **kw) -> Path:
    write_random_checkpoint(tmp_path, "tiny", dtype=torch.float32, **kw)
    return tmp_path


def _raises(path, *needles, exc=CheckpointError, **kw):
    with pytest.raises(exc) as e:
        load_checkpoint(path, **kw)
    for n in needles:
        assert str(n) in str(e.value), (n, str(e.value))
    return str(e.value)


def test_missing_key(tmp_path):
    p = _tiny(tmp_path)
    _rewrite(p / "model.safetensors", lambda sd: sd.pop("model.layers.1.mlp.up_proj.weight"))
    _raises(p, "model.safetensors", "layers.1.mlp.up_proj.weight", "missing")


def test_missing_key_in_shard_index(tmp_path):
    p = _tiny(tmp_path, num_shards=2)
    idx = json.loads((p / "model.safetensors.index.json").read_text())
    shard = idx["weight_map"].pop("model.norm.weight")
    (p / "model.safetensors.index.json").write_text(json.dumps(idx))
    _raises(p, shard, "model.norm.weight")  # the shard holds a tensor the index does not list
    _rewrite(p / shard, lambda sd: sd.pop("model.norm.weight"))
    _raises(p, "model.safetensors.index.json", "norm.weight", "missing")


def test_unexpected_key(tmp_path):
    p = _tiny(tmp_path, num_shards=2)
    shard = sorted(p.glob("model-*.safetensors"))[1]
    _rewrite(shard, lambda sd: sd.update({"model.layers.0.self_attn.extra.weight": torch.zeros(2)}))
    idx = json.loads((p / "model.safetensors.index.json").read_text())
    idx["weight_map"]["model.layers.0.self_attn.extra.weight"] = shard.name
    (p / "model.safetensors.index.json").write_text(json.dumps(idx))
    _raises(p, shard.name, "model.layers.0.self_attn.extra.weight", "unexpected")


def test_harmless_extra_keys_are_ignored(tmp_path):
    p = _tiny(tmp_path)
    _rewrite(
        p / "model.safetensors",
        lambda sd: sd.update({"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)}),
    )
    assert "layers.0.self_attn.rotary_emb.inv_freq" not in load_checkpoint(p).weights


def test_wrong_shape(tmp_path):
    p = _tiny(tmp_path)
    _rewrite(
        p / "model.safetensors",
        lambda sd: sd.update({"model.layers.0.self_attn.k_proj.weight": torch.zeros(48, 64)}),
    )
    _raises(p, "model.safetensors", "model.layers.0.self_attn.k_proj.weight", "[48, 64]", "[32, 64]")


def test_wrong_dtype(tmp_path):
    p = _tiny(tmp_path)
    _rewrite(
        p / "model.safetensors",
        lambda sd: sd.update({"model.norm.weight": torch.ones(64, dtype=torch.int32)}),
    )
    _raises(p, "model.safetensors", "model.norm.weight", "I32", "floating")


@pytest.mark.parametrize("keep", [4, 200, -100])
def test_truncated_safetensors(tmp_path, keep):
    p = _tiny(tmp_path, num_shards=2)
    shard = sorted(p.glob("model-*.safetensors"))[1]
    data = shard.read_bytes()
    shard.write_bytes(data[:keep] if keep > 0 else data[:keep])
    _raises(p, shard.name)


def test_shard_index_names_missing_file(tmp_path):
    p = _tiny(tmp_path, num_shards=2)
    shard = sorted(p.glob("model-*.safetensors"))[0]
    shard.unlink()
    _raises(p, "model.safetensors.index.json", shard.name)


def test_no_weights(tmp_path):
    p = _tiny(tmp_path)
    (p / "model.safetensors").unlink()
    _raises(p, str(p), "no weights")


def test_bad_json(tmp_path):
    p = _tiny(tmp_path)
    (p / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "hidden_size": 64,')
    _raises(p, "config.json", "JSON")


@pytest.mark.parametrize(
    "edit, needle",
    [
        (lambda d: d.pop("hidden_size"), "hidden_size"),
        (lambda d: d.pop("vocab_size"), "vocab_size"),
        (lambda d: d.update(hidden_size=-64), "hidden_size"),
        (lambda d: d.update(intermediate_size="128"), "intermediate_size"),
        (lambda d: d.update(num_hidden_layers=0), "num_hidden_layers"),
        (lambda d: d.update(num_attention_heads=5, head_dim=None), "num_attention_heads"),
        (lambda d: d.update(num_key_value_heads=3), "num_key_value_heads"),
        (lambda d: d.update(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_scaling.rope_type"),
        (
            lambda d: d.update(rope_scaling={"rope_type": "llama3", "factor": 8.0}),
            "rope_scaling.low_freq_factor",
        ),
        (
            lambda d: d.update(rope_scaling=None, rope_parameters={"rope_type": "dynamic", "factor": 2.0}),
            "rope_parameters.rope_type",
        ),
        (lambda d: d.update(hidden_act="gelu"), "hidden_act"),
        (lambda d: d.update(torch_dtype="int8"), "torch_dtype"),
        (lambda d: d.update(tie_word_embeddings="no"), "tie_word_embeddings"),
        (lambda d: d.update(architectures="LlamaForCausalLM"), "architectures"),
    ],
)
def test_malformed_config_names_field(tmp_path, edit, needle):
    p = _tiny(tmp_path)
    _edit_config(p, edit)
    msg = _raises(p, "config.json", needle)
    assert str(p) in msg


def test_unknown_architecture(tmp_path):
    p = _tiny(tmp_path)
    _edit_config(p, lambda d: d.update(architectures=["GPT2LMHeadModel"], model_type="gpt2"))
    _raises(p, "config.json", "architectures", "GPT2LMHeadModel")


def test_eagle3_bad_d2t(tmp_path, tiny_target):
    write_random_checkpoint(tmp_path, "tiny", kind="eagle3", target=tiny_target, draft_vocab_size=100)
    _rewrite(tmp_path / "model.safetensors", lambda sd: sd.update({"d2t": torch.full((100,), 500)}))
    _raises(tmp_path, "model.safetensors", "d2t", "outside [0, 512)")
    _rewrite(
        tmp_path / "model.safetensors", lambda sd: sd.update({"d2t": torch.zeros(100, dtype=torch.float32)})
    )
    _raises(tmp_path, "model.safetensors", "d2t", "integer")


# -- target/draft compatibility ---------------------------------------------------------------------


def test_vocab_mismatch_lm_draft(tmp_path, tiny_target):
    write_random_checkpoint(tmp_path, preset_config("tiny", vocab_size=500), num_layers=1)
    with pytest.raises(ConfigMismatchError) as e:
        check_draft_compatible(load_checkpoint(tiny_target), load_checkpoint(tmp_path))
    assert "vocab_size" in str(e.value) and "500" in str(e.value) and "512" in str(e.value)
    assert str(tmp_path) in str(e.value)


def test_hidden_mismatch_eagle(tmp_path, tiny_target):
    other = preset_config("tiny", hidden_size=96, head_dim=24)
    write_random_checkpoint(tmp_path / "t", other)
    write_random_checkpoint(tmp_path / "e", "tiny", kind="eagle", target=tiny_target)
    with pytest.raises(ConfigMismatchError) as e:
        check_draft_compatible(load_checkpoint(tmp_path / "t"), load_checkpoint(tmp_path / "e"))
    assert "hidden_size" in str(e.value) and "64" in str(e.value) and "96" in str(e.value)
    with pytest.raises(CheckpointError, match="hidden_size"):
        write_random_checkpoint(tmp_path / "bad", other, kind="eagle", target=tiny_target)


def test_eagle3_fc_width_vocab_and_aux_ids_against_target(tmp_path, tiny_target):
    write_random_checkpoint(tmp_path / "e3", "tiny", kind="eagle3", target=tiny_target, draft_vocab_size=200)
    head = load_checkpoint(tmp_path / "e3")
    wide = preset_config("tiny", hidden_size=96, head_dim=24)
    with pytest.raises(ConfigMismatchError, match="target_hidden_size"):
        check_draft_compatible(wide, head)
    # a target with a smaller vocab: the head's d2t (checked at load against its own vocab) maps past it
    with pytest.raises(ConfigMismatchError, match="vocab_size"):
        check_draft_compatible(preset_config("tiny", vocab_size=256), head)
    with pytest.raises(ConfigMismatchError, match="eagle_aux_hidden_state_layer_ids"):
        check_draft_compatible(load_checkpoint(tiny_target), head.config.with_(eagle_aux_layer_ids=(1, 2, 9)))


# -- self drafts ------------------------------------------------------------------------------------


@pytest.mark.parametrize("preset", ["tiny", "tiny-tied"])
def test_self_draft_lm(tmp_path, preset):
    write_random_checkpoint(tmp_path / "t", preset, dtype=torch.bfloat16)
    cfg = self_draft(tmp_path / "t", tmp_path / "d", 1, kind="lm")
    t, d = load_checkpoint(tmp_path / "t"), load_checkpoint(tmp_path / "d")
    assert isinstance(d, Checkpoint) and d.kind == "lm" and cfg.num_hidden_layers == 1
    assert d.config == t.config.with_(num_hidden_layers=1)
    assert set(d.weights) == {k for k in t.weights if not k.startswith("layers.1.")}
    assert all(torch.equal(v, t.weights[k]) and v.dtype == torch.bfloat16 for k, v in d.weights.items())
    check_draft_compatible(t, d)


@pytest.mark.parametrize("fc_init", ["embed", "hidden"])
def test_self_draft_eagle(tmp_path, tiny_target, fc_init):
    cfg = self_draft(tiny_target, tmp_path, 1, kind="eagle", fc_init=fc_init)
    t, d = load_checkpoint(tiny_target), load_checkpoint(tmp_path)
    assert d.kind == "eagle" and d.config == cfg and not cfg.has_embed_tokens and not cfg.eagle_fc_bias
    fc = d.weights["fc.weight"]
    eye = torch.eye(64)
    emb_part, hid_part = fc[:, :64], fc[:, 64:]  # fc input is [token embedding ; target hidden]
    assert torch.equal(emb_part, eye if fc_init == "embed" else torch.zeros(64, 64))
    assert torch.equal(hid_part, torch.zeros(64, 64) if fc_init == "embed" else eye)
    assert cfg.has_input_layernorm == (fc_init == "embed")
    q = "layers.0.self_attn.q_proj.weight"
    assert torch.equal(d.weights[q], t.weights[q])
    zeroed = fc_init == "hidden"
    assert bool((d.weights["layers.0.mlp.down_proj.weight"] == 0).all()) == zeroed
    assert bool((d.weights["layers.0.self_attn.o_proj.weight"] == 0).all()) == zeroed
    check_draft_compatible(t, d)


def test_cache_writers_on_one_folder_do_not_trip_each_other(tmp_path):
    """Two writers of one cache folder at once (test workers, two benches on an empty cache): each
    writes its own temporary copy, the first to finish is renamed into place and the other's copy is
    dropped; a writer that fails leaves nothing behind."""
    from graphrt.presets import write_once

    path = tmp_path / "cache" / "entry"

    def write(tag):
        def run(tmp):
            tmp.mkdir()
            if tag == "slow":  # the other writer starts and finishes while this one writes
                assert write_once(path, write("fast")) == path
            (tmp / "config.json").write_text(tag)
        return run

    assert write_once(path, write("slow")) == path
    assert (path / "config.json").read_text() == "fast"
    assert [p.name for p in path.parent.iterdir()] == ["entry"]  # no temporary copy left
    assert write_once(path, write("again")) == path and (path / "config.json").read_text() == "fast"

    def fail(tmp):
        tmp.mkdir()
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_once(tmp_path / "cache" / "other", fail)
    assert [p.name for p in path.parent.iterdir()] == ["entry"]
