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


def gateway_connections(r: redis.Redis, pid: int) -> dict[str, int]:
    """The Redis connections of the gateway running in process `pid`, by kind (requests, health,
    streams), from the names it gives them in CLIENT LIST."""
    mine = f"tl-gateway:{pid}:"
    kinds: dict[str, int] = {}
    for entry in r.client_list():
        name = str(entry.get("name", ""))
        if name.startswith(mine):
            kinds[name.removeprefix(mine)] = kinds.get(name.removeprefix(mine), 0) + 1
    return kinds
