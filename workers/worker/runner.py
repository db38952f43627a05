"""One runner per kind of stage (`pipeline.stages.StageKind`), none of which names a stage.

Every runner is the same shape: begin (the store checks that the turn is live, not cancelled, not
past its deadline, and that this stage has not run) → log context → the stage's pure function →
hand over to the next stage in one atomic step. Every early ending goes through
`Runtime.end_turn`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import dramatiq
import structlog
from dramatiq.middleware import CurrentMessage
from pydantic import ValidationError
from pydantic_ai import CancellationToken

from threadline.pipeline import events
from threadline.pipeline.compaction import (
    SUMMARISE_PROMPT,
    clear_snapshots,
    clearing_due,
    summariser_history,
    summary_record,
    turns_to_clear,
    window_start,
)
from threadline.pipeline.config import TRUSTED, AgentConfig, CompactionSpec
from threadline.pipeline.contracts import (
    Envelope,
    TurnRequest,
    extract_conversation_id,
    extract_turn_id,
    new_conversation_id,
    parse_turn_request,
    valid_turn_id,
)
from threadline.pipeline.errors import InvalidRequest, ThreadlineError
from threadline.pipeline.guards import stream_guard
from threadline.pipeline.history import decode_messages, encode_messages, turn_messages
from threadline.pipeline.invoke import (
    InvokeOutcome,
    TurnDeps,
    answer_without_model,
    invoke_decision,
    retry_delay_s,
    run_turn,
)
from threadline.pipeline.persist import final_row, new_conversation, pending_row
from threadline.pipeline.records import ConversationRecord, MessageRecord, ResolvedTurn
from threadline.pipeline.resolve import ConfigRef, choose_config, resolve_turn
from threadline.pipeline.stages import Stage, StageInput
from threadline.pipeline.streaming import RunEvents, TextDebouncer
from threadline.workers.protocol.wire import build_message
from threadline.workers.storage.store import WAKE_ID, Accept, Begin, Finish, Next
from threadline.workers.telemetry import metrics, tracing
from threadline.workers.worker.cancellation import CANCEL_ACTOR, CONTROL_QUEUE
from threadline.workers.worker.limiter import limited_model, turn_limiter
from threadline.workers.worker.loaders import LOADERS
from threadline.workers.worker.runtime import Runtime
from threadline.workers.worker.stream import TurnStream
from threadline.workers.worker.token_counting import CountUnavailable

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


def _finished(s: Started, stage: Stage, decision: Mapping[str, Any] | None = None) -> events.StageEvent:
    return events.StageEvent(turn_id=s.env.turn_id, attempt=s.begin.attempt, stage=stage.name, status="finished",
                             ms=round((time.perf_counter() - s.t0) * 1000, 2),
                             decision=dict(decision) if decision else None)


async def _stopped(rt: Runtime, begin: Begin, turn_id: str, stage: Stage) -> bool:
    """True when the stage must not run: the turn ended, the stage ran already, or the turn is being
    cancelled or is past its deadline (it ends here, before any model call)."""
    if begin.status == "go":
        return False
    if begin.status == "cancelled":
        await rt.end_turn(turn_id, "cancelled", code="cancelled", message=f"cancelled before {stage.name}")
    elif begin.status == "timed_out":
        await rt.end_turn(turn_id, "timed_out", code="timed_out", message=f"deadline passed before {stage.name}")
    else:
        log.info("stage_skipped", reason=begin.status)
    return True


async def _envelope(rt: Runtime, stage: Stage, raw: object) -> Envelope | None:
    """The stage message's envelope; a malformed one is dead-lettered at once, not retried."""
    try:
        return Envelope.model_validate(raw)
    except ValidationError:
        message = CurrentMessage.get_current_message()
        await rt.store.dead_letter(stage.queue, message.message_id if message else "", stage.name, "invalid_envelope")
        log.warning("message_refused", reason="invalid_envelope")
        return None


