"""Scrub credentials out of text before it leaves the process: provider error bodies, log lines,
events. Masks header and field values named like secrets, bearer tokens, key-shaped strings,
credentials in URLs, and the configured key values themselves."""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Mapping
from typing import Any

MASK = "***"
#: Given secret values shorter than this are not scrubbed verbatim: too likely to be ordinary words.
MIN_SECRET_CHARS = 6

# A name ends with one of these (api_key, x-goog-api-key, Proxy-Authorization, client_secret,
# accessToken, ...); `input_tokens` and `token_type` do not, because the keyword must end the name.
_NAME_KEYWORDS = r"authorization|(?:api|private|access|session|secret)[_-]?key|token|secret|passw(?:or)?d|credentials?"
_SECRET_NAME = re.compile(rf"(?i)[A-Za-z0-9_.-]*?(?:{_NAME_KEYWORDS})")

# `"api_key": "v"`, `'Authorization': 'Bearer v'`, `api_key=v`, `x-api-key: v`, `\"token\": \"v\"`.
# A quoted value runs to its closing quote; an unquoted one to the next delimiter.
_FIELD = re.compile(
    rf"""(?ix)
    (?=[acpst])(?<!tik)(?:{_NAME_KEYWORDS})       # the end of the name; what precedes it is kept
                                               # (a tokenizer named `tiktoken:o200k_base` is no field)
    \\?["']?                                   # the name's closing quote
    \s*(?:=>|[:=])\s*
    (?P<open>\\?["'])?
    (?:(?:bearer|basic|token|digest|bot|apikey)\s+)?
    (?!(?:null|none|true|false)\b)
    (?P<value>(?(open)[^"'\\\n]+|[^\s"'\\,;&{{}}\[\]<>()]+))
    """
)
_BEARER = re.compile(r"(?i)\b(bearer)\s+[A-Za-z0-9._~+/=-]{8,}")
# Provider key formats: OpenAI (sk-, sk-proj-, sk-svcacct-), Anthropic (sk-ant-api03-), Groq (gsk_),
# xAI (xai-), Hugging Face (hf_), Google (AIza), GitHub, GitLab, Slack; AWS access key ids; JWTs.
_KEY_SHAPE = re.compile(
    r"""(?x)
    (?<![A-Za-z0-9_-])
    (?:
      (?P<prefix>sk-(?:proj-|svcacct-|admin-|ant-(?:api\d\d-|admin\d\d-)?)?|gsk_|xai-|hf_|AIza
        |gh[pousr]_|github_pat_|glpat-|xox[abpr]-)
      [A-Za-z0-9_-]{16,}
    | (?P<aws>AKIA|ASIA)[0-9A-Z]{16}(?![A-Za-z0-9])
    | (?P<jwt>eyJ)[A-Za-z0-9_-]{8,}\.eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}
    )
    """
)
_URL_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^\s/@?#\"'<>]+@")
# Query parameters whose bare name is a credential (Google's `?key=`, signed URLs' `sig`).
_QUERY_KEY = re.compile(r"(?i)(?<=[?&])(key|sig|signature)=[^&#\s\"'<>]+")
_FIELD_HINTS = ("auth", "key", "token", "secret", "passw", "credential")
_KEY_HINTS = ("sk-", "gsk_", "xai-", "hf_", "AIza", "AKIA", "ASIA", "eyJ", "gh", "github_pat_", "glpat-", "xox")
# The same substring tests as one scan each: every log line runs them on each of its strings.
_FIELD_HINT = re.compile("|".join(map(re.escape, _FIELD_HINTS)))
_KEY_HINT = re.compile("|".join(map(re.escape, _KEY_HINTS)))
#: Names longer than this are matched each time rather than remembered (`is_secret_name`).
_CACHED_NAME_CHARS = 100
# What makes a bearer token in a config document: long, and not a plain word.
_BEARER_CREDENTIAL = re.compile(r"(?i)\bbearer\s+(?=[A-Za-z._~+/=-]*\d)[A-Za-z0-9._~+/=-]{16,}")


def is_secret_name(name: str) -> bool:
    """True for field and header names that hold credentials: `api_key`, `x-goog-api-key`,
    `Authorization`, `client_secret`, `accessToken`, `password`, `credentials`, ..."""
    # every log line asks about each of its keys, and they are mostly the same few names
    return _is_secret_name(name) if len(name) <= _CACHED_NAME_CHARS else _matches_secret_name(name)


def _matches_secret_name(name: str) -> bool:
    return _SECRET_NAME.fullmatch(name) is not None


_is_secret_name = functools.lru_cache(maxsize=4096)(_matches_secret_name)


def redact(text: str, secrets: Iterable[str] = ()) -> str:
    """`text` with every credential it holds replaced by `***`: the given secret values (6+
    characters, verbatim), values of fields named like secrets, bearer tokens, key-shaped strings
    and credentials in URLs. Idempotent."""
    if secrets:
        for secret in _longest_first(secrets if isinstance(secrets, tuple) else tuple(secrets)):
            if secret in text:
                text = text.replace(secret, MASK)
    # Substring tests first: most text holds nothing to scrub, and they are far cheaper than a scan.
    lowered = text.lower()
    if _FIELD_HINT.search(lowered):
        text = _FIELD.sub(_mask_value, text)
    if "bearer" in lowered:
        text = _BEARER.sub(rf"\1 {MASK}", text)
    if _KEY_HINT.search(text):
        text = _KEY_SHAPE.sub(_mask_key, text)
    if "://" in text:
        text = _URL_USERINFO.sub(rf"\1{MASK}@", text)
    if "=" in text:
        text = _QUERY_KEY.sub(rf"\1={MASK}", text)
    return text


@functools.lru_cache(maxsize=64)
def _longest_first(secrets: tuple[str, ...]) -> tuple[str, ...]:
    """The secrets worth scrubbing, longest first (so a secret inside a longer one is not left half
    masked); remembered, since a process logs with the same few for its whole life."""
    return tuple(sorted((s for s in secrets if len(s) >= MIN_SECRET_CHARS), key=len, reverse=True))


def redact_value(value: Any, secrets: Iterable[str] = ()) -> Any:
    """A copy of JSON-like data (dicts, lists, tuples, strings) with every string redacted and the
    value of every key named like a secret replaced by `***` (None and booleans kept)."""
    return _redact_value(value, tuple(secrets))


def contains_credential(text: str) -> bool:
    """True when `text` holds something that is a credential whatever its context: a key-shaped
    string, a URL with a user or password, or a bearer token. Names in prose do not count."""
    return bool(
        _KEY_SHAPE.search(text) or ("://" in text and _URL_USERINFO.search(text)) or _BEARER_CREDENTIAL.search(text)
    )


def _redact_value(value: Any, secrets: tuple[str, ...]) -> Any:
    if isinstance(value, str):
        return redact(value, secrets)
    if isinstance(value, Mapping):
        return {k: MASK if _masked_key(k, v) else _redact_value(v, secrets) for k, v in value.items()}
    if isinstance(value, list):
        return [_redact_value(v, secrets) for v in value]
    if isinstance(value, tuple):
        return tuple(_redact_value(v, secrets) for v in value)
    return value


def _masked_key(key: object, value: object) -> bool:
    return isinstance(key, str) and value is not None and not isinstance(value, bool) and is_secret_name(key)


def _mask_value(match: re.Match[str]) -> str:
    return match.string[match.start() : match.start("value")] + MASK


def _mask_key(match: re.Match[str]) -> str:
    return (match.group("prefix") or match.group("aws") or match.group("jwt") or "") + MASK
