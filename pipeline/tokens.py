"""Token counts for the memory budget: the text each message part puts before the model, counted with
the model's own tokenizer.

Pure: the tokenizer is loaded in the shell (`workers/worker/tokenizers.py`) and passed in. Characters ÷ 4
(`CharsTokenizer`) is only the labelled fallback, named `chars/4` wherever a count is recorded.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from pydantic_ai.messages import (
    BaseToolCallPart,
    BaseToolReturnPart,
    CompactionPart,
    ModelMessage,
    ModelRequest,
    ModelRequestPart,
    ModelResponse,
    RetryFeedbackPart,
    RetryPromptPart,
    SpeechPart,
    SystemPromptPart,
    TextContent,
    TextPart,
    ThinkingPart,
    UserPromptPart,
)
from pydantic_ai.tools import ToolDefinition
from pydantic_core import to_json

#: What a chat template adds around each message (role markers, separators): OpenAI's cookbook counts
#: 3 or 4 per message; 4 keeps the estimate on the safe side.
MESSAGE_OVERHEAD_TOKENS = 4


class Tokenizer(Protocol):
    """Counts the tokens of a text the way one model family does; `name` says which, for the record."""

    @property
    def name(self) -> str: ...

    def count(self, text: str) -> int: ...


@dataclass(frozen=True, slots=True)
class CharsTokenizer:
    """The labelled fallback: ⌈characters ÷ 4⌉, for a model whose tokenizer is not known. Right within
    a factor of about two for English prose, wrong for code, CJK text and emoji."""

    name: str = "chars/4"

    def count(self, text: str) -> int:
        return (len(text) + 3) // 4


def count_message(message: ModelMessage, tokenizer: Tokenizer) -> int:
    """The tokens of the texts of `message`'s parts, plus `MESSAGE_OVERHEAD_TOKENS`.

    Files, images and audio are not text and count nothing here, and neither does a request's
    `instructions` (the run instructions are sent once per request, not once per message: count them
    where the request is assembled).
    """
    count = tokenizer.count
    return MESSAGE_OVERHEAD_TOKENS + sum(count(text) for text in _part_texts(message) if text)


def count_messages(messages: Iterable[ModelMessage], tokenizer: Tokenizer) -> int:
    """The tokens of every message, overhead included."""
    return sum(count_message(message, tokenizer) for message in messages)


def count_tool_definitions(definitions: Sequence[ToolDefinition], tokenizer: Tokenizer) -> int:
    """The tokens of the tool definitions sent with each request, as the JSON of their name,
    description and parameter schema (providers wrap them a little differently; this is close)."""
    return tokenizer.count(tool_definitions_json(definitions)) if definitions else 0


def tool_definitions_json(definitions: Sequence[ToolDefinition]) -> str:
    """The tool definitions as they are counted: the JSON of their name, description and schema."""
    described = [
        {"name": d.name, "description": d.description, "parameters_json_schema": d.parameters_json_schema}
        for d in definitions
    ]
    return to_json(described).decode()


def as_text_exchange(messages: Sequence[ModelMessage]) -> list[ModelMessage]:
    """`messages` as plain text the way they are counted here (each message's part texts, one per
    line): a user turn and an assistant turn in alternation, same-role neighbours merged, empty ones
    left out, starting with the user. A provider's count endpoint counts this form: it never carries
    a tool call without its definitions or a file to fetch, and it always starts as a request must."""
    out: list[ModelMessage] = []
    for message in messages:
        text = "\n".join(t for t in _part_texts(message) if t)
        if not text:
            continue
        request = isinstance(message, ModelRequest)
        if out and isinstance(out[-1], ModelRequest) == request:
            text = f"{_text_of(out.pop())}\n{text}"
        elif not out and not request:
            out.append(ModelRequest(parts=[UserPromptPart(".")]))
        out.append(ModelRequest(parts=[UserPromptPart(text)]) if request else ModelResponse(parts=[TextPart(text)]))
    return out


def _text_of(message: ModelMessage) -> str:
    part = message.parts[0]
    return part.content if isinstance(part, UserPromptPart | TextPart) and isinstance(part.content, str) else ""


def _part_texts(message: ModelMessage) -> Iterator[str]:
    if isinstance(message, ModelRequest):
        for request_part in message.parts:
            yield from _request_part_texts(request_part)
        return
    for part in message.parts:
        if isinstance(part, TextPart | ThinkingPart):
            yield part.content
        elif isinstance(part, BaseToolCallPart):
            yield part.tool_name
            yield part.args_as_json_str()
        elif isinstance(part, BaseToolReturnPart):
            yield part.model_response_str()
        elif isinstance(part, CompactionPart | SpeechPart):
            yield part.content or ""


def _request_part_texts(part: ModelRequestPart) -> Iterator[str]:
    if isinstance(part, SystemPromptPart):
        yield part.content
    elif isinstance(part, UserPromptPart):
        if isinstance(part.content, str):
            yield part.content
        else:
            for item in part.content:
                if isinstance(item, str):
                    yield item
                elif isinstance(item, TextContent):
                    yield item.content
    elif isinstance(part, BaseToolReturnPart):
        yield part.model_response_str()
    elif isinstance(part, RetryFeedbackPart | RetryPromptPart):
        yield part.model_response()
    elif isinstance(part, CompactionPart | SpeechPart):
        yield part.content or ""
