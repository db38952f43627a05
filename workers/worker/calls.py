"""The model calls a worker process runs on an event loop of their own, off the threads of their
messages.

A model call waits on the network for seconds to minutes; a dramatiq worker thread held for all that
time is what capped a process at a handful of calls. Here the model actor claims the call, starts it
as a task on the calls' event loop and returns, freeing its thread within milliseconds. That loop is
not the one the other stages run on (dramatiq's): hundreds of streaming calls keep it busy, and a
fast stage or a cancel would wait behind all of their callbacks at every step. Each loop has its own
Redis connections and its own models (`Runtime.for_calls`); a model object never crosses loops. dramatiq
still delivers and acknowledges the message: its ack waits until the call has ended (`defer_ack`), so
the message stays in the broker's ack set as long as the call runs — redelivered if the process dies,
counted against the model queue's prefetch, which is therefore the number of calls a process runs at
once (`Settings.model_calls`: that is the back-pressure). The task holds its turn for the heartbeat
(`Runtime.hold`), so the watchdog takes over after a kill as before; a call that raises is
redelivered the way dramatiq's `Retries` would have (`redeliver`).

Middleware that time a message (metrics, spans) see a detached message end when its call ends:
they register `on_end` and skip it in their `after_process_message`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
import time
import traceback
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Protocol

import dramatiq
import structlog
from dramatiq.common import compute_backoff
from dramatiq.middleware import Retries

from threadline.workers.worker.loops import LoopFactory

log = structlog.get_logger(__name__)

#: What one open model call costs a worker process: `bench.model_bound` measured 19.5 MiB of
#: resident memory per 100 open streaming calls (docs/performance.md); rounded up.
MIB_PER_CALL = 0.25
#: The default number of calls a process runs at once: this many, or fewer when a quarter of the
#: memory available at start-up would not hold them; never fewer than MIN_DEFAULT.
MAX_DEFAULT = 500
MIN_DEFAULT = 16


def default_model_calls(available_mib: float | None = None) -> int:
    """How many model calls a process takes at most, unless `TL_MODEL_CALLS` says."""
    mib = available_mib if available_mib is not None else _available_mib()
    if mib is None:
        return MAX_DEFAULT
    return max(MIN_DEFAULT, min(MAX_DEFAULT, int(mib / 4 / MIB_PER_CALL)))


def _available_mib() -> float | None:
    """Memory available to this process: the cgroup's limit when one is set, else the machine's."""
    try:
        with open("/sys/fs/cgroup/memory.max") as handle:
            limit = handle.read().strip()
        if limit != "max":
            return int(limit) / 2**20
    except (OSError, ValueError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError):
        return None


class _Acker(Protocol):
    def ack_detached(self, message: dramatiq.MessageProxy) -> None: ...


@dataclass(slots=True)
class _Call:
    message: dramatiq.MessageProxy
    ended: bool = False
    #: The consumer whose ack waits for the call's end, once dramatiq asked for it.
    acker: _Acker | None = None


class ModelCalls:
    """The calls running detached, by delivery (`delivery`), and the acks that wait for them."""

    def __init__(self, limit: int, broker: dramatiq.Broker | None = None,
                 new_loop: LoopFactory = asyncio.new_event_loop) -> None:
        self.limit = limit
        self.broker = broker
        self._new_loop = new_loop
        self._calls: dict[str, _Call] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        #: The calls' futures, held until they end (a loop keeps only weak references to its tasks).
        self._futures: set[concurrent.futures.Future[None]] = set()
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._on_end: list[Callable[[dramatiq.MessageProxy, str], None]] = []

    def running(self) -> int:
        with self._lock:
            return sum(not c.ended for c in self._calls.values())

    def on_end(self, hook: Callable[[dramatiq.MessageProxy, str], None]) -> None:
        """Call `hook(message, outcome)` (outcome "ok" or "error") when a detached call ends."""
        self._on_end.append(hook)

    def detached(self, key: str) -> bool:
        """Whether the delivery `key` (`delivery`) runs detached, or waits for its ack."""
        with self._lock:
            return key in self._calls

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The calls' event loop, started on first use (a thread of its own)."""
        with self._lock:
            if self._loop is None:
                self._loop = self._new_loop()
                self._thread = threading.Thread(target=self._loop.run_forever, name="threadline-model-calls",
                                                daemon=True)
                self._thread.start()
            return self._loop

    def stop(self) -> None:
        """Stop the loop (the worker has stopped: `wait_idle` gave the calls their grace)."""
        with self._lock:
            loop, thread = self._loop, self._thread
        if loop is not None and thread is not None:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout=5)

    def spawn(self, message: dramatiq.MessageProxy, work: Coroutine[Any, Any, None]) -> None:
        """Run `work` on the calls' loop (in a copy of the caller's context: its log fields, its
        span); `message`'s ack waits until it has ended. `work` handles its errors (the runner
        redelivers the message); one that escapes is logged and makes the call's outcome "error"."""
        with self._lock:
            self._calls[delivery(message)] = _Call(message)
        future = asyncio.run_coroutine_threadsafe(self._run(message, work), self.loop)
        with self._lock:
            self._futures.add(future)
        future.add_done_callback(self._forget)

    def _forget(self, future: concurrent.futures.Future[None]) -> None:
        with self._lock:
            self._futures.discard(future)

    async def _run(self, message: dramatiq.MessageProxy, work: Coroutine[Any, Any, None]) -> None:
        outcome = "ok"
        try:
            await work
        except BaseException as e:
            outcome = "error"
            log.error("model_call_failed", error=type(e).__name__, exc_info=not isinstance(e, asyncio.CancelledError))
            if not isinstance(e, Exception):
                raise
        finally:
            acker = self._end(delivery(message))
            for hook in self._on_end:
                hook(message, outcome)
            if acker is not None:
                try:
                    await asyncio.to_thread(acker.ack_detached, message)
                except Exception as e:  # the process stops: its stage is done, a redelivery is a no-op
                    log.warning("model_call_ack_failed", error=type(e).__name__)

    def defer_ack(self, message: dramatiq.MessageProxy, acker: _Acker) -> bool:
        """dramatiq acks `message`: True when its call still runs, and `acker.ack_detached` acks it
        when the call ends; False when the ack may go now (no call, or the call has ended)."""
        with self._lock:
            call = self._calls.get(delivery(message))
            if call is None:
                return False
            if call.ended:
                del self._calls[delivery(message)]
                self._idle.notify_all()
                return False
            call.acker = acker
            return True

    def _end(self, key: str) -> _Acker | None:
        with self._lock:
            call = self._calls[key]
            call.ended = True
            if call.acker is None:  # dramatiq's ack comes later and goes at once (`defer_ack`)
                return None
            del self._calls[key]
            self._idle.notify_all()
            return call.acker

    async def redeliver(self, message: dramatiq.MessageProxy, exception: BaseException) -> bool:
        """`redeliver` on this process's broker, off the event loop."""
        assert self.broker is not None, "calls run detached only in a worker"
        return await asyncio.to_thread(redeliver, self.broker, message, exception)

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no call runs and no ack waits (a stopping worker), at most `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        with self._idle:
            while self._calls:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(left)
        return True


def delivery(message: dramatiq.MessageProxy) -> str:
    """One delivery of a message: a redelivered message keeps its message id, not its Redis id."""
    return str(message.options.get("redis_message_id") or message.message_id)


def calls_of(broker: dramatiq.Broker) -> ModelCalls | None:
    """The detached calls of a worker's broker (None for a broker that runs none)."""
    calls = getattr(broker, "calls", None)
    return calls if isinstance(calls, ModelCalls) else None


def ends_later(broker: dramatiq.Broker, message: dramatiq.MessageProxy) -> bool:
    """Whether `message`'s work goes on after its actor returned (a middleware's after-hook waits
    for `on_end`)."""
    calls = calls_of(broker)
    return calls is not None and calls.detached(delivery(message))


def redeliver(broker: dramatiq.Broker, message: dramatiq.MessageProxy, exception: BaseException) -> bool:
    """What dramatiq's `Retries` does with a message whose actor raised, for a call that raised after
    its actor returned: enqueue the message again after the same backoff (True), or False once its
    retries are spent (the message is failed; the caller ends the turn, as `GiveUp` would). It may
    wait out a Redis outage (`DoorbellBroker.enqueue`): run it off the event loop."""
    retries = next(m for m in broker.middleware if isinstance(m, Retries))
    actor = broker.get_actor(message.actor_name)
    done = message.options.get("retries", 0)
    if done >= actor.options.get("max_retries", retries.max_retries):
        message.fail()  # its ack becomes a nack: dead-lettered, with the reason (`DoorbellConsumer`)
        message.stuff_exception(exception)
        return False
    message.options.update(retries=done + 1, traceback="".join(traceback.format_exception(exception, limit=30)),
                           requeue_timestamp=int(time.time() * 1000))
    _, delay = compute_backoff(done, factor=retries.min_backoff, max_backoff=retries.max_backoff)
    broker.enqueue(message, delay=delay)  # type: ignore[arg-type]  # a proxy, as Retries enqueues it
    return True
