"""Invoke and persist: every terminal outcome ends with exactly one terminal event and a stored
snapshot the next turn can continue from; streaming, tool events, retries, ask_human."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from pydantic_ai.messages import ModelMessagesTypeAdapter, ModelRequest, ModelResponse, ToolReturnPart

from tests.conftest import ROOT, AgentFactory, WorkerPool, turn
from tests.support.clocks import stamped, turn_times
from tests.support.turns import all_events, assert_one_terminal, keys_of, python_model, records, wait_for_event
from tests.support.wait import wait_until
from threadline.pipeline import events as ev
from threadline.pipeline.config import AgentConfig
from threadline.pipeline.contracts import TURN_SCHEMA, new_conversation_id
from threadline.pipeline.streaming import TRUNCATED
from threadline.workers.clients.client import Client
from threadline.workers.protocol.keys import Keys

pytestmark = pytest.mark.integration

SECRET = "INSTRUCTION-MARKER-7f3a: never store me"
#: The slow tool's sleep: far longer than a cancel takes on any machine, so it is the cancel that ends it.
TOOL_S = 120


def conversation_of(terminal: ev.Terminal) -> str:
    """The conversation of an accepted turn (its terminal event names it)."""
    assert terminal.conversation_id is not None, terminal
    return terminal.conversation_id


def text_of(events: list[ev.Event]) -> str:
    return "".join(e.text for e in events if isinstance(e, ev.TextDelta))


def stored_messages(client: Client, conversation_id: str, message_id: str) -> list[Any]:
    data = client.snapshot(conversation_id, message_id)
    assert data is not None, "no snapshot stored"
    return list(ModelMessagesTypeAdapter.validate_json(data))


def continue_with(client: Client, agent: str, conversation_id: str, query: str = "next question") -> ev.Succeeded:
    """The next turn of a conversation runs normally with a new user prompt."""
    terminal = client.wait(client.submit(turn(agent, query, conversation_id=conversation_id)), timeout_s=30)
    assert isinstance(terminal, ev.Succeeded), terminal
    return terminal


def test_tool_loop_streams_tool_events_and_stores_tool_activity(
    workers: WorkerPool, client: Client, make_agent: AgentFactory
) -> None:
    agent = make_agent(python_model("tool_then_answer", tool="clock", only_when_asked=True),
                       tools=["clock"], instructions=SECRET)
    terminal = client.wait(client.submit(turn(agent, "use the tool please")), timeout_s=30)
    assert isinstance(terminal, ev.Succeeded) and terminal.answer.startswith("The tool said: 20"), terminal
    events = all_events(client, terminal.turn_id)
    call = next(e for e in events if isinstance(e, ev.ToolCall))
    result = next(e for e in events if isinstance(e, ev.ToolResult))
    assert call.name == "clock" and result.tool_call_id == call.tool_call_id and call.args == {}
    assert result.outcome == "success" and isinstance(result.content, str) and result.content.startswith("20")
    assert events.index(call) < events.index(result) < events.index(terminal)
    row = client.thread(conversation_of(terminal))[-1]
    assert [(t.name, t.outcome) for t in row.tools] == [("clock", "success")]
    assert row.usage.requests == 2 and terminal.usage.requests == 2
    continue_with(client, agent, conversation_of(terminal))


def test_permanent_model_error_fails_once_and_the_conversation_continues(
    workers: WorkerPool, client: Client, make_agent: AgentFactory, tmp_path: Path
) -> None:
    record = tmp_path / "calls.jsonl"
    agent = make_agent(python_model("failing", status=400, times=1, record=str(record)), instructions=SECRET)
    terminal = client.wait(client.submit(turn(agent, "this will fail")), timeout_s=30)
    assert isinstance(terminal, ev.Failed) and terminal.code == "model_bad_request", terminal
    assert len(records(record)) == 1, "a permanent error is not retried"
    assert_one_terminal(client, terminal.turn_id)
    row = client.thread(conversation_of(terminal))[-1]
    assert (row.status, row.error_code) == ("failed", "model_bad_request")
    after = continue_with(client, agent, conversation_of(terminal))
    assert after.answer == "recovered after failures"


def test_transient_model_error_is_retried_with_a_retrying_event(
    workers: WorkerPool, client: Client, make_agent: AgentFactory, tmp_path: Path
) -> None:
    record = tmp_path / "calls.jsonl"
    agent = make_agent(python_model("failing", status=503, times=1, record=str(record)))
    terminal = client.wait(client.submit(turn(agent, "flaky")), timeout_s=30)
    assert isinstance(terminal, ev.Succeeded) and terminal.attempt == 2, terminal
    events = all_events(client, terminal.turn_id)
    retrying = [e for e in events if isinstance(e, ev.Retrying)]
    assert len(retrying) == 1 and "model_unavailable" in retrying[0].reason and retrying[0].attempt == 2
    assert len(records(record)) == 2
    assert client.turn_state(terminal.turn_id).attempt == 2


def test_transient_errors_give_up_after_bounded_attempts(
    workers: WorkerPool, client: Client, make_agent: AgentFactory, tmp_path: Path
) -> None:
    record = tmp_path / "calls.jsonl"
    agent = make_agent(python_model("failing", status=429, record=str(record)))
    terminal = client.wait(client.submit(turn(agent, "always limited")), timeout_s=60)
    assert isinstance(terminal, ev.Failed) and terminal.code == "model_rate_limited", terminal
    assert len(records(record)) == 3  # TL_MAX_INVOKE_ATTEMPTS
    assert_one_terminal(client, terminal.turn_id)


def test_cancel_mid_stream_stops_the_model_and_keeps_the_partial_answer(
    workers: WorkerPool, client: Client, make_agent: AgentFactory, tmp_path: Path
) -> None:
    # the model streams until the test says so: only the cancel can end its first stream
    record, release = tmp_path / "calls.jsonl", tmp_path / "release"
    words = 100_000
    agent = make_agent(python_model("streaming", words=words, delay_ms=10, record=str(record), until=str(release)),
                       instructions=SECRET)
    turn_id = client.submit(turn(agent, "talk for a long time"))
    try:
        wait_for_event(client, turn_id, "text_delta")
        assert client.cancel(turn_id, "user pressed stop") == "enqueued"
        terminal = client.wait(turn_id, timeout_s=60)
        assert isinstance(terminal, ev.Cancelled) and terminal.code == "cancelled", terminal
        chunks_at_terminal = len([r for r in records(record) if r["event"] == "chunk"])
        wait_until(lambda: any(r["event"] == "closed" for r in records(record)), timeout_s=30)
        calls = records(record)
        assert calls[-1]["event"] == "closed", "the model stream was closed"
        assert len([r for r in calls if r["event"] == "chunk"]) == chunks_at_terminal < words
        assert len([r for r in calls if r["event"] == "request"]) == 1

        assert_one_terminal(client, turn_id)
        events = all_events(client, turn_id)
        streamed = text_of(events)
        assert streamed and streamed == terminal.answer
        assert all(not isinstance(e, ev.TextDelta) for e in events[events.index(terminal):])
        row = client.thread(conversation_of(terminal))[-1]
        assert (row.status, row.answer) == ("cancelled", streamed)
        stored = stored_messages(client, conversation_of(terminal), row.id)
        assert isinstance(stored[-1], ModelResponse) and stored[-1].state == "interrupted"
        # the conversation goes on: the next turn streams, and ends once the test lets it
        after = client.submit(turn(agent, "next question", conversation_id=conversation_of(terminal)))
        wait_for_event(client, after, "text_delta")
        release.touch()
        assert isinstance(client.wait(after, timeout_s=30), ev.Succeeded)
    finally:
        release.touch()


def test_cancel_mid_tool_call_closes_the_call_as_interrupted(
    workers: WorkerPool, client: Client, make_agent: AgentFactory
) -> None:
    agent = make_agent(
        python_model("tool_then_answer", tool="slow_tool", args={"seconds": TOOL_S}, only_when_asked=True),
        tools=["python:tests.support.models:slow_tool"], instructions=SECRET,
    )
    turn_id = client.submit(turn(agent, "use the tool"))
    wait_for_event(client, turn_id, "tool_call")
    client.cancel(turn_id)
    terminal = client.wait(turn_id, timeout_s=TOOL_S / 2)
    assert isinstance(terminal, ev.Cancelled), terminal
    # on the turn's own record: it ended long before the tool could have returned, soon after the request
    times = turn_times(client, turn_id)
    tool_called_at = next(at for at, e in stamped(client, turn_id) if isinstance(e, ev.ToolCall))
    assert times["finished_at"] - tool_called_at < TOOL_S, (times, tool_called_at)
    assert times["finished_at"] - times["cancel_requested_at"] < 10, times
    row = client.thread(conversation_of(terminal))[-1]
    stored = stored_messages(client, conversation_of(terminal), row.id)
    # the call is stored with its response; the run stopped before any result existed
    calls = [p for m in stored if isinstance(m, ModelResponse) for p in m.parts if p.part_kind == "tool-call"]
    assert [c.tool_name for c in calls] == ["slow_tool"]
    returns = [p for m in stored if isinstance(m, ModelRequest) for p in m.parts if isinstance(p, ToolReturnPart)]
    assert all(r.outcome == "interrupted" for r in returns)
    after = continue_with(client, agent, conversation_of(terminal), "just talk")
    assert "interrupted" in after.answer or after.answer.startswith("A plain answer")


def test_deadline_ends_the_turn_timed_out_and_the_conversation_continues(
    workers: WorkerPool, client: Client, make_agent: AgentFactory
) -> None:
    agent = make_agent(python_model("streaming", words=300, delay_ms=10), instructions=SECRET)
    terminal = client.wait(client.submit(turn(agent, "too long", deadline_s=0.6)), timeout_s=20)
    assert isinstance(terminal, ev.TimedOut) and terminal.code == "timed_out", terminal
    assert terminal.answer.startswith("w0 ")
    assert_one_terminal(client, terminal.turn_id)
    row = client.thread(conversation_of(terminal))[-1]
    assert row.status == "timed_out"
    stored = stored_messages(client, conversation_of(terminal), row.id)
    assert isinstance(stored[-1], ModelResponse) and stored[-1].state == "interrupted"
    again = client.wait(client.submit(turn(agent, "again", conversation_id=conversation_of(terminal),
                                           deadline_s=20)), timeout_s=30)
    assert isinstance(again, ev.Succeeded), again


def test_answers_and_tool_payloads_over_the_limit_are_stored_truncated_with_a_marker(
    isolated: Callable[..., WorkerPool],
) -> None:
    limit = 200
    pool = isolated({"TL_MAX_TEXT_CHARS": str(limit)}).start(processes=1)
    client = Client(pool.url, prefix=pool.prefix)
    client.put_agent(AgentConfig.model_validate({
        "id": "talker", "model": python_model("streaming", words=100, delay_ms=0)}))
    client.put_agent(AgentConfig.model_validate({
        "id": "reader", "model": python_model("tool_then_answer", tool="long_text", args={"chars": 1000}),
        "tools": ["python:tests.support.models:long_text"]}))

    terminal = client.wait(client.submit(turn("talker", "talk")), timeout_s=30)
    assert isinstance(terminal, ev.Succeeded), terminal
    streamed = text_of(all_events(client, terminal.turn_id))
    full = "".join(f"w{i} " for i in range(100)).rstrip()
    assert streamed == full[:limit] + TRUNCATED, "the stream stops at the limit too, and says so"
    assert len(terminal.answer) <= limit and "truncated" in terminal.answer
    kept = terminal.answer[: terminal.answer.index("\n[")]
    assert full.startswith(kept) and len(kept) > limit // 2
    row = client.thread(conversation_of(terminal))[-1]
    assert row.answer == terminal.answer
    stored = stored_messages(client, conversation_of(terminal), row.id)
    assert isinstance(stored[-1], ModelResponse)
    assert "".join(p.content for p in stored[-1].parts if p.part_kind == "text") == terminal.answer
    # the model stage's decision record says that what was stored is not all the model said
    assert client.decisions(terminal.turn_id)["invoke"]["truncated_parts"] >= 1

    read = client.wait(client.submit(turn("reader", "read it")), timeout_s=30)
    assert isinstance(read, ev.Succeeded), read
    result = next(e for e in all_events(client, read.turn_id) if isinstance(e, ev.ToolResult))
    assert isinstance(result.content, str) and len(result.content) <= limit and "truncated" in result.content
    assert result.content.startswith("0123456789")
    (activity,) = client.thread(conversation_of(read))[-1].tools
    assert activity.content == result.content
    assert len(read.answer) <= limit and read.answer.startswith("The tool said: 0123456789")
    client.close()


def test_ask_human_pauses_and_resumes_once(workers: WorkerPool, client: Client, make_agent: AgentFactory) -> None:
    agent = make_agent(python_model("ask_then_answer", question="Which colour?"), tools=["ask_human"],
                       instructions=SECRET)
    paused = client.wait(client.submit(turn(agent, "paint my room")), timeout_s=30)
    assert isinstance(paused, ev.Paused) and paused.answer == "Which colour?", paused
    (pending,) = paused.pending_tool_calls
    assert pending["name"] == "ask_human"
    conversation = conversation_of(paused)
    stored = client.conversation(conversation)
    assert stored is not None and stored.pending_tool_calls[0]["tool_call_id"] == pending["tool_call_id"]

    resume = {**turn(agent, "", conversation_id=conversation),
              "deferred_tool_results": {"calls": {pending["tool_call_id"]: "blue"}}}
    resumed = client.wait(client.submit(resume), timeout_s=30)
    assert isinstance(resumed, ev.Succeeded) and resumed.answer == "You answered: blue", resumed
    stored = client.conversation(conversation)
    assert stored is not None and stored.pending_tool_calls == []

    again = client.wait(client.submit({**resume, "turn_id": uuid.uuid4().hex}), timeout_s=30)
    assert isinstance(again, ev.Failed) and again.code == "invalid_request", again
    thread = client.thread(conversation)
    assert [m.status for m in thread] == ["paused", "succeeded"]


def test_a_new_prompt_after_a_pause_abandons_the_question(
    workers: WorkerPool, client: Client, make_agent: AgentFactory
) -> None:
    agent = make_agent(python_model("ask_then_answer"), tools=["ask_human"])
    paused = client.wait(client.submit(turn(agent, "ask me")), timeout_s=30)
    assert isinstance(paused, ev.Paused), paused
    after = client.wait(client.submit(turn(agent, "never mind", conversation_id=conversation_of(paused))),
                        timeout_s=30)
    # the open call was closed as interrupted, so the model saw a tool result and answered
    assert isinstance(after, ev.Succeeded) and "interrupted" in after.answer, after


def _secret_free_requests(client: Client, conversation_id: str) -> int:
    """Checks every stored snapshot of a conversation; returns how many requests they hold. The echo
    model's own answer quotes what it received, so only what the run sent (requests) is checked."""
    requests = 0
    for value in client.redis.hvals(client.keys.snapshots(conversation_id)):
        for message in ModelMessagesTypeAdapter.validate_json(value):
            if isinstance(message, ModelRequest):
                requests += 1
                assert message.instructions is None
                assert SECRET not in json.dumps([p.model_dump() if hasattr(p, "model_dump") else repr(p)
                                                 for p in message.parts], default=str)
    return requests


