"""Fallback chains and the fleet limit as config (what is refused), the history budget of a chain (every
model that may answer fits), what falls back, and how a run says which model answered."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from pydantic_ai import Agent
from pydantic_ai.exceptions import (
    FallbackExceptionGroup,
    ModelConnectionError,
    ModelHTTPError,
    ModelQuotaExceededError,
)
from pydantic_ai.messages import ModelMessage
from pydantic_ai.models.fallback import FallbackModel
from pydantic_ai.models.function import AgentInfo, FunctionModel

from threadline.pipeline import events
from threadline.pipeline.budget import ModelLimits, answering_limits
from threadline.pipeline.config import AgentConfig, ModelSpec, parse_agent_config
from threadline.pipeline.contracts import parse_turn_request
from threadline.pipeline.errors import InvalidRequest
from threadline.pipeline.invoke import (
    InvokeOutcome,
    answered_by,
    deciding_error,
    falls_back,
    invoke_decision,
    is_transient,
    model_error_code,
)
from threadline.pipeline.resolve import resolve_turn


def config(model: str) -> AgentConfig:
    return parse_agent_config(f"id: bot\nmodel: {model}\n")


# --- config ---------------------------------------------------------------------------------------


def test_fallback_entries_are_model_specs_shorthand_too() -> None:
    spec = config("{provider: offline, name: chat, max_concurrency: 2, fallback: "
                  "[offline:echo, {provider: offline, name: summary, context_window: 900}]}").model
    assert [(m.provider, m.name) for m in spec.chain()] == [("offline", "chat"), ("offline", "echo"),
                                                             ("offline", "summary")]
    assert spec.max_concurrency == 2 and spec.fallback[1].context_window == 900
    assert config("offline:chat").model.chain() == [config("offline:chat").model]


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ("{provider: offline, name: chat, fallback: [{provider: offline, name: echo, fallback: [offline:chat]}]}",
         "no fallback of its own"),
        ("{provider: offline, name: chat, fallback: [{provider: offline, name: echo, max_concurrency: 1}]}",
         "max_concurrency is the agent's"),
        ("{provider: offline, name: chat, fallback: [offline:a, offline:b, offline:c, offline:d]}", "at most 3"),
        ("{provider: offline, name: chat, fallback: [echo]}", "provider:name"),
        ("{provider: offline, name: chat, max_concurrency: 0}", "greater than or equal to 1"),
        ("{provider: offline, name: chat, max_concurrency: many}", "max_concurrency"),
        ("{provider: offline, name: chat, fallback: [{provider: openai, name: gpt, api_key: hunter2-Zq9xW4}]}",
         "model.fallback[0].api_key is named like a credential"),
    ],
)
def test_refused_fallbacks_and_limits(model: str, message: str) -> None:
    with pytest.raises(InvalidRequest) as raised:
        config(model)
    assert message in raised.value.message
    assert "hunter2" not in raised.value.message


# --- the budget of a chain ------------------------------------------------------------------------


def test_the_history_budget_fits_every_model_that_may_answer() -> None:
    spec = ModelSpec.model_validate({"provider": "offline", "name": "chat", "context_window": 32000,
                                     "max_output_tokens": 2000, "fallback": [
                                         {"provider": "offline", "name": "echo", "context_window": 8000,
                                          "max_output_tokens": 4000},
                                         {"provider": "offline", "name": "summary", "context_window": 16000,
                                          "max_output_tokens": 500}]})
    assert answering_limits(spec) == ModelLimits(context_window=8000, max_output=500)
    alone = spec.model_copy(update={"fallback": []})
    assert answering_limits(alone) == ModelLimits(context_window=32000, max_output=2000)


def test_every_model_of_the_chain_is_asked_for_no_more_than_the_smallest_answer() -> None:
    doc = ("id: bot\nmodel: {provider: offline, name: chat, max_output_tokens: 2000, "
           "fallback: [{provider: offline, name: echo, max_output_tokens: 300}]}\n")
    request = parse_turn_request({"schema": "threadline.turn/v1", "tenant_id": "t", "app_id": "a", "user_id": "u",
                                  "agent_id": "bot", "query": "hi"}, fallback_turn_id="t1", max_query_chars=100)
    resolved, _ = resolve_turn(request, conversation=None, config=parse_agent_config(doc), config_ref="v1",
                               new_conversation_id="c1", now=0.0)
    assert resolved.config.settings["max_tokens"] == 300


# --- what falls back ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("error", "transient"),
    [
        (ModelHTTPError(429, "m"), True),
        (ModelHTTPError(503, "m"), True),
        (ModelHTTPError(500, "m"), True),
        (ModelConnectionError("m", "refused"), True),
        (ModelHTTPError(400, "m"), False),
        (ModelHTTPError(401, "m"), False),
        (ValueError("a bug"), False),
    ],
)
def test_a_chain_moves_on_exactly_where_threadline_would_retry(error: Exception, transient: bool) -> None:
    assert is_transient(error) is transient
    assert model_error_code(error)[1] is transient


def test_an_exhausted_quota_is_not_retried_but_falls_back() -> None:
    quota = ModelQuotaExceededError("m", "You exceeded your current quota")
    assert model_error_code(quota) == ("model_quota_exceeded", False)
    assert not is_transient(quota) and falls_back(quota)
    assert falls_back(ModelHTTPError(429, "m")) and not falls_back(ModelHTTPError(400, "m"))
    chain = FallbackModel(quota_exhausted("primary"), answering("second"), fallback_on=falls_back)
    assert run(chain) == ("second", ["primary"])


def test_a_chain_that_failed_as_a_whole_is_classified_by_its_first_transient_error() -> None:
    group = FallbackExceptionGroup("all failed", [ModelHTTPError(400, "a"), ModelHTTPError(429, "b")])
    assert model_error_code(deciding_error(group)) == ("model_rate_limited", True)
    permanent = FallbackExceptionGroup("all failed", [ModelHTTPError(400, "a"), ModelHTTPError(404, "b")])
    assert deciding_error(permanent) is permanent.exceptions[0]
    assert not is_transient(permanent)


# --- which model answered -------------------------------------------------------------------------


def failing(status: int, name: str) -> FunctionModel:
    async def stream(messages: list[ModelMessage], info: AgentInfo) -> AsyncIterator[str]:
        raise ModelHTTPError(status, name)
        yield ""  # pragma: no cover - makes this an async generator

    return FunctionModel(stream_function=stream, model_name=name)


def quota_exhausted(name: str) -> FunctionModel:
    async def stream(messages: list[ModelMessage], info: AgentInfo) -> AsyncIterator[str]:
        raise ModelQuotaExceededError(name, "You exceeded your current quota")
        yield ""  # pragma: no cover - makes this an async generator

    return FunctionModel(stream_function=stream, model_name=name)


def answering(name: str) -> FunctionModel:
    async def stream(messages: list[ModelMessage], info: AgentInfo) -> AsyncIterator[str]:
        yield f"{name} here"

    return FunctionModel(stream_function=stream, model_name=name)


def run(model: FallbackModel) -> tuple[str | None, list[str]]:
    async def streamed(ctx: Any, stream: Any) -> None:
        async for _ in stream:
            pass

    agent: Agent[None, str] = Agent(model)
    try:
        result = asyncio.run(agent.run("hi", event_stream_handler=streamed))
    except FallbackExceptionGroup as e:
        return answered_by([], e)
    return answered_by(result.new_messages(), None)


def test_the_run_names_the_model_that_answered_and_those_it_fell_back_from() -> None:
    chain = FallbackModel(failing(503, "primary"), failing(429, "second"), answering("third"),
                          fallback_on=is_transient)
    assert run(chain) == ("third", ["primary", "second"])
    assert run(FallbackModel(answering("primary"), answering("second"), fallback_on=is_transient)) == ("primary", [])
    exhausted = FallbackModel(failing(503, "primary"), failing(503, "second"), fallback_on=is_transient)
    assert run(exhausted) == (None, ["primary", "second"])


def test_the_decision_record_and_the_terminal_event_say_it() -> None:
    outcome = InvokeOutcome(status="succeeded", answer="hi", model="third", fallback_from=["primary"],
                            truncated_parts=1)
    assert invoke_decision(outcome, limit_wait_s=0.25) == {"model": "third", "fallback_from": ["primary"],
                                                            "limit_wait_ms": 250.0, "truncated_parts": 1}
    assert invoke_decision(InvokeOutcome(status="failed")) is None
    terminal = events.terminal("t1", 1, "succeeded", answer="hi", model="third")
    decoded = events.decode(json.dumps({**json.loads(events.encode(terminal)), "seq": 3}))
    assert isinstance(decoded, events.Succeeded) and decoded.model == "third"
    paused = events.terminal("t1", 1, "paused", model="third", pending_tool_calls=[{"tool_call_id": "c"}])
    assert isinstance(paused, events.Paused) and paused.model == "third"
    old = events.decode('{"type": "succeeded", "turn_id": "t1", "seq": 2}')  # written before the field existed
    assert isinstance(old, events.Succeeded) and old.model is None
