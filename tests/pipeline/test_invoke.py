"""The model stage's run and persist preparation with real pydantic-ai runs (FunctionModel/TestModel)
and an in-memory event sink; no Redis."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from pydantic_ai import CancellationToken, models
from pydantic_ai.exceptions import ModelHTTPError
from pydantic_ai.messages import (
    ModelMessage,
    ModelRequest,
    ModelResponse,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
    UserPromptPart,
)
from pydantic_ai.models import Model
from pydantic_ai.models.function import AgentInfo, DeltaToolCall, FunctionModel
from pydantic_ai.models.test import TestModel

from threadline.pipeline import events
from threadline.pipeline.config import AgentConfig, ModelSpec
from threadline.pipeline.errors import ThreadlineError
from threadline.pipeline.history import decode_messages
from threadline.pipeline.invoke import (
    InvokeOutcome,
    TurnAgent,
    build_agent,
    model_error_code,
    retry_delay_s,
    run_turn,
)
from threadline.pipeline.limits import truncate_text, truncation_marker
from threadline.pipeline.llm import StrictSystemModel, chat_answer, profile_for
from threadline.pipeline.mapping import normalise_messages
from threadline.pipeline.persist import prepare_snapshot, run_answer
from threadline.pipeline.records import ResolvedTurn
from threadline.pipeline.streaming import RunEvents, TextDebouncer
from threadline.workers.worker.providers import build_model, build_tools
from threadline.workers.worker.stream import TurnStream

models.ALLOW_MODEL_REQUESTS = False


def resolved(**config: Any) -> ResolvedTurn:
    cfg = AgentConfig.model_validate({"id": "bot", "model": "offline:echo", **config})
    return ResolvedTurn(turn_id="t1", conversation_id="c1", message_id="t1", parent_message_id=None,
                        new_conversation=True, config_ref="v1", config=cfg, instructions="SECRET INSTRUCTIONS",
                        query="hello", deadline_s=30, accepted_at=0, tenant_id="t", app_id="a", user_id="u")


async def run_with(agent: TurnAgent, turn: ResolvedTurn, *, history: list[ModelMessage] | None = None,
                   token: CancellationToken | None = None, timeout_s: float = 10, max_chars: int = 100_000,
                   secrets: tuple[str, ...] = (), debounce_s: float = 0.01,
                   cancel_at_delta: int | None = None) -> tuple[InvokeOutcome, list[events.Event]]:
    """One run as the model stage does it: a `TurnStream` writing to an in-memory sink. With
    `cancel_at_delta`, `token` is cancelled once that many text deltas were written: a moment of the
    run itself, the same on a loaded machine as on an idle one."""
    sink: list[events.Event] = []

    async def emit(event: events.Event) -> None:
        sink.append(event)
        if token is not None and cancel_at_delta is not None and isinstance(event, events.TextDelta) \
                and len([e for e in sink if isinstance(e, events.TextDelta)]) == cancel_at_delta:
            token.cancel()

    translator = RunEvents(turn.turn_id, 1, TextDebouncer(window_s=debounce_s), tool_payload_chars=100_000)
    async with TurnStream(translator, emit, time.monotonic) as stream:
        outcome = await run_turn(turn, history or [], agent=agent, attempt=1, stream=stream,
                                 token=token or CancellationToken(), clock=lambda: 0.0, timeout_s=timeout_s,
                                 max_chars=max_chars, secrets=secrets)
    return outcome, sink


async def run(model: Model, turn: ResolvedTurn | None = None, *, cancel_at_delta: int | None = None,
              timeout_s: float = 10, history: list[ModelMessage] | None = None, max_chars: int = 100_000,
              secrets: tuple[str, ...] = (), debounce_s: float = 0.01) -> tuple[InvokeOutcome, list[events.Event]]:
    turn = turn or resolved()
    agent = build_agent(model, build_tools(turn.config.tools, allow_python=False))
    return await run_with(agent, turn, history=history, token=CancellationToken(), timeout_s=timeout_s,
                          max_chars=max_chars, secrets=secrets, debounce_s=debounce_s, cancel_at_delta=cancel_at_delta)


def words_model(n: int, delay: float) -> FunctionModel:
    async def stream(messages: list[ModelMessage], info: AgentInfo) -> AsyncIterator[str]:
        for i in range(n):
            yield f"w{i} "
            await asyncio.sleep(delay)

    return FunctionModel(stream_function=stream)


def both(respond: Any) -> FunctionModel:
    """A FunctionModel that answers `respond` whether the run streams (it does, with an event
    stream handler) or not."""

    async def stream(messages: list[ModelMessage], info: AgentInfo) -> AsyncIterator[Any]:
        for i, part in enumerate(respond(messages, info).parts):
            if isinstance(part, ToolCallPart):
                yield {i: DeltaToolCall(name=part.tool_name, json_args=part.args_as_json_str(),
                                        tool_call_id=part.tool_call_id)}
            else:
                yield part.content

    return FunctionModel(respond, stream_function=stream)


def text_of(sink: list[events.Event]) -> str:
    return "".join(e.text for e in sink if isinstance(e, events.TextDelta))


def test_debouncer_sends_the_first_text_at_once_then_flushes_on_window_and_size() -> None:
    d = TextDebouncer(window_s=0.1, max_chars=10)
    assert d.add("first", now=0.0) == "first"
    assert d.add("abc", now=0.0) is None and not d.due(0.05) and d.due(0.1)
    assert d.wait_s(0.04) == pytest.approx(0.06)
    assert d.add("defghijk", now=0.06) == "abcdefghijk"  # the size cap flushes at once
    assert d.flush() is None and d.wait_s(1.0) is None


async def test_success_streams_and_stores_no_instructions() -> None:
    # a debounce window longer than the whole stream takes on any machine: the first word goes out at
    # once, the rest together (a window shorter than a loaded machine's gaps would send every word)
    outcome, sink = await run(words_model(20, 0.001), debounce_s=30)
    assert outcome.status == "succeeded" and text_of(sink) == outcome.answer
    assert len([e for e in sink if isinstance(e, events.TextDelta)]) < 20  # debounced
    assert all(e.turn_id == "t1" and e.attempt == 1 for e in sink)
    stored = decode_messages(outcome.snapshot or "", where="test")
    assert all(m.instructions is None for m in stored if isinstance(m, ModelRequest))
    assert "SECRET INSTRUCTIONS" not in (outcome.snapshot or "")


async def test_cancel_keeps_the_streamed_text_as_the_answer() -> None:
    outcome, sink = await run(words_model(200, 0.01), cancel_at_delta=2)
    assert (outcome.status, outcome.code) == ("cancelled", "cancelled")
    assert outcome.answer and text_of(sink) == outcome.answer
    stored = decode_messages(outcome.snapshot or "", where="test")
    assert isinstance(stored[-1], ModelResponse) and stored[-1].state == "interrupted"


async def test_deadline_is_timed_out() -> None:
    outcome, _ = await run(words_model(200, 0.01), timeout_s=0.1)
    assert (outcome.status, outcome.code) == ("timed_out", "timed_out")


@pytest.mark.parametrize(("status", "code", "transient"), [(429, "model_rate_limited", True),
                                                           (503, "model_unavailable", True),
                                                           (400, "model_bad_request", False)])
async def test_model_errors_map_to_stable_codes(status: int, code: str, transient: bool) -> None:
    def fail(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        raise ModelHTTPError(status_code=status, model_name="x")

    async def fail_stream(messages: list[ModelMessage], info: AgentInfo) -> AsyncIterator[str]:
        raise ModelHTTPError(status_code=status, model_name="x")
        yield ""

    outcome, _ = await run(FunctionModel(fail, stream_function=fail_stream))
    assert (outcome.status, outcome.code, outcome.transient) == ("failed", code, transient)
    assert model_error_code(ModelHTTPError(status_code=status, model_name="x")) == (code, transient)


async def test_tool_loop_emits_tool_events_and_records_activity() -> None:
    outcome, sink = await run(TestModel(call_tools=["clock"]), resolved(tools=["clock"]))
    kinds = [e.type for e in sink]
    assert kinds.index("tool_call") < kinds.index("tool_result")
    call = next(e for e in sink if isinstance(e, events.ToolCall))
    result = next(e for e in sink if isinstance(e, events.ToolResult))
    assert (call.name, result.name, result.outcome) == ("clock", "clock", "success")
    assert result.tool_call_id == call.tool_call_id and isinstance(call.args, dict)
    assert [(t.name, t.outcome) for t in outcome.tools] == [("clock", "success")]
    assert outcome.usage.requests == 2


async def test_ask_human_pauses_with_the_question_as_answer() -> None:
    def ask(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        return ModelResponse(parts=[ToolCallPart("ask_human", {"question": "Which size?"}, tool_call_id="q1")])

    outcome, _ = await run(both(ask), resolved(tools=["ask_human"]))
    assert outcome.status == "paused" and outcome.answer == "Which size?"
    assert outcome.pending_tool_calls == [{"tool_call_id": "q1", "name": "ask_human",
                                           "args": {"question": "Which size?"}}]
    stored = decode_messages(outcome.snapshot or "", where="test")
    assert isinstance(stored[-1], ModelResponse) and stored[-1].state == "complete"  # open for the resume

    resume = resolved(tools=["ask_human"]).model_copy(
        update={"deferred_answers": {"q1": "XL"}, "query": "", "turn_id": "t2"}
    )

    def answer(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        result = next(p for p in messages[-1].parts if isinstance(p, ToolReturnPart))
        return ModelResponse(parts=[TextPart(f"size {result.content}")])

    resumed, _ = await run(both(answer), resume, history=stored)
    assert (resumed.status, resumed.answer) == ("succeeded", "size XL")


def test_prepare_snapshot_marks_a_trailing_call_interrupted_unless_paused() -> None:
    call = ModelResponse(parts=[ToolCallPart("clock", {}, tool_call_id="x")])
    request = ModelRequest(parts=[UserPromptPart("hi")], instructions="SECRET")
    stored = prepare_snapshot([request, call], paused=False)
    assert stored is not None and stored[0].instructions is None  # type: ignore[union-attr]
    assert stored[-1].state == "interrupted"  # type: ignore[union-attr]
    assert prepare_snapshot([request, call], paused=True)[-1].state == "complete"  # type: ignore[index,union-attr]
    assert prepare_snapshot([], paused=False) is None
    assert run_answer([request, ModelResponse(parts=[TextPart("par"), TextPart("tial")])]) == "partial"


async def test_offline_echo_describes_exactly_what_it_received() -> None:
    model = build_model(AgentConfig.model_validate({"id": "b", "model": "offline:echo"}).model, env={})
    history = [ModelRequest(parts=[UserPromptPart("earlier")]), ModelResponse(parts=[TextPart("reply")])]
    outcome, _ = await run(model, resolved(tools=["clock"]), history=history)
    assert json.loads(outcome.answer) == {
        "system": "SECRET INSTRUCTIONS",
        "messages": [{"role": "user", "text": "earlier"}, {"role": "assistant", "text": "reply"},
                     {"role": "user", "text": "hello"}],
        "tools": ["clock"],
    }


def test_offline_chat_refers_to_earlier_turns() -> None:
    history = [ModelRequest(parts=[UserPromptPart("one")]), ModelResponse(parts=[TextPart("x")]),
               ModelRequest(parts=[UserPromptPart("two")])]
    answer = chat_answer(history)
    assert '"two"' in answer and '"one"' in answer and "2 messages" in answer


def test_strict_profile_is_a_flag_of_the_config() -> None:
    spec = AgentConfig.model_validate({"id": "b", "model": {"provider": "offline", "name": "echo",
                                                            "strict_system": False}}).model
    assert not profile_for(spec).single_leading_system
    assert isinstance(build_model(spec, env={}), StrictSystemModel)


def test_retry_delay_is_bounded_and_only_for_transient_failures() -> None:
    transient = InvokeOutcome(status="failed", code="model_unavailable", transient=True)
    assert [retry_delay_s(transient, attempt=a, max_attempts=9) for a in (1, 2, 3, 8)] == [0.5, 1.0, 2.0, 10.0]
    assert retry_delay_s(transient, attempt=3, max_attempts=3) is None
    asked = transient.model_copy(update={"retry_after_s": 7.0})
    assert retry_delay_s(asked, attempt=1, max_attempts=3) == 7.0
    permanent = InvokeOutcome(status="failed", code="model_bad_request")
    assert retry_delay_s(permanent, attempt=1, max_attempts=3) is None
    assert retry_delay_s(InvokeOutcome(status="cancelled"), attempt=1, max_attempts=3) is None


def broken_tool() -> str:
    """A tool with a bug."""
    raise ValueError("bug in the tool")


async def test_a_broken_tool_fails_the_turn_once_and_keeps_its_history() -> None:
    from pydantic_ai import Tool

    turn = resolved()
    agent = build_agent(TestModel(call_tools=["broken_tool"]), [Tool(broken_tool)])
    outcome, _ = await run_with(agent, turn)
    assert (outcome.status, outcome.code, outcome.transient) == ("failed", "internal_error", False)
    assert "bug in the tool" in (outcome.message or "")
    stored = decode_messages(outcome.snapshot or "", where="test")
    assert stored[-1].state == "interrupted"  # pydantic-ai marks where the run stopped
    assert any(isinstance(p, ToolCallPart) and p.tool_name == "broken_tool"
               for m in stored if isinstance(m, ModelResponse) for p in m.parts)
    # and the next turn continues from it (the map stage repairs the open call)
    history, _ = normalise_messages(stored)
    after, _ = await run_with(build_agent(TestModel()), turn.model_copy(update={"turn_id": "t2"}), history=history)
    assert after.status == "succeeded"


async def test_answers_longer_than_the_limit_are_stored_truncated_with_a_marker() -> None:
    outcome, sink = await run(words_model(200, 0), max_chars=300)
    assert outcome.status == "succeeded"
    streamed = text_of(sink)
    assert len(streamed) > 300, "what was streamed is not cut"
    assert outcome.answer == truncate_text(streamed, 300)[0]
    kept = outcome.answer[: outcome.answer.index("\n[")]
    assert streamed.startswith(kept) and outcome.answer == kept + truncation_marker(len(streamed) - len(kept))
    assert len(outcome.answer) <= 300
    stored = decode_messages(outcome.snapshot or "", where="test")
    response = next(m for m in stored if isinstance(m, ModelResponse))
    assert "".join(p.content for p in response.parts if isinstance(p, TextPart)) == outcome.answer
    assert outcome.truncated_parts >= 1


async def test_a_model_error_never_carries_the_model_key() -> None:
    key = "sk-test-0123456789abcdef0123"

    async def fail_stream(messages: list[ModelMessage], info: AgentInfo) -> AsyncIterator[str]:
        raise ModelHTTPError(status_code=400, model_name="x", body={"error": f"bad key {key} (Authorization)"})
        yield ""

    outcome, _ = await run(FunctionModel(stream_function=fail_stream), secrets=(key,))
    assert (outcome.status, outcome.code) == ("failed", "model_bad_request")
    assert outcome.message and key not in outcome.message


async def test_the_stream_writes_every_event_in_order_even_when_the_run_is_cancelled() -> None:
    """The writer task is shielded: what the translator emitted before the cancel is all written."""
    outcome, sink = await run(words_model(500, 0.002), cancel_at_delta=3)
    assert outcome.status == "cancelled"
    assert text_of(sink) == outcome.answer


def test_an_anthropic_model_without_its_extra_names_the_extra_to_install() -> None:
    spec = ModelSpec(provider="anthropic", name="claude-sonnet-5-5")
    if importlib.util.find_spec("anthropic") is not None:
        pytest.skip("the anthropic extra is installed here")
    with pytest.raises(ThreadlineError, match=r"threadline\[anthropic\]") as caught:
        build_model(spec, env={"ANTHROPIC_API_KEY": "k" * 20})
    assert caught.value.code == "provider_not_installed"
