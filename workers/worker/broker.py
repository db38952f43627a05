"""The dramatiq Redis broker with a doorbell: millisecond hand-offs without busy polling.

Stock dramatiq consumers poll Redis with exponential backoff up to `worker_timeout`, so hand-off
latency is bought with idle load. Here an idle consumer blocks on a per-queue `threading.Event`
instead; every enqueue PUBLISHes the queue name on the doorbell channel, and each worker process's
one pub/sub listener sets the events of that queue. Consumers still poll every `idle_poll_ms`, so
messages from producers that ring nothing (raw Redis), rings lost to a reconnect, and redelivered
messages are all picked up, with the ordinary polling latency.

When Redis does not answer, the process says so once (`Reachability`) and each consumer tries again
with exponential backoff, instead of dramatiq's critical line per consumer every 3 s. A stopping
worker's consumers fetch nothing more.

In the sharded layout (`TL_SHARDS`) every queue is one per shard, each in its shard's slot, and
there is still one consumer per queue (dramatiq's worker sends a message's ack to the consumer its
body's `queue_name` names): it fetches from its rung shards first, in one round trip when several
rang, and stamps each message with the shard it came from (`SHARD_OPTION`), by which its ack, nack,
requeue, dead letter and any enqueue of it (a retry, a delayed message's move) find their keys. The
consumers that poll at one interval poll together (`DoorbellBroker.poll`): one command per shard for
all their queues, whose consumers the poll rings.
"""

from __future__ import annotations

import contextlib
import re
import threading
import time
from collections.abc import Callable, Container, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar
from uuid import uuid4

import dramatiq
import redis
import structlog
from dramatiq.brokers.redis import RedisBroker, _RedisConsumer
from dramatiq.common import current_millis, dq_name, q_name
from dramatiq.errors import ConnectionClosed, DecodeError
from dramatiq.message import Message, get_encoder

from threadline.workers.protocol.keys import Keys, UnboundShard
from threadline.workers.protocol.names import SHARD_OPTION
from threadline.workers.protocol.wire import DEAD_LETTERS_MAXLEN, json_too_deep
from threadline.workers.settings import Settings
from threadline.workers.storage import lua
from threadline.workers.storage.connect import OUTAGE_ERRORS, is_cluster, sync_client
from threadline.workers.storage.turns import Settle
from threadline.workers.telemetry import metrics
from threadline.workers.worker.calls import ModelCalls, default_model_calls
from threadline.workers.worker.listener import Listener
from threadline.workers.worker.loops import loop_factory
from threadline.workers.worker.reachability import Reachability

log = structlog.get_logger(__name__)

#: A shard of the sharded layout; None: one server's layout, which has one (`Keys.on(None)`).
Shard = int | None
#: dispatch.lua's commands that, in the sharded layout without a shard, run on every shard's keys of
#: the queue (dramatiq's `flush` and `join`): qsize adds their sizes up.
_EVERY_SHARD = frozenset({"purge", "qsize"})
T = TypeVar("T")


class Ring(threading.Event):
    """A consumer's doorbell: set to wake it (a ring of its queue, an ack, a stopping broker). It also
    keeps which of the queue's shards rang since the consumer last looked (`take`), and since when
    every shard may hold messages (the listener resubscribed: rings may have been lost)."""

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self._shards: dict[int, None] = {}
        self._everywhere_at: float | None = None

    def rang(self, shard: Shard) -> None:
        """`shard` of the queue has messages (None: any shard may)."""
        with self._lock:
            if shard is None:
                self._everywhere_at = time.monotonic()
            else:
                self._shards[shard] = None
        self.set()

    def take(self) -> tuple[list[int], float | None]:
        """The shards that rang since the last call, in order, and since when (monotonic) every shard
        may have messages (None: no such ring since the last call)."""
        with self._lock:
            shards, everywhere_at = list(self._shards), self._everywhere_at
            self._shards, self._everywhere_at = {}, None
        return shards, everywhere_at


@dataclass(slots=True)
class _PollGroup:
    """The queues whose consumers poll at one interval (sharded layout). One poll reads them all: per
    shard one EXISTS of its queues (one slot), so its cost grows with the shards, not the queues."""

    queues: dict[str, None] = field(default_factory=dict)
    #: When the last poll started (monotonic).
    started_at: float = float("-inf")
    lock: threading.Lock = field(default_factory=threading.Lock)


