"""Real turns through the real worker processes against a strict OpenAI-compatible server: with
`strict_system` every request carries exactly one leading system message and paired tool calls;
without it, the same conversations are refused the way vLLM/Qwen refuses them."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
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

from tests.conftest import AgentFactory, WorkerPool, turn
from tests.support.strict_server import (
    BLANK_SYSTEM,
    NO_USER,
    ORPHAN_TOOL,
    SYSTEM_NOT_FIRST,
    StrictChatServer,
    message_text,
    template_error,
)
from threadline.pipeline import events as ev
from threadline.workers.clients.client import Client

pytestmark = pytest.mark.integration

INSTRUCTIONS = "You help Ada with her orders."
STORED_SYSTEM = ["You are the support bot of Acme.", "The customer is Ada; she prefers short answers."]
IMPORTED_CALL_ID = "imported-call-1"
IMPORTED_RESULT = "2024-05-01T12:00:00+00:00"


@pytest.fixture
def strict_server() -> Iterator[StrictChatServer]:
    with StrictChatServer() as server:
        yield server


def _post(server: StrictChatServer, body: dict[str, Any]) -> tuple[int, bytes]:
    request = urllib.request.Request(f"{server.base_url}/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _system_messages(body: dict[str, Any]) -> list[tuple[int, str]]:
    return [(i, message_text(m)) for i, m in enumerate(body["messages"]) if m["role"] == "system"]


def _assert_tool_results_follow_their_calls(body: dict[str, Any]) -> None:
    """Each tool message answers a call made by an assistant message since the last user message."""
    open_calls: set[str] = set()
    for message in body["messages"]:
        if message["role"] == "assistant":
            open_calls = {call["id"] for call in message.get("tool_calls") or []}
        elif message["role"] == "tool":
            assert message["tool_call_id"] in open_calls, body["messages"]
            open_calls.discard(message["tool_call_id"])
        else:
            open_calls = set()


# --- the double refuses what strict templates refuse -----------------------------------------------

_USER = {"role": "user", "content": "hi"}
_SYSTEM = {"role": "system", "content": "be brief"}
_CALL = {"role": "assistant", "content": None,
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "clock", "arguments": "{}"}}]}


@pytest.mark.parametrize(
    ("messages", "error"),
    [
        ([_SYSTEM, _USER], None),
        ([_USER], None),
        ([_SYSTEM, _USER, _CALL, {"role": "tool", "tool_call_id": "c1", "content": "noon"}], None),
        ([_USER, _SYSTEM], SYSTEM_NOT_FIRST),
        ([_SYSTEM, _SYSTEM, _USER], SYSTEM_NOT_FIRST),
        ([{"role": "system", "content": " \n"}, _USER], BLANK_SYSTEM),
        ([{"role": "system", "content": [{"type": "text", "text": ""}]}, _USER], BLANK_SYSTEM),
        ([_SYSTEM], NO_USER),
        ([_SYSTEM, _USER, {"role": "tool", "tool_call_id": "c1", "content": "noon"}], ORPHAN_TOOL),
        ([_SYSTEM, _USER, _CALL, {"role": "tool", "tool_call_id": "c2", "content": "noon"}], ORPHAN_TOOL),
    ],
    ids=["system-first", "no-system", "paired-tool", "system-last", "two-systems", "blank-system",
         "blank-system-parts", "no-user", "orphan-tool", "wrong-tool-id"],
)
def test_the_double_refuses_what_a_strict_template_refuses(messages: list[dict[str, Any]],
                                                           error: str | None) -> None:
    assert template_error(messages) == error


def test_the_double_answers_over_http_and_records_every_request(strict_server: StrictChatServer) -> None:
    tools = [{"type": "function", "function": {"name": "clock", "parameters": {"type": "object"}}}]
    refused = {"model": "qwen3.6", "messages": [_USER, _SYSTEM]}
    call = {"model": "qwen3.6", "messages": [_SYSTEM, _USER], "tools": tools}

    status, body = _post(strict_server, refused)
    assert status == 400 and json.loads(body)["error"]["message"] == SYSTEM_NOT_FIRST
    status, body = _post(strict_server, call)
    assert status == 200
    message = json.loads(body)["choices"][0]["message"]
    assert message["tool_calls"][0]["function"]["name"] == "clock"
    answer = {"model": "qwen3.6", "stream": True, "tools": tools, "messages": [
        _SYSTEM, _USER, {"role": "assistant", "content": None, "tool_calls": message["tool_calls"]},
        {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": "noon"}]}
    status, body = _post(strict_server, answer)
    assert status == 200
    events = [line.removeprefix("data: ") for line in body.decode().splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in map(json.loads, events[:-1])
                   if c["choices"])
    assert text == "The tool said: noon"
    assert strict_server.requests == [refused, call, answer]


# --- real turns -----------------------------------------------------------------------------------


def _import_history(client: Client, agent: str) -> str:
    """A conversation migrated from elsewhere: system prompts stored in several requests (one of them
    blank), and a finished tool call. Returns its id."""
    first: list[ModelMessage] = [
        ModelRequest(parts=[SystemPromptPart(STORED_SYSTEM[0]), UserPromptPart("hello")]),
        ModelResponse(parts=[TextPart("Hi Ada, how can I help?")], model_name="qwen3.6"),
    ]
    second: list[ModelMessage] = [
        ModelRequest(parts=[SystemPromptPart(STORED_SYSTEM[1]), SystemPromptPart("  \n"),
                            UserPromptPart("what time is it?")]),
        ModelResponse(parts=[ToolCallPart("clock", {}, tool_call_id=IMPORTED_CALL_ID)], model_name="qwen3.6"),
        ModelRequest(parts=[ToolReturnPart("clock", IMPORTED_RESULT, tool_call_id=IMPORTED_CALL_ID)]),
        ModelResponse(parts=[TextPart("It is noon.")], model_name="qwen3.6"),
    ]
    conversation_id = f"c-imported-{uuid.uuid4().hex[:10]}"
    client.import_conversation(
        conversation_id=conversation_id, tenant_id="t1", app_id="app", user_id="u1", agent_id=agent,
        turns=[("hello", "Hi Ada, how can I help?", first), ("what time is it?", "It is noon.", second)],
    )
    return conversation_id


def test_a_tool_calling_turn_sends_one_leading_system_message_on_every_request(
    workers: WorkerPool, client: Client, make_agent: AgentFactory, strict_server: StrictChatServer
) -> None:
    agent = make_agent(strict_server.model_config(strict_system=True), instructions=INSTRUCTIONS,
                       tools=["clock"])
    turn_id = client.submit(turn(agent, "What time is it?"))
    terminal = client.wait(turn_id, timeout_s=30)

    assert isinstance(terminal, ev.Succeeded), terminal
    sent = strict_server.requests
    assert len(sent) >= 2
    for body in sent:
        assert _system_messages(body) == [(0, INSTRUCTIONS)], body["messages"]
        _assert_tool_results_follow_their_calls(body)
    # the second request carries the clock's answer, and the final answer quotes it
    result = next(message_text(m) for m in sent[-1]["messages"] if m["role"] == "tool")
    assert terminal.answer == f"The tool said: {result}"
    assert terminal.usage.input_tokens == 20 and terminal.usage.requests == 2  # the server's usage, twice
    kinds = [e.type for e in client.events(turn_id)]
    assert kinds.index("tool_call") < kinds.index("tool_result") < kinds.index("succeeded")


def test_the_turn_after_a_tool_calling_turn_keeps_one_leading_system_message(
    workers: WorkerPool, client: Client, make_agent: AgentFactory, strict_server: StrictChatServer
) -> None:
    agent = make_agent(strict_server.model_config(strict_system=True), instructions=INSTRUCTIONS,
                       tools=["clock"])
    first = client.wait(client.submit(turn(agent, "What time is it?")), timeout_s=30)
    assert isinstance(first, ev.Succeeded), first
    before = len(strict_server.requests)

    second = client.wait(client.submit(turn(agent, "And now?", conversation_id=first.conversation_id)),
                         timeout_s=30)

    assert isinstance(second, ev.Succeeded), second
    sent = strict_server.requests[before:]
    assert len(sent) == 2
    for body in sent:
        assert _system_messages(body) == [(0, INSTRUCTIONS)]
        _assert_tool_results_follow_their_calls(body)
    # the stored first turn (its call and result) is replayed ahead of the new question
    roles = [m["role"] for m in sent[0]["messages"]]
    assert roles == ["system", "user", "assistant", "tool", "assistant", "user"]


def test_a_paused_question_resumes_with_its_call_and_answer_in_place(
    workers: WorkerPool, client: Client, make_agent: AgentFactory
) -> None:
    with StrictChatServer(tool_arguments=json.dumps({"question": "Which colour?"})) as server:
        agent = make_agent(server.model_config(strict_system=True), instructions=INSTRUCTIONS,
                           tools=["ask_human"])
        paused = client.wait(client.submit(turn(agent, "Paint my room.")), timeout_s=30)
        assert isinstance(paused, ev.Paused), paused
        assert paused.answer == "Which colour?"
        (pending,) = paused.pending_tool_calls

        resume = {**turn(agent, "", conversation_id=paused.conversation_id),
                  "deferred_tool_results": {"calls": {pending["tool_call_id"]: "blue"}}}
        resumed = client.wait(client.submit(resume), timeout_s=30)

    assert isinstance(resumed, ev.Succeeded), resumed
    assert resumed.answer == "The tool said: blue"
    sent = server.requests
    assert len(sent) == 2
    for body in sent:
        assert _system_messages(body) == [(0, INSTRUCTIONS)]
        _assert_tool_results_follow_their_calls(body)
    # the question is answered by the human's reply, not closed as interrupted
    assert [(m["role"], message_text(m)) for m in sent[1]["messages"][-2:]] == [("assistant", ""),
                                                                                 ("tool", "blue")]


@pytest.mark.parametrize("tools", [[], ["clock"]], ids=["answer", "tool-call"])
def test_an_imported_conversation_with_scattered_system_prompts_continues(
    workers: WorkerPool, client: Client, make_agent: AgentFactory, strict_server: StrictChatServer,
    tools: list[str],
) -> None:
    agent = make_agent(strict_server.model_config(strict_system=True), instructions=INSTRUCTIONS,
                       tools=tools)
    conversation_id = _import_history(client, agent)

    terminal = client.wait(client.submit(turn(agent, "and my order?", conversation_id=conversation_id)),
                           timeout_s=30)

    assert isinstance(terminal, ev.Succeeded), terminal
    assert terminal.conversation_id == conversation_id
    sent = strict_server.requests
    assert len(sent) == (2 if tools else 1)
    for body in sent:
        assert _system_messages(body) == [(0, "\n\n".join([*STORED_SYSTEM, INSTRUCTIONS]))]
        _assert_tool_results_follow_their_calls(body)
    roles = [m["role"] for m in sent[0]["messages"]]
    assert roles == ["system", "user", "assistant", "user", "assistant", "tool", "assistant", "user"]
    imported = sent[0]["messages"][4:6]
    assert [call["id"] for call in imported[0]["tool_calls"]] == [IMPORTED_CALL_ID]
    assert (imported[1]["tool_call_id"], message_text(imported[1])) == (IMPORTED_CALL_ID, IMPORTED_RESULT)
    assert [message_text(m) for m in sent[0]["messages"] if m["role"] == "user"] == [
        "hello", "what time is it?", "and my order?"]
    # and the turn was stored: the conversation goes on from it
    assert [m.query for m in client.thread(conversation_id)] == ["hello", "what time is it?", "and my order?"]


@pytest.mark.parametrize("tools", [[], ["clock"]], ids=["answer", "tool-call"])
def test_without_strict_system_the_same_turn_is_refused(
    workers: WorkerPool, client: Client, make_agent: AgentFactory, strict_server: StrictChatServer,
    tools: list[str],
) -> None:
    agent = make_agent(strict_server.model_config(strict_system=False), instructions=INSTRUCTIONS,
                       tools=tools)
    conversation_id = _import_history(client, agent)

    terminal = client.wait(client.submit(turn(agent, "and my order?", conversation_id=conversation_id)),
                           timeout_s=30)

    assert isinstance(terminal, ev.Failed) and terminal.code == "model_bad_request", terminal
    assert SYSTEM_NOT_FIRST in terminal.message
    assert [(e.status, e.error) for e in strict_server.exchanges] == [(400, SYSTEM_NOT_FIRST)]
    # the map stage merged the stored prompts; the run instructions went out as a second message
    assert _system_messages(strict_server.requests[0]) == [(0, "\n\n".join(STORED_SYSTEM)), (1, INSTRUCTIONS)]


def test_without_strict_system_a_fresh_tool_calling_turn_still_passes(
    workers: WorkerPool, client: Client, make_agent: AgentFactory, strict_server: StrictChatServer
) -> None:
    """The server refuses what strict templates refuse, not every non-strict request: with no stored
    system prompts, the run instructions alone are already one leading system message."""
    agent = make_agent(strict_server.model_config(strict_system=False), instructions=INSTRUCTIONS,
                       tools=["clock"])
    terminal = client.wait(client.submit(turn(agent, "What time is it?")), timeout_s=30)

    assert isinstance(terminal, ev.Succeeded), terminal
    assert [e.status for e in strict_server.exchanges] == [200, 200]
