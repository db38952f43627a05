"""The broker in the sharded layout (`TL_SHARDS`): one consumer per queue fetches from every shard's
queue of it, stamps each message with the shard it came from (`SHARD_OPTION`, whatever the body
says), and sends its ack, nack, retry, delayed move and orphan sweep to that shard's keys. Real Redis,
real dramatiq worker threads; every message is put on a shard the test names."""

from __future__ import annotations

import dataclasses
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import dramatiq
import pytest
from dramatiq.message import Message
from dramatiq.middleware import CurrentMessage, Retries
from prometheus_client import REGISTRY
from redis.crc import key_slot

from tests.conftest import close_broker
from tests.support.wait import poll, wait_until
from threadline.workers.protocol.keys import UnboundShard
from threadline.workers.protocol.names import SHARD_OPTION
from threadline.workers.settings import Settings
from threadline.workers.storage.connect import nodes_serving, sync_client
from threadline.workers.worker.broker import DoorbellBroker, DoorbellConsumer

pytestmark = pytest.mark.integration

SHARDS = 4
QUEUE = "work"


def sharded_settings(redis_url: str, **fields: Any) -> Settings:
    return dataclasses.replace(Settings.from_env({}), prefix=f"tlb{uuid.uuid4().hex[:8]}", redis_url=redis_url,
                               shards=SHARDS, idle_poll_ms=200, delay_poll_ms=200, **fields)


@dataclasses.dataclass
class Seen:
    """What the actors saw: per call, its first argument and the shard of its message."""

    calls: list[tuple[str, int]] = dataclasses.field(default_factory=list)
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def add(self, tag: str) -> None:
        message = CurrentMessage.get_current_message()
        assert message is not None
        with self.lock:
            self.calls.append((tag, message.options[SHARD_OPTION]))

    def of(self, tag: str) -> list[int]:
        with self.lock:
            return [shard for seen, shard in self.calls if seen == tag]


@pytest.fixture
def seen() -> Seen:
    return Seen()


@pytest.fixture
def broker(redis_url: str, seen: Seen) -> Iterator[DoorbellBroker]:
    made = DoorbellBroker(settings=sharded_settings(redis_url), url=redis_url,
                          middleware=[Retries(min_backoff=10, max_backoff=50), CurrentMessage()])
    failed_once: set[str] = set()

    def record(tag: str) -> None:
        seen.add(tag)

    def flaky(tag: str) -> None:
        seen.add(tag)
        if tag not in failed_once:
            failed_once.add(tag)
            raise RuntimeError("the first try fails")

    def broken(tag: str) -> None:
        seen.add(tag)
        raise RuntimeError("always")

    dramatiq.actor(record, actor_name="record", queue_name=QUEUE, broker=made)
    dramatiq.actor(flaky, actor_name="flaky", queue_name=QUEUE, broker=made, max_retries=3)
    dramatiq.actor(broken, actor_name="broken", queue_name=QUEUE, broker=made, max_retries=0)
    yield made
    close_broker(made, redis_url)


@pytest.fixture
def worker(broker: DoorbellBroker) -> Iterator[Callable[[], dramatiq.Worker]]:
    started: list[dramatiq.Worker] = []

    def start() -> dramatiq.Worker:
        started.append(dramatiq.Worker(broker, worker_threads=2, worker_timeout=100))
        started[-1].start()
        return started[-1]

    yield start
    for w in started:
        w.stop(timeout=5_000)


def send(broker: DoorbellBroker, actor: str, tag: str, shard: int | None, **kwargs: Any) -> Message[Any]:
    options = {} if shard is None else {SHARD_OPTION: shard}
    return broker.enqueue(Message(queue_name=QUEUE, actor_name=actor, args=(tag,), kwargs={}, options=options),
                          **kwargs)


def ids_on(broker: DoorbellBroker, shard: int, queue: str = QUEUE) -> list[str]:
    return [v.decode() for v in broker.client.lrange(broker.keys.on(shard).queue(queue), 0, -1)]


def settled(broker: DoorbellBroker) -> bool:
    """Nothing of the queue left on any shard: no message body, no ack set entry, its delay queue's neither."""
    return broker.do_qsize(QUEUE) == 0 and not any(ids_on(broker, s) or ids_on(broker, s, f"{QUEUE}.DQ")
                                                   for s in range(SHARDS))


