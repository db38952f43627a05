"""`pipeline.mapping` keeps strict chat templates happy: plain pydantic-ai messages in, normalised
messages out, no Redis and no model."""

from __future__ import annotations

from typing import Any

from hypothesis import example, given
from hypothesis import strategies as st
from pydantic_ai.messages import (
    INTERRUPTED_TOOL_RETURN_CONTENT,
    ModelMessage,
    ModelMessagesTypeAdapter,
    ModelRequest,
    ModelResponse,
    SystemPromptPart,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
    UserPromptPart,
)
from pydantic_ai.tools import ToolDefinition

from threadline.pipeline.mapping import SYSTEM_SEPARATOR, normalise_messages, normalise_tool_definitions

# --- helpers --------------------------------------------------------------------------------------


def _system_parts(messages: list[ModelMessage]) -> list[tuple[int, int, str]]:
    """(message index, part index, content) of every system part."""
    return [
        (m, p, part.content)
        for m, message in enumerate(messages)
        if isinstance(message, ModelRequest)
        for p, part in enumerate(message.parts)
        if isinstance(part, SystemPromptPart)
    ]


def _leading_system(messages: list[ModelMessage]) -> str | None:
    found = _system_parts(messages)
    assert len(found) <= 1, found
    if not found:
        return None
    assert found[0][:2] == (0, 0), "the system part must be the first part of the first message"
    return found[0][2]


def _user_texts(messages: list[ModelMessage]) -> list[str]:
    return [
        str(part.content)
        for message in messages
        if isinstance(message, ModelRequest)
        for part in message.parts
        if isinstance(part, UserPromptPart)
    ]


def _shape(messages: list[ModelMessage]) -> list[tuple[str, str]]:
    """The conversation as (kind, text) pairs, system parts left out: what order means here."""
    shape: list[tuple[str, str]] = []
    for message in messages:
        for part in message.parts:
            if isinstance(part, UserPromptPart):
                shape.append(("user", str(part.content)))
            elif isinstance(part, TextPart):
                shape.append(("assistant", part.content))
            elif isinstance(part, ToolCallPart):
                shape.append(("call", part.tool_call_id))
            elif isinstance(part, ToolReturnPart):
                shape.append(("return", part.tool_call_id))
    return shape


def _without_timestamps(value: Any) -> Any:
    """The leading system part is built afresh on each pass, so its timestamp is not content."""
    if isinstance(value, dict):
        return {k: _without_timestamps(v) for k, v in value.items() if k != "timestamp"}
    if isinstance(value, list):
        return [_without_timestamps(v) for v in value]
    return value


def _dump(messages: list[ModelMessage]) -> Any:
    return _without_timestamps(ModelMessagesTypeAdapter.dump_python(messages, mode="json"))


# --- system content -------------------------------------------------------------------------------


def test_scattered_system_parts_become_one_leading_part() -> None:
    history: list[ModelMessage] = [
        ModelRequest(parts=[SystemPromptPart("You are terse."), UserPromptPart("hi")]),
        ModelResponse(parts=[TextPart("hello")]),
        ModelRequest(parts=[SystemPromptPart("The user is Ada."), UserPromptPart("my order?")]),
        ModelResponse(parts=[TextPart("shipped")]),
        ModelRequest(parts=[UserPromptPart("thanks"), SystemPromptPart("Answer in English.")]),
    ]
    mapped, decision = normalise_messages(history)

    assert _leading_system(mapped) == SYSTEM_SEPARATOR.join(
        ["You are terse.", "The user is Ada.", "Answer in English."]
    )
    assert _shape(mapped) == _shape(history)
    assert decision.system_parts_merged == 3


