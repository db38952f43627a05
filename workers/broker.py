"""The dramatiq Redis broker with a doorbell: millisecond hand-offs without busy polling.

Stock dramatiq consumers poll Redis with exponential backoff up to `worker_timeout`, so hand-off
latency is bought with idle load. Here an idle consumer blocks on a per-queue `threading.Event`
instead; every enqueue PUBLISHes the queue name on the doorbell channel, and each worker process's
one pub/sub listener sets the events of that queue. Consumers still poll every `idle_poll_ms`, so
messages from producers that ring nothing (raw Redis), rings lost to a reconnect, and redelivered
messages are all picked up, with the ordinary polling latency.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import dramatiq
import redis
import structlog
from dramatiq.brokers.redis import RedisBroker, _RedisConsumer
from dramatiq.errors import ConnectionClosed, DecodeError
from dramatiq.message import Message
from dramatiq.middleware import AgeLimit, AsyncIO, CurrentMessage, Middleware, Retries

from .keys import Keys
from .listener import Listener
from .settings import Settings

log = structlog.get_logger(__name__)

STAGE_QUEUES = ("resolve", "history", "map", "invoke", "persist")
CONTROL_QUEUE = "control"
QUEUES = (*STAGE_QUEUES, CONTROL_QUEUE)
WAKE_ID = "@@WAKE_ID@@"


def build_message(
    queue: str,
    actor: str,
    args: tuple[Any, ...],
    *,
    message_id: str,
    now_ms: int,
    delay_ms: int | None = None,
) -> tuple[str, str, bytes]:
    """A dramatiq message as `RedisBroker.enqueue` writes it: (queue to push to, id, data).

    `options.redis_message_id` must equal the hash field the message is stored under.
    """
    options: dict[str, Any] = {"redis_message_id": message_id}
    target = queue
    if delay_ms:
        target = f"{queue}.DQ"
        options["eta"] = now_ms + delay_ms
    message: Message[Any] = Message(
        queue_name=target,
        actor_name=actor,
        args=args,
        kwargs={},
        options=options,
        message_id=message_id,
        message_timestamp=now_ms,
    )
    return target, message_id, message.encode()


class DoorbellBroker(RedisBroker):
    def __init__(self, *, settings: Settings, url: str, **kwargs: Any) -> None:
        super().__init__(url=url, namespace=settings.broker_namespace, **kwargs)  # type: ignore[no-untyped-call]
        self.settings = settings
        self.keys = Keys(settings.prefix)
        self.url = url
        self._rings: dict[str, list[threading.Event]] = {}
        self._rings_lock = threading.Lock()
        self._listener: Listener | None = None
        self.closing = False

    @property
    def consumer_class(self) -> type[_RedisConsumer]:
        return DoorbellConsumer

    @property
    def listener(self) -> Listener:
        """The process's pub/sub listener, started on first use (worker processes only)."""
        if self._listener is None:
            self._listener = Listener(self.url)
            self._listener.on(self.keys.doorbell_channel(), self._ring)
            self._listener.on_reconnect(self._ring_all)
        return self._listener

    def consume(self, queue_name: str, prefetch: int = 1, timeout: int = 5000) -> DoorbellConsumer:
        if queue_name == "invoke":
            prefetch = self.settings.invoke_prefetch or 1
        delayed = queue_name.endswith(".DQ")
        idle_ms = self.settings.delay_poll_ms if delayed else self.settings.idle_poll_ms
        ring = threading.Event()
        with self._rings_lock:
            self._rings.setdefault(queue_name, []).append(ring)
        _ = self.listener
        return DoorbellConsumer(self, queue_name, prefetch, idle_ms, ring)

    def enqueue(self, message: Message[Any], *, delay: int | None = None) -> Message[Any]:
        enqueued = super().enqueue(message, delay=delay)
        self.client.publish(self.keys.doorbell_channel(), enqueued.queue_name)
        return enqueued

    def _ring(self, queue_name: str) -> None:
        with self._rings_lock:
            rings = list(self._rings.get(queue_name, ()))
        for ring in rings:
            ring.set()

    def before_shutdown(self) -> None:
        """Wake every idle consumer so that a stopping worker does not wait out their polls."""
        self.closing = True
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


