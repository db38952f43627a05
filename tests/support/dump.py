"""Everything stored under a key prefix, as plain data: compare two dumps to show that a script
wrote nothing (values, and whether each key expires; TTL values themselves tick, so not those)."""

from __future__ import annotations

from typing import Any

import redis.asyncio as aioredis

Dump = dict[str, tuple[str, Any, bool]]


async def dump(client: aioredis.Redis, prefix: str) -> Dump:
    """{key: (type, value, expires)} for every key under `prefix:`."""
    out: Dump = {}
    async for raw in client.scan_iter(f"{prefix}:*", count=1000):
        key = raw.decode() if isinstance(raw, bytes) else raw
        out[key] = (*(await _value(client, key)), await client.pttl(key) >= 0)
    return out


async def _value(client: aioredis.Redis, key: str) -> tuple[str, Any]:
    kind = await client.type(key)
    kind = kind.decode() if isinstance(kind, bytes) else kind
    if kind == "string":
        return kind, await client.get(key)
    if kind == "hash":
        return kind, await client.hgetall(key)
    if kind == "list":
        return kind, await client.lrange(key, 0, -1)
    if kind == "zset":
        return kind, await client.zrange(key, 0, -1, withscores=True)
    if kind == "set":
        return kind, await client.smembers(key)
    if kind == "stream":
        return kind, await client.xrange(key)
    return kind, None  # gone between SCAN and TYPE
