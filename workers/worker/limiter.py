"""The fleet-wide limit on an agent's model calls (`model.max_concurrency`): pydantic-ai's own
concurrency hook (`ConcurrencyLimitedModel`) with its slots held in Redis, because a limiter in one
process bounds that process, not the fleet.

A slot is a token in the agent's holders set (`scripts/slot_acquire.lua`), leased for
`TL_INVOKE_LEASE_S` and renewed every third of it while the call runs; a worker that dies leaves a
lease that runs out, and the next acquire drops it. A waiting call polls with a short exponential
backoff capped at 250 ms. The wait is a plain await inside the run, so the turn's cancellation
token and its deadline end it like any other part of the run.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
import uuid
from collections.abc import AsyncIterator

import structlog
from pydantic_ai.concurrency import AbstractConcurrencyLimiter
from pydantic_ai.models import Model
from pydantic_ai.models.concurrency import ConcurrencyLimitedModel

from threadline.pipeline.invoke import TurnAgent
from threadline.workers.storage.store import Store

log = structlog.get_logger(__name__)

FIRST_BACKOFF_S = 0.01
MAX_BACKOFF_S = 0.25


class FleetLimiter(AbstractConcurrencyLimiter):
    """One turn's side of an agent's limit: the slots its run holds (one per model request in flight;
    a run makes one at a time), and how long it waited for them."""

    def __init__(self, store: Store, agent_id: str, *, limit: int, turn_id: str) -> None:
        self._store = store
        self._agent_id = agent_id
        self._limit = limit
        self._turn_id = turn_id
        self._held: list[str] = []
        self._releasing: set[asyncio.Task[None]] = set()
        self.waited_s = 0.0

    async def acquire(self, source: str) -> None:
        # the token names the turn, so whoever looks at the holders set can tell who holds a slot
        token = f"{self._turn_id}:{uuid.uuid4().hex[:12]}"
        started = time.monotonic()
        delay = FIRST_BACKOFF_S
        try:
            while not await self._store.acquire_slot(self._agent_id, token, limit=self._limit):
                # jittered, so waiters on different workers do not poll in step
                await asyncio.sleep(delay * random.uniform(0.5, 1.0))
                delay = min(delay * 2, MAX_BACKOFF_S)
        except BaseException:
            # cancelled or past the deadline while waiting: the script may have granted the slot just
            # as the wait was cut, so give back this token's (only ever its own)
            self._release_later(token)
            raise
        finally:
            self.waited_s += time.monotonic() - started
        self._held.append(token)

    def release(self) -> None:
        if self._held:
            self._release_later(self._held.pop(0))

    def _release_later(self, token: str) -> None:
        # pydantic-ai's `release` is synchronous: the script runs in a task, which `close` awaits
        task = asyncio.get_running_loop().create_task(self._store.release_slot(self._agent_id, token))
        self._releasing.add(task)
        task.add_done_callback(self._releasing.discard)

    async def renew(self) -> None:
        for token in list(self._held):
            if not await self._store.renew_slot(self._agent_id, token):
                log.warning("model_slot_lost", agent_id=self._agent_id, reason="lease ran out before renewal")

    async def close(self) -> None:
        """Give back every slot still held, and wait until every release is written."""
        while self._held:
            self.release()
        if self._releasing:
            await asyncio.gather(*self._releasing, return_exceptions=True)


@contextlib.asynccontextmanager
async def turn_limiter(store: Store, agent_id: str, *, limit: int | None,
                       turn_id: str) -> AsyncIterator[FleetLimiter | None]:
    """The limiter of one turn's run (None when the agent has no limit), its leases renewed while the
    run lasts and its slots given back when it ends."""
    if limit is None:
        yield None
        return
    limiter = FleetLimiter(store, agent_id, limit=limit, turn_id=turn_id)

    async def renew() -> None:
        while True:
            await asyncio.sleep(store.settings.invoke_lease_s / 3)
            try:
                await limiter.renew()
            except Exception as e:  # a Redis hiccup: the lease has two more thirds to be renewed in
                log.warning("model_slot_renew_failed", error=type(e).__name__)

    renewing = asyncio.create_task(renew())
    try:
        yield limiter
    finally:
        renewing.cancel()
        await limiter.close()


def limited_model(agent: TurnAgent, limiter: FleetLimiter | None) -> Model | None:
    """The agent's model behind `limiter`, for one run (None: no limit, the run uses the agent's own)."""
    if limiter is None:
        return None
    assert isinstance(agent.model, Model), "agents are built with a model (workers/worker/runtime.py)"
    return ConcurrencyLimitedModel(agent.model, limiter)
