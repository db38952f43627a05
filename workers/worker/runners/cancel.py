"""The control actor's runner: `cancel(turn_id, reason)`."""

from __future__ import annotations

from typing import Any

import dramatiq
import structlog
from dramatiq.middleware import CurrentMessage

from threadline.pipeline.contracts import (
    valid_turn_id,
)
from threadline.pipeline.stages import StageGraph
from threadline.workers.protocol.names import CANCEL_ACTOR, CONTROL_QUEUE
from threadline.workers.protocol.schema import TurnState
from threadline.workers.worker.runtime import Runtime

log = structlog.get_logger(__name__)


async def run_cancel(rt: Runtime, turn_id: object, reason: object = "") -> None:
    """The control actor: a durable flag, a broadcast to every process, and a waiting turn ended."""
    tid = valid_turn_id(turn_id)
    if tid is None or not isinstance(reason, str):  # a `Malformed` message too
        message: dramatiq.Message[Any] | None = CurrentMessage.get_current_message()
        mid = message.message_id if message is not None else ""
        await rt.store.dead_letter(CONTROL_QUEUE, mid, CANCEL_ACTOR, "invalid_cancel_arguments")
        log.warning("cancel_refused", reason="invalid_cancel_arguments")
        return
    structlog.contextvars.bind_contextvars(turn_id=tid)
    outcome, status = await rt.store.cancel(tid, reason[:1000], now=rt.now())
    rt.registry.cancel(tid)
    if outcome == "noop":
        log.info("cancel_noop", reason="the turn has already finished", status=status)
    elif status == "waiting":
        url, tenant = await _waiting_webhook(rt, tid)
        await rt.end_turn(tid, "cancelled", code="cancelled", message=reason[:1000] or "cancelled while waiting",
                          webhook_url=url, tenant_id=tenant)
    elif status == "running" and queued_before_its_model(rt.graph, await rt.store.turn_state(tid)):
        # its next stage would refuse it anyway (the flag is up), but only once a worker reaches its
        # message, seconds away behind a backlog: end it now; that message is then dropped as a no-op
        await rt.end_turn(tid, "cancelled", code="cancelled", message=reason[:1000] or "cancelled while queued")
    else:
        log.info("cancel_signalled", status=status)


async def _waiting_webhook(rt: Runtime, turn_id: str) -> tuple[str | None, str]:
    """The webhook a waiting turn's request names (checked when it was admitted), with its tenant;
    none when it names none (an agent's webhook is applied only to turns accepted)."""
    state = await rt.store.turn_state(turn_id)
    request = await rt.store.waiting_request(state.conversation_id, turn_id) if state.conversation_id else None
    if not isinstance(request, dict) or not isinstance(request.get("webhook_url"), str):
        return None, ""
    return request["webhook_url"], str(request.get("tenant_id", ""))


def queued_before_its_model(graph: StageGraph, state: TurnState) -> bool:
    """An admitted turn that no worker runs a stage of now (between stages, or waiting to retry its
    model call) and whose model has not answered: a cancel ends it at once. One whose model answered
    is left to its finish stage, which a cancel does not stop (the answer is kept)."""
    models = {stage.name for stage in graph if stage.kind == "model"}
    return state.status == "running" and not state.holder and not state.done & models
