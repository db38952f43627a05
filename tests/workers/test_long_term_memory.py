"""Long-term memory through real workers: a turn's facts are extracted after it ended (debounced, off
its critical path), recalled by the same user's next conversations only, corrected, forgotten, and
left alone by `memory: "off"` turns. `offline:echo` answers with the JSON of what it received, so an
answer shows whether the recalled block reached the model."""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Iterator

import pytest

from tests.conftest import AgentFactory, WorkerPool, turn
from tests.support.strict_server import StrictChatServer, message_text
from tests.support.turns import keys_of
from tests.support.wait import poll
from threadline.pipeline import events as ev
from threadline.pipeline.memory import MemoryRecord, Scope
from threadline.pipeline.recall import RECALL_HEADER
from threadline.workers.clients.client import Client
from threadline.workers.storage.memory import SyncMemoryStore

pytestmark = pytest.mark.integration


@pytest.fixture
def mem(client: Client) -> Iterator[SyncMemoryStore]:
    yield SyncMemoryStore(client.redis, client.keys)


@pytest.fixture
def user() -> str:
    """A user of its own per test (the session's prefix is shared)."""
    return f"u{uuid.uuid4().hex[:8]}"


def ask(client: Client, agent: str, query: str, *, user: str, tenant: str = "t1", **fields: object) -> ev.Succeeded:
    terminal = client.wait(client.submit({**turn(agent, query, **fields), "tenant_id": tenant, "user_id": user}),
                           timeout_s=30)
    assert isinstance(terminal, ev.Succeeded), terminal
    return terminal


def facts(records: list[MemoryRecord]) -> dict[str, str]:
    return {r.key or "": r.value for r in records if r.kind == "fact" and r.current}


def remembered(mem: SyncMemoryStore, scope: Scope, **expected: str) -> list[MemoryRecord]:
    """The partition's current records, once they hold `expected` (extraction runs after the turn)."""
    return poll(lambda: (found := mem.current(scope)) and expected.items() <= facts(found).items() and found,
                timeout_s=20)


def test_facts_of_one_conversation_reach_the_next_one_of_the_same_user_only(
        workers: WorkerPool, client: Client, make_agent: AgentFactory, mem: SyncMemoryStore, user: str) -> None:
    agent = make_agent("offline:echo", memory={"long_term": {}})
    first = ask(client, agent, "I'm Ada, I'm vegetarian, answer in Portuguese", user=user)
    assert RECALL_HEADER not in first.answer
    records = remembered(mem, Scope("t1", user), name="Ada", diet="vegetarian")
    assert facts(records)["preferred_language"].casefold() == "portuguese"
    assert all(r.source.conversation_id == first.conversation_id for r in records)
    decision = poll(lambda: client.decisions(first.turn_id).get("remember"), timeout_s=20)
    assert decision["writes"] >= 3 and "Ada" not in str(decision)
    second = ask(client, agent, "What should I cook tonight?", user=user)
    assert second.conversation_id != first.conversation_id
    assert RECALL_HEADER in second.answer and "Ada" in second.answer and "vegetarian" in second.answer
    assert client.decisions(second.turn_id)["history"]["recall"]["facts"]
    # another user of the tenant, the same user id in another tenant: nothing of Ada's
    for tenant, other in (("t1", f"{user}x"), ("t2", user)):
        answer = ask(client, agent, "What is my name?", user=other, tenant=tenant).answer
        assert "Ada" not in answer and RECALL_HEADER not in answer


def test_a_correction_supersedes_the_name_and_keeps_the_old_one_closed(
        workers: WorkerPool, client: Client, make_agent: AgentFactory, mem: SyncMemoryStore, user: str) -> None:
    agent = make_agent("offline:echo", memory={"long_term": {}})
    scope = Scope("t1", user)
    ask(client, agent, "I'm Ada, I'm vegetarian", user=user)
    remembered(mem, scope, name="Ada")
    ask(client, agent, "actually, call me Ana", user=user)
    current = remembered(mem, scope, name="Ana")
    names = [r for r in current if r.key == "name"]
    assert [r.value for r in names] == ["Ana"] and facts(current)["diet"] == "vegetarian"
    closed = [r for r in mem.read(scope)[0] if not r.current and r.key == "name"]
    assert [r.value for r in closed] == ["Ada"]
    assert closed[0].invalid_at is not None and closed[0].superseded_by == names[0].id
    answer = ask(client, agent, "Who am I?", user=user).answer
    assert "name: Ana" in answer and "name: Ada" not in answer


def test_forget_all_leaves_no_trace_of_the_memory_outside_the_conversations_it_came_from(
        workers: WorkerPool, client: Client, make_agent: AgentFactory, mem: SyncMemoryStore, user: str) -> None:
    agent = make_agent("offline:echo", memory={"long_term": {}})
    scope = Scope("t1", user)
    said = ask(client, agent, "I'm Zorblax, I live in Quuxtown", user=user)
    records = remembered(mem, scope, name="Zorblax")
    poll(lambda: client.decisions(said.turn_id).get("remember"), timeout_s=20)
    assert mem.forget_all(scope) > 0
    assert mem.current(scope) == [] and mem.read(scope) == ([], 0)
    assert not list(client.redis.scan_iter(f"{client.keys.prefix}:mem:{{t1/{user}}}*"))
    later = ask(client, agent, "Who am I?", user=user)
    assert "Zorblax" not in later.answer and RECALL_HEADER not in later.answer
    # what the user said stays where it was said (the conversation and its turn, deleted with the
    # conversation); nothing else under the prefix holds the memory's text or its ids
    owned = (client.keys.conversation(said.conversation_id), keys_of(client, said.turn_id).turn(said.turn_id))
    needles = [b"Zorblax", b"Quuxtown", *(r.id.encode() for r in records)]
    found = [key for key in client.redis.scan_iter(f"{client.keys.prefix}:*", count=1000)
             if not any(o in key.decode() for o in owned) and any(n in dump(client, key) for n in needles)]
    assert found == []


