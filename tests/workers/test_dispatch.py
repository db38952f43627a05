"""The broker's own queue commands (`storage/scripts/dispatch.lua`, `DoorbellBroker._dispatch`) against
stock dramatiq's: the same bytes on the same keys, so that a message a stock `RedisBroker` (any
producer of dramatiq's layout) enqueued is fetched, acked, dead-lettered and put back as before,
and what ours enqueues is what dramatiq would have written; but every key in KEYS, a ring with each
enqueue in the same call, and no heartbeat or maintenance pass riding on the commands."""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Iterator

import dramatiq
import pytest
import redis
from dramatiq.brokers.redis import RedisBroker
from dramatiq.message import Message
from redis.crc import key_slot

from tests.conftest import drop_prefix
from tests.support.wait import wait_until
from threadline.pipeline.stages import DEFAULT_GRAPH
from threadline.workers.protocol.keys import Keys
from threadline.workers.settings import Settings
from threadline.workers.storage.connect import sync_client
from threadline.workers.worker.broker import DoorbellBroker

pytestmark = [pytest.mark.integration,
              # stock dramatiq's script builds key names inside Lua: it runs on one server only
              pytest.mark.one_server("stock dramatiq's RedisBroker on the same keys")]

QUEUE = DEFAULT_GRAPH.stages[1].queue


@pytest.fixture
def settings(redis_url: str) -> Settings:
    return dataclasses.replace(Settings.from_env({}), prefix=f"tlx{uuid.uuid4().hex[:8]}", redis_url=redis_url)


@pytest.fixture
def r(redis_url: str, settings: Settings) -> Iterator[redis.Redis]:
    client = sync_client(redis_url)
    yield client
    drop_prefix(client, settings.prefix)
    client.close()


@pytest.fixture
def ours(settings: Settings, redis_url: str, r: redis.Redis) -> Iterator[DoorbellBroker]:
    made = DoorbellBroker(settings=settings, url=redis_url)
    dramatiq.actor(lambda envelope: None, actor_name=QUEUE, queue_name=QUEUE, broker=made)
    yield made
    made.close()


@pytest.fixture
def stock(settings: Settings, redis_url: str, r: redis.Redis) -> Iterator[RedisBroker]:
    """dramatiq's own broker on the same namespace: the reference."""
    made = RedisBroker(url=redis_url, namespace=settings.broker_namespace)  # type: ignore[no-untyped-call]
    made.declare_queue(QUEUE)
    yield made
    made.close()


def message(text: str) -> Message[object]:
    return Message(queue_name=QUEUE, actor_name=QUEUE, args=(text,), kwargs={"n": 1}, options={})


def test_what_ours_enqueues_is_what_dramatiq_writes_and_it_rings(
    ours: DoorbellBroker, stock: RedisBroker, r: redis.Redis, settings: Settings
) -> None:
    keys = Keys(settings.prefix)
    pubsub = r.pubsub()
    pubsub.subscribe(keys.doorbell_channel())
    wait_until(lambda: pubsub.get_message(timeout=0.1) is not None, timeout_s=5)  # the subscribe reply
    a = ours.enqueue(message("ours"))
    b = stock.enqueue(message("stock"))
    ids = [v.decode() for v in r.lrange(keys.queue(QUEUE), 0, -1)]
    assert ids == [a.options["redis_message_id"], b.options["redis_message_id"]]
    bodies = r.hgetall(keys.queue_messages(QUEUE))
    assert bodies[ids[0].encode()] == a.encode()
    assert bodies[ids[1].encode()] == b.encode()
    assert Message.decode(bodies[ids[0].encode()]).args == ("ours",)
    r.publish(keys.doorbell_channel(), "marker")  # every ring of the enqueues arrives before it
    rings: list[bytes] = []
    wait_until(lambda: rings[-1:] == [b"marker"] or bool(
        (m := pubsub.get_message(timeout=0.1)) and rings.append(m["data"])), timeout_s=5)
    assert rings == [QUEUE.encode(), b"marker"]  # one ring, ours; stock dramatiq rings nothing
    pubsub.close()


