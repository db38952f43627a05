"""Stage 4, invoke: one pydantic-ai run of the turn, streamed to an event sink, ending in an outcome.

The shell passes in the agent, the cancellation token, a clock and a sink for events; this module
never touches Redis. Whatever happens to the run (success, model error, cancel, deadline, pause),
it returns an `InvokeOutcome` holding the run's new messages for `persist`.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterable, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, cast

from pydantic import BaseModel, ConfigDict, Field
from pydantic_ai import (
    Agent,
    CallDeferred,
    CancellationToken,
    DeferredToolRequests,
    DeferredToolResults,
    RunCancelled,
    RunContext,
    Tool,
    capture_run_messages,
)
from pydantic_ai.exceptions import (
    AgentRunError,
    ModelAPIError,
    ModelConnectionError,
    ModelContextWindowExceededError,
    ModelRateLimitError,
    ModelRequestRejectedError,
    ModelServerError,
    ModelUnavailableError,
    RunTimedOut,
    UserError,
)
from pydantic_ai.messages import (
    AgentStreamEvent,
    FunctionToolCallEvent,
    FunctionToolResultEvent,
    ImageUrl,
    ModelMessage,
    PartDeltaEvent,
    PartStartEvent,
    TextPart,
    TextPartDelta,
    ToolCallPart,
    UserContent,
)
from pydantic_ai.models import Model
from pydantic_ai.settings import ModelSettings

from . import events
from .contracts import TerminalType, Usage
from .errors import ErrorCode, InvalidRequest, ThreadlineError
from .history import encode_messages
from .models import import_object
from .persist import prepare_snapshot, run_answer, run_usage
from .records import ResolvedTurn, ToolActivity

Sink = Callable[[events.Event], Awaitable[None]]


class InvokeOutcome(BaseModel):
    """How the run ended; `snapshot` is the run's new messages, ready to store (None: keep the old)."""

    model_config = ConfigDict(frozen=True)

    status: TerminalType
    answer: str = ""
    usage: Usage = Field(default_factory=Usage)
    code: ErrorCode | None = None
    message: str | None = None
    transient: bool = False
    retry_after_s: float | None = None
    pending_tool_calls: list[dict[str, Any]] = Field(default_factory=list)
    tools: list[ToolActivity] = Field(default_factory=list)
    snapshot: str | None = None


# --- streaming ------------------------------------------------------------------------------------


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


class TurnStream:
    """Turns pydantic-ai run events into turn events. Writing happens in a task of its own, so that
    cancelling the run can never cut an event in half: what was streamed is what was stored."""

    def __init__(
        self, turn_id: str, attempt: int, sink: Sink, clock: Callable[[], float], debouncer: TextDebouncer
    ) -> None:
        self.turn_id = turn_id
        self.attempt = attempt
        self.streamed_text: list[str] = []
        self.tools: dict[str, ToolActivity] = {}
        self._sink = sink
        self._clock = clock
        self._debouncer = debouncer
        self._queue: asyncio.Queue[events.Event | None] = asyncio.Queue()
        self._wake = asyncio.Event()
        self._writer: asyncio.Task[None] | None = None
        self._ticker: asyncio.Task[None] | None = None

    async def __aenter__(self) -> TurnStream:
        self._writer = asyncio.create_task(self._write())
        self._ticker = asyncio.create_task(self._tick())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._writer is not None and self._ticker is not None
        self._ticker.cancel()
        self.flush_text()
        self._queue.put_nowait(None)
        await asyncio.shield(self._writer)

    async def handle(self, ctx: RunContext[TurnDeps], stream: AsyncIterable[AgentStreamEvent]) -> None:
        async for event in stream:
            self.observe(event)

    def observe(self, event: AgentStreamEvent) -> None:
        if isinstance(event, PartStartEvent) and isinstance(event.part, TextPart):
            self._text(event.part.content)
        elif isinstance(event, PartDeltaEvent) and isinstance(event.delta, TextPartDelta):
            self._text(event.delta.content_delta)
        elif isinstance(event, FunctionToolCallEvent):
            self.flush_text()
            part = event.part
            self.tools[part.tool_call_id] = ToolActivity(
                tool_call_id=part.tool_call_id, name=part.tool_name, args=part.args_as_dict()
            )
            self._put(events.tool_call(self.turn_id, self.attempt, tool_call_id=part.tool_call_id,
                                       name=part.tool_name, args=part.args_as_dict()))
        elif isinstance(event, FunctionToolResultEvent):
            self.flush_text()
            result = event.part
            content = _jsonable(result.content)
            call = self.tools.get(result.tool_call_id)
            self.tools[result.tool_call_id] = ToolActivity(
                tool_call_id=result.tool_call_id, name=result.tool_name,
                args=call.args if call else None, content=content, outcome=result.outcome,
            )
            self._put(events.tool_result(self.turn_id, self.attempt, tool_call_id=result.tool_call_id,
                                         name=result.tool_name, content=content, outcome=result.outcome))

    def flush_text(self) -> None:
        text = self._debouncer.flush()
        if text:
            self._put(events.text_delta(self.turn_id, self.attempt, text))

    def _text(self, text: str) -> None:
        if not text:
            return
        self.streamed_text.append(text)
        ready = self._debouncer.add(text, self._clock())
        if ready:
            self._put(events.text_delta(self.turn_id, self.attempt, ready))
        self._wake.set()

    def _put(self, event: events.Event) -> None:
        self._queue.put_nowait(event)

    async def _tick(self) -> None:
        while True:
            wait = self._debouncer.wait_s(self._clock())
            if wait is None:
                self._wake.clear()
                await self._wake.wait()
                continue
            await asyncio.sleep(wait)
            if self._debouncer.due(self._clock()):
                self.flush_text()

    async def _write(self) -> None:
        while (event := await self._queue.get()) is not None:
            await self._sink(event)


