"""Test models whose calls wait for one another (`provider: python`, loaded by import path in the
worker processes): a test that needs model calls in flight at once gets them whatever the
machine's load, instead of hoping that calls a few hundred ms long happen to overlap."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from pydantic_ai.messages import ModelMessage
from pydantic_ai.models.function import AgentInfo, FunctionModel


def _record(path: Path, event: str) -> None:
    with open(path, "a") as handle:
        handle.write(json.dumps({"event": event, "at": time.time()}) + "\n")


def _starts(path: Path) -> int:
    return sum('"start"' in line for line in path.read_text().splitlines()) if path.exists() else 0


def meeting(options: dict[str, Any]) -> FunctionModel:
    """Records when each call starts and ends (`record`, as `tests.support.models:timed` does), and
    answers only once `calls` calls have started (or `max_wait_ms` passed): with no limit in the
    way, those calls are in flight together."""
    record = Path(options["record"])
    calls = int(options.get("calls", 2))
    max_wait_s = float(options.get("max_wait_ms", 30_000)) / 1000

    async def stream(messages: list[ModelMessage], info: AgentInfo) -> AsyncIterator[str]:
        _record(record, "start")
        try:
            deadline = time.monotonic() + max_wait_s
            while _starts(record) < calls and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            yield "done"
        finally:
            _record(record, "end")

    return FunctionModel(stream_function=stream, model_name="test:meeting")


def held(options: dict[str, Any]) -> FunctionModel:
    """Streams one word, records its start, then holds the stream open until `until` (a file path)
    exists, and ends with a second word (`record`: start, then end or closed when cancelled). Many
    such calls stay open together at no cost but their waiting."""
    record, until = Path(options["record"]), Path(options["until"])

    async def stream(messages: list[ModelMessage], info: AgentInfo) -> AsyncIterator[str]:
        _record(record, "start")
        ended = "closed"
        try:
            yield "held "
            while not until.exists():
                await asyncio.sleep(0.05)
            yield "released"
            ended = "end"
        finally:
            _record(record, ended)

    return FunctionModel(stream_function=stream, model_name="test:held")
