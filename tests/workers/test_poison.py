"""Hostile input on a queue: each poison message is dead-lettered with a stable reason, leaves nothing
behind in the queue's hash or any ack set, and the normal turns fetched in the same batch finish.

Every case is written with raw Redis commands, as docs/protocol.md's raw-producer section does, in one
MULTI together with five normal turns, so that the bad message and the good ones share a fetch."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from dramatiq.message import Message

from tests.conftest import OwnPool, own_pool, turn
from tests.support.wait import poll
from threadline.workers.worker.broker import _parse_message, _Refused

pytestmark = [pytest.mark.integration,
              pytest.mark.one_server("raw messages written in one MULTI on one server's queue keys")]

#: Text no log line may carry: it stands for user text inside a bad message.
SENTINEL = "POISON-USER-TEXT-5c1e"
NORMAL_TURNS = 5


@pytest.fixture(scope="module")
def env(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[OwnPool]:
    """One worker process on a prefix of its own for the whole module (what `isolated` gives one
    test). Four threads: the resolve consumer prefetches 8, so a case's six messages are one fetch."""
    with own_pool(redis_url, tmp_path_factory.mktemp("logs"), tag="tli") as env:
        yield env


def message(mid: str, actor: str = "resolve", **fields: Any) -> dict[str, Any]:
    """A dramatiq message on the resolve queue, as docs/protocol.md's raw producer writes it."""
    return {
        "queue_name": "resolve", "actor_name": actor, "args": [], "kwargs": {},
        "options": {"redis_message_id": mid}, "message_id": mid, "message_timestamp": int(time.time() * 1000),
        **fields,
    }


def encode(fields: dict[str, Any]) -> bytes:
    return json.dumps(fields).encode()


def too_deep(mid: str, agent: str) -> bytes:
    depth = 100_000
    head = encode(message(mid)).replace(b'"args": []', b'"args": [' + b"[" * depth + json.dumps(SENTINEL).encode())
    return head.replace(b'"kwargs"', b"]" * depth + b'], "kwargs"', 1)


def invalid_json(mid: str, agent: str) -> bytes:
    return encode(message(mid, args=[turn(agent, SENTINEL, turn_id=mid)]))[:-1] + b", oops"


def json_array(mid: str, agent: str) -> bytes:
    return json.dumps([message(mid, args=[turn(agent, SENTINEL, turn_id=mid)])]).encode()


def args_not_a_list(mid: str, agent: str) -> bytes:
    return encode(message(mid, args={"0": turn(agent, SENTINEL, turn_id=mid)}))


def wrong_queue_name(mid: str, agent: str) -> bytes:
    # dramatiq would hand it to the consumer of "elsewhere" when done: a KeyError in a worker thread
    return encode(message(mid, queue_name="elsewhere", args=[turn(agent, SENTINEL, turn_id=mid)]))


def no_redis_message_id(mid: str, agent: str) -> bytes:
    # dramatiq acks by this id: without it the message would stay in the hash and the ack set
    return encode(message(mid, options={}, args=[turn(agent, SENTINEL, turn_id=mid)]))


def unknown_actor(mid: str, agent: str) -> bytes:
    return encode(message(mid, actor="no_such_actor", args=[turn(agent, SENTINEL, turn_id=mid)]))


Case = Callable[[str, str], bytes | None]

CASES: dict[str, tuple[Case, str]] = {
    "nested_100000_deep": (too_deep, "too_deep"),
    "invalid_json": (invalid_json, "undecodable: JSONDecodeError"),
    "json_array": (json_array, "malformed: not_an_object"),
    "args_not_a_list": (args_not_a_list, "malformed: args"),
    "wrong_queue_name": (wrong_queue_name, "malformed: queue_name"),
    "no_redis_message_id": (no_redis_message_id, "malformed: options.redis_message_id"),
    "id_without_body": (lambda mid, agent: None, "missing_body"),
    "unknown_actor": (unknown_actor, "unknown_actor: no_such_actor"),
}


