"""A consumer that lost its connection leaves messages in its process's ack set that nothing in the
process holds any more: the ones it had fetched but not handed out (dramatiq drops them with the
consumer), and the ones of a fetch whose reply never arrived. dramatiq gives those back only when
the process is gone, so their turns would wait for the watchdog's stall time; the next consumer of
the queue puts them back before its first fetch, and leaves alone what the process still holds.

A stage that hands its turn over acks its own message in the same script (`advance.lua`,
`finish.lua`, on the keys of the message's shard), and its worker then sends no ack of its own
(`DoorbellConsumer._settled`). Were the script to ack other keys, nothing would fail at once: the
messages would stay in the workers' ack sets and their bodies in the queues."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from dramatiq.errors import ConnectionClosed
from dramatiq.message import Message
from prometheus_client import REGISTRY

from tests.conftest import WorkerPool, close_broker, turn
from threadline.pipeline import events as ev
from threadline.pipeline.config import AgentConfig
from threadline.pipeline.stages import DEFAULT_GRAPH
from threadline.workers.clients.client import Client
from threadline.workers.protocol.names import SHARD_OPTION
from threadline.workers.settings import Settings, shards_from_env
from threadline.workers.storage.base import in_shard
from threadline.workers.storage.connect import async_plain_client
from threadline.workers.storage.store import Store
from threadline.workers.storage.turns import Next
from threadline.workers.worker.broker import DoorbellBroker, DoorbellConsumer
from threadline.workers.worker.process import create_broker

pytestmark = pytest.mark.integration

QUEUE = DEFAULT_GRAPH.stages[1].queue
#: The shard the messages go to (the sharded layout's enqueue needs one; one server's has one).
SHARD = 0


def make_broker(redis_url: str, **settings: Any) -> DoorbellBroker:
    return create_broker(dataclasses.replace(
        Settings.from_env({}), prefix=f"tlo{uuid.uuid4().hex[:8]}", redis_url=redis_url,
        shards=shards_from_env(),  # the session's layout (a cluster's is sharded)
        **settings), redis_url)


@pytest.fixture
def broker(redis_url: str) -> Iterator[DoorbellBroker]:
    made = make_broker(redis_url)
    yield made
    close_broker(made, redis_url)


@pytest.fixture
def polling_broker(redis_url: str) -> Iterator[DoorbellBroker]:
    """One whose consumers that find nothing wait 50 ms, not a poll interval."""
    made = make_broker(redis_url, idle_poll_ms=50, delay_poll_ms=50)
    yield made
    close_broker(made, redis_url)


def work_for(broker: DoorbellBroker, turn_id: str) -> Message[Any]:
    actor = next(name for name, a in broker.actors.items() if a.queue_name == QUEUE)
    return Message(queue_name=QUEUE, actor_name=actor, args=({"turn_id": turn_id},), kwargs={},
                   options={SHARD_OPTION: SHARD} if broker.keys.shards else {})


def enqueue(broker: DoorbellBroker, n: int) -> list[str]:
    return [broker.enqueue(work_for(broker, f"t{i}")).options["redis_message_id"] for i in range(n)]


def acks_key(broker: DoorbellBroker) -> str:
    return broker.keys.on(SHARD).acks(broker.broker_id, QUEUE)


def acks(broker: DoorbellBroker) -> set[str]:
    return {m.decode() for m in broker.client.smembers(acks_key(broker))}


def queued(broker: DoorbellBroker) -> list[str]:
    return [m.decode() for m in broker.client.lrange(broker.keys.on(SHARD).queue(QUEUE), 0, -1)]


def test_a_new_consumer_puts_back_what_the_lost_one_had_fetched_and_keeps_what_is_held(
        broker: DoorbellBroker) -> None:
    ids = enqueue(broker, 3)
    lost = broker.consume(QUEUE, prefetch=3, timeout=50)
    assert isinstance(lost, DoorbellConsumer)
    handed_out = next(lost)
    assert handed_out is not None and handed_out.options["redis_message_id"] == ids[0]
    # the other two were fetched with it: in the ack set, in the consumer's cache
    assert acks(broker) == set(ids) and queued(broker) == []

    # the connection drops: dramatiq throws `lost` away with its cache and makes a new consumer
    requeued = REGISTRY.get_sample_value("threadline_orphaned_messages_requeued_total", {"queue": QUEUE}) or 0.0
    fresh = broker.consume(QUEUE, prefetch=3, timeout=50)
    got = [next(fresh), next(fresh)]
    assert REGISTRY.get_sample_value("threadline_orphaned_messages_requeued_total", {"queue": QUEUE}) == requeued + 2
    assert sorted(m.options["redis_message_id"] for m in got if m is not None) == sorted(ids[1:])
    assert acks(broker) == set(ids)  # fetched again, now held
    # the one still being processed was left alone, and its ack still works
    fresh.ack(handed_out)
    for message in got:
        assert message is not None
        fresh.ack(message)
    fresh.close()  # sends the acks that would ride on its next fetch
    assert acks(broker) == set() and queued(broker) == []


def test_a_fetch_whose_reply_was_lost_is_put_back(broker: DoorbellBroker) -> None:
    (orphan,) = enqueue(broker, 1)
    # the fetch script ran (the id moved to the ack set) but its reply never reached the consumer
    broker.client.lpop(broker.keys.on(SHARD).queue(QUEUE))
    broker.client.sadd(acks_key(broker), orphan)

    message = next(broker.consume(QUEUE, prefetch=1, timeout=50))
    assert message is not None and message.options["redis_message_id"] == orphan


def test_a_consumer_looks_again_after_any_new_connection_of_its_process(polling_broker: DoorbellBroker) -> None:
    """A cluster client sends a command whose node failed again on the node that replaced it, and
    the first of the process's calls to get there makes the one connection: the consumer whose fetch
    (or unreplicated ack) left an orphan may not be that caller, and gets no error to start anew on."""
    broker = polling_broker
    consumer = broker.consume(QUEUE, prefetch=1, timeout=50)
    # its first look for orphans, and the one after it (the first made the client's connection)
    assert next(consumer) is None and next(consumer) is None
    (orphan,) = enqueue(broker, 1)
    broker.client.lrem(broker.keys.on(SHARD).queue(QUEUE), 0, orphan)
    broker.client.sadd(acks_key(broker), orphan)
    assert next(consumer) is None  # nothing tells it yet

    # every connection dropped: the next call makes a new one (a cluster client has a pool per node)
    client: Any = broker.client
    client.disconnect_connection_pools() if hasattr(client, "nodes_manager") else client.connection_pool.disconnect()
    assert broker.client.ping()
    message = next(consumer)
    assert message is not None and message.options["redis_message_id"] == orphan
    assert acks(broker) == {orphan}


def test_a_message_whose_ack_was_not_sent_stays_held(broker: DoorbellBroker, monkeypatch: pytest.MonkeyPatch) -> None:
    (only,) = enqueue(broker, 1)
    first = broker.consume(QUEUE, prefetch=1, timeout=50)
    message = next(first)
    assert message is not None

    def unreachable(*args: object, **kwargs: object) -> None:
        raise redis.ConnectionError("Connection refused")

    first.ack(message)  # sent with the consumer's next look
    with monkeypatch.context() as patched:
        patched.setattr(broker, "do_fetch", unreachable, raising=False)  # the server is gone for that look
        with pytest.raises(ConnectionClosed):
            next(first)
    assert acks(broker) == {only}
    # dramatiq makes a new consumer: it must not requeue the message, and it sends the ack with its fetch
    (later,) = enqueue(broker, 1)
    fresh = broker.consume(QUEUE, prefetch=1, timeout=50)
    taken = next(fresh)
    assert taken is not None and taken.options["redis_message_id"] == later
    assert queued(broker) == [] and acks(broker) == {later}


def test_a_delay_queues_handed_out_messages_are_put_back_with_its_next_consumer(broker: DoorbellBroker) -> None:
    delayed = broker.enqueue(work_for(broker, "t"), delay=60_000)
    dq = f"{QUEUE}.DQ"
    first = broker.consume(dq, prefetch=1, timeout=50)
    waiting = next(first)
    # dramatiq keeps it in the consumer thread's wait list until its eta, and drops that list with
    # the consumer when the connection is lost
    assert waiting is not None and waiting.options["redis_message_id"] == delayed.options["redis_message_id"]
    again = next(broker.consume(dq, prefetch=1, timeout=50))
    assert again is not None and again.options["redis_message_id"] == delayed.options["redis_message_id"]


async def test_the_hand_over_acks_the_stages_message_and_the_worker_sends_nothing(
        broker: DoorbellBroker, redis_url: str) -> None:
    stage, following = DEFAULT_GRAPH.stages[1], DEFAULT_GRAPH.stages[2]
    assert stage.queue == QUEUE
    (redis_id,) = enqueue(broker, 1)
    consumer = broker.consume(QUEUE, prefetch=2, timeout=50)  # not full with the message: no ring owed
    assert isinstance(consumer, DoorbellConsumer)
    message = next(consumer)
    assert message is not None and message.options["redis_message_id"] == redis_id
    bodies = broker.keys.on(SHARD).queue_messages(QUEUE)
    assert acks(broker) == {redis_id} and broker.client.hexists(bodies, redis_id)

    store = Store(async_plain_client(redis_url), broker.settings, DEFAULT_GRAPH)
    with in_shard(SHARD if broker.keys.shards else None):
        result = await store.advance("t0", stage.name, next_=Next(following.name, {"turn_id": "t0"}, "next-1"),
                                     now=1.0, now_ms=1000, artifact="{}", settle=broker.settlement(message))
    await store.redis.aclose()
    assert result == "ok"
    # acked by the script: gone from the ack set and the queue, the next stage's message enqueued
    assert acks(broker) == set() and not broker.client.hexists(bodies, redis_id)
    assert broker.client.hexists(broker.keys.on(SHARD).queue_messages(following.queue), "next-1")

    broker.settled_by_script(message)
    consumer.ring.clear()
    consumer.ack(message)  # what dramatiq does after the actor: nothing to send, nobody to wake (a full
    # consumer would be rung: it has room again)
    assert not any(broker.unsent_acks.values()) and not consumer.ring.is_set()
    assert redis_id not in broker.settled and redis_id not in broker.held.get(QUEUE, set())
    consumer.close()


def test_turns_through_workers_leave_nothing_in_an_ack_set_or_a_queue(isolated: Callable[..., WorkerPool]) -> None:
    pool = isolated().start(processes=2, threads=4)
    client = Client(pool.url, prefix=pool.prefix)
    client.put_agent(AgentConfig.model_validate({"id": "echo", "model": "offline:echo"}))
    turn_ids = [client.submit(turn("echo", f"question {i}")) for i in range(12)]
    for turn_id in turn_ids:
        assert isinstance(client.wait(turn_id, timeout_s=60), ev.Succeeded)
    r = client.redis
    held = {key: r.scard(key) for key in r.scan_iter(f"{pool.prefix}:*__acks__*", count=1000) if r.scard(key)}
    bodies = {key: r.hlen(key) for key in r.scan_iter(f"{pool.prefix}:*q:*.msgs", count=1000) if r.hlen(key)}
    assert (held, bodies) == ({}, {})
    client.close()
