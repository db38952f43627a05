"""Turn events: a discriminated union (`type` is the discriminator) read and written through one
`TypeAdapter`, shared by the workers, the client, the CLI and the tests.

The store numbers events as it appends them to the turn's stream: an event is encoded without
`seq` (`encode`), and the script that appends it puts `"seq":N` in front. Events whose attempt
only the store knows (a stage start after a claim) are encoded without `attempt` too
(`encode(..., numbered_by_store=True)`), and the script adds it next to `seq`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from .contracts import Usage
from .terminal import TERMINAL_TYPES as TERMINAL_TYPES
from .terminal import TerminalType as TerminalType


class _Event(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")

    turn_id: str
    #: 1, 2, ... with no gaps, set by the store when the event is appended.
    seq: int = 0
    attempt: int = 1


class Accepted(_Event):
    type: Literal["accepted"] = "accepted"
    conversation_id: str
    message_id: str
    parent_message_id: str | None
    config_version: str


class StageEvent(_Event):
    type: Literal["stage"] = "stage"
    stage: str
    status: Literal["started", "finished"]
    ms: float | None = None
    #: The stage's decision record (what it chose and why), on `finished` events that have one.
    decision: dict[str, Any] | None = None


class TextDelta(_Event):
    type: Literal["text_delta"] = "text_delta"
    text: str


class ToolCall(_Event):
    type: Literal["tool_call"] = "tool_call"
    tool_call_id: str
    name: str
    args: Any = None


class ToolResult(_Event):
    type: Literal["tool_result"] = "tool_result"
    tool_call_id: str
    name: str
    content: Any = None
    outcome: str


class Retrying(_Event):
    type: Literal["retrying"] = "retrying"
    reason: str


class _Terminal(_Event):
    answer: str = ""
    usage: Usage | None = None
    #: Set on the terminal events of accepted turns.
    conversation_id: str | None = None
    message_id: str | None = None


class Succeeded(_Terminal):
    type: Literal["succeeded"] = "succeeded"
    usage: Usage = Field(default_factory=Usage)
    #: The model that answered: the `model_name` of its last response (a fallback's when one answered).
    model: str | None = None


class Paused(_Terminal):
    type: Literal["paused"] = "paused"
    usage: Usage = Field(default_factory=Usage)
    #: As on `Succeeded`.
    model: str | None = None
    pending_tool_calls: list[dict[str, Any]] = Field(default_factory=list)


class _Failure(_Terminal):
    code: str
    message: str = ""


class Failed(_Failure):
    type: Literal["failed"] = "failed"


class Cancelled(_Failure):
    type: Literal["cancelled"] = "cancelled"


class TimedOut(_Failure):
    type: Literal["timed_out"] = "timed_out"


Terminal = Succeeded | Paused | Failed | Cancelled | TimedOut
Event = Annotated[
    Accepted | StageEvent | TextDelta | ToolCall | ToolResult | Retrying | Terminal,
    Field(discriminator="type"),
]
EVENTS: TypeAdapter[Event] = TypeAdapter(Event)


def encode(event: _Event, *, numbered_by_store: bool = False) -> str:
    """The event's JSON as the store appends it: without `seq` (and `attempt`, see the module doc)."""
    return event.model_dump_json(exclude={"seq", "attempt"} if numbered_by_store else {"seq"})


def decode(data: str | bytes) -> Event:
    return EVENTS.validate_json(data)


def is_terminal(event: _Event) -> bool:
    return isinstance(event, Terminal)


def terminal(
    turn_id: str,
    attempt: int,
    status: TerminalType,
    *,
    answer: str = "",
    usage: Usage | None = None,
    code: str | None = None,
    message: str | None = None,
    pending_tool_calls: list[dict[str, Any]] | None = None,
    conversation_id: str | None = None,
    message_id: str | None = None,
    model: str | None = None,
) -> Terminal:
    """The one terminal event of a turn, for any of the five endings."""
    common: dict[str, Any] = {"turn_id": turn_id, "attempt": attempt, "answer": answer,
                              "conversation_id": conversation_id, "message_id": message_id}
    if status == "succeeded":
        return Succeeded(**common, usage=usage or Usage(), model=model)
    if status == "paused":
        return Paused(**common, usage=usage or Usage(), pending_tool_calls=pending_tool_calls or [], model=model)
    failure = {**common, "usage": usage, "code": code or "internal_error", "message": message or ""}
    if status == "failed":
        return Failed(**failure)
    if status == "cancelled":
        return Cancelled(**failure)
    return TimedOut(**failure)