class DoorbellBroker(RedisBroker):
    def __init__(self, *, settings: Settings, url: str, slow_queues: frozenset[str] = frozenset(),
                 entry_queues: frozenset[str] | None = None, **kwargs: Any) -> None:
        #: How many connections the client has made (`_connected`): one more means a command may have
        #: been sent again on a new connection after its reply was lost (`DoorbellConsumer.__next__`).
        self.connections = 0
        self._cluster = is_cluster(url)
        # a cluster URL: redis-py's RedisCluster, which routes each call by its keys' slot
        client = sync_client(url, redis_connect_func=self._connected)
        super().__init__(client=client, namespace=settings.broker_namespace, **kwargs)  # type: ignore[no-untyped-call]
        self.settings = settings
        #: Queues of model stages: their calls run detached (`calls.py`), their acks wait for them.
        self.slow_queues = slow_queues
        #: Queues that producers outside the workers fill (which may ring nothing): polled every
        #: `idle_poll_ms`. Every other queue is filled by the workers' own scripts, each enqueue
        #: rings, and its poll (`delay_poll_ms`, as a delay queue's) only covers a ring lost with a
        #: connection. None: every queue but the delay queues is such a queue.
        self.entry_queues = entry_queues
        self.calls = ModelCalls(settings.model_calls or default_model_calls(), self,
                                new_loop=loop_factory(settings.loop()))
        self.keys = Keys(settings.prefix, settings.shards)
        #: The shards every queue has: each consumer fetches from all of them.
        self.shards: tuple[Shard, ...] = tuple(range(settings.shards)) or (None,)
        self.url = url
        self._rings: dict[str, list[Ring]] = {}
        self._rings_lock = threading.Lock()
        self._listener: Listener | None = None
        self.closing = False
        self.reachability = Reachability(url)
        self._closed = threading.Event()
        #: Per queue, the redis ids of the messages this process's consumers handed to dramatiq and
        #: that are not acked, nacked or requeued yet (`DoorbellConsumer`: what is NOT an orphan).
        self.held: dict[str, set[str]] = {}
        #: Per queue and shard, the redis ids of messages acked and not yet sent: the queue's consumer
        #: sends them with its next fetch of that shard (`DoorbellConsumer._exchange`); they stay held
        #: until then. (Redis ids are unique, so `held` needs no shard.)
        self.unsent_acks: dict[tuple[str, Shard], list[str]] = {}
        #: The redis ids of held messages that the script handing their turn over acked (`settlement`):
        #: dramatiq's ack of one sends nothing.
        self.settled: set[str] = set()
        self.held_lock = threading.Lock()
        self._queue_keys: dict[tuple[str, Shard], list[str]] = {}
        #: Sharded layout: the queues consumed here by their poll interval (ms), polled together.
        self._poll_groups: dict[int, _PollGroup] = {}
        self._dispatch_script = self.client.register_script(lua.source("dispatch"))

    def _connected(self, connection: redis.connection.AbstractConnection) -> None:
        """Each new connection's handshake (redis-py's `redis_connect_func`: a cluster client has done
        it already, one server's client leaves it to this), counted."""
        if not self._cluster:
            connection.on_connect_check_health(check_health=True)
        self.connections += 1

    @property
    def listener(self) -> Listener:
        """The process's pub/sub listener, started on first use (worker processes only)."""
        if self._listener is None:
            self._listener = Listener(self.url, reachability=self.reachability)
            # before the channels, which start the listener: its first confirmed subscription rings
            # every consumer (what was enqueued before it listened), and must find the hook there
            self._listener.on_reconnect(self._ring_all)
            self._listener.on_each({self.keys.on(shard).doorbell_channel(): partial(self._ring, shard=shard)
                                    for shard in self.shards})
        return self._listener

    def consume(self, queue_name: str, prefetch: int = 1, timeout: int = 5000) -> DoorbellConsumer:
        if queue_name in self.slow_queues:
            prefetch = self.calls.limit  # a call's message stays outstanding until its call ends
        delayed = queue_name.endswith(".DQ")
        entry = not delayed and (self.entry_queues is None or queue_name in self.entry_queues)
        idle_ms = self.settings.idle_poll_ms if entry else self.settings.delay_poll_ms
        # dramatiq restarts a consumer that lost its connection after 3 s; this adds the backoff
        self._closed.wait(self.reachability.retry_in(queue_name))
        ring = Ring()
        with self._rings_lock:
            self._rings.setdefault(queue_name, []).append(ring)
            if self.keys.shards:
                self._poll_groups.setdefault(idle_ms, _PollGroup()).queues[queue_name] = None
        _ = self.listener
        return DoorbellConsumer(self, queue_name, prefetch, idle_ms, ring)

    def enqueue(self, message: Message[Any], *, delay: int | None = None) -> Message[Any]:
        """Enqueue, waiting out a Redis outage: in a worker process this is dramatiq enqueuing a
        retry (`Retries`) or moving a delayed message to its queue, and the message it comes from is
        acked right after, so an enqueue given up would lose it. (dramatiq waits out an outage the
        same way to ack.) A cluster's CLUSTERDOWN is an outage too (`OUTAGE_ERRORS`: a turn's admit
        message was lost to one in the chaos test on a cluster). A stopping process does not wait."""
        shard = self.shard_of_message(message)
        while True:
            try:
                enqueued = self._enqueue(message, delay, shard)
                break
            except OUTAGE_ERRORS as e:
                if self.closing:
                    raise
                self._closed.wait(self.reachability.failed("enqueue", e))
        self.reachability.ok("enqueue")
        return enqueued

    def settlement(self, message: Message[Any] | dramatiq.MessageProxy) -> Settle:
        """What lets the stage's hand-over script ack `message` (`Store.advance`): no ack of its own
        then, one round trip less per stage. The store acks it on the keys of the shard it is bound
        to, which is the message's (`actors._message_shard`)."""
        return Settle(message.queue_name, self.broker_id, message.options["redis_message_id"])

    def settled_by_script(self, message: Message[Any] | dramatiq.MessageProxy) -> None:
        """`message`'s ack went with its stage's hand-over (`settlement`)."""
        with self.held_lock:
            self.settled.add(message.options["redis_message_id"])

    def shard_of_message(self, message: Message[Any] | dramatiq.MessageProxy) -> Shard:
        """The shard a message belongs on: the one its consumer fetched it from (`SHARD_OPTION`);
        None in one server's layout. A sharded layout's message without one is a bug of its sender,
        never guessed: it would put the turn's message into another shard's slot."""
        if not self.keys.shards:
            return None
        shard = message.options.get(SHARD_OPTION)
        if isinstance(shard, bool) or not isinstance(shard, int) or not 0 <= shard < self.keys.shards:
            raise UnboundShard(f"message {message.message_id} of queue {message.queue_name!r} has no shard of "
                               f"{self.keys.shards} in its {SHARD_OPTION!r} option ({shard!r}): a sharded layout "
                               "enqueues only messages fetched from a shard (the turn's)")
        return shard

    def _enqueue(self, message: Message[Any], delay: int | None, shard: Shard) -> Message[Any]:
        """dramatiq's `RedisBroker.enqueue` (the same options, eta, body and middleware hooks), onto the
        queue of `shard`; dispatch.lua's enqueue rings that shard's doorbell in the same call."""
        queue_name = message.queue_name
        # a redelivered message is stored anew: each needs a redis id of its own
        message = message.copy(options={"redis_message_id": str(uuid4())})
        if delay is not None:
            queue_name = dq_name(queue_name)
            message = message.copy(queue_name=queue_name, options={"eta": current_millis() + delay})
        self.emit_before("enqueue", message, delay)
        self.do_enqueue(queue_name, message.options["redis_message_id"], message.encode(), shard=shard)
        self.emit_after("enqueue", message, delay)
        return message

    def queue_keys(self, queue_name: str, shard: Shard = None) -> list[str]:
        """KEYS of dispatch.lua (and dead_letter.lua) for a queue of `shard`: the queue, its messages,
        this worker's ack set of it, and the dead-letter set and bodies of its canonical queue."""
        keys = self._queue_keys.get((queue_name, shard))
        if keys is None:
            canonical, on = q_name(queue_name), self.keys.on(shard)
            keys = self._queue_keys[queue_name, shard] = [
                on.queue(queue_name), on.queue_messages(queue_name), on.acks(self.broker_id, queue_name),
                on.dead_queue(canonical), on.dead_queue_messages(canonical)]
        return keys

    def dispatch_keys(self, command: str, queue_name: str, shard: Shard = None) -> list[str]:
        """KEYS of one dispatch.lua call. A queue's keys share its name (and a shard's queue its
        shard's tag), so a queue named with a hash tag (`resolve{s3}`) keeps every call in one slot."""
        if command != "qsize":
            return self.queue_keys(queue_name, shard)
        canonical, on = q_name(queue_name), self.keys.on(shard)
        delayed = f"{canonical}.DQ"
        return [on.queue_messages(canonical), on.acks(self.broker_id, canonical),
                on.queue_messages(delayed), on.acks(self.broker_id, delayed)]

    def _dispatch_call(self, command: str, queue_name: str, shard: Shard, args: Sequence[Any]) -> tuple[
            list[str], list[Any]]:
        """KEYS and ARGV of dispatch.lua's `command` on the queue of `shard`."""
        keys = self.dispatch_keys(command, queue_name, shard)
        if command == "enqueue":
            args = (*args, self.keys.on(shard).doorbell_channel(), queue_name)
        elif command == "nack":
            args = (*args, self.dead_message_ttl)
        unpack = self._max_unpack_size()  # type: ignore[no-untyped-call]
        return keys, [command, now_ms(), unpack, *args]

    def _dispatch(self, command: str) -> Callable[..., Any]:
        """dramatiq's `do_<command>(queue_name, *args)`, run by dispatch.lua with every key in KEYS, on
        the keys of `shard` (sharded layout; dramatiq's own `flush` and `join` name none: every shard)."""
        script = self._dispatch_script

        def do_dispatch(queue_name: str, *args: Any, shard: Shard = None) -> Any:
            if shard is None and self.keys.shards and command in _EVERY_SHARD:
                replies = [do_dispatch(queue_name, *args, shard=s) for s in self.shards]
                return sum(replies) if command == "qsize" else 1
            keys, argv = self._dispatch_call(command, queue_name, shard, args)
            return script(keys=keys, args=argv)

        return do_dispatch

    def dispatch_each(self, calls: Sequence[tuple[str, str, Shard, Sequence[Any]]]) -> list[Any]:
        """dispatch.lua's `(command, queue, shard, args)` calls in one round trip (a pipeline, not a
        transaction: each call is in its own shard's slot): their replies, an exception in place of a
        call that failed."""
        replies = self._pipeline(calls)
        # EVALSHA straight away: redis-py's pipeline would send SCRIPT EXISTS first, every time
        missing = [i for i, reply in enumerate(replies) if isinstance(reply, redis.exceptions.NoScriptError)]
        if missing:  # the server lost its scripts (a restart): none of these ran
            self.client.script_load(self._dispatch_script.script)
            for i, reply in zip(missing, self._pipeline([calls[i] for i in missing]), strict=True):
                replies[i] = reply
        return replies

    def _pipeline(self, calls: Sequence[tuple[str, str, Shard, Sequence[Any]]]) -> list[Any]:
        with self.client.pipeline(transaction=False) as pipe:
            for command, queue_name, shard, args in calls:
                keys, argv = self._dispatch_call(command, queue_name, shard, args)
                # (execute_command: a cluster pipeline refuses `evalsha` by name, and routes this by its keys)
                pipe.execute_command("EVALSHA", self._dispatch_script.sha, len(keys), *keys, *argv)
            return list(pipe.execute(raise_on_error=False))

    def poll(self, idle_ms: int, since: float) -> None:
        """Sharded layout: look for messages that rang nothing (raw producers' enqueues, rings lost
        with a connection) in every queue of the consumers polling every `idle_ms`, on every shard,
        and ring this process's consumers of each (queue, shard) holding some; unless a poll of
        them started after `since` (another consumer's), which saw what this one would. One round
        trip of one EXISTS per shard; a second, of LLEN per queue, only for the shards that hold some."""
        group = self._poll_groups[idle_ms]
        with group.lock:  # the group's other consumers wait, and find this poll recent enough
            if group.started_at > since:
                return
            started_at = time.monotonic()
            with self._rings_lock:  # `consume` adds to the group
                queues = list(group.queues)
            with self.client.pipeline(transaction=False) as pipe:
                for on in self.keys.every_shard():
                    pipe.exists(*(on.queue(q) for q in queues))
                held = [shard for shard, n in enumerate(pipe.execute()) if n]
            group.started_at = started_at  # a poll that failed is none: the next consumer polls
            found = [(q, shard) for shard in held for q in queues]
            if held and len(queues) > 1:
                with self.client.pipeline(transaction=False) as pipe:
                    for q, shard in found:
                        pipe.llen(self.keys.on(shard).queue(q))
                    found = [pair for pair, n in zip(found, pipe.execute(), strict=True) if n]
            for q, shard in found:  # before a consumer that waited for this poll looks at its ring
                self._ring(q, shard)

    def _ring(self, queue_name: str, shard: Shard = None) -> None:
        with self._rings_lock:
            rings = list(self._rings.get(queue_name, ()))
        for ring in rings:
            ring.rang(shard)

    def ring(self, queue_name: str, shard: Shard = None) -> None:
        """Tell every worker that `queue_name` of `shard` has messages (ones put back without an
        enqueue); the sharded layout's without a shard: every shard's (one round trip)."""
        if not self.keys.shards:
            self.client.publish(self.keys.doorbell_channel(), queue_name)
        elif shard is not None:  # a shard's channel: sharded pub/sub (prelude.lua's `ring`)
            self.client.spublish(self.keys.on(shard).doorbell_channel(), queue_name)
        else:
            with self.client.pipeline(transaction=False) as pipe:
                for keys in self.keys.every_shard():
                    pipe.spublish(keys.doorbell_channel(), queue_name)
                pipe.execute()

    def before_shutdown(self) -> None:
        """Stop fetching, and wake every idle consumer so that a stopping worker does not wait out
        their polls (or a backoff)."""
        self.closing = True
        self._closed.set()
        self._ring_all()

    def _ring_all(self) -> None:
        with self._rings_lock:
            rings = [r for group in self._rings.values() for r in group]
        for ring in rings:
            ring.rang(None)

    def close(self) -> None:
        if self._listener is not None:
            self._listener.stop()
        super().close()


