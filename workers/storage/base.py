"""What every part of the store stands on: the async Redis connection, the settings, the stage graph,
the keys, and the scripts registered on the connection (one call each)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Self

import redis.asyncio as aioredis
from redis.commands.core import AsyncScript

from threadline.pipeline.stages import StageGraph
from threadline.workers.protocol.keys import Keys
from threadline.workers.protocol.names import SHARD_OPTION
from threadline.workers.settings import Settings
from threadline.workers.storage import lua
from threadline.workers.storage.connect import async_client, untimed_socket_options

#: A worker process's connections to Redis for its stages, and how long a command waits for one.
POOL_CONNECTIONS = 64
POOL_TIMEOUT_S = 30.0


#: The shard of the turn the current code works on (sharded layout): a stage actor sets it from its
#: message's `SHARD_OPTION`, the watchdog per shard it reads (`in_shard`). Tasks a stage starts
#: inherit it. None: unbound (conversation keys still bind themselves from their id).
CURRENT_SHARD: ContextVar[int | None] = ContextVar("threadline_shard", default=None)


def shard_in(options: Mapping[str, object]) -> int | None:
    """The shard a message's options name (`SHARD_OPTION`, stamped by the consumer that fetched it)."""
    shard = options.get(SHARD_OPTION)
    return shard if isinstance(shard, int) and not isinstance(shard, bool) else None


@contextmanager
def in_shard(shard: int | None) -> Iterator[None]:
    """Run the block with the store's keys bound to `shard`."""
    token = CURRENT_SHARD.set(shard)
    try:
        yield
    finally:
        CURRENT_SHARD.reset(token)


class StoreBase:
    def __init__(self, client: aioredis.Redis, settings: Settings, graph: StageGraph) -> None:
        self.redis = client
        self.settings = settings
        self.graph = graph
        self.layout = Keys(settings.prefix, settings.shards)
        self._scripts: dict[str, AsyncScript] = {
            name: client.register_script(lua.source(name)) for name in lua.SCRIPT_NAMES
        }

    @property
    def keys(self) -> Keys:
        """The layout's keys bound to the current shard (`CURRENT_SHARD`); one server's layout: the
        same keys always."""
        return self.layout.on(CURRENT_SHARD.get())

    async def turn_keys(self, turn_id: str) -> Keys | None:
        """The keys of a turn's shard: the current shard's, or (unbound, sharded layout) the one its
        pointer names; None when no pointer does (an unknown turn, or one long gone)."""
        k = self.keys
        if not k.shards or k.shard is not None:
            return k
        return k.pointed(await self.redis.get(k.turn_shard(turn_id)))

    @classmethod
    def connect(cls, url: str, settings: Settings, graph: StageGraph) -> Self:
        """A worker's store. Its pool blocks: a process holds hundreds of model calls on one event
        loop, and a burst of their writes waits for a free connection instead of failing. Its
        commands carry no socket timeout (`untimed_socket_options`)."""
        return cls(async_client(url, max_connections=POOL_CONNECTIONS, timeout_s=POOL_TIMEOUT_S,
                                **untimed_socket_options(url)), settings, graph)

    async def close(self) -> None:
        await self.redis.aclose()

    async def _run(self, name: lua.ScriptName, keys: Sequence[str], *argv: str | bytes) -> Any:
        return await self._scripts[name](keys=list(keys), args=list(argv))