def test_a_stock_enqueued_message_is_fetched_acked_and_put_back_by_ours(
    ours: DoorbellBroker, stock: RedisBroker, r: redis.Redis, settings: Settings
) -> None:
    keys = Keys(settings.prefix)
    sent = [stock.enqueue(message(f"m{i}")) for i in range(3)]
    acks = keys.acks(ours.broker_id, QUEUE)
    fetched = ours.do_fetch(QUEUE, 2)  # unlike dramatiq's, with each body its id
    assert fetched == [v for m in sent[:2] for v in (m.options["redis_message_id"].encode(), m.encode())]
    assert {v.decode() for v in r.smembers(acks)} == {m.options["redis_message_id"] for m in sent[:2]}
    ours.do_ack(QUEUE, sent[0].options["redis_message_id"])
    assert not r.hexists(keys.queue_messages(QUEUE), sent[0].options["redis_message_id"])
    ours.do_requeue(QUEUE, sent[1].options["redis_message_id"], "not-fetched")
    assert r.scard(acks) == 0
    assert [v.decode() for v in r.lrange(keys.queue(QUEUE), 0, -1)] == [
        sent[2].options["redis_message_id"], sent[1].options["redis_message_id"]]
    assert ours.do_qsize(QUEUE) == stock.do_qsize(QUEUE) == 2  # type: ignore[attr-defined]
    assert ours.do_fetch(QUEUE, 10)[1::2] == [sent[2].encode(), sent[1].encode()]
    assert ours.do_fetch(QUEUE, 10) == []
    # a message acked twice (a redelivery's second ack) changes nothing the second time
    ours.do_ack(QUEUE, sent[2].options["redis_message_id"])
    ours.do_ack(QUEUE, sent[2].options["redis_message_id"])
    assert r.hlen(keys.queue_messages(QUEUE)) == 1


def test_a_nack_dead_letters_as_dramatiq_does_and_drops_expired_dead_letters(
    ours: DoorbellBroker, stock: RedisBroker, r: redis.Redis, settings: Settings
) -> None:
    keys = Keys(settings.prefix)
    old, new = stock.enqueue(message("old")), stock.enqueue(message("new"))
    old_id, new_id = old.options["redis_message_id"], new.options["redis_message_id"]
    assert ours.do_fetch(QUEUE, 2)[1::2] == [old.encode(), new.encode()]
    ours.do_nack(QUEUE, old_id)
    assert r.hget(keys.dead_queue_messages(QUEUE), old_id) == old.encode()
    assert not r.hexists(keys.queue_messages(QUEUE), old_id)
    # the first dead letter is older than the dead-letter ttl now: the next nack drops it
    r.zadd(keys.dead_queue(QUEUE), {old_id: int(time.time() * 1000) - ours.dead_message_ttl - 1_000})
    ours.do_nack(QUEUE, new_id)
    assert [v.decode() for v in r.zrange(keys.dead_queue(QUEUE), 0, -1)] == [new_id]
    assert set(r.hkeys(keys.dead_queue_messages(QUEUE))) == {new_id.encode()}
    # a nack of a message not in the ack set (already handled) moves nothing
    ours.do_nack(QUEUE, "never-fetched")
    assert r.zcard(keys.dead_queue(QUEUE)) == 1


def test_the_commands_write_no_heartbeat_and_purge_empties_the_queue(
    ours: DoorbellBroker, r: redis.Redis, settings: Settings
) -> None:
    """dramatiq stamps its heartbeat set on every command, a producer's broker too; here the worker's
    heartbeat (heartbeat.lua) alone does, so a producer never shows as a worker."""
    keys = Keys(settings.prefix)
    sent = ours.enqueue(message("x"))
    ours.do_fetch(QUEUE, 1)
    ours.do_nack(QUEUE, sent.options["redis_message_id"])
    assert r.zscore(keys.heartbeats(), ours.broker_id) is None
    ours.enqueue(message("y"))
    ours.flush(QUEUE)
    assert not any(r.exists(k) for k in ours.queue_keys(QUEUE))
    with pytest.raises(redis.ResponseError, match="unknown dispatch command"):
        ours.do_frobnicate(QUEUE)  # type: ignore[attr-defined]


@pytest.mark.parametrize("queue", [f"{QUEUE}{{s3}}", f"{QUEUE}{{s3}}.DQ"])
def test_a_queue_named_with_a_hash_tag_keeps_every_call_in_one_slot(
    ours: DoorbellBroker, r: redis.Redis, settings: Settings, queue: str
) -> None:
    """dramatiq's dispatch.lua builds its key names inside Lua from the namespace alone, which no
    cluster can route; ours is given them, and a shard's queue (a name with a hash tag) has all of
    them, its delay queue's and its dead letters' included, in the tag's slot. Every command then
    runs as on any queue."""
    slots = {command: {key_slot(k.encode()) for k in ours.dispatch_keys(command, queue)}
             for command in ("enqueue", "fetch", "ack", "nack", "requeue", "purge", "qsize")}
    assert all(found == {key_slot(b"s3")} for found in slots.values()), slots
    ours.declare_queue(queue.removesuffix(".DQ"))
    sent = ours.enqueue(Message(queue_name=queue, actor_name=QUEUE, args=("x",), kwargs={}, options={}))
    redis_id = sent.options["redis_message_id"]
    assert ours.do_fetch(queue, 5) == [redis_id.encode(), sent.encode()]
    assert ours.do_qsize(queue) == 2  # type: ignore[attr-defined]  # its body and its ack entry
    ours.do_nack(queue, redis_id)
    assert r.hget(Keys(settings.prefix).dead_queue_messages(f"{QUEUE}{{s3}}"), redis_id) == sent.encode()
