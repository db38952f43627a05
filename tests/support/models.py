"""Test models and tools that worker processes load by import path (`provider: python`).

They are pydantic-ai `FunctionModel`s: they never reach a network, and they record what they did
to a file the test names, so a test in another process can see how many chunks were produced.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from pydantic_ai.exceptions import ModelHTTPError
from pydantic_ai.messages import (
    ModelMessage,
    ModelRequest,
    ModelResponse,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
    UserPromptPart,
)
from pydantic_ai.models import ModelRequestParameters
from pydantic_ai.models.function import AgentInfo, DeltaToolCall, FunctionModel
from pydantic_ai.settings import ModelSettings
from pydantic_ai.usage import RequestUsage


def _record(options: dict[str, Any], line: dict[str, Any]) -> None:
    path = options.get("record")
    if path:
        with open(path, "a") as handle:
            handle.write(json.dumps({**line, "at": time.time()}) + "\n")


def _last_tool_return(messages: list[ModelMessage]) -> ToolReturnPart | None:
    last = messages[-1]
    if isinstance(last, ModelRequest):
        for part in last.parts:
            if isinstance(part, ToolReturnPart):
                return part
    return None


def streaming(options: dict[str, Any]) -> FunctionModel:
    """Streams `words` words, `delay_ms` apart, recording each chunk it yields and when it stops.
    With `until` (a file path) it stops early, as soon as that file exists: a test holds the stream
    open for as long as it needs, whatever the machine's load."""
    words = int(options.get("words", 50))
    delay = float(options.get("delay_ms", 20)) / 1000
    until = options.get("until")

    async def stream(messages: list[ModelMessage], info: AgentInfo) -> AsyncIterator[str]:
        _record(options, {"event": "request"})
        try:
            for i in range(words):
                if i and until and Path(until).exists():  # a word at least: a stream of none fails
                    break
                chunk = f"w{i} "
                _record(options, {"event": "chunk", "text": chunk})
                yield chunk
                await asyncio.sleep(delay)
        finally:
            _record(options, {"event": "closed"})

    return FunctionModel(stream_function=stream, model_name="test:streaming")


def _last_user_text(messages: list[ModelMessage]) -> str:
    for message in reversed(messages):
        if isinstance(message, ModelRequest):
            for part in message.parts:
                if isinstance(part, UserPromptPart) and isinstance(part.content, str):
                    return part.content
    return ""


def tool_then_answer(options: dict[str, Any]) -> FunctionModel:
    """Calls `tool` (with `args`) and answers with what it returned; only when the user's last
    prompt mentions "tool" if `only_when_asked` is set, else it just answers in text."""
    tool = options.get("tool", "clock")
    args = options.get("args", {})
    before = options.get("say_before", "")
    only_when_asked = bool(options.get("only_when_asked", False))

    async def stream(messages: list[ModelMessage], info: AgentInfo) -> AsyncIterator[Any]:
        _record(options, {"event": "request", "messages": len(messages)})
        result = _last_tool_return(messages)
        if only_when_asked and result is None and "tool" not in _last_user_text(messages):
            yield f"A plain answer to: {_last_user_text(messages)}"
            return
        if result is None:
            if before:
                yield before
            yield {0: DeltaToolCall(name=tool, json_args=json.dumps(args))}
            return
        yield f"The tool said: {result.model_response_str()}"

    return FunctionModel(stream_function=stream, model_name="test:tool")


