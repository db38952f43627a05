"""The doorbell's polls and rings (`worker/broker.py`): a queue that producers outside the workers
fill is polled every `idle_poll_ms`; a queue only the workers' scripts fill (each enqueue rings: the
delay queues, every stage's but the first) only every `delay_poll_ms`; an ack wakes its consumer,
which sends it with its next fetch (one round trip), and answers a ring passed over while full."""

from __future__ import annotations

import dataclasses
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import dramatiq
import pytest
from dramatiq.message import Message

from tests.conftest import close_broker
from threadline.pipeline.stages import DEFAULT_GRAPH
from threadline.workers.protocol.names import SHARD_OPTION
from threadline.workers.settings import Settings, shards_from_env
from threadline.workers.worker.broker import DoorbellBroker

pytestmark = pytest.mark.integration

ENTRY = DEFAULT_GRAPH.first.queue
INTERNAL = DEFAULT_GRAPH.stages[1].queue
#: The shard the messages go to (the sharded layout's enqueue needs one; one server's has one).
SHARD = 0


@pytest.fixture
def settings(redis_url: str) -> Settings:
    return dataclasses.replace(Settings.from_env({}), prefix=f"tld{uuid.uuid4().hex[:8]}", redis_url=redis_url,
                               idle_poll_ms=2_000, delay_poll_ms=30_000,
                               shards=shards_from_env())  # the session's layout (a cluster's is sharded)


@pytest.fixture
def broker(settings: Settings, redis_url: str) -> Iterator[DoorbellBroker]:
    made = DoorbellBroker(settings=settings, url=redis_url, entry_queues=frozenset({ENTRY}))
    dramatiq.actor(lambda envelope: None, actor_name=INTERNAL, queue_name=INTERNAL, broker=made)
    yield made
    close_broker(made, redis_url)


def work_for(broker: DoorbellBroker, turn_id: str) -> Message[Any]:
    return Message(queue_name=INTERNAL, actor_name=INTERNAL, args=({"turn_id": turn_id},), kwargs={},
                   options={SHARD_OPTION: SHARD} if broker.keys.shards else {})


def test_queues_producers_fill_are_polled_often_the_others_rarely(broker: DoorbellBroker) -> None:
    assert broker.consume(ENTRY).idle_s == 2.0
    assert broker.consume(INTERNAL).idle_s == 30.0
    assert broker.consume(f"{INTERNAL}.DQ").idle_s == 30.0


def test_without_entry_queues_every_queue_is_polled_often(settings: Settings, redis_url: str) -> None:
    made = DoorbellBroker(settings=settings, url=redis_url)
    try:
        assert made.consume(INTERNAL).idle_s == 2.0
        assert made.consume(f"{INTERNAL}.DQ").idle_s == 30.0
    finally:
        made.before_shutdown()
        made.close()


def test_an_ack_wakes_a_consumer_that_passed_a_ring_over_while_full(broker: DoorbellBroker) -> None:
    for i in range(2):
        broker.enqueue(work_for(broker, f"t{i}"))
    consumer = broker.consume(INTERNAL, prefetch=1, timeout=50)
    time.sleep(1.0)  # the listener has subscribed (and rung once): from now on only the ack rings
    first = next(consumer)
    assert first is not None
    # full now: the next look fetches nothing and waits (30 s here) until something rings
    threading.Timer(0.3, consumer.ack, args=(first,)).start()
    t0 = time.monotonic()
    assert next(consumer) is None
    assert 0.25 < time.monotonic() - t0 < 5.0
    second = next(consumer)
    assert second is not None and second.message_id != first.message_id
    consumer.ack(second)


def test_an_ack_rides_on_the_next_fetch_and_a_closing_consumer_sends_its_own(broker: DoorbellBroker) -> None:
    """One round trip acks a message and fetches the next: until it is sent, the acked message stays
    in the ack set and held (not an orphan to put back)."""
    sent = [broker.enqueue(work_for(broker, f"t{i}")) for i in range(2)]
    ids = [m.options["redis_message_id"] for m in sent]
    k = broker.keys.on(SHARD)
    acks, bodies = k.acks(broker.broker_id, INTERNAL), k.queue_messages(INTERNAL)
    consumer = broker.consume(INTERNAL, prefetch=1, timeout=50)
    first = next(consumer)
    assert first is not None and first.options["redis_message_id"] == ids[0]
    consumer.ack(first)
    assert broker.client.sismember(acks, ids[0]) and ids[0] in broker.held[INTERNAL]
    assert consumer.ring.is_set()  # the ack woke the consumer, to send it
    second = next(consumer)
    assert second is not None and second.options["redis_message_id"] == ids[1]
    assert not broker.client.sismember(acks, ids[0]) and not broker.client.hexists(bodies, ids[0])
    assert broker.held[INTERNAL] == {ids[1]}
    consumer.ack(second)
    consumer.close()
    assert broker.client.scard(acks) == 0 and broker.client.hlen(bodies) == 0
    assert broker.held[INTERNAL] == set()


def test_messages_put_back_without_an_enqueue_ring(broker: DoorbellBroker) -> None:
    broker.enqueue(work_for(broker, "t"))
    stopping = broker.consume(INTERNAL, prefetch=1, timeout=50)
    other = broker.consume(INTERNAL, prefetch=1, timeout=50)
    time.sleep(1.0)  # subscribed, and the subscription's own ring has landed
    message = next(stopping)
    assert message is not None
    other.ring.clear()
    stopping.requeue([message])  # as dramatiq does with a stopping worker's fetched messages
    deadline = time.monotonic() + 5.0
    while not other.ring.is_set() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert other.ring.is_set()
    again = next(other)
    assert again is not None and again.message_id == message.message_id
    other.ack(again)
