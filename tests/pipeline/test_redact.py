"""Credentials never leave the process: what `redact` masks, and what it leaves alone."""

from __future__ import annotations

import json
import string

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from threadline.pipeline.redact import contains_credential, is_secret_name, redact, redact_value

OPENAI_KEY = "sk-proj-Ab3dEf6hIj9kLm2nOp5qRs8tUv1wXy4zAb7cDe0fGh3iJk6lMn9o"


def test_an_openai_error_body_echoing_the_authorization_header() -> None:
    body = (
        "Error code: 401 - {'error': {'message': \"Invalid request headers: {'Authorization': 'Bearer "
        + OPENAI_KEY
        + "', 'Content-Type': 'application/json'}\", 'type': 'invalid_request_error', 'code': None}}"
    )
    redacted = redact(body)
    assert OPENAI_KEY not in redacted
    assert "'Authorization': 'Bearer ***'" in redacted
    assert "'Content-Type': 'application/json'" in redacted
    assert "invalid_request_error" in redacted


def test_a_url_with_userinfo() -> None:
    text = "Connection error: https://alice:s3cr3t-pw@llm.internal:8443/v1/chat/completions timed out"
    assert redact(text) == "Connection error: https://***@llm.internal:8443/v1/chat/completions timed out"
    assert redact("redis://:hunter22@10.0.0.5:6379/0") == "redis://***@10.0.0.5:6379/0"


def test_a_json_body_with_an_api_key_stays_json() -> None:
    body = json.dumps({"api_key": "0123456789abcdef0123456789abcdef", "model": "gpt", "usage": {"input_tokens": 12}})
    redacted = json.loads(redact(body))
    assert redacted == {"api_key": "***", "model": "gpt", "usage": {"input_tokens": 12}}


def test_json_escaped_inside_json_as_events_and_artifacts_carry_it() -> None:
    inner = json.dumps({"error": {"headers": {"x-api-key": "abcdefghijkl0123"}}})
    outer = json.dumps({"type": "failed", "message": inner})
    redacted = redact(outer)
    assert "abcdefghijkl0123" not in redacted
    assert json.loads(json.loads(redacted)["message"])["error"]["headers"]["x-api-key"] == "***"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Authorization: Bearer abc.def-ghi_jkl", "Authorization: Bearer ***"),
        ("Proxy-Authorization: Basic dXNlcjpwYXNzd29yZA==", "Proxy-Authorization: Basic ***"),
        ("api-key: 3f9a8b7c6d5e4f30", "api-key: ***"),
        ("x-api-key: 3f9a8b7c6d5e4f30", "x-api-key: ***"),
        ("x-goog-api-key: 3f9a8b7c6d5e4f30", "x-goog-api-key: ***"),
        ('{"apiKey":"3f9a8b7c6d5e4f30"}', '{"apiKey":"***"}'),
        ("url?api_key=3f9a8b7c&model=x", "url?api_key=***&model=x"),
        ("access_token=3f9a8b7c; path=/", "access_token=***; path=/"),
        ("{'password': 'correct horse battery staple'}", "{'password': '***'}"),
        ('client_secret="s3cr3t"', 'client_secret="***"'),
        ("SECRET_KEY=abcdef", "SECRET_KEY=***"),
        ("https://generativelanguage.googleapis.com/v1?key=abc123xyz&alt=sse", None),
        (f'"secret": "{"ab12" * 16}"', '"secret": "***"'),
    ],
)
def test_header_and_field_values(text: str, expected: str | None) -> None:
    if expected is None:
        assert "abc123xyz" not in redact(text)
    else:
        assert redact(text) == expected


@pytest.mark.parametrize(
    "key",
    [
        OPENAI_KEY,
        "sk-Ab3dEf6hIj9kLm2nOp5qRs8tUv1wXy4z",
        "sk-ant-api03-Ab3dEf6hIj9kLm2nOp5qRs8tUv1wXy4zAb7cDe0f-Gh3iJk6lMn9oAA",
        "gsk_Ab3dEf6hIj9kLm2nOp5qRs8tUv1wXy4zAb7cDe0f",
        "AIzaSyAb3dEf6hIj9kLm2nOp5qRs8tUv1wXy4zA",
        "xai-Ab3dEf6hIj9kLm2nOp5qRs8tUv1wXy4zAb7cDe0f",
        "hf_Ab3dEf6hIj9kLm2nOp5qRs8tUv1wXy4zAb",
        "AKIAIOSFODNN7EXAMPLE",
        "ghp_Ab3dEf6hIj9kLm2nOp5qRs8tUv1wXy4zAb7c",
        "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U",
    ],
)
def test_key_shaped_strings_anywhere(key: str) -> None:
    text = f"the provider said: invalid credential ({key}) for this project"
    redacted = redact(text)
    assert key not in redacted
    assert redacted.startswith("the provider said: invalid credential (")
    assert redacted.endswith("***) for this project")
    assert contains_credential(text)


