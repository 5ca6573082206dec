"""GGUF checkpoints on small synthetic files (CPU, fast): logits against transformers' own GGUF
loader, the Checkpoint an HF folder gives, dequantization of every supported type, and a clear
CheckpointError, before any tensor is dequantized, for every kind of broken file."""

from __future__ import annotations

import json
import shutil
import struct
import sys

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from graphrt import Runtime, SamplingParams  # noqa: E402
from graphrt.checkpoint import load_checkpoint, load_config  # noqa: E402
from graphrt.config import ModelConfig  # noqa: E402
from graphrt.errors import CheckpointError, GraphrtError  # noqa: E402
from graphrt.gguf_checkpoint import SUPPORTED_TYPES  # noqa: E402
from tests.gguf_files import DELETE, random_weights, write_gguf  # noqa: E402
from tests.helpers import prefill_logits  # noqa: E402

COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5)
# transformers' GGUF loader does not read a qwen3 head size (it keeps Qwen3Config's 128), so the
# qwen3 model has 128-wide heads.
QWEN3 = {**COMMON, "hidden_size": 256, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 128}
TINY = ModelConfig(architecture="llama", tie_word_embeddings=True, **COMMON)


def _hf_models():
    yield "llama", "F32", transformers.LlamaConfig(**COMMON, rope_theta=50000.0, tie_word_embeddings=True)
    yield "llama-untied", "F32", transformers.LlamaConfig(**COMMON, tie_word_embeddings=False)
    yield "llama-q8_0", "Q8_0", transformers.LlamaConfig(**COMMON, tie_word_embeddings=True)
    yield "qwen2", "F32", transformers.Qwen2Config(**COMMON, tie_word_embeddings=False)
    yield "qwen3", "F32", transformers.Qwen3Config(**QWEN3, tie_word_embeddings=True)


def _hf_model(config):
    torch.manual_seed(0)
    cls = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM,
           "qwen3": transformers.Qwen3ForCausalLM}[config.model_type]
    hf = cls(config).eval()
    with torch.no_grad():  # the default init is tiny; widen it so the comparisons are not trivially close
        for p in hf.parameters():
            p.normal_(0, 0.2)
    return hf


@pytest.fixture(autouse=True)
def _own_cache(tmp_path_factory, monkeypatch):
    """The files' indexes (gguf_checkpoint's cache) go to a folder of the session's, not the user's."""
    monkeypatch.setenv("GRAPHRT_CACHE", str(tmp_path_factory.getbasetemp() / "graphrt-cache"))


@pytest.fixture
def tiny_gguf(tmp_path):
    return write_gguf(tmp_path / "tiny.gguf", TINY, random_weights(TINY))


# -- against transformers and HF folders -----------------------------------------------------------


