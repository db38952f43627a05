"""What the shell loads for a transform stage's `needs` (`pipeline.stages.Stage.needs`), by need."""

from __future__ import annotations

import asyncio
import dataclasses
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any

from threadline.pipeline.budget import BudgetParts, answering_limits, history_budget
from threadline.pipeline.history import RecallRead, ThreadRead, summary_messages, turn_messages
from threadline.pipeline.invoke import run_instructions, user_prompt
from threadline.pipeline.recall import RecallIndex, index_records
from threadline.pipeline.records import MessageRecord, ResolvedTurn
from threadline.workers.storage.memory import memory_keys
from threadline.workers.worker.files import check_files
from threadline.workers.worker.long_term import long_term_of, memory_store, turn_scope
from threadline.workers.worker.providers import build_tools
from threadline.workers.worker.runtime import Runtime
from threadline.workers.worker.token_counting import CountUnavailable, TokenCounter
from threadline.workers.worker.tokenizers import load_tokenizer

Loader = Callable[[Runtime, ResolvedTurn, str], Awaitable[Any]]

#: Rows read by the first round trip while walking a thread back from its newest turn (it doubles).
READ_BATCH = 32


async def load_thread(rt: Runtime, turn: ResolvedTurn, stage: str) -> ThreadRead:
    """The thread's newest turns, walked back from the turn's parent (never read by a row count from
    the conversation's newest message, so a branch from any old message sees its own thread), until
    they overflow the history budget and pass the start the parent's request kept; with their token
    counts, counted once per turn and counter and cached with the conversation. When the provider's
    count endpoint fails, the read counts with the provider's local default, and says so."""
    counter = rt.counter(turn.config.model)
    recalling = asyncio.create_task(_recall_read(rt, turn, counter))
    try:
        read = await _read_thread(rt, turn, stage, counter)
    except CountUnavailable as e:
        read = await _read_thread(rt, turn, stage, e.fallback)
        read = dataclasses.replace(read, tokenizer_fallback=f"{counter.name}: {e.reason}")
    finally:
        recalling.add_done_callback(_retrieved)
    return dataclasses.replace(read, recall=await recalling)


#: Recall indexes kept per process, by (the partition's records key, its revision): a partition's
#: records are read and indexed again only when its revision moved (one field read per turn).
RECALL_INDEXES = 1024
_indexes: OrderedDict[tuple[str, int], RecallIndex] = OrderedDict()


async def _recall_read(rt: Runtime, turn: ResolvedTurn, counter: TokenCounter) -> RecallRead | None:
    """The partition's current records, indexed, when the turn recalls long-term memory."""
    if (spec := long_term_of(turn)) is None:
        return None
    scope = turn_scope(spec, turn)
    mem = memory_store(rt.store)
    key = (memory_keys(rt.store.keys, scope).records, await mem.revision(scope))
    index = _indexes.get(key)
    if index is None:
        records, revision = await mem.current_and_revision(scope) if key[1] else ([], 0)
        index = index_records(records, scope)
        key = (key[0], revision)
        _indexes[key] = index
        while len(_indexes) > RECALL_INDEXES:
            _indexes.popitem(last=False)
    _indexes.move_to_end(key)
    tokenizer = counter.tokenizer or load_tokenizer(None, turn.config.model.provider)
    return RecallRead(index=index, tokenizer=tokenizer)


async def _budget(rt: Runtime, turn: ResolvedTurn, counter: TokenCounter) -> BudgetParts:
    """The history budget: the fixed parts counted (at once: a provider counts each over HTTP)."""
    tools = build_tools(turn.config.tools, allow_python=rt.settings.allow_python_models)
    prompt = user_prompt(turn, vision=False)
    query = prompt if isinstance(prompt, str) else " ".join(p for p in prompt or () if isinstance(p, str))
    instructions, query_tokens, tool_tokens = await asyncio.gather(
        counter.text(run_instructions(turn)), counter.text(query), counter.tools([t.tool_def for t in tools]))
    limits = answering_limits(turn.config.model)  # the history must fit every model that may answer (fallbacks)
    return history_budget(
        context_window=limits.context_window, max_output=limits.max_output,
        safety_margin=turn.config.memory.safety_margin_tokens,
        instructions=instructions, query=query_tokens, tools=tool_tokens,
    )


async def _read_thread(rt: Runtime, turn: ResolvedTurn, stage: str, counter: TokenCounter) -> ThreadRead:
    # the fixed parts are counted while the thread is read and its new turn counted: with a provider's
    # count endpoint the stage waits for one round trip, not two
    budgeting = asyncio.create_task(_budget(rt, turn, counter))
    try:
        return await _walk_thread(rt, turn, stage, counter, budgeting)
    finally:
        budgeting.cancel()  # nothing when it is done
        budgeting.add_done_callback(_retrieved)