class DoorbellConsumer(_RedisConsumer):
    broker: DoorbellBroker

    def __init__(
        self, broker: DoorbellBroker, queue_name: str, prefetch: int, idle_ms: int, ring: threading.Event
    ) -> None:
        super().__init__(broker, queue_name, prefetch, idle_ms)  # type: ignore[no-untyped-call]
        self.ring = ring
        self.idle_s = idle_ms / 1000
        self.delayed = queue_name.endswith(".DQ")

    def ack(self, message: dramatiq.MessageProxy) -> None:
        try:
            super().ack(message)  # type: ignore[no-untyped-call]
        finally:
            self.ring.set()  # capacity freed: fetch again now

    def nack(self, message: dramatiq.MessageProxy) -> None:
        try:
            super().nack(message)  # type: ignore[no-untyped-call]
        finally:
            self.ring.set()

    def __next__(self) -> dramatiq.MessageProxy | None:
        try:
            while True:
                if self.message_cache:
                    proxy = self._decode(self.message_cache.pop(0))
                    if proxy is not None:
                        return proxy
                    continue
                # Clear before fetching: a ring that lands during the fetch is not lost.
                self.ring.clear()
                messages: list[bytes] = []
                if self.outstanding_message_count < self.prefetch:
                    messages = self.broker.do_fetch(self.queue_name, self.prefetch - self.outstanding_message_count)
                    self.message_cache = messages
                if not messages:
                    self.ring.wait(self._wait_s())
                    return None
        except redis.ConnectionError as e:
            raise ConnectionClosed(e) from None  # type: ignore[no-untyped-call]

    def _wait_s(self) -> float:
        # A delay queue holding messages must look at their etas often; otherwise sleep until rung.
        if self.broker.closing or (self.delayed and self.outstanding_message_count):
            return 0.05
        return self.idle_s

    def _decode(self, data: bytes | None) -> dramatiq.MessageProxy | None:
        if data is None:
            return None
        try:
            message = Message.decode(data)
        except DecodeError:
            self._drop_undecodable(data)
            return None
        self.misses = 0
        self.queued_message_ids.add(message.message_id)
        return dramatiq.MessageProxy(message)

    def _drop_undecodable(self, data: bytes) -> None:
        """A poison message never crashes a consumer: dead-letter it when its id can be read."""
        try:
            redis_id = json.loads(data)["options"]["redis_message_id"]
        except (ValueError, KeyError, TypeError):
            log.error("undecodable_message_dropped", queue=self.queue_name, size=len(data))
            return
        self.broker.do_nack(self.queue_name, redis_id)
        log.error("undecodable_message_dead_lettered", queue=self.queue_name, redis_message_id=redis_id)


class LogContext(Middleware):
    """Binds turn_id, stage and attempt to every log line of a message (structlog contextvars
    propagate into the actor's task on the event loop)."""

    def before_process_message(self, broker: dramatiq.Broker, message: dramatiq.MessageProxy) -> None:
        structlog.contextvars.clear_contextvars()
        fields: dict[str, Any] = {"stage": message.actor_name, "message_id": message.message_id}
        arg = message.args[0] if message.args else None
        if isinstance(arg, dict):
            for name in ("turn_id", "attempt", "conversation_id"):
                if name in arg:
                    fields[name] = arg[name]
        structlog.contextvars.bind_contextvars(**fields)

    def after_process_message(self, broker: dramatiq.Broker, message: dramatiq.MessageProxy, *,
                              result: Any = None, exception: BaseException | None = None) -> None:
        structlog.contextvars.clear_contextvars()

    def after_skip_message(self, broker: dramatiq.Broker, message: dramatiq.MessageProxy) -> None:
        structlog.contextvars.clear_contextvars()


def make_broker(settings: Settings, url: str, *, extra: list[Middleware] | None = None) -> DoorbellBroker:
    middleware = [
        AgeLimit(),
        Retries(max_retries=5, min_backoff=200, max_backoff=10_000),
        CurrentMessage(),
        AsyncIO(),
        LogContext(),
        *(extra or []),
    ]
    broker = DoorbellBroker(settings=settings, url=url, middleware=middleware)
    dramatiq.set_broker(broker)
    return broker


def now_ms() -> int:
    return int(time.time() * 1000)