def _jsonable(value: Any) -> Any:
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        return str(value)


# --- the run --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TurnDeps:
    now: Callable[[], float]


def clock(ctx: RunContext[TurnDeps]) -> str:
    """The current date and time (UTC, ISO 8601)."""
    return datetime.fromtimestamp(ctx.deps.now(), UTC).isoformat(timespec="seconds")


def ask_human(question: str) -> str:
    """Ask the user a question and wait for the answer; the turn pauses until it arrives."""
    raise CallDeferred(kind="question")


_BUILTIN_TOOLS: dict[str, Tool[TurnDeps]] = {
    "clock": Tool(clock, takes_ctx=True),
    "ask_human": Tool(ask_human, takes_ctx=False),
}


def build_tools(names: Sequence[str], *, allow_python: bool) -> list[Tool[TurnDeps]]:
    """The tools a config names: built-ins, or `python:module:function` where workers allow plugins."""
    tools: list[Tool[TurnDeps]] = []
    for name in names:
        if name in _BUILTIN_TOOLS:
            tools.append(_BUILTIN_TOOLS[name])
        elif allow_python:
            tools.append(Tool(import_object(name.removeprefix("python:"))))
        else:
            raise InvalidRequest(f"tool {name!r}: python plugins are disabled on these workers")
    return tools


def user_prompt(turn: ResolvedTurn, *, vision: bool) -> str | list[UserContent] | None:
    """The current query with its files: images natively for vision models, else as text lines."""
    if turn.deferred_answers is not None:
        return None
    if not turn.files:
        return turn.query
    content: list[UserContent] = [turn.query]
    for f in turn.files:
        if vision and f.type == "image":
            content.append(ImageUrl(url=f.url))
        else:
            content.append(f"[attached {f.type}{' ' + f.mime if f.mime else ''}: {f.url}]")
    return content


def run_instructions(turn: ResolvedTurn) -> str | None:
    parts = [turn.instructions.strip()]
    if turn.context and turn.context.strip():
        parts.append(f"Context:\n{turn.context.strip()}")
    text = "\n\n".join(p for p in parts if p)
    return text or None


TurnAgent = Agent[TurnDeps, str | DeferredToolRequests]


def build_agent(model: Model, tools: Sequence[Tool[TurnDeps]] = ()) -> TurnAgent:
    """The agent a config runs: stateless between runs, so the shell builds it once and reuses it."""
    return Agent(model, output_type=[str, DeferredToolRequests], deps_type=TurnDeps, tools=list(tools))


