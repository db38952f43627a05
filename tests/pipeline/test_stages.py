"""The stage graph, declared once, and its transform stages called directly: plain data in, an
artifact and a decision record out."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic_ai.messages import (
    ModelMessage,
    ModelRequest,
    ModelResponse,
    SystemPromptPart,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
    UserPromptPart,
)

from threadline.pipeline.budget import BudgetParts
from threadline.pipeline.config import AgentConfig
from threadline.pipeline.errors import SnapshotCorrupt
from threadline.pipeline.history import ThreadRead, decode_messages, encode_messages
from threadline.pipeline.records import MessageRecord, ResolvedTurn
from threadline.pipeline.stages import (
    DEFAULT_GRAPH,
    Stage,
    StageGraph,
    StageInput,
    StageOutput,
    history_stage,
    map_stage,
)


def resolved(**fields: Any) -> ResolvedTurn:
    base: dict[str, Any] = dict(
        turn_id="t3", conversation_id="c-t1", message_id="t3", parent_message_id="t2", new_conversation=False,
        config_ref="v1", config=AgentConfig.model_validate({"id": "bot", "model": "offline:echo"}),
        instructions="", query="third", deadline_s=30, accepted_at=0, tenant_id="t", app_id="a", user_id="u",
    )
    return ResolvedTurn(**{**base, **fields})


def row(id: str, parent: str | None, *, answer: str = "", at: float = 0.0) -> MessageRecord:
    return MessageRecord(id=id, conversation_id="c-t1", parent_id=parent, turn_id=id, query=f"q-{id}",
                         answer=answer or f"a-{id}", status="succeeded", created_at=at)


def stored(query: str, answer: str) -> list[ModelMessage]:
    return [ModelRequest(parts=[UserPromptPart(query)]), ModelResponse(parts=[TextPart(answer)])]


def noop(given: StageInput) -> StageOutput:
    return StageOutput(given.artifact)


# --- the graph ------------------------------------------------------------------------------------


def test_the_default_graph_names_the_five_stages_in_order() -> None:
    assert DEFAULT_GRAPH.names == ("resolve", "history", "map", "invoke", "persist", "compact", "remember")
    assert [s.kind for s in DEFAULT_GRAPH] == ["admit", "transform", "transform", "model", "finish", "compaction",
                                               "memory"]
    assert [s.name for s in DEFAULT_GRAPH.turn_stages] == ["resolve", "history", "map", "invoke", "persist"]
    assert [s.queue for s in DEFAULT_GRAPH] == list(DEFAULT_GRAPH.names)
    assert DEFAULT_GRAPH.first.name == "resolve"
    assert DEFAULT_GRAPH["history"].needs == ("thread",) and DEFAULT_GRAPH["map"].needs == ()
    assert [s.name for s in DEFAULT_GRAPH.of_kind("model")] == ["invoke"]
    assert "map" in DEFAULT_GRAPH and "audit" not in DEFAULT_GRAPH


def test_next_and_previous_walk_the_table() -> None:
    assert DEFAULT_GRAPH.next("resolve") == DEFAULT_GRAPH["history"]
    assert DEFAULT_GRAPH.next("persist") is None
    assert DEFAULT_GRAPH.previous("invoke") == DEFAULT_GRAPH["map"]
    with pytest.raises(ValueError, match="first stage"):
        DEFAULT_GRAPH.previous("resolve")


def test_a_stage_is_added_with_one_entry_and_the_original_graph_is_unchanged() -> None:
    audited = DEFAULT_GRAPH.with_stage(Stage("audit", "transform", noop), after="map")
    assert audited.names == ("resolve", "history", "map", "audit", "invoke", "persist", "compact", "remember")
    assert audited.next("map") == audited["audit"] and audited.previous("invoke") == audited["audit"]
    assert DEFAULT_GRAPH.names == ("resolve", "history", "map", "invoke", "persist", "compact", "remember")


@pytest.mark.parametrize(("stages", "message"), [
    ([Stage("resolve", "admit")], "starts with its admit stage"),
    ([Stage("history", "transform", noop), Stage("persist", "finish")], "starts with its admit stage"),
    ([Stage("resolve", "admit"), Stage("invoke", "model")], "ends with its finish stage"),
    ([Stage("resolve", "admit"), Stage("x", "transform", noop), Stage("x", "transform", noop),
      Stage("persist", "finish")], "unique"),
    ([Stage("resolve", "admit"), Stage("x", "transform"), Stage("persist", "finish")], "transform stages"),
    ([Stage("resolve", "admit", noop), Stage("persist", "finish")], "transform stages"),
])
def test_a_malformed_graph_is_refused(stages: list[Stage], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        StageGraph(stages)


# --- history --------------------------------------------------------------------------------------


def read(rows: list[MessageRecord], snapshots: dict[str, bytes], *, history_budget: int = 10_000,
         previous_start: str | None = None, counts: dict[str, int] | None = None) -> ThreadRead:
    """What the shell would have read: `rows` oldest first, each turn costing 100 tokens."""
    fixed = BudgetParts(context_window=history_budget + 1000, max_output=1000, safety_margin=0, instructions=0,
                        query=0, tools=0)
    return ThreadRead(rows=rows, snapshots=snapshots, counts=counts or {r.id: 100 for r in rows},
                      complete=not rows or rows[0].parent_id is None, previous_start=previous_start,
                      budget=fixed, tokenizer="chars/4")


def test_history_concatenates_the_stored_messages_of_the_thread_in_order() -> None:
    first, second = stored("q-t1", "a-t1"), stored("q-t2", "a-t2")
    snapshots = {"t1": encode_messages(first), "t2": encode_messages(second), "other": encode_messages(second)}
    thread_ = [row("t1", None, at=1), row("t2", "t1", at=2)]
    out = history_stage(StageInput(resolved(), "", {"thread": read(thread_, snapshots)}))
    messages = decode_messages(out.artifact, where="test")
    assert messages == [*first, *second]
    assert out.decision["window"]["reason"] == "all_fit" and out.decision["window"]["kept_turns"] == 2
    assert out.decision["tokenizer"] == "chars/4" and out.decision["budget"]["history"] == 10_000
    assert out.decision["read"] == {"turns": 2, "complete": True} and out.decision["messages_out"] == 4


def test_history_falls_back_to_text_and_says_when_the_read_did_not_reach_the_root() -> None:
    thread_ = [row("t2", "t1", answer="old answer")]
    out = history_stage(StageInput(resolved(), "", {"thread": read(thread_, {})}))
    messages = decode_messages(out.artifact, where="test")
    assert messages[0].parts[0].content == "q-t2"  # type: ignore[union-attr]
    assert out.decision["read"]["complete"] is False


def test_history_keeps_the_newest_whole_turns_that_fit_and_records_what_it_dropped() -> None:
    rows = [row(f"t{i}", f"t{i - 1}" if i > 1 else None, at=i, answer=f"a{i}") for i in range(1, 6)]
    out = history_stage(StageInput(resolved(), "", {"thread": read(rows, {}, history_budget=300)}))
    window = out.decision["window"]
    # 500 tokens > 300: down to the low-water mark (0.7 x 300 = 210): the two newest turns
    assert (window["reason"], window["kept_turns"], window["start"]) == ("pruned_to_low_water", 2, "t4")
    assert window["dropped"] == ["t1", "t2", "t3"] and window["dropped_tokens"] == 300
    users = [p.content for m in decode_messages(out.artifact, where="test") if isinstance(m, ModelRequest)
             for p in m.parts if isinstance(p, UserPromptPart)]
    assert users == ["q-t4", "q-t5"]


def test_a_corrupt_snapshot_is_a_stable_error_naming_its_message() -> None:
    thread_ = [row("t1", None)]
    given = StageInput(resolved(parent_message_id="t1"), "", {"thread": read(thread_, {"t1": b"[{"})})
    with pytest.raises(SnapshotCorrupt, match="message t1"):
        history_stage(given)


# --- map ------------------------------------------------------------------------------------------


def test_map_normalises_the_assembled_history_and_reports_what_it_changed() -> None:
    history: list[ModelMessage] = [
        ModelRequest(parts=[SystemPromptPart("stored one"), UserPromptPart("q1")]),
        ModelResponse(parts=[ToolCallPart("clock", {}, tool_call_id="c1")]),
        ModelRequest(parts=[SystemPromptPart("stored two"), UserPromptPart("q2")]),
        ModelResponse(parts=[TextPart("  ")]),
    ]
    out = map_stage(StageInput(resolved(), encode_messages(history).decode()))
    mapped = decode_messages(out.artifact, where="test")
    systems = [p.content for m in mapped if isinstance(m, ModelRequest) for p in m.parts
               if isinstance(p, SystemPromptPart)]
    assert systems == ["stored one\n\nstored two"]
    returns = [p for m in mapped if isinstance(m, ModelRequest) for p in m.parts if isinstance(p, ToolReturnPart)]
    assert [(r.tool_call_id, r.outcome) for r in returns] == [("c1", "interrupted")]
    assert out.decision["system_parts_merged"] == 2 and out.decision["empty_responses_dropped"] == 1


def test_map_leaves_the_open_question_of_a_paused_turn_for_its_resume() -> None:
    history: list[ModelMessage] = [
        ModelRequest(parts=[UserPromptPart("paint my room")]),
        ModelResponse(parts=[ToolCallPart("ask_human", {"question": "Which colour?"}, tool_call_id="q1")]),
    ]
    artifact = encode_messages(history).decode()
    resume = resolved(query="", deferred_answers={"q1": "blue"})
    kept = decode_messages(map_stage(StageInput(resume, artifact)).artifact, where="test")
    assert not any(isinstance(p, ToolReturnPart) for m in kept for p in m.parts)
    # a new prompt instead abandons the question: the call is closed as interrupted
    closed = decode_messages(map_stage(StageInput(resolved(), artifact)).artifact, where="test")
    assert [p.outcome for m in closed for p in m.parts if isinstance(p, ToolReturnPart)] == ["interrupted"]
