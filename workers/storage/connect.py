"""Connections by URL: one server (`redis://`, `rediss://`, `unix://`) or a Redis Cluster
(`redis+cluster://host:port`, `rediss+cluster://`: any node; the client finds the others).

A cluster needs the sharded key layout (`TL_SHARDS`): every script of a turn then touches one slot.
redis-py's `RedisCluster` routes each command, script call and pipeline part to its slot's node; it
is typed here as the single-server client whose commands it implements, so that the code using it
is one code path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast
from urllib.parse import urlsplit, urlunsplit

import redis

if TYPE_CHECKING:  # loaded by the asyncio clients' functions: a sync client (the CLI's) never needs them
    import redis.asyncio as aioredis

#: A cluster client's connections per node. redis-py's asyncio cluster pool does not block when it is
#: full (it raises), so its cap is set above what one process's stages and model calls hold at once.
CLUSTER_CONNECTIONS_PER_NODE = 1024
#: The URL schemes of a Redis Cluster, and the plain scheme each stands for.
CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}


class ClusterNeedsShards(ValueError):
    """A Redis Cluster URL with one server's key layout."""


def cluster_url(url: str) -> str | None:
    """The plain URL of a cluster's node when `url` names a cluster, else None."""
    parts = urlsplit(url)
    plain = CLUSTER_SCHEMES.get(parts.scheme)
    return urlunsplit((plain, parts.netloc, "", "", "")) if plain else None


def is_cluster(url: str) -> bool:
    return cluster_url(url) is not None


def require_shards(url: str, shards: int) -> None:
    """A `ClusterNeedsShards` error when `url` names a cluster and the layout has no shards."""
    if shards == 0 and is_cluster(url):
        raise ClusterNeedsShards("a Redis Cluster needs the sharded key layout: set TL_SHARDS (a multiple of the "
                                 "cluster's primaries, e.g. 48) before the first worker starts")


def sync_client(url: str, **options: Any) -> redis.Redis:
    """A client of `url`: `redis.Redis`, or `redis.RedisCluster` for a cluster URL."""
    plain = cluster_url(url)
    if plain is None:
        return redis.Redis.from_url(url, **options)
    return cast(redis.Redis, redis.RedisCluster.from_url(plain, **options))


def async_client(url: str, *, max_connections: int, timeout_s: float, **options: Any) -> aioredis.Redis:
    """An asyncio client of `url` whose pool blocks up to `timeout_s` for one of `max_connections`
    (a cluster's holds up to `CLUSTER_CONNECTIONS_PER_NODE` per node instead)."""
    import redis.asyncio as aioredis
    import redis.asyncio.cluster as aiocluster

    plain = cluster_url(url)
    if plain is None:
        pool = aioredis.BlockingConnectionPool.from_url(url, max_connections=max_connections, timeout=timeout_s,
                                                        **options)
        return aioredis.Redis(connection_pool=pool)
    return cast(aioredis.Redis, aiocluster.RedisCluster.from_url(plain, max_connections=CLUSTER_CONNECTIONS_PER_NODE,
                                                                 **options))


def async_plain_client(url: str, **options: Any) -> aioredis.Redis:
    """An asyncio client of `url` with redis-py's default pool (a cluster's: per node)."""
    import redis.asyncio as aioredis
    import redis.asyncio.cluster as aiocluster

    plain = cluster_url(url)
    if plain is None:
        return aioredis.Redis.from_url(url, **options)
    return cast(aioredis.Redis, aiocluster.RedisCluster.from_url(plain, **options))
