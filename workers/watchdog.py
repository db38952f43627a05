"""Recovery of turns whose worker died.

dramatiq redelivers a dead worker's message only after its heartbeat timeout plus a random
maintenance pass (minutes, up to ~25 min measured), and a conversation waits behind its turn all
that time. Each worker process therefore looks, every `watchdog_s`, at turns that made no progress
for `stall_s`: a turn with a live model claim is running; any other gets its first unfinished stage
enqueued again — at most `max_recoveries` times, after which the turn ends `failed` instead of
being run again forever. Every stage is idempotent, so the duplicate that dramatiq may still
deliver later, or a message that was only waiting in a long queue, changes nothing.
"""

from __future__ import annotations

import asyncio
from typing import cast

import redis
import structlog

from threadline.pipeline.contracts import Envelope

from .runtime import Runtime
from .schema import text
from .store import with_message_id

log = structlog.get_logger(__name__)


class Watchdog:
    def __init__(self, runtime: Runtime) -> None:
        self.rt = runtime

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.rt.settings.watchdog_s)
            try:
                await self.sweep(self.rt.now())
            except redis.RedisError as e:
                log.warning("watchdog_sweep_failed", error=str(e))

    async def sweep(self, now: float) -> int:
        """Enqueue again the next stage of every stalled turn; returns how many were."""
        rt, store = self.rt, self.rt.store
        stalled = cast(list[bytes], await store.redis.zrangebyscore(
            store.keys.running(), "-inf", now - rt.settings.stall_s, start=0, num=100))
        recovered = 0
        for raw in stalled:
            turn_id = text(raw)
            verdict, stage, attempt, request = await store.stalled(turn_id, now=now,
                                                                   max_recoveries=rt.settings.max_recoveries)
            if verdict == "exhausted":
                await rt.end_turn(turn_id, "failed", code="internal_error",
                                  message=f"the turn stalled at {stage} more than {rt.settings.max_recoveries} times")
                continue
            if verdict != "stalled":
                continue
            message_id = f"recover.{turn_id}.{rt.new_id()[:8]}"
            if stage == rt.graph.first.name:
                if not request:
                    continue
                await store.enqueue(rt.graph.first.queue, message_id, with_message_id(request, message_id).encode())
            else:
                arg = Envelope(turn_id=turn_id, stage=stage, attempt=attempt).model_dump()
                await store.enqueue_stage(stage, arg, message_id=message_id, now_ms=rt.now_ms())
            log.warning("stalled_turn_requeued", turn_id=turn_id, stage=stage, stalled_s=rt.settings.stall_s)
            recovered += 1
        return recovered
