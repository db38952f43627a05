"""The running model's events on their way to the turn's stream.

`pipeline.streaming.RunEvents` decides what to send; here one task writes the events in order and
another flushes debounced text when its window passes. Writing happens in a task of its own, so
cancelling the run can never cut an event in half: what was streamed is what was stored.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, Awaitable, Callable, Mapping

from pydantic_ai import RunContext
from pydantic_ai.messages import AgentStreamEvent

from threadline.pipeline import events
from threadline.pipeline.invoke import TurnDeps
from threadline.pipeline.records import ToolActivity
from threadline.pipeline.streaming import RunEvents

Sink = Callable[[events.Event], Awaitable[None]]


class TurnStream:
    def __init__(self, translator: RunEvents, sink: Sink, clock: Callable[[], float]) -> None:
        self._events = translator
        self._sink = sink
        self._clock = clock
        self._queue: asyncio.Queue[events.Event | None] = asyncio.Queue()
        self._wake = asyncio.Event()
        self._writer: asyncio.Task[None] | None = None
        self._ticker: asyncio.Task[None] | None = None

    @property
    def tools(self) -> Mapping[str, ToolActivity]:
        return self._events.tools

    async def __aenter__(self) -> TurnStream:
        self._writer = asyncio.create_task(self._write())
        self._ticker = asyncio.create_task(self._tick())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._writer is not None and self._ticker is not None
        self._ticker.cancel()
        self._put(self._events.end(self._clock()))
        self._queue.put_nowait(None)
        await asyncio.shield(self._writer)

    async def handle(self, ctx: RunContext[TurnDeps], stream: AsyncIterable[AgentStreamEvent]) -> None:
        async for event in stream:
            self._put(self._events.observe(event, self._clock()))
            self._wake.set()

    def _put(self, due: list[events.Event]) -> None:
        for event in due:
            self._queue.put_nowait(event)

    async def _tick(self) -> None:
        debouncer = self._events.debouncer
        while True:
            wait = debouncer.wait_s(self._clock())
            if wait is None:
                self._wake.clear()
                await self._wake.wait()
                continue
            await asyncio.sleep(wait)
            self._put(self._events.tick(self._clock()))

    async def _write(self) -> None:
        while (event := await self._queue.get()) is not None:
            await self._sink(event)
