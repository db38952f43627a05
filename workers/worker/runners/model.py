"""The runner of the `model` stage: the model claim and its heartbeat, the pydantic-ai run with a
cancellation token and a deadline, retries of transient failures, the hand-over to the finish stage.
The call runs on the model calls' event loop, not on its message's thread (`calls.py`)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from functools import partial

import dramatiq
import structlog
from dramatiq.middleware import CurrentMessage
from pydantic_ai import CancellationToken

from threadline.pipeline import events
from threadline.pipeline.contracts import (
    Envelope,
)
from threadline.pipeline.cost import LocalCount, local_count
from threadline.pipeline.errors import ThreadlineError
from threadline.pipeline.guards import stream_guard
from threadline.pipeline.history import decode_messages
from threadline.pipeline.invoke import (
    answer_without_model,
    invoke_decision,
    retry_delay_s,
    run_instructions,
    run_turn,
)
from threadline.pipeline.records import ResolvedTurn
from threadline.pipeline.stages import Stage
from threadline.pipeline.streaming import RunEvents, TextDebouncer
from threadline.workers.storage.turns import Next
from threadline.workers.telemetry import metrics
from threadline.workers.worker.limiter import limited_model, turn_limiter
from threadline.workers.worker.middleware.give_up import gave_up
from threadline.workers.worker.providers import build_tools
from threadline.workers.worker.runners.common import (
    Started,
    envelope_of,
    hand_over,
    start_stage,
)
from threadline.workers.worker.runtime import Runtime
from threadline.workers.worker.stream import TurnStream
from threadline.workers.worker.tokenizers import load_tokenizer

log = structlog.get_logger(__name__)


async def run_model(rt: Runtime, stage: Stage, envelope: object) -> None:
    """Claim the model call and start it on the calls' event loop (`calls.py`), with the calls'
    runtime; the message's thread is free again at once, and its ack waits for the call's end."""
    if (env := await envelope_of(rt, stage, envelope)) is None:
        return
    token = rt.registry.register(env.turn_id, rt.store.keys.shard)  # before begin: a cancel from now on reaches the run
    try:
        s = await start_stage(rt, stage, env, claim=rt.worker_id)
    except BaseException:
        rt.registry.unregister(env.turn_id, token)
        raise
    if s is None:
        rt.registry.unregister(env.turn_id, token)
        return
    message = CurrentMessage.get_current_message()
    assert isinstance(message, dramatiq.MessageProxy), "the model stage runs under CurrentMessage"
    assert rt.on_calls is not None, "a worker's runtime has the calls' runtime (Boot)"
    rt.hold(env.turn_id)  # for the heartbeat, until the call ends (Liveness lets the message go now)
    rt.calls.spawn(message, _run_call(rt.on_calls, stage, s, token, message))


async def _run_call(rt: Runtime, stage: Stage, s: Started, token: CancellationToken,
                    message: dramatiq.MessageProxy) -> None:
    turn_id = s.env.turn_id
    try:
        if s.turn.guard is not None:
            await _answer_without_model(rt, stage, s)
        else:
            await _call_model(rt, stage, s, token)
            await _cancel_observed(rt, turn_id, token)
    except Exception as e:
        # the message runs again: its next delivery must not find our claim and stand down
        await rt.store.release_claim(turn_id, rt.worker_id)
        if not await rt.calls.redeliver(message, e):
            await rt.end_turn(turn_id, "failed", code="internal_error", message=gave_up(message.actor_name, e))
        raise  # logged, and counted as the stage's error, by `ModelCalls`
    finally:
        rt.registry.unregister(turn_id, token)
        rt.let_go(turn_id)


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


async def _answer_without_model(rt: Runtime, stage: Stage, s: Started) -> None:
    """A turn the input guards answered: no model is built or called; the reply goes out as one text
    delta, with the stage's end, and the turn ends like any other."""
    outcome = answer_without_model(s.turn)
    log.info("invoked", status=outcome.status, guard=outcome.guard)
    delta = events.TextDelta(turn_id=s.env.turn_id, attempt=s.begin.attempt, text=outcome.answer)
    await hand_over(rt, stage, s, outcome.model_dump_json(), before=[delta])


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
                           guard=stream_guard(turn.config.guards))
    spec = turn.config.model
    async with (_claim_heartbeat(rt, turn_id),
                turn_limiter(rt.store, turn.config.id, limit=spec.max_concurrency, turn_id=turn_id) as limiter,
                TurnStream(translator, partial(rt.store.emit, turn_id), rt.now) as stream):
        outcome = await run_turn(turn, history, agent=agent, attempt=attempt, stream=stream, token=token,
                                 clock=rt.now, timeout_s=deadline_at - rt.now(), max_chars=rt.settings.max_text_chars,
                                 secrets=rt.secrets(spec),
                                 model=limited_model(agent, limiter), local=_local_count(rt, turn))
    log.info("invoked", status=outcome.status, code=outcome.code, usage=outcome.usage.model_dump(),
             truncated_parts=outcome.truncated_parts, model=outcome.model, fallback_from=outcome.fallback_from)
    if outcome.status == "cancelled" and rt.handing_over(turn_id):
        await _hand_back(rt, stage, s)
        return
    if outcome.status == "cancelled":  # the reason the canceller gave (`cancel(turn_id, reason)`) ends it
        outcome = outcome.model_copy(update={"message": await rt.store.cancel_reason(turn_id) or outcome.message})
    # attempts a stopping worker handed over are not failed ones
    delay_s = retry_delay_s(outcome, attempt=attempt - s.begin.handovers, max_attempts=rt.settings.max_invoke_attempts)
    if delay_s is None:
        decision = invoke_decision(outcome, limit_wait_s=limiter.waited_s if limiter else None)
        await hand_over(rt, stage, s, outcome.model_dump_json(), decision)
        return
    reason = f"{outcome.code}: {outcome.message}"
    arg = Envelope(turn_id=turn_id, stage=stage.name, attempt=attempt + 1).model_dump()
    await rt.store.retry(turn_id, next_=Next(stage.name, arg, rt.new_id(), delay_ms=int(delay_s * 1000)),
                         now=rt.now(), now_ms=rt.now_ms(),
                         event=events.Retrying(turn_id=turn_id, attempt=attempt + 1, reason=reason),
                         claim=rt.worker_id)
    log.info("model_retry_scheduled", delay_s=delay_s, reason=reason)


def _local_count(rt: Runtime, turn: ResolvedTurn) -> LocalCount | None:
    """How the usage of an offline model is counted (its own is a guess): with the agent's tokenizer,
    what the history stage counts with; None when no model of the chain is offline."""
    spec = turn.config.model
    if not any(m.provider == "offline" for m in spec.chain()):
        return None
    tokenizer = rt.counter(spec).tokenizer or load_tokenizer(None, spec.provider)
    tools = build_tools(turn.config.tools, allow_python=rt.settings.allow_python_models)
    return local_count(tokenizer, instructions=run_instructions(turn), tools=[t.tool_def for t in tools])


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