async def _start(rt: Runtime, stage: Stage, env: Envelope, *, claim: str = "") -> Started | None:
    t0 = time.perf_counter()
    started = events.StageEvent(turn_id=env.turn_id, stage=stage.name, status="started")
    begin = await rt.store.begin(env.turn_id, stage.name, now=rt.now(), interrupts=stage.kind != "finish",
                                 claim=claim, started=started, attempt_hint=env.attempt, holder=rt.worker_id)
    if await _stopped(rt, begin, env.turn_id, stage):
        return None
    turn = ResolvedTurn.model_validate_json(begin.admitted, context=TRUSTED)
    structlog.contextvars.bind_contextvars(conversation_id=turn.conversation_id, attempt=begin.attempt)
    tracing.annotate(conversation_id=turn.conversation_id, attempt=begin.attempt)
    return Started(env, begin, turn, t0)


async def _hand_over(rt: Runtime, stage: Stage, s: Started, artifact: str,
                     decision: Mapping[str, Any] | None = None, *, before: Sequence[events.Event] = ()) -> None:
    following = rt.graph.next(stage.name)
    assert following is not None, "the finish stage hands over to no one"
    arg = Envelope(turn_id=s.env.turn_id, stage=following.name, attempt=s.begin.attempt).model_dump()
    await rt.store.advance(
        s.env.turn_id, stage.name, next_=Next(following.name, arg, rt.new_id()), now=rt.now(), now_ms=rt.now_ms(),
        artifact=artifact, events_=[*before, _finished(s, stage, decision)], fence=s.begin.fence,
        conversation_id=s.turn.conversation_id, decision=decision,
    )


# --- transform ------------------------------------------------------------------------------------


async def run_transform(rt: Runtime, stage: Stage, envelope: object) -> None:
    if (env := await _envelope(rt, stage, envelope)) is None or (s := await _start(rt, stage, env)) is None:
        return
    assert stage.run is not None
    try:
        loaded = {need: await LOADERS[need](rt, s.turn, stage.name) for need in stage.needs}
        out = stage.run(StageInput(s.turn, s.begin.previous, loaded))
    except ThreadlineError as e:
        await rt.end_turn(env.turn_id, "failed", code=e.code, message=e.message, resolved=s.turn)
        return
    log.info("stage_decided", **out.decision)
    await _hand_over(rt, stage, s, out.artifact, out.decision)


# --- model ----------------------------------------------------------------------------------------


async def run_model(rt: Runtime, stage: Stage, envelope: object) -> None:
    if (env := await _envelope(rt, stage, envelope)) is None:
        return
    token = rt.registry.register(env.turn_id)  # before begin: a cancel from now on reaches the run
    try:
        if (s := await _start(rt, stage, env, claim=rt.worker_id)) is None:
            return
        try:
            if s.turn.guard is not None:
                await _answer_without_model(rt, stage, s)
            else:
                await _call_model(rt, stage, s, token)
                await _cancel_observed(rt, env.turn_id, token)
        except Exception:
            # dramatiq retries this message: its next delivery must not find our claim and stand down
            await rt.store.release_claim(env.turn_id, rt.worker_id)
            raise
    finally:
        rt.registry.unregister(env.turn_id, token)


@contextlib.asynccontextmanager
async def _claim_heartbeat(rt: Runtime, turn_id: str) -> AsyncIterator[None]:
    """Keep the model claim alive while the run lasts, so a duplicate delivery stays out."""

    async def beat() -> None:
        while True:
            await asyncio.sleep(rt.settings.invoke_lease_s / 3)
            await rt.store.refresh_claim(turn_id)

    task = asyncio.create_task(beat())
    try:
        yield
    finally:
        task.cancel()


async def _cancel_observed(rt: Runtime, turn_id: str, token: CancellationToken) -> None:
    """The cancel latency metric: from the cancel request to here, where the cancelled run has ended."""
    if token.cancelled:
        now = rt.now()
        metrics.cancel_closed((await rt.store.turn_state(turn_id)).cancel_requested_at, now=now)


