"""The command line on the CPU: bench JSON fields, generate, clear refusals without CUDA."""

import json
import subprocess
import sys

import pytest
import torch

from graphrt.cli import main
from tests.helpers import draft_dir, tiny_dir


def test_bench_json_has_the_fields_it_claims(tmp_path, monkeypatch):
    monkeypatch.setenv("GRAPHRT_CACHE", str(tmp_path / "cache"))
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    assert main(["bench", "--device", "cpu", "--batch-sizes", "1,3", "--max-new-tokens", "6", "--prompt-len", "5",
                 "--json", str(out), "--png", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    d = json.loads(out.read_text())
    assert d["meta"]["draft"].startswith("self-draft")
    modes = {(r["mode"], r["batch_size"]) for r in d["results"]}
    assert modes == {("spec-eager", 1), ("spec-eager", 3), ("plain-eager", 1), ("plain-eager", 3)}
    for r in d["results"]:
        assert r["tokens"] == r["batch_size"] * 5  # 6 new tokens each, the first from prefill
        assert r["tokens_per_s"] > 0 and r["cycles"] >= 1 and r["cycle_ms"] > 0
        assert 1.0 <= r["mean_acceptance_length"] <= 4.0
        phases = {"spec-eager": {"TARGET_VERIFY", "DRAFT_EXTEND", "DRAFT_DECODE"},
                  "plain-eager": {"TARGET_DECODE"}}[r["mode"]]
        assert set(r["phases"]) == phases
        for p in r["phases"].values():
            assert p["calls"] >= 1 and p["mean_us"] > 0


def test_bench_eagle_shaped_self_draft(tmp_path, monkeypatch):
    monkeypatch.setenv("GRAPHRT_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "bench.json"
    assert main(["bench", "--device", "cpu", "--batch-sizes", "2", "--max-new-tokens", "5", "--prompt-len", "4",
                 "--draft-kind", "eagle", "--no-draft", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["meta"]["draft"] == "none"
    assert main(["bench", "--device", "cpu", "--batch-sizes", "2", "--max-new-tokens", "5", "--prompt-len", "4",
                 "--draft-kind", "eagle", "--draft-quantization", "fp8", "--json", str(out)]) == 0
    d = json.loads(out.read_text())
    assert "EAGLE" in d["meta"]["draft"] and d["meta"]["draft"].endswith("; FP8 weights")
    assert {r["mode"] for r in d["results"]} == {"spec-eager", "plain-eager"}


def test_generate_with_prompt_ids_matches_the_api(capsys):
    from graphrt import Runtime, SamplingParams
    from tests.helpers import load

    expected = Runtime(load(tiny_dir()), None, max_batch_size=1, max_seq_len=32).generate(
        [[1, 2, 3]], SamplingParams(max_new_tokens=7, ignore_eos=True))[0].token_ids
    for quantized in ([], ["--draft-quantization", "fp8"]):
        assert main(["generate", str(tiny_dir()), "--prompt-ids", "1,2,3", "--max-new-tokens", "7", "--ignore-eos",
                     "--draft", str(draft_dir("eagle")), "--device", "cpu", "--dtype", "fp32", "--json",
                     *quantized]) == 0
        got = json.loads(capsys.readouterr().out)
        assert got["token_ids"] == expected, quantized


def test_generate_passes_the_filters(capsys):
    """--top-k 1 leaves one token: sampling at any temperature is greedy; a bad --top-p is refused
    with its name."""
    args = ["generate", str(tiny_dir()), "--prompt-ids", "1,2,3", "--max-new-tokens", "6", "--ignore-eos",
            "--device", "cpu", "--dtype", "fp32", "--json"]
    assert main(args) == 0
    greedy = json.loads(capsys.readouterr().out)["token_ids"]
    assert main(args + ["--temperature", "1.5", "--seed", "5", "--top-k", "1", "--top-p", "0.5", "--min-p", "0.1"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == greedy
    assert main(args + ["--temperature", "1.0", "--top-p", "0"]) == 2
    assert "top_p" in capsys.readouterr().err


def test_generate_text_prompt_without_tokenizer_is_a_clear_error(capsys):
    assert main(["generate", str(tiny_dir()), "--prompt", "hello", "--device", "cpu"]) == 2
    assert "tokenizer" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
@pytest.mark.parametrize("cmd", [["capture"], ["profile"]])
def test_gpu_commands_refuse_clearly_without_cuda(cmd, capsys):
    assert main(cmd) == 2
    err = capsys.readouterr().err
    assert "CUDA" in err


def test_bad_arguments_exit_cleanly():
    r = subprocess.run([sys.executable, "-m", "graphrt", "bench", "--batch-sizes", "x"], capture_output=True,
                       text=True)
    assert r.returncode == 2 and "comma-separated integers" in r.stderr


@pytest.mark.parametrize("argv, names", [
    (["bench", "--preset", "tiny", "--batch-sizes", "0"], "--batch-sizes"),
    (["bench", "--preset", "tiny", "-k", "0"], "--num-draft-tokens"),
    (["bench", "--preset", "tiny", "--max-new-tokens", "0"], "--max-new-tokens"),
    (["bench", "--preset", "tiny", "--prompt-len", "-3"], "--prompt-len"),
    (["bench", "--preset", "tiny", "--sweep-accept", "--sweep-k", "3,0"], "--sweep-k"),
    (["profile", "--preset", "tiny", "--batch-sizes", "1,0"], "--batch-sizes"),
    (["capture", "--max-batch-size", "0"], "--max-batch-size"),
    (["capture", "--prefill", "--prefill-chunk-tokens", "0"], "--prefill-chunk-tokens"),
    (["generate", "x.gguf", "--prompt-ids", "1", "--max-new-tokens", "0"], "--max-new-tokens"),
    (["generate", "x.gguf", "--prompt-ids", "1", "--tp", "0"], "--tp"),
])
def test_out_of_range_arguments_are_refused_by_name(argv, names, capsys):
    """Zero or negative counts stop at the parser, which names the option (no traceback, exit 2);
    before, --max-new-tokens 0 silently fell back to the default."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert names in err and "positive integer" in err and "Traceback" not in err


@pytest.mark.parametrize("argv", [["bench", "--preset", "tiny", "--max-new-tokens", "1"],
                                  ["bench", "--preset", "tiny", "--sweep-accept", "--max-new-tokens", "1"],
                                  ["profile", "--preset", "tiny", "--max-new-tokens", "1"]])
def test_benchmarks_need_a_token_to_decode(argv, capsys):
    """One new token a request is its prefill's: nothing to time, and every ratio would divide by zero."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--max-new-tokens" in err and "at least 2" in err and "Traceback" not in err


def test_runtime_option_errors_reach_the_command_line_cleanly(tmp_path, monkeypatch, capsys):
    """A value the parser cannot judge alone (L against K) is the Runtime's OptionError, printed as
    the command's error; a path that does not exist is named as such, before any tokenizer."""
    monkeypatch.setenv("GRAPHRT_CACHE", str(tmp_path / "cache"))
    assert main(["bench", "--preset", "tiny", "--batch-sizes", "1", "-k", "3", "--accept-len", "4.5"]) == 2
    assert "[1, K + 1] = [1, 4], got 4.5" in capsys.readouterr().err
    missing = str(tmp_path / "nowhere")
    assert main(["generate", missing, "--prompt", "hi"]) == 2
    assert f"no checkpoint at {missing}" in capsys.readouterr().err


def test_bench_says_when_its_draft_is_random(tmp_path, monkeypatch, capsys):
    """A random embedded head accepts next to nothing: the report says so, and where the speedup is
    measured instead, unless the acceptance is simulated."""
    monkeypatch.setenv("GRAPHRT_CACHE", str(tmp_path / "cache"))
    base = ["bench", "--preset", "tiny", "--draft-kind", "eagle3", "--batch-sizes", "1", "--max-new-tokens", "4"]
    assert main(base) == 0
    assert "random weights, so it accepts next to nothing" in capsys.readouterr().out
    assert main(base + ["--accept-len", "2"]) == 0
    assert "random weights" not in capsys.readouterr().out


def test_bench_sweep_accept_and_simulated_header(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("GRAPHRT_CACHE", str(tmp_path / "cache"))
    out, png = tmp_path / "sweep.json", tmp_path / "sweep.png"
    assert main(["bench", "--device", "cpu", "--sweep-accept", "--sweep-k", "2", "--batch-sizes", "1",
                 "--max-new-tokens", "7", "--prompt-len", "4", "--draft-kind", "eagle3", "--json", str(out),
                 "--png", str(png)]) == 0
    text = capsys.readouterr().out
    assert "simulated acceptance" in text and "EAGLE-3 head" in text and "break-even at K = 2, B = 1" in text
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    d = json.loads(out.read_text())
    assert [r["L"] for r in d["rows"]] == [1.0, 1.5, 2.0, 2.5, 3.0]
    for r in d["rows"]:
        assert r["speedup"] == pytest.approx(r["tokens_per_s"] / r["plain_tokens_per_s"])
        assert set(r["phases_us"]) == {"TARGET_VERIFY", "DRAFT_EXTEND", "DRAFT_DECODE"}
        # served: the measured L over the cycle's time at the batch's bucket, against the plain step's
        assert r["served_speedup"] == pytest.approx(r["measured_L"] * r["plain_step_us"] / sum(r["phases_us"].values()))
    assert d["rows"][0]["measured_L"] == 1.0 and d["rows"][-1]["measured_L"] > 2.0  # L = K + 1: all accepted
    assert d["break_even"][0]["K"] == 2 and "L_served" in d["break_even"][0]
    assert "(served: " in text
    # --accept-len: the ordinary report, headed as simulated
    assert main(["bench", "--device", "cpu", "--batch-sizes", "1", "--max-new-tokens", "9", "--prompt-len", "4",
                 "--accept-len", "3", "-k", "2", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "simulated acceptance 3" in text
    d = json.loads(out.read_text())
    assert d["meta"]["simulated_acceptance"] == 3.0
    runs = {r["mode"]: r for r in d["results"]}
    assert runs["spec-eager"]["mean_acceptance_length"] == pytest.approx(8 / 3)
    static = runs["spec-eager"]["tokens_per_s"] / runs["plain-eager"]["tokens_per_s"]
    served = 8 / 3 * runs["plain-eager"]["full_cycle_us"] / runs["spec-eager"]["full_cycle_us"]
    assert f"spec-eager      1 {static:>6.2f}x / {served:.2f}x" in text


def test_break_even_interpolates():
    from graphrt.bench import break_even

    rows = [{"K": 3, "batch_size": 1, "measured_L": L, "speedup": s, "served_speedup": 2 * s}
            for L, s in ((1.0, 0.6), (1.5, 0.8), (2.0, 1.2))]
    rows += [{"K": 3, "batch_size": 8, "measured_L": L, "speedup": s, "served_speedup": s + 0.2}
             for L, s in ((1.0, 0.5), (1.5, 0.9))]
    assert break_even(rows) == {(3, 1): pytest.approx(1.75), (3, 8): None}
    assert break_even(rows, "served_speedup") == {(3, 1): 1.0, (3, 8): pytest.approx(1.375)}


def test_full_bucket_times_leave_out_the_tail_buckets():
    """A batch whose requests finish cycles apart runs its last cycles at smaller buckets; its cost
    per launch is the largest bucket's mean, and the served speedup is built from it."""
    from graphrt.profiling.phase_timer import PhaseTimer

    from graphrt.bench import served_speedup

    timer = PhaseTimer("cpu")
    for name, b, ms in [("TARGET_VERIFY", 8, 4.0), ("TARGET_VERIFY", 8, 6.0), ("TARGET_VERIFY", 4, 1.0),
                        ("DRAFT_DECODE", 2, 0.5), ("DRAFT_DECODE", 8, 2.0)]:
        timer._pending.append((name, b, 0.0, ms / 1e3))
    full = timer.largest_batch_us()
    assert full == {"TARGET_VERIFY": pytest.approx(5000.0), "DRAFT_DECODE": pytest.approx(2000.0)}
    spec = {"mean_acceptance_length": 2.8, "full_cycle_us": sum(full.values())}
    assert served_speedup(spec, {"full_cycle_us": 3500.0}) == pytest.approx(2.8 * 3500 / 7000)


def test_converted_tokenizer_key_follows_the_file_contents(tmp_path, monkeypatch):
    """The cache key of a GGUF file's converted tokenizer: the same for a copy at another path, another
    for a file whose metadata differs by one byte, and under $GRAPHRT_CACHE."""
    pytest.importorskip("tokenizers")
    pytest.importorskip("transformers")
    from graphrt.tokenizer import converted_tokenizer_dir

    monkeypatch.setenv("GRAPHRT_CACHE", str(tmp_path / "cache"))
    data = bytearray(b"GGUF" + bytes(range(256)) * 64)
    paths = [tmp_path / "a.gguf", tmp_path / "sub" / "b.gguf", tmp_path / "c.gguf"]
    paths[1].parent.mkdir()
    for path in paths[:2]:
        path.write_bytes(data)
    data[100] ^= 1
    paths[2].write_bytes(data)
    a, b, c = map(converted_tokenizer_dir, paths)
    assert a == b != c and a.parent == tmp_path / "cache" / "tokenizers"