def test_no_snapshot_ever_contains_the_instructions(workers: WorkerPool, client: Client,
                                                   make_agent: AgentFactory, tmp_path: Path) -> None:
    """Every outcome, each in a conversation of this test's own: success (twice, so the second run
    replays the first), a tool loop, a model failure, a deadline, a cancel, a pause and its resume."""
    echo = make_agent("offline:echo", instructions=SECRET)
    first = client.wait(client.submit(turn(echo, "hello")), timeout_s=30)
    assert isinstance(first, ev.Succeeded), first
    assert SECRET in json.loads(first.answer)["system"], "the model did receive the instructions"
    continue_with(client, echo, conversation_of(first))
    conversations = [conversation_of(first)]

    endings: list[tuple[dict[str, Any], list[str], dict[str, Any], type[ev.Terminal]]] = [
        (python_model("tool_then_answer", tool="clock"), ["clock"], {}, ev.Succeeded),
        (python_model("failing", status=400, record=str(tmp_path / "failing.jsonl")), [], {}, ev.Failed),
        (python_model("streaming", words=300, delay_ms=10), [], {"deadline_s": 0.6}, ev.TimedOut),
    ]
    for model, tools, extra, expected in endings:
        agent = make_agent(model, tools=tools, instructions=SECRET)
        terminal = client.wait(client.submit(turn(agent, "go", **extra)), timeout_s=30)
        assert isinstance(terminal, expected), terminal
        conversations.append(conversation_of(terminal))

    # streams until a file nobody creates exists: the cancel ends it, however late it comes
    streaming = make_agent(python_model("streaming", words=100_000, delay_ms=10, until=str(tmp_path / "never")),
                           instructions=SECRET)
    turn_id = client.submit(turn(streaming, "talk"))
    wait_for_event(client, turn_id, "text_delta")
    client.cancel(turn_id, "stop")
    cancelled = client.wait(turn_id, timeout_s=60)
    assert isinstance(cancelled, ev.Cancelled), cancelled
    conversations.append(conversation_of(cancelled))

    asking = make_agent(python_model("ask_then_answer"), tools=["ask_human"], instructions=SECRET)
    paused = client.wait(client.submit(turn(asking, "ask me")), timeout_s=30)
    assert isinstance(paused, ev.Paused), paused
    answers = {"calls": {paused.pending_tool_calls[0]["tool_call_id"]: "blue"}}
    resumed = client.wait(client.submit({**turn(asking, "", conversation_id=conversation_of(paused)),
                                         "deferred_tool_results": answers}), timeout_s=30)
    assert isinstance(resumed, ev.Succeeded), resumed
    conversations.append(conversation_of(paused))

    counts = {cid: _secret_free_requests(client, cid) for cid in conversations}
    assert all(counts.values()), counts  # every outcome stored what its run sent
    assert sum(counts.values()) > 5


