"""A consumer that lost its connection leaves messages in its process's ack set that nothing in the
process holds any more: the ones it had fetched but not handed out (dramatiq drops them with the
consumer), and the ones of a fetch whose reply never arrived. dramatiq gives those back only when
the process is gone, so their turns would wait for the watchdog's stall time; the next consumer of
the queue puts them back before its first fetch, and leaves alone what the process still holds."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from dramatiq.errors import ConnectionClosed
from dramatiq.message import Message
from prometheus_client import REGISTRY

from tests.conftest import close_broker
from threadline.pipeline.stages import DEFAULT_GRAPH
from threadline.workers.protocol.names import SHARD_OPTION
from threadline.workers.settings import Settings, shards_from_env
from threadline.workers.worker.broker import DoorbellBroker, DoorbellConsumer
from threadline.workers.worker.process import create_broker

pytestmark = pytest.mark.integration

QUEUE = DEFAULT_GRAPH.stages[1].queue
#: The shard the messages go to (the sharded layout's enqueue needs one; one server's has one).
SHARD = 0


@pytest.fixture
def broker(redis_url: str) -> Iterator[DoorbellBroker]:
    settings = dataclasses.replace(Settings.from_env({}), prefix=f"tlo{uuid.uuid4().hex[:8]}", redis_url=redis_url,
                                   shards=shards_from_env())  # the session's layout (a cluster's is sharded)
    made = create_broker(settings, redis_url)
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
