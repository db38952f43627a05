"""Binds turn_id, stage and attempt to every log line of a message (structlog contextvars
propagate into the actor's task on the event loop)."""

from __future__ import annotations

from typing import Any

import dramatiq
import structlog
from dramatiq.middleware import Middleware


class LogContext(Middleware):
    def before_process_message(self, broker: dramatiq.Broker, message: dramatiq.MessageProxy) -> None:
        structlog.contextvars.clear_contextvars()
        fields: dict[str, Any] = {"stage": message.actor_name, "message_id": message.message_id}
        arg = message.args[0] if message.args else None
        if isinstance(arg, dict):
            for name in ("turn_id", "attempt", "conversation_id"):
                if isinstance(arg.get(name), str | int):
                    fields[name] = arg[name]
        structlog.contextvars.bind_contextvars(**fields)

    def after_process_message(self, broker: dramatiq.Broker, message: dramatiq.MessageProxy, *,
                              result: Any = None, exception: BaseException | None = None) -> None:
        structlog.contextvars.clear_contextvars()

    def after_skip_message(self, broker: dramatiq.Broker, message: dramatiq.MessageProxy) -> None:
        structlog.contextvars.clear_contextvars()
