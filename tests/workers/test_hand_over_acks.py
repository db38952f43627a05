"""A stage that hands its turn over acks its own message in the same script (`advance.lua`,
`finish.lua`, on the keys of the message's shard), and its worker then sends no ack of its own
(`DoorbellConsumer._settled`). Were the script to ack other keys, nothing would fail at once: the
messages would stay in the workers' ack sets and their bodies in the queues."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Callable, Iterator

import pytest
from dramatiq.message import Message

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

STAGE, FOLLOWING = DEFAULT_GRAPH.stages[1], DEFAULT_GRAPH.stages[2]
SHARD = 0


@pytest.fixture
def broker(redis_url: str) -> Iterator[DoorbellBroker]:
    settings = dataclasses.replace(Settings.from_env({}), prefix=f"tlh{uuid.uuid4().hex[:8]}", redis_url=redis_url,
                                   shards=shards_from_env())  # the session's layout (a cluster's is sharded)
    made = create_broker(settings, redis_url)
    yield made
    close_broker(made, redis_url)


async def test_the_hand_over_acks_the_stages_message_and_the_worker_sends_nothing(
        broker: DoorbellBroker, redis_url: str) -> None:
    shard = SHARD if broker.keys.shards else None
    actor = next(name for name, a in broker.actors.items() if a.queue_name == STAGE.queue)
    sent = broker.enqueue(Message(queue_name=STAGE.queue, actor_name=actor, args=({"turn_id": "t1"},), kwargs={},
                                  options={SHARD_OPTION: SHARD} if shard is not None else {}))
    redis_id = sent.options["redis_message_id"]
    consumer = broker.consume(STAGE.queue, prefetch=2, timeout=50)  # not full with the message: no ring owed
    assert isinstance(consumer, DoorbellConsumer)
    message = next(consumer)
    assert message is not None and message.options["redis_message_id"] == redis_id
    on = broker.keys.on(shard)
    acks, bodies = on.acks(broker.broker_id, STAGE.queue), on.queue_messages(STAGE.queue)
    assert broker.client.sismember(acks, redis_id) and broker.client.hexists(bodies, redis_id)

    store = Store(async_plain_client(redis_url), broker.settings, DEFAULT_GRAPH)
    with in_shard(shard):
        result = await store.advance("t1", STAGE.name, next_=Next(FOLLOWING.name, {"turn_id": "t1"}, "next-1"),
                                     now=1.0, now_ms=1000, artifact="{}", settle=broker.settlement(message))
    await store.redis.aclose()
    assert result == "ok"
    # acked by the script: gone from the ack set and the queue, the next stage's message enqueued
    assert not broker.client.sismember(acks, redis_id) and not broker.client.hexists(bodies, redis_id)
    assert broker.client.hexists(on.queue_messages(FOLLOWING.queue), "next-1")

    broker.settled_by_script(message)
    consumer.ring.clear()
    consumer.ack(message)  # what dramatiq does after the actor: nothing to send, nobody to wake (a full
    # consumer would be rung: it has room again)
    assert not any(broker.unsent_acks.values()) and not consumer.ring.is_set()
    assert redis_id not in broker.settled and redis_id not in broker.held.get(STAGE.queue, set())
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
