"""Cross-cutting behaviour of a worker, one middleware per module (as dramatiq does)."""

from __future__ import annotations

from .boot import Boot
from .give_up import GiveUp
from .liveness import Liveness
from .log_context import LogContext
from .metrics import Metrics
from .tracing import Tracing

__all__ = ["Boot", "GiveUp", "Liveness", "LogContext", "Metrics", "Tracing"]
