"""The three-primary cluster the cluster-mode tests will run on (`tests/support/cluster.py`): it
starts on this machine, serves every slot, and fails a killed primary over to its replica with the
writes that were replicated (WAIT) kept."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import redis
from redis.cluster import RedisCluster

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
