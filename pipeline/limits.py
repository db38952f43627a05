"""Size limits on what a turn stores and streams: answers, tool results, prompts, event payloads.
Anything longer than its limit is cut, and says so in a marker the model and the reader can see."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import pydantic_core
from pydantic_ai.messages import (
    ModelMessage,
    ModelRequest,
    ModelRequestPart,
    ModelResponse,
    ModelResponsePart,
    TextContent,
    TextPart,
    ToolReturnPart,
    UserPromptPart,
)


def truncation_marker(omitted: int) -> str:
    return f"\n[… truncated: {omitted} more characters]"


def truncate_text(text: str, limit: int) -> tuple[str, bool]:
    """`text` cut to at most `limit` characters, marker included, and whether it was cut. Below the
    marker's own length the text is cut bare."""
    if limit < 0:
        raise ValueError("limit must not be negative")
    if len(text) <= limit:
        return text, False
    kept = limit - len(truncation_marker(len(text) - limit))
    # The marker counts what it hides; fewer kept characters can need one digit more.
    while kept > 0 and kept + len(truncation_marker(len(text) - kept)) > limit:
        kept -= 1
    if kept <= 0:
        return text[:limit], True
    return text[:kept] + truncation_marker(len(text) - kept), True


def json_text(value: Any) -> str:
    """A JSON-like value's compact JSON text; what cannot be serialised is written as its `str`."""
    return pydantic_core.to_json(value, serialize_unknown=True, bytes_mode="base64").decode()


def limit_jsonable(value: Any, max_chars: int) -> tuple[Any, bool]:
    """`value` unchanged when its JSON text fits in `max_chars` (a string: its own length), else its
    JSON text truncated to `max_chars` with the marker; and whether it was cut."""
    if isinstance(value, str):
        return truncate_text(value, max_chars)
    text = json_text(value)
    if len(text) <= max_chars:
        return value, False
    return truncate_text(text, max_chars)


def limit_messages(messages: Sequence[ModelMessage], max_chars: int) -> tuple[list[ModelMessage], int]:
    """The messages with the text of every answer, tool result and user prompt cut to `max_chars`,
    and how many parts were cut. Messages and parts within the limit are returned as they are."""
    limited: list[ModelMessage] = []
    cut = 0
    for message in messages:
        parts: list[Any] = []
        cut_here = 0
        for part in message.parts:
            new = _limit_part(part, max_chars)
            if new is not part:
                cut_here += 1
            parts.append(new)
        if cut_here:
            limited.append(_with_parts(message, parts))
            cut += cut_here
        else:
            limited.append(message)
    return limited, cut


def _limit_part(part: ModelRequestPart | ModelResponsePart, max_chars: int) -> Any:
    if isinstance(part, TextPart):
        text, truncated = truncate_text(part.content, max_chars)
        return dataclasses.replace(part, content=text) if truncated else part
    if isinstance(part, ToolReturnPart):
        return _limit_tool_return(part, max_chars)
    if isinstance(part, UserPromptPart):
        return _limit_user_prompt(part, max_chars)
    return part


def _limit_tool_return(part: ToolReturnPart, max_chars: int) -> ToolReturnPart:
    if isinstance(part.content, str):
        text, truncated = truncate_text(part.content, max_chars)
    else:
        # What the model is sent for a structured result; files are not part of it, nor are they cut.
        text, truncated = truncate_text(part.model_response_str(wrap_if_error=False), max_chars)
    return dataclasses.replace(part, content=text) if truncated else part


def _limit_user_prompt(part: UserPromptPart, max_chars: int) -> UserPromptPart:
    if isinstance(part.content, str):
        text, truncated = truncate_text(part.content, max_chars)
        return dataclasses.replace(part, content=text) if truncated else part
    items: list[Any] = []
    any_cut = False
    for item in part.content:
        if isinstance(item, str):
            item, truncated = truncate_text(item, max_chars)
            any_cut |= truncated
        elif isinstance(item, TextContent):
            text, truncated = truncate_text(item.content, max_chars)
            if truncated:
                item = dataclasses.replace(item, content=text)
                any_cut = True
        items.append(item)
    return dataclasses.replace(part, content=items) if any_cut else part


def _with_parts(message: ModelMessage, parts: list[Any]) -> ModelMessage:
    if isinstance(message, ModelRequest):
        return dataclasses.replace(message, parts=parts)
    if isinstance(message, ModelResponse):
        return dataclasses.replace(message, parts=parts)
    raise TypeError(f"not a model message: {type(message).__name__}")