def test_instructions_follow_the_history_system_texts() -> None:
    history: list[ModelMessage] = [
        ModelRequest(parts=[SystemPromptPart("stored one"), UserPromptPart("q1")]),
        ModelResponse(parts=[TextPart("a1")]),
        ModelRequest(parts=[SystemPromptPart("stored two"), UserPromptPart("q2")]),
    ]
    mapped, _ = normalise_messages(history, instructions=["run instructions", "context"])

    assert _leading_system(mapped) == "stored one\n\nstored two\n\nrun instructions\n\ncontext"


def test_instructions_alone_make_the_leading_part() -> None:
    mapped, _ = normalise_messages([ModelRequest(parts=[UserPromptPart("q")])], instructions=["Be brief."])

    assert _leading_system(mapped) == "Be brief."
    assert _user_texts(mapped) == ["q"]


def test_instructions_with_a_history_that_starts_with_a_response_get_a_request_of_their_own() -> None:
    history: list[ModelMessage] = [ModelResponse(parts=[TextPart("welcome")]),
                                   ModelRequest(parts=[UserPromptPart("q")])]
    mapped, _ = normalise_messages(history, instructions=["Be brief."])

    assert isinstance(mapped[0], ModelRequest) and mapped[0].parts == [mapped[0].parts[0]]
    assert _leading_system(mapped) == "Be brief."
    assert _shape(mapped) == _shape(history)


def test_blank_system_content_disappears() -> None:
    history: list[ModelMessage] = [
        ModelRequest(parts=[SystemPromptPart("   "), UserPromptPart("q1")]),
        ModelResponse(parts=[TextPart("a1")]),
        ModelRequest(parts=[SystemPromptPart("real"), SystemPromptPart("\n\t"), UserPromptPart("q2")]),
    ]
    mapped, decision = normalise_messages(history, instructions=["", "  \n"])

    assert _leading_system(mapped) == "real"
    assert decision.blank_system_parts_dropped == 4


def test_no_system_part_without_system_content() -> None:
    history: list[ModelMessage] = [
        ModelRequest(parts=[SystemPromptPart(" "), UserPromptPart("q1")]),
        ModelResponse(parts=[TextPart("a1")]),
        ModelRequest(parts=[UserPromptPart("q2")]),
    ]
    mapped, decision = normalise_messages(history, instructions=["\n"])

    assert _system_parts(mapped) == []
    assert _shape(mapped) == _shape(history)
    assert decision.system_parts_merged == 0


def test_a_request_holding_only_system_parts_is_not_left_behind_empty() -> None:
    history: list[ModelMessage] = [
        ModelRequest(parts=[SystemPromptPart("sys")]),
        ModelRequest(parts=[UserPromptPart("q")]),
    ]
    mapped, _ = normalise_messages(history)

    assert all(message.parts for message in mapped)
    assert _leading_system(mapped) == "sys"
    assert _user_texts(mapped) == ["q"]


# --- conversation order ---------------------------------------------------------------------------


def test_user_assistant_and_tool_messages_keep_their_order() -> None:
    history: list[ModelMessage] = [
        ModelRequest(parts=[SystemPromptPart("sys"), UserPromptPart("what time is it?")]),
        ModelResponse(parts=[TextPart("let me look"), ToolCallPart("clock", {}, tool_call_id="c1")]),
        ModelRequest(parts=[ToolReturnPart("clock", "12:00", tool_call_id="c1")]),
        ModelResponse(parts=[TextPart("it is noon")]),
        ModelRequest(parts=[SystemPromptPart("late note"), UserPromptPart("and tomorrow?")]),
        ModelResponse(parts=[TextPart("noon again")]),
    ]
    mapped, _ = normalise_messages(history)

    assert _shape(mapped) == [
        ("user", "what time is it?"), ("assistant", "let me look"), ("call", "c1"), ("return", "c1"),
        ("assistant", "it is noon"), ("user", "and tomorrow?"), ("assistant", "noon again"),
    ]
    assert [type(m) for m in mapped] == [type(m) for m in history]


