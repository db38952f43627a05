"""Turn events: the typed union on the wire (encoded without `seq`, numbered by the store), the five
terminal endings, and the pure translation of a run's pydantic-ai stream events into turn events."""

from __future__ import annotations

import json
import typing

import pytest
from pydantic import ValidationError
from pydantic_ai.messages import (
    FunctionToolCallEvent,
    FunctionToolResultEvent,
    PartDeltaEvent,
    PartStartEvent,
    TextPart,
    TextPartDelta,
    ToolCallPart,
    ToolReturnPart,
)

from threadline.pipeline import events
from threadline.pipeline.contracts import Usage
from threadline.pipeline.limits import truncation_marker
from threadline.pipeline.streaming import RunEvents, TextDebouncer


def numbered(encoded: str, seq: int, attempt: int | None = None) -> str:
    """What the store's `emit` (prelude.lua) does to an encoded event: `seq` (and `attempt`) in front."""
    head = f'{{"seq":{seq},'
    if attempt is not None:
        head += f'"attempt":{attempt},'
    return head + encoded[1:]


# --- the wire union -------------------------------------------------------------------------------


def test_an_event_is_encoded_without_seq_and_the_store_numbers_it() -> None:
    delta = events.TextDelta(turn_id="t1", attempt=2, text="hi")
    encoded = events.encode(delta)
    assert "seq" not in json.loads(encoded)
    decoded = events.decode(numbered(encoded, 7))
    assert decoded == delta.model_copy(update={"seq": 7})
    assert isinstance(decoded, events.TextDelta) and (decoded.seq, decoded.attempt, decoded.text) == (7, 2, "hi")


def test_an_event_numbered_by_the_store_gets_its_attempt_from_the_store_too() -> None:
    started = events.StageEvent(turn_id="t1", stage="invoke", status="started")
    encoded = events.encode(started, numbered_by_store=True)
    assert {"seq", "attempt"}.isdisjoint(json.loads(encoded))
    decoded = events.decode(numbered(encoded, 3, attempt=2).encode())
    assert isinstance(decoded, events.StageEvent)
    assert (decoded.seq, decoded.attempt, decoded.stage, decoded.status) == (3, 2, "invoke", "started")


def test_a_stage_finished_event_carries_its_decision() -> None:
    finished = events.StageEvent(turn_id="t1", stage="map", status="finished", ms=1.5,
                                 decision={"system_parts_merged": 2})
    decoded = events.decode(numbered(events.encode(finished), 1))
    assert isinstance(decoded, events.StageEvent) and decoded.decision == {"system_parts_merged": 2}
    assert decoded.ms == 1.5


@pytest.mark.parametrize("event", [
    events.Accepted(turn_id="t1", conversation_id="c-t1", message_id="t1", parent_message_id=None,
                    config_version="v1"),
    events.StageEvent(turn_id="t1", stage="history", status="finished", ms=0.4),
    events.TextDelta(turn_id="t1", text="Hello"),
    events.ToolCall(turn_id="t1", tool_call_id="call-1", name="clock", args={}),
    events.ToolResult(turn_id="t1", tool_call_id="call-1", name="clock", content="noon", outcome="success"),
    events.Retrying(turn_id="t1", attempt=2, reason="model_unavailable: 503"),
    events.Succeeded(turn_id="t1", answer="done", usage=Usage(input_tokens=3, output_tokens=4, requests=1),
                     conversation_id="c-t1", message_id="t1"),
    events.Paused(turn_id="t1", answer="Which colour?", pending_tool_calls=[{"tool_call_id": "q1"}]),
    events.Failed(turn_id="t1", code="invalid_request", message="query is empty"),
    events.Cancelled(turn_id="t1", code="cancelled", message="user pressed stop", answer="partial"),
    events.TimedOut(turn_id="t1", code="timed_out", message="the turn's deadline passed"),
], ids=lambda e: e.type)
def test_every_event_round_trips_through_the_one_adapter(event: events.Event) -> None:
    decoded = events.decode(numbered(events.encode(event), 5))
    assert type(decoded) is type(event)
    assert decoded == event.model_copy(update={"seq": 5})
    assert events.is_terminal(decoded) == (event.type in events.TERMINAL_TYPES)


def test_terminal_types_are_the_types_of_the_terminal_union() -> None:
    union = {cls.model_fields["type"].default for cls in typing.get_args(events.Terminal)}
    assert union == events.TERMINAL_TYPES == {"succeeded", "paused", "failed", "cancelled", "timed_out"}


@pytest.mark.parametrize(("status", "cls"), [("succeeded", events.Succeeded), ("paused", events.Paused),
                                             ("failed", events.Failed), ("cancelled", events.Cancelled),
                                             ("timed_out", events.TimedOut)])
