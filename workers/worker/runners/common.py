"""What every runner shares: the refusal of a malformed message, the start of a stage (begin in the store,
the log context) and the hand-over to the next stage in one atomic step."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import dramatiq
import structlog
from dramatiq.middleware import CurrentMessage
from pydantic import ValidationError

from threadline.pipeline import events
from threadline.pipeline.contracts import (
    Envelope,
)
from threadline.pipeline.records import ResolvedTurn
from threadline.pipeline.stages import Stage
from threadline.workers.storage.turns import Begin, Next, Settle
from threadline.workers.telemetry import tracing
from threadline.workers.worker.broker import DoorbellBroker
from threadline.workers.worker.runtime import Runtime, admitted_turn

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class Malformed:
    """What a runner gets instead of a message's argument when the message carried none or
    several; `first` is its first argument, which may still name the turn."""

    first: object = None


@dataclass(frozen=True, slots=True)
class Started:
    """A stage that may run: its envelope, what the store began, the resolved turn, its start time."""

    env: Envelope
    begin: Begin
    turn: ResolvedTurn
    t0: float
    #: The stage's own message, acked by its hand-over (`hand_over`); None outside a worker.
    message: dramatiq.Message[Any] | dramatiq.MessageProxy | None = None


def finished_event(s: Started, stage: Stage, decision: Mapping[str, Any] | None = None) -> events.StageEvent:
    return events.StageEvent(turn_id=s.env.turn_id, attempt=s.begin.attempt, stage=stage.name, status="finished",
                             ms=round((time.perf_counter() - s.t0) * 1000, 2),
                             decision=dict(decision) if decision else None)


async def stopped(rt: Runtime, begin: Begin, turn_id: str, stage: Stage) -> bool:
    """True when the stage must not run: the turn ended, the stage ran already, or the turn is being
    cancelled or is past its deadline (it ends here, before any model call)."""
    if begin.status == "go":
        return False
    if begin.status == "cancelled":
        await rt.end_turn(turn_id, "cancelled", code="cancelled",
                          message=await rt.store.cancel_reason(turn_id) or f"cancelled before {stage.name}")
    elif begin.status == "timed_out":
        await rt.end_turn(turn_id, "timed_out", code="timed_out", message=f"deadline passed before {stage.name}")
    else:
        log.info("stage_skipped", reason=begin.status)
    return True


async def envelope_of(rt: Runtime, stage: Stage, raw: object) -> Envelope | None:
    """The stage message's envelope; a malformed one is dead-lettered at once, not retried."""
    try:
        return Envelope.model_validate(raw)
    except ValidationError:
        message = CurrentMessage.get_current_message()
        await rt.store.dead_letter(stage.queue, message.message_id if message else "", stage.name, "invalid_envelope")
        log.warning("message_refused", reason="invalid_envelope")
        return None


async def start_stage(rt: Runtime, stage: Stage, env: Envelope, *, claim: str = "") -> Started | None:
    t0 = time.perf_counter()
    started = events.StageEvent(turn_id=env.turn_id, stage=stage.name, status="started")
    begin = await rt.store.begin(env.turn_id, stage.name, now=rt.now(), interrupts=stage.kind != "finish",
                                 claim=claim, started=started, attempt_hint=env.attempt, holder=rt.worker_id)
    if await stopped(rt, begin, env.turn_id, stage):
        return None
    turn = admitted_turn(begin.admitted)
    structlog.contextvars.bind_contextvars(conversation_id=turn.conversation_id, attempt=begin.attempt)
    tracing.annotate(conversation_id=turn.conversation_id, attempt=begin.attempt)
    return Started(env, begin, turn, t0, CurrentMessage.get_current_message())


def settlement(rt: Runtime, message: dramatiq.Message[Any] | dramatiq.MessageProxy | None) -> Settle | None:
    """How the hand-over script acks `message` (`DoorbellBroker.settlement`); None outside a worker."""
    broker = rt.calls.broker
    return broker.settlement(message) if message is not None and isinstance(broker, DoorbellBroker) else None


def settled(rt: Runtime, message: dramatiq.Message[Any] | dramatiq.MessageProxy | None, result: str) -> None:
    """Tell the broker that the hand-over answering `result` acked `message` ("ok" only)."""
    broker = rt.calls.broker
    if result == "ok" and message is not None and isinstance(broker, DoorbellBroker):
        broker.settled_by_script(message)


async def hand_over(rt: Runtime, stage: Stage, s: Started, artifact: str,
                     decision: Mapping[str, Any] | None = None, *, before: Sequence[events.Event] = ()) -> None:
    following = rt.graph.next(stage.name)
    assert following is not None, "the finish stage hands over to no one"
    arg = Envelope(turn_id=s.env.turn_id, stage=following.name, attempt=s.begin.attempt).model_dump()
    result = await rt.store.advance(
        s.env.turn_id, stage.name, next_=Next(following.name, arg, rt.new_id()), now=rt.now(), now_ms=rt.now_ms(),
        artifact=artifact, events_=[*before, finished_event(s, stage, decision)], fence=s.begin.fence,
        conversation_id=s.turn.conversation_id, decision=decision, settle=settlement(rt, s.message),
    )
    settled(rt, s.message, result)
