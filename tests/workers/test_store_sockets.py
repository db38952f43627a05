"""A worker's store talks to Redis without a timer per command: its sockets have no timeout, and the
kernel finds a peer that is gone (keepalive probes, and a bound on unacknowledged writes)."""

from __future__ import annotations

import socket
import sys
from typing import Any

import pytest

from threadline.pipeline.stages import DEFAULT_GRAPH
from threadline.workers.settings import Settings
from threadline.workers.storage.connect import DEAD_PEER_S, DEAD_PEER_WRITE_MS, is_cluster
from threadline.workers.storage.store import Store

pytestmark = pytest.mark.integration


def _sockets(client: Any) -> list[socket.socket]:
    """The connected sockets of a one-server client's pool."""
    return [c._writer.transport.get_extra_info("socket") for c in client.connection_pool._available_connections
            if c._writer is not None]


async def test_the_stores_sockets_have_no_timeout_and_the_kernel_finds_a_dead_peer(own_prefix: str,
                                                                                     redis_url: str) -> None:
    if is_cluster(redis_url):
        pytest.skip("the asyncio cluster client keeps its connections per node elsewhere: one server's here")
    settings = Settings.from_env({"TL_PREFIX": own_prefix, "REDIS_URL": redis_url})
    store = Store.connect(redis_url, settings, DEFAULT_GRAPH)
    try:
        await store.redis.ping()  # a connection made and back in the pool
        (sock,) = _sockets(store.redis)
        (connection,) = store.redis.connection_pool._available_connections
        assert connection.socket_timeout is None  # redis-py 8's default is 5 s: a task and a timer per command
        assert sock.gettimeout() in (None, 0.0)  # asyncio's sockets are non-blocking, never timed
        if sock.family == socket.AF_UNIX:
            return
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        if sys.platform.startswith("linux"):
            idle, interval, probes = DEAD_PEER_S
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == idle
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL) == interval
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT) == probes
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == DEAD_PEER_WRITE_MS
        # and the store works on them: a script call of a stage
        assert await store.redis.eval("return 1", 0) == 1
    finally:
        await store.close()


def test_a_store_on_a_unix_socket_is_made_without_the_tcp_options() -> None:
    """redis-py's Unix socket connection takes no keepalive options (a TypeError at its first
    command): a store of a `unix://` URL gets only the timeout's absence."""
    url = "unix:///tmp/threadline-no-such.sock"
    settings = Settings.from_env({"REDIS_URL": url})
    store = Store.connect(url, settings, DEFAULT_GRAPH)
    connection = store.redis.connection_pool.make_connection()  # type: ignore[no-untyped-call]  # its first command
    assert connection.socket_timeout is None