def test_terminal_builds_each_ending_with_the_ids_of_an_accepted_turn(status: events.TerminalType,
                                                                      cls: type[events.Terminal]) -> None:
    terminal = events.terminal("t1", 2, status, answer="text", code="model_error", message="why",
                               conversation_id="c-t1", message_id="t1")
    assert type(terminal) is cls and terminal.type == status
    assert (terminal.turn_id, terminal.attempt, terminal.answer) == ("t1", 2, "text")
    assert (terminal.conversation_id, terminal.message_id) == ("c-t1", "t1")
    if isinstance(terminal, events.Failed | events.Cancelled | events.TimedOut):
        assert (terminal.code, terminal.message) == ("model_error", "why")
    else:
        assert terminal.usage == Usage()


def test_a_failure_without_a_code_is_an_internal_error_and_a_refused_turn_names_no_conversation() -> None:
    failed = events.terminal("t1", 1, "failed")
    assert isinstance(failed, events.Failed)
    assert (failed.code, failed.message, failed.conversation_id, failed.message_id) == ("internal_error", "", None,
                                                                                        None)


def test_fields_the_reader_does_not_know_are_ignored_and_unknown_types_refused() -> None:
    newer = '{"seq":1,"turn_id":"t1","attempt":1,"type":"text_delta","text":"x","added_later":true}'
    assert events.decode(newer) == events.TextDelta(seq=1, turn_id="t1", text="x")
    with pytest.raises(ValidationError):
        events.decode('{"seq":1,"turn_id":"t1","type":"mystery"}')
    with pytest.raises(ValidationError):
        events.decode('{"seq":1,"turn_id":"t1","type":"failed"}')  # a failure always has a code


def test_events_are_frozen() -> None:
    delta = events.TextDelta(turn_id="t1", text="x")
    with pytest.raises(ValidationError):
        delta.text = "y"  # type: ignore[misc]


# --- a run's stream events, translated ------------------------------------------------------------


def translator(window_s: float = 0.1, max_chars: int = 512, payload_chars: int = 100_000) -> RunEvents:
    return RunEvents("t1", 2, TextDebouncer(window_s=window_s, max_chars=max_chars), tool_payload_chars=payload_chars)


def test_a_tool_call_flushes_the_buffered_text_before_it_and_its_result_follows() -> None:
    run = translator()
    run.observe(PartStartEvent(index=0, part=TextPart("Let me look. ")), now=0.0)
    run.observe(PartDeltaEvent(index=0, delta=TextPartDelta(content_delta="One moment.")), now=0.01)
    call = ToolCallPart("clock", {"zone": "UTC"}, tool_call_id="call-1")
    out = run.observe(FunctionToolCallEvent(part=call), now=0.02)
    assert out == [events.TextDelta(turn_id="t1", attempt=2, text="One moment."),
                   events.ToolCall(turn_id="t1", attempt=2, tool_call_id="call-1", name="clock",
                                   args={"zone": "UTC"})]
    result = ToolReturnPart("clock", "12:00", tool_call_id="call-1")
    done = run.observe(FunctionToolResultEvent(part=result), now=0.03)
    assert done == [events.ToolResult(turn_id="t1", attempt=2, tool_call_id="call-1", name="clock", content="12:00",
                                      outcome="success")]
    activity = run.tools["call-1"]
    assert (activity.name, activity.args, activity.content, activity.outcome) == ("clock", {"zone": "UTC"}, "12:00",
                                                                                  "success")


def test_tool_payloads_over_the_limit_are_carried_truncated_with_a_marker() -> None:
    run = translator(payload_chars=60)
    long_result = "x" * 500
    run.observe(FunctionToolCallEvent(part=ToolCallPart("lookup", {"q": "y" * 500}, tool_call_id="c1")), now=0.0)
    (done,) = run.observe(FunctionToolResultEvent(part=ToolReturnPart("lookup", long_result, tool_call_id="c1")),
                          now=0.0)
    assert isinstance(done, events.ToolResult)
    assert isinstance(done.content, str) and len(done.content) <= 60
    kept = done.content[: done.content.index("\n[")]
    assert done.content == kept + truncation_marker(len(long_result) - len(kept))
    args = run.tools["c1"].args
    assert isinstance(args, str) and len(args) <= 60 and "truncated" in args
    assert run.tools["c1"].content == done.content


def test_events_that_say_nothing_to_the_user_make_no_turn_event() -> None:
    run = translator()
    call = ToolCallPart("clock", {}, tool_call_id="c1")
    assert run.observe(PartStartEvent(index=0, part=call), now=0.0) == []
    assert run.observe(PartStartEvent(index=1, part=TextPart("")), now=0.0) == []
