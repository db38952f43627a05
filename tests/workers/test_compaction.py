"""Compaction, off the critical path: turns that fell out of the window reach later turns through a
running summary (`offline:summary` keeps the first sentence of every user message it summarises)."""

from __future__ import annotations

import dataclasses
import uuid

import pytest
from pydantic_ai.messages import ToolCallPart, ToolReturnPart

from tests.conftest import AgentFactory, WorkerPool, turn
from tests.support.wait import wait_until
from threadline.pipeline import events as ev
from threadline.pipeline.history import SUMMARY_HEADER, decode_messages
from threadline.pipeline.stages import DEFAULT_GRAPH
from threadline.workers.clients.client import Client
from threadline.workers.settings import Settings, shards_from_env
from threadline.workers.storage.connect import async_plain_client
from threadline.workers.storage.conversations import CachedCounts
from threadline.workers.storage.store import Store
from threadline.workers.worker.tokenizers import load_tokenizer

pytestmark = pytest.mark.integration


@pytest.mark.slow  # 40 turns with their compactions
def test_a_code_word_of_turn_1_reaches_turn_40_through_the_summary(workers: WorkerPool, client: Client,
                                                                   make_agent: AgentFactory) -> None:
    agent = make_agent({"provider": "offline", "name": "chat", "context_window": 700, "max_output_tokens": 100},
                       memory={"safety_margin_tokens": 50, "compaction": {"summariser": "offline:summary"}})
    conversation = None
    for n in range(1, 41):
        query = ("My code word is ZEBRA-42. Keep it secret from the others." if n == 1
                 else f"Question {n}: tell me something new. Some more words to fill the window.")
        terminal = client.wait(client.submit(turn(agent, query, conversation_id=conversation)), timeout_s=30)
        assert isinstance(terminal, ev.Succeeded), terminal
        conversation = terminal.conversation_id
    assert conversation is not None
    decision = client.decisions(terminal.turn_id)["history"]
    # turn 1 itself was pruned long ago; a summary stands in for the dropped turns
    assert decision["window"]["dropped_turns"] > 0 and decision["summary"] is not None
    seen = [e for e in client.events(terminal.turn_id) if isinstance(e, ev.StageEvent) and e.stage == "history"]
    assert seen[-1].decision == decision
    # offline:chat quotes every user message it received: the summary's, with only the first sentence of
    # turn 1 (what offline:summary keeps), and never turn 1 itself
    assert SUMMARY_HEADER in terminal.answer and "ZEBRA-42." in terminal.answer
    assert "Keep it secret" not in terminal.answer
    summaries = client.redis.hgetall(client.keys.summaries(conversation))
    assert summaries and all(b"ZEBRA-42." in v for v in summaries.values())
    # every compaction covers the thread from the root: its watermark is a message of the conversation
    assert {k.decode() for k in summaries} <= {m.id for m in client.messages(conversation)}