async def run_turn(
    turn: ResolvedTurn,
    history: Sequence[ModelMessage],
    *,
    agent: TurnAgent,
    attempt: int,
    sink: Sink,
    token: CancellationToken,
    clock: Callable[[], float],
    timeout_s: float,
    debounce_s: float = 0.075,
) -> InvokeOutcome:
    """Run the agent once; every way it can end becomes an `InvokeOutcome`."""
    run_id = f"{turn.turn_id}/{attempt}"
    deferred = DeferredToolResults(calls=dict(turn.deferred_answers)) if turn.deferred_answers else None
    stream = TurnStream(turn.turn_id, attempt, sink, clock, TextDebouncer(window_s=debounce_s))
    async with stream:
        with capture_run_messages() as captured:
            try:
                result = await agent.run(
                    user_prompt(turn, vision=turn.config.model.vision),
                    message_history=list(history) or None,
                    deferred_tool_results=deferred,
                    instructions=run_instructions(turn),
                    model_settings=cast(ModelSettings, turn.config.settings),
                    deps=TurnDeps(now=clock),
                    cancellation_token=token,
                    timeout=max(timeout_s, 0.001),
                    run_id=run_id,
                    conversation_id=turn.conversation_id,
                    event_stream_handler=stream.handle,
                )
                output: str | DeferredToolRequests | None = result.output
                failure: BaseException | None = None
            except Exception as e:  # a broken tool too: the turn ends `failed`, its history kept
                output, failure = None, e
        new = [m for m in captured if m.run_id == run_id]
    return _outcome(output, failure, new, stream)


def _outcome(
    output: str | DeferredToolRequests | None,
    failure: BaseException | None,
    new: list[ModelMessage],
    stream: TurnStream,
) -> InvokeOutcome:
    status, code, message, transient, retry_after = _classify(output, failure)
    snapshot = prepare_snapshot(new, paused=status == "paused")
    pending = _pending_calls(output) if isinstance(output, DeferredToolRequests) else []
    if isinstance(output, str):
        answer = output
    elif pending:
        answer = "\n".join(str(call["args"].get("question", "")) for call in pending).strip()
    else:
        answer = run_answer(new)
    return InvokeOutcome(
        status=status,
        answer=answer,
        usage=run_usage(new),
        code=code,
        message=message,
        transient=transient,
        retry_after_s=retry_after,
        pending_tool_calls=pending,
        tools=list(stream.tools.values()),
        snapshot=encode_messages(snapshot).decode() if snapshot is not None else None,
    )


def _pending_calls(output: DeferredToolRequests) -> list[dict[str, Any]]:
    calls: list[ToolCallPart] = [*output.calls, *output.approvals]
    return [{"tool_call_id": c.tool_call_id, "name": c.tool_name, "args": c.args_as_dict()} for c in calls]


Classified = tuple[TerminalType, ErrorCode | None, str | None, bool, float | None]


def _classify(output: object, failure: BaseException | None) -> Classified:
    if failure is None:
        return ("paused" if isinstance(output, DeferredToolRequests) else "succeeded"), None, None, False, None
    if isinstance(failure, RunTimedOut):
        return "timed_out", "timed_out", "the turn's deadline passed", False, None
    if isinstance(failure, RunCancelled):
        return "cancelled", "cancelled", "the turn was cancelled", False, None
    code, transient = model_error_code(failure)
    retry_after = failure.retry_after if isinstance(failure, ModelAPIError) else None
    return "failed", code, _safe_message(failure), transient, retry_after


def retry_delay_s(outcome: InvokeOutcome, *, attempt: int, max_attempts: int) -> float | None:
    """Seconds before the next attempt of a transiently failed run (bounded exponential backoff,
    or what the provider asked for), or None: the outcome is final."""
    if outcome.status != "failed" or not outcome.transient or attempt >= max_attempts:
        return None
    backoff = min(0.5 * 2 ** (attempt - 1), 10.0)
    # a provider's Retry-After is honoured up to 30 s: a turn is not left waiting longer
    return min(outcome.retry_after_s, 30.0) if outcome.retry_after_s else backoff


def model_error_code(error: BaseException) -> tuple[ErrorCode, bool]:
    """A stable code for a model failure, and whether trying again may help."""
    if isinstance(error, ThreadlineError):
        return error.code, error.transient
    if isinstance(error, ModelRateLimitError):
        return "model_rate_limited", True
    if isinstance(error, ModelUnavailableError | ModelServerError | ModelConnectionError):
        return "model_unavailable", True
    if isinstance(error, ModelContextWindowExceededError):
        return "context_too_large", False
    if isinstance(error, ModelRequestRejectedError):
        return "model_bad_request", False
    status = getattr(error, "status_code", None)
    if isinstance(status, int):
        if status == 429:
            return "model_rate_limited", True
        if status >= 500 or status == 408:
            return "model_unavailable", True
        if status >= 400:
            return "model_bad_request", False
    return ("model_error" if isinstance(error, AgentRunError | UserError) else "internal_error"), False


def _safe_message(error: BaseException) -> str:
    """A short description that never carries request headers or keys."""
    text = str(error).splitlines()[0] if str(error) else type(error).__name__
    return text[:300]

