"""An HTTP server on 127.0.0.1 and a free port, serving in a background thread: the base of the
test doubles of model servers (`strict_server`, `fake_providers`)."""

from __future__ import annotations

import functools
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Self


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LocalServer:
    def __init__(self, handler: type[BaseHTTPRequestHandler], *, name: str) -> None:
        self._http = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._http.daemon_threads = True
        # a short poll keeps `stop()` quick: shutdown waits for the serving loop's next poll
        serve = functools.partial(self._http.serve_forever, poll_interval=0.05)
        self._thread = threading.Thread(target=serve, name=name, daemon=True)

    @property
    def url(self) -> str:
        host, port = self._http.server_address[:2]
        return f"http://{host!s}:{port}"

    def start(self) -> Self:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._http.shutdown()
        self._http.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
