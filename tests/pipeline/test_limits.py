"""Size limits: never longer than the limit, unchanged under it, idempotent, and visibly cut."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from pydantic_ai.messages import (
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

from threadline.pipeline.limits import json_text, limit_jsonable, limit_messages, truncate_text, truncation_marker

LIMITS = st.integers(min_value=0, max_value=300)
TEXTS = st.text(max_size=400) | st.integers(min_value=0, max_value=2000).map(lambda n: "x" * n)
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=30),
    lambda children: st.lists(children, max_size=6) | st.dictionaries(st.text(max_size=8), children, max_size=6),
    max_leaves=30,
)


def test_the_marker_says_how_much_was_cut() -> None:
    text, cut = truncate_text("a" * 1000, 100)
    assert cut
    assert len(text) == 100
    kept = text.index("\n[")
    assert text == "a" * kept + f"\n[… truncated: {1000 - kept} more characters]"


def test_under_the_limit_nothing_changes_and_tiny_limits_cut_bare() -> None:
    assert truncate_text("hello", 5) == ("hello", False)
    assert truncate_text("hello world", 3) == ("hel", True)
    assert truncate_text("hello", 0) == ("", True)
    with pytest.raises(ValueError, match="negative"):
        truncate_text("hello", -1)


@given(TEXTS, LIMITS)
@example("x" * 1000, len(truncation_marker(900)) + 100)  # the count loses a digit as the text kept grows
@example("x" * 1009, len(truncation_marker(10)) + 999)
def test_truncate_text_properties(text: str, limit: int) -> None:
    result, cut = truncate_text(text, limit)
    assert len(result) <= limit
    assert cut == (len(text) > limit)
    if not cut:
        assert result == text
    assert truncate_text(result, limit) == (result, False)
    if cut and limit > len(truncation_marker(len(text))):  # room for the marker and some text: marked
        kept = result.rindex("\n[… truncated: ")
        assert kept > 0
        assert result == text[:kept] + truncation_marker(len(text) - kept)


def test_limit_jsonable_cuts_big_values_to_marked_text() -> None:
    small = {"rows": [1, 2, 3]}
    assert limit_jsonable(small, 100) == (small, False)
    assert limit_jsonable(small, 100)[0] is small
    big = {"rows": list(range(1000))}
    value, cut = limit_jsonable(big, 200)
    assert cut
    assert isinstance(value, str)
    assert len(value) <= 200
    assert value.startswith('{"rows":[0,1,2,')
    assert "more characters]" in value
    assert limit_jsonable("y" * 50, 10)[0] == "y" * 10
    assert limit_jsonable(b"bytes", 100) == (b"bytes", False)


@given(JSON, LIMITS)
def test_limit_jsonable_properties(value: Any, limit: int) -> None:
    result, cut = limit_jsonable(value, limit)
    if not cut:
        assert result is value
    size = len(result) if isinstance(result, str) else len(json_text(result))
    assert size <= limit
    assert limit_jsonable(result, limit) == (result, False)


def conversation(answer: str, tool_result: Any, prompt: str) -> list[ModelMessage]:
    return [
        ModelRequest(parts=[SystemPromptPart("Be brief. " * 50), UserPromptPart(prompt)]),
        ModelResponse(parts=[TextPart("let me look"), ToolCallPart("lookup", {"q": "x" * 500}, tool_call_id="c1")]),
        ModelRequest(parts=[ToolReturnPart("lookup", tool_result, tool_call_id="c1")]),
        ModelResponse(parts=[TextPart(answer)]),
    ]


def test_limit_messages_cuts_answers_tool_results_and_prompts() -> None:
    rows = {"rows": [{"id": i, "name": f"row {i}"} for i in range(500)]}
    messages = conversation("z" * 5000, rows, "q" * 300)
    limited, cut = limit_messages(messages, 200)
    assert cut == 3
    prompt = limited[0].parts[1]
    result = limited[2].parts[0]
    answer = limited[3].parts[0]
    assert isinstance(prompt, UserPromptPart) and isinstance(prompt.content, str)
    assert isinstance(result, ToolReturnPart) and isinstance(result.content, str)
    assert isinstance(answer, TextPart)
    assert len(prompt.content) <= 200 and len(answer.content) <= 200 and len(result.content) <= 200
    assert result.content.startswith('{"rows":[{"id":0,"name":"row 0"}')
    assert result.tool_call_id == "c1" and result.tool_name == "lookup"
    # untouched: the system prompt (not ours to cut), tool call args, and a message with nothing to cut
    assert limited[0].parts[0] is messages[0].parts[0]
    assert limited[1] is messages[1]
    # the result is still a valid history
    dumped = ModelMessagesTypeAdapter.dump_json(limited)
    assert ModelMessagesTypeAdapter.validate_json(dumped) == limited
    assert len(json.loads(dumped)) == 4
    assert limit_messages(limited, 200) == (limited, 0)


def test_limit_messages_cuts_text_items_of_a_multipart_prompt() -> None:
    messages: list[ModelMessage] = [ModelRequest(parts=[UserPromptPart(["a" * 50, "b" * 500])])]
    limited, cut = limit_messages(messages, 100)
    part = limited[0].parts[0]
    assert cut == 1
    assert isinstance(part, UserPromptPart) and not isinstance(part.content, str)
    assert part.content[0] == "a" * 50
    assert isinstance(part.content[1], str) and len(part.content[1]) <= 100


def limited_size(part: object) -> int | None:
    """The size `limit_messages` holds to its limit, for the parts it limits."""
    if isinstance(part, TextPart):
        return len(part.content)
    if isinstance(part, UserPromptPart) and isinstance(part.content, str):
        return len(part.content)
    if isinstance(part, ToolReturnPart):
        return len(part.content) if isinstance(part.content, str) else len(part.model_response_str())
    return None


@given(TEXTS, JSON | TEXTS, TEXTS, LIMITS)
def test_limit_messages_properties(answer: str, tool_result: Any, prompt: str, limit: int) -> None:
    messages = conversation(answer, tool_result, prompt)
    limited, cut = limit_messages(messages, limit)
    over = 0
    for before, after in zip(messages, limited, strict=True):
        for old, new in zip(before.parts, after.parts, strict=True):
            size = limited_size(old)
            if size is not None and size > limit:
                over += 1
                assert (limited_size(new) or 0) <= limit
            else:
                assert new is old
    assert cut == over
    assert limit_messages(limited, limit) == (limited, 0)