_SAFE_NAME = re.compile(r"[A-Za-z0-9_.:@-]{1,64}")
_MESSAGE_FIELDS: dict[str, type | tuple[type, ...]] = {
    "queue_name": str, "actor_name": str, "args": list, "kwargs": dict, "options": dict,
    "message_id": str, "message_timestamp": (int, float),
}
_REQUIRED_FIELDS = ("queue_name", "actor_name", "args", "kwargs", "options")
#: Message options that pass: the broker's (`redis_message_id`, `eta`) and those Retries writes on a
#: redelivery (`retries`, `traceback`).
_OPTIONS = frozenset({"redis_message_id", "eta", "retries", "traceback"})



@dataclass(frozen=True, slots=True)
class _Refused:
    """Why a fetched body is not a message this consumer may hand to dramatiq."""

    reason: str
    actor: str = ""


def _safe_name(value: object) -> str:
    """An actor name fit for a log line and a reason; anything else (user text, say) is `?`."""
    return value if isinstance(value, str) and _SAFE_NAME.fullmatch(value) else "?"


def _shape_problem(fields: object, queue_name: str, redis_id: str) -> str | None:
    """The first field that makes `fields` no message of this queue, stored under `redis_id`, that
    dramatiq could process without crashing a thread (a wrong `queue_name` kills the worker thread
    that finishes it; an `options.redis_message_id` not its hash field would ack another message)."""
    if not isinstance(fields, dict):
        return "not_an_object"
    if any(name not in _MESSAGE_FIELDS for name in fields):
        return "unknown_field"
    for name, kind in _MESSAGE_FIELDS.items():
        if name not in fields:
            if name in _REQUIRED_FIELDS:
                return name
            continue
        if not isinstance(fields[name], kind) or isinstance(fields[name], bool):
            return name
    if fields["queue_name"] != queue_name:
        return "queue_name"
    claimed = fields["options"].get("redis_message_id")
    if claimed != redis_id or not _encodable(redis_id):
        return "options.redis_message_id"
    return None


