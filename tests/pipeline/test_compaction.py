"""Compaction's pure parts: what the summariser reads, `offline:summary`'s answer, and how a summary
takes its place in a budgeted history."""

from __future__ import annotations

import dataclasses

from pydantic_ai.messages import (
    ModelMessage,
    ModelRequest,
    ModelResponse,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
    UserPromptPart,
)

from threadline.pipeline.budget import BudgetParts
from threadline.pipeline.compaction import (
    clear_snapshots,
    clear_tool_results,
    clearing_due,
    summariser_history,
    turns_to_clear,
    window_start,
)
from threadline.pipeline.history import SUMMARY_HEADER, ThreadRead, budgeted_history, decode_messages, encode_messages
from threadline.pipeline.llm import first_sentence, summary_answer
from threadline.pipeline.records import MessageRecord
from threadline.pipeline.stages import DEFAULT_GRAPH
from threadline.pipeline.tokens import CharsTokenizer, count_messages


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
    messages, window, watermark, _ = budgeted_history(read, low_water=1.0)
    # 440 tokens for history: t3..t6 (400) fit, t1 and t2 are dropped and summarised (40 tokens)
    assert watermark == "t2" and window.kept == ["t3", "t4", "t5", "t6"] and window.tokens == 400
    # a longer summary takes its tokens from the history: one turn fewer
    longer = dataclasses.replace(read, summaries={"t2": ("q1 and q2 happened", 60)})
    assert budgeted_history(longer, low_water=1.0)[1].kept == ["t4", "t5", "t6"]
    # after the kept turns (t3..t6: two messages each), before the turn's query
    assert [str(m.parts[0].content)[:2] for m in messages[:8:2]] == ["q3", "q4", "q5", "q6"]
    block = messages[8]
    assert isinstance(block, ModelRequest) and str(block.parts[0].content).startswith(SUMMARY_HEADER)
    assert len(messages) == 10


def test_a_rewritten_summary_leaves_the_kept_turns_a_prefix_of_the_next_request() -> None:
    """The turn after a cut carries the summary its compaction wrote: with the same window, the
    provider's cached prefix (the kept turns) stays the one the cut turn sent."""
    rows = [MessageRecord(id=f"t{i}", conversation_id="c", parent_id=f"t{i - 1}" if i > 1 else None,
                          turn_id=f"t{i}", query=f"q{i}", answer=f"a{i}", status="succeeded") for i in range(1, 8)]
    budget = BudgetParts(context_window=1440, max_output=1000, safety_margin=0, instructions=0, query=0, tools=0)
    cut = ThreadRead(rows=rows[:6], snapshots={}, counts={r.id: 100 for r in rows}, complete=True,
                     previous_start=None, budget=budget, tokenizer="chars/4", summaries={"t1": ("q1 happened", 40)})
    first, window, _, _ = budgeted_history(cut, low_water=0.5)
    assert window.reason == "pruned_to_low_water" and window.start == "t5"
    after = dataclasses.replace(cut, rows=rows, previous_start="t5",
                                summaries={"t1": ("q1 happened", 40), "t4": ("q1 to q4 happened", 50)})
    second, window, watermark, _ = budgeted_history(after, low_water=0.5)
    assert window.reason == "prefix_kept" and watermark == "t4"
    def texts(messages: list[ModelMessage]) -> list[list[str]]:  # what the provider reads, not the timestamps
        return [[str(p.content) for p in m.parts if isinstance(p, UserPromptPart | TextPart)] for m in messages]

    assert texts(second)[:4] == texts(first)[:4] and texts(second)[-2] != texts(first)[-2]  # t5, t6; the summaries


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


# --- clearing old tool results --------------------------------------------------------------------


def tool_turn(result: str, *, call_id: str = "call-1") -> list[ModelRequest | ModelResponse]:
    return [ModelRequest(parts=[UserPromptPart("look it up")]),
            ModelResponse(parts=[ToolCallPart("lookup", {"q": "x"}, tool_call_id=call_id)]),
            ModelRequest(parts=[ToolReturnPart("lookup", result, tool_call_id=call_id)]),
            ModelResponse(parts=[TextPart("found it")])]


def test_clearing_replaces_a_tool_results_content_and_keeps_the_call_and_its_pairing() -> None:
    messages = tool_turn("x" * 1234)
    cleared = clear_tool_results(messages)
    assert (cleared.results, cleared.chars) == (1, 1234)
    result = cleared.messages[2].parts[0]
    assert isinstance(result, ToolReturnPart) and result.content == "[tool result cleared: 1,234 chars]"
    assert result.tool_call_id == "call-1" and result.tool_name == "lookup" and result.outcome == "success"
    # everything but the result's content is the same message; the stored original is untouched
    assert [cleared.messages[i] for i in (0, 1, 3)] == [messages[i] for i in (0, 1, 3)]
    assert messages[2].parts[0].content == "x" * 1234  # type: ignore[union-attr]
    # once cleared, a result stays as it is (a later compaction changes nothing), as does a short one
    assert clear_tool_results(cleared.messages).results == 0
    assert clear_tool_results(tool_turn("12:00")).results == 0


def test_only_a_cut_window_clears_and_the_newest_turns_keep_their_results() -> None:
    assert clearing_due({"window": {"reason": "pruned_to_low_water"}})
    assert clearing_due({"window": {"reason": "nothing_fits"}})
    assert not clearing_due({"window": {"reason": "prefix_kept"}}) and not clearing_due(None)
    assert turns_to_clear(["t1", "t2", "t3", "t4"]) == ["t1", "t2"]
    assert turns_to_clear(["t1", "t2"]) == []


def test_clear_snapshots_returns_only_the_turns_that_changed_and_they_cost_less() -> None:
    stored = {"t1": encode_messages(tool_turn("y" * 800)), "t2": encode_messages(exchange("hi", "hello"))}
    cleared = clear_snapshots(stored)
    assert list(cleared) == ["t1"]
    tokenizer = CharsTokenizer()
    before = count_messages(decode_messages(stored["t1"], where="test"), tokenizer)
    assert count_messages(cleared["t1"].messages, tokenizer) < before - 150