@pytest.mark.parametrize(("factory", "counter"), [
    ("tool_then_answer", load_tokenizer(None, "python").name),
    # the model's own count (`model.tokenizer: provider`): the cleared turns are counted by it again
    ("counting_tool_then_answer", "provider:python:tests.support.models:counting_tool_then_answer"),
], ids=["local", "provider"])
def test_a_cut_window_clears_old_tool_results_keeping_the_calls_and_counting_them_again(
        workers: WorkerPool, client: Client, make_agent: AgentFactory, factory: str, counter: str) -> None:
    tool = "python:tests.support.models:long_text"
    agent = make_agent({"provider": "python", "name": f"tests.support.models:{factory}",
                        "options": {"tool": "long_text", "args": {"chars": 600}}, "context_window": 1500,
                        "max_output_tokens": 100, "tokenizer": "provider" if counter.startswith("provider") else None},
                       tools=[tool],
                       memory={"safety_margin_tokens": 50, "compaction": {"summariser": "offline:summary"}})
    conversation, turn_ids = None, []
    for n in range(1, 6):
        terminal = client.wait(client.submit(turn(agent, f"Turn {n}: use the tool.", conversation_id=conversation)),
                               timeout_s=30)
        assert isinstance(terminal, ev.Succeeded), terminal
        conversation = terminal.conversation_id
        turn_ids.append(terminal.turn_id)
        # compaction stands down while a turn runs: let it finish first (its decision is its last write)
        wait_until(lambda t=terminal.turn_id, c=conversation: "compact" in client.decisions(t, conversation_id=c))
    assert conversation is not None
    decisions = [client.decisions(t, conversation_id=conversation) for t in turn_ids]
    cuts = [i for i, d in enumerate(decisions) if d["history"]["window"]["reason"] == "pruned_to_low_water"]
    assert cuts and all((decisions[i]["compact"]["tool_results"] is None) == (i not in cuts) for i in range(5))
    first = decisions[cuts[0]]["compact"]["tool_results"]
    # every turn but the newest two (the cut turn and its parent) lost its tool result's content
    assert first["write"] == "cleared" and first["turns"] == first["results"] == cuts[0] - 1
    assert first["chars"] == 600 * (cuts[0] - 1)
    assert all(d["history"]["tokenizer"] == counter for d in decisions)
    counts = client.redis.hgetall(client.keys.token_counts(conversation))
    for n, message_id in enumerate(turn_ids):
        messages = decode_messages(client.snapshot(conversation, message_id) or b"", where=message_id)
        calls = [p for m in messages for p in m.parts if isinstance(p, ToolCallPart)]
        results = [p for m in messages for p in m.parts if isinstance(p, ToolReturnPart)]
        # the call stays, with its result message
        assert [c.tool_call_id for c in calls] == [r.tool_call_id for r in results] and len(calls) == 1
        if n <= cuts[-1] - 2:
            assert results[0].content == "[tool result cleared: 600 chars]"
            # counted again, under the snapshot's next content version; the old count is gone
            assert counts[f"{message_id}|version".encode()] == b"1"
            assert f"{message_id}|{counter}".encode() not in counts
            assert int(counts[f"{message_id}#1|{counter}".encode()]) < 300
        else:
            assert results[0].content == "".join(str(i % 10) for i in range(600))


async def test_clearing_writes_only_while_no_turn_runs_and_the_snapshots_are_the_ones_read(redis_url: str) -> None:
    settings = dataclasses.replace(Settings.from_env({}), prefix=f"tlc{uuid.uuid4().hex[:8]}", redis_url=redis_url,
                                   shards=shards_from_env())  # the session's layout (a cluster's needs shards)
    store = Store(async_plain_client(redis_url), settings, DEFAULT_GRAPH)
    k, cid, r = store.keys, "c1", store.redis
    try:
        await r.hset(k.conversation(cid), "tip", "m1")
        await r.hset(k.snapshots(cid), "m1", b"old")
        await store.save_token_counts(cid, {"m1": 500}, "tok")
        assert await store.token_counts(cid, ["m1"], "tok") == CachedCounts({"m1": 500}, {})

        async def clear(stored: bytes) -> str:
            return await store.clear_tool_results(cid, {"m1": (stored, b"new")}, counts={"m1": 100}, tokenizer="tok")

        await r.hset(k.lease(cid), "turn", "t2")
        assert await clear(b"old") == "busy"  # a turn of the conversation runs
        await r.hdel(k.lease(cid), "turn")
        assert await clear(b"other") == "changed"
        assert await r.hget(k.snapshots(cid), "m1") == b"old"
        assert await clear(b"old") == "cleared"
        assert await r.hget(k.snapshots(cid), "m1") == b"new"
        assert await store.token_counts(cid, ["m1"], "tok") == CachedCounts({"m1": 100}, {"m1": 1})
        # a history stage that read version 0 before the clearing saves its count where nobody reads it
        await store.save_token_counts(cid, {"m1": 999}, "tok", versions={})
        assert (await store.token_counts(cid, ["m1"], "tok")).counts == {"m1": 100}
        await r.delete(k.conversation(cid))
        assert await clear(b"new") == "gone"
    finally:
        async for key in r.scan_iter(f"{settings.prefix}:*"):
            await r.delete(key)
        await store.close()
