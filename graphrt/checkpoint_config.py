"""The ModelConfig of a checkpoint on disk: an HF folder's config.json plus its weight names and
shapes (which tell the EAGLE head kinds apart), or a GGUF file's metadata. It sits apart from
graphrt/config.py so that the config module imports no checkpoint reader."""

from __future__ import annotations

import os

from graphrt.checkpoint import scan_weight_shapes
from graphrt.config import ModelConfig, read_config_json
from graphrt.gguf_checkpoint import find_gguf, gguf_config


def load_config(path: str | os.PathLike, *, kind: str | None = None) -> ModelConfig:
    """Read `<path>/config.json` (and generation_config.json's eos ids) into a ModelConfig; for a GGUF
    file (or a folder holding one and no config.json), its metadata.

    The weight files' headers are read too (names and shapes only) so EAGLE heads are recognised;
    `kind` forces "lm" / "eagle" / "eagle3".
    """
    gguf_file = find_gguf(path)
    if gguf_file is not None:
        return gguf_config(gguf_file)
    d = read_config_json(path)
    shapes = scan_weight_shapes(path)
    return ModelConfig.from_hf_dict(d, path, weight_shapes=shapes, kind=kind)
