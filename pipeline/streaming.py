"""What a running model says, as turn events: pydantic-ai stream events in, turn events out.

Pure: the shell (`workers/worker/stream.py`) owns the tasks that write the events and tick the debouncer;
this module decides what to send and when, given the time it is told.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from pydantic_ai.messages import (
    AgentStreamEvent,
    FunctionToolCallEvent,
    FunctionToolResultEvent,
    PartDeltaEvent,
    PartStartEvent,
    TextPart,
    TextPartDelta,
)

from . import events
from .guards import StreamGuard
from .limits import limit_jsonable
from .records import ToolActivity


@dataclass
class TextDebouncer:
    """Buffers text deltas: a flush is due once the oldest buffered text is `window_s` old or the
    buffer holds `max_chars`; any non-text event, the end of the run and a cancel flush it too.
    The run's first text goes out at once: the user waits for the first token, not for the window."""

    window_s: float = 0.075
    max_chars: int = 512
    _buffer: list[str] = field(default_factory=list)
    _size: int = 0
    _since: float | None = None
    _started: bool = False

    def add(self, text: str, now: float) -> str | None:
        """Buffer `text`; return the text to send now (the first text, or when the size cap says so)."""
        if not text:
            return None
        if not self._started:
            self._started = True
            return text
        if self._since is None:
            self._since = now
        self._buffer.append(text)
        self._size += len(text)
        return self.flush() if self._size >= self.max_chars else None

    def due(self, now: float) -> bool:
        return self._since is not None and now - self._since >= self.window_s

    def wait_s(self, now: float) -> float | None:
        """Seconds until the buffered text is due, or None when nothing is buffered."""
        if self._since is None:
            return None
        return max(0.0, self.window_s - (now - self._since))

    def flush(self) -> str | None:
        if not self._buffer:
            return None
        text = "".join(self._buffer)
        self._buffer.clear()
        self._size = 0
        self._since = None
        return text


#: The last text a run streams once it reached the size limit.
TRUNCATED = "\n[… truncated]"


class RunEvents:
    """Translates one run's stream events into turn events, and keeps its tool activity.
    `tool_payload_chars` bounds the text streamed, and the arguments and results carried by events
    and rows. `guard` (the output guard's hold-back) lets out only text that cannot be part of a
    match; after a hit no more text streams (the terminal event carries the guard's reply)."""

    def __init__(self, turn_id: str, attempt: int, debouncer: TextDebouncer, *, tool_payload_chars: int,
                 guard: StreamGuard | None = None) -> None:
        self.turn_id = turn_id
        self.guard = guard
        self.attempt = attempt
        self.tools: dict[str, ToolActivity] = {}
        self.debouncer = debouncer
        self._limit = tool_payload_chars
        #: Text still allowed to stream this attempt: the stored answer is cut at the same size.
        self._room = tool_payload_chars

    def observe(self, event: AgentStreamEvent, now: float) -> list[events.Event]:
        """The turn events `event` makes due now (often none: text waits in the debouncer)."""
        if isinstance(event, PartStartEvent) and isinstance(event.part, TextPart):
            return self._text(event.part.content, now)
        if isinstance(event, PartDeltaEvent) and isinstance(event.delta, TextPartDelta):
            return self._text(event.delta.content_delta, now)
        if isinstance(event, FunctionToolCallEvent):
            part = event.part
            args, _ = limit_jsonable(part.args_as_dict(), self._limit)
            self.tools[part.tool_call_id] = ToolActivity(tool_call_id=part.tool_call_id, name=part.tool_name,
                                                         args=args)
            call = events.ToolCall(turn_id=self.turn_id, attempt=self.attempt, tool_call_id=part.tool_call_id,
                                   name=part.tool_name, args=args)
            return [*self.flush(), call]
        if isinstance(event, FunctionToolResultEvent):
            result = event.part
            content, _ = limit_jsonable(_jsonable(result.content), self._limit)
            before = self.tools.get(result.tool_call_id)
            self.tools[result.tool_call_id] = ToolActivity(
                tool_call_id=result.tool_call_id, name=result.tool_name,
                args=before.args if before else None, content=content, outcome=result.outcome,
            )
            done = events.ToolResult(turn_id=self.turn_id, attempt=self.attempt, tool_call_id=result.tool_call_id,
                                     name=result.tool_name, content=content, outcome=result.outcome)
            return [*self.flush(), done]
        return []

    def flush(self) -> list[events.Event]:
        text = self.debouncer.flush()
        return [self._delta(text)] if text else []

    def end(self, now: float) -> list[events.Event]:
        """The run is over: the text the guard held back (unless it completes a match), then the rest."""
        held = self._stream(self.guard.finish(), now) if self.guard is not None else []
        return [*held, *self.flush()]

    def tick(self, now: float) -> list[events.Event]:
        """Buffered text whose window has passed."""
        return self.flush() if self.debouncer.due(now) else []

    def _text(self, text: str, now: float) -> list[events.Event]:
        return self._stream(self.guard.feed(text) if self.guard is not None else text, now)

    def _stream(self, text: str, now: float) -> list[events.Event]:
        if self._room <= 0 or not text:
            return []
        if len(text) >= self._room:
            text = text[: self._room] + TRUNCATED
        self._room -= len(text)
        ready = self.debouncer.add(text, now)
        return [self._delta(ready)] if ready else []

    def _delta(self, text: str) -> events.TextDelta:
        return events.TextDelta(turn_id=self.turn_id, attempt=self.attempt, text=text)


def _jsonable(value: Any) -> Any:
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        return str(value)
