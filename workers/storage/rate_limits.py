"""The gateway's rate limits in Redis (`scripts/rate_limit.lua`): token buckets and an API key's
stream holds, shared by every gateway process. One typed call per check; no clock but the server's."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import redis.asyncio as aioredis

from threadline.workers.protocol.keys import Keys
from threadline.workers.storage import lua

#: An open stream's hold lives this long unless renewed (a gateway that died frees its holds so).
STREAM_LEASE_MS = 30_000


@dataclass(frozen=True, slots=True)
class Bucket:
    """A token bucket: `burst` tokens, refilled at `per_s` a second; a check takes `cost`."""

    key: str
    per_s: float
    burst: float
    cost: int = 1


@dataclass(frozen=True, slots=True)
class Verdict:
    allowed: bool
    retry_after_ms: int = 0
    #: The bucket that was short (None: allowed, or the stream holds were all taken).
    short: Bucket | None = None


class RateLimits:
    def __init__(self, client: aioredis.Redis, keys: Keys) -> None:
        self.redis = client
        self.keys = keys
        self._script = client.register_script(lua.source("rate_limit"))
        self._renew = client.register_script(lua.source("slot_renew"))

    async def take(self, buckets: Sequence[Bucket], *, hold: tuple[str, str, int] | None = None) -> Verdict:
        """Take every bucket's cost and, with `hold` (key id, token, limit), one of the key's stream
        holds; all or nothing."""
        keys = [b.key for b in buckets]
        fields: dict[str, object] = {"buckets": [{"rate": b.per_s, "burst": b.burst, "cost": b.cost} for b in buckets]}
        if hold is not None:
            key_id, token, limit = hold
            keys.append(self.keys.stream_holders(key_id))
            fields["hold"] = {"token": token, "limit": limit, "lease_ms": STREAM_LEASE_MS}
        allowed, retry_ms, index = await self._script(keys=keys, args=[lua.payload(**fields)])
        if int(allowed) == 1:
            return Verdict(True)
        return Verdict(False, int(retry_ms), buckets[int(index) - 1] if int(index) else None)

    async def renew_streams(self, holds: Sequence[tuple[str, str]]) -> None:
        """Extend the leases of open streams' holds ((key id, token) pairs), in one round trip."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for key_id, token in holds:
                await self._renew(keys=[self.keys.stream_holders(key_id)],
                                  args=[lua.payload(token=token, lease_ms=STREAM_LEASE_MS)], client=pipe)
            await pipe.execute()

    async def release_stream(self, key_id: str, token: str) -> None:
        await self.redis.zrem(self.keys.stream_holders(key_id), token)

    async def open_streams(self, key_id: str) -> int:
        """How many streams of the key hold a lease now (expired holders not counted)."""
        return int(await self.redis.zcount(self.keys.stream_holders(key_id), "(" + str(await self._now_ms()), "+inf"))

    async def _now_ms(self) -> int:
        seconds, micros = await self.redis.time()
        return int(seconds) * 1000 + int(micros) // 1000
