"""dramatiq's event loop thread for the async actors, on a loop of the kind the settings name
(`worker/loops.py`)."""

from __future__ import annotations

from typing import Any

import dramatiq
from dramatiq.asyncio import EventLoopThread, set_event_loop_thread
from dramatiq.middleware import AsyncIO

from threadline.workers.worker.loops import LoopFactory


class EventLoop(AsyncIO):
    """dramatiq's `AsyncIO`: the thread that runs the async actors' event loop, whose loop is made
    by `factory` instead of `asyncio.new_event_loop`."""

    def __init__(self, factory: LoopFactory) -> None:
        super().__init__()
        self.factory = factory

    def before_worker_boot(self, broker: dramatiq.Broker, worker: Any) -> None:
        thread = EventLoopThread(self.logger)
        thread.loop.close()  # the standard one its constructor made, never run
        thread.loop = self.factory()
        thread.start(timeout=1.0)
        set_event_loop_thread(thread)
