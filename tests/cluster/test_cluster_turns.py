"""Threadline on a real Redis Cluster (`tests/support/cluster.py`: three primaries, a replica each,
on this machine): sharded workers and the Python client on a `redis+cluster://` URL run turns whose
keys spread over every primary, and a primary killed mid-run fails over with every turn ending
exactly once."""

from __future__ import annotations

import dataclasses
import threading
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from dramatiq.message import Message
from redis.cluster import RedisCluster

from tests.conftest import WorkerPool, turn
from tests.support.cluster import Cluster
from tests.support.turns import all_events, python_model
from tests.support.wait import wait_until
from threadline.pipeline import events as ev
from threadline.pipeline.config import AgentConfig
from threadline.pipeline.stages import DEFAULT_GRAPH
from threadline.workers.clients.client import Client
from threadline.workers.protocol.keys import Keys
from threadline.workers.protocol.names import SHARD_OPTION
from threadline.workers.settings import Settings
from threadline.workers.worker.broker import DoorbellBroker, DoorbellConsumer
from threadline.workers.worker.process import create_broker
from threadline.workers.worker.reachability import RETRY_MIN_S

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not Cluster.available(), reason="redis-server is not installed")]

#: A multiple of the three primaries: each holds two shards.
SHARDS = 6


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    with Cluster(tmp_path / "cluster") as started:
        yield started


def pool_on(cluster: Cluster, tmp_path: Path, **env: str) -> WorkerPool:
    return WorkerPool(cluster.every_node_url, f"tlc{uuid.uuid4().hex[:8]}", tmp_path,
                      env={"TL_SHARDS": str(SHARDS), **env})


def first_turn_ids(layout: Keys, per_shard: int) -> list[str]:
    """Turn ids whose conversations (`c-<turn id>`) fill every shard `per_shard` times."""
    found: dict[int, list[str]] = {i: [] for i in range(SHARDS)}
    while any(len(ids) < per_shard for ids in found.values()):
        turn_id = f"t-{uuid.uuid4().hex[:12]}"
        ids = found[layout.shard_of(f"c-{turn_id}") or 0]
        if len(ids) < per_shard:
            ids.append(turn_id)
    return [t for ids in found.values() for t in ids]


def test_turns_run_on_a_three_primary_cluster(cluster: Cluster, tmp_path: Path) -> None:
    pool = pool_on(cluster, tmp_path).start(processes=2, threads=4)
    client = Client(pool.url, prefix=pool.prefix)
    try:
        client.put_agent(AgentConfig.model_validate({"id": "echo", "model": "offline:echo"}))
        layout = Keys(pool.prefix, SHARDS)
        firsts = [client.submit(turn("echo", f"hello {t}", turn_id=t)) for t in first_turn_ids(layout, 3)]
        assert all(isinstance(client.wait(t, timeout_s=120), ev.Succeeded) for t in firsts)
        conversations = [client.turn_state(t).conversation_id for t in firsts]
        seconds = [client.submit(turn("echo", "and again", conversation_id=c)) for c in conversations]
        assert all(isinstance(client.wait(t, timeout_s=120), ev.Succeeded) for t in seconds)
        assert [len(client.thread(c)) for c in conversations] == [2] * len(conversations)

        # the turns' keys are on every primary, two shards each
        node = RedisCluster.from_url(cluster.url)
        primaries = Counter(node.get_node_from_key(layout.on(i).running()).port for i in range(SHARDS))
        assert sorted(primaries.values()) == [2, 2, 2], primaries
        held = Counter(node.get_node_from_key(layout.of_conversation(c).turn(t)).port
                       for t, c in zip(firsts, conversations, strict=True))
        assert len(held) == 3, held
        node.close()

        cancelled = client.submit(turn("echo", "never mind", conversation_id=conversations[0]))
        client.cancel(cancelled, "changed my mind")
        assert client.wait(cancelled, timeout_s=60).type in ("cancelled", "succeeded")
        assert client.delete_conversation(conversations[1], tenant_id="t1").status == "deleted"
        assert client.thread(conversations[1]) == []
    finally:
        client.close()
        pool.discard()


def test_a_killed_primary_fails_over_and_every_turn_ends_once(cluster: Cluster, tmp_path: Path) -> None:
    """A primary holding two shards is SIGKILLed while 36 streaming turns run (default recovery
    settings); its replica takes over and the workers' clients follow the new topology. Every turn
    ends once, succeeded, and its events have no gap."""
    pool = pool_on(cluster, tmp_path).start(processes=2, threads=4)
    client = Client(pool.url, prefix=pool.prefix)
    try:
        client.put_agent(AgentConfig.model_validate(
            {"id": "slow", "model": python_model("streaming", words=30, delay_ms=40)}))
        layout = Keys(pool.prefix, SHARDS)
        turns = [client.submit(turn("slow", f"go {t}", turn_id=t)) for t in first_turn_ids(layout, 6)]
        wait_until(lambda: sum(client.turn_state(t).status != "" for t in turns) >= 12, timeout_s=60)
        victim = cluster.primary_nodes()[0]
        cluster.kill(victim)
        cluster.wait_failover(victim)
        ends: dict[str, list[str]] = {}
        for turn_id in turns:
            client.wait(turn_id, timeout_s=180)
            seen = all_events(client, turn_id)
            assert [e.seq for e in seen] == list(range(1, len(seen) + 1)), (turn_id, seen)
            ends[turn_id] = [e.type for e in seen if isinstance(e, ev.Terminal)]
        outcomes = Counter(types[0] for types in ends.values() if len(types) == 1)
        print(f"after a primary's failover: {dict(outcomes)} of {len(turns)} turns")
        assert all(len(types) == 1 for types in ends.values()), ends
        # nothing lost: the stages that failed on the dead node ran again once it was replaced
        assert outcomes == {"succeeded": len(turns)}, outcomes
    finally:
        client.close()
        pool.discard()


