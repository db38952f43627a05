"""The producers' side of the sharded key layout (`TL_SHARDS`) on one server, with no workers: the
layout record (written by the first producer with a count, read by everyone after), submits onto
the turn's shard (queue keys, line, shard pointer, doorbell), readers by turn id through the
pointer (the turn's keys written by hand, as a worker writes them), and the indexes read over every
shard (conversations, usage, queue sizes, dead letters). One server's layout is unchanged: the
other client, gateway and operations tests run in it."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from tests.conftest import drop_prefix, turn
from tests.support.cli import cli_env, cli_runner
from tests.support.wait import poll
from threadline.pipeline import events as ev
from threadline.pipeline.config import AgentConfig
from threadline.pipeline.ids import new_conversation_id
from threadline.workers.clients.async_client import AsyncClient
from threadline.workers.clients.client import Client
from threadline.workers.clients.common import ADMIT_QUEUE
from threadline.workers.clients.layout import merged_page
from threadline.workers.operations.status import Operations
from threadline.workers.protocol.keys import Keys
from threadline.workers.protocol.names import CONTROL_QUEUE
from threadline.workers.settings import Settings
from threadline.workers.storage.api_keys import KeyRing
from threadline.workers.storage.connect import nodes_serving, sync_client

SHARDS = 4


@pytest.fixture
def fresh(redis_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A key prefix of its own (every key under it removed afterwards), TL_SHARDS unset."""
    monkeypatch.delenv("TL_SHARDS", raising=False)
    name = f"tlsh{uuid.uuid4().hex[:8]}"
    yield name
    r = sync_client(redis_url)
    drop_prefix(r, name)
    r.close()


@pytest.fixture
def sharded(redis_url: str, fresh: str) -> Iterator[Client]:
    c = Client(redis_url, prefix=fresh, shards=SHARDS)
    yield c
    c.close()


def conversations_in_distinct_shards(layout: Keys, count: int) -> list[str]:
    """Conversation ids, one per shard until `count` shards are covered."""
    found: dict[int, str] = {}
    while len(found) < count:
        cid = f"c-{uuid.uuid4().hex[:12]}"
        found.setdefault(layout.shard_of(cid) or 0, cid)
    return list(found.values())


def write_turn(r: redis.Redis, layout: Keys, turn_id: str, conversation_id: str, *, tenant: str = "t1") -> None:
    """A finished turn as the workers leave it: its pointer, record and events in its shard."""
    shard = layout.shard_of(conversation_id)
    k = layout.on(shard)
    r.set(layout.turn_shard(turn_id), str(shard))
    r.hset(k.turn(turn_id), mapping={"status": "succeeded", "conversation_id": conversation_id,
                                     "message_id": turn_id, "tenant_id": tenant})
    accepted = ev.Accepted(turn_id=turn_id, seq=1, conversation_id=conversation_id, message_id=turn_id,
                           parent_message_id=None, config_version="v1")
    done = ev.Succeeded(turn_id=turn_id, seq=2, answer="hi there", conversation_id=conversation_id)
    for event in (accepted, done):
        r.xadd(k.events(turn_id), {"json": event.model_dump_json()})


# --- the layout record ------------------------------------------------------------------------------


def test_the_first_producer_with_a_count_writes_the_layout_and_later_ones_use_it(
        redis_url: str, fresh: str, sharded: Client) -> None:
    assert sharded.keys.shards == SHARDS
    stored = json.loads(sharded.redis.get(Keys(fresh).layout()) or b"{}")
    assert stored["shards"] == SHARDS and len(stored["tags"]) == SHARDS
    with Client(redis_url, prefix=fresh) as from_env, Client(redis_url, prefix=fresh, shards=2) as other:
        assert from_env.shards == 0 and from_env.keys.shards == SHARDS
        assert other.keys.shards == SHARDS, "the stored layout wins over the client's own count"

    async def from_async() -> int:
        async with AsyncClient(redis_url, prefix=fresh) as aclient:
            return (await aclient.layout()).shards

    assert asyncio.run(from_async()) == SHARDS