def test_empty_assistant_responses_are_dropped() -> None:
    history: list[ModelMessage] = [
        ModelRequest(parts=[UserPromptPart("q1")]),
        ModelResponse(parts=[]),
        ModelRequest(parts=[UserPromptPart("q2")]),
        ModelResponse(parts=[TextPart("  \n ")]),
        ModelRequest(parts=[UserPromptPart("q3")]),
        ModelResponse(parts=[TextPart(" "), TextPart("kept")]),
    ]
    mapped, decision = normalise_messages(history)

    responses = [m for m in mapped if isinstance(m, ModelResponse)]
    assert [[p.content for p in r.parts if isinstance(p, TextPart)] for r in responses] == [["kept"]]
    assert _user_texts(mapped) == ["q1", "q2", "q3"]
    assert decision.empty_responses_dropped == 2


def test_orphan_tool_results_are_dropped() -> None:
    history: list[ModelMessage] = [
        ModelRequest(parts=[UserPromptPart("q")]),
        ModelResponse(parts=[ToolCallPart("clock", {}, tool_call_id="c1")]),
        ModelRequest(parts=[
            ToolReturnPart("clock", "12:00", tool_call_id="c1"),
            ToolReturnPart("clock", "from nowhere", tool_call_id="ghost"),
        ]),
        ModelResponse(parts=[TextPart("noon")]),
    ]
    mapped, _ = normalise_messages(history)

    returns = [p for m in mapped for p in m.parts if isinstance(p, ToolReturnPart)]
    assert [(r.tool_call_id, r.content) for r in returns] == [("c1", "12:00")]


def test_a_dangling_tool_call_gets_an_interrupted_return() -> None:
    history: list[ModelMessage] = [
        ModelRequest(parts=[UserPromptPart("q1")]),
        ModelResponse(parts=[ToolCallPart("clock", {}, tool_call_id="c1")]),
        ModelRequest(parts=[UserPromptPart("q2")]),
    ]
    mapped, _ = normalise_messages(history)

    assert _shape(mapped) == [("user", "q1"), ("call", "c1"), ("return", "c1"), ("user", "q2")]
    synthesized = mapped[2].parts[0]
    assert isinstance(synthesized, ToolReturnPart)
    assert synthesized.outcome == "interrupted"
    assert synthesized.content == INTERRUPTED_TOOL_RETURN_CONTENT


def test_a_dangling_call_in_the_final_response_is_closed_by_default() -> None:
    history: list[ModelMessage] = [
        ModelRequest(parts=[UserPromptPart("q")]),
        ModelResponse(parts=[ToolCallPart("clock", {}, tool_call_id="c1")]),
    ]
    mapped, _ = normalise_messages(history)

    assert _shape(mapped) == [("user", "q"), ("call", "c1"), ("return", "c1")]


def test_the_final_response_is_left_open_without_repair_last_response() -> None:
    history: list[ModelMessage] = [
        ModelRequest(parts=[UserPromptPart("q1")]),
        ModelResponse(parts=[ToolCallPart("clock", {}, tool_call_id="old")]),
        ModelRequest(parts=[UserPromptPart("q2")]),
        ModelResponse(parts=[ToolCallPart("ask_human", {"question": "?"}, tool_call_id="open")]),
    ]
    mapped, _ = normalise_messages(history, repair_last_response=False)

    # an earlier dangling call is still closed; the frontier is left for the resume to answer
    assert _shape(mapped) == [("user", "q1"), ("call", "old"), ("return", "old"), ("user", "q2"),
                              ("call", "open")]


# --- tool definitions -----------------------------------------------------------------------------


def test_tool_definitions_get_a_string_description() -> None:
    tools = [ToolDefinition(name="clock"), ToolDefinition(name="ask_human", description="Ask the user.")]

    normalised = normalise_tool_definitions(tools)

    assert [(t.name, t.description) for t in normalised] == [("clock", ""), ("ask_human", "Ask the user.")]
    assert normalised[1] is tools[1]


# --- invariants -----------------------------------------------------------------------------------

