"""A worker process's part in recovery and in a graceful stop.

While it runs, a thread renews its heartbeat every `TL_HEARTBEAT_S` with the turns it runs a stage
of (heartbeat.lua): the watchdog of any process takes over a turn whose holder's heartbeat no longer
lists it, within `TL_WORKER_TIMEOUT_S` of a crash (a live long turn is never re-run), and puts the
messages a dead process had fetched back on their queues.

When it stops (SIGTERM): it fetches nothing more, puts back at once the messages it fetched but did
not start, and cancels its model runs so that each hands its turn to another worker (`retrying`,
the claim released, the stage enqueued again without delay); other stages finish within the grace
`worker.stop` is given. Its last act is to take its heartbeat away, so that whatever it could not
finish is taken over at the watchdog's next look instead of after a timeout.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections import defaultdict
from typing import TYPE_CHECKING, Any

import dramatiq
import redis
import structlog
from dramatiq.common import iter_queue
from dramatiq.middleware import Middleware

from threadline.workers.settings import Settings
from threadline.workers.storage import lua
from threadline.workers.storage.connect import sync_client
from threadline.workers.worker.middleware.give_up import turn_id_of
from threadline.workers.worker.runtime import Runtime, RuntimeRef

if TYPE_CHECKING:
    from threadline.workers.worker.reachability import Reachability

log = structlog.get_logger(__name__)


class Heartbeat:
    """The thread that renews a worker process's heartbeat: a thread of its own, so that a busy
    event loop does not make a live process look dead (the model claim, renewed from the run, covers
    a stuck loop)."""

    def __init__(self, runtime: Runtime, *, url: str, broker_id: str, queues: list[str],
                 reachability: Reachability | None = None) -> None:
        self.rt = runtime
        settings = runtime.settings
        # three beats per timeout at least: one late beat never makes a live process look dead
        self.interval_s = min(settings.heartbeat_s, settings.worker_timeout_s / 3)
        self.ttl_ms = int(settings.worker_timeout_s * 1000)
        self.broker_id = broker_id
        self.info = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "broker_id": broker_id,
                                "queues": queues, "since": time.time()})
        self._client = sync_client(url, socket_timeout=5, socket_connect_timeout=5)
        self._script = self._client.register_script(lua.source("heartbeat"))
        self._reachability = reachability
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="threadline-heartbeat", daemon=True)

    def start(self) -> None:
        self.beat()  # before the first message: a stage begun from now on has a live holder
        self._thread.start()

    def beat(self, *, stop: bool = False) -> bool:
        k = self.rt.store.keys
        worker_id = self.rt.worker_id
        try:
            self._script(keys=[k.worker(worker_id), k.worker_turns(worker_id), k.workers(), k.heartbeats()],
                         args=[lua.payload(worker_id=worker_id, broker_id=self.broker_id, info=self.info,
                                           ttl_ms=self.ttl_ms, now_ms=int(time.time() * 1000),
                                           turns=[] if stop else self.rt.held(), stop=stop)])
        except redis.RedisError as e:
            if self._reachability is not None:
                self._reachability.failed("heartbeat", e)
            return False
        if self._reachability is not None:
            self._reachability.ok("heartbeat")
        return True

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.beat()

    def stop(self) -> None:
        """Stop beating and take the heartbeat away (the process is about to end)."""
        self._stop.set()
        self._thread.join(timeout=2)
        self.beat(stop=True)
        self._client.close()


class Liveness(Middleware):
    def __init__(self, settings: Settings, url: str, ref: RuntimeRef, *, admit_actor: str) -> None:
        self.settings = settings
        self.url = url
        self.ref = ref
        self.admit_actor = admit_actor
        self.heartbeat: Heartbeat | None = None
        self._holding: dict[str, str] = {}
        self._lock = threading.Lock()

    # --- the turns this process runs a stage of ---------------------------------------------------

    def before_process_message(self, broker: dramatiq.Broker, message: dramatiq.MessageProxy) -> None:
        turn_id = turn_id_of(message, admit_actor=self.admit_actor)
        if turn_id is None:
            return
        with self._lock:
            self._holding[message.message_id] = turn_id
        self.ref.get().hold(turn_id)

    def after_process_message(self, broker: dramatiq.Broker, message: dramatiq.MessageProxy, *,
                              result: Any = None, exception: BaseException | None = None) -> None:
        self._let_go(message)

    def after_skip_message(self, broker: dramatiq.Broker, message: dramatiq.MessageProxy) -> None:
        self._let_go(message)

    def _let_go(self, message: dramatiq.MessageProxy) -> None:
        with self._lock:
            turn_id = self._holding.pop(message.message_id, None)
        if turn_id is not None:
            self.ref.get().let_go(turn_id)

    # --- start and stop --------------------------------------------------------------------------

    def after_worker_boot(self, broker: dramatiq.Broker, worker: dramatiq.Worker) -> None:
        from threadline.workers.worker.broker import DoorbellBroker

        assert isinstance(broker, DoorbellBroker)
        queues = sorted(q for q in broker.get_declared_queues()
                        if not worker.consumer_whitelist or q in worker.consumer_whitelist)
        self.heartbeat = Heartbeat(self.ref.get(), url=self.url, broker_id=broker.broker_id, queues=queues,
                                   reachability=broker.reachability)
        self.heartbeat.start()

    def before_worker_shutdown(self, broker: dramatiq.Broker, worker: dramatiq.Worker) -> None:
        """Runs after Boot's (the consumers fetch nothing more): put back what was fetched and not
        started, and hand the model runs over."""
        from threadline.workers.worker.broker import DoorbellBroker

        assert isinstance(broker, DoorbellBroker)
        requeued = requeue_prefetched(broker, worker)
        handed_over = self.ref.get().hand_over_all()
        log.info("worker_draining", requeued=requeued, handing_over=handed_over, running=self.ref.get().held(),
                 grace_s=self.settings.shutdown_grace_s)
        # the model calls run on their own event loop, stopped with the worker: wait for them to hand back
        if not broker.calls.wait_idle(self.settings.shutdown_grace_s):
            log.warning("model_calls_still_running", calls=broker.calls.running())

    def after_worker_shutdown(self, broker: dramatiq.Broker, worker: dramatiq.Worker) -> None:
        left = self.ref.get().held()
        if self.heartbeat is not None:
            self.heartbeat.stop()
        if left:
            # past the grace: the watchdog takes these over (their holder's heartbeat is gone now)
            log.warning("turns_abandoned", turns=left)


def requeue_prefetched(broker: Any, worker: dramatiq.Worker) -> int:
    """Put the messages waiting in this worker's memory (fetched, not started) back on their queues
    now, rather than at the end of `Worker.stop`, and ring for them: another worker runs them at once."""
    by_queue: dict[str, list[dramatiq.MessageProxy]] = defaultdict(list)
    for item in iter_queue(worker.work_queue):  # type: ignore[no-untyped-call]
        by_queue[item.message.queue_name].append(item.message)
    for queue_name, messages in by_queue.items():
        try:
            worker.consumers[queue_name].requeue_messages(messages)  # rings each shard it put back on
        except (dramatiq.errors.BrokerConnectionError, redis.RedisError) as e:
            # they stay in the ack set: the watchdog puts them back once this process is gone
            log.warning("requeue_failed", queue=queue_name, messages=len(messages), error=type(e).__name__)
    return sum(len(m) for m in by_queue.values())