def send_with_normal_turns(env: OwnPool, bad_id: str, body: bytes | None) -> list[str]:
    """The bad message first, then five normal turns, in one MULTI; then the doorbell."""
    ns, r = env.ns, env.redis
    pipe = r.pipeline(transaction=True)
    if body is not None:
        pipe.hset(f"{ns}:resolve.msgs", bad_id, body)
    pipe.rpush(f"{ns}:resolve", bad_id)
    turn_ids = []
    for i in range(NORMAL_TURNS):
        mid = f"ok-{uuid.uuid4().hex[:12]}"
        request = {"schema": "threadline.turn/v1", "turn_id": mid, **turn(env.agent, f"normal {i}")}
        pipe.hset(f"{ns}:resolve.msgs", mid, encode(message(mid, args=[request])))
        pipe.rpush(f"{ns}:resolve", mid)
        turn_ids.append(mid)
    pipe.execute()
    r.publish(f"{env.pool.prefix}:doorbell", "resolve")
    return turn_ids


def dead_letters(env: OwnPool, redis_id: str) -> list[dict[str, str]]:
    entries = env.redis.xrange(f"{env.pool.prefix}:deadletters")
    rows = [{k.decode(): v.decode() for k, v in fields.items()} for _, fields in entries]
    return [row for row in rows if row["message_id"] == redis_id]


def leftovers(env: OwnPool, redis_id: str) -> list[str]:
    """Where anything of `redis_id` (or of any resolve message) is still held."""
    ns, r = env.ns, env.redis
    found = []
    if r.hlen(f"{ns}:resolve.msgs"):
        found.append(f"resolve.msgs holds {r.hkeys(f'{ns}:resolve.msgs')}")
    if redis_id.encode() in r.lrange(f"{ns}:resolve", 0, -1):
        found.append("resolve list")
    for key in r.scan_iter(f"{ns}:__acks__.*", count=1000):
        if key.decode().endswith(".resolve") and r.scard(key):
            found.append(f"{key.decode()} holds {r.smembers(key)}")
    return found


@pytest.mark.parametrize("case", list(CASES))
def test_poison_message_is_dead_lettered_and_its_batch_finishes(env: OwnPool, case: str) -> None:
    build, reason = CASES[case]
    bad_id = f"bad-{case}-{uuid.uuid4().hex[:8]}"
    body = build(bad_id, env.agent)
    turn_ids = send_with_normal_turns(env, bad_id, body)

    for turn_id in turn_ids:
        terminal = env.client.wait(turn_id, timeout_s=10)
        assert terminal.type == "succeeded", terminal
    assert env.pool.alive(), env.pool.log_tail()

    entries = poll(lambda: dead_letters(env, bad_id))
    assert entries == [{"queue": "resolve", "message_id": bad_id, "actor": entries[0]["actor"], "reason": reason}]
    poll(lambda: not leftovers(env, bad_id))
    assert leftovers(env, bad_id) == []
    if body is not None:  # dramatiq's own dead-letter set keeps the body
        assert env.redis.hget(f"{env.ns}:resolve.XQ.msgs", bad_id) == body
        assert env.redis.zscore(f"{env.ns}:resolve.XQ", bad_id) is not None
    assert SENTINEL not in env.pool.log_path.read_text()


def test_a_producer_sets_no_option_that_steers_dramatiq() -> None:
    body = json.dumps({
        "queue_name": "resolve", "actor_name": "resolve", "args": [{}], "kwargs": {}, "message_id": "m1",
        "message_timestamp": 1, "options": {"redis_message_id": "m1", "max_retries": 10**9, "max_age": 10**12,
                                            "pipe_target": {"actor_name": "cancel"}, "on_failure": "cancel"},
    }).encode()
    message = _parse_message(body, redis_id="m1", queue_name="resolve", actors={"resolve"})
    assert isinstance(message, Message)
    assert message.options == {"redis_message_id": "m1"}
    # stored under another hash field than it claims: its ack would remove another message
    assert _parse_message(body, redis_id="m2", queue_name="resolve", actors={"resolve"}) == _Refused(
        "malformed: options.redis_message_id", "resolve")