_system_text = st.sampled_from(["sys A", "sys B", "", "  ", "\n\t", "sys C"])
_call_ids = st.sampled_from(["c0", "c1", "c2", "c3"])


@st.composite
def _request(draw: st.DrawFn) -> ModelRequest:
    parts = draw(st.lists(
        st.one_of(
            st.builds(SystemPromptPart, _system_text),
            st.builds(UserPromptPart, st.integers(0, 10_000).map(lambda n: f"user {n}")),
            st.builds(lambda i: ToolReturnPart("clock", f"result {i}", tool_call_id=i), _call_ids),
        ),
        min_size=1, max_size=4,
    ))
    return ModelRequest(parts=parts)


@st.composite
def _response(draw: st.DrawFn) -> ModelResponse:
    parts = draw(st.lists(
        st.one_of(
            st.builds(TextPart, st.sampled_from(["answer", "", "   ", "more"])),
            st.builds(lambda i: ToolCallPart("clock", {}, tool_call_id=i), _call_ids),
        ),
        max_size=3,
    ))
    # real responses name their model, which keeps pydantic-ai from merging adjacent ones
    return ModelResponse(parts=parts, model_name=draw(st.sampled_from([None, "m"])))


_histories = st.lists(st.one_of(_request(), _response()), max_size=10)
_instructions = st.lists(_system_text, max_size=2)


@given(_histories, _instructions, st.booleans())
def test_at_most_one_system_part_and_only_in_front(
    history: list[ModelMessage], instructions: list[str], repair_last: bool
) -> None:
    mapped, _ = normalise_messages(history, instructions=instructions, repair_last_response=repair_last)

    system = _leading_system(mapped)
    assert system is None or system.strip()
    expected = [
        part.content
        for message in history
        if isinstance(message, ModelRequest)
        for part in message.parts
        if isinstance(part, SystemPromptPart) and part.content.strip()
    ] + [text for text in instructions if text.strip()]
    assert system == (SYSTEM_SEPARATOR.join(expected) if expected else None)


@given(_histories, _instructions)
def test_user_prompt_texts_are_preserved_in_order(
    history: list[ModelMessage], instructions: list[str]
) -> None:
    mapped, _ = normalise_messages(history, instructions=instructions)

    assert _user_texts(mapped) == _user_texts(history)


@given(_histories, _instructions)
def test_no_empty_messages_come_out(history: list[ModelMessage], instructions: list[str]) -> None:
    mapped, _ = normalise_messages(history, instructions=instructions)

    assert all(message.parts for message in mapped)
    for message in mapped:
        if isinstance(message, ModelResponse):
            assert not any(isinstance(p, TextPart) and not p.content.strip() for p in message.parts)


@given(_histories, _instructions, st.booleans())
# The smallest histories hypothesis finds: a request left with nothing but system parts (from the
# start, or once its orphan tool result is gone) is dropped after `repair_messages` ran, leaving two
# responses side by side, which the second pass's `repair_messages` then merges.
@example(
    history=[ModelResponse(parts=[TextPart("a")]), ModelRequest(parts=[SystemPromptPart("sys")]),
             ModelResponse(parts=[TextPart("b")])],
    instructions=[], repair_last=True,
)
@example(
    history=[ModelResponse(parts=[TextPart("a")]),
             ModelRequest(parts=[SystemPromptPart("sys"), ToolReturnPart("clock", "?", tool_call_id="c0")]),
             ModelResponse(parts=[TextPart("b")])],
    instructions=[], repair_last=False,
)
def test_normalising_twice_is_normalising_once(
    history: list[ModelMessage], instructions: list[str], repair_last: bool
) -> None:
    once, _ = normalise_messages(history, instructions=instructions, repair_last_response=repair_last)
    # the instructions are in `once` already: a second pass adds none
    twice, _ = normalise_messages(once, repair_last_response=repair_last)

    assert _dump(twice) == _dump(once)
