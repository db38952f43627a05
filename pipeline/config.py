"""Agent config documents: parsing, validation (credentials refused), the settings whitelist and prompt
variables."""

from __future__ import annotations

import functools
import json
import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Protocol, cast
from urllib.parse import parse_qsl, urlsplit

import re2
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from .busy import DEFAULT_ON_BUSY, OnBusy
from .contracts import Id
from .errors import InvalidRequest
from .redact import contains_credential, is_secret_name
from .webhooks import WebhookUrl

Provider = Literal[
    "offline", "python", "openai", "anthropic", "google", "bedrock", "groq", "mistral",
    # OpenAI-compatible servers (vLLM, Ollama, LM Studio, llama.cpp): called without a key unless
    # `api_key_env` names one
    "openai-compatible", "vllm", "ollama",
]

#: Model settings a config may set; anything else is refused when the config is registered.
SETTINGS_WHITELIST: frozenset[str] = frozenset(
    {"temperature", "top_p", "presence_penalty", "frequency_penalty", "max_tokens", "stop_sequences"}
)
BUILTIN_TOOLS: frozenset[str] = frozenset({"clock", "ask_human"})
_VARIABLE = re.compile(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}")
#: Names refused in a config besides those `redact` masks everywhere (`api_key`, `token`, ...).
_CONFIG_SECRET_NAMES = frozenset({"key", "auth", "bearer", "cookie", "cookies", "set_cookie", "private_key"})
#: Query parameters of a URL that carry credentials besides those named like secrets.
_QUERY_SECRET_NAMES = frozenset({"key", "sig", "signature", "auth"})
#: Fallback models a config may list (each tried after the one before failed transiently).
MAX_FALLBACKS = 3
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")
_NO_SECRETS = (
    "never put an API key or any other secret in a config: "
    "name the environment variable that holds it in model.api_key_env"
)


def find_credential(document: object, path: str = "") -> str | None:
    """Where a config document holds a credential and why (never the value), or None. Refused:
    fields named like secrets at any depth (`api_key`, `token`, `password`, `Authorization`, ...),
    strings that look like keys, and URLs with a user, a password or a key in their query.
    `*_env` fields name environment variables and are allowed."""
    if isinstance(document, Mapping):
        for key, value in document.items():
            name = str(key)
            where = f"{path}.{name}" if path else name
            if name.lower().endswith("_env"):
                if value is not None and not (isinstance(value, str) and _ENV_NAME.fullmatch(value)):
                    return f"{where} must be the NAME of an environment variable, not its value"
                continue
            if is_secret_name(name) or name.lower().replace("-", "_") in _CONFIG_SECRET_NAMES:
                return f"{where} is named like a credential"
            if (found := find_credential(value, where)) is not None:
                return found
    elif isinstance(document, list | tuple):
        for i, item in enumerate(document):
            if (found := find_credential(item, f"{path}[{i}]")) is not None:
                return found
    elif isinstance(document, str):
        return _string_credential(document, path or "config")
    return None


def _string_credential(text: str, where: str) -> str | None:
    if _URL.match(text) and (found := _url_credential(text)) is not None:
        return f"{where} {found}"
    if contains_credential(text):
        return f"{where} holds what looks like a credential"
    return None


def _url_credential(url: str) -> str | None:
    try:
        parts = urlsplit(url)
    except ValueError:
        return None  # not a URL after all; a malformed base_url is the model client's to refuse
    if "@" in parts.netloc:
        return "has credentials in its URL (a user or password before '@')"
    for name, _ in parse_qsl(parts.query, keep_blank_values=True):
        if is_secret_name(name) or name.lower() in _QUERY_SECRET_NAMES:
            return f"has a credential in its query parameter {name!r}"
    return None


#: The validation context of documents Threadline stored itself after `parse_agent_config` checked
#: them (a pinned config, a resolved turn): the credential walk is not repeated on every read.
TRUSTED: dict[str, bool] = {"threadline_trusted": True}


def _refuse_credentials(value: Any, info: ValidationInfo) -> None:
    if info.context and info.context.get("threadline_trusted"):
        return
    if (found := find_credential(value)) is not None:
        raise PydanticCustomError("credential_in_config", "{where}; " + _NO_SECRETS, {"where": found})


class _Doc(BaseModel):
    # A refused document may hold a secret: validation errors never quote the input.
    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)


