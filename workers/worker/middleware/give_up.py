"""When a message exhausts its retries (dramatiq dead-letters it), its turn still gets its one
terminal event: `failed` with `internal_error`.

dramatiq runs `after_*` hooks in reverse order of the middleware list, and `Retries` marks the
message failed in its own hook: this middleware must stand *before* `Retries` in the list, so that
it runs after it and sees `message.failed`.
"""

from __future__ import annotations

from typing import Any

import dramatiq
import structlog
from dramatiq.asyncio import get_event_loop_thread
from dramatiq.middleware import Middleware

from threadline.pipeline.contracts import extract_turn_id, valid_turn_id
from threadline.workers.storage.base import in_shard, shard_in
from threadline.workers.worker.runtime import RuntimeRef

log = structlog.get_logger(__name__)


class GiveUp(Middleware):
    def __init__(self, ref: RuntimeRef, *, admit_actor: str) -> None:
        self.ref = ref
        self.admit_actor = admit_actor

    def after_process_message(self, broker: dramatiq.Broker, message: dramatiq.MessageProxy, *,
                              result: Any = None, exception: BaseException | None = None) -> None:
        if exception is None or not message.failed:
            return
        turn_id = self.turn_id_of(message)
        loop = get_event_loop_thread()
        if turn_id is None or loop is None:
            log.error("message_gave_up", actor=message.actor_name, error=type(exception).__name__)
            return
        try:
            with in_shard(shard_in(message.options)):  # the coroutine runs in a copy of this context
                loop.run_coroutine(self.ref.get().end_turn(
                    turn_id, "failed", code="internal_error",
                    message=gave_up(message.actor_name, exception),
                ))
        except Exception:
            log.exception("give_up_failed", turn_id=turn_id)

    def turn_id_of(self, message: dramatiq.MessageProxy) -> str | None:
        return turn_id_of(message, admit_actor=self.admit_actor)


def gave_up(actor_name: str, exception: BaseException) -> str:
    """The terminal event's message of a turn whose stage message exhausted its retries."""
    return f"{actor_name} failed after retries: {type(exception).__name__}"


def turn_id_of(message: dramatiq.MessageProxy, *, admit_actor: str) -> str | None:
    """The turn a stage message is about: the request's (or the message's) id on the admit queue,
    the envelope's on the others; None for a control message or one that names no turn."""
    arg = message.args[0] if message.args else None
    if message.actor_name == admit_actor:
        return extract_turn_id(arg) or valid_turn_id(message.message_id)
    return valid_turn_id(arg.get("turn_id")) if isinstance(arg, dict) else None