def test_an_enqueue_goes_to_the_queue_of_its_messages_shard_and_one_without_is_refused(
        broker: DoorbellBroker) -> None:
    sent = {shard: send(broker, "record", f"m{shard}", shard) for shard in range(SHARDS)}
    for shard, message in sent.items():
        assert ids_on(broker, shard) == [message.options["redis_message_id"]]
        assert message.queue_name == QUEUE  # the body keeps the canonical queue name
    with pytest.raises(UnboundShard, match=SHARD_OPTION):
        send(broker, "record", "nowhere", None)
    with pytest.raises(UnboundShard):
        send(broker, "record", "out of range", SHARDS)
    assert [len(ids_on(broker, s)) for s in range(SHARDS)] == [1] * SHARDS
    delayed = send(broker, "record", "later", 2, delay=60_000)
    assert ids_on(broker, 2, f"{QUEUE}.DQ") == [delayed.options["redis_message_id"]]
    assert not any(ids_on(broker, s, f"{QUEUE}.DQ") for s in (0, 1, 3))
    broker.flush(QUEUE)  # dramatiq's flush, and join's qsize, cover every shard
    assert broker.do_qsize(QUEUE) == 0 and not any(ids_on(broker, s) for s in range(SHARDS))


def test_messages_of_every_shard_are_processed_once_each_on_its_shard_and_acked(
        broker: DoorbellBroker, seen: Seen, worker: Callable[[], dramatiq.Worker]) -> None:
    for shard in range(SHARDS):
        for n in range(3):
            send(broker, "record", f"s{shard}-{n}", shard)
    # a body that claims another shard than the queue it is on: the queue's shard wins
    lying = Message(queue_name=QUEUE, actor_name="record", args=("liar",), kwargs={},
                    options={"redis_message_id": "liar-1", SHARD_OPTION: 0})
    on = broker.keys.on(2)
    broker.client.hset(on.queue_messages(QUEUE), "liar-1", lying.encode())
    broker.client.rpush(on.queue(QUEUE), "liar-1")
    worker()
    wait_until(lambda: len(seen.calls) >= SHARDS * 3 + 1, timeout_s=20)
    wait_until(lambda: settled(broker), timeout_s=10)  # the last acks ride on fetches too
    expected = [(f"s{shard}-{n}", shard) for shard in range(SHARDS) for n in range(3)] + [("liar", 2)]
    assert sorted(seen.calls) == sorted(expected)  # each once, on the shard it was put on
    for shard in range(SHARDS):
        assert broker.client.scard(broker.keys.on(shard).acks(broker.broker_id, QUEUE)) == 0
    assert broker.held.get(QUEUE, set()) == set()


def test_a_failing_message_is_retried_on_its_own_shard_and_one_failing_for_good_dead_lettered_there(
        broker: DoorbellBroker, seen: Seen, worker: Callable[[], dramatiq.Worker]) -> None:
    send(broker, "flaky", "retried", 3)
    dead = send(broker, "broken", "dead", 1)
    worker()
    wait_until(lambda: len(seen.of("retried")) == 2 and seen.of("dead"), timeout_s=20)
    assert seen.of("retried") == [3, 3]  # the retry went through shard 3's delay queue, back to shard 3
    assert seen.of("dead") == [1]
    one = broker.keys.on(1)
    dead_id = dead.options["redis_message_id"]
    wait_until(lambda: broker.client.hexists(one.dead_queue_messages(QUEUE), dead_id), timeout_s=10)
    entries = broker.client.xrange(one.dead_letters())
    assert [(e[b"message_id"].decode(), e[b"reason"].decode()) for _, e in entries] == [
        (dead_id, "failed: RuntimeError")]
    assert not any(broker.client.exists(broker.keys.on(s).dead_letters()) for s in (0, 2, 3))
    wait_until(lambda: settled(broker), timeout_s=10)


def test_a_delayed_message_waits_on_its_shards_delay_queue_and_runs_on_its_shard(
        broker: DoorbellBroker, seen: Seen, worker: Callable[[], dramatiq.Worker]) -> None:
    worker()
    t0 = time.monotonic()
    send(broker, "record", "delayed", 1, delay=300)
    wait_until(lambda: seen.of("delayed"), timeout_s=20)
    assert time.monotonic() - t0 >= 0.3
    assert seen.of("delayed") == [1]
    wait_until(lambda: settled(broker), timeout_s=10)


