"""Recovery of turns whose worker died.

dramatiq redelivers a dead worker's message only after its heartbeat timeout plus a random
maintenance pass (minutes, up to ~25 min measured), and a conversation waits behind its turn all
that time. Each worker process therefore looks, every `watchdog_s`:

- at the worker processes whose heartbeat is gone (`middleware/liveness.py`): the messages they had
  fetched and not acked go back on their queues at once (`reap`);
- at running turns it has not looked at for `worker_timeout_s` (stalled.lua): a turn whose holder's
  heartbeat still lists it is alive, however long its model streams; one whose holder is gone is
  taken over at once; one nobody holds (its next message waits in a queue, or was lost) after
  `stall_s` without progress. Taking over enqueues its first unfinished stage again — at most
  `max_recoveries` times, after which the turn ends `failed` instead of being run again forever.

Every stage is idempotent, so the duplicate that dramatiq may still deliver later, or a message that
was only waiting in a long queue, changes nothing.

The same loop enforces retention (`TL_RETENTION_DAYS`): conversations whose last activity (the
`activity` index, kept by admit.lua and finish.lua) is older are deleted through the delete script,
a batch at a time; one with a turn running or waiting is skipped until it is idle.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, cast

import redis
import structlog
from dramatiq.common import dq_name

from threadline.pipeline.contracts import Envelope
from threadline.pipeline.records import MessageRecord
from threadline.workers.protocol.keys import Keys
from threadline.workers.protocol.names import queues
from threadline.workers.protocol.schema import text
from threadline.workers.storage.base import in_shard
from threadline.workers.storage.turns import with_message_id
from threadline.workers.telemetry import metrics
from threadline.workers.worker.runtime import Runtime

if TYPE_CHECKING:
    from threadline.workers.worker.reachability import Reachability

log = structlog.get_logger(__name__)
#: Conversations read from the activity index per round trip, and looked at per pass at most.
EXPIRE_BATCH = 20
EXPIRE_MAX = 200


class Watchdog:
    def __init__(self, runtime: Runtime, *, reachability: Reachability | None = None) -> None:
        self.rt = runtime
        self.reachability = reachability
        self._outage = False
        self._settle_until = 0.0

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.rt.settings.watchdog_s)
            try:
                if self._outage:
                    # After an outage every heartbeat has run out: wait until the live processes
                    # have beaten again before taking anything of theirs over.
                    await self.rt.store.redis.ping()
                    self._outage = False
                    self._settle_until = time.monotonic() + 2 * self.rt.settings.heartbeat_s
                if time.monotonic() >= self._settle_until:
                    await self.reap()
                    await self.sweep(self.rt.now())
                if self.rt.settings.retention_days > 0:
                    await self.backfill_activity()
                    await self.expire(self.rt.now())
            except redis.RedisError as e:
                self._outage = True
                if self.reachability is None:
                    log.warning("watchdog_sweep_failed", error=str(e))
                else:
                    await asyncio.sleep(self.reachability.failed("watchdog", e))
            else:
                if self.reachability is not None:
                    self.reachability.ok("watchdog")

    def queues(self) -> list[str]:
        """Every queue a worker may have fetched from, delay queues included."""
        names = list(queues(self.rt.graph))
        return [q for name in names for q in (name, dq_name(name))]

    async def reap(self) -> int:
        """Put back the messages fetched by worker processes whose heartbeat is gone; returns how many."""
        store, k = self.rt.store, self.rt.store.keys
        registry = cast(dict[bytes, bytes], await store.redis.hgetall(k.workers()))
        if not registry:
            return 0
        ids = [text(w) for w in registry]
        beats = cast(list[bytes | None], await store.redis.mget([k.worker(w) for w in ids]))
        requeued = 0
        for worker_id, broker_id, beat in zip(ids, registry.values(), beats, strict=True):
            if beat is not None:
                continue
            moved = await store.reap(worker_id, text(broker_id), self.queues())
            if moved >= 0:
                log.warning("worker_reaped", worker_id=worker_id, messages_requeued=moved)
                requeued += moved
        return requeued

    async def sweep(self, now: float) -> int:
        """Enqueue again the next stage of every turn that is no longer running anywhere; returns how
        many were. (Sharded layout: every shard's `running` index, read in one round trip.)"""
        store, settings = self.rt.store, self.rt.settings
        due = now - min(settings.worker_timeout_s, settings.stall_s)
        shards = store.layout.every_shard()
        async with store.redis.pipeline(transaction=False) as pipe:
            for k in shards:
                pipe.zrangebyscore(k.running(), "-inf", due, start=0, num=100)
            found = cast(list[list[bytes]], await pipe.execute())
        recovered = 0
        for k, stalled in zip(shards, found, strict=True):
            with in_shard(k.shard):
                for raw in stalled:
                    recovered += await self._recover(text(raw), now)
        return recovered

    async def _recover(self, turn_id: str, now: float) -> int:
        """Look at one turn the `running` index says is due (stalled.lua); 1 when it was enqueued again."""
        rt, store, settings = self.rt, self.rt.store, self.rt.settings
        look = await store.stalled(turn_id, now=now, max_recoveries=settings.max_recoveries)
        stage, attempt, request = look.stage, look.attempt, look.request
        if look.verdict == "exhausted":
            await rt.end_turn(turn_id, "failed", code="internal_error",
                              message=f"the turn stalled at {stage} more than {settings.max_recoveries} times")
            return 0
        if look.verdict != "stalled":
            return 0
        message_id = f"recover.{turn_id}.{rt.new_id()[:8]}"
        if stage == rt.graph.first.name:
            if not request:
                return 0
            await store.enqueue(rt.graph.first.queue, message_id, with_message_id(request, message_id).encode())
        else:
            arg = Envelope(turn_id=turn_id, stage=stage, attempt=attempt).model_dump()
            await store.enqueue_stage(stage, arg, message_id=message_id, now_ms=rt.now_ms())
        log.warning("stalled_turn_requeued", turn_id=turn_id, stage=stage, why=look.why, holder=look.holder or None,
                    attempt=attempt)
        metrics.TAKEOVERS.labels(stage).inc()
        return 1

    async def backfill_activity(self) -> int:
        """Once per deployment (the first process to get there): conversations stored while retention
        was off enter the activity index, scored by their newest message (else their creation), so
        switching retention on also expires the ones idle since before. Returns how many entered."""
        store = self.rt.store
        if not await store.redis.set(store.layout.activity_backfill(), "1", nx=True):
            return 0
        added = 0
        for k in store.layout.every_shard():
            head, tail = _conversation_pattern(k)
            async for raw in store.redis.scan_iter(f"{head}*{tail}", count=1000):
                conversation_id = text(raw)[len(head):len(text(raw)) - len(tail)]
                if any(c in conversation_id for c in "{}:"):
                    continue  # one of the conversation's other keys
                newest = cast(list[bytes], await store.redis.zrange(k.message_order(conversation_id), -1, -1))
                row = await store.redis.hget(k.messages(conversation_id), newest[0]) if newest else None
                last = _updated_at(row) or float(text(await store.redis.hget(raw, "created_at") or b"0"))
                if not await store.redis.zadd(k.activity(), {conversation_id: last}, nx=True):
                    continue
                # deleted since the scan read it (a retention sweep of another process, a user's delete,
                # which take the entry with the conversation): the entry just added would stay behind
                if await store.redis.exists(raw):
                    added += 1
                else:
                    await store.redis.zrem(k.activity(), conversation_id)
        log.info("activity_backfilled", conversations=added)
        return added

    async def expire(self, now: float) -> int:
        """Delete the conversations idle longer than the retention; returns how many were. Busy ones
        stay in the index (their score moves when their turn ends); each worker process sweeps, and
        a conversation another one deleted first is simply not found."""
        deleted = 0
        for k in self.rt.store.layout.every_shard():
            with in_shard(k.shard):
                deleted += await self._expire(now)
        return deleted

    async def _expire(self, now: float) -> int:
        store, days = self.rt.store, self.rt.settings.retention_days
        cutoff = now - days * 86_400
        deleted = passed = 0
        while deleted + passed < EXPIRE_MAX:
            batch = cast(list[bytes], await store.redis.zrangebyscore(
                store.keys.activity(), "-inf", cutoff, start=passed, num=EXPIRE_BATCH))
            if not batch:
                break
            for raw in batch:
                result = await store.delete_conversation(text(raw))
                if result.status != "deleted":
                    passed += 1  # left in the index (busy), or gone from it: either way, look further on
                    continue
                deleted += 1
                log.info("conversation_expired", conversation_id=result.conversation_id, messages=result.messages,
                         turns=result.turns, retention_days=days)
        return deleted


def _conversation_pattern(k: Keys) -> tuple[str, str]:
    """What a conversation's hash key has before and after its id, in `k`'s shard."""
    key = k.conversation("-")
    return (key[:-2], "}") if key.endswith("{-}") else (key[:-1], "")


def _updated_at(row: bytes | str | None) -> float | None:
    return MessageRecord.model_validate_json(row).updated_at if row is not None else None
