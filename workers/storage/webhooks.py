"""Completion webhooks in Redis: deliveries, their attempts, and each tenant's signing secret.

A delivery is created, with its first message on the `webhooks` queue, by the script that writes the
turn's terminal event (`scripts/finish.lua`): once per turn. Its id is the turn id. Each attempt is
recorded, and the next one queued, in one step (`scripts/webhook_attempt.lua`); a manual retry is
`scripts/webhook_retry.lua`. Layout: `Keys.webhook`, `Keys.webhook_attempts`, `Keys.webhooks`,
`Keys.webhook_secret` (docs/webhooks.md)."""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Any, Literal, cast

import redis
import redis.asyncio as aioredis

from threadline.pipeline.webhooks import DeliveryJob, DeliveryStatus
from threadline.workers.protocol.keys import Keys
from threadline.workers.protocol.names import WEBHOOK_ACTOR, WEBHOOK_QUEUE
from threadline.workers.protocol.schema import text, text_map
from threadline.workers.protocol.wire import build_message
from threadline.workers.storage import lua
from threadline.workers.storage.base import StoreBase, in_shard

#: Deliveries `threadline webhooks list` shows unless told otherwise.
DEFAULT_LIST = 50
#: Secrets are generated with this prefix, so one found in a log or a config reads as what it is.
SECRET_PREFIX = "whsec_"

AttemptWrite = Literal["ok", "gone", "stale"]
RetryWrite = Literal["ok", "not_found", "stale"]


@dataclass(frozen=True, slots=True)
class Delivery:
    id: str
    turn_id: str
    tenant_id: str
    url: str
    status: DeliveryStatus
    attempts: int
    max_attempts: int
    created_at: float
    #: The terminal event as written on the turn's stream (JSON text): what is POSTed.
    event: str
    last_at: float | None = None

    @classmethod
    def from_hash(cls, delivery_id: str, h: dict[str, str]) -> Delivery:
        return cls(id=delivery_id, turn_id=h.get("turn_id", delivery_id), tenant_id=h.get("tenant_id", ""),
                   url=h.get("url", ""), status=cast(DeliveryStatus, h.get("status", "pending")),
                   attempts=int(h.get("attempts") or 0), max_attempts=int(h.get("max_attempts") or 1),
                   created_at=float(h.get("created_at") or 0), event=h.get("event", "{}"),
                   last_at=float(h["last_at"]) if h.get("last_at") else None)


def new_secret() -> str:
    return SECRET_PREFIX + secrets.token_urlsafe(32)


def sync_webhook_secret(client: redis.Redis, keys: Keys, tenant_id: str, *, rotate: bool = False) -> str:
    """`WebhookStore.webhook_secret` for the sync `Client`."""
    key = keys.webhook_secret(tenant_id)
    fresh = new_secret()
    if rotate:
        client.set(key, fresh)
        return fresh
    client.set(key, fresh, nx=True)
    return text(cast(bytes, client.get(key)))


async def async_webhook_secret(client: aioredis.Redis, keys: Keys, tenant_id: str, *, rotate: bool = False) -> str:
    """The tenant's signing secret, created on first use; `rotate` replaces it (deliveries signed
    from then on use the new one). For the store and the `AsyncClient`."""
    key = keys.webhook_secret(tenant_id)
    fresh = new_secret()
    if rotate:
        await client.set(key, fresh)
        return fresh
    await client.set(key, fresh, nx=True)
    return text(cast(bytes, await client.get(key)))


