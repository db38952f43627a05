"""The public wire contracts: the turn request (`threadline.turn/v1`), turn events and the stage envelope."""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from .busy import OnBusy
from .errors import InvalidRequest
from .ids import ID_PATTERN as ID_PATTERN
from .ids import MAX_ID_CHARS, MAX_TURN_ID_CHARS
from .ids import new_conversation_id as new_conversation_id
from .ids import valid_id as valid_id
from .ids import valid_turn_id as valid_turn_id
from .webhooks import WebhookUrl

TURN_SCHEMA = "threadline.turn/v1"

# the ids' rule and its checks live in ids.py, light: `valid_id`, `valid_turn_id` and
# `new_conversation_id` are re-exported from there
Id = Annotated[str, Field(min_length=1, max_length=MAX_ID_CHARS, pattern=ID_PATTERN)]
TurnId = Annotated[str, Field(min_length=1, max_length=MAX_TURN_ID_CHARS, pattern=ID_PATTERN)]
_ID: TypeAdapter[str] = TypeAdapter(Id)
_TURN_ID: TypeAdapter[str] = TypeAdapter(TurnId)

#: How deeply a turn request may nest objects and arrays. Deeper text is refused before it is parsed
#: (a parser recurses once per level), a deeper object before it is walked.
MAX_JSON_DEPTH = 32
#: The most files a request may carry whatever `TL_MAX_FILES` says (the schema's bound).
MAX_FILES_CEILING = 256
# a JSON string (escapes included), and every byte that is no bracket
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_NO_BRACKET = bytes(b for b in range(256) if b not in b"[]{}")


class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class FileRef(_Wire):
    type: Literal["image", "document", "audio", "video", "file"] = "file"
    url: Annotated[str, Field(min_length=1, max_length=4096)]
    mime: Annotated[str, Field(max_length=255)] | None = None


class DeferredAnswers(_Wire):
    """Answers to a paused turn's pending tool calls, keyed by tool call id."""

    calls: dict[str, Any] = Field(min_length=1)


class TurnRequest(_Wire):
    """What a producer enqueues: "user U said Q in conversation C of agent A"."""

    schema_: Literal["threadline.turn/v1"] = Field(alias="schema")
    turn_id: TurnId
    tenant_id: Id
    app_id: Id
    user_id: Id
    agent_id: Id
    conversation_id: Id | None = None
    #: None: continue from the tip; an id: branch from that message; "root": a new root.
    parent_message_id: Id | None = None
    query: str = ""
    files: list[FileRef] = Field(default_factory=list, max_length=MAX_FILES_CEILING)
    inputs: dict[str, str | int | float | bool] = Field(default_factory=dict)
    context: str | None = None
    invoke_from: Literal["published", "draft"] = "published"
    draft_id: Id | None = None
    deferred_tool_results: DeferredAnswers | None = None
    deadline_s: Annotated[float, Field(gt=0, le=86400)] | None = None
    #: "off": the turn neither recalls nor feeds long-term memory (`memory.long_term`).
    memory: Literal["on", "off"] = "on"
    #: What the turn does when its conversation is busy (pipeline/busy.py); None: its agent's `on_busy`.
    on_busy: OnBusy | None = None
    #: POSTed the terminal event when the turn ends (docs/webhooks.md); else the agent's `webhook_url`.
    webhook_url: WebhookUrl | None = None

    @property
    def is_resume(self) -> bool:
        return self.deferred_tool_results is not None


def parse_turn_request(raw: object, *, fallback_turn_id: str, max_query_chars: int,
                       max_context_chars: int = 200_000, max_inputs_chars: int = 32_000,
                       max_files: int = 32) -> TurnRequest:
    """Validate a producer's turn request (a JSON object or its text), or raise `InvalidRequest`.

    `fallback_turn_id` names the turn when the producer gave none: the queue message id, so a
    redelivered message keeps the same turn. Sizes are counted in characters like the query's:
    `context` and the answers of `deferred_tool_results` (their JSON text) against
    `max_context_chars`, `inputs` (every name and value as text) against `max_inputs_chars`; at most
    `max_files` files. Every producer's request is checked here, not only the gateway's.
    """
    data = _as_object(raw)
    data.setdefault("turn_id", fallback_turn_id)
    _check_text(data)
    try:
        request = TurnRequest.model_validate(data)
    except ValidationError as e:
        raise InvalidRequest(f"invalid turn request: {_describe(e)}") from None
    if request.is_resume:
        if request.conversation_id is None:
            raise InvalidRequest("deferred_tool_results needs the conversation_id of the paused turn")
    elif not request.query.strip():
        raise InvalidRequest("query is empty")
    _check_sizes(request, max_query_chars=max_query_chars, max_context_chars=max_context_chars,
                 max_inputs_chars=max_inputs_chars, max_files=max_files)
    if request.invoke_from == "draft" and request.draft_id is None:
        raise InvalidRequest("invoke_from 'draft' needs a draft_id")
    return request


