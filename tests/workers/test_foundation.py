"""A turn flows end to end through five queues and real worker processes on a real server."""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
import redis
from threadline.workers.client import Client

from tests.conftest import AgentFactory, WorkerPool, turn

pytestmark = pytest.mark.integration


def _types(events: list[dict[str, Any]]) -> list[str]:
    return [e["type"] for e in events]


def _echo(event: dict[str, Any]) -> dict[str, Any]:
    assert event["type"] == "succeeded", event
    return json.loads(event["answer"])


def test_a_turn_crosses_the_five_stages_in_order(workers: WorkerPool, client: Client,
                                                 make_agent: AgentFactory) -> None:
    agent = make_agent("offline:echo", instructions="Be brief.")
    turn_id = client.submit(turn(agent, "hello"))
    events = list(client.events(turn_id, follow=True, timeout_s=30))

    assert [e["seq"] for e in events] == list(range(1, len(events) + 1))
    assert events[0]["type"] == "accepted"
    stages = [(e["stage"], e["status"]) for e in events if e["type"] == "stage"]
    assert stages == [(s, status) for s in ("resolve", "history", "map", "invoke", "persist")
                      for status in ("started", "finished")]
    assert _types(events).count("succeeded") == 1 and events[-1]["type"] == "succeeded"
    seen = _echo(events[-1])
    assert seen["system"] == "Be brief."
    assert seen["messages"] == [{"role": "user", "text": "hello"}]


def test_turn_n_sees_turns_1_to_n_minus_1_in_order(workers: WorkerPool, client: Client,
                                                    make_agent: AgentFactory) -> None:
    agent = make_agent("offline:echo")
    conversation = None
    for n in range(1, 5):
        turn_id = client.submit(turn(agent, f"question {n}", conversation_id=conversation))
        terminal = client.wait(turn_id, timeout_s=30)
        conversation = terminal["conversation_id"]
        seen = _echo(terminal)
        users = [m["text"] for m in seen["messages"] if m["role"] == "user"]
        assert users == [f"question {i}" for i in range(1, n + 1)]
        # the assistant answers of earlier turns are there too, each after its question
        assert [m["role"] for m in seen["messages"]] == ["user", "assistant"] * (n - 1) + ["user"]
    thread = client.thread(conversation)
    assert [m.query for m in thread] == [f"question {i}" for i in range(1, 5)]
    assert all(m.status == "succeeded" for m in thread)


def test_offline_chat_refers_to_earlier_turns(workers: WorkerPool, client: Client,
                                              make_agent: AgentFactory) -> None:
    agent = make_agent({"provider": "offline", "name": "chat"})
    first = client.wait(client.submit(turn(agent, "I like tea")), timeout_s=30)
    second = client.wait(client.submit(turn(agent, "and biscuits", conversation_id=first["conversation_id"])),
                         timeout_s=30)
    assert '"I like tea"' in second["answer"] and '"and biscuits"' in second["answer"]
    deltas = [e["text"] for e in client.events(second["turn_id"]) if e["type"] == "text_delta"]
    assert "".join(deltas) == second["answer"]


def test_same_turn_id_twice_is_one_turn(workers: WorkerPool, client: Client, make_agent: AgentFactory) -> None:
    agent = make_agent("offline:echo")
    request = turn(agent, "once", turn_id=f"dup-{uuid.uuid4().hex}")
    client.submit(request)
    client.submit(request)
    terminal = client.wait(request["turn_id"], timeout_s=30)
    events = list(client.events(request["turn_id"]))
    assert _types(events).count("succeeded") == 1
    assert _types(events).count("accepted") == 1
    assert len(client.messages(terminal["conversation_id"])) == 1


def test_two_turns_at_once_on_one_conversation_run_one_after_the_other(
    workers: WorkerPool, client: Client, make_agent: AgentFactory
) -> None:
    agent = make_agent("offline:echo")
    first = client.wait(client.submit(turn(agent, "first")), timeout_s=30)
    conversation = first["conversation_id"]
    second_id = client.submit(turn(agent, "second", conversation_id=conversation))
    third_id = client.submit(turn(agent, "third", conversation_id=conversation))
    second, third = client.wait(second_id, timeout_s=30), client.wait(third_id, timeout_s=30)

    assert [m["text"] for m in _echo(second)["messages"] if m["role"] == "user"] == ["first", "second"]
    assert [m["text"] for m in _echo(third)["messages"] if m["role"] == "user"] == ["first", "second", "third"]
    thread = client.thread(conversation)
    assert [m.query for m in thread] == ["first", "second", "third"]
    assert [m.parent_id for m in thread] == [None, thread[0].id, thread[1].id]


