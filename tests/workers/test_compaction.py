"""Compaction, off the critical path: turns that fell out of the window reach later turns through a
running summary (`offline:summary` keeps the first sentence of every user message it summarises)."""

from __future__ import annotations

import pytest

from tests.conftest import AgentFactory, WorkerPool, turn
from threadline.pipeline import events as ev
from threadline.pipeline.history import SUMMARY_HEADER
from threadline.workers.client import Client

pytestmark = pytest.mark.integration


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
