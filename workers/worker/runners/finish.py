"""The runner of the `finish` stage: the one terminal write of the turn (row, snapshot, usage, event)."""

from __future__ import annotations

import structlog

from threadline.pipeline import events
from threadline.pipeline.contracts import (
    Envelope,
)
from threadline.pipeline.invoke import (
    InvokeOutcome,
)
from threadline.pipeline.persist import final_row
from threadline.pipeline.stages import Stage
from threadline.workers.storage.turns import REFUSALS, Finish
from threadline.workers.telemetry import metrics, tracing
from threadline.workers.worker.long_term import long_term_of
from threadline.workers.worker.runners.common import (
    envelope_of,
    finished_event,
    settled,
    settlement,
    start_stage,
)
from threadline.workers.worker.runners.memory import note_ended_turn
from threadline.workers.worker.runtime import Runtime

log = structlog.get_logger(__name__)


async def run_finish(rt: Runtime, stage: Stage, envelope: object) -> None:
    if (env := await envelope_of(rt, stage, envelope)) is None or (s := await start_stage(rt, stage, env)) is None:
        return
    turn = s.turn
    outcome = InvokeOutcome.model_validate_json(s.begin.previous)
    row = final_row(turn, status=outcome.status, now=rt.now(), answer=outcome.answer, usage=outcome.usage,
                    code=outcome.code, tools=outcome.tools)
    if outcome.guard:
        row = row.model_copy(update={"guard": outcome.guard})
    terminal = events.terminal(
        env.turn_id, s.begin.attempt, outcome.status, answer=outcome.answer, usage=outcome.usage,
        code=outcome.code, message=outcome.message, pending_tool_calls=outcome.pending_tool_calls,
        conversation_id=turn.conversation_id, message_id=turn.message_id, model=outcome.model,
    )
    result = await rt.store.finish(
        Finish(turn_id=env.turn_id, event=terminal, conversation_id=turn.conversation_id, message=row,
               snapshot=outcome.snapshot, pending_tool_calls=outcome.pending_tool_calls, fence=s.begin.fence,
               tenant_id=turn.tenant_id, before=[finished_event(s, stage)], webhook_url=turn.webhook_url or "",
               settle=settlement(rt, s.message)),
        now=rt.now(),
    )
    settled(rt, s.message, result)
    if result in REFUSALS:
        # not the turn's tenant's conversation, or not the row its accept wrote: the turn ended `failed`
        log.warning("persist_refused", reason=result)
        return
    log.info("persisted", status=outcome.status, write=result, snapshot=outcome.snapshot is not None)
    metrics.turn_ended(terminal, write=result, turn=turn)
    tracing.turn_ended(terminal, write=result, turn=turn, now=rt.now())
    if turn.config.memory.compaction is not None:
        # after the turn, off its critical path: the turns its window dropped get summarised
        for after in rt.graph.of_kind("compaction"):
            arg = Envelope(turn_id=env.turn_id, stage=after.name, conversation_id=turn.conversation_id).model_dump()
            await rt.store.enqueue_stage(after.name, arg, message_id=rt.new_id(), now_ms=rt.now_ms())
    if outcome.status == "succeeded" and long_term_of(turn) is not None and turn.agent_id:
        # after the turn too: it joins its user's memory partition's line (debounced: one message
        # per partition while one is queued)
        for after in rt.graph.of_kind("memory"):
            await note_ended_turn(rt, after, turn)
