"""Stage 3, map: normalise a message list so that strict chat templates accept it.

Strict templates (Qwen 3.5/3.6 on vLLM, several Ollama/llama.cpp builds) reject any system message
that is not the first one, and blank system messages. The invariant we keep on every request:

- exactly one system message, first, when there is any system content: the system parts of the
  history in their order (stored system prompts and any found later), then the run instructions,
  merged with "\\n\\n"; none at all when there is no system content;
- whitespace-only system parts are dropped;
- user/assistant/tool messages keep their order; empty assistant messages are dropped;
- every tool result follows its call, orphan results are dropped, and calls left without results
  are closed the way pydantic-ai repairs interrupted calls (`repair_messages`);
- tool definitions carry a string description.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from pydantic_ai.messages import (
    ModelMessage,
    ModelRequest,
    ModelResponse,
    SystemPromptPart,
    TextPart,
    repair_messages,
)
from pydantic_ai.tools import ToolDefinition

SYSTEM_SEPARATOR = "\n\n"


@dataclass(frozen=True, slots=True)
class MapDecision:
    """What normalisation changed, for the log line."""

    system_parts_merged: int
    blank_system_parts_dropped: int
    empty_responses_dropped: int
    messages_in: int
    messages_out: int


def normalise_messages(
    messages: Sequence[ModelMessage],
    *,
    instructions: Sequence[str] = (),
    repair_last_response: bool = True,
) -> tuple[list[ModelMessage], MapDecision]:
    """Apply the invariant above; `instructions` are the run-level system texts, merged in after
    the history's own system parts."""
    cleaned, dropped_responses = _drop_blank_responses(messages)
    repaired = repair_messages(cleaned, repair_last_response=repair_last_response)
    history_texts, blank = _collect_system_text(repaired)
    system_texts = [*history_texts, *(t for t in instructions if t.strip())]
    blank += sum(1 for t in instructions if not t.strip())
    body: list[ModelMessage] = []
    for message in repaired:
        if isinstance(message, ModelResponse):
            body.append(message)
            continue
        parts = [p for p in message.parts if not isinstance(p, SystemPromptPart)]
        if parts:
            body.append(replace(message, parts=parts, instructions=None))
    if len(body) != len(repaired):
        # A request that held only system parts is gone: its neighbours may merge now, and must,
        # or normalising twice would differ from normalising once (and two responses would meet).
        body = repair_messages(body, repair_last_response=repair_last_response)
    if system_texts:
        body = _with_leading_system(body, SYSTEM_SEPARATOR.join(system_texts))
    decision = MapDecision(
        system_parts_merged=len(system_texts),
        blank_system_parts_dropped=blank,
        empty_responses_dropped=dropped_responses,
        messages_in=len(messages),
        messages_out=len(body),
    )
    return body, decision


def normalise_tool_definitions(tools: Sequence[ToolDefinition]) -> list[ToolDefinition]:
    """Providers that require a string description get `""` instead of `None`."""
    return [t if t.description is not None else replace(t, description="") for t in tools]


def system_text(messages: Sequence[ModelMessage]) -> str | None:
    """The merged system text a normalised history carries, or None."""
    texts = [
        part.content
        for message in messages
        if isinstance(message, ModelRequest)
        for part in message.parts
        if isinstance(part, SystemPromptPart)
    ]
    return SYSTEM_SEPARATOR.join(texts) if texts else None


def _collect_system_text(messages: Sequence[ModelMessage]) -> tuple[list[str], int]:
    """The history's non-blank system texts in order, and how many blank ones there were."""
    texts: list[str] = []
    blank = 0
    for message in messages:
        if isinstance(message, ModelRequest):
            for part in message.parts:
                if isinstance(part, SystemPromptPart):
                    if part.content.strip():
                        texts.append(part.content)
                    else:
                        blank += 1
    return texts, blank


def _drop_blank_responses(messages: Sequence[ModelMessage]) -> tuple[list[ModelMessage], int]:
    """Drop whitespace-only text from responses, and responses left with nothing."""
    kept: list[ModelMessage] = []
    dropped = 0
    for message in messages:
        if isinstance(message, ModelResponse):
            parts = [p for p in message.parts if not (isinstance(p, TextPart) and not p.content.strip())]
            if not parts:
                dropped += 1
                continue
            if len(parts) != len(message.parts):
                message = replace(message, parts=parts)
        kept.append(message)
    return kept, dropped


def _with_leading_system(body: list[ModelMessage], text: str) -> list[ModelMessage]:
    system = SystemPromptPart(text)
    if body and isinstance(body[0], ModelRequest):
        first = body[0]
        return [replace(first, parts=[system, *first.parts]), *body[1:]]
    return [ModelRequest(parts=[system]), *body]