#: `model.tokenizer` for counting with the provider's own count endpoint (Anthropic `count_tokens`,
#: Gemini `countTokens`, Bedrock `CountTokens`; a `python:` model factory may implement
#: `Model.count_tokens` too).
PROVIDER_TOKENIZER = "provider"
COUNTING_PROVIDERS: frozenset[str] = frozenset({"anthropic", "google", "bedrock", "python"})
#: The hosted providers whose models count with their own endpoint when a config names no tokenizer:
#: their tokenizers ship nowhere, and a local vocabulary would only approximate them.
COUNTED_BY_DEFAULT: frozenset[str] = frozenset({"anthropic", "google", "bedrock"})
#: The models of provider `offline`, which Threadline owns (`pipeline/llm.py` says what each answers,
#: `workers/worker/providers.py` builds them): `agents put` refuses any other name.
OFFLINE_MODELS: frozenset[str] = frozenset({"echo", "chat", "summary"})

#: Prompt-cache retentions (pydantic-ai's `CacheRetention`), snapped by it to the provider's tiers.
CacheRetention = Literal["5m", "30m", "1h", "12h"]


class CacheOptions(_Doc):
    """`model.cache` in full: a retention (None: the provider's default), and `messages: false` to cache
    only the tool definitions and instructions, not the conversation."""

    retention: CacheRetention | None = None
    messages: bool = True


class ModelSpec(_Doc):
    provider: Provider
    name: Annotated[str, Field(min_length=1, max_length=256)]
    base_url: str | None = None
    #: The NAME of an environment variable on the workers; never the key itself.
    api_key_env: Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")] | None = None
    context_window: Annotated[int, Field(gt=0)] = 32768
    max_output_tokens: Annotated[int, Field(gt=0)] = 1024
    #: Exactly one leading system message on every request (strict chat templates).
    strict_system: bool = True
    #: Images in `files` go to the model natively; otherwise files are described as text.
    vision: bool = False
    #: The tokenizer the history budget counts with: `tiktoken:cl100k_base`, `tiktoken:o200k_base`,
    #: `hf:<path to tokenizer.json>`, `chars/4`, or `provider` (the provider's own count endpoint, for
    #: the providers in `COUNTING_PROVIDERS`); None: the provider's default (`provider` for those in
    #: `COUNTED_BY_DEFAULT`, else by `workers/worker/tokenizers.py`).
    tokenizer: Annotated[str, Field(min_length=1, max_length=512)] | None = None
    #: Offline and test models only: options passed to the model factory.
    options: dict[str, Any] = Field(default_factory=dict)
    #: Models tried in order when this one fails transiently (429, 5xx, connection errors): same shape
    #: (shorthand strings too), no fallback of their own.
    fallback: Annotated[list[ModelSpec], Field(max_length=MAX_FALLBACKS)] = Field(default_factory=list)
    #: At most this many model calls of the agent in flight across all workers; None: no limit.
    max_concurrency: Annotated[int, Field(ge=1)] | None = None
    #: Provider prompt caching (`pipeline/caching.py`): on (the provider's default retention), off, a
    #: retention (`5m`, `1h`, ...), or `{messages: false}`; see docs/agent-config.md for the default.
    cache: bool | CacheRetention | CacheOptions = True

    @model_validator(mode="before")
    @classmethod
    def _from_shorthand(cls, value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, str):
            provider, sep, name = value.partition(":")
            if not sep:
                raise ValueError("model shorthand must look like 'provider:name', e.g. 'offline:echo'")
            value = {"provider": provider, "name": name}
        _refuse_credentials(value, info)
        return value

    def counts_with_provider(self) -> bool:
        """Whether the history budget counts with the provider's count endpoint (configured, or the
        provider's default)."""
        if self.tokenizer is None:
            return self.provider in COUNTED_BY_DEFAULT
        return self.tokenizer == PROVIDER_TOKENIZER

    @model_validator(mode="after")
    def _countable(self) -> ModelSpec:
        if self.tokenizer == PROVIDER_TOKENIZER and self.provider not in COUNTING_PROVIDERS:
            raise ValueError(f"tokenizer 'provider' counts with the provider's count endpoint, and provider "
                             f"{self.provider!r} has none: use it with {', '.join(sorted(COUNTING_PROVIDERS))}, "
                             "or name a local tokenizer ('tiktoken:o200k_base', 'hf:<path to tokenizer.json>')")
        return self

    @field_validator("fallback")
    @classmethod
    def _flat_fallback(cls, value: list[ModelSpec]) -> list[ModelSpec]:
        # one chain, tried in order: a nested chain or a limit of its own would make it a tree
        if any(f.fallback for f in value):
            raise ValueError("a fallback model has no fallback of its own: list every model in one chain")
        if any(f.max_concurrency is not None for f in value):
            raise ValueError("max_concurrency is the agent's (set it on model), not a fallback model's")
        return value

    def chain(self) -> list[ModelSpec]:
        """Every model that may answer, in the order they are tried: this one, then its fallbacks."""
        return [self, *self.fallback]


