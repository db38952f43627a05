"""Compaction's pure parts: what the summariser reads, `offline:summary`'s answer, and how a summary
takes its place in a budgeted history."""

from __future__ import annotations

import dataclasses

from pydantic_ai.messages import ModelRequest, ModelResponse, TextPart, UserPromptPart

from threadline.pipeline.budget import BudgetParts
from threadline.pipeline.compaction import summariser_history, window_start
from threadline.pipeline.history import SUMMARY_HEADER, ThreadRead, budgeted_history
from threadline.pipeline.models import first_sentence, summary_answer
from threadline.pipeline.records import MessageRecord
from threadline.pipeline.stages import DEFAULT_GRAPH


def exchange(question: str, answer: str) -> list[ModelRequest | ModelResponse]:
    return [ModelRequest(parts=[UserPromptPart(question)]), ModelResponse(parts=[TextPart(answer)])]


def test_offline_summary_keeps_the_first_sentence_of_each_user_message_and_the_previous_summary() -> None:
    history = summariser_history("Earlier: the user is Ada.", [exchange("I like tea. Also cake.", "ok"),
                                                                  exchange("Where is Lisbon? Tell me", "Portugal")])
    asked = [*history, ModelRequest(parts=[UserPromptPart("Summarise.")])]
    assert summary_answer(asked) == "Earlier: the user is Ada.\nI like tea.\nWhere is Lisbon?"
    assert first_sentence("No stop at all") == "No stop at all"
    assert first_sentence("v1.2 is out. Yes.") == "v1.2 is out."


def test_a_summary_stands_in_for_the_dropped_turns_and_counts_in_the_budget() -> None:
    rows = [MessageRecord(id=f"t{i}", conversation_id="c", parent_id=f"t{i - 1}" if i > 1 else None,
                          turn_id=f"t{i}", query=f"q{i}", answer=f"a{i}", status="succeeded") for i in range(1, 7)]
    budget = BudgetParts(context_window=1440, max_output=1000, safety_margin=0, instructions=0, query=0, tools=0)
    read = ThreadRead(rows=rows, snapshots={}, counts={r.id: 100 for r in rows}, complete=True, previous_start=None,
                      budget=budget, tokenizer="chars/4", summaries={"t2": ("q1 and q2 happened", 40)})
    messages, window, watermark = budgeted_history(read, low_water=1.0)
    # 440 tokens for history: t3..t6 (400) fit, t1 and t2 are dropped and summarised (40 tokens)
    assert watermark == "t2" and window.kept == ["t3", "t4", "t5", "t6"] and window.tokens == 400
    # a longer summary takes its tokens from the history: one turn fewer
    longer = dataclasses.replace(read, summaries={"t2": ("q1 and q2 happened", 60)})
    assert budgeted_history(longer, low_water=1.0)[1].kept == ["t4", "t5", "t6"]
    first = messages[0]
    assert isinstance(first, ModelRequest) and str(first.parts[0].content).startswith(SUMMARY_HEADER)


def test_no_summary_while_nothing_was_dropped() -> None:
    rows = [MessageRecord(id="t1", conversation_id="c", parent_id=None, turn_id="t1", query="q", answer="a",
                          status="succeeded")]
    budget = BudgetParts(context_window=2000, max_output=100, safety_margin=0, instructions=0, query=0, tools=0)
    read = ThreadRead(rows=rows, snapshots={}, counts={"t1": 10}, complete=True, previous_start=None, budget=budget,
                      tokenizer="chars/4", summaries={"t1": ("x", 5)})
    assert budgeted_history(read, low_water=0.7)[2] is None


def test_compaction_runs_after_the_turn_never_in_its_chain() -> None:
    assert DEFAULT_GRAPH.next("persist") is None
    assert [s.name for s in DEFAULT_GRAPH.turn_stages] == ["resolve", "history", "map", "invoke", "persist"]
    assert window_start({"window": {"start": "m7"}}) == "m7" and window_start(None) is None