def _warn_if_timed_out(guard: Mapping[str, object] | None) -> None:
    """A guard pattern that ran out of its time budget refused a text without knowing: the operator
    should fix the pattern (it backtracks catastrophically on some texts)."""
    if guard and guard.get("timed_out"):
        log.warning("guard_pattern_timed_out", rule=guard.get("rule"),
                    hint="the text was refused unread: rewrite this pattern so that it cannot backtrack")


async def _answer_without_model(rt: Runtime, stage: Stage, s: Started) -> None:
    """A turn the input guards answered: no model is built or called; the reply goes out as one text
    delta, with the stage's end, and the turn ends like any other."""
    outcome = answer_without_model(s.turn)
    log.info("invoked", status=outcome.status, guard=outcome.guard)
    delta = events.TextDelta(turn_id=s.env.turn_id, attempt=s.begin.attempt, text=outcome.answer)
    await _hand_over(rt, stage, s, outcome.model_dump_json(), before=[delta])


async def _call_model(rt: Runtime, stage: Stage, s: Started, token: CancellationToken) -> None:
    turn, turn_id, attempt = s.turn, s.env.turn_id, s.begin.attempt
    try:
        agent = rt.agent(turn.config.model, turn.config.tools)
        history = decode_messages(s.begin.previous, where="the mapped history")
    except ThreadlineError as e:
        await rt.end_turn(turn_id, "failed", code=e.code, message=e.message, resolved=turn)
        return
    deadline_at = s.begin.deadline_at or rt.now() + turn.deadline_s
    translator = RunEvents(turn_id, attempt, TextDebouncer(window_s=rt.settings.debounce_ms / 1000),
                           tool_payload_chars=rt.settings.max_text_chars,
                           guard=stream_guard(turn.config.guards, time.monotonic))
    spec = turn.config.model
    async with (_claim_heartbeat(rt, turn_id),
                turn_limiter(rt.store, turn.config.id, limit=spec.max_concurrency, turn_id=turn_id) as limiter,
                TurnStream(translator, partial(rt.store.emit, turn_id), rt.now) as stream):
        outcome = await run_turn(turn, history, agent=agent, attempt=attempt, stream=stream, token=token,
                                 clock=rt.now, timeout_s=deadline_at - rt.now(), max_chars=rt.settings.max_text_chars,
                                 secrets=rt.secrets(spec),
                                 model=limited_model(agent, limiter))
    log.info("invoked", status=outcome.status, code=outcome.code, usage=outcome.usage.model_dump(),
             truncated_parts=outcome.truncated_parts, model=outcome.model, fallback_from=outcome.fallback_from)
    if outcome.status == "cancelled" and rt.handing_over(turn_id):
        await _hand_back(rt, stage, s)
        return
    # attempts a stopping worker handed over are not failed ones
    delay_s = retry_delay_s(outcome, attempt=attempt - s.begin.handovers, max_attempts=rt.settings.max_invoke_attempts)
    if delay_s is None:
        decision = invoke_decision(outcome, limit_wait_s=limiter.waited_s if limiter else None)
        await _hand_over(rt, stage, s, outcome.model_dump_json(), decision)
        return
    reason = f"{outcome.code}: {outcome.message}"
    arg = Envelope(turn_id=turn_id, stage=stage.name, attempt=attempt + 1).model_dump()
    await rt.store.retry(turn_id, next_=Next(stage.name, arg, rt.new_id(), delay_ms=int(delay_s * 1000)),
                         now=rt.now(), now_ms=rt.now_ms(),
                         event=events.Retrying(turn_id=turn_id, attempt=attempt + 1, reason=reason),
                         claim=rt.worker_id)
    log.info("model_retry_scheduled", delay_s=delay_s, reason=reason)