class CompactionSpec(_Doc):
    """Compaction after a turn ends, off the critical path: the turns that fell out of the window are
    summarised into one running summary by this model (`offline:summary` keeps the first sentence of
    every user message it summarises)."""

    summariser: ModelSpec


# --- long-term memory (`pipeline/memory.py` and its neighbours) ---------------------------------------

ScopeKind = Literal["user", "app", "agent"]
Order = Literal["recall_first", "history_first"]
OFFLINE_EXTRACTOR = "offline:facts"


@dataclass(frozen=True, slots=True)
class MemoryLimits:
    """What consolidation refuses past: current records per partition, characters per value."""

    max_records: int = 1000
    max_value_chars: int = 500


class LongTermSpec(BaseModel):
    """`memory.long_term` of an agent config: remember facts and notes about each user across
    conversations (absent: off).

    `order` says who gives way when the history budget is short. `recall_first` (the default) takes
    the whole `recall_tokens` share off the history budget before the history stage chooses its turns:
    the records are small and a user's name or allergy is usually worth more than the oldest kept
    turn, and because the share is reserved whether or not it is used, the history budget stays the
    same from turn to turn (the kept window's start, and the provider's cached prefix, stay stable).
    `history_first` keeps the turns first and gives recall what they left, up to `recall_tokens`.

    Values longer than `max_value_chars` are refused, not cut: a cut value is a different value, and a
    cut fact would supersede the right one."""

    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)

    #: The model that proposes operations after a turn: `offline:facts` (deterministic rules), or any
    #: model spec, run with `extraction.ExtractionOutput` as its output type.
    extractor: ModelSpec = Field(default=OFFLINE_EXTRACTOR, validate_default=True)
    #: A pydantic-ai `Embedder` model name (`openai:text-embedding-3-small`); None: notes are ranked by
    #: BM25 over their words.
    embedder: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]+:\S+$", max_length=256)] | None = None
    #: Whose memory a turn reads and writes: `user` (tenant, user), `app` (tenant, user, app) or
    #: `agent` (tenant, user, agent). Always taken from the turn, never from a model's output.
    scope: ScopeKind = "user"
    #: The share of the history budget the recalled block may use, in the agent's tokens.
    recall_tokens: Annotated[int, Field(ge=0, le=32768)] = 512
    max_notes_recalled: Annotated[int, Field(ge=0, le=100)] = 8
    #: Current records per partition; adds past it are refused (`limit` in the decision record).
    max_records: Annotated[int, Field(ge=1, le=100_000)] = 1000
    max_value_chars: Annotated[int, Field(ge=1, le=10_000)] = 500
    #: Closed (superseded or invalidated) records kept per partition for the history view, newest first.
    max_history: Annotated[int, Field(ge=0, le=100_000)] = 200
    order: Order = "recall_first"

    @property
    def limits(self) -> MemoryLimits:
        return MemoryLimits(max_records=self.max_records, max_value_chars=self.max_value_chars)

    @property
    def extractor_name(self) -> str:
        """`provider:name` of the extractor, as provenance records it."""
        return f"{self.extractor.provider}:{self.extractor.name}"


class MemorySpec(_Doc):
    message_limit: Annotated[int, Field(gt=0, le=10000)] = 500
    safety_margin_tokens: Annotated[int, Field(ge=0)] = 256
    #: Once the history overflows its budget, it is cut down to this share of the budget, so that the
    #: kept prefix stays the same for the turns that follow (provider prompt caches).
    low_water: Annotated[float, Field(gt=0, le=1)] = 0.7
    #: None: no compaction.
    compaction: CompactionSpec | None = None
    #: Long-term memory across conversations (`LongTermSpec`, `pipeline/memory.py`); None: off.
    long_term: LongTermSpec | None = None


#: Guard rules run on every query and answer: their number and size are bounded (the texts they see
#: are bounded by TL_MAX_QUERY_CHARS and TL_MAX_TEXT_CHARS), so that no config can make a check slow.
MAX_GUARD_KEYWORDS = 500
MAX_GUARD_PATTERNS = 32
MAX_PATTERN_CHARS = 256
MAX_ANNOTATIONS = 1000
GuardKeyword = Annotated[str, StringConstraints(strip_whitespace=True, min_length=1, max_length=100)]


class CompiledPattern(Protocol):
    """What `pipeline.guards` asks of a compiled RE2 pattern (google-re2 ships no type stubs)."""

    def search(self, text: str | bytes) -> object | None: ...