def first_stage_broker(url: str, *, tag: str) -> tuple[DoorbellBroker, str, str]:
    """A sharded broker on the cluster at `url`, under a prefix of its own; the first stage's queue
    and actor name."""
    settings = dataclasses.replace(Settings.from_env({}), prefix=f"{tag}{uuid.uuid4().hex[:6]}", redis_url=url,
                                   shards=SHARDS)
    broker = create_broker(settings, url)
    queue = DEFAULT_GRAPH.first.queue
    return broker, queue, next(name for name, a in broker.actors.items() if a.queue_name == queue)


def test_a_retry_enqueued_while_the_cluster_is_down_waits_for_it(tmp_path: Path) -> None:
    """dramatiq's Retries enqueues a failed message's retry, then the message is acked. A cluster
    whose stopped primary has no replica answers CLUSTERDOWN to every command until that primary is
    back: the broker waits that out as it does a lost connection, or the message is lost (a turn's
    admit message was, once, in the chaos test on a cluster)."""
    with Cluster(tmp_path / "down", replicas=0) as down:
        url = down.every_node_url
        broker, queue, actor = first_stage_broker(url, tag="tlq")
        message = Message(queue_name=queue, actor_name=actor, args=({"turn_id": "t"},), kwargs={},
                          options={SHARD_OPTION: 0})
        delayed = broker.keys.on(0).queue_messages(f"{queue}.DQ")
        reader = RedisCluster.from_url(url.replace("redis+cluster://", "redis://").split(",")[0])
        serving = reader.get_node_from_key(delayed).port
        done: list[Message[Any]] = []
        try:
            # a primary that does not serve the message's shard: the cluster refuses every slot
            victim = next(n for n in down.primary_nodes() if n.port != serving)
            down.stop_node(victim)
            witness = next(n for n in down.nodes if n.alive())
            wait_until(lambda: witness.client().cluster("INFO").get("cluster_state") in ("fail", b"fail"),
                       timeout_s=30)
            enqueuing = threading.Thread(target=lambda: done.append(broker.enqueue(message, delay=10)))
            enqueuing.start()
            # it failed, waited its backoff and failed again: waiting, not given up
            wait_until(lambda: broker.reachability.retry_in("enqueue") >= 2 * RETRY_MIN_S or not enqueuing.is_alive(),
                       timeout_s=60)
            assert enqueuing.is_alive() and not done
            down.start_node(victim)
            enqueuing.join(timeout=60)
            assert not enqueuing.is_alive() and len(done) == 1
            assert reader.hexists(delayed, done[0].options["redis_message_id"])
        finally:
            reader.close()
            broker.before_shutdown()
            broker.close()


def test_a_fetch_sent_again_on_a_new_connection_leaves_no_orphan(tmp_path: Path) -> None:
    """A cluster client sends a command whose node failed again, on a new connection, once the
    topology says where (`connect.CLUSTER_RETRIES`). A fetch that ran on a primary killed before its
    reply left runs once more on the replica: what the first run moved into the ack set comes back
    in no reply, and nothing but this consumer would ever put it back (its process lives). A turn
    whose admit message it was waited in its conversation's line for ever, once, in the chaos test.
    Here the first run's effect is made by hand and the connection dropped: the consumer's next
    fetch reconnects, and the one after it finds the orphan back in the queue."""
    with Cluster(tmp_path / "retry", replicas=0) as small:
        url = small.every_node_url
        broker, queue, actor = first_stage_broker(url, tag="tlr")
        on = broker.keys.on(0)
        admin = RedisCluster.from_url(url.replace("redis+cluster://", "redis://").split(",")[0])
        try:
            consumer = broker.consume(queue, prefetch=1, timeout=50)
            assert isinstance(consumer, DoorbellConsumer)
            assert next(consumer) is None  # its first look (a new consumer's sweep) is done
            orphan = broker.enqueue(Message(queue_name=queue, actor_name=actor, args=({"turn_id": "t"},), kwargs={},
                                            options={SHARD_OPTION: 0})).options["redis_message_id"]
            # the first run of a fetch: the id moved from the queue to this process's ack set, no reply
            assert admin.lrem(on.queue(queue), 0, orphan) == 1
            admin.sadd(on.acks(broker.broker_id, queue), orphan)
            node = admin.get_node_from_key(on.queue(queue))
            killed = redis.Redis(host=node.host, port=node.port).client_kill_filter(_type="normal", skipme=True)
            assert killed >= 1  # the broker's connections to that primary

            got: list[str] = []

            def fetched() -> bool:
                message = next(consumer)
                if message is not None:
                    got.append(message.options["redis_message_id"])
                return bool(got)

            wait_until(fetched, timeout_s=30)
            assert got == [orphan]
            assert admin.smembers(on.acks(broker.broker_id, queue)) == {orphan.encode()}  # held now, once
        finally:
            admin.close()
            broker.before_shutdown()
            broker.close()