@pytest.mark.one_server("a client without TL_SHARDS, where one server's layout is allowed")
def test_a_producer_of_one_server_layout_writes_nothing(redis_url: str, fresh: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    with Client(redis_url, prefix=fresh) as client:
        assert client.keys == Keys(fresh)
        assert not client.redis.exists(Keys(fresh).layout())
    monkeypatch.setenv("TL_SHARDS", str(SHARDS))
    with Client(redis_url, prefix=fresh) as client:
        assert client.shards == SHARDS and client.keys.shards == SHARDS, "TL_SHARDS is the default count"


# --- submitting --------------------------------------------------------------------------------------


def test_a_submit_goes_onto_its_conversations_shard_with_its_pointer_and_doorbell(
        redis_url: str, fresh: str, sharded: Client) -> None:
    layout = Keys(fresh, SHARDS)
    cid = f"c-{uuid.uuid4().hex[:12]}"
    bound = layout.of_conversation(cid)
    first = next(t for t in iter(lambda: uuid.uuid4().hex, "")
                 if layout.shard_of(new_conversation_id(t)) != bound.shard)
    [node] = nodes_serving(redis_url, [bound.doorbell_channel()])  # a shard channel is heard on its node
    listener = sync_client(node)
    bell = listener.pubsub(ignore_subscribe_messages=True)
    bell.ssubscribe(bound.doorbell_channel())
    try:
        follow_up = sharded.submit(turn("bot", "hi", conversation_id=cid))
        new = sharded.submit(turn("bot", "a first turn", turn_id=first))
        r = sharded.redis
        queued = [m.decode() for m in r.lrange(bound.queue(ADMIT_QUEUE), 0, -1)]
        assert len(queued) == 1
        body = json.loads(r.hget(bound.queue_messages(ADMIT_QUEUE), queued[0]) or b"")
        assert body["queue_name"] == ADMIT_QUEUE and body["args"][0]["turn_id"] == follow_up
        assert [m.decode() for m in r.zrange(bound.turn_queue(cid), 0, -1)] == [follow_up]
        assert r.get(layout.turn_shard(follow_up)) == str(bound.shard).encode()
        assert 0 < r.ttl(layout.turn_shard(follow_up)) <= 6 * 3600 + 86_400
        # a first turn: the shard of the conversation it starts
        own = layout.of_conversation(new_conversation_id(first))
        assert r.get(layout.turn_shard(new)) == str(own.shard).encode()
        assert any(first.encode() in body for body in r.hvals(own.queue_messages(ADMIT_QUEUE)))
        assert not r.exists(Keys(fresh).queue(ADMIT_QUEUE)), "nothing in one server's layout"
        message = poll(lambda: bell.get_message(timeout=0.1), timeout_s=10)
        assert message["data"] == ADMIT_QUEUE.encode(), "the doorbell rings the canonical queue name"
    finally:
        bell.close()
        listener.close()


def test_a_cancel_goes_onto_the_turns_shard_and_an_unknown_turn_is_no_cancel(sharded: Client) -> None:
    layout = sharded.keys
    cid = f"c-{uuid.uuid4().hex[:12]}"
    handle = sharded.submit(turn("bot", "hi", conversation_id=cid))
    assert handle.cancel("enough") == "enqueued"
    (mid,) = sharded.redis.lrange(layout.of_conversation(cid).queue(CONTROL_QUEUE), 0, -1)
    body = json.loads(sharded.redis.hget(layout.of_conversation(cid).queue_messages(CONTROL_QUEUE), mid) or b"")
    assert body["queue_name"] == CONTROL_QUEUE and body["args"] == [handle, "enough"]
    assert sharded.cancel(uuid.uuid4().hex) == "noop: unknown"


def test_the_same_turn_id_in_another_conversation_is_not_enqueued_again(sharded: Client) -> None:
    sharded.put_agent(AgentConfig.model_validate({"id": "bot", "model": "offline:echo"}))
    one, two = conversations_in_distinct_shards(sharded.keys, 2)
    request = turn("bot", "hi", turn_id=uuid.uuid4().hex, conversation_id=one)
    assert sharded.start(request, owner="t1").created
    assert not sharded.start({**request, "conversation_id": two}, owner="t1").created
    assert not sharded.redis.exists(sharded.keys.of_conversation(two).queue(ADMIT_QUEUE))


# --- reading by turn id ----------------------------------------------------------------------------


def test_readers_by_turn_id_find_the_turn_in_its_shard(redis_url: str, fresh: str, sharded: Client) -> None:
    layout = sharded.keys
    turn_id, cid = uuid.uuid4().hex, f"c-{uuid.uuid4().hex[:12]}"
    write_turn(sharded.redis, layout, turn_id, cid)
    with Client(redis_url, prefix=fresh) as reader:  # knows the turn by its pointer only
        state = reader.turn_state(turn_id)
        assert state.status == "succeeded" and state.conversation_id == cid
        assert [e.type for e in reader.events(turn_id)] == ["accepted", "succeeded"]
        assert reader.wait(turn_id, timeout_s=5).answer == "hi there"
        terminal = reader.terminal(turn_id)
        assert terminal is not None and terminal.type == "succeeded"
        assert reader.owner(turn_id) == "t1" and reader.turn_exists(turn_id)
        assert reader.cancel(turn_id) == "noop: succeeded"
        unknown = uuid.uuid4().hex
        assert reader.turn_state(unknown).status == "" and list(reader.events(unknown)) == []
        assert reader.terminal(unknown) is None and reader.owner(unknown) is None
        assert not reader.turn_exists(unknown)
        with pytest.raises(TimeoutError):
            reader.wait(unknown, timeout_s=0.5)

    async def from_async() -> tuple[Any, ...]:
        async with AsyncClient(redis_url, prefix=fresh) as aclient:
            events = [e.type async for e in aclient.events(turn_id)]
            return (events, (await aclient.turn_state(turn_id)).status, await aclient.owner(turn_id),
                    await aclient.cancel(turn_id), await aclient.owner(uuid.uuid4().hex),
                    await aclient.cancel(uuid.uuid4().hex))

    assert asyncio.run(from_async()) == (["accepted", "succeeded"], "succeeded", "t1", "noop: succeeded", None,
                                         "noop: unknown")


def test_a_follower_finds_a_turn_whose_pointer_comes_later(sharded: Client) -> None:
    turn_id, cid = uuid.uuid4().hex, f"c-{uuid.uuid4().hex[:12]}"
    events = sharded.events(turn_id, follow=True, timeout_s=20)
    write_turn(sharded.redis, sharded.keys, turn_id, cid)
    assert [e.type for e in events] == ["accepted", "succeeded"]


def test_the_async_client_submits_onto_the_turns_shard(redis_url: str, fresh: str, sharded: Client) -> None:
    sharded.put_agent(AgentConfig.model_validate({"id": "bot", "model": "offline:echo"}))
    cid = f"c-{uuid.uuid4().hex[:12]}"

    async def scenario() -> str:
        async with AsyncClient(redis_url, prefix=fresh) as aclient:
            handle = await aclient.start(turn("bot", "hi", conversation_id=cid), owner="t1")
            assert await aclient.cancel(handle) == "enqueued"
            return str(handle)

    turn_id = asyncio.run(scenario())
    bound = sharded.keys.of_conversation(cid)
    assert sharded.redis.get(sharded.keys.turn_shard(turn_id)) == str(bound.shard).encode()
    assert sharded.redis.llen(bound.queue(ADMIT_QUEUE)) == 1 and sharded.redis.llen(bound.queue(CONTROL_QUEUE)) == 1
    assert sharded.redis.hget(bound.turn(turn_id), "tenant_id") == b"t1"


# --- indexes over every shard ----------------------------------------------------------------------


def test_a_tenants_conversations_merge_over_shards_by_last_activity(sharded: Client) -> None:
    sharded.put_agent(AgentConfig.model_validate({"id": "bot", "model": "offline:echo"}))
    ids = conversations_in_distinct_shards(sharded.keys, SHARDS) + [f"c-{uuid.uuid4().hex[:12]}" for _ in range(4)]
    for score, cid in enumerate(ids, start=1):
        sharded.import_conversation(conversation_id=cid, tenant_id="t1", app_id="app", user_id="u1", agent_id="bot",
                                    turns=[("q", "a", None)])
        sharded.redis.zadd(sharded.keys.of_conversation(cid).tenant_conversations("t1"), {cid: score})
    gone = f"c-{uuid.uuid4().hex[:12]}"
    sharded.redis.zadd(sharded.keys.of_conversation(gone).tenant_conversations("t1"), {gone: 100})
    newest_first = list(reversed(ids))
    assert [c.id for c in sharded.conversations("t1", limit=3)] == newest_first[:2], "the stale id is dropped"
    assert [c.id for c in sharded.conversations("t1", limit=3)] == newest_first[:3]
    assert [c.id for c in sharded.conversations("t1", limit=3, offset=3)] == newest_first[3:6]
    assert not sharded.redis.zscore(sharded.keys.of_conversation(gone).tenant_conversations("t1"), gone)
    assert sharded.redis.zscore(sharded.keys.of_conversation(ids[0]).activity(), ids[0])
    deleted = sharded.delete_conversation(ids[0], tenant_id="t1")
    assert deleted.status == "deleted" and sharded.conversation(ids[0]) is None


def test_merged_pages_order_as_one_sorted_set() -> None:
    pages = [[(b"b", 2.0), (b"a", 1.0)], [(b"c", 2.0), (b"ab", 1.0)]]
    assert merged_page(pages, 0, 10) == ["c", "b", "ab", "a"]
    assert merged_page(pages, 1, 2) == ["b", "ab"]


def test_operations_sum_usage_queues_and_dead_letters_over_shards(sharded: Client) -> None:
    layout, r = sharded.keys, sharded.redis
    cids = conversations_in_distinct_shards(layout, 3)
    for n, cid in enumerate(cids, start=1):
        r.hincrby(layout.of_conversation(cid).usage("t1"), "input_tokens", n)
        r.hincrby(layout.of_conversation(cid).usage("t1"), "turns", 1)
        sharded.submit(turn("bot", "hi", conversation_id=cid))
    ops = Operations(r, Keys(layout.prefix), stored_layout=True)
    usage = ops.usage("t1")
    assert (usage.input_tokens, usage.turns) == (6, 3)
    resolve = next(q for q in ops.status().queues if q.name == ADMIT_QUEUE)
    assert resolve.depth == 3 and resolve.oldest_age_s is not None
    # a dead letter in two shards: listed, shown, replayed onto its own shard's queue, purged
    letters = []
    for cid in cids[:2]:
        k, mid = layout.of_conversation(cid), uuid.uuid4().hex
        body = json.dumps({"queue_name": ADMIT_QUEUE, "actor_name": "resolve", "args": [{}], "kwargs": {},
                           "options": {}, "message_id": mid, "message_timestamp": 1})
        r.zadd(k.dead_queue(ADMIT_QUEUE), {mid: 1000})
        r.hset(k.dead_queue_messages(ADMIT_QUEUE), mid, body)
        r.xadd(k.dead_letters(), {"queue": ADMIT_QUEUE, "message_id": mid, "actor": "resolve", "reason": "boom"})
        letters.append((k, mid))
    listed = ops.dead_letters()
    assert sorted(d.message_id for d in listed) == sorted(m for _, m in letters)
    assert {d.reason for d in listed} == {"boom"}
    shown = ops.dead_letter(letters[1][1])
    assert shown is not None and shown.letter.reason == "boom"
    k, mid = letters[0]
    assert ops.replay(mid) == "replayed"
    assert mid.encode() in r.lrange(k.queue(ADMIT_QUEUE), 0, -1)
    assert ops.purge() == 1 and ops.dead_letters() == []


# --- the gateway ------------------------------------------------------------------------------------


def test_the_gateway_submits_and_reads_turns_in_their_shard(redis_url: str, fresh: str, sharded: Client) -> None:
    from fastapi.testclient import TestClient

    from threadline.workers.gateway.app import create_app

    sharded.put_agent(AgentConfig.model_validate({"id": "bot", "model": "offline:echo"}))
    ring = KeyRing(sharded.redis, sharded.keys)
    tenant_key, user_key = ring.create("acme")[0], ring.create("acme", user_id="u1")[0]
    other_user = ring.create("acme", user_id="u2")[0]
    settings = dataclasses.replace(Settings.from_env({}), prefix=fresh, redis_url=redis_url)  # TL_SHARDS 0: stored 4
    with TestClient(create_app(settings, redis_url, console_dir=None)) as http:
        def get(path: str, key: str) -> Any:
            return http.get(path, headers={"Authorization": f"Bearer {key}"})

        posted = http.post("/v1/turns", json={"app_id": "app", "user_id": "u1", "agent_id": "bot", "query": "hi",
                                              "turn_id": "order-1"}, headers={"Authorization": f"Bearer {user_key}"})
        assert posted.status_code == 202, posted.text
        accepted = posted.json()
        stored = next(t.decode().removeprefix(f"{fresh}:turnshard:")
                      for t in sharded.redis.scan_iter(f"{fresh}:turnshard:*"))
        shard = sharded.keys.of_conversation(new_conversation_id(stored))
        assert sharded.redis.get(sharded.keys.turn_shard(stored)) == str(shard.shard).encode()
        assert sharded.redis.llen(shard.queue(ADMIT_QUEUE)) == 1
        assert sharded.redis.get(shard.turn_user(stored)) == b"u1", "the user marker is in the turn's shard"
        # queued: found by its pointer, seen by its user and its tenant, not by another user
        assert get(accepted["turn_url"], user_key).json()["status"] == "queued"
        assert get(accepted["turn_url"], tenant_key).status_code == 200
        assert get(accepted["turn_url"], other_user).status_code == 404
        write_turn(sharded.redis, sharded.keys, stored, new_conversation_id(stored), tenant="acme")
        answer = get(accepted["turn_url"], user_key).json()
        assert answer["status"] == "succeeded" and answer["result"]["answer"] == "hi there"
        events = get(accepted["events_url"], user_key)
        assert events.status_code == 200 and "event: succeeded" in events.text
        assert http.post(f"{accepted['turn_url']}/cancel", headers={"Authorization": f"Bearer {user_key}"}
                         ).json()["result"] == "noop: succeeded"
        assert get("/v1/turns/nope/events", user_key).status_code == 404


def test_a_layout_record_of_another_schema_is_refused(redis_url: str, fresh: str) -> None:
    with Client(redis_url, prefix=fresh) as client:
        client.redis.set(Keys(fresh).layout(), json.dumps({"schema": "threadline.layout/v9", "shards": 4}))
        with pytest.raises(ValueError, match=r"threadline\.layout/v1"):
            client.keys  # noqa: B018


# --- the command line -------------------------------------------------------------------------------


def test_the_cli_reads_and_writes_in_the_stored_layout(redis_url: str, fresh: str, sharded: Client,
                                                      monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """TL_SHARDS unset: the commands use the layout the data is in (4 shards)."""
    cli_env(monkeypatch, redis_url=redis_url, prefix=fresh, data_dir=tmp_path)
    run = cli_runner(capsys)
    sharded.put_agent(AgentConfig.model_validate({"id": "bot", "model": "offline:echo"}))
    layout = sharded.keys
    cid = f"c-{uuid.uuid4().hex[:12]}"
    submitted = run("submit", "--agent", "bot", "--query", "hi", "--tenant", "t1", "--app", "app", "--user", "u1",
                    "--conversation", cid)
    assert submitted.code == 0, submitted.err
    turn_id = submitted.out.split()[0]
    assert sharded.redis.get(layout.turn_shard(turn_id)) == str(layout.shard_of(cid)).encode()
    for n, other in enumerate(conversations_in_distinct_shards(layout, 2), start=1):
        sharded.redis.hincrby(layout.of_conversation(other).usage("t1"), "turns", n)
    usage = run("usage", "t1", "--json")
    assert usage.code == 0 and json.loads(usage.out)["turns"] == 3, usage.err
    status = run("status", "--json")
    assert status.code == 0, status.err
    assert next(q for q in json.loads(status.out)["queues"] if q["name"] == ADMIT_QUEUE)["depth"] == 1
    assert run("cancel", turn_id).code == 0
    assert sharded.redis.llen(layout.of_conversation(cid).queue(CONTROL_QUEUE)) == 1