class WebhookStore(StoreBase):
    async def delivery(self, delivery_id: str) -> Delivery | None:
        """A delivery (its id is its turn's), found in its turn's shard."""
        k = await self.turn_keys(delivery_id)
        found = text_map(await self.redis.hgetall(k.webhook(delivery_id))) if k is not None else {}
        return Delivery.from_hash(delivery_id, found) if found else None

    async def deliveries(self, *, turn_id: str | None = None, tenant_id: str | None = None,
                         limit: int = DEFAULT_LIST) -> list[Delivery]:
        """The newest deliveries first (of one turn, or one tenant, when named), over every shard."""
        if turn_id is not None:
            one = await self.delivery(turn_id)
            return [one] if one is not None and tenant_id in (None, one.tenant_id) else []
        found: list[Delivery] = []
        for k in self.layout.every_shard():
            with in_shard(k.shard):
                found += await self._newest(tenant_id, limit)
        return sorted(found, key=lambda d: d.created_at, reverse=True)[:limit]

    async def _newest(self, tenant_id: str | None, limit: int) -> list[Delivery]:
        found: list[Delivery] = []
        start = 0
        while len(found) < limit:
            page = await self.redis.zrevrange(self.keys.webhooks(), start, start + 199)
            ids = [text(cast(bytes, i)) for i in page]
            if not ids:
                break
            start += len(ids)
            for delivery_id in ids:
                d = await self.delivery(delivery_id)
                if d is not None and tenant_id in (None, d.tenant_id):
                    found.append(d)
        return found[:limit]

    async def delivery_attempts(self, delivery_id: str) -> list[dict[str, Any]]:
        k = await self.turn_keys(delivery_id)
        return [json.loads(r) for r in await self.redis.lrange(k.webhook_attempts(delivery_id), 0, -1)] if k else []

    async def record_webhook_attempt(self, job: DeliveryJob, *, status: DeliveryStatus, record: dict[str, Any],
                                     retry_in_s: float | None, now: float) -> AttemptWrite:
        """Record attempt `job.attempt` and queue the next one `retry_in_s` from now (None: none)."""
        k = self.keys
        queue, message_id, data = WEBHOOK_QUEUE, "", b""
        if retry_in_s is not None:
            queue, message_id, data = self._attempt_message(job.delivery_id, job.attempt + 1, now=now,
                                                            delay_ms=max(1, int(retry_in_s * 1000)))
        reply = await self._run(
            "webhook_attempt",
            [k.webhook(job.delivery_id), k.webhook_attempts(job.delivery_id), k.queue_messages(queue), k.queue(queue)],
            lua.payload(attempt=job.attempt, status=status, now=now, ttl_s=self.settings.turn_ttl_s,
                        message_id=message_id, channel=k.doorbell_channel(), queue=queue),
            json.dumps(record, separators=(",", ":")), data,
        )
        return cast(AttemptWrite, text(reply))

    async def retry_delivery(self, delivery_id: str, *, now: float) -> RetryWrite:
        """One more attempt of a delivery, now (`threadline webhooks retry`)."""
        d = await self.delivery(delivery_id)
        k = await self.turn_keys(delivery_id)  # the CLI binds no shard: the turn's (sharded layout)
        if d is None or k is None:
            return "not_found"
        queue, message_id, data = self._attempt_message(delivery_id, d.attempts + 1, now=now)
        reply = await self._run(
            "webhook_retry", [k.webhook(delivery_id), k.queue_messages(queue), k.queue(queue)],
            lua.payload(attempt=d.attempts + 1, message_id=message_id, channel=k.doorbell_channel(), queue=queue),
            data,
        )
        return cast(RetryWrite, text(reply))

    async def webhook_secret(self, tenant_id: str, *, rotate: bool = False) -> str:
        return await async_webhook_secret(self.redis, self.keys, tenant_id, rotate=rotate)

    def _attempt_message(self, delivery_id: str, attempt: int, *, now: float,
                         delay_ms: int | None = None) -> tuple[str, str, bytes]:
        job = DeliveryJob(delivery_id=delivery_id, attempt=attempt).model_dump()
        # one id per attempt and moment: a manual retry never collides with a queued attempt's message
        message_id = f"wh.{delivery_id}.{attempt}.{int(now * 1000)}"
        return build_message(WEBHOOK_QUEUE, WEBHOOK_ACTOR, (job,), message_id=message_id, now_ms=int(now * 1000),
                             delay_ms=delay_ms)
