"""The event loops of a worker process, of the kind `Settings.loop()` names: dramatiq's, which runs
the async stages (`middleware/event_loop.py`), and the model calls' (`calls.py`).

With uvloop (libuv's loop), a Redis round trip and a model stage's pydantic-ai run cost less CPU in
the worker than on the standard loop (docs/capacity.md). Each loop is made by its factory, not by a
process-wide event loop policy: nothing else in the process (a test's loop, a library's
`asyncio.run`) changes kind, and asyncio's policies are deprecated.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Literal

LoopFactory = Callable[[], asyncio.AbstractEventLoop]


def loop_factory(kind: Literal["uvloop", "asyncio"]) -> LoopFactory:
    """What makes a new event loop of `kind`."""
    if kind == "uvloop":
        import uvloop

        return uvloop.new_event_loop
    return asyncio.new_event_loop