def _check_sizes(request: TurnRequest, *, max_query_chars: int, max_context_chars: int, max_inputs_chars: int,
                 max_files: int) -> None:
    answers = json.dumps(request.deferred_tool_results.calls) if request.deferred_tool_results else ""
    measured = (("query", len(request.query), max_query_chars),
                ("context", len(request.context or ""), max_context_chars),
                ("deferred_tool_results", len(answers), max_context_chars),
                ("inputs", inputs_chars(request.inputs), max_inputs_chars))
    for name, size, limit in measured:
        if size > limit:
            raise InvalidRequest(f"{name} is {size} characters; the limit is {limit}")
    if len(request.files) > max_files:
        raise InvalidRequest(f"{len(request.files)} files; the limit is {max_files}")


def inputs_chars(inputs: dict[str, str | int | float | bool]) -> int:
    """The size of the prompt variables as counted against their limit: every name and value as text."""
    return sum(len(name) + len(str(value)) for name, value in inputs.items())


def json_too_deep(text: bytes | str, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether JSON text nests objects and arrays deeper than `limit`, found without parsing it: the
    brackets outside strings, counted (text that is no JSON at all is the parser's to refuse)."""
    raw = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text
    depth = 0
    for byte in _JSON_STRING.sub(b"", raw).translate(None, _NO_BRACKET):
        depth += 1 if byte in b"[{" else -1
        if depth > limit:
            return True
    return False


def _object_too_deep(value: object, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether a parsed JSON-like value nests deeper than `limit` (walked without recursion)."""
    stack: list[tuple[object, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            if depth + 1 > limit:
                return True
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children)
    return False


def extract_turn_id(raw: object) -> str | None:
    """The turn id of a request that may be invalid, so its failure lands on the right stream."""
    return _extract_id(raw, "turn_id", _TURN_ID)


def extract_conversation_id(raw: object) -> str | None:
    """The conversation id of a request that may be invalid."""
    return _extract_id(raw, "conversation_id", _ID)


def _extract_id(raw: object, field: str, adapter: TypeAdapter[str]) -> str | None:
    try:
        data = _as_object(raw)
    except InvalidRequest:
        return None
    try:
        return adapter.validate_python(data.get(field))
    except ValidationError:
        return None


def _check_text(data: dict[str, Any]) -> None:
    """Text that cannot be stored as UTF-8 (a lone surrogate such as "\\ud800") is refused here,
    before it can fail a write later in the turn."""
    try:
        json.dumps(data, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        raise InvalidRequest("turn request holds text that is not valid Unicode (a lone surrogate)") from None
    except (TypeError, ValueError, RecursionError):
        raise InvalidRequest("turn request is not plain JSON") from None


def _as_object(raw: object) -> dict[str, Any]:
    if isinstance(raw, bytes | str):
        if json_too_deep(raw):
            raise InvalidRequest(f"turn request nests deeper than {MAX_JSON_DEPTH} levels")
        try:
            raw = json.loads(raw)
        except ValueError as e:
            raise InvalidRequest(f"turn request is not valid JSON: {e}") from None
    elif _object_too_deep(raw):
        raise InvalidRequest(f"turn request nests deeper than {MAX_JSON_DEPTH} levels")
    if not isinstance(raw, dict):
        raise InvalidRequest("turn request must be a JSON object")
    return dict(raw)


def _describe(error: ValidationError) -> str:
    parts = []
    for item in error.errors()[:5]:
        where = ".".join(str(p) for p in item["loc"]) or "request"
        parts.append(f"{where}: {item['msg']}")
    return "; ".join(parts)


class Envelope(_Wire):
    """The small message passed between stages; artifacts live in Redis under turn-scoped keys."""

    v: Literal[1] = 1
    turn_id: TurnId
    #: A stage of the stage graph (`pipeline.stages`).
    stage: Id
    attempt: int = Field(default=1, ge=1)
    #: Set on messages that run after the turn ended (compaction), when the turn's record may be gone.
    conversation_id: Id | None = None


class Usage(_Wire):
    """A run's model usage (`pipeline/cost.py` fills it). Input tokens include the cached ones."""

    input_tokens: int = 0
    output_tokens: int = 0
    requests: int = 0
    #: Input tokens the provider served from its prompt cache, and those it wrote to it.
    cache_read_tokens: int = 0
    cache_write_tokens: int = 0
    #: The run's cost in USD (genai-prices); None: unknown (a model it does not price, offline models).
    cost_usd: float | None = None
    #: None: the provider reported the counts; else the local tokenizer that counted them.
    counted_by: str | None = None