def test_many_turns_on_many_conversations_at_once(workers: WorkerPool, client: Client,
                                                  make_agent: AgentFactory) -> None:
    agent = make_agent("offline:echo")
    firsts = [client.wait(client.submit(turn(agent, f"c{i} q1")), timeout_s=30) for i in range(4)]
    ids = []
    for q in (2, 3):
        for i, first in enumerate(firsts):
            ids.append((i, q, client.submit(turn(agent, f"c{i} q{q}", conversation_id=first["conversation_id"]))))
    for i, q, turn_id in ids:
        seen = _echo(client.wait(turn_id, timeout_s=60))
        assert [m["text"] for m in seen["messages"] if m["role"] == "user"] == [f"c{i} q{n}" for n in range(1, q + 1)]


@pytest.mark.parametrize(
    ("request_body", "code"),
    [
        ("{not json", "invalid_request"),
        ('["a", "list"]', "invalid_request"),
        ({"schema": "threadline.turn/v1", "tenant_id": "t1", "app_id": "app", "user_id": "u1", "query": "hi"},
         "invalid_request"),  # agent_id missing
        ({"schema": "threadline.turn/v2", "tenant_id": "t1", "app_id": "app", "user_id": "u1",
          "agent_id": "x", "query": "hi"}, "invalid_request"),
    ],
)
def test_malformed_requests_fail_with_a_stable_code(workers: WorkerPool, client: Client, request_body: Any,
                                                    code: str) -> None:
    message_id = client.submit_raw(request_body)
    terminal = client.wait(message_id, timeout_s=30)
    assert terminal["type"] == "failed" and terminal["code"] == code
    assert terminal["message"]
    assert workers.alive()


def _stored_state(url: str, prefix: str) -> dict[bytes, bytes | None]:
    """Every key but turn-scoped ones and queues, with its value: what bad input must leave as it
    was. A conversation's lease is bookkeeping (its fence grows with every admission): only its
    presence counts."""
    r = redis.Redis.from_url(url)
    state: dict[bytes, bytes | None] = {}
    for key in r.scan_iter(f"{prefix}:*", count=1000):
        if key.startswith(f"{prefix}:turn:".encode()) or key.startswith(f"{prefix}:q:".encode()):
            continue
        state[key] = None if key.endswith(b":lease") else r.dump(key)
    return state


def test_bad_input_fails_cleanly_and_changes_no_stored_data(workers: WorkerPool, client: Client,
                                                            make_agent: AgentFactory) -> None:
    agent = make_agent("offline:echo")
    first = client.wait(client.submit(turn(agent, "keep me")), timeout_s=30)
    conversation = first["conversation_id"]
    before = _stored_state(workers.url, workers.prefix)
    cases = {
        "unknown agent": (turn("no-such-agent", "hi"), "agent_not_found"),
        "empty query": (turn(agent, "   ", conversation_id=conversation), "invalid_request"),
        "oversize query": (turn(agent, "x" * 2001, conversation_id=conversation), "invalid_request"),
        "unknown conversation": (turn(agent, "hi", conversation_id="c-nope"), "conversation_not_found"),
        "someone else's conversation": ({**turn(agent, "hi", conversation_id=conversation), "user_id": "u2"},
                                        "forbidden"),
        "unknown field": ({**turn(agent, "hi"), "qeury": "typo"}, "invalid_request"),
        "resume with nothing paused": ({**turn(agent, "", conversation_id=conversation),
                                        "deferred_tool_results": {"calls": {"x": 1}}}, "invalid_request"),
    }
    for name, (body, code) in cases.items():
        terminal = client.wait(client.submit(body), timeout_s=30)
        assert (terminal["type"], terminal["code"]) == ("failed", code), name
    assert _stored_state(workers.url, workers.prefix) == before
    assert workers.alive()
    # and the conversation continues normally
    after = client.wait(client.submit(turn(agent, "still here", conversation_id=conversation)), timeout_s=30)
    assert [m["text"] for m in _echo(after)["messages"] if m["role"] == "user"] == ["keep me", "still here"]