def _re2_options() -> Any:
    options = re2.Options()
    options.case_sensitive = False
    options.never_capture = True  # a guard only asks whether a sentence matches, never for groups
    options.log_errors = False  # the refusal says why; RE2 need not print it to stderr as well
    return options


_RE2_OPTIONS = _re2_options()


def compile_pattern(pattern: str) -> CompiledPattern:
    """A guard pattern as `pipeline/guards.py` searches it: on RE2, whose searches take time linear
    in the text whatever the pattern (no backtracking, so no time budget), case-insensitive, in
    multi-line mode so that `$` also matches before the line break that ends a sentence, as Python's
    `$` does before a final line break. Raises `re2.error` for a pattern RE2 cannot run."""
    return cast(CompiledPattern, re2.compile("(?m)" + pattern, _RE2_OPTIONS))


def _re2_reason(pattern: str) -> str:
    """RE2's reason for refusing `pattern` (compiled without the `(?m)` prefix, which it would quote)."""
    for candidate in (pattern, "(?m)" + pattern):
        try:
            re2.compile(candidate, _RE2_OPTIONS)
        except re2.error as e:
            reason = e.args[0] if e.args else ""
            return reason.decode("utf-8", "replace") if isinstance(reason, bytes) else str(reason)
    return "refused"


def _python_compiles(pattern: str) -> bool:
    with warnings.catch_warnings(action="ignore"):  # e.g. FutureWarning "possible nested set"
        try:
            re.compile(pattern)
        except (re.error, OverflowError, RecursionError):
            return False
    return True


#: RE2's refusals of patterns that are valid elsewhere, by the start of its reason: what to say.
_RE2_LIMITS = (
    ("pattern too large", "its compiled program is larger than RE2 allows"),
    ("invalid repetition size", "it repeats at most 1000 times, nested counts multiplied"),
    ("invalid escape sequence: \\Z", "it spells the end of the text \\z"),
)


def _runnable_pattern(pattern: str) -> str:
    """A guard pattern RE2 runs that does not match the empty text; refused with RE2's reason."""
    try:
        compiled = compile_pattern(pattern)
    except re2.error:
        reason = _re2_reason(pattern)
        why = next((why for start, why in _RE2_LIMITS if reason.startswith(start)), None)
        if why is None:
            if not _python_compiles(pattern):
                raise PydanticCustomError("guard_pattern_invalid", "not a valid regular expression: {reason}",
                                          {"reason": reason}) from None
            why = "it supports no backreferences or lookarounds"
        raise PydanticCustomError("guard_pattern_not_re2", "RE2 cannot run this pattern ({why}): {reason}",
                                  {"why": why, "reason": reason}) from None
    if compiled.search(b"") is not None:
        raise PydanticCustomError("guard_pattern_empty", "matches the empty text: it would refuse everything")
    return pattern


GuardPattern = Annotated[str, Field(min_length=1, max_length=MAX_PATTERN_CHARS), AfterValidator(_runnable_pattern)]


class GuardRules(_Doc):
    """Moderation of one direction (`pipeline.guards`): a hit answers `reply` instead."""

    #: Case-insensitive; `match: word` only on word boundaries ("ass" is not in "class"), `substring`
    #: anywhere (for scripts written without spaces, e.g. Chinese).
    keywords: Annotated[tuple[GuardKeyword, ...], Field(max_length=MAX_GUARD_KEYWORDS)] = ()
    match: Literal["word", "substring"] = "word"
    #: Regular expressions in RE2's syntax (Python's, without backreferences and lookarounds),
    #: case-insensitive, each matched within one sentence; refused when RE2 cannot run one.
    patterns: Annotated[tuple[GuardPattern, ...], Field(max_length=MAX_GUARD_PATTERNS)] = ()
    reply: Annotated[str, Field(min_length=1, max_length=4000)] = "Sorry, I can't help with that."

    @property
    def active(self) -> bool:
        return bool(self.keywords or self.patterns)


class Annotation(_Doc):
    question: Annotated[str, Field(min_length=1, max_length=2000)]
    answer: Annotated[str, Field(min_length=1, max_length=20000)]


class GuardsSpec(_Doc):
    """Input guards (moderation, then annotation replies) answer without calling the model; the
    output guard replaces an answer that matches its rules."""

    input: GuardRules = Field(default_factory=GuardRules)
    output: GuardRules = Field(default_factory=GuardRules)
    #: Stored question → answer pairs; the first whose question matches the query answers it.
    annotations: Annotated[tuple[Annotation, ...], Field(max_length=MAX_ANNOTATIONS)] = ()
    #: `exact`: the query is the question; `normalised`: equal after casefold, NFKC, collapsed
    #: whitespace and punctuation stripped at both ends.
    annotation_match: Literal["exact", "normalised"] = "normalised"


