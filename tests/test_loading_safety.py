"""Checkpoint loading safety: the cases tests/test_checkpoint.py does not cover.

Covered there: missing / unexpected / wrong-shape / wrong-dtype tensors, truncated safetensors,
missing shards, malformed config fields, a .bin whose pickle names a callable. Here: code in the
folder is never run (auto_map + modeling_*.py, a malicious .bin beside the safetensors), shard
indexes cannot reach outside the folder, corrupt (not truncated) safetensors headers, broken .bin
files, and a config.json that is missing or not an object. Every error names the file.
"""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import pytest
import torch

from graphrt.checkpoint import load_checkpoint
from graphrt.checkpoint_writer import write_random_checkpoint
from graphrt.errors import CheckpointError


class _Payload:
    """Unpickling this would call Path.touch(marker)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def _tiny(path: Path, **kw) -> Path:
    write_random_checkpoint(path, "tiny", dtype=torch.float32, **kw)
    return path


def _raises(path, *needles):
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(path)
    for n in needles:
        assert str(n) in str(e.value), (n, str(e.value))
    return str(e.value)


def test_remote_code_in_the_folder_is_never_run(tmp_path):
    p = _tiny(tmp_path / "ckpt")
    marker = tmp_path / "imported"
    (p / "modeling_evil.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    (p / "configuration_evil.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    (p / "__init__.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    cfg = json.loads((p / "config.json").read_text())
    cfg["auto_map"] = {"AutoConfig": "configuration_evil.EvilConfig",
                       "AutoModelForCausalLM": "modeling_evil.EvilModel"}
    cfg["trust_remote_code"] = True
    (p / "config.json").write_text(json.dumps(cfg))
    ckpt = load_checkpoint(p)
    assert ckpt.config.vocab_size == 512
    assert not marker.exists()
    assert not any("evil" in name for name in sys.modules)


def test_safetensors_first_a_bin_beside_them_is_never_unpickled(tmp_path):
    p = _tiny(tmp_path / "ckpt")
    marker = tmp_path / "unpickled"
    torch.save({"model.embed_tokens.weight": _Payload(marker)}, p / "pytorch_model.bin")
    load_checkpoint(p)
    assert not marker.exists()


@pytest.mark.parametrize("shard", ["../outside.safetensors", "/etc/passwd", "sub/../../x.safetensors"])
def test_shard_index_cannot_leave_the_folder(tmp_path, shard):
    p = _tiny(tmp_path / "ckpt", num_shards=2)
    (tmp_path / "outside.safetensors").write_bytes((p / sorted(x.name for x in p.glob("model-*"))[0]).read_bytes())
    idx = json.loads((p / "model.safetensors.index.json").read_text())
    name = next(iter(idx["weight_map"]))
    idx["weight_map"][name] = shard
    (p / "model.safetensors.index.json").write_text(json.dumps(idx))
    _raises(p, "model.safetensors.index.json", "weight_map", "outside the folder")


def test_shard_index_not_a_map(tmp_path):
    p = _tiny(tmp_path / "ckpt", num_shards=2)
    (p / "model.safetensors.index.json").write_text(json.dumps({"weight_map": ["model-00001-of-00002.safetensors"]}))
    _raises(p, "model.safetensors.index.json", "weight_map")
    (p / "model.safetensors.index.json").write_text("{not json")
    _raises(p, "model.safetensors.index.json", "JSON")


def _replace_header(file: Path, edit) -> None:
    data = file.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8: 8 + n])
    new = edit(header)
    raw = new if isinstance(new, bytes) else json.dumps(new).encode()
    file.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n:])


def _first_tensor(header):
    return next(k for k in header if k != "__metadata__")


@pytest.mark.parametrize("corruption,needle", [
    (lambda h: b"\xff\xfe not json at all", "corrupt safetensors header"),
    (lambda h: b"[1, 2, 3]", "not an object"),
    (lambda h: {**h, _first_tensor(h): {"dtype": "F32"}}, "corrupt safetensors header entry"),
    (lambda h: {**h, _first_tensor(h): {**h[_first_tensor(h)], "data_offsets": [0, 2**40]}}, "needs bytes"),
    (lambda h: {**h, _first_tensor(h): {**h[_first_tensor(h)], "data_offsets": [8, 4]}}, "needs bytes"),
    (lambda h: {**h, _first_tensor(h): {**h[_first_tensor(h)], "shape": [3, 3]}}, "spans"),
])
def test_corrupt_safetensors_header(tmp_path, corruption, needle):
    p = _tiny(tmp_path / "ckpt")
    _replace_header(p / "model.safetensors", corruption)
    _raises(p, "model.safetensors", needle)


def test_safetensors_header_length_larger_than_file(tmp_path):
    p = _tiny(tmp_path / "ckpt")
    data = (p / "model.safetensors").read_bytes()
    (p / "model.safetensors").write_bytes(struct.pack("<Q", 2**62) + data[8:])
    _raises(p, "model.safetensors", "header length")


@pytest.mark.parametrize("keep", [0, 10, 0.5])
def test_truncated_bin(tmp_path, keep):
    p = _tiny(tmp_path / "ckpt", file_format="bin")
    f = p / "pytorch_model.bin"
    data = f.read_bytes()
    f.write_bytes(data[: int(len(data) * keep) if isinstance(keep, float) else keep])
    _raises(p, "pytorch_model.bin")


@pytest.mark.parametrize("obj,needle", [
    ([torch.zeros(2)], "expected a state dict"),
    ({"model.norm.weight": [1.0, 2.0]}, "not a tensor"),
    ({3: torch.zeros(2)}, "not a tensor"),
])
def test_bin_that_is_not_a_state_dict(tmp_path, obj, needle):
    p = _tiny(tmp_path / "ckpt", file_format="bin")
    torch.save(obj, p / "pytorch_model.bin")
    _raises(p, "pytorch_model.bin", needle)


def test_config_json_missing_or_not_an_object(tmp_path):
    p = _tiny(tmp_path / "ckpt")
    (p / "config.json").write_text("[1, 2]")
    _raises(p, "config.json")
    (p / "config.json").write_text("")
    _raises(p, "config.json")
    (p / "config.json").unlink()
    _raises(p, "config.json")


def test_not_a_folder(tmp_path):
    _raises(tmp_path / "nowhere", "nowhere")
    f = tmp_path / "file.safetensors"
    f.write_bytes(b"12345678")
    _raises(f, "file.safetensors")
