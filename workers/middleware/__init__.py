"""Cross-cutting behaviour of a worker, one middleware per module (as dramatiq does)."""

from __future__ import annotations

from .boot import Boot
from .give_up import GiveUp
from .log_context import LogContext

__all__ = ["Boot", "GiveUp", "LogContext"]
