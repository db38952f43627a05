"""What every part of the store stands on: the async Redis connection, the settings, the stage graph,
the keys, and the scripts registered on the connection (one call each)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Self

import redis.asyncio as aioredis
from redis.commands.core import AsyncScript

from threadline.pipeline.stages import StageGraph
from threadline.workers.protocol.keys import Keys
from threadline.workers.settings import Settings
from threadline.workers.storage import lua

#: A worker process's connections to Redis for its stages, and how long a command waits for one.
POOL_CONNECTIONS = 64
POOL_TIMEOUT_S = 30.0


class StoreBase:
    def __init__(self, client: aioredis.Redis, settings: Settings, graph: StageGraph) -> None:
        self.redis = client
        self.settings = settings
        self.graph = graph
        self.keys = Keys(settings.prefix)
        self._scripts: dict[str, AsyncScript] = {
            name: client.register_script(lua.source(name)) for name in lua.SCRIPT_NAMES
        }

    @classmethod
    def connect(cls, url: str, settings: Settings, graph: StageGraph) -> Self:
        """A worker's store. Its pool blocks: a process holds hundreds of model calls on one event
        loop, and a burst of their writes waits for a free connection instead of failing."""
        pool = aioredis.BlockingConnectionPool.from_url(url, max_connections=POOL_CONNECTIONS,
                                                        timeout=POOL_TIMEOUT_S)
        return cls(aioredis.Redis(connection_pool=pool), settings, graph)

    async def close(self) -> None:
        await self.redis.aclose()

    async def _run(self, name: lua.ScriptName, keys: Sequence[str], *argv: str | bytes) -> Any:
        return await self._scripts[name](keys=list(keys), args=list(argv))