def _encodable(text: str) -> bool:
    """Whether `text` can be sent to Redis (a lone surrogate cannot: dramatiq could never ack it)."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def _parse_message(data: bytes, *, redis_id: str, queue_name: str, actors: Container[str]) -> Message[Any] | _Refused:
    """The message in a body fetched under `redis_id`, or why it is refused; never raises."""
    if json_too_deep(data):
        return _Refused("too_deep")
    try:
        fields = get_encoder().decode(data)
    except Exception as e:
        cause = e.error if isinstance(e, DecodeError) and isinstance(e.error, BaseException) else e
        return _Refused(f"undecodable: {type(cause).__name__}")
    problem = _shape_problem(fields, queue_name, redis_id)
    actor = _safe_name(fields.get("actor_name")) if isinstance(fields, dict) else ""
    if problem is not None:
        return _Refused(f"malformed: {problem}", actor)
    if fields["actor_name"] not in actors:
        return _Refused(f"unknown_actor: {actor}", actor)
    try:
        # Options steer dramatiq's middleware (max_retries, max_age, pipe_target, on_failure, ...): a
        # producer gets none of them; only those the broker and Retries set themselves pass.
        options = {k: v for k, v in fields["options"].items() if k in _OPTIONS}
        return Message(**{**fields, "args": tuple(fields["args"]), "options": options})
    except Exception as e:
        return _Refused(f"undecodable: {type(e).__name__}", actor)


def _clip(value: bytes | str, limit: int = 128) -> str:
    text = value.decode(errors="replace") if isinstance(value, bytes) else value
    return text[:limit]


class DoorbellConsumer(_RedisConsumer):
    broker: DoorbellBroker
    message_cache: list[dramatiq.MessageProxy]

    def __init__(
        self, broker: DoorbellBroker, queue_name: str, prefetch: int, idle_ms: int, ring: Ring
    ) -> None:
        super().__init__(broker, queue_name, prefetch, idle_ms)  # type: ignore[no-untyped-call]
        self.ring = ring
        self.idle_s = idle_ms / 1000
        self.delayed = queue_name.endswith(".DQ")
        # The dead-letter set is the canonical queue's: `resolve.DQ` -> `resolve.XQ`.
        self.canonical_queue = q_name(queue_name)
        self._dead_letter_script = broker.client.register_script(lua.source("dead_letter"))
        #: The broker's `connections` when this consumer last looked for orphans (`_requeue_orphans`);
        #: None: it never did.
        self._swept_at: int | None = None
        #: Sharded layout: the shards the next look fetches from, in order (rung, or full at their last
        #: fetch: they may hold more); one that answers fewer messages than asked for leaves.
        self._pending: dict[Shard, None] = {}
        #: Sharded layout: when the next look polls (`DoorbellBroker.poll`), `idle_s` after the last;
        #: the first look does, unless a poll that started after this consumer was made saw its queue.
        self._poll_at = 0.0
        #: Sharded layout: a poll of this consumer's group must have started after this to count as
        #: this consumer's (its making; the last ring of every shard).
        self._poll_since = time.monotonic()
        self._idle_ms = idle_ms
        #: The last fetch took messages and left every queue it asked empty (`__next__`).
        self._drained = False

    @property
    def sharded(self) -> bool:
        return bool(self.broker.keys.shards)

    def _run(self, command: str, shard: Shard, *args: Any) -> Any:
        """dispatch.lua's `command` on this queue's keys of `shard` (`do_<command>`)."""
        do = getattr(self.broker, f"do_{command}")
        return do(self.queue_name, *args) if shard is None else do(self.queue_name, *args, shard=shard)

    def _settle(self, command: str, message: dramatiq.MessageProxy) -> None:
        """What dramatiq's consumer does to ack or nack, on the keys of the message's shard: a lost
        connection is `ConnectionClosed` (dramatiq's post-processing then tries again)."""
        try:
            self._run(command, self.broker.shard_of_message(message), message.options["redis_message_id"])
        except redis.ConnectionError as e:
            raise ConnectionClosed(e) from None  # type: ignore[no-untyped-call]
        finally:
            self.queued_message_ids.discard(message.message_id)

    def ack(self, message: dramatiq.MessageProxy) -> None:
        if self.broker.calls.defer_ack(message, self):
            return  # its model call runs on: `ack_detached` acks it when the call ends
        self._ack(message)

    def ack_detached(self, message: dramatiq.MessageProxy) -> None:
        """The ack (a nack if it failed for good) of a detached call's message, once the call ended:
        waits out a lost connection as dramatiq's does (`post_process_message`), unless the process
        stops (the message then stays in the ack set; the watchdog puts it back, and its stage is
        done: a no-op)."""
        while True:
            try:
                if message.failed:  # its retries are spent (`calls.redeliver`)
                    self._nack(message)
                else:
                    self._ack(message)
                return
            except ConnectionClosed:
                if self.broker.closing:
                    raise
                self.broker._closed.wait(1.0)

    def _ack(self, message: dramatiq.MessageProxy) -> None:
        """Acks ride on the consumer's next fetch of the message's shard, which the ack wakes: one round
        trip for a message done and the next one taken, not two. The message stays held (no orphan)
        until its ack is sent; a stopping process sends it at once, as dramatiq does. A message its
        stage's hand-over acked (`DoorbellBroker.settlement`) sends nothing."""
        if self._settled(message):
            return
        shard = self.broker.shard_of_message(message)
        if self.broker.closing:
            try:
                self._settle("ack", message)
                self._release(message)  # not when the ack failed: dramatiq tries it again, and it is still held
            finally:
                self.ring.set()
            return
        with self.broker.held_lock:
            self.broker.unsent_acks.setdefault((self.queue_name, shard), []).append(message.options["redis_message_id"])
        self.queued_message_ids.discard(message.message_id)  # what dramatiq's ack does locally
        self.ring.set()

    def _settled(self, message: dramatiq.MessageProxy) -> bool:
        """Whether a script acked `message` already (`DoorbellBroker.settlement`); if so it is let go
        here, and a consumer that was full is woken (it has room again: nothing else rings)."""
        redis_id = message.options["redis_message_id"]
        with self.broker.held_lock:
            if redis_id not in self.broker.settled:
                return False
            self.broker.settled.discard(redis_id)
            self.broker.held.get(self.queue_name, set()).discard(redis_id)
        full = self.outstanding_message_count >= self.prefetch
        self.queued_message_ids.discard(message.message_id)
        if full:
            self.ring.set()
        return True

    def _exchange(self, counts: Mapping[Shard, int]) -> dict[Shard, list[bytes | None]]:
        """Send the unsent acks of the shards in `counts`, each with a fetch of up to `counts[shard]`
        messages (0: none) in the same call, in one round trip: the fetched (id, body, ...) per shard.
        One server's layout: its one call, as before. Acks a lost connection or a failed call kept
        from Redis are sent next time."""
        with self.broker.held_lock:
            acks = {shard: self.broker.unsent_acks.pop((self.queue_name, shard), []) for shard in counts}
        calls = [(shard, count, acks[shard]) for shard, count in counts.items() if count or acks[shard]]
        replies: list[Any] = []
        try:
            if len(calls) == 1:
                shard, count, ids = calls[0]
                replies = [self._run("fetch", shard, count, *ids) if count else self._run("ack", shard, *ids)]
            elif calls:
                replies = self.broker.dispatch_each(
                    [("fetch" if count else "ack", self.queue_name, shard, (count, *ids) if count else ids)
                     for shard, count, ids in calls])
        except redis.RedisError:
            self._unsend(acks)
            raise
        fetched: dict[Shard, list[bytes | None]] = {}
        failed: Exception | None = None
        for (shard, count, ids), reply in zip(calls, replies, strict=True):
            if isinstance(reply, Exception):
                self._unsend({shard: ids})
                failed = failed or reply
                continue
            if ids:
                with self.broker.held_lock:
                    self.broker.held.get(self.queue_name, set()).difference_update(ids)
            if count:
                fetched[shard] = reply
        if failed is not None:
            raise failed  # what the other calls fetched is not held: the next consumer puts it back
        return fetched

    def _unsend(self, acks: Mapping[Shard, list[str]]) -> None:
        """Put acks that did not reach Redis back in front of the unsent ones."""
        with self.broker.held_lock:
            for shard, ids in acks.items():
                if ids:
                    key = (self.queue_name, shard)
                    self.broker.unsent_acks[key] = ids + self.broker.unsent_acks.get(key, [])

    def close(self) -> None:
        with contextlib.suppress(redis.RedisError):
            self._exchange(dict.fromkeys(self.broker.shards, 0))
        super().close()

    def nack(self, message: dramatiq.MessageProxy) -> None:
        """dramatiq nacks a message for an actor it does not know (`ConsumerThread.handle_message`)
        and one that failed for good (retries exhausted): either way, record why. A detached call
        that failed for good may be failed before dramatiq looks: its nack, too, waits for its end."""
        if self.broker.calls.defer_ack(message, self):
            return
        self._nack(message)

    def _nack(self, message: dramatiq.MessageProxy) -> None:
        if self._settled(message):  # its stage handed over, then failed: the hand-over's ack stands
            self._record_nack(message)
            return
        try:
            self._settle("nack", message)
            self._release(message)
            self._record_nack(message)
        finally:
            self.ring.set()  # capacity freed: a ring passed over while the consumer was full is answered

    def requeue(self, messages: Iterable[dramatiq.MessageProxy]) -> None:
        by_shard: dict[Shard, list[dramatiq.MessageProxy]] = {}
        for message in messages:
            by_shard.setdefault(self.broker.shard_of_message(message), []).append(message)
        for shard, listed in by_shard.items():
            self._run("requeue", shard, *(m.options["redis_message_id"] for m in listed))
            for message in listed:
                self._release(message)
        for shard in by_shard:
            # put back without an enqueue (a stopping worker's): ring, or they wait for a poll
            with contextlib.suppress(redis.RedisError):
                self.broker.ring(self.queue_name, shard)

    def _hold(self, message: dramatiq.MessageProxy) -> None:
        with self.broker.held_lock:
            self.broker.held.setdefault(self.queue_name, set()).add(message.options["redis_message_id"])

    def _release(self, message: dramatiq.MessageProxy) -> None:
        with self.broker.held_lock:
            self.broker.held.get(self.queue_name, set()).discard(message.options["redis_message_id"])

    def _requeue_orphans(self) -> None:
        """Put back the messages this process's ack sets (one per shard) hold that no part of the
        process has: the ones a consumer had fetched when it lost its connection (dramatiq drops a
        consumer's fetched, not yet handed out messages with it) and the ones of a fetch whose reply
        was lost. dramatiq gives them back only when the process is gone; without this, their turns
        would wait for the watchdog's stall time (a delay queue's: every message its last consumer
        handed out, see below) — and a turn whose admit message it was, for ever: no index knows a
        turn not admitted yet. Runs on the consumer thread with nothing fetched and not handed out:
        before a new consumer's first fetch, and before the first fetch after the client made a
        connection (any part of the process: the one to a failed primary's replica is made once).
        A cluster client sends a command whose node failed again once the topology says where
        (`connect.CLUSTER_RETRIES`): a fetch that ran on a primary killed before it replied runs once
        more on its replica and returns nothing of what the first run took; and an ack the primary
        answered but did not pass on before it died is not on its replica."""
        connections = self.broker.connections
        with self.broker.held_lock:
            if self.delayed and self._swept_at is None:
                # a delay queue's messages wait in its consumer thread until their eta, and dramatiq
                # drops that wait list with a consumer that lost its connection: none is held now
                self.broker.held.pop(self.queue_name, None)
            held = set(self.broker.held.get(self.queue_name, ()))
        shards = self.broker.shards
        acks = [self.broker.queue_keys(self.queue_name, shard)[2] for shard in shards]
        if len(acks) == 1:
            members = [self.broker.client.smembers(acks[0])]
        else:
            with self.broker.client.pipeline(transaction=False) as pipe:
                for key in acks:
                    pipe.smembers(key)
                members = pipe.execute()
        for shard, found in zip(shards, members, strict=True):
            orphans = [m for m in (v.decode() if isinstance(v, bytes) else str(v) for v in found) if m not in held]
            if not orphans:
                continue
            self._run("requeue", shard, *orphans)
            self.broker.ring(self.queue_name, shard)  # the other processes' consumers may take them too
            metrics.ORPHANS_REQUEUED.labels(self.queue_name).inc(len(orphans))
            log.warning("orphaned_messages_requeued", queue=self.queue_name, messages=len(orphans),
                        **({} if shard is None else {"shard": shard}))
        self._swept_at = connections

    def __next__(self) -> dramatiq.MessageProxy | None:
        try:
            while True:
                if not self.message_cache and self._swept_at != self.broker.connections:
                    self._requeue_orphans()
                if self.message_cache:
                    proxy = self.message_cache.pop(0)
                    self.misses = 0
                    self.queued_message_ids.add(proxy.message_id)
                    self._hold(proxy)
                    return proxy
                room = 0 if self.broker.closing else max(0, self.prefetch - self.outstanding_message_count)
                if self._drained:
                    # the last fetch emptied the queue, and the ring was cleared before it: unless it
                    # rang since (an enqueue, an ack to send), another fetch now would find nothing
                    self._drained = False
                    if not self.ring.is_set():
                        self.ring.wait(self._wait_s(room))
                        return None
                # Clear before fetching: a ring that lands during the fetch is not lost.
                self.ring.clear()
                fetched = self._look(room)
                if room:
                    self.broker.reachability.ok(self.queue_name)
                if not fetched and not (room and self._pending):
                    self.ring.wait(self._wait_s(room))
                    return None
        except redis.ConnectionError as e:
            self.broker.reachability.failed(self.queue_name, e)
            raise ConnectionClosed(e) from None  # type: ignore[no-untyped-call]

    def _look(self, room: int) -> bool:
        """One round trip: send the unsent acks, fetch up to `room` messages into the cache, and in the
        sharded layout poll the shards when due. Whether anything was fetched."""
        counts = self._plan(room)
        fetched = self._exchange(counts)
        for shard, count in counts.items():
            if count:
                # fewer than asked for: empty now; as many: it may hold more, and goes behind the others
                self._pending.pop(shard, None)
                if len(fetched.get(shard, ())) // 2 >= count:
                    self._pending[shard] = None
        if room:
            self.message_cache = [m for shard, batch in fetched.items() for m in self._admit(batch, shard)]
        # every shard asked answered fewer than asked for (the others did not ring)
        self._drained = bool(room) and not self._pending and any(fetched.values())
        return any(fetched.values())

    def _plan(self, room: int) -> dict[Shard, int]:
        """How many messages to fetch from which shard (every shard with unsent acks is in, to send
        them): one server's layout fetches `room` from its one queue. Sharded: when a poll is due (or
        the listener resubscribed), the broker's poll first rings the shards holding messages; then
        `room` (prefetch is the consumer's, not a shard's) is split over the pending shards, rung
        first, or else over the shards whose acks are sent anyway."""
        if not self.sharded:
            return {None: room}
        self._take_rings()
        now = time.monotonic()
        if room and now >= self._poll_at:
            self._poll_at = now + self.idle_s
            # a poll of the group started since (another consumer's) saw all this one would
            self.broker.poll(self._idle_ms, max(now - self.idle_s, self._poll_since))
            self._take_rings()
        with self.broker.held_lock:
            acked = [s for s in self.broker.shards if self.broker.unsent_acks.get((self.queue_name, s))]
        return dict.fromkeys(acked, 0) | _share(room, list(self._pending) or acked)

    def _take_rings(self) -> None:
        """The shards rung since the last look are pending; a ring of every shard makes a poll due,
        one that starts after it."""
        rung, everywhere_at = self.ring.take()
        self._pending.update(dict.fromkeys(rung))
        if everywhere_at is not None:
            self._poll_at, self._poll_since = 0.0, max(self._poll_since, everywhere_at)

    def _wait_s(self, room: int) -> float:
        # A delay queue holding messages must look at their etas often; otherwise sleep until rung
        # (sharded: or until the next poll is due).
        if self.broker.closing or (self.delayed and self.outstanding_message_count):
            return 0.05
        if self.sharded and room:
            return max(0.0, min(self.idle_s, self._poll_at - time.monotonic()))
        return self.idle_s

    def _admit(self, fetched: list[bytes | None], shard: Shard) -> list[dramatiq.MessageProxy]:
        """The batch's messages (`fetched`: dispatch.lua's id, body pairs from `shard`'s queue), each
        stamped with its shard; refused bodies and ids without a body are dead-lettered first, in one
        script, so that nothing of them stays in the ack set (normal batches: no extra call)."""
        admitted: list[dramatiq.MessageProxy] = []
        refused: list[tuple[bytes, _Refused]] = []
        bodies = fetched[1::2]
        for redis_id, data in zip(fetched[::2], bodies, strict=True):
            if data is None or redis_id is None:
                continue
            parsed = _parse_message(data, redis_id=redis_id.decode("utf-8", "surrogatepass"),
                                    queue_name=self.queue_name, actors=self.broker.actors)
            if isinstance(parsed, _Refused):
                refused.append((data, parsed))
                continue
            if shard is not None:  # after the option filter: a producer's own value never passes
                parsed.options[SHARD_OPTION] = shard
            admitted.append(dramatiq.MessageProxy(parsed))
        missing = len(admitted) + len(refused) < len(bodies)
        if refused or missing:
            self._dead_letter(refused, shard, sweep=missing)
        return admitted

    def _dead_letter(self, refused: list[tuple[bytes, _Refused]], shard: Shard, *, sweep: bool) -> None:
        args: list[bytes | str | int] = [now_ms(), self.canonical_queue, DEAD_LETTERS_MAXLEN, "1" if sweep else "0"]
        for data, why in refused:
            args += [data, why.reason, why.actor]
        _, bodies, acks, dead, dead_bodies = self.broker.queue_keys(self.queue_name, shard)
        keys = [acks, bodies, dead, dead_bodies, self.broker.keys.on(shard).dead_letters()]
        try:
            reply = self._dead_letter_script(keys=keys, args=args)
        except redis.ResponseError as e:
            # A script error must not cost the batch its good messages; the bad ones stay behind.
            log.error("dead_letter_failed", queue=self.queue_name, error=type(e).__name__)
            return
        entries = list(zip(reply[::2], reply[1::2], strict=True))
        swept = len(entries) - len(refused)
        sizes = [0] * swept + [len(data) for data, _ in refused]
        for (redis_id, reason), size in zip(entries, sizes, strict=True):
            log.error("message_dead_lettered", queue=self.queue_name, redis_message_id=_clip(redis_id) or None,
                      size=size, reason=_clip(reason))

    def _record_nack(self, message: dramatiq.MessageProxy) -> None:
        actor = _safe_name(message.actor_name)
        exception = getattr(message, "_exception", None)
        if message.actor_name not in self.broker.actors:
            reason = f"unknown_actor: {actor}"
        elif exception is None:
            reason = "failed"
        else:
            reason = f"failed: {type(exception).__name__}"
        redis_id = str(message.options.get("redis_message_id", ""))
        entry = {"queue": self.canonical_queue, "message_id": redis_id, "actor": actor, "reason": reason}
        stream = self.broker.keys.on(self.broker.shard_of_message(message)).dead_letters()
        try:
            self.broker.client.xadd(stream, entry,  # type: ignore[arg-type]
                                    maxlen=DEAD_LETTERS_MAXLEN, approximate=True)
        except redis.RedisError as e:
            log.warning("dead_letter_record_failed", queue=self.queue_name, error=type(e).__name__)
        log.error("message_dead_lettered", queue=self.queue_name, redis_message_id=_clip(redis_id), reason=reason)


def _share(room: int, shards: Sequence[T]) -> dict[T, int]:
    """`room` split over `shards` as evenly as it goes, the first ones taking the remainder (with less
    room than shards: one each for the first `room`)."""
    if not shards:
        return {}
    each, extra = divmod(room, len(shards))
    return {shard: each + (i < extra) for i, shard in enumerate(shards)}


def now_ms() -> int:
    return int(time.time() * 1000)