async def _hand_back(rt: Runtime, stage: Stage, s: Started) -> None:
    """This worker is shutting down and cancelled the run: the same stage goes back on its queue at
    once, as the next attempt (not a failed one), for another worker to run from the start."""
    turn_id, attempt = s.env.turn_id, s.begin.attempt
    arg = Envelope(turn_id=turn_id, stage=stage.name, attempt=attempt + 1).model_dump()
    reason = "handover: the worker running it is shutting down"
    write = await rt.store.retry(turn_id, next_=Next(stage.name, arg, rt.new_id()), now=rt.now(), now_ms=rt.now_ms(),
                                 event=events.Retrying(turn_id=turn_id, attempt=attempt + 1, reason=reason),
                                 claim=rt.worker_id, handover=True)
    log.warning("turn_handed_over", attempt=attempt, write=write)


# --- finish ---------------------------------------------------------------------------------------


async def run_finish(rt: Runtime, stage: Stage, envelope: object) -> None:
    if (env := await _envelope(rt, stage, envelope)) is None or (s := await _start(rt, stage, env)) is None:
        return
    turn = s.turn
    outcome = InvokeOutcome.model_validate_json(s.begin.previous)
    row = final_row(turn, status=outcome.status, now=rt.now(), answer=outcome.answer, usage=outcome.usage,
                    code=outcome.code, tools=outcome.tools)
    if outcome.guard:
        row = row.model_copy(update={"guard": outcome.guard})
        _warn_if_timed_out(outcome.guard)
    terminal = events.terminal(
        env.turn_id, s.begin.attempt, outcome.status, answer=outcome.answer, usage=outcome.usage,
        code=outcome.code, message=outcome.message, pending_tool_calls=outcome.pending_tool_calls,
        conversation_id=turn.conversation_id, message_id=turn.message_id, model=outcome.model,
    )
    result = await rt.store.finish(
        Finish(turn_id=env.turn_id, event=terminal, conversation_id=turn.conversation_id, message=row,
               snapshot=outcome.snapshot, pending_tool_calls=outcome.pending_tool_calls, fence=s.begin.fence,
               tenant_id=turn.tenant_id, before=[_finished(s, stage)]),
        now=rt.now(),
    )
    log.info("persisted", status=outcome.status, write=result, snapshot=outcome.snapshot is not None)
    metrics.turn_ended(terminal, write=result, turn=turn)
    tracing.turn_ended(terminal, write=result, turn=turn, now=rt.now())
    if turn.config.memory.compaction is not None:
        # after the turn, off its critical path: the turns its window dropped get summarised
        for after in rt.graph.of_kind("compaction"):
            arg = Envelope(turn_id=env.turn_id, stage=after.name, conversation_id=turn.conversation_id).model_dump()
            await rt.store.enqueue_stage(after.name, arg, message_id=rt.new_id(), now_ms=rt.now_ms())


# --- compaction -----------------------------------------------------------------------------------


async def run_compaction(rt: Runtime, stage: Stage, envelope: object) -> None:
    """After a turn ended: clear old tool results when its window was cut, then summarise the turns
    that fell out of its window into the running summary of its thread (best effort: a failure is
    logged, and a later turn's compaction covers the same turns); its decision record says what it did."""
    if (env := await _envelope(rt, stage, envelope)) is None or env.conversation_id is None:
        return
    store, cid = rt.store, env.conversation_id
    conversation = await store.find_conversation(cid)
    if conversation is None:
        return
    config, _ = await store.load_config(conversation.agent_id, ConfigRef.parse(conversation.config_ref))
    if config.memory.compaction is None:
        return
    decisions = [await store.decision(cid, env.turn_id, t.name) for t in rt.graph.of_kind("transform")]
    record: dict[str, Any] = {"tool_results": None}
    if any(clearing_due(d) for d in decisions) or await _clearing_owed(rt, cid, env.turn_id, stage.name):
        record["tool_results"] = await _clear_old_tool_results(rt, cid, env.turn_id, config)
    start = next((found for d in decisions if (found := window_start(d))), None)
    record["summary"] = await _summarise(rt, cid, start, config.memory.compaction)
    await store.save_decision(cid, env.turn_id, stage.name, record)