def test_the_configured_key_value_verbatim_whatever_its_shape() -> None:
    key = "qw3n-local-8c1e"
    assert redact(f"upstream rejected {key}!", [key]) == "upstream rejected ***!"
    assert redact("the word cat stays", ["cat"]) == "the word cat stays"  # under 6 characters: too common
    assert redact("abcdefgh and abcdef", ["abcdef", "abcdefgh"]) == "*** and ***"


@pytest.mark.parametrize(
    "text",
    [
        '{"input_tokens": 12, "output_tokens": 3, "max_tokens": 1024, "token_type": "bearer"}',
        "The API key is missing: set api_key_env in the config.",
        "a bearer of bad news; the task-list; sk-learn",
        "commit 3f2a9c1d5e7b8a0f4c6d2e1b3a5f7c9d8e0b1a2c",
        "https://example.com/v1/chat?model=gpt&stream=true",
        "a@b.example wrote: see http://example.com/x",
        '{"token": null, "secret": true}',
        '{"tokenizer": "tiktoken:o200k_base"}',  # the history stage's decision line
        "tokenizer tiktoken:cl100k_base, fallback from tiktoken: no such encoding",
        "",
    ],
)
def test_ordinary_text_is_left_alone(text: str) -> None:
    assert redact(text) == text
    assert not contains_credential(text)


def test_redact_value_walks_json_like_data_without_mutating_it() -> None:
    value = {
        "headers": {"Authorization": "Bearer abc", "X-Request-Id": "r1"},
        "messages": [{"content": f"my key is {OPENAI_KEY}"}, ("token", 3)],
        "token": None,
        "secret": True,
        "password": 1234,
        "usage": {"input_tokens": 5},
    }
    before = json.dumps(value)
    assert redact_value(value) == {
        "headers": {"Authorization": "***", "X-Request-Id": "r1"},
        "messages": [{"content": "my key is sk-proj-***"}, ("token", 3)],
        "token": None,
        "secret": True,
        "password": "***",
        "usage": {"input_tokens": 5},
    }
    assert json.dumps(value) == before
    assert redact_value("token=abcdef", ["zzzzzz"]) == "token=***"
    assert redact_value(42) == 42


@pytest.mark.parametrize(
    ("name", "secret"),
    [
        ("api_key", True), ("apiKey", True), ("x-goog-api-key", True), ("Proxy-Authorization", True),
        ("client_secret", True), ("accessToken", True), ("password", True), ("credentials", True),
        ("private_key", True), ("OPENAI_API_KEY", True),
        ("api_key_env", False), ("max_tokens", False), ("input_tokens", False), ("token_type", False),
        ("key", False), ("model", False),
    ],
)  # fmt: skip
def test_secret_names(name: str, secret: bool) -> None:
    assert is_secret_name(name) is secret


_FRAGMENTS = st.sampled_from(
    [
        "Authorization: ", "Bearer ", "'api_key': '", '"token": "', "password=", "https://", "user:pw@",
        "host/v1?key=", "&", "sk-proj-", "AIza", "AKIA", "xai-", "hf_", "gsk_", "\\\"", "'", '"', ":", "=", " ",
        "\n", ",", "}", "{", "***", "abcdefghijklmnopqrstuvwxyz0123456789", "ABCDEFGHIJKLMNOP", "null",
    ]
)  # fmt: skip
_TEXT = st.lists(_FRAGMENTS | st.text(max_size=8), max_size=24).map("".join)


@given(_TEXT)
@example("token: a***b")
def test_redact_is_idempotent(text: str) -> None:
    once = redact(text)
    assert redact(once) == once


@given(
    st.text(alphabet=string.ascii_letters + string.digits, min_size=20, max_size=60),
    st.sampled_from(["sk-", "sk-proj-", "gsk_", "xai-", "hf_", "AIza"]),
    _TEXT,
    _TEXT,
)
def test_a_planted_key_never_survives(body: str, prefix: str, before: str, after: str) -> None:
    key = prefix + body
    assert key not in redact(f"{before} {key} {after}")


@given(st.text(alphabet=string.ascii_letters + string.digits + "-_.:/@%+=!", min_size=6, max_size=40), _TEXT, _TEXT)
def test_a_given_secret_never_survives(secret: str, before: str, after: str) -> None:
    assert secret not in redact(before + secret + after, [secret])
