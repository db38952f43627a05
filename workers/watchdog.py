"""Recovery of turns whose worker died.

dramatiq redelivers a dead worker's message only after its heartbeat timeout plus a random
maintenance pass (minutes, up to ~25 min measured), and a conversation waits behind its turn all
that time. Each worker process therefore looks, every `watchdog_s`, at turns that made no progress
for `stall_s`: a turn with a live invoke claim is running; any other gets its next stage enqueued
again. Every stage is idempotent, so the duplicate that dramatiq may still deliver later, or a
message that was only waiting in a long queue, changes nothing.
"""

from __future__ import annotations

import json
import threading
import time
from typing import cast

import redis
import structlog

from . import lua
from .client import Client
from .store import text

log = structlog.get_logger(__name__)


class Watchdog:
    def __init__(self, client: Client, *, stall_s: float, every_s: float) -> None:
        self.client = client
        self.stall_s = stall_s
        self.every_s = every_s
        self._stalled = client.redis.register_script(lua.STALLED)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="threadline-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self.sweep(time.time())
            except redis.RedisError as e:
                log.warning("watchdog_sweep_failed", error=str(e))

    def sweep(self, now: float) -> int:
        """Enqueue again the next stage of every stalled turn; returns how many were."""
        keys = self.client.keys
        stalled = cast(list[bytes], self.client.redis.zrangebyscore(keys.running(), "-inf", now - self.stall_s,
                                                                     start=0, num=100))
        recovered = 0
        for raw in stalled:
            turn_id = text(raw)
            reply = self._stalled(keys=[keys.turn(turn_id), keys.invoke_claim(turn_id), keys.running()],
                                  args=[turn_id, now])
            if text(reply[0]) != "stalled":
                continue
            stage, attempt, wake = text(reply[1]), int(reply[2]), text(reply[4])
            if stage == "resolve":
                if not wake:
                    continue
                self.client.enqueue("resolve", "resolve", tuple(json.loads(wake)["args"]))
            else:
                self.client.enqueue(stage, stage, ({"v": 1, "turn_id": turn_id, "stage": stage, "attempt": attempt},))
            log.warning("stalled_turn_requeued", turn_id=turn_id, stage=stage, stalled_s=self.stall_s)
            recovered += 1
        return recovered