def test_a_ring_wakes_the_consumer_for_its_shard_long_before_its_poll(redis_url: str) -> None:
    """A ring of one shard's queue wakes its consumer, whose next look fetches that shard: no poll
    (here every 30 s) was needed."""
    settings = dataclasses.replace(sharded_settings(redis_url), idle_poll_ms=30_000)
    made = DoorbellBroker(settings=settings, url=redis_url)
    dramatiq.actor(lambda tag: None, actor_name="record", queue_name=QUEUE, broker=made)
    try:
        consumer = made.consume(QUEUE, prefetch=4)
        assert isinstance(consumer, DoorbellConsumer)
        # subscribed to every shard's channel: the listener rings every consumer once (any shard may
        # have messages), and the consumer's first look polls every shard
        wait_until(consumer.ring.is_set, timeout_s=10)
        got: list[dramatiq.MessageProxy] = []

        def consume() -> None:
            while not got:
                message = next(consumer)  # None: woken (or its wait over), nothing fetched
                if message is not None:
                    got.append(message)

        waiting = threading.Thread(target=consume, daemon=True)
        waiting.start()
        wait_until(lambda: consumer._poll_at > 0, timeout_s=10)  # the first look's poll is done
        polled_at = consumer._poll_at
        sent = send(made, "record", "rung", 2)
        waiting.join(timeout=10)
        assert got and got[0].message_id == sent.message_id and got[0].options[SHARD_OPTION] == 2
        assert consumer._poll_at == polled_at  # fetched by the ring's look, not by a poll
        consumer.ack(got[0])
        consumer.close()
        assert made.do_qsize(QUEUE) == 0
    finally:
        close_broker(made, redis_url)


def test_a_message_that_rang_nothing_is_found_by_the_next_poll_of_every_shard(broker: DoorbellBroker) -> None:
    consumer = broker.consume(QUEUE, prefetch=1)
    assert poll(lambda: next(consumer) is None and consumer._poll_at > 0, timeout_s=10)  # polled: nothing
    raw = Message(queue_name=QUEUE, actor_name="record", args=("raw",), kwargs={},
                  options={"redis_message_id": "raw-1"})
    on = broker.keys.on(3)  # as a raw producer writes it, ringing nothing
    broker.client.hset(on.queue_messages(QUEUE), "raw-1", raw.encode())
    broker.client.rpush(on.queue(QUEUE), "raw-1")
    found = poll(lambda: next(consumer), timeout_s=10)  # the poll is every 0.2 s here
    assert found is not None and found.options[SHARD_OPTION] == 3 and found.options["redis_message_id"] == "raw-1"
    consumer.ack(found)
    consumer.close()
    assert broker.do_qsize(QUEUE) == 0


def test_orphans_of_a_shard_are_requeued_onto_that_shard(broker: DoorbellBroker) -> None:
    sent = [send(broker, "record", "a", 1), send(broker, "record", "b", 1), send(broker, "record", "c", 3)]
    shard_of = {m.options["redis_message_id"]: s for m, s in zip(sent, (1, 1, 3), strict=True)}
    lost = broker.consume(QUEUE, prefetch=3)
    handed_out = poll(lambda: next(lost), timeout_s=10)
    assert handed_out is not None
    held_id = handed_out.options["redis_message_id"]
    assert handed_out.options[SHARD_OPTION] == shard_of[held_id]

    def acked_on(shard: int) -> set[str]:
        return {v.decode() for v in broker.client.smembers(broker.keys.on(shard).acks(broker.broker_id, QUEUE))}

    # the other two were fetched too, each into its own shard's ack set, and sit in the lost cache
    wait_until(lambda: len(lost.message_cache) == 2, timeout_s=10)  # type: ignore[attr-defined]
    assert acked_on(1) | acked_on(3) == set(shard_of) and acked_on(3) == {sent[2].options["redis_message_id"]}
    before = REGISTRY.get_sample_value("threadline_orphaned_messages_requeued_total", {"queue": QUEUE}) or 0.0
    fresh = broker.consume(QUEUE, prefetch=3)
    got = [poll(lambda: next(fresh), timeout_s=10) for _ in range(2)]
    assert REGISTRY.get_sample_value("threadline_orphaned_messages_requeued_total", {"queue": QUEUE}) == before + 2
    for message in got:
        assert message is not None
        redis_id = message.options["redis_message_id"]
        assert redis_id != held_id and message.options[SHARD_OPTION] == shard_of[redis_id]
    # the one still being processed was left alone, and its ack goes to its shard
    for message in [handed_out, *got]:
        assert message is not None
        fresh.ack(message)
    fresh.close()
    assert acked_on(1) == acked_on(3) == set() and broker.do_qsize(QUEUE) == 0

    # a fetch on shard 3 whose reply was lost: its id is in shard 3's ack set only, and goes back there
    orphan = send(broker, "record", "d", 3).options["redis_message_id"]
    broker.client.lpop(broker.keys.on(3).queue(QUEUE))
    broker.client.sadd(broker.keys.on(3).acks(broker.broker_id, QUEUE), orphan)
    again = poll(lambda: next(broker.consume(QUEUE, prefetch=1)), timeout_s=10)
    assert again is not None and again.options["redis_message_id"] == orphan and again.options[SHARD_OPTION] == 3


