"""Constructors for turn events: each returns the JSON object of one event, minus `seq`.

The store numbers events (`seq` 1, 2, ...) as it appends them to the turn's stream.
"""

from __future__ import annotations

from typing import Any

from .contracts import Stage, TerminalType, Usage

Event = dict[str, Any]


def accepted(
    turn_id: str,
    attempt: int,
    *,
    conversation_id: str,
    message_id: str,
    parent_message_id: str | None,
    config_version: str,
) -> Event:
    return {
        "type": "accepted",
        "turn_id": turn_id,
        "attempt": attempt,
        "conversation_id": conversation_id,
        "message_id": message_id,
        "parent_message_id": parent_message_id,
        "config_version": config_version,
    }


def stage(turn_id: str, attempt: int, name: Stage, status: str, ms: float | None = None) -> Event:
    event: Event = {"type": "stage", "turn_id": turn_id, "attempt": attempt, "stage": name, "status": status}
    if ms is not None:
        event["ms"] = round(ms, 2)
    return event


def text_delta(turn_id: str, attempt: int, text: str) -> Event:
    return {"type": "text_delta", "turn_id": turn_id, "attempt": attempt, "text": text}


def tool_call(turn_id: str, attempt: int, *, tool_call_id: str, name: str, args: Any) -> Event:
    return {
        "type": "tool_call",
        "turn_id": turn_id,
        "attempt": attempt,
        "tool_call_id": tool_call_id,
        "name": name,
        "args": args,
    }


def tool_result(
    turn_id: str, attempt: int, *, tool_call_id: str, name: str, content: Any, outcome: str
) -> Event:
    return {
        "type": "tool_result",
        "turn_id": turn_id,
        "attempt": attempt,
        "tool_call_id": tool_call_id,
        "name": name,
        "content": content,
        "outcome": outcome,
    }


def retrying(turn_id: str, attempt: int, reason: str) -> Event:
    return {"type": "retrying", "turn_id": turn_id, "attempt": attempt, "reason": reason}


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
) -> Event:
    event: Event = {"type": status, "turn_id": turn_id, "attempt": attempt, "answer": answer}
    if conversation_id is not None:
        event["conversation_id"] = conversation_id
        event["message_id"] = message_id
    if status in ("succeeded", "paused"):
        event["usage"] = (usage or Usage()).model_dump()
    else:
        event["code"] = code or "internal_error"
        event["message"] = message or ""
        if usage is not None:
            event["usage"] = usage.model_dump()
    if status == "paused":
        event["pending_tool_calls"] = pending_tool_calls or []
    return event
