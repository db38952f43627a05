"""A gateway process's Redis connections, each kind on a pool of its own, sized explicitly.

On one server, requests share one blocking pool of `TL_GATEWAY_POOL` connections: when all are busy
a request waits for one (up to `TL_GATEWAY_POOL_TIMEOUT_S`, then 503) instead of failing at once or
opening connections without bound. `/healthz` has two connections nobody else uses, so a load balancer's
probe answers while requests queue. Every event stream of the process shares one more connection
(`streams.py`). Each connection names itself (`CLIENT SETNAME tl-gateway:<pid>:<kind>`), so
`CLIENT LIST` shows what a gateway holds. On a Redis Cluster the requests use the cluster client's
pool per node (`storage/connect.py`), and the streams one connection per shard with open streams.
"""

from __future__ import annotations

import os
from typing import Any

import redis.asyncio as aioredis

from threadline.workers.settings import Settings
from threadline.workers.storage.connect import async_plain_client, is_cluster

#: `/healthz`'s own connections: probes rarely overlap, and never wait for the request pool.
HEALTH_CONNECTIONS = 2
#: A gateway's connections fail fast rather than hang on a server that stopped answering.
CONNECT_TIMEOUT_S = 5.0


def client_name(kind: str) -> str:
    return f"tl-gateway:{os.getpid()}:{kind}"


def blocking_client(url: str, *, kind: str, size: int, timeout_s: float, **options: Any) -> aioredis.Redis:
    """A client over a blocking pool of `size` connections named for `kind`."""
    pool = aioredis.BlockingConnectionPool.from_url(url, max_connections=size, timeout=timeout_s,
                                                   client_name=client_name(kind),
                                                   socket_connect_timeout=CONNECT_TIMEOUT_S, **options)
    return aioredis.Redis(connection_pool=pool)


def request_pool(settings: Settings, url: str) -> aioredis.BlockingConnectionPool:
    """The pool of a process's requests (also what the streams use for short reads)."""
    client = blocking_client(url, kind="requests", size=settings.gateway_pool,
                             timeout_s=settings.gateway_pool_timeout_s)
    pool = client.connection_pool
    assert isinstance(pool, aioredis.BlockingConnectionPool)
    return pool


def health_client(url: str) -> aioredis.Redis:
    """`/healthz`'s client: a ping answers within a few seconds, or it is a 503 (a cluster's: its
    client's pool per node)."""
    if is_cluster(url):
        return async_plain_client(url, client_name=client_name("health"), socket_timeout=2.0,
                                  socket_connect_timeout=CONNECT_TIMEOUT_S)
    return blocking_client(url, kind="health", size=HEALTH_CONNECTIONS, timeout_s=2.0, socket_timeout=2.0)


def use_pool(client: aioredis.Redis, pool: aioredis.ConnectionPool) -> None:
    """Put a client (`AsyncClient.redis`, whose scripts are registered on it) on `pool` before its
    first command: its own default pool (100 connections, then "Too many connections") never opens one."""
    client.connection_pool = pool
