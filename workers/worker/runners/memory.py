"""The runner of `memory` stages, after the turn: the ended turns of one user's memory partition are
extracted (once per batch) and consolidated into long-term memory, one extraction per partition at a
time; and `note_ended_turn`, which the finish stage calls to put a turn in that line (debounced)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import structlog
from dramatiq.middleware import CurrentMessage
from pydantic_ai import Agent

from threadline.pipeline.config import OFFLINE_EXTRACTOR, AgentConfig, LongTermSpec
from threadline.pipeline.consolidation import consolidate
from threadline.pipeline.contracts import Envelope
from threadline.pipeline.extraction import (
    EXTRACTION_INSTRUCTIONS,
    EXTRACTION_VERSION,
    OFFLINE_VERSION,
    ExtractionOutput,
    Proposal,
    extraction_prompt,
    offline_facts,
    proposals_from_output,
)
from threadline.pipeline.memory import Provenance, Scope
from threadline.pipeline.records import ResolvedTurn
from threadline.pipeline.resolve import ConfigRef
from threadline.pipeline.stages import Stage
from threadline.workers.protocol.wire import build_message
from threadline.workers.storage.base import in_shard
from threadline.workers.storage.memory import (
    ATTEMPTS,
    MemoryStore,
    PendingTurn,
    lease_call,
    memory_keys,
    note_call,
    pending_from,
)
from threadline.workers.worker.long_term import long_term_of, memory_store, turn_scope
from threadline.workers.worker.providers import build_model
from threadline.workers.worker.runners.common import envelope_of
from threadline.workers.worker.runtime import Runtime

log = structlog.get_logger(__name__)

#: The debounce flag's life: a turn ending while it is set joins the message queued already (if that
#: message is lost, the next turn after it expires enqueues one again).
QUEUED_FLAG_MS = 60_000
#: One extraction's lease: renewed between batches; a crashed holder's lease runs out by then.
LEASE_MS = 30_000

async def note_ended_turn(rt: Runtime, stage: Stage, turn: ResolvedTurn) -> str:
    """Put a succeeded turn in its partition's line for extraction; the stage's message is enqueued
    only when none is queued ('queued'), else the turn goes with it ('folded'; 'done': consolidated)."""
    spec = long_term_of(turn)
    assert spec is not None
    mk = memory_keys(rt.store.keys, turn_scope(spec, turn))
    pending = PendingTurn(turn_id=turn.turn_id, conversation_id=turn.conversation_id, message_id=turn.message_id,
                          ended_at=rt.now(), agent_id=turn.agent_id, config_ref=turn.config_ref)
    arg = Envelope(turn_id=turn.turn_id, stage=stage.name, conversation_id=turn.conversation_id).model_dump()
    message = build_message(stage.queue, stage.name, (arg,), message_id=rt.new_id(), now_ms=rt.now_ms())
    keys = rt.store.keys
    # sharded layout: the partition's keys and the turn's shard's queue are in two slots (a message
    # lost between the two calls is enqueued again by the next turn after the flag expired)
    queue_keys = None if keys.shards else (keys.queue_messages(stage.queue), keys.queue(stage.queue))
    reply = await memory_store(rt.store).call(note_call(
        mk, pending, message=message, channel=keys.doorbell_channel(), queue_keys=queue_keys, flag_ms=QUEUED_FLAG_MS))
    status = reply.decode() if isinstance(reply, bytes) else str(reply)
    if queue_keys is None and status == "queued":
        await rt.store.enqueue(*message)
    return status


# --- the runner -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Batch:
    """Turns consolidated together, with what their extraction proposed and who proposed it."""

    turns: tuple[PendingTurn, ...]
    proposals: tuple[Proposal, ...]
    source: Provenance


async def run_memory(rt: Runtime, stage: Stage, envelope: object) -> None:
    """Extract and consolidate the partition's pending turns, holding its lease; a message that finds
    the lease held leaves its turns to the holder (who takes what is pending before it lets go).
    Exceptions go to dramatiq's retries (the turns ended long ago: nothing waits on this)."""
    if (env := await envelope_of(rt, stage, envelope)) is None or env.conversation_id is None:
        return
    conversation = await rt.store.find_conversation(env.conversation_id)
    if conversation is None:
        return
    config, _ = await rt.store.load_config(conversation.agent_id, ConfigRef.parse(conversation.config_ref))
    if config.memory.long_term is None:
        return
    scope = turn_scope(config.memory.long_term, conversation)
    mem = memory_store(rt.store)
    mk = memory_keys(rt.store.keys, scope)
    current = CurrentMessage.get_current_message()
    token = current.message_id if current else rt.new_id()
    taken, _ = await mem.call(lease_call(mk, "take", token, lease_ms=LEASE_MS))
    if int(taken) != 1:
        log.info("memory_lease_held", partition=scope.partition)
        return
    kept = 1
    while kept == 1:  # the release keeps the lease while turns are pending: take them too
        with in_shard(None):  # the partition's turns are of conversations in any shard
            await _consolidate_pending(rt, stage, mem, scope)
        kept, _ = (int(x) for x in await mem.call(lease_call(mk, "release", token, lease_ms=LEASE_MS)))