def test_a_ring_names_its_shards_channel_on_sharded_pub_sub(broker: DoorbellBroker, redis_url: str) -> None:
    channel = broker.keys.on(1).doorbell_channel()
    # a shard channel is heard on the node serving its slot (on one server: the server)
    [node] = nodes_serving(redis_url, [channel])
    client = sync_client(node)
    pubsub = client.pubsub()
    pubsub.ssubscribe(channel)
    wait_until(lambda: pubsub.get_message(timeout=0.1) is not None, timeout_s=5)  # the subscribe reply
    broker.ring(QUEUE, 3)  # another shard's channel: not heard here
    broker.ring(QUEUE, 1)
    message = poll(lambda: pubsub.get_message(timeout=0.1), timeout_s=5)
    assert message is not None and message["data"] == QUEUE.encode() and message["type"] == "smessage"
    assert message["channel"] == broker.keys.on(1).doorbell_channel().encode()
    pubsub.close()
    client.close()


def acked_everywhere(broker: DoorbellBroker) -> int:
    return sum(int(broker.client.scard(broker.keys.on(s).acks(broker.broker_id, QUEUE))) for s in range(SHARDS))


def test_prefetch_is_the_consumers_over_all_shards(broker: DoorbellBroker) -> None:
    sent = {send(broker, "record", f"s{shard}-{n}", shard).message_id: shard
            for shard in range(SHARDS) for n in range(2)}
    consumer = broker.consume(QUEUE, prefetch=3)
    taken: dict[str, int] = {}
    while len(taken) < len(sent):
        message = poll(lambda: next(consumer), timeout_s=10)
        assert message is not None
        # fetched and not acked yet: never more than the prefetch, whichever shards they came from
        assert consumer.outstanding_message_count <= 3 and acked_everywhere(broker) <= 3
        taken[message.message_id] = message.options[SHARD_OPTION]
        consumer.ack(message)
    assert taken == sent
    consumer.close()
    assert acked_everywhere(broker) == 0 and broker.do_qsize(QUEUE) == 0


def test_a_ring_passed_over_while_full_is_answered_after_the_ack_which_rides_on_that_fetch(
        redis_url: str) -> None:
    """A full consumer keeps the shards that rang meanwhile; the ack that frees it wakes it, and one
    round trip sends the ack to its shard and fetches the rung one (no poll: it is 30 s away)."""
    settings = dataclasses.replace(sharded_settings(redis_url), idle_poll_ms=30_000)
    made = DoorbellBroker(settings=settings, url=redis_url)
    dramatiq.actor(lambda tag: None, actor_name="record", queue_name=QUEUE, broker=made)
    try:
        first_sent = send(made, "record", "first", 1)
        consumer = made.consume(QUEUE, prefetch=1)
        assert isinstance(consumer, DoorbellConsumer)
        wait_until(consumer.ring.is_set, timeout_s=10)  # subscribed to every shard's channel
        first = poll(lambda: next(consumer), timeout_s=10)  # the first look's poll finds it
        assert first is not None and first.message_id == first_sent.message_id
        second_sent = send(made, "record", "second", 2)  # rings shard 2 while the consumer is full
        t0 = time.monotonic()
        threading.Timer(0.3, consumer.ack, args=(first,)).start()
        second = poll(lambda: next(consumer), timeout_s=10)
        assert second is not None and second.message_id == second_sent.message_id
        assert second.options[SHARD_OPTION] == 2 and 0.25 < time.monotonic() - t0 < 10
        assert made.client.scard(made.keys.on(1).acks(made.broker_id, QUEUE)) == 0  # sent with that fetch
        consumer.ack(second)
        consumer.close()
        assert made.do_qsize(QUEUE) == 0
    finally:
        close_broker(made, redis_url)


