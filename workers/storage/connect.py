"""Connections by URL: one server (`redis://`, `rediss://`, `unix://`) or a Redis Cluster
(`redis+cluster://host:port[,host:port...]`, `rediss+cluster://`: the nodes to start from; the
client finds the others, and name several so that a client whose first node is down still finds the
cluster).

A cluster needs the sharded key layout (`TL_SHARDS`): every script of a turn then touches one slot.
redis-py's `RedisCluster` routes each command, script call and pipeline part to its slot's node; it
is typed here as the single-server client whose commands it implements, so that the code using it
is one code path.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, cast
from urllib.parse import urlsplit, urlunsplit

import redis

if TYPE_CHECKING:  # loaded by the asyncio clients' functions: a sync client (the CLI's) never needs them
    import redis.asyncio as aioredis

#: A cluster client's connections per node. redis-py's asyncio cluster pool does not block when it is
#: full (it raises), so its cap is set above what one process's stages and model calls hold at once.
CLUSTER_CONNECTIONS_PER_NODE = 1024
#: A cluster client's retries of a command whose node failed (it re-reads the topology between
#: them): exponential from 0.1 s to 1 s, 20 times, which outlasts a primary's failover (a few
#: seconds with `cluster-node-timeout` 1 s; `tests/cluster`).
CLUSTER_RETRIES = 20
CLUSTER_BACKOFF_S = (0.1, 1.0)
#: What an asyncio cluster client does on a MOVED reply: patch that slot's node and go on. redis-py's
#: default (every 5th MOVED) closes *every* connection of the client, those other requests are using
#: included, which then fail (`'NoneType' object has no attribute 'writelines'`): a burst of first
#: commands on a client not yet initialized is routed to its default node, so that default turned a
#: burst of 150 event streams on a gateway into 500s.
CLUSTER_REINITIALIZE_STEPS = 0
#: The errors of a server, or a cluster, that is away for a while: a caller that must not give up
#: (an enqueue whose message is acked right after) waits them out. A cluster answers CLUSTERDOWN
#: while a failed primary has no replica serving its slots yet, and TRYAGAIN while a slot moves.
OUTAGE_ERRORS: tuple[type[Exception], ...] = (redis.ConnectionError, redis.TimeoutError,
                                              redis.exceptions.ClusterDownError, redis.exceptions.TryAgainError)
#: The sockets of a worker's store (`StoreBase.connect`): no per-command timeout, the kernel finds a
#: peer that is gone instead. redis-py 8's default 5 s socket timeout costs every command an asyncio
#: task around its write and a timer around its read: 6-11% of the client's CPU per command
#: (`bench.redis_client`, docs/capacity.md). Without it a reset or a refused connection still
#: fails at once (a restart, a killed server); a peer gone without a reset fails a command once its
#: writes go unacknowledged for `TCP_USER_TIMEOUT` or, with nothing unacknowledged, once keepalive
#: probes go unanswered: within ~11 s either way, where the timeout took 5 s. A server that is stopped
#: but whose host answers (SIGSTOP) keeps a command waiting until it resumes.
DEAD_PEER_S = (5, 2, 3)  # keepalive: idle seconds before the first probe, seconds between, probes
DEAD_PEER_WRITE_MS = 10_000


def untimed_socket_options(url: str) -> dict[str, Any]:
    """redis-py connection options for a client of `url` with no socket timeout, and on TCP with
    `DEAD_PEER_S` and `DEAD_PEER_WRITE_MS` (the options a platform lacks are left out; a Unix
    socket's peer is on this host, and its reset is never lost)."""
    import socket

    if urlsplit(url).scheme == "unix":
        return {"socket_timeout": None}
    idle, interval, probes = DEAD_PEER_S
    wanted = {"TCP_KEEPIDLE": idle, "TCP_KEEPALIVE": idle, "TCP_KEEPINTVL": interval, "TCP_KEEPCNT": probes,
              "TCP_USER_TIMEOUT": DEAD_PEER_WRITE_MS}
    options = {getattr(socket, name): value for name, value in wanted.items() if hasattr(socket, name)}
    return {"socket_timeout": None, "socket_keepalive": True, "socket_keepalive_options": options}


#: The URL schemes of a Redis Cluster, and the plain scheme each stands for.
CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}


class ClusterNeedsShards(ValueError):
    """A Redis Cluster URL with one server's key layout."""


def cluster_url(url: str) -> str | None:
    """The plain URL of a cluster's first node when `url` names a cluster, else None."""
    nodes = cluster_nodes(url)
    if nodes is None:
        return None
    host, port = nodes[2][0]
    return node_url(url, host, port)