async def _summarise(rt: Runtime, cid: str, start: str | None, spec: CompactionSpec) -> dict[str, Any] | None:
    """The new running summary for the turns before the window `start`, if there is something new."""
    first_kept = await rt.store.message(cid, start) if start else None
    watermark = first_kept.parent_id if first_kept else None  # the newest turn the window dropped
    if watermark is None or await rt.store.summaries(cid, [watermark]):
        return None
    turns, previous, since = await _unsummarised(rt, cid, watermark)
    try:
        agent = rt.agent(spec.summariser, [])
        result = await agent.run(SUMMARISE_PROMPT, message_history=summariser_history(previous, turns) or None,
                                 deps=TurnDeps(now=rt.now))
    except Exception as e:
        log.warning("compaction_failed", error=type(e).__name__)
        return {"watermark": watermark, "error": type(e).__name__}
    text = result.output if isinstance(result.output, str) else ""
    await rt.store.save_summary(cid, watermark, summary_record(
        text, watermark=watermark, turns=len(turns), summariser=f"{spec.summariser.provider}:{spec.summariser.name}",
        since=since))
    log.info("compacted", watermark=watermark, turns=len(turns), since=since)
    return {"watermark": watermark, "turns": len(turns), "since": since}


async def _clear_old_tool_results(rt: Runtime, cid: str, turn_id: str, config: AgentConfig) -> dict[str, Any]:
    """Clear the tool results of the thread's turns older than the newest few, back to its newest
    summary (older turns were cleared before they were summarised), and count those turns again."""
    thread = await _thread_to_summary(rt, cid, turn_id, limit=config.memory.message_limit)
    stored = await rt.store.load_snapshots(cid, turns_to_clear(thread))
    try:
        counter = rt.counter(config.model)
        # decoding and clearing are CPU work: off the event loop
        cleared = await asyncio.to_thread(clear_snapshots, stored)
    except ThreadlineError as e:
        return {"error": e.code}
    turns = {mid: c.messages for mid, c in cleared.items()}
    try:
        counts = await counter.turns(turns)
    except CountUnavailable as e:  # counted with the fallback, and cached under its name
        counter = e.fallback
        counts = await counter.turns(turns)
    write = await rt.store.clear_tool_results(
        cid, {mid: (stored[mid], encode_messages(c.messages)) for mid, c in cleared.items()},
        counts=counts, tokenizer=counter.name) if cleared else "cleared"
    record = {"results": sum(c.results for c in cleared.values()), "chars": sum(c.chars for c in cleared.values()),
              "turns": len(cleared), "examined": len(stored), "write": write}
    log.info("tool_results_cleared", **record)
    return record


async def _clearing_owed(rt: Runtime, cid: str, turn_id: str, stage: str) -> bool:
    """Whether the parent turn's compaction had to leave its clearing undone (a turn was running):
    then this one clears, though its own window was not cut."""
    row = await rt.store.message(cid, turn_id)
    parent = await rt.store.decision(cid, row.parent_id, stage) if row and row.parent_id else None
    return ((parent or {}).get("tool_results") or {}).get("write") in ("busy", "changed")


async def _thread_to_summary(rt: Runtime, cid: str, from_id: str, *, limit: int) -> list[str]:
    """The thread's turns from `from_id` back to its newest summary's watermark (exclusive), oldest first."""
    ids: list[str] = []
    current: str | None = from_id
    async for batch in rt.store.walk_back(cid, from_id, batch=32):
        by_id = {r.id: r for r in batch}
        summarised = await rt.store.summaries(cid, list(by_id))
        while current is not None and current in by_id and current not in summarised and len(ids) < limit:
            ids.append(current)
            current = by_id[current].parent_id
        if current is None or current in summarised or len(ids) >= limit:
            break
    return ids[::-1]