@pytest.mark.parametrize("queue", [QUEUE, f"{QUEUE}.DQ"])
def test_every_call_on_a_shards_queue_keeps_to_that_shards_slot(broker: DoorbellBroker, queue: str) -> None:
    """dispatch.lua's and dead_letter.lua's keys of a shard's queue (its delay queue's, dead letters'
    and this worker's ack sets included) and the doorbell it rings are all in the shard's slot."""
    for shard in range(SHARDS):
        on = broker.keys.on(shard)
        keys = [k for command in ("enqueue", "fetch", "ack", "nack", "requeue", "purge", "qsize")
                for k in broker.dispatch_keys(command, queue, shard)]
        keys += [on.dead_letters(), on.doorbell_channel()]
        assert {key_slot(k.encode()) for k in keys} == {key_slot(on.queue(queue).encode())}, keys
    with pytest.raises(UnboundShard):
        broker.dispatch_keys("fetch", queue)  # a sharded layout's queue key needs its shard


def test_one_poll_reads_every_queue_of_its_interval_on_every_shard_for_all_their_consumers(
        redis_url: str) -> None:
    """The consumers that poll at one interval share their polls: one consumer's poll finds what rang
    nothing on another queue and rings that queue's consumer, which then polls no more itself."""
    settings = dataclasses.replace(sharded_settings(redis_url), idle_poll_ms=30_000)
    made = DoorbellBroker(settings=settings, url=redis_url)
    # The listener rings every consumer once per node it listens to, when that node confirms its
    # subscriptions (one server: once; a cluster: once per primary, each when it answers). A ring
    # after the first poll below would start a poll of its own: count them, and start after the last.
    ring_all, rings_all = made._ring_all, list[None]()

    def counted() -> None:
        rings_all.append(None)
        ring_all()

    made._ring_all = counted  # type: ignore[method-assign]  # read when the listener is made, at the first consume
    nodes = len(nodes_serving(redis_url, [made.keys.on(s).doorbell_channel() for s in made.shards]))
    dramatiq.actor(lambda tag: None, actor_name="record", queue_name=QUEUE, broker=made)
    dramatiq.actor(lambda tag: None, actor_name="other", queue_name="other", broker=made)
    try:
        raw = Message(queue_name="other", actor_name="other", args=("raw",), kwargs={},
                      options={"redis_message_id": "raw-2"})
        on = made.keys.on(3)
        made.client.hset(on.queue_messages("other"), "raw-2", raw.encode())
        made.client.rpush(on.queue("other"), "raw-2")
        mine, theirs = made.consume(QUEUE, prefetch=1), made.consume("other", prefetch=1)
        group = made._poll_groups[30_000]
        # subscribed: the listener rang every consumer once (any shard may have messages: a poll is due)
        rung = poll(lambda: len(rings_all) >= nodes and mine.ring.is_set() and theirs.ring.is_set(), timeout_s=10)
        assert rung, {"mine": mine.ring.is_set(), "theirs": theirs.ring.is_set(), "rings": len(rings_all),
                      "nodes": nodes}  # which one, if it fails again
        threading.Thread(target=lambda: next(mine), daemon=True).start()  # its first look polls the group
        wait_until(lambda: group.started_at > float("-inf"), timeout_s=10)
        polled = group.started_at
        found = poll(lambda: next(theirs), timeout_s=10)
        assert found is not None and found.options["redis_message_id"] == "raw-2" and found.options[SHARD_OPTION] == 3
        assert group.started_at == polled  # rung by the first consumer's poll: it polled nothing itself
        theirs.ack(found)
        theirs.close()
        assert made.do_qsize("other") == 0
    finally:
        close_broker(made, redis_url)


def test_a_burst_over_every_shard_is_processed_exactly_once(
        broker: DoorbellBroker, seen: Seen, worker: Callable[[], dramatiq.Worker]) -> None:
    worker()
    sent = [(f"b{n}", n % SHARDS) for n in range(200)]
    for tag, shard in sent:
        send(broker, "record", tag, shard)
    wait_until(lambda: len(seen.calls) >= len(sent), timeout_s=30)
    wait_until(lambda: settled(broker), timeout_s=10)
    assert sorted(seen.calls) == sorted(sent)