def cluster_nodes(url: str) -> tuple[str, str, list[tuple[str, int]]] | None:
    """A cluster URL's plain scheme, its `user:password@` part ("" without) and its nodes."""
    parts = urlsplit(url)
    plain = CLUSTER_SCHEMES.get(parts.scheme)
    if plain is None:
        return None
    user, _, hosts = parts.netloc.rpartition("@")
    nodes = []
    for address in hosts.split(","):
        host, _, port = address.rpartition(":")
        nodes.append((host or address, int(port) if port.isdigit() else 6379))
    return plain, f"{user}@" if user else "", nodes


def node_url(url: str, host: str, port: int) -> str:
    """The plain URL of one node of the cluster `url` names (its scheme and credentials)."""
    nodes = cluster_nodes(url)
    assert nodes is not None, "not a cluster URL"
    scheme, user, _ = nodes
    return urlunsplit((scheme, f"{user}{host}:{port}", "", "", ""))


def nodes_serving(url: str, keys: Iterable[str]) -> dict[str, list[str]]:
    """The plain URL of each node serving some of `keys`' slots, with those keys (one server's URL:
    itself, with all of them). A shard channel (`SSUBSCRIBE`) is heard on its slot's node only."""
    if not is_cluster(url):
        return {url: list(keys)}
    client = cast(Any, sync_client(url))
    try:
        found: dict[str, list[str]] = {}
        for key in keys:
            node = client.get_node_from_key(key)
            found.setdefault(node_url(url, node.host, node.port), []).append(key)
        return found
    finally:
        client.close()


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
    from redis.backoff import ExponentialWithJitterBackoff
    from redis.cluster import ClusterNode
    from redis.retry import Retry

    base, cap = CLUSTER_BACKOFF_S
    retry = Retry(ExponentialWithJitterBackoff(base=base, cap=cap), CLUSTER_RETRIES)
    nodes = [ClusterNode(host, port) for host, port in _nodes(url)]  # type: ignore[no-untyped-call]
    return cast(redis.Redis, redis.RedisCluster.from_url(plain, startup_nodes=nodes, retry=retry, **options))


def async_client(url: str, *, max_connections: int, timeout_s: float, **options: Any) -> aioredis.Redis:
    """An asyncio client of `url` whose pool blocks up to `timeout_s` for one of `max_connections`
    (a cluster's holds up to `CLUSTER_CONNECTIONS_PER_NODE` per node instead)."""
    import redis.asyncio as aioredis

    if not is_cluster(url):
        pool = aioredis.BlockingConnectionPool.from_url(url, max_connections=max_connections, timeout=timeout_s,
                                                        **options)
        return aioredis.Redis(connection_pool=pool)
    return _async_cluster(url, **options)


def async_plain_client(url: str, **options: Any) -> aioredis.Redis:
    """An asyncio client of `url` with redis-py's default pool (a cluster's: up to
    `CLUSTER_CONNECTIONS_PER_NODE` per node)."""
    import redis.asyncio as aioredis

    if not is_cluster(url):
        return aioredis.Redis.from_url(url, **options)
    return _async_cluster(url, **options)


def _async_cluster(url: str, **options: Any) -> aioredis.Redis:
    """redis-py's asyncio cluster client of the cluster `url` names. Its pool per node does not wait
    when it is full (it raises `MaxConnectionsError`): its default cap of 100 turned a gateway's burst
    of 150 event streams into 503s, so the cap is `CLUSTER_CONNECTIONS_PER_NODE`."""
    import redis.asyncio.cluster as aiocluster

    plain = cluster_url(url)
    assert plain is not None
    return cast("aioredis.Redis", aiocluster.RedisCluster.from_url(
        plain, startup_nodes=_async_nodes(url), max_connections=CLUSTER_CONNECTIONS_PER_NODE, retry=_async_retry(),
        reinitialize_steps=CLUSTER_REINITIALIZE_STEPS, **options))


def _nodes(url: str) -> list[tuple[str, int]]:
    found = cluster_nodes(url)
    assert found is not None
    return found[2]


def _async_nodes(url: str) -> list[Any]:
    from redis.asyncio.cluster import ClusterNode

    return [ClusterNode(host, port) for host, port in _nodes(url)]


def _async_retry() -> Any:
    from redis.asyncio.retry import Retry
    from redis.backoff import ExponentialWithJitterBackoff

    base, cap = CLUSTER_BACKOFF_S
    return Retry(ExponentialWithJitterBackoff(base=base, cap=cap), CLUSTER_RETRIES)