def test_events_follow_shows_deltas_while_the_model_is_still_streaming(
    workers: WorkerPool, client: Client, make_agent: AgentFactory, tmp_path: Path
) -> None:
    """`threadline events --follow` prints the first delta while the model's stream is still open.
    The model keeps streaming until the test has seen that delta (or 30 s pass), so how long the CLI
    takes to start does not matter; the model's own record says whether its stream was still open."""
    record, release = tmp_path / "calls.jsonl", tmp_path / "release"
    agent = make_agent(python_model("streaming", words=3000, delay_ms=10, record=str(record), until=str(release)))
    turn_id = client.submit(turn(agent, "stream please"))
    env = {**os.environ, "REDIS_URL": workers.url, "TL_PREFIX": workers.prefix, "TL_LOG_LEVEL": "WARNING"}
    cli = subprocess.Popen([sys.executable, "-m", "threadline.workers.cli", "events", turn_id, "--follow", "--json",
                            "--timeout", "60"], env=env, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    assert cli.stdout is not None
    first_delta: tuple[float, list[dict[str, Any]]] | None = None
    shown: list[ev.Event] = []
    try:
        for line in cli.stdout:
            event = ev.decode(line)
            shown.append(event)
            if isinstance(event, ev.TextDelta) and first_delta is None:
                first_delta = (time.time(), records(record))  # what the model had done at that moment
                release.touch()
            if isinstance(event, ev.Terminal):
                break
    finally:
        release.touch()
        cli.wait(timeout=30)
    assert first_delta is not None, [e.type for e in shown]
    shown_at, model_so_far = first_delta
    assert [r["event"] for r in model_so_far][:2] == ["request", "chunk"]
    assert "closed" not in [r["event"] for r in model_so_far], "the model's stream was already closed"
    closed_at = next(r["at"] for r in records(record) if r["event"] == "closed")
    assert shown_at < closed_at
    assert isinstance(shown[-1], ev.Succeeded) and shown[-1].answer.startswith("w0 w1")
    assert text_of(shown) == shown[-1].answer


def _wait_until_processed(client: Client, keys: Keys, messages: list[tuple[str, str]], timeout_s: float = 20) -> None:
    """Until every (queue, message id) of `keys`' shard was handled and acknowledged: dramatiq deletes a
    message's body from `<queue>.msgs` when it acks it (a retried one sits in `<queue>.DQ.msgs` meanwhile)."""
    deadline = time.monotonic() + timeout_s
    pending = list(messages)
    while pending:
        pending = [(q, mid) for q, mid in pending
                   if client.redis.hexists(keys.queue_messages(q), mid)
                   or client.redis.hexists(keys.queue_messages(f"{q}.DQ"), mid)]
        if pending and time.monotonic() > deadline:
            raise TimeoutError(f"not processed: {pending}")
        time.sleep(0.02)
    for queue, mid in messages:
        assert not client.redis.zscore(keys.dead_queue(queue), mid), f"{queue} {mid} was dead-lettered"


def test_usage_is_recorded_once_even_when_every_stage_message_is_delivered_again(
    workers: WorkerPool, client: Client, make_agent: AgentFactory
) -> None:
    agent = make_agent("offline:echo")
    tenant = f"tenant-{uuid.uuid4().hex[:8]}"
    request = {**turn(agent, "count me once"), "tenant_id": tenant}
    terminal = client.wait(client.submit(request), timeout_s=30)
    keys = keys_of(client, terminal.turn_id)  # the turn's shard: its usage, queues and artifacts
    usage_key = keys.usage(tenant)
    usage = client.redis.hgetall(usage_key)
    assert int(usage[b"turns"]) == 1 and int(usage[b"requests"]) == 1
    events_before = all_events(client, terminal.turn_id)

    # deliver every stage's message again, and the original request
    turn_id = terminal.turn_id
    delivered = [(stage, client.enqueue(stage, stage, ({"v": 1, "turn_id": turn_id, "stage": stage, "attempt": 1},),
                                        shard=keys.shard))
                 for stage in ("history", "map", "invoke", "persist")]
    # as `client.submit` enqueues it, but keeping the message id to wait for
    body = {"schema": TURN_SCHEMA, **request, "turn_id": turn_id}
    delivered.append(("resolve", client.enqueue("resolve", "resolve", (body,), turn_id=turn_id,
                                                conversation_id=new_conversation_id(turn_id))))
    _wait_until_processed(client, keys, delivered)
    assert client.redis.hgetall(usage_key) == usage
    assert all_events(client, turn_id) == events_before
    assert len(client.messages(conversation_of(terminal))) == 1
    assert client.turn_state(turn_id).status == "succeeded"
    assert not list(client.redis.scan_iter(keys.artifact(turn_id, "*"))), "artifacts came back"


def test_a_stage_that_raises_on_every_attempt_gives_up_with_one_internal_error(
    isolated: Callable[..., WorkerPool], tmp_path: Path
) -> None:
    """A bug (a plain exception, not a Threadline error) in the model stage: dramatiq retries the
    message TL_MAX_RETRIES times, then dead-letters it, and the turn ends `failed` once."""
    pool = isolated({"TL_MAX_RETRIES": "1"}).start(processes=1)
    client = Client(pool.url, prefix=pool.prefix)
    record = tmp_path / "builds.jsonl"
    client.put_agent(AgentConfig.model_validate({"id": "broken", "model": python_model("broken", record=str(record))}))
    turn_id = client.submit(turn("broken", "hello"))
    terminal = client.wait(turn_id, timeout_s=60)
    assert isinstance(terminal, ev.Failed) and terminal.code == "internal_error", terminal
    assert "invoke" in terminal.message and "RuntimeError" in terminal.message
    assert_one_terminal(client, turn_id)
    assert len([r for r in records(record) if r["event"] == "build"]) == 2  # the delivery and its one retry

    keys = keys_of(client, turn_id)
    dead_letters = keys.dead_queue("invoke")
    deadline = time.monotonic() + 10
    while not client.redis.zcard(dead_letters) and time.monotonic() < deadline:
        time.sleep(0.05)
    (dead,) = client.redis.zrange(dead_letters, 0, -1)
    body = client.redis.hget(keys.dead_queue_messages("invoke"), dead)
    assert body is not None and turn_id.encode() in body

    conversation = conversation_of(terminal)
    row = client.thread(conversation)[-1]
    assert (row.status, row.error_code) == ("failed", "internal_error")
    assert client.turn_state(turn_id).status == "failed"
    assert not client.redis.hexists(client.keys.lease(conversation), "turn"), "the conversation was released"
    assert not list(client.redis.scan_iter(keys.artifact(turn_id, "*")))
    client.close()
