"""Counts every message a worker processes: its stage's time and outcome, the stages running now,
and the redeliveries; and says, once a second, whether the worker's consumer threads run (what the
supervisor's `/healthz` reports). The metrics themselves are in `workers/telemetry/metrics.py`."""

from __future__ import annotations

import threading
import time
from typing import Any

import dramatiq
from dramatiq.middleware import Middleware

from threadline.workers.telemetry import metrics
from threadline.workers.worker.calls import calls_of, delivery, ends_later


class Metrics(Middleware):
    def __init__(self, *, report_s: float = 1.0) -> None:
        self.report_s = report_s
        self._started: dict[str, float] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._reporter: threading.Thread | None = None

    def after_worker_boot(self, broker: dramatiq.Broker, worker: dramatiq.Worker) -> None:
        if (calls := calls_of(broker)) is not None:
            calls.on_end(self._done)  # a model call's time is its whole call's, not its actor's
            metrics.MODEL_CALLS_LIMIT.set(calls.limit)
        self._stop.clear()
        self._reporter = threading.Thread(target=self._report, args=(worker,), name="threadline-metrics-report",
                                          daemon=True)
        self._reporter.start()

    def before_worker_shutdown(self, broker: dramatiq.Broker, worker: dramatiq.Worker) -> None:
        self._stop.set()
        metrics.WORKER_READY.set(0)

    def before_process_message(self, broker: dramatiq.Broker, message: dramatiq.MessageProxy) -> None:
        with self._lock:  # by delivery: a redelivery may start before the call that redelivered it has ended
            self._started[delivery(message)] = time.perf_counter()
        metrics.STAGES_RUNNING.labels(message.actor_name).inc()
        if message.options.get("retries"):  # set by dramatiq's Retries when it enqueues a message again
            metrics.REDELIVERIES.labels(message.actor_name).inc()

    def after_process_message(self, broker: dramatiq.Broker, message: dramatiq.MessageProxy, *,
                              result: Any = None, exception: BaseException | None = None) -> None:
        if exception is None and ends_later(broker, message):
            return
        self._done(message, "ok" if exception is None else "error")

    def after_skip_message(self, broker: dramatiq.Broker, message: dramatiq.MessageProxy) -> None:
        self._done(message, None)

    def _done(self, message: dramatiq.MessageProxy, outcome: str | None) -> None:
        with self._lock:
            started = self._started.pop(delivery(message), None)
        if started is None:  # skipped before this middleware saw it
            return
        metrics.STAGES_RUNNING.labels(message.actor_name).dec()
        if outcome is not None:
            metrics.STAGE_SECONDS.labels(message.actor_name, outcome).observe(time.perf_counter() - started)

    def _report(self, worker: dramatiq.Worker) -> None:
        while True:
            consumers = list(worker.consumers.values())
            alive = sum(1 for c in consumers if c.is_alive())
            metrics.CONSUMERS.set(alive)
            ready = bool(consumers) and alive == len(consumers) and all(w.is_alive() for w in worker.workers)
            metrics.WORKER_READY.set(1 if ready else 0)
            if self._stop.wait(self.report_s):
                return
