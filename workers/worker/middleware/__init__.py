"""Cross-cutting behaviour of a worker, one middleware per module (as dramatiq does)."""

from __future__ import annotations

from threadline.workers.worker.middleware.boot import Boot
from threadline.workers.worker.middleware.event_loop import EventLoop
from threadline.workers.worker.middleware.give_up import GiveUp
from threadline.workers.worker.middleware.liveness import Liveness
from threadline.workers.worker.middleware.log_context import LogContext
from threadline.workers.worker.middleware.metrics import Metrics
from threadline.workers.worker.middleware.tracing import Tracing

__all__ = ["Boot", "EventLoop", "GiveUp", "Liveness", "LogContext", "Metrics", "Tracing"]