async def _unsummarised(rt: Runtime, cid: str, watermark: str) -> tuple[list[list[Any]], str | None, str | None]:
    """The turns from the newest earlier summary (exclusive) to `watermark`, oldest first, with that
    summary's text and watermark."""
    rows: list[MessageRecord] = []
    previous = since = None
    current: str | None = watermark
    async for batch in rt.store.walk_back(cid, watermark, batch=32):
        by_id = {r.id: r for r in batch}
        found = await rt.store.summaries(cid, [mid for mid in by_id if mid != watermark])
        while current is not None and current in by_id:
            if current in found:
                previous, since, current = found[current], current, None
                break
            rows.append(by_id[current])
            current = by_id[current].parent_id
        if current is None:
            break
    rows.reverse()
    snapshots = await rt.store.load_snapshots(cid, [r.id for r in rows])
    return [turn_messages(r, snapshots.get(r.id)) for r in rows], previous, since


# --- admit ----------------------------------------------------------------------------------------


async def run_admit(rt: Runtime, stage: Stage, request: object) -> None:
    """Validate the producer's request, refuse it before anything of its conversation is touched,
    take its place in the conversation's line, pin what it runs with, and accept it."""
    message = CurrentMessage.get_current_message()
    assert message is not None, "the CurrentMessage middleware is installed"
    turn_id = extract_turn_id(request.first if isinstance(request, Malformed) else request) or valid_turn_id(
        message.message_id)
    if turn_id is None:
        # no id that names a turn of its own: there is no stream to report on
        await rt.store.dead_letter(stage.queue, message.message_id, stage.name, "invalid_turn_id")
        log.warning("turn_refused", reason="invalid_turn_id")
        return
    structlog.contextvars.bind_contextvars(turn_id=turn_id)
    try:
        if isinstance(request, Malformed):
            raise InvalidRequest("a turn message carries exactly one argument: the turn request")
        req = parse_turn_request(request, fallback_turn_id=turn_id, max_query_chars=rt.settings.max_query_chars,
                                 max_context_chars=rt.settings.max_context_chars)
    except ThreadlineError as e:
        # a producer may have put the turn in its conversation's line: take it out again
        cid = extract_conversation_id(request) or new_conversation_id(turn_id)
        await _refuse(rt, stage, turn_id, request, e, conversation_id=cid)
        return
    cid = req.conversation_id or new_conversation_id(turn_id)
    structlog.contextvars.bind_contextvars(conversation_id=cid)
    t0 = time.perf_counter()
    try:
        # validate before anything of the conversation is written: a refusal leaves it as it was
        resolved = await _resolve(rt, req, cid, must_exist=False)
    except ThreadlineError as e:
        await _refuse(rt, stage, turn_id, request, e, conversation_id=cid)
        return
    _, _, wake = build_message(stage.queue, stage.name, (req.model_dump(mode="json", by_alias=True),),
                               message_id=WAKE_ID, now_ms=message.message_timestamp)
    admission, ahead = await rt.store.admit(turn_id, cid, now=rt.now(), request=wake)
    if admission == "cancelled":
        await rt.end_turn(turn_id, "cancelled", code="cancelled", conversation_id=cid,
                          message=f"cancelled before {stage.name}: the turn never started")
    if admission != "admitted":
        log.info("turn_not_admitted", admission=admission, behind=ahead)
        return
    begin = await rt.store.begin(turn_id, stage.name, now=rt.now(), holder=rt.worker_id)
    if await _stopped(rt, begin, turn_id, stage):
        return
    tracing.annotate(conversation_id=cid, attempt=begin.attempt)
    try:
        if resolved is None or req.conversation_id is not None:
            # the conversation may have changed (or been created) while this turn waited
            resolved = await _resolve(rt, req, cid, must_exist=True)
    except ThreadlineError as e:
        await rt.end_turn(turn_id, "failed", code=e.code, message=e.message, conversation_id=cid)
        return
    assert resolved is not None
    await _accept(rt, stage, resolved, begin, t0)


