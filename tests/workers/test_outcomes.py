"""Invoke and persist: every terminal outcome ends with exactly one terminal event and a stored
snapshot the next turn can continue from; streaming, tool events, retries, ask_human."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import redis
from pydantic_ai.messages import ModelMessagesTypeAdapter, ModelRequest, ModelResponse, ToolReturnPart
from threadline.pipeline.contracts import TERMINAL_TYPES
from threadline.workers.client import Client

from tests.conftest import ROOT, AgentFactory, WorkerPool, turn

pytestmark = pytest.mark.integration

SECRET = "INSTRUCTION-MARKER-7f3a: never store me"


def python_model(factory: str, **options: Any) -> dict[str, Any]:
    return {"provider": "python", "name": f"tests.support.models:{factory}", "options": options}


def records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def all_events(client: Client, turn_id: str) -> list[dict[str, Any]]:
    return list(client.events(turn_id))


def wait_for_event(client: Client, turn_id: str, kind: str, timeout_s: float = 20) -> dict[str, Any]:
    for event in client.events(turn_id, follow=True, timeout_s=timeout_s):
        if event["type"] == kind:
            return event
        if event["type"] in TERMINAL_TYPES:
            raise AssertionError(f"turn ended before {kind}: {event}")
    raise AssertionError(kind)


def assert_one_terminal(client: Client, turn_id: str) -> dict[str, Any]:
    events = all_events(client, turn_id)
    terminals = [e for e in events if e["type"] in TERMINAL_TYPES]
    assert len(terminals) == 1, [e["type"] for e in events]
    assert events[-1] is terminals[0]
    return terminals[0]


def stored_messages(client: Client, conversation_id: str, message_id: str) -> list[Any]:
    data = client.snapshot(conversation_id, message_id)
    assert data is not None, "no snapshot stored"
    return list(ModelMessagesTypeAdapter.validate_json(data))


def continue_with(client: Client, agent: str, conversation_id: str, query: str = "next question") -> dict[str, Any]:
    """The next turn of a conversation runs normally with a new user prompt."""
    terminal = client.wait(client.submit(turn(agent, query, conversation_id=conversation_id)), timeout_s=30)
    assert terminal["type"] == "succeeded", terminal
    return terminal


def test_tool_loop_streams_tool_events_and_stores_tool_activity(
    workers: WorkerPool, client: Client, make_agent: AgentFactory
) -> None:
    agent = make_agent(python_model("tool_then_answer", tool="clock", only_when_asked=True),
                       tools=["clock"], instructions=SECRET)
    terminal = client.wait(client.submit(turn(agent, "use the tool please")), timeout_s=30)
    assert terminal["type"] == "succeeded" and terminal["answer"].startswith("The tool said: 20")
    events = all_events(client, terminal["turn_id"])
    call = next(e for e in events if e["type"] == "tool_call")
    result = next(e for e in events if e["type"] == "tool_result")
    assert call["name"] == "clock" and result["tool_call_id"] == call["tool_call_id"]
    assert result["outcome"] == "success"
    assert events.index(call) < events.index(result) < events.index(terminal)
    row = client.thread(terminal["conversation_id"])[-1]
    assert [(t.name, t.outcome) for t in row.tools] == [("clock", "success")]
    assert row.usage.requests == 2
    continue_with(client, agent, terminal["conversation_id"])


def test_permanent_model_error_fails_once_and_the_conversation_continues(
    workers: WorkerPool, client: Client, make_agent: AgentFactory, tmp_path: Path
) -> None:
    record = tmp_path / "calls.jsonl"
    agent = make_agent(python_model("failing", status=400, times=1, record=str(record)), instructions=SECRET)
    terminal = client.wait(client.submit(turn(agent, "this will fail")), timeout_s=30)
    assert (terminal["type"], terminal["code"]) == ("failed", "model_bad_request")
    assert len(records(record)) == 1, "a permanent error is not retried"
    assert_one_terminal(client, terminal["turn_id"])
    row = client.thread(terminal["conversation_id"])[-1]
    assert (row.status, row.error_code) == ("failed", "model_bad_request")
    after = continue_with(client, agent, terminal["conversation_id"])
    assert after["answer"] == "recovered after failures"


def test_transient_model_error_is_retried_with_a_retrying_event(
    workers: WorkerPool, client: Client, make_agent: AgentFactory, tmp_path: Path
) -> None:
    record = tmp_path / "calls.jsonl"
    agent = make_agent(python_model("failing", status=503, times=1, record=str(record)))
    terminal = client.wait(client.submit(turn(agent, "flaky")), timeout_s=30)
    assert terminal["type"] == "succeeded" and terminal["attempt"] == 2
    events = all_events(client, terminal["turn_id"])
    retrying = [e for e in events if e["type"] == "retrying"]
    assert len(retrying) == 1 and "model_unavailable" in retrying[0]["reason"]
    assert len(records(record)) == 2


def test_transient_errors_give_up_after_bounded_attempts(
    workers: WorkerPool, client: Client, make_agent: AgentFactory, tmp_path: Path
) -> None:
    record = tmp_path / "calls.jsonl"
    agent = make_agent(python_model("failing", status=429, record=str(record)))
    terminal = client.wait(client.submit(turn(agent, "always limited")), timeout_s=60)
    assert (terminal["type"], terminal["code"]) == ("failed", "model_rate_limited")
    assert len(records(record)) == 3  # TL_MAX_INVOKE_ATTEMPTS
    assert_one_terminal(client, terminal["turn_id"])


def test_cancel_mid_stream_stops_the_model_and_keeps_the_partial_answer(
    workers: WorkerPool, client: Client, make_agent: AgentFactory, tmp_path: Path
) -> None:
    record = tmp_path / "calls.jsonl"
    agent = make_agent(python_model("streaming", words=400, delay_ms=10, record=str(record)), instructions=SECRET)
    turn_id = client.submit(turn(agent, "talk for a long time"))
    wait_for_event(client, turn_id, "text_delta")
    time.sleep(0.2)
    assert client.cancel(turn_id, "user pressed stop") == "enqueued"
    terminal = client.wait(turn_id, timeout_s=20)
    assert (terminal["type"], terminal["code"]) == ("cancelled", "cancelled")

    chunks_at_terminal = len([r for r in records(record) if r["event"] == "chunk"])
    time.sleep(0.5)
    calls = records(record)
    assert calls[-1]["event"] == "closed", "the model stream was closed"
    assert len([r for r in calls if r["event"] == "chunk"]) == chunks_at_terminal < 400
    assert len([r for r in calls if r["event"] == "request"]) == 1

    assert_one_terminal(client, turn_id)
    events = all_events(client, turn_id)
    streamed = "".join(e["text"] for e in events if e["type"] == "text_delta")
    assert streamed and streamed == terminal["answer"]
    assert all(e["type"] != "text_delta" for e in events[events.index(terminal):])
    row = client.thread(terminal["conversation_id"])[-1]
    assert (row.status, row.answer) == ("cancelled", streamed)
    stored = stored_messages(client, terminal["conversation_id"], row.id)
    assert isinstance(stored[-1], ModelResponse) and stored[-1].state == "interrupted"
    continue_with(client, agent, terminal["conversation_id"])


def test_cancel_mid_tool_call_closes_the_call_as_interrupted(
    workers: WorkerPool, client: Client, make_agent: AgentFactory
) -> None:
    agent = make_agent(
        python_model("tool_then_answer", tool="slow_tool", args={"seconds": 30}, only_when_asked=True),
        tools=["python:tests.support.models:slow_tool"], instructions=SECRET,
    )
    turn_id = client.submit(turn(agent, "use the tool"))
    wait_for_event(client, turn_id, "tool_call")
    started = time.monotonic()
    client.cancel(turn_id)
    terminal = client.wait(turn_id, timeout_s=20)
    assert terminal["type"] == "cancelled" and time.monotonic() - started < 5
    row = client.thread(terminal["conversation_id"])[-1]
    stored = stored_messages(client, terminal["conversation_id"], row.id)
    # the call is stored with its response; the run stopped before any result existed
    calls = [p for m in stored if isinstance(m, ModelResponse) for p in m.parts if p.part_kind == "tool-call"]
    assert [c.tool_name for c in calls] == ["slow_tool"]
    returns = [p for m in stored if isinstance(m, ModelRequest) for p in m.parts if isinstance(p, ToolReturnPart)]
    assert all(r.outcome == "interrupted" for r in returns)
    after = continue_with(client, agent, terminal["conversation_id"], "just talk")
    assert "interrupted" in after["answer"] or after["answer"].startswith("A plain answer")


def test_deadline_ends_the_turn_timed_out_and_the_conversation_continues(
    workers: WorkerPool, client: Client, make_agent: AgentFactory
) -> None:
    agent = make_agent(python_model("streaming", words=300, delay_ms=10), instructions=SECRET)
    terminal = client.wait(client.submit(turn(agent, "too long", deadline_s=0.6)), timeout_s=20)
    assert (terminal["type"], terminal["code"]) == ("timed_out", "timed_out")
    assert terminal["answer"].startswith("w0 ")
    assert_one_terminal(client, terminal["turn_id"])
    row = client.thread(terminal["conversation_id"])[-1]
    assert row.status == "timed_out"
    stored = stored_messages(client, terminal["conversation_id"], row.id)
    assert isinstance(stored[-1], ModelResponse) and stored[-1].state == "interrupted"
    client.wait(client.submit(turn(agent, "again", conversation_id=terminal["conversation_id"],
                                   deadline_s=20)), timeout_s=30)


def test_ask_human_pauses_and_resumes_once(workers: WorkerPool, client: Client, make_agent: AgentFactory) -> None:
    agent = make_agent(python_model("ask_then_answer", question="Which colour?"), tools=["ask_human"],
                       instructions=SECRET)
    paused = client.wait(client.submit(turn(agent, "paint my room")), timeout_s=30)
    assert paused["type"] == "paused" and paused["answer"] == "Which colour?"
    (pending,) = paused["pending_tool_calls"]
    assert pending["name"] == "ask_human"
    conversation = paused["conversation_id"]
    assert client.conversation(conversation).pending_tool_calls[0]["tool_call_id"] == pending["tool_call_id"]

    resume = {**turn(agent, "", conversation_id=conversation),
              "deferred_tool_results": {"calls": {pending["tool_call_id"]: "blue"}}}
    resumed = client.wait(client.submit(resume), timeout_s=30)
    assert resumed["type"] == "succeeded" and resumed["answer"] == "You answered: blue"
    assert client.conversation(conversation).pending_tool_calls == []

    again = client.wait(client.submit({**resume, "turn_id": uuid.uuid4().hex}), timeout_s=30)
    assert (again["type"], again["code"]) == ("failed", "invalid_request")
    thread = client.thread(conversation)
    assert [m.status for m in thread] == ["paused", "succeeded"]


def test_a_new_prompt_after_a_pause_abandons_the_question(
    workers: WorkerPool, client: Client, make_agent: AgentFactory
) -> None:
    agent = make_agent(python_model("ask_then_answer"), tools=["ask_human"])
    paused = client.wait(client.submit(turn(agent, "ask me")), timeout_s=30)
    after = client.wait(client.submit(turn(agent, "never mind", conversation_id=paused["conversation_id"])),
                        timeout_s=30)
    # the open call was closed as interrupted, so the model saw a tool result and answered
    assert after["type"] == "succeeded" and "interrupted" in after["answer"]


def test_no_snapshot_ever_contains_the_instructions(workers: WorkerPool, client: Client,
                                                   make_agent: AgentFactory) -> None:
    agent = make_agent("offline:echo", instructions=SECRET)
    terminal = client.wait(client.submit(turn(agent, "hello")), timeout_s=30)
    assert SECRET in json.loads(terminal["answer"])["system"], "the model did receive the instructions"
    # every snapshot written so far in this session, by every outcome above; the echo model's own
    # answer quotes what it received, so only what the run sent (requests) is checked
    r = redis.Redis.from_url(workers.url)
    requests = 0
    for key in r.scan_iter(f"{workers.prefix}:conv:*:snaps"):
        for value in r.hvals(key):
            for message in ModelMessagesTypeAdapter.validate_json(value):
                if isinstance(message, ModelRequest):
                    requests += 1
                    assert message.instructions is None
                    assert SECRET not in json.dumps([p.model_dump() if hasattr(p, "model_dump") else repr(p)
                                                     for p in message.parts], default=str)
    assert requests > 5


def test_events_follow_shows_deltas_while_the_model_is_still_streaming(
    workers: WorkerPool, client: Client, make_agent: AgentFactory, tmp_path: Path
) -> None:
    record = tmp_path / "calls.jsonl"
    agent = make_agent(python_model("streaming", words=60, delay_ms=25, record=str(record)))
    turn_id = client.submit(turn(agent, "stream please"))
    env = {**os.environ, "REDIS_URL": workers.url, "TL_PREFIX": workers.prefix, "TL_LOG_LEVEL": "WARNING"}
    cli = subprocess.Popen([sys.executable, "-m", "threadline.workers.cli", "events", turn_id, "--follow", "--json"],
                           env=env, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    assert cli.stdout is not None
    first_delta_at = None
    for line in cli.stdout:
        event = json.loads(line)
        if event["type"] == "text_delta" and first_delta_at is None:
            first_delta_at = time.time()
        if event["type"] in TERMINAL_TYPES:
            break
    cli.wait(timeout=10)
    closed_at = next(r["at"] for r in records(record) if r["event"] == "closed")
    assert first_delta_at is not None and first_delta_at < closed_at - 0.5


def test_usage_is_recorded_once_even_when_every_stage_message_is_delivered_again(
    workers: WorkerPool, client: Client, make_agent: AgentFactory
) -> None:
    agent = make_agent("offline:echo")
    tenant = f"tenant-{uuid.uuid4().hex[:8]}"
    request = {**turn(agent, "count me once"), "tenant_id": tenant}
    terminal = client.wait(client.submit(request), timeout_s=30)
    usage_key = client.keys.usage(tenant)
    usage = client.redis.hgetall(usage_key)
    assert int(usage[b"turns"]) == 1 and int(usage[b"requests"]) == 1
    events_before = all_events(client, terminal["turn_id"])

    # redeliver every stage's message, and the original request
    turn_id = terminal["turn_id"]
    for stage in ("history", "map", "invoke", "persist"):
        client.enqueue(stage, stage, ({"v": 1, "turn_id": turn_id, "stage": stage, "attempt": 1},))
    client.submit({**request, "turn_id": turn_id})
    time.sleep(1.5)
    assert client.redis.hgetall(usage_key) == usage
    assert all_events(client, turn_id) == events_before
    assert len(client.messages(terminal["conversation_id"])) == 1
