"""Compaction: the turns that fell out of a turn's window, summarised into one running summary that
later turns carry as context. It runs after the turn ended, off the critical path; a summary covers
the thread from the root to its watermark (the newest turn it summarises), so every branch below
that turn reuses it, and the next summary starts from it (incremental).

Before summarising, it clears old tool results: when a turn's window was cut (the prefix the provider
cached changes then anyway), the results of the tool calls in every turn of the thread older than
the newest `KEEP_TOOL_RESULTS_TURNS` are replaced by a short marker. The calls stay, each with its
result message, so the history stays valid for strict servers; the turns cost less, so more whole
turns fit before the next cut, and the summariser reads less."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic_ai.messages import ModelMessage, ModelRequest, ModelRequestPart, ToolReturnPart

from .history import decode_messages, summary_messages
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


#: The newest turns of a thread (the turn that just ended included) whose tool results are kept as
#: they are: the model may still work with them.
KEEP_TOOL_RESULTS_TURNS = 2
#: Only a cut window clears (see the module docstring): these are the history stage's reasons for one.
CUT_REASONS = frozenset({"pruned_to_low_water", "nothing_fits"})
_CLEARED = "[tool result cleared: "


def cleared_marker(chars: int) -> str:
    """What a cleared tool result says instead of its content."""
    return f"{_CLEARED}{chars:,} chars]"


def clearing_due(decision: Mapping[str, Any] | None) -> bool:
    """Whether the turn whose history decision this is cut its window (and so may clear)."""
    window = (decision or {}).get("window") or {}
    return window.get("reason") in CUT_REASONS


def turns_to_clear(thread: Sequence[str]) -> list[str]:
    """The turns of `thread` (oldest first, ending with the turn that just ended) whose tool results
    are old: all but the newest `KEEP_TOOL_RESULTS_TURNS`."""
    return list(thread[:-KEEP_TOOL_RESULTS_TURNS])


@dataclass(frozen=True, slots=True)
class Cleared:
    """One turn's messages with its old tool results cleared, and what that cleared."""

    messages: list[ModelMessage]
    results: int
    chars: int


def clear_tool_results(messages: Sequence[ModelMessage]) -> Cleared:
    """`messages` with the content of every tool result replaced by `cleared_marker` (the call and its
    id, name, outcome and time stay). A result already cleared, or shorter than its marker, stays."""
    out: list[ModelMessage] = []
    results = chars = 0
    for message in messages:
        if not isinstance(message, ModelRequest):
            out.append(message)
            continue
        parts: list[ModelRequestPart] = []
        before = results
        for part in message.parts:
            text = part.model_response_str() if isinstance(part, ToolReturnPart) else None
            if isinstance(part, ToolReturnPart) and text is not None and _clearable(text):
                parts.append(ToolReturnPart(part.tool_name, cleared_marker(len(text)), part.tool_call_id,
                                            timestamp=part.timestamp, outcome=part.outcome))
                results, chars = results + 1, chars + len(text)
            else:
                parts.append(part)
        out.append(dataclasses.replace(message, parts=parts) if results > before else message)
    return Cleared(out, results, chars)


def _clearable(text: str) -> bool:
    return not text.startswith(_CLEARED) and len(text) > len(cleared_marker(len(text)))


def clear_snapshots(snapshots: Mapping[str, bytes]) -> dict[str, Cleared]:
    """The stored turns (`message id -> snapshot`) that have tool results to clear, cleared."""
    cleared = {mid: clear_tool_results(decode_messages(data, where=f"message {mid}"))
               for mid, data in snapshots.items()}
    return {mid: c for mid, c in cleared.items() if c.results}
