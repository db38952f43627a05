"""The servers the chaos test runs on, one shape for both: `url` (what the workers and clients are
given), `env` (the workers' settings the server needs), `start()`, `stop(near_key=...)` (the restart's
stop: the server, or on a cluster the primary serving `near_key`'s slot) and `close()`.

- `OneServer`: one persisted Valkey (`Restartable`), stopped and started again.
- `ClusterServer` (`TL_TEST_CLUSTER=N`): a Redis Cluster of N primaries with a replica each, every
  node persisted (`--appendfsync always`); the restart stops one primary gracefully and starts it
  again on the same port and directory. Its replica may take over meanwhile (the node then rejoins
  as a replica), or not (it comes back as the primary, with its data).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Protocol, cast

from redis.cluster import RedisCluster

from tests.support.cluster import Cluster, Node
from tests.support.restartable import Restartable
from threadline.workers.storage.connect import sync_client


class ChaosServer(Protocol):
    @property
    def url(self) -> str: ...

    @property
    def env(self) -> dict[str, str]: ...

    def start(self) -> None: ...

    def stop(self, near_key: str | None = None) -> None: ...

    def close(self) -> None: ...

    def describe(self) -> dict[str, Any]: ...


class OneServer(Restartable):
    """The one persisted server: `stop` stops it, whatever the key."""

    def __init__(self, data_dir: Path) -> None:
        super().__init__(data_dir)
        self.env: dict[str, str] = {}

    def stop(self, near_key: str | None = None) -> None:
        super().stop()

    def close(self) -> None:
        super().stop()

    def describe(self) -> dict[str, Any]:
        return {"kind": "one server"}


class ClusterServer:
    """A persisted Redis Cluster of `primaries` primaries and a replica each, in the sharded layout
    (2 shards per primary). `start` starts it all the first time, and after a `stop` the node it
    stopped."""

    def __init__(self, workdir: Path, primaries: int) -> None:
        self.cluster = Cluster(workdir, primaries=primaries, replicas=1, persist=True)
        self.env = {"TL_SHARDS": str(2 * primaries)}
        self.stopped: Node | None = None
        #: What the restart did: the port of the primary it stopped, and that node's role once back.
        self.restarted: dict[str, Any] = {}

    @property
    def url(self) -> str:
        return self.cluster.every_node_url

    def start(self) -> None:
        if not self.cluster.nodes:
            self.cluster.start()
            return
        assert self.stopped is not None, "nothing stopped"
        self.cluster.start_node(self.stopped)
        self.restarted["role_after"] = self.stopped.role()
        self.stopped = None

    def stop(self, near_key: str | None = None) -> None:
        """Stop (SIGTERM) the primary serving `near_key`'s slot (None: the first primary)."""
        node = self.primary_of(near_key) if near_key is not None else self.cluster.primary_nodes()[0]
        self.restarted = {"port": node.port, "near_key": near_key}
        self.cluster.stop_node(node)
        self.stopped = node

    def primary_of(self, key: str) -> Node:
        client = cast(RedisCluster, sync_client(self.url))
        try:
            port = client.get_node_from_key(key).port  # type: ignore[no-untyped-call]
        finally:
            client.close()
        return next(n for n in self.cluster.nodes if n.port == port)

    def close(self) -> None:
        self.cluster.stop()

    def describe(self) -> dict[str, Any]:
        return {"kind": "cluster", "primaries": self.cluster.primaries, "replicas": self.cluster.replicas,
                "shards": int(self.env["TL_SHARDS"]), "restart": self.restarted}


def chaos_server(workdir: Path) -> ChaosServer:
    """A `ClusterServer` of `TL_TEST_CLUSTER` primaries when that is set, else a `OneServer`; not started."""
    primaries = int(os.environ.get("TL_TEST_CLUSTER") or 0)
    if primaries:
        return ClusterServer(workdir / "cluster", primaries)
    return OneServer(workdir / "valkey")