def dump(client: Client, key: bytes) -> bytes:
    """Everything a key holds, as bytes (its members, fields and values)."""
    r = client.redis
    kind = r.type(key).decode()
    if kind == "string":
        return r.get(key) or b""
    if kind == "hash":
        return b"\n".join(b"%s=%s" % kv for kv in r.hgetall(key).items())
    if kind == "list":
        return b"\n".join(r.lrange(key, 0, -1))
    if kind == "set":
        return b"\n".join(r.smembers(key))
    if kind == "zset":
        return b"\n".join(m for m, _ in r.zrange(key, 0, -1, withscores=True))
    if kind == "stream":
        return b"\n".join(b"%s=%s" % kv for _, fields in r.xrange(key) for kv in fields.items())
    return b""


def test_a_memory_off_turn_neither_sees_nor_feeds_memory(
        workers: WorkerPool, client: Client, make_agent: AgentFactory, mem: SyncMemoryStore, user: str) -> None:
    agent = make_agent("offline:echo", memory={"long_term": {}})
    scope = Scope("t1", user)
    ask(client, agent, "I'm Ada", user=user)
    remembered(mem, scope, name="Ada")
    revision = mem.revision(scope)
    off = ask(client, agent, "I'm vegetarian, answer in Portuguese", user=user, memory="off")
    assert RECALL_HEADER not in off.answer and "Ada" not in off.answer
    assert "recall" not in client.decisions(off.turn_id)["history"]
    # an "on" turn after it is consolidated after it: by then the "off" turn would have been too
    on = ask(client, agent, "I live in Lisbon", user=user)
    remembered(mem, scope, location="Lisbon")
    assert "diet" not in facts(mem.current(scope)) and mem.revision(scope) > revision
    assert "remember" not in client.decisions(off.turn_id) and "Ada" in on.answer


def test_the_same_fact_said_in_five_turns_is_one_record(
        workers: WorkerPool, client: Client, make_agent: AgentFactory, mem: SyncMemoryStore, user: str) -> None:
    agent = make_agent("offline:echo", memory={"long_term": {}})
    scope = Scope("t1", user)
    conversation = None
    ended = []
    for _ in range(5):
        terminal = ask(client, agent, "I'm vegetarian", user=user, conversation_id=conversation)
        conversation = terminal.conversation_id
        ended.append(terminal.turn_id)
    for turn_id in ended:  # every turn consolidated (folded into a batch or on its own)
        poll(lambda t=turn_id: client.decisions(t).get("remember"), timeout_s=20)
    everything, _ = mem.read(scope)
    assert [(r.key, r.value, r.current) for r in everything] == [("diet", "vegetarian", True)]


def test_the_recalled_block_keeps_one_leading_system_message_for_a_strict_template(
        workers: WorkerPool, client: Client, make_agent: AgentFactory, mem: SyncMemoryStore, user: str) -> None:
    with StrictChatServer() as server:
        agent = make_agent(server.model_config(strict_system=True), instructions="You help Ada.",
                           memory={"long_term": {}})
        ask(client, agent, "I'm Ada, I'm vegetarian", user=user)
        remembered(mem, Scope("t1", user), name="Ada", diet="vegetarian")
        first = ask(client, agent, "Hello again", user=user)
        body = server.requests[-1]
        follow_up = ask(client, agent, "And tomorrow?", user=user, conversation_id=first.conversation_id)
        again = server.requests[-1]
    for sent in (body, again):
        roles = [m["role"] for m in sent["messages"]]
        assert roles[0] == "system" and roles.count("system") == 1, roles
        assert all(a != b for a, b in itertools.pairwise(roles[1:])), roles  # user, assistant in turn
    texts = [message_text(m) for m in body["messages"]]
    # the block sits right before the query, after the (empty) history
    assert [m["role"] for m in body["messages"]] == ["system", "user", "assistant", "user"]
    assert texts[1].startswith(RECALL_HEADER) and "name: Ada" in texts[1] and texts[-1] == "Hello again"
    # the next turn of that conversation: the kept turn first, then the block, then the query
    assert [message_text(m) for m in again["messages"]][1:] == ["Hello again", first.answer, texts[1], texts[2],
                                                                 "And tomorrow?"]
    assert follow_up.conversation_id == first.conversation_id


def test_deleting_a_conversation_forgets_what_was_extracted_from_it(
        workers: WorkerPool, client: Client, make_agent: AgentFactory, mem: SyncMemoryStore, user: str) -> None:
    agent = make_agent("offline:echo", memory={"long_term": {}})
    scope = Scope("t1", user)
    kept = ask(client, agent, "I'm Ada", user=user)
    remembered(mem, scope, name="Ada")
    gone = ask(client, agent, "I'm vegetarian", user=user)
    remembered(mem, scope, name="Ada", diet="vegetarian")
    poll(lambda: client.decisions(gone.turn_id).get("remember"), timeout_s=20)
    assert client.delete_conversation(gone.conversation_id).status == "deleted"
    everything, _ = mem.read(scope)
    assert [(r.key, r.value) for r in everything] == [("name", "Ada")]
    assert everything[0].source.conversation_id == kept.conversation_id
