"""A span per stage message, child of its turn's span, current while the actor runs (so that
pydantic-ai's model spans and the log lines' trace ids fall inside it); a no-op while tracing is
off (`workers/telemetry/tracing.py`)."""

from __future__ import annotations

from typing import Any

import dramatiq
from dramatiq.middleware import Middleware

from threadline.pipeline.contracts import extract_turn_id, valid_turn_id
from threadline.workers.protocol.names import CANCEL_ACTOR
from threadline.workers.telemetry import tracing
from threadline.workers.worker.calls import calls_of, ends_later


class Tracing(Middleware):
    def __init__(self, *, admit_actor: str) -> None:
        self.admit_actor = admit_actor
        #: Spans open, and those current in the thread of their message's actor (a model call's
        #: span stays open after its thread moved on).
        self._spans: dict[str, tracing.StageSpan] = {}
        self._current: dict[str, tracing.StageSpan] = {}

    def after_worker_boot(self, broker: dramatiq.Broker, worker: dramatiq.Worker) -> None:
        if (calls := calls_of(broker)) is not None:  # a model call's span lasts as long as the call
            calls.on_end(lambda message, outcome: self._end(message, None, detach=False))

    def before_process_message(self, broker: dramatiq.Broker, message: dramatiq.MessageProxy) -> None:
        if not tracing.enabled():
            return
        turn_id = self.turn_id_of(message)
        if turn_id is None:  # a message naming no turn: nothing to join
            return
        arg = message.args[0] if message.args else None
        attributes: dict[str, str | int] = {"queue": message.queue_name, "message_id": message.message_id}
        if isinstance(arg, dict):
            attributes.update({name: arg[name] for name in ("attempt", "conversation_id")
                               if isinstance(arg.get(name), str | int)})
        started = tracing.start_stage(message.actor_name, turn_id, attributes)
        if started is not None:
            self._spans[message.message_id] = self._current[message.message_id] = started

    def after_process_message(self, broker: dramatiq.Broker, message: dramatiq.MessageProxy, *,
                              result: Any = None, exception: BaseException | None = None) -> None:
        current = self._current.pop(message.message_id, None)
        if exception is None and ends_later(broker, message):
            if current is not None:  # the thread moves on; the span ends with the call (`_end`)
                tracing.leave_stage(current)
            return
        self._end(message, exception, detach=current is not None)

    def _end(self, message: dramatiq.MessageProxy, exception: BaseException | None, *, detach: bool) -> None:
        started = self._spans.pop(message.message_id, None)
        if started is not None:
            tracing.end_stage(started, error=exception, detach=detach)

    def after_skip_message(self, broker: dramatiq.Broker, message: dramatiq.MessageProxy) -> None:
        self.after_process_message(broker, message)

    def turn_id_of(self, message: dramatiq.MessageProxy) -> str | None:
        arg = message.args[0] if message.args else None
        if message.actor_name == self.admit_actor:
            return extract_turn_id(arg) or valid_turn_id(message.message_id)
        if message.actor_name == CANCEL_ACTOR:
            return valid_turn_id(arg)
        return valid_turn_id(arg.get("turn_id")) if isinstance(arg, dict) else None
