"""The HTTP gateway served by a real uvicorn on a free port, in a background thread, for tests."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import redis
import uvicorn

from tests.support.local_http import free_port
from tests.support.wait import wait_until
from threadline.workers.gateway.app import create_app
from threadline.workers.settings import Settings


@contextlib.contextmanager
def running_gateway(settings: Settings, url: str) -> Iterator[str]:
    """The gateway's base URL while it runs."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(settings, url), host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.started, timeout_s=10)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def _client_lists(r: redis.Redis) -> Iterator[tuple[str, dict[str, object]]]:
    """(node, entry) of CLIENT LIST on every server `r` reaches: each primary of a cluster."""
    if isinstance(r, redis.RedisCluster):
        for node in r.get_primaries():
            for entry in r.client_list(target_nodes=node):
                yield node.name, entry
    else:
        for entry in r.client_list():
            yield "", entry


def gateway_connections(r: redis.Redis, pid: int, *, besides: frozenset[str] = frozenset()) -> dict[str, int]:
    """The Redis connections of the gateways running in process `pid`, by kind (requests, health,
    streams), from the names they give them in CLIENT LIST (on every primary of a cluster); but those
    in `besides` (another gateway's of the same process, from `gateway_connection_ids`)."""
    mine = f"tl-gateway:{pid}:"
    kinds: dict[str, int] = {}
    for node, entry in _client_lists(r):
        name = str(entry.get("name", ""))
        if name.startswith(mine) and f"{node}/{entry.get('id')}" not in besides:
            kinds[name.removeprefix(mine)] = kinds.get(name.removeprefix(mine), 0) + 1
    return kinds


def gateway_connection_ids(r: redis.Redis, pid: int) -> frozenset[str]:
    """The gateway connections process `pid` holds now (node and CLIENT LIST id): taken before a test
    starts its own gateway, they leave out what earlier tests' gateways still hold."""
    mine = f"tl-gateway:{pid}:"
    return frozenset(f"{node}/{e.get('id')}" for node, e in _client_lists(r) if str(e.get("name", "")).startswith(mine))
