"""Per-key rate limits of the gateway, shared by every gateway process (`storage/rate_limits.py`):
requests per second, turns per minute, event streams open at once, and failed authentications per
client address. A refusal is 429 `rate_limited` with `Retry-After`. A key's own limits (its record)
win over the settings' defaults (`TL_KEY_RPS`, `TL_KEY_TURNS_PER_MIN`, `TL_KEY_MAX_STREAMS`,
`TL_AUTH_FAILURES_PER_MIN`); 0 is no limit."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Sequence

import redis

from threadline.workers.gateway.refusals import rate_limited
from threadline.workers.settings import Settings
from threadline.workers.storage.api_keys import ApiKey
from threadline.workers.storage.rate_limits import Bucket, RateLimits


class Limiter:
    def __init__(self, settings: Settings, limits: RateLimits) -> None:
        self.settings = settings
        self.limits = limits
        self._releases: set[asyncio.Task[None]] = set()

    def _limit(self, key: ApiKey, name: str) -> int:
        own: int | None = getattr(key.limits, name)
        defaults = {"rps": self.settings.key_rps, "turns_per_min": self.settings.key_turns_per_min,
                    "streams": self.settings.key_max_streams}
        return defaults[name] if own is None else own

    def buckets(self, key: ApiKey, *, turn: bool) -> list[Bucket]:
        """The buckets a request of `key` takes from: its requests, and its turns for a new turn."""
        found: list[Bucket] = []
        if rps := self._limit(key, "rps"):
            found.append(Bucket(self.limits.keys.rate_bucket("rps", key.id), per_s=rps, burst=rps))
        if turn and (per_min := self._limit(key, "turns_per_min")):
            found.append(Bucket(self.limits.keys.rate_bucket("turns", key.id), per_s=per_min / 60, burst=per_min))
        return found

    async def request(self, key: ApiKey, *, turn: bool = False) -> None:
        """Count a request of `key` (and a turn, with `turn`); 429 when a bucket is empty."""
        buckets = self.buckets(key, turn=turn)
        if not buckets:
            return
        verdict = await self.limits.take(buckets)
        if not verdict.allowed:
            turns = verdict.short is not None and verdict.short.key == self.limits.keys.rate_bucket("turns", key.id)
            what = "turns per minute" if turns else "requests per second"
            raise rate_limited(f"the API key made too many {what}", verdict.retry_after_ms)

    async def open_stream(self, key: ApiKey) -> tuple[str, str] | None:
        """Take one of the key's stream holds: (key id, token), to give back with `close_stream`;
        None when the key has no cap. 429 while every hold is taken."""
        limit = self._limit(key, "streams")
        if not limit:
            return None
        token = uuid.uuid4().hex
        verdict = await self.limits.take([], hold=(key.id, token, limit))
        if not verdict.allowed:
            raise rate_limited(f"the API key has {limit} event streams open, its limit", verdict.retry_after_ms)
        return key.id, token

    def close_stream(self, hold: tuple[str, str] | None) -> None:
        """Give a hold back, in a task of its own: a stream closes when its client went away, inside
        a cancelled scope where nothing can be awaited. A lost release lapses with the lease."""
        if hold is None:
            return
        task = asyncio.get_running_loop().create_task(self._release(hold))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def _release(self, hold: tuple[str, str]) -> None:
        with contextlib.suppress(redis.RedisError, OSError):
            await self.limits.release_stream(*hold)

    async def renew_streams(self, holds: Sequence[tuple[str, str]]) -> None:
        await self.limits.renew_streams(holds)

    def _auth_bucket(self, address: str, cost: int) -> Bucket:
        per_min = self.settings.auth_failures_per_min
        return Bucket(self.limits.keys.rate_bucket("auth", address), per_s=per_min / 60, burst=per_min, cost=cost)

    async def check_address(self, address: str) -> None:
        """Before a key is looked up: 429 while the address has used up its failed authentications."""
        if self.settings.auth_failures_per_min:
            verdict = await self.limits.take([self._auth_bucket(address, 0)])
            if not verdict.allowed:
                raise rate_limited("too many failed authentications from this address", verdict.retry_after_ms)

    async def failed_auth(self, address: str) -> None:
        """Count a failed authentication of the address; 429 once it has none left."""
        if self.settings.auth_failures_per_min:
            verdict = await self.limits.take([self._auth_bucket(address, 1)])
            if not verdict.allowed:
                raise rate_limited("too many failed authentications from this address", verdict.retry_after_ms)
