"""The runner of `compaction` stages, after the turn: tool-result clearing and running summaries."""

from __future__ import annotations

import asyncio
from typing import Any

import structlog

from threadline.pipeline.compaction import (
    SUMMARISE_PROMPT,
    clear_snapshots,
    clearing_due,
    summariser_history,
    summary_record,
    turns_to_clear,
    window_start,
)
from threadline.pipeline.config import AgentConfig, CompactionSpec
from threadline.pipeline.errors import ThreadlineError
from threadline.pipeline.history import encode_messages, turn_messages
from threadline.pipeline.invoke import (
    TurnDeps,
)
from threadline.pipeline.records import MessageRecord
from threadline.pipeline.resolve import ConfigRef
from threadline.pipeline.stages import Stage
from threadline.workers.worker.runners.common import (
    envelope_of,
)
from threadline.workers.worker.runtime import Runtime
from threadline.workers.worker.token_counting import CountUnavailable

log = structlog.get_logger(__name__)


async def run_compaction(rt: Runtime, stage: Stage, envelope: object) -> None:
    """After a turn ended: clear old tool results when its window was cut, then summarise the turns
    that fell out of its window into the running summary of its thread (best effort: a failure is
    logged, and a later turn's compaction covers the same turns); its decision record says what it did."""
    if (env := await envelope_of(rt, stage, envelope)) is None or env.conversation_id is None:
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
