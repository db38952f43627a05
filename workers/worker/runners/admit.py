"""The runner of the `admit` stage: validate the request, take the turn's place in its conversation's
line, pin the config, check scope, accept — or refuse before anything of the conversation is written."""

from __future__ import annotations

import time
from typing import cast

import structlog
from dramatiq.middleware import CurrentMessage

from threadline.pipeline import events
from threadline.pipeline.busy import DEFAULT_ON_BUSY, OnBusy, busy_error
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
from threadline.pipeline.persist import new_conversation, pending_row
from threadline.pipeline.records import ConversationRecord, ResolvedTurn
from threadline.pipeline.resolve import Refusal, choose_config, refusal_error, resolve_turn
from threadline.pipeline.stages import Stage
from threadline.workers.protocol.wire import build_message
from threadline.workers.storage.turns import REFUSALS, WAKE_ID, Accept, Begin, Next
from threadline.workers.telemetry import tracing
from threadline.workers.worker.runners.common import (
    Malformed,
    Started,
    finished_event,
    settled,
    settlement,
)
from threadline.workers.worker.runtime import Runtime

log = structlog.get_logger(__name__)


async def run_admit(rt: Runtime, stage: Stage, request: object) -> None:
    """Validate the producer's request, refuse it before anything of its conversation is touched,
    take its place in the conversation's line, pin what it runs with, and accept it."""
    message = CurrentMessage.get_current_message()
    assert message is not None, "the CurrentMessage middleware is installed"
    turn_id = extract_turn_id(request.first if isinstance(request, Malformed) else request) or valid_turn_id(
        message.message_id)
    if not await _placed(rt, stage, turn_id, request, message.message_id):
        return
    assert turn_id is not None
    try:
        if isinstance(request, Malformed):
            raise InvalidRequest("a turn message carries exactly one argument: the turn request")
        settings = rt.settings
        req = parse_turn_request(request, fallback_turn_id=turn_id, max_query_chars=settings.max_query_chars,
                                 max_context_chars=settings.max_context_chars,
                                 max_inputs_chars=settings.max_inputs_chars, max_files=settings.max_files)
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
    # a turn that ends here, not accepted, still reaches its webhook (the request's, else its agent's)
    url = resolved.webhook_url if resolved is not None else req.webhook_url
    admission, ahead, begin = await rt.store.admit(turn_id, cid, now=rt.now(), request=wake, tenant_id=req.tenant_id,
                                                   creates=req.conversation_id is None,
                                                   on_busy=await _on_busy(rt, req, resolved), holder=rt.worker_id)
    if admission == "busy":
        # `on_busy: reject` in a busy conversation: nothing of it was written
        busy = busy_error(cid, ahead)
        await rt.end_turn(turn_id, "failed", code=busy.code, message=busy.message, conversation_id=cid,
                          webhook_url=url, tenant_id=req.tenant_id)
        return
    if admission == "changed":
        # turns kept arriving between the read of the interrupted ones and the script: try again later
        raise RuntimeError(f"the turns in the way of turn {turn_id} kept changing")
    if admission == "refused":
        # the conversation changed under the turn since it was checked: the script's check is the last word
        error = refusal_error(cast(Refusal, ahead), turn_id=turn_id, conversation_id=cid)
        await rt.end_turn(turn_id, "failed", code=error.code, message=error.message, conversation_id=cid,
                          webhook_url=url, tenant_id=req.tenant_id)
        return
    if admission == "cancelled":
        await rt.end_turn(turn_id, "cancelled", code="cancelled", conversation_id=cid,
                          webhook_url=url, tenant_id=req.tenant_id,
                          message=await rt.store.cancel_reason(turn_id)
                          or f"cancelled before {stage.name}: the turn never started")
    if begin is None:
        log.info("turn_not_admitted", admission=admission, behind=ahead)
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


async def _placed(rt: Runtime, stage: Stage, turn_id: str | None, request: object, message_id: str) -> bool:
    """Whether the message names a turn of its own, on the queue of its turn's shard (sharded
    layout); if not, it is dead-lettered: there is no stream to report on, or the turn's keys would
    be split over two shards. A sharded turn's shard pointer is written here."""
    if turn_id is None:
        await rt.store.dead_letter(stage.queue, message_id, stage.name, "invalid_turn_id")
        log.warning("turn_refused", reason="invalid_turn_id")
        return False
    structlog.contextvars.bind_contextvars(turn_id=turn_id)
    if not rt.store.layout.shards:
        return True
    shard = rt.store.layout.shard_of(extract_conversation_id(request) or new_conversation_id(turn_id))
    if shard != rt.store.keys.shard:
        await rt.store.dead_letter(stage.queue, message_id, stage.name, f"wrong_shard: {shard}")
        log.warning("turn_refused", reason="wrong_shard", shard=shard, queue_shard=rt.store.keys.shard)
        return False
    await rt.store.point(turn_id)
    return True


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


