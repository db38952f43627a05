"""The three-primary cluster the cluster-mode tests will run on (`tests/support/cluster.py`): it
starts on this machine, serves every slot, and fails a killed primary over to its replica with the
writes that were replicated (WAIT) kept."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest
import redis
from redis.cluster import RedisCluster

from tests.support import cluster as support_cluster
from tests.support.cluster import Cluster

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not Cluster.available(), reason="redis-server is not installed")]


def test_a_killed_primary_fails_over_with_its_replicated_writes(tmp_path: Path) -> None:
    with Cluster(tmp_path) as cluster:
        client = RedisCluster.from_url(cluster.url)
        keys = [f"harness:{{{i}}}" for i in range(300)]  # tags spread over every primary
        for key in keys:
            client.set(key, key)
        for node in cluster.primary_nodes():
            node.client().execute_command("WAIT", 1, 5000)
        nodes = {client.get_node_from_key(k).port for k in keys}
        assert len(nodes) == 3, nodes

        victim = cluster.primary_nodes()[0]
        t0 = time.monotonic()
        cluster.kill(victim)
        cluster.wait_failover(victim)
        failover_s = time.monotonic() - t0
        client.close()
        client = RedisCluster(host="127.0.0.1", port=cluster.primary_nodes()[0].port)
        assert [client.get(k) for k in keys] == [k.encode() for k in keys]
        assert failover_s < 30
        print(f"failover of a killed primary: {failover_s:.1f} s")
        client.close()
        with pytest.raises(redis.ConnectionError):
            victim.client().ping()


def test_a_node_whose_bus_port_is_taken_is_started_again_on_other_ports(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A node listens on its port and on port + 10000 (its bus), which a client connection or another
    node may hold by the time it binds: such a node exits at start, and the harness starts another on
    other ports instead of waiting for it (a fresh-check once failed so, two nodes 10000 apart)."""
    real = support_cluster._free_port
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        blocked = held.getsockname()[1] - 10_000
        assert blocked > 1024
        calls = iter([blocked])
        monkeypatch.setattr(support_cluster, "_free_port", lambda taken: next(calls, None) or real(taken))
        with Cluster(tmp_path, replicas=0) as cluster:
            assert blocked not in [n.port for n in cluster.nodes]
            client = RedisCluster.from_url(cluster.url)
            assert client.set("harness:again", "1")
            client.close()
        log = (tmp_path / str(blocked) / "redis.log").read_text()
        assert "Address already in use" in log, log