async def _refuse(rt: Runtime, stage: Stage, turn_id: str, request: object, error: ThreadlineError, *,
                  conversation_id: str) -> None:
    """End the turn a refused message names — unless that turn already lives on another message
    (a producer's duplicate, or a hostile one): a waiting or running turn is ended only by its own
    request; any other message naming it is dead-lettered and the turn left alone."""
    state = await rt.store.turn_state(turn_id)
    if state.status in ("waiting", "running"):
        own = await rt.store.waiting_request(state.conversation_id, turn_id)
        if own is None or own != request:
            message = CurrentMessage.get_current_message()
            await rt.store.dead_letter(stage.queue, message.message_id if message else "", stage.name,
                                       f"refused_duplicate: {error.code}")
            log.warning("duplicate_refused", code=error.code, turn_status=state.status)
            return
    await rt.end_turn(turn_id, "failed", code=error.code, message=error.message, conversation_id=conversation_id)


async def _resolve(rt: Runtime, req: TurnRequest, cid: str, *, must_exist: bool) -> ResolvedTurn | None:
    """The turn pinned (config, variables, parent), or None when its conversation does not exist yet
    and need not (its first turn may still be ahead in line)."""
    conversation: ConversationRecord | None = None
    if req.conversation_id is not None:
        conversation = await rt.store.find_conversation(req.conversation_id)
        if conversation is None:
            if must_exist:
                await rt.store.load_conversation(req.conversation_id)  # raises conversation_not_found
            return None
    config, ref = await rt.store.load_config(req.agent_id, choose_config(req, conversation))
    parent = req.parent_message_id
    parent_known = parent in (None, "root") or (
        conversation is not None and await rt.store.has_message(conversation.id, str(parent)))
    resolved, decision = resolve_turn(req, conversation=conversation, config=config, config_ref=ref,
                                      new_conversation_id=cid, now=rt.now(), clock=time.monotonic,
                                      parent_known=parent_known)
    log.info("resolved", config_ref=decision.config_ref, new_conversation=decision.new_conversation,
             missing_variables=decision.missing_variables)
    return resolved


async def _accept(rt: Runtime, stage: Stage, resolved: ResolvedTurn, begin: Begin, t0: float) -> None:
    turn_id = resolved.turn_id
    following = rt.graph.next(stage.name)
    assert following is not None
    s = Started(Envelope(turn_id=turn_id, stage=stage.name), begin, resolved, t0)
    # the input guards' verdict is the stage's decision record (`threadline turn show` prints it)
    decision = resolved.guard.record() if resolved.guard is not None else None
    accepted = events.Accepted(turn_id=turn_id, conversation_id=resolved.conversation_id,
                               message_id=resolved.message_id, parent_message_id=resolved.parent_message_id,
                               config_version=resolved.config_ref)
    # `accepted` is the first event of a turn; the admit stage's own `started` follows it
    started = events.StageEvent(turn_id=turn_id, stage=stage.name, status="started")
    await rt.store.advance(
        turn_id, stage.name, next_=Next(following.name, Envelope(turn_id=turn_id, stage=following.name).model_dump(),
                                        rt.new_id()),
        now=rt.now(), now_ms=rt.now_ms(), artifact=resolved.model_dump_json(),
        events_=[accepted, started, _finished(s, stage, decision)], fence=begin.fence,
        conversation_id=resolved.conversation_id, decision=decision,
        accept=Accept(new_conversation(resolved), pending_row(resolved), resolved.accepted_at + resolved.deadline_s),
    )


# --- control --------------------------------------------------------------------------------------


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
        await rt.end_turn(tid, "cancelled", code="cancelled", message=reason[:1000] or "cancelled while waiting")
    else:
        log.info("cancel_signalled", status=status)
