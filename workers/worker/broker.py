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
"""

from __future__ import annotations

import contextlib
import re
import threading
import time
from collections.abc import Callable, Container, Iterable
from dataclasses import dataclass
from typing import Any

import dramatiq
import redis
import structlog
from dramatiq.brokers.redis import RedisBroker, _RedisConsumer
from dramatiq.common import q_name
from dramatiq.errors import ConnectionClosed, DecodeError
from dramatiq.message import Message, get_encoder

from threadline.workers.protocol.keys import Keys
from threadline.workers.protocol.wire import DEAD_LETTERS_MAXLEN, json_too_deep
from threadline.workers.settings import Settings
from threadline.workers.storage import lua
from threadline.workers.telemetry import metrics
from threadline.workers.worker.calls import ModelCalls, default_model_calls
from threadline.workers.worker.listener import Listener
from threadline.workers.worker.reachability import Reachability

log = structlog.get_logger(__name__)

class DoorbellBroker(RedisBroker):
    def __init__(self, *, settings: Settings, url: str, slow_queues: frozenset[str] = frozenset(),
                 entry_queues: frozenset[str] | None = None, **kwargs: Any) -> None:
        super().__init__(url=url, namespace=settings.broker_namespace, **kwargs)  # type: ignore[no-untyped-call]
        self.settings = settings
        #: Queues of model stages: their calls run detached (`calls.py`), their acks wait for them.
        self.slow_queues = slow_queues
        #: Queues that producers outside the workers fill (which may ring nothing): polled every
        #: `idle_poll_ms`. Every other queue is filled by the workers' own scripts, each enqueue
        #: rings, and its poll (`delay_poll_ms`, as a delay queue's) only covers a ring lost with a
        #: connection. None: every queue but the delay queues is such a queue.
        self.entry_queues = entry_queues
        self.calls = ModelCalls(settings.model_calls or default_model_calls(), self)
        self.keys = Keys(settings.prefix)
        self.url = url
        self._rings: dict[str, list[threading.Event]] = {}
        self._rings_lock = threading.Lock()
        self._listener: Listener | None = None
        self.closing = False
        self.reachability = Reachability(url)
        self._closed = threading.Event()
        #: Per queue, the redis ids of the messages this process's consumers handed to dramatiq and
        #: that are not acked, nacked or requeued yet (`DoorbellConsumer`: what is NOT an orphan).
        self.held: dict[str, set[str]] = {}
        #: Per queue, the redis ids of messages acked and not yet sent: the queue's consumer sends them
        #: with its next fetch (`DoorbellConsumer._send_acks`); they stay held until then.
        self.unsent_acks: dict[str, list[str]] = {}
        self.held_lock = threading.Lock()
        self._queue_keys: dict[str, list[str]] = {}
        self._dispatch_script = self.client.register_script(lua.source("dispatch"))

    @property
    def listener(self) -> Listener:
        """The process's pub/sub listener, started on first use (worker processes only)."""
        if self._listener is None:
            self._listener = Listener(self.url, reachability=self.reachability)
            self._listener.on(self.keys.doorbell_channel(), self._ring)
            self._listener.on_reconnect(self._ring_all)
        return self._listener

    def consume(self, queue_name: str, prefetch: int = 1, timeout: int = 5000) -> DoorbellConsumer:
        if queue_name in self.slow_queues:
            prefetch = self.calls.limit  # a call's message stays outstanding until its call ends
        delayed = queue_name.endswith(".DQ")
        entry = not delayed and (self.entry_queues is None or queue_name in self.entry_queues)
        idle_ms = self.settings.idle_poll_ms if entry else self.settings.delay_poll_ms
        # dramatiq restarts a consumer that lost its connection after 3 s; this adds the backoff
        self._closed.wait(self.reachability.retry_in(queue_name))
        ring = threading.Event()
        with self._rings_lock:
            self._rings.setdefault(queue_name, []).append(ring)
        _ = self.listener
        return DoorbellConsumer(self, queue_name, prefetch, idle_ms, ring)

    def enqueue(self, message: Message[Any], *, delay: int | None = None) -> Message[Any]:
        """Enqueue, waiting out a Redis outage: in a worker process this is dramatiq enqueuing a
        retry (`Retries`) or moving a delayed message to its queue, and the message it comes from is
        acked right after, so an enqueue given up would lose it. (dramatiq waits out an outage the
        same way to ack.) A stopping process does not wait."""
        while True:
            try:
                enqueued = super().enqueue(message, delay=delay)  # rings too: dispatch.lua's enqueue
                break
            except (redis.ConnectionError, redis.TimeoutError) as e:
                if self.closing:
                    raise
                self._closed.wait(self.reachability.failed("enqueue", e))
        self.reachability.ok("enqueue")
        return enqueued

    def queue_keys(self, queue_name: str) -> list[str]:
        """KEYS of dispatch.lua (and dead_letter.lua) for a queue: the queue, its messages, this
        worker's ack set of it, and the dead-letter set and bodies of its canonical queue."""
        keys = self._queue_keys.get(queue_name)
        if keys is None:
            canonical = q_name(queue_name)
            keys = self._queue_keys[queue_name] = [
                self.keys.queue(queue_name), self.keys.queue_messages(queue_name),
                self.keys.acks(self.broker_id, queue_name),
                self.keys.dead_queue(canonical), self.keys.dead_queue_messages(canonical)]
        return keys

    def dispatch_keys(self, command: str, queue_name: str) -> list[str]:
        """KEYS of one dispatch.lua call. A queue's keys share its name, so a queue named with a hash
        tag (a shard's: `resolve{s3}`) keeps every call in one Redis Cluster slot."""
        if command != "qsize":
            return self.queue_keys(queue_name)
        canonical = q_name(queue_name)
        delayed = f"{canonical}.DQ"
        return [self.keys.queue_messages(canonical), self.keys.acks(self.broker_id, canonical),
                self.keys.queue_messages(delayed), self.keys.acks(self.broker_id, delayed)]

    def _dispatch(self, command: str) -> Callable[..., Any]:
        """dramatiq's `do_<command>(queue_name, *args)`, run by dispatch.lua with every key in KEYS."""
        script = self._dispatch_script

        def do_dispatch(queue_name: str, *args: Any) -> Any:
            keys = self.dispatch_keys(command, queue_name)
            if command == "enqueue":
                args = (*args, self.keys.doorbell_channel(), queue_name)
            elif command == "nack":
                args = (*args, self.dead_message_ttl)
            unpack = self._max_unpack_size()  # type: ignore[no-untyped-call]
            return script(keys=keys, args=[command, now_ms(), unpack, *args])

        return do_dispatch

    def _ring(self, queue_name: str) -> None:
        with self._rings_lock:
            rings = list(self._rings.get(queue_name, ()))
        for ring in rings:
            ring.set()

    def ring(self, queue_name: str) -> None:
        """Tell every worker that `queue_name` has messages (ones put back without an enqueue)."""
        self.client.publish(self.keys.doorbell_channel(), queue_name)

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
            ring.set()

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
        self, broker: DoorbellBroker, queue_name: str, prefetch: int, idle_ms: int, ring: threading.Event
    ) -> None:
        super().__init__(broker, queue_name, prefetch, idle_ms)  # type: ignore[no-untyped-call]
        self.ring = ring
        self.idle_s = idle_ms / 1000
        self.delayed = queue_name.endswith(".DQ")
        # The dead-letter set is the canonical queue's: `resolve.DQ` -> `resolve.XQ`.
        self.canonical_queue = q_name(queue_name)
        _, bodies, acks, dead, dead_bodies = broker.queue_keys(queue_name)
        self._dead_letter_keys = [acks, bodies, dead, dead_bodies, broker.keys.dead_letters()]
        self._dead_letter_script = broker.client.register_script(lua.source("dead_letter"))
        #: Look for orphans before the first fetch (`_requeue_orphans`).
        self._sweep = True

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
        """Acks ride on the consumer's next fetch, which the ack wakes: one round trip for a message
        done and the next one taken, not two. The message stays held (no orphan) until its ack is
        sent; a stopping process sends it at once, as dramatiq does."""
        if self.broker.closing:
            try:
                super().ack(message)  # type: ignore[no-untyped-call]
                self._release(message)  # not when the ack failed: dramatiq tries it again, and it is still held
            finally:
                self.ring.set()
            return
        with self.broker.held_lock:
            self.broker.unsent_acks.setdefault(self.queue_name, []).append(message.options["redis_message_id"])
        self.queued_message_ids.discard(message.message_id)  # what dramatiq's ack does locally
        self.ring.set()

    def _send_acks(self, fetch: int) -> list[bytes | None]:
        """Send the queue's unsent acks, with a fetch of up to `fetch` messages (0: none) in the same
        call; the fetched (id, body, ...). Acks a lost connection kept from Redis are sent next time."""
        with self.broker.held_lock:
            acks = self.broker.unsent_acks.pop(self.queue_name, [])
        if not acks and not fetch:
            return []
        fetched: list[bytes | None] = []
        try:
            if fetch:
                fetched = self.broker.do_fetch(self.queue_name, fetch, *acks)
            else:
                self.broker.do_ack(self.queue_name, *acks)
        except redis.RedisError:
            with self.broker.held_lock:
                self.broker.unsent_acks[self.queue_name] = acks + self.broker.unsent_acks.get(self.queue_name, [])
            raise
        if acks:
            with self.broker.held_lock:
                held = self.broker.held.get(self.queue_name, set())
                held.difference_update(acks)
        return fetched

    def close(self) -> None:
        with contextlib.suppress(redis.RedisError):
            self._send_acks(0)
        super().close()

    def nack(self, message: dramatiq.MessageProxy) -> None:
        """dramatiq nacks a message for an actor it does not know (`ConsumerThread.handle_message`)
        and one that failed for good (retries exhausted): either way, record why. A detached call
        that failed for good may be failed before dramatiq looks: its nack, too, waits for its end."""
        if self.broker.calls.defer_ack(message, self):
            return
        self._nack(message)

    def _nack(self, message: dramatiq.MessageProxy) -> None:
        try:
            super().nack(message)  # type: ignore[no-untyped-call]
            self._release(message)
            self._record_nack(message)
        finally:
            self.ring.set()  # capacity freed: a ring passed over while the consumer was full is answered

    def requeue(self, messages: Iterable[dramatiq.MessageProxy]) -> None:
        listed = list(messages)
        super().requeue(listed)  # type: ignore[no-untyped-call]
        for message in listed:
            self._release(message)
        if listed:
            # put back without an enqueue (a stopping worker's): ring, or they wait for a poll
            with contextlib.suppress(redis.RedisError):
                self.broker.ring(self.queue_name)

    def _hold(self, message: dramatiq.MessageProxy) -> None:
        with self.broker.held_lock:
            self.broker.held.setdefault(self.queue_name, set()).add(message.options["redis_message_id"])

    def _release(self, message: dramatiq.MessageProxy) -> None:
        with self.broker.held_lock:
            self.broker.held.get(self.queue_name, set()).discard(message.options["redis_message_id"])

    def _requeue_orphans(self) -> None:
        """Put back the messages this process's ack set holds that no part of the process has: the
        ones a consumer had fetched when it lost its connection (dramatiq drops a consumer's fetched,
        not yet handed out messages with it) and the ones of a fetch whose reply was lost. dramatiq
        gives them back only when the process is gone; without this, their turns would wait for the
        watchdog's stall time (a delay queue's: every message its last consumer handed out, see
        below). Runs before a new consumer's first fetch, on the consumer thread."""
        acks = self._dead_letter_keys[0]
        with self.broker.held_lock:
            if self.delayed:
                # a delay queue's messages wait in its consumer thread until their eta, and dramatiq
                # drops that wait list with a consumer that lost its connection: none is held now
                self.broker.held.pop(self.queue_name, None)
            held = set(self.broker.held.get(self.queue_name, ()))
        members = self.broker.client.smembers(acks)
        orphans = [m for m in (v.decode() if isinstance(v, bytes) else str(v) for v in members) if m not in held]
        if orphans:
            self.broker.do_requeue(self.queue_name, *orphans)
            self.broker.ring(self.queue_name)  # the other processes' consumers may take them too
            metrics.ORPHANS_REQUEUED.labels(self.queue_name).inc(len(orphans))
            log.warning("orphaned_messages_requeued", queue=self.queue_name, messages=len(orphans))

    def __next__(self) -> dramatiq.MessageProxy | None:
        try:
            if self._sweep:
                self._requeue_orphans()
                self._sweep = False
            while True:
                if self.message_cache:
                    proxy = self.message_cache.pop(0)
                    self.misses = 0
                    self.queued_message_ids.add(proxy.message_id)
                    self._hold(proxy)
                    return proxy
                # Clear before fetching: a ring that lands during the fetch is not lost.
                self.ring.clear()
                room = 0 if self.broker.closing else max(0, self.prefetch - self.outstanding_message_count)
                fetched = self._send_acks(room)  # id, body (None when it is gone), id, body, ...
                if room:
                    self.broker.reachability.ok(self.queue_name)
                    self.message_cache = self._admit(fetched)
                if not fetched:
                    self.ring.wait(self._wait_s())
                    return None
        except redis.ConnectionError as e:
            self.broker.reachability.failed(self.queue_name, e)
            raise ConnectionClosed(e) from None  # type: ignore[no-untyped-call]

    def _wait_s(self) -> float:
        # A delay queue holding messages must look at their etas often; otherwise sleep until rung.
        if self.broker.closing or (self.delayed and self.outstanding_message_count):
            return 0.05
        return self.idle_s

    def _admit(self, fetched: list[bytes | None]) -> list[dramatiq.MessageProxy]:
        """The batch's messages (`fetched`: dispatch.lua's id, body pairs); refused bodies and ids
        without a body are dead-lettered first, in one script, so that nothing of them stays in the
        ack set (normal batches: no extra call)."""
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
            else:
                admitted.append(dramatiq.MessageProxy(parsed))
        missing = len(admitted) + len(refused) < len(bodies)
        if refused or missing:
            self._dead_letter(refused, sweep=missing)
        return admitted

    def _dead_letter(self, refused: list[tuple[bytes, _Refused]], *, sweep: bool) -> None:
        args: list[bytes | str | int] = [now_ms(), self.canonical_queue, DEAD_LETTERS_MAXLEN, "1" if sweep else "0"]
        for data, why in refused:
            args += [data, why.reason, why.actor]
        try:
            reply = self._dead_letter_script(keys=self._dead_letter_keys, args=args)
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
        try:
            self.broker.client.xadd(self.broker.keys.dead_letters(), entry,  # type: ignore[arg-type]
                                    maxlen=DEAD_LETTERS_MAXLEN, approximate=True)
        except redis.RedisError as e:
            log.warning("dead_letter_record_failed", queue=self.queue_name, error=type(e).__name__)
        log.error("message_dead_lettered", queue=self.queue_name, redis_message_id=_clip(redis_id), reason=reason)


def now_ms() -> int:
    return int(time.time() * 1000)