class CountingFunctionModel(FunctionModel):
    """A `FunctionModel` with a count endpoint of its own (`model.tokenizer: provider` on a `python:`
    factory): 3 tokens per request and per message, plus ⌈characters ÷ 4⌉ of every text part."""

    async def count_tokens(self, messages: list[ModelMessage], model_settings: ModelSettings | None,
                           model_request_parameters: ModelRequestParameters) -> RequestUsage:
        texts = [p.content for m in messages for p in m.parts if isinstance(getattr(p, "content", None), str)]
        return RequestUsage(input_tokens=3 + 3 * len(messages) + sum((len(t) + 3) // 4 for t in texts))


def counting_tool_then_answer(options: dict[str, Any]) -> FunctionModel:
    """`tool_then_answer` that counts its own tokens (`CountingFunctionModel`)."""
    return CountingFunctionModel(stream_function=tool_then_answer(options).stream_function, model_name="test:tool")


def ask_then_answer(options: dict[str, Any]) -> FunctionModel:
    """Asks the human a question (`ask_human`), then answers with the reply."""
    question = options.get("question", "What is your favourite colour?")

    def respond(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        result = _last_tool_return(messages)
        if result is None:
            return ModelResponse(parts=[ToolCallPart("ask_human", {"question": question})])
        return ModelResponse(parts=[TextPart(f"You answered: {result.model_response_str()}")])

    async def stream(messages: list[ModelMessage], info: AgentInfo) -> AsyncIterator[Any]:
        response = respond(messages, info)
        part = response.parts[0]
        if isinstance(part, ToolCallPart):
            yield {0: DeltaToolCall(name=part.tool_name, json_args=part.args_as_json_str())}
        else:
            assert isinstance(part, TextPart)
            yield part.content

    return FunctionModel(respond, stream_function=stream, model_name="test:ask")


def failing(options: dict[str, Any]) -> FunctionModel:
    """Fails with HTTP `status` the first `times` requests (every request by default), recording each."""
    status = int(options.get("status", 500))
    times = int(options.get("times", 1_000_000))

    async def stream(messages: list[ModelMessage], info: AgentInfo) -> AsyncIterator[str]:
        path = options.get("record")
        seen = len(Path(path).read_text().splitlines()) if path and Path(path).exists() else 0
        _record(options, {"event": "request"})
        if seen < times:
            raise ModelHTTPError(status_code=status, model_name="test:failing", body={"error": "boom"})
        yield "recovered after failures"

    return FunctionModel(stream_function=stream, model_name="test:failing")


def broken(options: dict[str, Any]) -> FunctionModel:
    """A factory with a bug: building the model raises a plain `RuntimeError` (not a Threadline
    error), every time, so the model stage fails on every delivery of its message."""
    _record(options, {"event": "build"})
    raise RuntimeError("bug in the model factory")


async def slow_tool(seconds: float = 30.0) -> str:
    """A tool that takes its time (tests cancel during it)."""
    await asyncio.sleep(seconds)
    return f"slept {seconds}s"


async def long_text(chars: int = 1000) -> str:
    """A tool whose result is as long as asked (tests of the stored size limit)."""
    return "".join(str(i % 10) for i in range(chars))


def timed(options: dict[str, Any]) -> FunctionModel:
    """Answers after `ms` milliseconds, recording when each request starts and ends (`record`), so a
    test in another process sees which model calls were in flight at once."""
    delay = float(options.get("ms", 300)) / 1000

    async def stream(messages: list[ModelMessage], info: AgentInfo) -> AsyncIterator[str]:
        _record(options, {"event": "start"})
        try:
            await asyncio.sleep(delay)
            yield "done"
        finally:
            _record(options, {"event": "end"})

    return FunctionModel(stream_function=stream, model_name="test:timed")


def says(options: dict[str, Any]) -> FunctionModel:
    """Says `text`, streamed `chunk` characters at a time, recording each request and the texts of
    the messages it received (tests of what a guard keeps from the stream and from later history)."""
    text = str(options.get("text", "Hello."))
    size = max(1, int(options.get("chunk", 3)))

    async def stream(messages: list[ModelMessage], info: AgentInfo) -> AsyncIterator[str]:
        seen = [p.content for m in messages for p in m.parts
                if isinstance(p, UserPromptPart | TextPart) and isinstance(p.content, str)]
        _record(options, {"event": "request", "seen": seen})
        for i in range(0, len(text), size):
            yield text[i : i + size]

    return FunctionModel(stream_function=stream, model_name="test:says")


def keeps_the_process(options: dict[str, Any]) -> FunctionModel:
    """Answers, and leaves behind a thread that is not a daemon and never ends: the process that ran
    it cannot exit (interpreter shutdown waits for that thread), as a worker wedged in its stop
    would be. Tests of the supervisor's kill after the grace use it."""

    def wait_forever() -> None:
        threading.Event().wait()

    async def stream(messages: list[ModelMessage], info: AgentInfo) -> AsyncIterator[str]:
        threading.Thread(target=wait_forever, name="keeps-the-process", daemon=False).start()
        yield "answered"

    return FunctionModel(stream_function=stream, model_name="test:keeps-the-process")