async def _pending(mem: MemoryStore, scope: Scope) -> list[PendingTurn]:
    raw = await mem.redis.hgetall(memory_keys(mem.keys, scope).pending)
    return pending_from(cast(dict[bytes, bytes], raw))


async def _consolidate_pending(rt: Runtime, stage: Stage, mem: MemoryStore, scope: Scope) -> None:
    turns = await _pending(mem, scope)
    if not turns:
        return
    texts = await _turn_texts(rt, turns)
    config, _ = await rt.store.load_config(turns[-1].agent_id, ConfigRef.parse(turns[-1].config_ref))
    spec = config.memory.long_term
    if spec is None:  # the agent turned memory off since: the turns are dropped, unconsolidated
        records, revision = await mem.current_and_revision(scope)
        await mem.apply(scope, consolidate(records, [], scope=scope, now=rt.now(), new_id=rt.new_id,
                                           source=Provenance("extracted"), turn_ended_at=rt.now()),
                        revision=revision, unpend=[t.turn_id for t in turns])
        return
    for batch in await _extract(rt, spec, config, scope, mem, turns, texts):
        await _apply_batch(rt, stage, mem, scope, spec, batch)


async def _turn_texts(rt: Runtime, turns: Sequence[PendingTurn]) -> dict[str, tuple[str, str]]:
    """Each turn's (query, answer), from its conversation's message row (a deleted one: nothing)."""
    texts = {}
    for t in turns:
        row = await rt.store.message(t.conversation_id, t.message_id)
        texts[t.turn_id] = (row.query, row.answer) if row else ("", "")
    return texts


async def _extract(rt: Runtime, spec: LongTermSpec, config: AgentConfig, scope: Scope, mem: MemoryStore,
                   turns: Sequence[PendingTurn], texts: dict[str, tuple[str, str]]) -> list[Batch]:
    """`offline:facts`: each turn on its own (its own provenance); a model: one run for the batch."""
    if spec.extractor_name == OFFLINE_EXTRACTOR:
        return [Batch((t,), offline_facts(*texts[t.turn_id]), _source(t, OFFLINE_EXTRACTOR, OFFLINE_VERSION))
                for t in turns]
    records = await mem.current(scope)
    rt.settings.policy.check(spec.extractor)
    model = build_model(spec.extractor, env=rt.settings.model_env, allow_python=rt.settings.allow_python_models)
    agent: Agent[None, ExtractionOutput] = Agent(model, output_type=ExtractionOutput,
                                                 instructions=EXTRACTION_INSTRUCTIONS)
    result = await agent.run(extraction_prompt(records, [texts[t.turn_id][0] for t in turns]))
    return [Batch(tuple(turns), proposals_from_output(result.output),
                  _source(turns[-1], spec.extractor_name, EXTRACTION_VERSION))]


def _source(turn: PendingTurn, extractor: str, version: str) -> Provenance:
    return Provenance("extracted", conversation_id=turn.conversation_id, message_id=turn.message_id,
                      turn_id=turn.turn_id, extractor=extractor, extractor_version=version)


async def _apply_batch(rt: Runtime, stage: Stage, mem: MemoryStore, scope: Scope, spec: LongTermSpec,
                       batch: Batch) -> None:
    """Consolidate against the partition's current records and write, guarded by its revision: on a
    conflict read again and consolidate again (a few times), unless the turns are no longer pending."""
    ids = [t.turn_id for t in batch.turns]
    for _ in range(ATTEMPTS):
        records, revision = await mem.current_and_revision(scope)
        result = consolidate(records, batch.proposals, scope=scope, now=rt.now(), new_id=rt.new_id,
                             source=batch.source, turn_ended_at=batch.turns[-1].ended_at, limits=spec.limits)
        if await mem.apply(scope, result, revision=revision, turn_ids=ids, max_history=spec.max_history):
            await _save_decisions(rt, stage, batch.turns, result.decision())
            log.info("remembered", partition=scope.partition, turns=len(ids), writes=len(result.writes))
            return
        if not set(ids) & {t.turn_id for t in await _pending(mem, scope)}:
            return  # consolidated by another delivery, or its conversation was forgotten meanwhile
    raise RuntimeError("the memory partition kept changing; retried")


async def _save_decisions(rt: Runtime, stage: Stage, turns: Sequence[PendingTurn], decision: dict[str, Any]) -> None:
    for t in turns:
        await rt.store.save_decision(t.conversation_id, t.message_id, stage.name, decision)