async def _on_busy(rt: Runtime, req: TurnRequest, resolved: ResolvedTurn | None) -> OnBusy:
    """The turn's `on_busy` policy: its request's, else its agent's (the config it would run with)."""
    if req.on_busy is not None:
        return req.on_busy
    if resolved is not None:
        return resolved.config.on_busy
    try:  # its conversation does not exist yet: the agent's current config says
        config, _ = await rt.store.load_config(req.agent_id, choose_config(req, None))
    except ThreadlineError:
        return DEFAULT_ON_BUSY  # the turn fails for that reason when it runs
    return config.on_busy


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
    parent = req.parent_message_id
    parent_known = parent in (None, "root")
    if conversation is None:  # a new conversation: whether its id is taken, and its agent's config, in one read
        existing, (config, ref) = await rt.store.find_with_config(cid, req.agent_id, choose_config(req, None))
        taken = False
    else:  # the pinned config, and whether the turn's message and its parent are rows, in one read
        existing = None
        (config, ref), rows = await rt.store.config_and_rows(
            req.agent_id, choose_config(req, conversation), conversation.id,
            [req.turn_id] if parent_known else [req.turn_id, str(parent)])
        taken, parent_known = rows[0], parent_known or rows[-1]
    if (existing is not None or taken) and await _accepted_before(rt, req.turn_id):
        existing, taken = None, False
    resolved, decision = resolve_turn(req, conversation=conversation, config=config, config_ref=ref,
                                      new_conversation_id=cid, now=rt.now(),
                                      parent_known=parent_known, existing=existing, message_taken=taken)
    log.info("resolved", config_ref=decision.config_ref, new_conversation=decision.new_conversation,
             missing_variables=decision.missing_variables)
    return resolved


async def _accepted_before(rt: Runtime, turn_id: str) -> bool:
    """Whether what the turn would write over — the conversation a first turn's id names, a row with
    its message id — is its own doing: it was accepted before (a redelivery: its admit stage is done,
    and admit.lua says so), and nothing is in the way."""
    return (await rt.store.turn_state(turn_id)).message_id == turn_id


async def _accept(rt: Runtime, stage: Stage, resolved: ResolvedTurn, begin: Begin, t0: float) -> None:
    turn_id = resolved.turn_id
    following = rt.graph.next(stage.name)
    assert following is not None
    message = CurrentMessage.get_current_message()
    s = Started(Envelope(turn_id=turn_id, stage=stage.name), begin, resolved, t0, message)
    # the input guards' verdict is the stage's decision record (`threadline turn show` prints it)
    decision = resolved.guard.record() if resolved.guard is not None else None
    accepted = events.Accepted(turn_id=turn_id, conversation_id=resolved.conversation_id,
                               message_id=resolved.message_id, parent_message_id=resolved.parent_message_id,
                               config_version=resolved.config_ref)
    # `accepted` is the first event of a turn; the admit stage's own `started` follows it
    started = events.StageEvent(turn_id=turn_id, stage=stage.name, status="started")
    result = await rt.store.advance(
        turn_id, stage.name, next_=Next(following.name, Envelope(turn_id=turn_id, stage=following.name).model_dump(),
                                        rt.new_id()),
        now=rt.now(), now_ms=rt.now_ms(), artifact=resolved.model_dump_json(),
        events_=[accepted, started, finished_event(s, stage, decision)], fence=begin.fence,
        conversation_id=resolved.conversation_id, decision=decision,
        accept=Accept(new_conversation(resolved), pending_row(resolved), resolved.accepted_at + resolved.deadline_s,
                      creates=resolved.new_conversation),
        settle=settlement(rt, message),
    )
    settled(rt, message, result)
    if result in REFUSALS:
        error = refusal_error(cast(Refusal, result), turn_id=turn_id, conversation_id=resolved.conversation_id)
        await rt.end_turn(turn_id, "failed", code=error.code, message=error.message,
                          conversation_id=resolved.conversation_id)
