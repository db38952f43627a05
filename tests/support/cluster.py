"""A real Redis Cluster on this machine, for the tests that need one: `primaries` primaries, each with
`replicas` replicas, started with `redis-server --cluster-enabled yes` on free ports and joined with
`redis-cli --cluster create` (both ship with Redis 7). Nothing is persisted unless `persist` (an
append-only file fsynced at every write: a node stopped by `stop_node` and started again by
`start_node` comes back with its data); `stop` removes it all.

    with Cluster(tmp_path) as cluster:
        client = redis.RedisCluster.from_url(cluster.url)
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from types import TracebackType

import redis

#: A node that exits at start (a port taken between choosing and binding it) is started again on
#: other ports this many times.
START_TRIES = 5


def _free_port(taken: set[int]) -> int:
    """A free port whose cluster bus port (port + 10000, which a node also listens on) is free too,
    neither of them in `taken` (the other nodes' ports and bus ports, which they may not have bound
    yet): a node's bus port lies in the kernel's range of ports for outgoing connections, and once
    was another node's port."""
    while True:
        with socket.socket() as s, socket.socket() as bus:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
            if port + 10_000 >= 65_536 or {port, port + 10_000} & taken:
                continue
            try:
                bus.bind(("127.0.0.1", port + 10_000))
            except OSError:
                continue
            return port


@dataclass
class Node:
    port: int
    proc: subprocess.Popen[bytes]
    #: Where its output goes.
    log: Path
    #: The `redis-server` command line it was started with (`Cluster.start_node` runs it again).
    command: list[str] = field(default_factory=list)

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, socket_timeout=5)

    def role(self) -> str:
        return str(self.client().execute_command("ROLE")[0].decode())

    def alive(self) -> bool:
        return self.proc.poll() is None


@dataclass
class Cluster:
    workdir: Path
    primaries: int = 3
    replicas: int = 1
    #: How long a silent primary stays a primary before its replica takes over (ms).
    node_timeout_ms: int = 1_000
    #: Each node keeps an append-only file fsynced at every write (`--appendfsync always`).
    persist: bool = False
    nodes: list[Node] = field(default_factory=list)

    @staticmethod
    def available() -> bool:
        return bool(shutil.which("redis-server") and shutil.which("redis-cli"))

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.nodes[0].port}/0"

    @property
    def every_node_url(self) -> str:
        """Threadline's URL of the cluster, naming every node as a deployment does (a client whose
        first node is down still finds the cluster)."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{node.port}" for node in self.nodes)

    def start(self) -> Cluster:
        self.nodes = []
        for _ in range(self.primaries * (1 + self.replicas)):
            self.nodes.append(self._new_node())  # one at a time: each avoids the ports of those before it
        for i in range(len(self.nodes)):
            for _ in range(START_TRIES):
                node = self.nodes[i]
                _wait(partial(_up_or_gone, node), f"node {node.port} answers", detail=partial(_tail, node.log))
                if node.alive():
                    break
                self.nodes[i] = self._new_node()  # it exited: a port of it was taken after it was chosen
            else:
                raise RuntimeError(f"no node started in {START_TRIES} tries: {_tail(self.nodes[i].log)}")
        subprocess.run(["redis-cli", "--cluster", "create", *(f"127.0.0.1:{n.port}" for n in self.nodes),
                        "--cluster-replicas", str(self.replicas), "--cluster-yes"],
                       check=True, capture_output=True, timeout=60)
        _wait(self.ready, "the cluster's slots are all served")
        return self

    def _new_node(self) -> Node:
        port = _free_port({p for n in self.nodes for p in (n.port, n.port + 10_000)})
        home = self.workdir / str(port)
        home.mkdir(parents=True)
        persistence = ["--appendonly", "yes", "--appendfsync", "always"] if self.persist else ["--appendonly", "no"]
        command = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--cluster-enabled", "yes",
                   "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", str(self.node_timeout_ms),
                   "--save", "", *persistence, "--dir", str(home)]
        log = home / "redis.log"
        return Node(port, _launch(command, log), log, command)

    def ready(self) -> bool:
        try:
            info = self.nodes[0].client().cluster("INFO")
        except redis.RedisError:
            return False
        # a replica takes over only once it has synced: one still loading its primary's data would
        # leave the slots unserved if the primary died now
        replicas = sum(1 for n in self.nodes if n.alive() and n.role() == "slave" and _synced(n))
        return _state_ok(info) and replicas == self.replicas * self.primaries

    def primary_nodes(self) -> list[Node]:
        return [n for n in self.nodes if n.alive() and n.role() == "master"]

    def kill(self, node: Node) -> None:
        """SIGKILL one node (a primary dies with whatever it had not replicated yet)."""
        node.proc.kill()
        node.proc.wait(timeout=10)

    def stop_node(self, node: Node, timeout_s: float = 30) -> None:
        """Stop one node gracefully (SIGTERM: it flushes its append-only file and saves its cluster
        config); the others see it fail after `node_timeout_ms`, and a replica of a primary may take over."""
        node.proc.send_signal(signal.SIGTERM)
        node.proc.wait(timeout=timeout_s)

    def start_node(self, node: Node, timeout_s: float = 30) -> None:
        """Start a stopped node again with the same command (port, directory, cluster config), until
        it serves: its data loaded and the cluster ok in its view (a primary that rejoins waits a
        moment before it serves; one whose replica took over meanwhile rejoins as a replica)."""
        assert not node.alive(), f"node {node.port} is running"
        node.proc = _launch(node.command, node.log)

        def serving() -> bool:
            try:
                return _state_ok(node.client().cluster("INFO"))
            except redis.RedisError:
                return False

        _wait(serving, f"node {node.port} serves again", timeout_s)

    def wait_failover(self, killed: Node, timeout_s: float = 30) -> None:
        """Until a replica of the killed primary serves its slots and the cluster is ok again."""

        def ok() -> bool:
            for node in self.nodes:
                if node is killed or not node.alive():
                    continue
                try:
                    info = node.client().cluster("INFO")
                except redis.RedisError:
                    continue
                return _state_ok(info) and len(self.primary_nodes()) == self.primaries
            return False

        _wait(ok, "a replica took over the killed primary's slots", timeout_s)

    def stop(self) -> None:
        for node in self.nodes:
            if node.alive():
                node.proc.kill()
                node.proc.wait(timeout=10)

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


def _launch(command: list[str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)


def _up_or_gone(node: Node) -> bool:
    return not node.alive() or _pings(node.port)


def _tail(log: Path, lines: int = 5) -> str:
    if not log.exists():
        return "(no log)"
    return " | ".join(log.read_text(errors="replace").splitlines()[-lines:])


def _state_ok(info: object) -> bool:
    """CLUSTER INFO says every slot is served (redis-py parses the reply into a dict)."""
    state = info.get("cluster_state") if isinstance(info, dict) else None
    return state in ("ok", b"ok")


def _synced(node: Node) -> bool:
    """A replica's link to its primary is up (INFO replication)."""
    try:
        return node.client().info("replication").get("master_link_status") == "up"
    except redis.RedisError:
        return False


def _pings(port: int) -> bool:
    try:
        return bool(redis.Redis(port=port, socket_timeout=1).ping())
    except redis.RedisError:
        return False


def _wait(predicate: object, what: str, timeout_s: float = 30, detail: Callable[[], str] | None = None) -> None:
    assert callable(predicate)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise TimeoutError(f"{what}: {detail()}" if detail is not None else what)
