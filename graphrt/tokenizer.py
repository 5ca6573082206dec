"""Text in, text out: the checkpoint's own tokenizer, through transformers.

The runtime works on token ids; these helpers are for callers (and the CLI) who want text. The
tokenizer is the checkpoint's: tokenizer.json and friends in an HF folder, or the vocabulary, merges
and chat template in a GGUF file's metadata (transformers converts it; that needs the gguf package).
Nothing is downloaded and no code from the checkpoint runs. Converting a GGUF vocabulary takes
seconds every time, so the converted tokenizer is kept in $GRAPHRT_CACHE (converted_tokenizer_dir).
"""

from __future__ import annotations

import os
from functools import partial
from pathlib import Path

from graphrt.errors import GraphrtError
from graphrt.gguf_checkpoint import find_gguf, gguf_file_key
from graphrt.params import Generation
from graphrt.presets import cache_dir, kept_in_cache


def load_tokenizer(path: str | os.PathLike):
    """The tokenizer of a checkpoint folder or GGUF file (a transformers tokenizer)."""
    path = os.fspath(path)
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise GraphrtError("text needs the transformers package for the tokenizer (pip install transformers); "
                           "or pass token ids") from None
    load = partial(AutoTokenizer.from_pretrained, local_files_only=True, trust_remote_code=False)
    gguf_file = find_gguf(path)
    try:
        if gguf_file is None:
            return load(path)
        # from the cache where an earlier process converted it, else converted from the file's metadata
        gguf_file = os.path.abspath(gguf_file)
        return kept_in_cache(converted_tokenizer_dir(gguf_file), load,
                             lambda: load(os.path.dirname(gguf_file), gguf_file=os.path.basename(gguf_file)),
                             lambda tokenizer, tmp: tokenizer.save_pretrained(tmp), done="tokenizer.json")
    except Exception as exc:  # noqa: BLE001 - any tokenizer failure means the same thing here
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise GraphrtError(f"no usable tokenizer in {path} ({exc.__class__.__name__}: {first[:200]}); "
                           "pass token ids instead") from None


def converted_tokenizer_dir(gguf_file: str | os.PathLike) -> Path:
    """Where the tokenizer converted from this GGUF file is kept: named by the file's size, its first
    64 MiB (every key of its metadata for any vocabulary in use) and the versions of transformers and
    tokenizers, which do the conversion; not by its path, so that a copy of the file finds it too."""
    import tokenizers
    import transformers

    return cache_dir() / "tokenizers" / gguf_file_key(gguf_file, transformers.__version__, tokenizers.__version__)


def encode(tokenizer, text: str, *, chat: bool = False) -> list[int]:
    """Token ids of `text`; chat=True wraps it as one user turn in the checkpoint's chat template,
    ready for the assistant's reply."""
    if not chat:
        return list(tokenizer.encode(text))
    if not getattr(tokenizer, "chat_template", None):
        raise GraphrtError("this checkpoint's tokenizer has no chat template; leave out --chat")
    templated = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                              tokenize=False)
    # The template spells out its special tokens; encoding must not add a BOS of its own on top.
    return list(tokenizer.encode(templated, add_special_tokens=False))


def decode(tokenizer, generated: Generation | list[int]) -> str:
    """The text of a Generation's tokens (or of a list of ids), special tokens such as EOS left out."""
    ids = generated.token_ids if isinstance(generated, Generation) else generated
    return tokenizer.decode(list(ids), skip_special_tokens=True)


class TextStream:
    """Newly completed text as a generation grows. Each update decodes everything so far and returns
    what was not returned before, so characters spelled over several tokens come out whole: while the
    text ends in a partial UTF-8 character (decoded as U+FFFD) the rest waits for the next token."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.shown = ""

    def update(self, token_ids: list[int], *, final: bool = False) -> str:
        text = decode(self.tokenizer, token_ids)
        if text.endswith("\ufffd") and not final:
            return ""
        # Decoding is prefix-stable for byte-level tokenizers; should an earlier character change,
        # only what follows the shared prefix is new (what was shown cannot be taken back).
        new = text[len(os.path.commonprefix([self.shown, text])):]
        self.shown = text
        return new


__all__ = ["load_tokenizer", "encode", "decode", "TextStream"]