class AgentConfig(_Doc):
    id: Id
    model: ModelSpec
    instructions: str = ""
    settings: dict[str, Any] = Field(default_factory=dict)
    layers: list[Annotated[str, Field(min_length=1)]] = Field(default_factory=lambda: ["history"])
    tools: list[str] = Field(default_factory=list)
    memory: MemorySpec = Field(default_factory=MemorySpec)
    deadline_s: Annotated[float, Field(gt=0, le=86400)] = 120.0
    guards: GuardsSpec = Field(default_factory=GuardsSpec)
    #: What a turn whose request names no `on_busy` does when its conversation is busy (pipeline/busy.py).
    on_busy: OnBusy = DEFAULT_ON_BUSY
    #: Where every turn's terminal event is POSTed unless its request names another (docs/webhooks.md).
    webhook_url: WebhookUrl | None = None

    @model_validator(mode="before")
    @classmethod
    def _no_credentials(cls, value: Any, info: ValidationInfo) -> Any:
        _refuse_credentials(value, info)
        return value

    @field_validator("settings")
    @classmethod
    def _whitelisted(cls, value: dict[str, Any]) -> dict[str, Any]:
        unknown = sorted(set(value) - SETTINGS_WHITELIST)
        if unknown:
            raise ValueError(f"settings not allowed: {unknown}; allowed: {sorted(SETTINGS_WHITELIST)}")
        return value

    @field_validator("tools")
    @classmethod
    def _known_tools(cls, value: list[str]) -> list[str]:
        unknown = sorted(t for t in value if t not in BUILTIN_TOOLS and not t.startswith("python:"))
        if unknown:
            raise ValueError(f"unknown tools: {unknown}; available: {sorted(BUILTIN_TOOLS)} or python:module:function")
        return value

    @field_validator("layers")
    @classmethod
    def _one_history_layer(cls, value: list[str]) -> list[str]:
        if len(set(value)) != len(value):
            raise ValueError("layer names must be unique")
        return value


def parse_agent_config(text: str | bytes) -> AgentConfig:
    """Parse a YAML or JSON agent config document, or raise `InvalidRequest` saying what is wrong."""
    import yaml  # here, not at the top: the producer commands that never parse a config start faster

    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise InvalidRequest(f"agent config is not valid YAML/JSON: {_yaml_problem(e)}") from None
    if not isinstance(data, dict):
        raise InvalidRequest("agent config must be a mapping")
    if (found := find_credential(data)) is not None:
        raise InvalidRequest(f"agent config refused: {found}; {_NO_SECRETS}")
    try:
        return AgentConfig.model_validate(data)
    except ValidationError as e:
        details = "; ".join(f"{_place(err['loc'])}: {err['msg']}" for err in e.errors()[:5])
        raise InvalidRequest(f"invalid agent config: {details}") from None


def _yaml_problem(error: Exception) -> str:
    """pyyaml's error in one line: its problem and where (line and column from 1), without the
    quoted excerpt of the document it spreads over several lines."""
    problem = getattr(error, "problem", None)
    if not problem:
        return " ".join(str(error).split())
    mark = getattr(error, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    context = getattr(error, "context", None)
    return f"{problem}{where}" + (f" ({context})" if context else "")


def _place(loc: tuple[int | str, ...]) -> str:
    """A validation error's place as a config path: `guards.output.patterns[1]`."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else f".{part}" if out else part
    return out or "config"


def config_to_json(config: AgentConfig) -> str:
    return config.model_dump_json()


@functools.lru_cache(maxsize=256)
def config_from_json(text: str | bytes) -> AgentConfig:
    """A config as `agents put` stored it (already checked for credentials). Every turn's admit
    reads its agent's config, most often the same text: the model is frozen and depends on the text
    alone, so it is parsed once."""
    return AgentConfig.model_validate(json.loads(text), context=TRUSTED)


def whitelisted_settings(settings: Mapping[str, Any]) -> dict[str, Any]:
    """Only the whitelisted model settings pass, whatever a stored config holds."""
    return {k: v for k, v in settings.items() if k in SETTINGS_WHITELIST}


def expand_variables(template: str, inputs: Mapping[str, object]) -> tuple[str, list[str]]:
    """Replace `{{name}}` with `inputs[name]`; return the text and the names that had no value."""
    missing: list[str] = []

    def substitute(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in inputs:
            missing.append(name)
            return ""
        return str(inputs[name])

    return _VARIABLE.sub(substitute, template), missing
