"""A turn flows end to end through five queues and real worker processes on a real server."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import pytest

from tests.conftest import AgentFactory, WorkerPool, liveness_key, turn
from tests.support.turns import keys_of
from threadline.pipeline import events as ev
from threadline.pipeline.config import AgentConfig
from threadline.pipeline.contracts import new_conversation_id
from threadline.pipeline.stages import DEFAULT_GRAPH
from threadline.workers.clients.client import Client
from threadline.workers.storage.connect import sync_client

pytestmark = pytest.mark.integration


def _types(events: Sequence[ev.Event]) -> list[str]:
    return [e.type for e in events]


def _echo(event: ev.Event) -> dict[str, Any]:
    assert isinstance(event, ev.Succeeded), event
    answer: dict[str, Any] = json.loads(event.answer)
    return answer


def _users(event: ev.Event) -> list[str]:
    """The user prompts `offline:echo` received, in order."""
    return [m["text"] for m in _echo(event)["messages"] if m["role"] == "user"]


def test_a_turn_crosses_the_five_stages_in_order(workers: WorkerPool, client: Client,
                                                 make_agent: AgentFactory) -> None:
    agent = make_agent("offline:echo", instructions="Be brief.")
    turn_id = client.submit(turn(agent, "hello"))
    events = list(client.events(turn_id, follow=True, timeout_s=30))

    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    assert isinstance(events[0], ev.Accepted)
    assert (events[0].conversation_id, events[0].message_id) == (new_conversation_id(turn_id), turn_id)
    stages = [(e.stage, e.status) for e in events if isinstance(e, ev.StageEvent)]
    assert stages == [(s, status) for s in ("resolve", "history", "map", "invoke", "persist")
                      for status in ("started", "finished")]
    # the transform stages say what they decided
    decided = {e.stage: e.decision for e in events if isinstance(e, ev.StageEvent) and e.status == "finished"}
    assert decided["history"] is not None and decided["history"]["messages_out"] == 0
    assert decided["map"] is not None and decided["map"]["messages_in"] == 0
    assert _types(events).count("succeeded") == 1 and isinstance(events[-1], ev.Succeeded)
    terminal = events[-1]
    assert (terminal.conversation_id, terminal.message_id) == (new_conversation_id(turn_id), turn_id)
    seen = _echo(terminal)
    assert seen["system"] == "Be brief."
    assert seen["messages"] == [{"role": "user", "text": "hello"}]

    state = client.turn_state(turn_id)
    assert (state.status, state.conversation_id, state.message_id) == ("succeeded", terminal.conversation_id, turn_id)
    # every stage before the finish stage marked itself done (the finish stage's mark is the status)
    assert state.done >= {s.name for s in DEFAULT_GRAPH.turn_stages if s.kind != "finish"} and state.attempt == 1
    k = keys_of(client, turn_id)
    assert client.redis.hget(k.turn(turn_id), "model_starts") == b"1"
    # the turn's artifacts are gone; its record and events stay readable for TL_TURN_TTL_S (6 h)
    assert not any(client.redis.exists(k.artifact(turn_id, s.name)) for s in DEFAULT_GRAPH.turn_stages)
    for key in (k.turn(turn_id), k.events(turn_id)):
        assert 6 * 3600 - 60 < client.redis.ttl(key) <= 6 * 3600


def test_turn_n_sees_turns_1_to_n_minus_1_in_order(workers: WorkerPool, client: Client,
                                                    make_agent: AgentFactory) -> None:
    agent = make_agent("offline:echo")
    conversation = None
    for n in range(1, 5):
        turn_id = client.submit(turn(agent, f"question {n}", conversation_id=conversation))
        terminal = client.wait(turn_id, timeout_s=30)
        conversation = terminal.conversation_id
        seen = _echo(terminal)
        users = [m["text"] for m in seen["messages"] if m["role"] == "user"]
        assert users == [f"question {i}" for i in range(1, n + 1)]
        # the assistant answers of earlier turns are there too, each after its question
        assert [m["role"] for m in seen["messages"]] == ["user", "assistant"] * (n - 1) + ["user"]
    assert conversation is not None
    thread = client.thread(conversation)
    assert [m.query for m in thread] == [f"question {i}" for i in range(1, 5)]
    assert all(m.status == "succeeded" for m in thread)


def test_offline_chat_refers_to_earlier_turns(workers: WorkerPool, client: Client,
                                              make_agent: AgentFactory) -> None:
    agent = make_agent({"provider": "offline", "name": "chat"})
    first = client.wait(client.submit(turn(agent, "I like tea")), timeout_s=30)
    second = client.wait(client.submit(turn(agent, "and biscuits", conversation_id=first.conversation_id)),
                         timeout_s=30)
    assert isinstance(second, ev.Succeeded), second
    assert '"I like tea"' in second.answer and '"and biscuits"' in second.answer
    deltas = [e.text for e in client.events(second.turn_id) if isinstance(e, ev.TextDelta)]
    assert "".join(deltas) == second.answer


def test_same_turn_id_twice_is_one_turn(workers: WorkerPool, client: Client, make_agent: AgentFactory) -> None:
    agent = make_agent("offline:echo")
    request = turn(agent, "once", turn_id=f"dup-{uuid.uuid4().hex}")
    client.submit(request)
    client.submit(request)
    terminal = client.wait(request["turn_id"], timeout_s=30)
    events = list(client.events(request["turn_id"]))
    assert _types(events).count("succeeded") == 1
    assert _types(events).count("accepted") == 1
    assert terminal.conversation_id is not None
    assert len(client.messages(terminal.conversation_id)) == 1


def test_a_finished_turn_submitted_again_changes_nothing_and_its_conversation_goes_on(
    workers: WorkerPool, client: Client, make_agent: AgentFactory
) -> None:
    """A producer that retries a submission after the turn ended (at-least-once producers do)."""
    agent = make_agent("offline:echo")
    request = turn(agent, "once", turn_id=f"again-{uuid.uuid4().hex}")
    first = client.wait(client.submit(request), timeout_s=30)
    assert isinstance(first, ev.Succeeded) and first.conversation_id is not None
    before = list(client.events(first.turn_id))
    client.submit(request)
    after = client.wait(client.submit(turn(agent, "next", conversation_id=first.conversation_id)), timeout_s=15)
    assert _users(after) == ["once", "next"]
    assert list(client.events(first.turn_id)) == before
    assert [m.query for m in client.thread(first.conversation_id)] == ["once", "next"]


def test_two_turns_at_once_on_one_conversation_run_one_after_the_other(
    workers: WorkerPool, client: Client, make_agent: AgentFactory
) -> None:
    agent = make_agent("offline:echo")
    first = client.wait(client.submit(turn(agent, "first")), timeout_s=30)
    conversation = first.conversation_id
    assert conversation is not None
    second_id = client.submit(turn(agent, "second", conversation_id=conversation))
    third_id = client.submit(turn(agent, "third", conversation_id=conversation))
    second, third = client.wait(second_id, timeout_s=30), client.wait(third_id, timeout_s=30)

    assert _users(second) == ["first", "second"]
    assert _users(third) == ["first", "second", "third"]
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
            ids.append((i, q, client.submit(turn(agent, f"c{i} q{q}", conversation_id=first.conversation_id))))
    for i, q, turn_id in ids:
        assert _users(client.wait(turn_id, timeout_s=60)) == [f"c{i} q{n}" for n in range(1, q + 1)]


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
    assert isinstance(terminal, ev.Failed) and terminal.code == code
    assert terminal.message
    # refused before it was accepted: it names no conversation and no message
    assert (terminal.conversation_id, terminal.message_id) == (None, None)
    assert workers.alive()


def _unscoped(name: str, prefix: str) -> str:
    """A key's name without the sharded layout's hash tag (`<prefix>:{<tag>}:...`: a shard's, the fleet's)."""
    rest = name[len(prefix) + 1:]
    return f"{prefix}:{rest.split('}:', 1)[1]}" if rest.startswith("{") and "}:" in rest else name


def _stored_state(url: str, prefix: str) -> dict[bytes, bytes | None]:
    """Every key but turn-scoped ones (their shard pointers too), queues and the workers' heartbeats,
    with its value: what bad input must leave as it was. Conversation leases included: bad input is
    refused before the turn takes the lease."""
    r = sync_client(url)
    state: dict[bytes, bytes | None] = {}
    for key in r.scan_iter(f"{prefix}:*", count=1000):
        name = _unscoped(key.decode(), prefix)
        if name.startswith((f"{prefix}:turn:", f"{prefix}:turnshard:", f"{prefix}:q:")) or liveness_key(name, prefix):
            continue
        state[key] = r.dump(key)
    r.close()
    return state


def _conversation_keys(client: Client, conversation_ids: Sequence[str]) -> dict[str, Any]:
    """Every key of these conversations with its whole content, by type: the conversation hash, its
    messages, order, snapshots, line, lease (its fence too) and waiting requests."""
    r = client.redis
    dump: dict[str, Any] = {}
    for cid in conversation_ids:
        conversation = client.keys.conversation(cid)  # every other key of it is `<this>:<part>`
        found = [*r.scan_iter(conversation, count=1000), *r.scan_iter(f"{conversation}:*", count=1000)]
        for raw in sorted(found):
            key = raw.decode()
            kind = r.type(raw).decode()
            if kind == "hash":
                value: Any = sorted(r.hgetall(raw).items())
            elif kind == "zset":
                value = r.zrange(raw, 0, -1, withscores=True)
            elif kind == "string":
                value = r.get(raw)
            elif kind == "list":
                value = r.lrange(raw, 0, -1)
            elif kind == "set":
                value = sorted(r.smembers(raw))
            else:
                value = r.dump(raw)
            dump[key] = (kind, value)
    return dump


def test_bad_input_fails_cleanly_and_changes_no_stored_data(workers: WorkerPool, client: Client,
                                                            make_agent: AgentFactory) -> None:
    agent = make_agent("offline:echo")
    first = client.wait(client.submit(turn(agent, "keep me")), timeout_s=30)
    conversation = first.conversation_id
    assert conversation is not None
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
        "unknown parent": (turn(agent, "hi", conversation_id=conversation, parent_message_id="no-such-message"),
                           "invalid_request"),
        "a colon in an id": (turn(agent, "hi", conversation_id=f"{conversation}:msgs"), "invalid_request"),
    }
    for name, (body, code) in cases.items():
        terminal = client.wait(client.submit(body), timeout_s=30)
        assert isinstance(terminal, ev.Failed) and terminal.code == code, (name, terminal)
    now = _stored_state(workers.url, workers.prefix)
    assert sorted(set(now) ^ set(before)) == [], "keys left behind (or removed)"
    assert now == before
    assert workers.alive()
    # and the conversation continues normally
    after = client.wait(client.submit(turn(agent, "still here", conversation_id=conversation)), timeout_s=30)
    assert _users(after) == ["keep me", "still here"]


def test_a_parent_from_another_conversation_is_refused_and_changes_nothing(
    workers: WorkerPool, client: Client, make_agent: AgentFactory
) -> None:
    agent = make_agent("offline:echo")
    mine = client.wait(client.submit(turn(agent, "mine 1")), timeout_s=30)
    conversation = mine.conversation_id
    assert conversation is not None
    assert isinstance(client.wait(client.submit(turn(agent, "mine 2", conversation_id=conversation)), timeout_s=30),
                      ev.Succeeded)
    theirs = client.wait(client.submit(turn(agent, "theirs 1")), timeout_s=30)
    assert isinstance(theirs, ev.Succeeded) and theirs.conversation_id and theirs.message_id
    both = [conversation, theirs.conversation_id]
    before = _conversation_keys(client, both)
    kind, lease = before[client.keys.lease(conversation)]
    assert kind == "hash" and dict(lease)[b"fence"], "the lease and its fence are part of the comparison"

    foreign = turn(agent, "branch from theirs", conversation_id=conversation, parent_message_id=theirs.message_id)
    refused = client.wait(client.submit(foreign), timeout_s=30)
    assert isinstance(refused, ev.Failed) and refused.code == "invalid_request", refused
    assert theirs.message_id in refused.message
    assert "accepted" not in [e.type for e in client.events(refused.turn_id)]
    assert _conversation_keys(client, both) == before

    # the next normal turn continues from the tip, and sees the earlier turns
    after = client.wait(client.submit(turn(agent, "mine 3", conversation_id=conversation)), timeout_s=30)
    assert _users(after) == ["mine 1", "mine 2", "mine 3"]
    assert [m.query for m in client.thread(conversation)] == ["mine 1", "mine 2", "mine 3"]
    assert [m.query for m in client.thread(theirs.conversation_id)] == ["theirs 1"]


def test_follow_ups_submitted_before_the_first_turn_exists_run_behind_it_in_order(
    isolated: Callable[..., WorkerPool],
) -> None:
    """Turn 1 starts conversation `c-<turn 1>`; turns 2-5 name that conversation at once. They are
    all in the queue before any worker runs, so the follow-ups are resolved while the conversation
    does not exist yet: they wait in its line behind turn 1 instead of failing `conversation_not_found`."""
    pool = isolated()
    client = Client(pool.url, prefix=pool.prefix)
    client.put_agent(AgentConfig.model_validate({"id": "echo", "model": "offline:echo"}))
    first = f"first-{uuid.uuid4().hex}"
    conversation = new_conversation_id(first)
    ids = [client.submit(turn("echo", "q1", turn_id=first))]
    ids += [client.submit(turn("echo", f"q{n}", conversation_id=conversation)) for n in range(2, 6)]
    pool.start(processes=1)
    terminals = [client.wait(turn_id, timeout_s=60) for turn_id in ids]
    for n, terminal in enumerate(terminals, start=1):
        assert isinstance(terminal, ev.Succeeded), terminal
        assert terminal.conversation_id == conversation
        assert _users(terminal) == [f"q{i}" for i in range(1, n + 1)]
    thread = client.thread(conversation)
    assert [m.query for m in thread] == [f"q{n}" for n in range(1, 6)]
    assert [m.parent_id for m in thread] == [None, *ids[:-1]]
    # the line is empty and the lease free once the last turn ended
    assert not client.redis.exists(client.keys.turn_queue(conversation))
    assert not client.redis.hexists(client.keys.lease(conversation), "turn")
    client.close()


def test_follow_ups_named_before_the_first_turn_ends_wait_behind_it_on_busy_workers(
    workers: WorkerPool, client: Client, make_agent: AgentFactory
) -> None:
    """The same, with workers already running: turns 2-5 are submitted right after turn 1."""
    agent = make_agent("offline:echo")
    first = f"first-{uuid.uuid4().hex}"
    conversation = new_conversation_id(first)
    ids = [client.submit(turn(agent, "q1", turn_id=first))]
    ids += [client.submit(turn(agent, f"q{n}", conversation_id=conversation)) for n in range(2, 6)]
    for n, turn_id in enumerate(ids, start=1):
        terminal = client.wait(turn_id, timeout_s=60)
        assert isinstance(terminal, ev.Succeeded), terminal
        assert _users(terminal) == [f"q{i}" for i in range(1, n + 1)]
    assert [m.query for m in client.thread(conversation)] == [f"q{n}" for n in range(1, 6)]


def test_follow_ups_of_a_first_turn_refused_as_bad_input_are_not_left_waiting_behind_it(
    workers: WorkerPool, client: Client, make_agent: AgentFactory
) -> None:
    """Turn 1 took its place in the line of `c-<turn 1>` at submission, and is then refused (a
    field it may not have): the line must not keep it, or the turns naming that conversation would
    wait behind it forever. They fail `conversation_not_found`: the conversation never began."""
    agent = make_agent("offline:echo")
    first = f"first-{uuid.uuid4().hex}"
    conversation = new_conversation_id(first)
    refused = client.submit({**turn(agent, "q1", turn_id=first), "qeury": "typo"})
    follow_up = client.submit(turn(agent, "q2", conversation_id=conversation))
    terminal = client.wait(refused, timeout_s=30)
    assert isinstance(terminal, ev.Failed) and terminal.code == "invalid_request"
    after = client.wait(follow_up, timeout_s=15)
    assert isinstance(after, ev.Failed) and after.code == "conversation_not_found", after
    assert not client.redis.exists(client.keys.turn_queue(conversation))
    assert not client.redis.exists(client.keys.lease(conversation))
