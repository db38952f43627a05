"""The five stage actors and the control actor. Each is thin: begin (the store checks the turn is
still live, not cancelled and not past its deadline) → load → one pipeline function → hand over."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from functools import partial
from typing import Any

import dramatiq
import structlog
from dramatiq.middleware import CurrentMessage
from pydantic_ai import CancellationToken
from threadline.pipeline import events
from threadline.pipeline.contracts import (
    Envelope,
    Stage,
    TurnRequest,
    extract_conversation_id,
    extract_turn_id,
    parse_turn_request,
)
from threadline.pipeline.errors import ThreadlineError
from threadline.pipeline.history import assemble_history, decode_messages, encode_messages, extract_thread
from threadline.pipeline.invoke import InvokeOutcome, retry_delay_s, run_turn
from threadline.pipeline.mapping import normalise_messages
from threadline.pipeline.persist import conversation_fields, final_row, pending_row
from threadline.pipeline.records import ResolvedTurn
from threadline.pipeline.resolve import choose_config, resolve_turn

from .broker import WAKE_ID, build_message, now_ms
from .runtime import runtime
from .store import Begin, Finish, Next

log = structlog.get_logger(__name__)

MAX_RETRIES = 5


def new_conversation_id(turn_id: str) -> str:
    """Deterministic, so a redelivered first turn creates the same conversation."""
    return f"c-{turn_id}"


def _envelope(turn_id: str, stage: Stage, attempt: int = 1) -> dict[str, Any]:
    return Envelope(turn_id=turn_id, stage=stage, attempt=attempt).model_dump()


async def _not_live(begin: Begin, turn_id: str, stage: Stage) -> bool:
    """True when the stage must not run: the turn ended, the stage ran already, or it is being
    cancelled or timed out (then it ends here, before any model call)."""
    rt = runtime()
    if begin.status == "go":
        return False
    if begin.status == "cancelled":
        await rt.end_turn(turn_id, "cancelled", code="cancelled", message=f"cancelled before {stage}")
    elif begin.status == "timed_out":
        await rt.end_turn(turn_id, "timed_out", code="timed_out", message=f"deadline passed before {stage}")
    else:
        log.info("stage_skipped", reason=begin.status)
    return True


def _current_message() -> dramatiq.Message[Any]:
    message = CurrentMessage.get_current_message()
    assert message is not None, "the CurrentMessage middleware is installed"
    return message


async def resolve(request: object) -> None:
    rt = runtime()
    if (admitted := await _admit(request, _current_message())) is None:
        return
    req, cid = admitted
    t0 = time.perf_counter()
    # `accepted` is the first event of a turn; resolve's own `started` follows it.
    begin = await rt.store.begin(req.turn_id, "resolve", now=rt.now(), announce=False)
    if await _not_live(begin, req.turn_id, "resolve"):
        return
    try:
        conversation = await rt.store.load_conversation(req.conversation_id) if req.conversation_id else None
        config, ref = await rt.store.load_config(req.agent_id, choose_config(req, conversation))
        resolved, decision = resolve_turn(req, conversation=conversation, config=config, config_ref=ref,
                                          new_conversation_id=cid, now=rt.now())
    except ThreadlineError as e:
        await rt.end_turn(req.turn_id, "failed", code=e.code, message=e.message)
        return
    log.info("resolved", config_ref=decision.config_ref, new_conversation=decision.new_conversation,
             missing_variables=decision.missing_variables)
    accepted = events.accepted(req.turn_id, 1, conversation_id=cid, message_id=resolved.message_id,
                               parent_message_id=resolved.parent_message_id, config_version=ref)
    await rt.store.advance(
        req.turn_id, "resolve", next_=Next("history", _envelope(req.turn_id, "history"), rt.new_id()),
        now=rt.now(), now_ms=now_ms(), artifact=("resolved", resolved.model_dump_json()),
        events=[accepted, events.stage(req.turn_id, 1, "resolve", "started"),
                _finished(req.turn_id, begin, "resolve", t0)],
        fence=begin.fence, conversation_id=cid,
        accept=(conversation_fields(resolved), pending_row(resolved), resolved.accepted_at + resolved.deadline_s),
    )


async def _admit(request: object, message: dramatiq.Message[Any]) -> tuple[TurnRequest, str] | None:
    """Validate the request and take the turn's place in its conversation's line: the request and
    conversation id when the turn may run now; None when it ended (bad input, cancelled) or waits."""
    rt = runtime()
    turn_id = extract_turn_id(request) or message.message_id
    structlog.contextvars.bind_contextvars(turn_id=turn_id)
    try:
        req = parse_turn_request(request, fallback_turn_id=message.message_id,
                                 max_query_chars=rt.settings.max_query_chars)
    except ThreadlineError as e:
        # a producer may have put the turn in its conversation's line: take it out again
        await rt.end_turn(turn_id, "failed", code=e.code, message=e.message,
                          conversation_id=extract_conversation_id(request))
        return None
    cid = req.conversation_id or new_conversation_id(turn_id)
    structlog.contextvars.bind_contextvars(conversation_id=cid)
    _, _, wake = build_message("resolve", "resolve", (req.model_dump(mode="json", by_alias=True),),
                               message_id=WAKE_ID, now_ms=message.message_timestamp)
    admission, other = await rt.store.admit(turn_id, cid, now=rt.now(), wake=wake)
    if admission == "cancelled":
        await rt.end_turn(turn_id, "cancelled", code="cancelled", conversation_id=cid,
                          message="cancelled before resolve: the turn never started")
    if admission != "admitted":
        log.info("turn_not_admitted", admission=admission, behind=other)
        return None
    return req, cid


def _finished(turn_id: str, begin: Begin, stage: Stage, t0: float) -> events.Event:
    return events.stage(turn_id, begin.attempt, stage, "finished", (time.perf_counter() - t0) * 1000)


async def _begin_stage(env: Envelope, stage: Stage, artifact: str) -> tuple[Begin, ResolvedTurn] | None:
    """Begin a stage after resolve: its resolved turn, and the input artifact in `begin.artifacts[1]`."""
    rt = runtime()
    begin = await rt.store.begin(env.turn_id, stage, now=rt.now(), inputs=("resolved", artifact))
    if await _not_live(begin, env.turn_id, stage):
        return None
    turn = ResolvedTurn.model_validate_json(begin.artifacts[0])
    structlog.contextvars.bind_contextvars(conversation_id=turn.conversation_id, attempt=begin.attempt)
    return begin, turn


async def history(envelope: dict[str, Any]) -> None:
    rt = runtime()
    env = Envelope.model_validate(envelope)
    t0 = time.perf_counter()
    if (started := await _begin_stage(env, "history", "-")) is None:
        return
    begin, turn = started
    try:
        recent = await rt.store.load_recent_messages(turn.conversation_id, turn.config.memory.message_limit)
        thread, truncated = extract_thread(recent, turn.parent_message_id)
        stored = await rt.store.load_snapshots(turn.conversation_id, [m.id for m in thread])
        snapshots = {mid: decode_messages(data, where=f"message {mid}") for mid, data in stored.items()}
        messages, decision = assemble_history(thread, snapshots)
    except ThreadlineError as e:
        await rt.end_turn(env.turn_id, "failed", code=e.code, message=e.message, resolved=turn)
        return
    log.info("history_assembled", thread=decision.messages, truncated=truncated,
             from_snapshots=decision.from_snapshots, from_text=decision.from_text, messages=len(messages))
    await _hand_over(env, begin, "history", "map", ("history", encode_messages(messages).decode()), t0, turn)


async def map_messages(envelope: dict[str, Any]) -> None:
    rt = runtime()
    env = Envelope.model_validate(envelope)
    t0 = time.perf_counter()
    if (started := await _begin_stage(env, "map", "history")) is None:
        return
    begin, turn = started
    try:
        history = decode_messages(begin.artifacts[1], where="the assembled history")
    except ThreadlineError as e:
        await rt.end_turn(env.turn_id, "failed", code=e.code, message=e.message, resolved=turn)
        return
    # A resume answers the open calls of the paused response: leave that frontier to the run.
    mapped, decision = normalise_messages(history, repair_last_response=turn.deferred_answers is None)
    log.info("messages_mapped", **dataclasses.asdict(decision))
    await _hand_over(env, begin, "map", "invoke", ("mapped", encode_messages(mapped).decode()), t0, turn)


async def _hand_over(
    env: Envelope, begin: Begin, stage: Stage, next_stage: Stage, artifact: tuple[str, str], t0: float,
    turn: ResolvedTurn,
) -> None:
    rt = runtime()
    await rt.store.advance(
        env.turn_id, stage, next_=Next(next_stage, _envelope(env.turn_id, next_stage, begin.attempt), rt.new_id()),
        now=rt.now(), now_ms=now_ms(), artifact=artifact, events=[_finished(env.turn_id, begin, stage, t0)],
        fence=begin.fence, conversation_id=turn.conversation_id,
    )


@contextlib.asynccontextmanager
async def _claim_heartbeat(turn_id: str) -> AsyncIterator[None]:
    """Keep the invoke claim alive while the run lasts, so a duplicate delivery stays out."""
    rt = runtime()

    async def beat() -> None:
        while True:
            await asyncio.sleep(rt.settings.invoke_lease_s / 3)
            await rt.store.refresh_claim(turn_id)

    task = asyncio.create_task(beat())
    try:
        yield
    finally:
        task.cancel()


async def invoke(envelope: dict[str, Any]) -> None:
    rt = runtime()
    env = Envelope.model_validate(envelope)
    token = rt.registry.register(env.turn_id)  # before begin: a cancel from now on reaches the run
    try:
        t0 = time.perf_counter()
        begin = await rt.store.begin(env.turn_id, "invoke", now=rt.now(), inputs=("resolved", "mapped"),
                                     claim=rt.worker_id)
        if await _not_live(begin, env.turn_id, "invoke"):
            return
        try:
            await _run_claimed(env, begin, token, t0)
        except Exception:
            # dramatiq retries this message: its next delivery must not find our claim and stand down
            await rt.store.release_claim(env.turn_id)
            raise
    finally:
        rt.registry.unregister(env.turn_id, token)


async def _run_claimed(env: Envelope, begin: Begin, token: CancellationToken, t0: float) -> None:
    rt = runtime()
    turn = ResolvedTurn.model_validate_json(begin.artifacts[0])
    structlog.contextvars.bind_contextvars(conversation_id=turn.conversation_id, attempt=begin.attempt)
    try:
        agent = rt.agent(turn.config.model, turn.config.tools)
        history = decode_messages(begin.artifacts[1], where="the mapped history")
    except ThreadlineError as e:
        await rt.end_turn(env.turn_id, "failed", code=e.code, message=e.message, resolved=turn)
        return
    deadline_at = begin.deadline_at or rt.now() + turn.deadline_s
    async with _claim_heartbeat(env.turn_id):
        outcome = await run_turn(
            turn, history, agent=agent, attempt=begin.attempt, sink=partial(rt.store.emit, env.turn_id),
            token=token, clock=rt.now, timeout_s=deadline_at - rt.now(), debounce_s=rt.settings.debounce_ms / 1000,
        )
    log.info("invoked", status=outcome.status, code=outcome.code, usage=outcome.usage.model_dump())
    delay_s = retry_delay_s(outcome, attempt=begin.attempt, max_attempts=rt.settings.max_invoke_attempts)
    if delay_s is None:
        await _hand_over(env, begin, "invoke", "persist", ("outcome", outcome.model_dump_json()), t0, turn)
        return
    reason = f"{outcome.code}: {outcome.message}"
    await rt.store.retry_invoke(
        env.turn_id,
        next_=Next("invoke", _envelope(env.turn_id, "invoke", begin.attempt + 1), rt.new_id(),
                   delay_ms=int(delay_s * 1000)),
        now_ms=now_ms(),
        event=events.retrying(env.turn_id, begin.attempt + 1, reason),
    )
    log.info("invoke_retry_scheduled", delay_s=delay_s, reason=reason)


async def persist(envelope: dict[str, Any]) -> None:
    rt = runtime()
    env = Envelope.model_validate(envelope)
    t0 = time.perf_counter()
    begin = await rt.store.begin(env.turn_id, "persist", now=rt.now(), inputs=("resolved", "outcome"),
                                 check_interrupts=False)
    if begin.status != "go":
        log.info("stage_skipped", reason=begin.status)
        return
    turn = ResolvedTurn.model_validate_json(begin.artifacts[0])
    outcome = InvokeOutcome.model_validate_json(begin.artifacts[1])
    structlog.contextvars.bind_contextvars(conversation_id=turn.conversation_id)
    row = final_row(turn, status=outcome.status, now=rt.now(), answer=outcome.answer, usage=outcome.usage,
                    code=outcome.code, tools=outcome.tools)
    terminal = events.terminal(
        env.turn_id, begin.attempt, outcome.status, answer=outcome.answer, usage=outcome.usage,
        code=outcome.code, message=outcome.message, pending_tool_calls=outcome.pending_tool_calls,
        conversation_id=turn.conversation_id, message_id=turn.message_id,
    )
    result = await rt.store.finish(
        Finish(turn_id=env.turn_id, status=outcome.status, event=terminal, conversation_id=turn.conversation_id,
               message=row, snapshot=outcome.snapshot, pending_tool_calls=outcome.pending_tool_calls,
               fence=begin.fence, tenant_id=turn.tenant_id, before=[_finished(env.turn_id, begin, "persist", t0)]),
        now=rt.now(),
    )
    log.info("persisted", status=outcome.status, write=result, snapshot=outcome.snapshot is not None)


async def cancel(turn_id: str, reason: str = "") -> None:
    """The control actor: a durable flag, a broadcast to every process, and a waiting turn ended."""
    rt = runtime()
    structlog.contextvars.bind_contextvars(turn_id=turn_id)
    outcome, status = await rt.store.cancel(turn_id, reason, now=rt.now())
    rt.registry.cancel(turn_id)
    if outcome == "noop":
        log.info("cancel_noop", reason="the turn has already finished", status=status)
    elif status == "waiting":
        await rt.end_turn(turn_id, "cancelled", code="cancelled", message=reason or "cancelled while waiting")
    else:
        log.info("cancel_signalled", status=status)


ACTORS: dict[str, tuple[Callable[..., Coroutine[Any, Any, None]], str]] = {
    "resolve": (resolve, "resolve"),
    "history": (history, "history"),
    "map": (map_messages, "map"),
    "invoke": (invoke, "invoke"),
    "persist": (persist, "persist"),
    "cancel": (cancel, "control"),
}


def declare_actors(broker: dramatiq.Broker) -> dict[str, dramatiq.Actor[Any, Any]]:
    """Register the actors on `broker`; their names are the public queue contract."""
    return {
        name: dramatiq.actor(actor_name=name, queue_name=queue, broker=broker, max_retries=MAX_RETRIES,
                             priority=0 if name == "cancel" else 10)(fn)
        for name, (fn, queue) in ACTORS.items()
    }
