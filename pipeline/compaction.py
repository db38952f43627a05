"""Compaction: the turns that fell out of a turn's window, summarised into one running summary that
later turns carry as context. It runs after the turn ended, off the critical path; a summary covers
the thread from the root to its watermark (the newest turn it summarises), so every branch below
that turn reuses it, and the next summary starts from it (incremental)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pydantic_ai.messages import ModelMessage

from .history import summary_messages
from .mapping import normalise_messages

SUMMARISE_PROMPT = (
    "Summarise the conversation above in a few sentences for whoever continues it: keep names, facts, "
    "decisions and open questions; say nothing else."
)


def window_start(decision: Mapping[str, Any] | None) -> str | None:
    """The oldest turn a turn's request kept (from its history decision record), or None."""
    window = (decision or {}).get("window") or {}
    start = window.get("start")
    return start if isinstance(start, str) else None


def summariser_history(previous: str | None, turns: Sequence[Sequence[ModelMessage]]) -> list[ModelMessage]:
    """What the summariser reads: the previous summary (when there is one), then the turns it has not
    covered yet, oldest first, normalised so that every tool call has its result."""
    messages: list[ModelMessage] = summary_messages(previous) if previous else []
    for turn in turns:
        messages.extend(turn)
    normalised, _ = normalise_messages(messages)
    return normalised


def summary_record(text: str, *, watermark: str, turns: int, summariser: str, since: str | None) -> dict[str, Any]:
    return {"text": text.strip(), "watermark": watermark, "turns": turns, "summariser": summariser, "since": since}