def _retrieved(task: asyncio.Task[Any]) -> None:
    """Its error was raised through the walk, or no longer matters (the walk failed first)."""
    if not task.cancelled():
        task.exception()


async def _walk_thread(rt: Runtime, turn: ResolvedTurn, stage: str, counter: TokenCounter,
                       budgeting: asyncio.Task[BudgetParts]) -> ThreadRead:
    spec = turn.config.model
    store, cid = rt.store, turn.conversation_id
    previous_start = None
    if turn.parent_message_id is not None:
        decided = await store.decision(cid, turn.parent_message_id, stage)
        previous_start = decided.get("window", {}).get("start") if decided else None
    rows: list[MessageRecord] = []
    snapshots: dict[str, bytes] = {}
    counts: dict[str, int] = {}
    used, passed_start, current = 0, previous_start is None, turn.parent_message_id
    limit = turn.config.memory.message_limit
    async for batch in store.walk_back(cid, current, batch=READ_BATCH):
        by_id = {r.id: r for r in batch}
        chain: list[MessageRecord] = []
        while current is not None and current in by_id:
            chain.append(by_id[current])
            current = by_id[current].parent_id
        counts.update(await _counts(rt, cid, chain, counter, snapshots))
        budget = await budgeting
        for record in chain:
            rows.append(record)
            used += counts[record.id]
            passed_start = passed_start or record.id == previous_start
            if (used > budget.history and passed_start) or len(rows) >= limit:
                current = None
                break
        if current is None:
            break
    budget = await budgeting
    rows.reverse()
    snapshots.update(await store.load_snapshots(cid, [r.id for r in rows if r.id not in snapshots]))
    summaries: dict[str, tuple[str, int]] = {}
    if turn.config.memory.compaction is not None and rows:
        found = await store.summaries(cid, [r.id for r in rows])
        if not found and rows[0].parent_id:
            found = await _summary_below(rt, cid, rows[0].parent_id, limit)
        summary_counts = await counter.turns({mid: summary_messages(text) for mid, text in found.items()})
        summaries = {mid: (text, summary_counts[mid]) for mid, text in found.items()}
    # the files of the turns read, asked about in one batch (the history keeps some of these turns)
    files = await check_files((f.url for r in rows for f in r.files), mode=rt.settings.file_check)
    return ThreadRead(rows=rows, snapshots=snapshots, counts=counts, complete=not rows or rows[0].parent_id is None,
                      previous_start=previous_start, budget=budget, tokenizer=counter.name, summaries=summaries,
                      files=files, vision=spec.vision, counter=counter.tokenizer)


async def _summary_below(rt: Runtime, cid: str, start: str, limit: int) -> dict[str, str]:
    """The newest running summary on the thread from `start` back (older than what was read)."""
    current: str | None = start
    walked = 0
    async for batch in rt.store.walk_back(cid, start, batch=READ_BATCH):
        by_id = {r.id: r for r in batch}
        chain: list[str] = []
        while current is not None and current in by_id:
            chain.append(current)
            current = by_id[current].parent_id
        found = await rt.store.summaries(cid, chain)
        for mid in chain:  # newest first
            if mid in found:
                return {mid: found[mid]}
        walked += len(batch)
        if current is None or walked >= limit:
            break
    return {}


async def _counts(rt: Runtime, cid: str, chain: list[MessageRecord], counter: TokenCounter,
                  snapshots: dict[str, bytes]) -> dict[str, int]:
    """Token counts of `chain`'s turns: cached ones read, the others counted once and cached (their
    snapshots, read to count them, are added to `snapshots` so that they are read once)."""
    ids = [r.id for r in chain]
    cached = await rt.store.token_counts(cid, ids, counter.name)
    counts = cached.counts
    missing = [r for r in chain if r.id not in counts]
    if missing:
        snapshots.update(await rt.store.load_snapshots(cid, [r.id for r in missing if r.id not in snapshots]))
        # decoding is CPU work: off the event loop, so the process's other turns keep streaming
        decoded = await asyncio.to_thread(lambda: {r.id: turn_messages(r, snapshots.get(r.id)) for r in missing})
        fresh = await counter.turns(decoded)
        await rt.store.save_token_counts(cid, fresh, counter.name, versions=cached.versions)
        counts.update(fresh)
    return counts


LOADERS: dict[str, Loader] = {"thread": load_thread}
