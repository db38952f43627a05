"""The turn request's size and shape limits, enforced in `parse_turn_request` for every producer:
inputs, context, deferred answers and files counted like the query, and JSON nesting bounded before
anything parses it."""

from __future__ import annotations

import json
from typing import Any

import pytest

from threadline.pipeline.contracts import MAX_JSON_DEPTH, inputs_chars, json_too_deep, parse_turn_request
from threadline.pipeline.errors import InvalidRequest


def request(**fields: Any) -> dict[str, Any]:
    return {"schema": "threadline.turn/v1", "tenant_id": "t", "app_id": "a", "user_id": "u", "agent_id": "bot",
            "query": "hello", **fields}


def parse(raw: object, **limits: int) -> Any:
    return parse_turn_request(raw, fallback_turn_id="msg-1", max_query_chars=100, **limits)


@pytest.mark.parametrize(("fields", "limits", "message"), [
    ({"inputs": {"name": "x" * 10}}, {"max_inputs_chars": 13}, "inputs is 14 characters; the limit is 13"),
    ({"context": "x" * 51}, {"max_context_chars": 50}, "context is 51 characters; the limit is 50"),
    ({"conversation_id": "c1", "query": "", "deferred_tool_results": {"calls": {"c": "x" * 60}}},
     {"max_context_chars": 50}, "deferred_tool_results is"),
    ({"files": [{"url": f"https://f/{i}"} for i in range(3)]}, {"max_files": 2}, "3 files; the limit is 2"),
    ({"files": [{"url": "https://f/1", "mime": "x" * 256}]}, {}, "mime"),
])
def test_sizes_over_their_limits_are_invalid(fields: dict[str, Any], limits: dict[str, int], message: str) -> None:
    with pytest.raises(InvalidRequest, match=message):
        parse(request(**fields), **limits)


def test_sizes_at_their_limits_pass() -> None:
    parsed = parse(request(inputs={"name": "x" * 9}, context="c" * 50, files=[{"url": "https://f/1"}] * 2),
                   max_inputs_chars=13, max_context_chars=50, max_files=2)
    assert inputs_chars(parsed.inputs) == 13 and len(parsed.files) == 2


def test_inputs_count_names_and_values_as_text() -> None:
    assert inputs_chars({"ab": "cde", "n": 12345, "flag": True}) == 5 + 6 + 8


def test_eight_megabytes_of_inputs_are_refused_by_the_default_limit() -> None:
    with pytest.raises(InvalidRequest, match="inputs is"):
        parse(request(inputs={f"k{i}": "x" * 8_000 for i in range(1_000)}))


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 100_000])
def test_json_nesting_is_bounded_before_parsing(depth: int) -> None:
    deep = "[" * depth + "]" * depth
    text = json.dumps(request(inputs={"x": "@@"})).replace('"@@"', deep)
    assert json_too_deep(text)
    with pytest.raises(InvalidRequest, match=f"deeper than {MAX_JSON_DEPTH}"):
        parse(text)
    with pytest.raises(InvalidRequest, match=f"deeper than {MAX_JSON_DEPTH}"):
        parse(request(deferred_tool_results={"calls": {"c": json.loads("[" * 40 + "]" * 40)}}, conversation_id="c1",
                      query=""))


def test_brackets_inside_strings_are_not_nesting() -> None:
    inside = json.dumps({"q": "[" * 1000 + '\\" {{{'})
    assert not json_too_deep(inside)
    assert not json_too_deep("[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH)
    assert json_too_deep("[" * (MAX_JSON_DEPTH + 1))