@pytest.mark.parametrize("name,qtype,config", list(_hf_models()), ids=lambda x: x if isinstance(x, str) else "")
def test_logits_match_transformers_reading_the_same_gguf(tmp_path, name, qtype, config):
    """transformers undoes llama.cpp's q/k permutation with its own code (reverse_permute): equal
    logits check graphrt's, and the names and metadata both read."""
    hf = _hf_model(config)
    hf.save_pretrained(tmp_path / "hf")
    ref = load_checkpoint(tmp_path / "hf", dtype=torch.float32)
    write_gguf(tmp_path / "gguf" / "model.gguf", ref.config, ref.weights, qtype=qtype)
    ours = load_checkpoint(tmp_path / "gguf" / "model.gguf")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "gguf", gguf_file="model.gguf",
                                                               dtype=torch.float32).eval()
    ids = torch.randint(0, config.vocab_size, (45,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = theirs(ids[None]).logits[0]
        original = hf(ids[None]).logits[0]
    got = prefill_logits(ours, ids)
    scale = expected.abs().max().item()
    assert (got - expected).abs().max().item() / scale < 1e-5, name
    if qtype == "F32":  # an unquantized file is the original model exactly
        assert (got - original).abs().max().item() / scale < 1e-5, name
    else:
        assert 0 < (got - original).abs().max().item() / scale < 0.1, name


def test_checkpoint_looks_like_one_from_an_hf_folder(tmp_path):
    hf = _hf_model(transformers.LlamaConfig(**COMMON, tie_word_embeddings=True))
    hf.save_pretrained(tmp_path / "hf")
    ref = load_checkpoint(tmp_path / "hf", dtype=torch.float32)
    file = write_gguf(tmp_path / "m.gguf", ref.config, ref.weights)
    got = load_checkpoint(file)
    assert got.kind == "lm" and got.path == str(file)
    assert got.config == ref.config.with_(torch_dtype=None)  # a GGUF file names no stored dtype
    assert set(got.weights) == set(ref.weights)
    assert got.weights["lm_head.weight"] is got.weights["embed_tokens.weight"]
    for k, v in ref.weights.items():
        assert got.weights[k].dtype == torch.float32 and got.weights[k].shape == v.shape, k
        assert torch.equal(got.weights[k], v), k
    assert load_config(file) == got.config
    half = load_checkpoint(file, dtype=torch.bfloat16)
    assert {t.dtype for t in half.weights.values()} == {torch.bfloat16}
    up = "layers.1.mlp.up_proj.weight"
    assert torch.equal(half.weights[up], ref.weights[up].bfloat16())


def test_runtime_from_gguf_file_or_folder_equals_hf_folder(tmp_path):
    hf = _hf_model(transformers.LlamaConfig(**COMMON, tie_word_embeddings=False))
    hf.save_pretrained(tmp_path / "hf")
    ref = load_checkpoint(tmp_path / "hf", dtype=torch.float32)
    file = write_gguf(tmp_path / "folder" / "m.gguf", ref.config, ref.weights)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    want = Runtime.from_pretrained(tmp_path / "hf", device="cpu", max_batch_size=2, max_seq_len=64).generate(
        [[5, 6, 7], [9]], params)
    for path in (file, tmp_path / "folder"):
        # the same model from its HF folder as the draft: greedy speculation must change nothing
        rt = Runtime.from_pretrained(path, str(tmp_path / "hf"), device="cpu", max_batch_size=2, max_seq_len=64)
        got = rt.generate([[5, 6, 7], [9]], params)
        assert [g.token_ids for g in got] == [g.token_ids for g in want]


def test_folder_with_config_json_stays_an_hf_folder(tmp_path):
    hf = _hf_model(transformers.LlamaConfig(**COMMON, tie_word_embeddings=True))
    hf.save_pretrained(tmp_path)
    ref = load_checkpoint(tmp_path, dtype=torch.float32)
    write_gguf(tmp_path / "stray.gguf", TINY.with_(hidden_size=32), random_weights(TINY.with_(hidden_size=32)))
    got = load_checkpoint(tmp_path, dtype=torch.float32)
    assert got.config.hidden_size == ref.config.hidden_size == 64
    assert got.path == str(tmp_path)  # read as the HF folder, not as the .gguf beside it


def test_folder_with_two_gguf_files_is_refused(tmp_path, tiny_gguf):
    shutil.copy(tiny_gguf, tmp_path / "other.gguf")
    with pytest.raises(CheckpointError, match=r"holds 2 \.gguf files \(other\.gguf, tiny\.gguf\)"):
        load_checkpoint(tmp_path)


# -- dequantization ----------------------------------------------------------------------------------

# Matrices 256 wide: the K-quants pack 256 values a block.
WIDE = ModelConfig(architecture="qwen2", vocab_size=32, hidden_size=256, intermediate_size=256, num_hidden_layers=1,
                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, attention_bias=True)
# How far the round trip may move a value, relative to the tensor's largest magnitude.
ROUND_TRIP = {"F32": 0.0, "F16": 1e-3, "BF16": 1e-2, "Q8_0": 1e-2, "Q4_0": 0.15, "Q4_1": 0.15}


def _quantizable(qtype):
    try:
        gguf.quants.quantize(np.zeros((1, 256), np.float32), gguf.GGMLQuantizationType[qtype])
        return True
    except NotImplementedError:
        return False


@pytest.mark.parametrize("qtype", SUPPORTED_TYPES)
def test_dequantize_every_supported_type(tmp_path, qtype):
    """Quantizable types: what graphrt loads is gguf's quantize-then-dequantize of the original, and
    close to it. K-quants (gguf quantizes none of them): random blocks with sane scales load as
    gguf's dequantization of those bytes, in the right place and shape."""
    weights = random_weights(WIDE, seed=4)
    t = gguf.GGMLQuantizationType[qtype]
    if _quantizable(qtype):
        assert qtype in ROUND_TRIP
        ckpt = load_checkpoint(write_gguf(tmp_path / "m.gguf", WIDE, weights, qtype=qtype))
        for name, w in weights.items():
            if w.dim() == 1:
                assert torch.equal(ckpt.weights[name], w), name  # 1-D norms and biases stay F32
                continue
            expected = gguf.quants.dequantize(gguf.quants.quantize(w.numpy(), t), t)
            assert torch.equal(ckpt.weights[name], torch.from_numpy(expected)), name
            assert (ckpt.weights[name] - w).abs().max() <= ROUND_TRIP[qtype] * w.abs().max(), name
        return
    block, size = gguf.GGML_QUANT_SIZES[t]
    scale_at = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (size - 2,)}[qtype]  # fp16 d (and dmin) per block
    rng = np.random.default_rng(5)
    raw, expected = {}, {}
    from graphrt.gguf_checkpoint import gguf_tensor_name

    for name, w in weights.items():
        if w.dim() != 2 or name == "lm_head.weight":
            continue
        rows, cols = w.shape
        data = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
        for at in scale_at:
            data[..., at:at + 2] = rng.uniform(0.001, 0.01, size=(rows, cols // block)).astype(np.float16)[
                ..., None].view(np.uint8)
        data = data.reshape(rows, -1)
        raw[gguf_tensor_name(name)] = (data, qtype)
        expected[name] = gguf.quants.dequantize(data, t)
    ckpt = load_checkpoint(write_gguf(tmp_path / "m.gguf", WIDE, weights, raw=raw))
    for name, e in expected.items():
        assert np.isfinite(e).all() and e.std() > 0
        assert torch.equal(ckpt.weights[name], torch.from_numpy(e)), name


# -- broken files: a clear CheckpointError, and nothing dequantized ----------------------------------


def _patch_type_id(file, tensor: str, type_id: int) -> None:
    """Overwrite the GGML type of `tensor` in the file's tensor table (name, n_dims, dims, type)."""
    data = bytearray(file.read_bytes())
    at = data.index(tensor.encode()) + len(tensor)
    (n_dims,) = struct.unpack_from("<I", data, at)
    struct.pack_into("<I", data, at + 4 + 8 * n_dims, type_id)
    file.write_bytes(bytes(data))


def _truncate(keep):
    def cut(file):
        data = file.read_bytes()
        file.write_bytes(data[: keep if keep >= 1 else int(len(data) * keep)])
    return cut


BROKEN = {
    # id: (how to make the file from (path, cfg, weights), message fragment)
    "truncated-data": (lambda p: _truncate(0.6)(write_gguf(p, TINY, random_weights(TINY))),
                       r"corrupt or truncated GGUF file"),
    "truncated-header": (lambda p: _truncate(40)(write_gguf(p, TINY, random_weights(TINY))),
                         r"corrupt or truncated GGUF file"),
    "truncated-magic": (lambda p: _truncate(3)(write_gguf(p, TINY, random_weights(TINY))),
                        r"not a GGUF file \(starts with b'GGU'"),
    "wrong-magic": (lambda p: p.write_bytes(b"GGML" + write_gguf(p, TINY, random_weights(TINY)).read_bytes()[4:]),
                    r"not a GGUF file \(starts with b'GGML', expected b'GGUF'\)"),
    "shape-vs-metadata": (lambda p: write_gguf(p, TINY, random_weights(TINY), meta={"llama.feed_forward_length": 80}),
                          r"tensor 'blk\.0\.ffn_(gate|up|down)\.weight' has shape \[.*\], but the metadata says"),
    "wrong-row-count": (lambda p: write_gguf(p, TINY, random_weights(TINY), shapes={"blk.1.attn_k.weight": (48, 64)}),
                        r"tensor 'blk\.1\.attn_k\.weight' has shape \[48, 64\], but the metadata says \[32, 64\]"),
    "unsupported-type": (lambda p: write_gguf(p, TINY, random_weights(TINY), qtype="Q5_0"),
                         r"tensor 'token_embd\.weight' is stored as Q5_0; graphrt dequantizes F32, F16, BF16"),
    "unknown-type-id": (lambda p: _patch_type_id(write_gguf(p, TINY, random_weights(TINY)), "blk.0.ffn_up.weight", 99),
                        r"a tensor has a GGML type this gguf package does not know .*99"),
    "missing-tensor": (lambda p: write_gguf(p, TINY, random_weights(TINY), skip=("blk.1.ffn_up.weight",)),
                       r"missing tensor 'blk\.1\.ffn_up\.weight' \(canonical 'layers\.1\.mlp\.up_proj\.weight'"),
    "unexpected-tensor": (lambda p: write_gguf(p, TINY, random_weights(TINY),
                                               extra={"blk.0.attn_qkv.weight": np.zeros((4, 64))}),
                          r"unexpected tensor 'blk\.0\.attn_qkv\.weight'"),
    "rope-freqs": (lambda p: write_gguf(p, TINY, random_weights(TINY), extra={"rope_freqs.weight": np.ones(8)}),
                   r"'rope_freqs\.weight' \(llama3-style RoPE frequency factors\) is not supported"),
    "architecture": (lambda p: write_gguf(p, TINY, random_weights(TINY), arch="phi3"),
                     r"'general\.architecture' is 'phi3', which graphrt does not run \(supported from GGUF: llama"),
    "missing-metadata": (lambda p: write_gguf(p, TINY, random_weights(TINY), meta={"llama.block_count": DELETE}),
                         r"metadata key 'llama\.block_count' is missing"),
    "bad-metadata": (lambda p: write_gguf(p, TINY, random_weights(TINY), meta={"llama.attention.head_count": "4"}),
                     r"metadata key 'llama\.attention\.head_count' must be a positive int, found '4'"),
    "heads-do-not-divide": (lambda p: write_gguf(p, TINY, random_weights(TINY),
                                                 meta={"llama.attention.head_count_kv": 3}),
                            r"'num_key_value_heads' \(3\) must divide num_attention_heads \(4\)"),
    "mixture-of-experts": (lambda p: write_gguf(p, TINY, random_weights(TINY), meta={"llama.expert_count": 8}),
                           r"'llama\.expert_count' > 0: graphrt does not run mixture-of-experts"),
    "rope-scaling": (lambda p: write_gguf(p, TINY, random_weights(TINY), meta={"llama.rope.scaling.type": "linear"}),
                     r"'llama\.rope\.scaling\.type' is 'linear'"),
    "partial-rotary": (lambda p: write_gguf(p, TINY, random_weights(TINY), meta={"llama.rope.dimension_count": 8}),
                       r"'llama\.rope\.dimension_count' \(8\) is not the head size \(16\)"),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_broken_file_is_a_clear_checkpoint_error(tmp_path, monkeypatch, case):
    make, message = BROKEN[case]
    file = tmp_path / "model.gguf"
    make(file)
    calls = []
    real = gguf.quants.dequantize
    monkeypatch.setattr(gguf.quants, "dequantize", lambda *a: calls.append(a) or real(*a))
    for load in (lambda: load_checkpoint(file), lambda: Runtime.from_pretrained(file, device="cpu")):
        with pytest.raises(CheckpointError, match=message) as err:
            load()
        assert str(file) in str(err.value)
    assert calls == []  # refused before the first tensor was dequantized


def test_without_the_gguf_package_the_error_says_how_to_install_it(monkeypatch, tiny_gguf):
    monkeypatch.setitem(sys.modules, "gguf", None)  # import gguf now raises ImportError
    with pytest.raises(GraphrtError, match=r"needs the gguf package: pip install gguf"):
        load_checkpoint(tiny_gguf)


def test_self_draft_and_transformers_peer_of_a_gguf_target(tmp_path, tiny_gguf):
    """What `graphrt bench --target FILE.gguf` builds: a self-draft of the first layers, and (with
    --peers) transformers' model of the same file."""
    from graphrt.checkpoint_writer import self_draft
    from graphrt.peers import hf_from_pretrained

    target = load_checkpoint(tiny_gguf)
    cfg = self_draft(tiny_gguf, tmp_path / "draft", 1)
    draft = load_checkpoint(tmp_path / "draft")
    assert cfg.num_hidden_layers == 1 and draft.config == target.config.with_(num_hidden_layers=1,
                                                                              torch_dtype="float32")
    for name, w in draft.weights.items():
        assert torch.equal(w, target.weights[name]), name
    peer = hf_from_pretrained(tiny_gguf, dtype=torch.float32)
    assert (peer.config.hidden_size, peer.config.num_hidden_layers) == (64, 2)
    assert torch.equal(peer.model.embed_tokens.weight, target.weights["embed_tokens.weight"])


def test_a_second_load_reads_the_kept_index_not_the_file_header(tmp_path, tiny_gguf, monkeypatch):
    """The first load keeps the header's index; a later process (here: the in-process memo cleared)
    and a copy of the file at another path load from it without gguf's reader, to the same
    checkpoint. A damaged index is parsed again and replaced."""
    import importlib.metadata

    from graphrt import gguf_checkpoint
    from graphrt.presets import cache_dir

    first = load_checkpoint(tiny_gguf)
    key = gguf_checkpoint.gguf_file_key(tiny_gguf, importlib.metadata.version("gguf"))
    index = cache_dir() / "gguf-index" / key / "index.json"
    assert index.is_file()
    copy = shutil.copy(tiny_gguf, tmp_path / "copy.gguf")
    real, parsed = gguf.GGUFReader, []
    monkeypatch.setattr(gguf, "GGUFReader", lambda *a, **k: parsed.append(a) or real(*a, **k))
    for path in (tiny_gguf, copy):
        gguf_checkpoint._index.cache_clear()
        again = load_checkpoint(path)
        assert again.config == first.config and all(torch.equal(again.weights[k], v) for k, v in first.weights.items())
    assert parsed == []
    index.write_text("{not json")
    gguf_checkpoint._index.cache_clear()
    assert torch.equal(load_checkpoint(tiny_gguf).weights["norm.weight"], first.weights["norm.weight"])
    assert len(parsed) == 1 and json.loads(index.read_text())["tensors"]
