"""`threadline status`, `dead-letters list|show|replay|purge` and `usage`, run in-process through
`cli.main` against one real worker process on a prefix of its own (a purge must not touch the
shared pool's dead letters). The pool serves every queue but `compact`, so that a message waits
there for `status` to see."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import OwnPool, drop_prefix, own_pool, turn
from tests.support.turns import raw_message
from tests.support.wait import poll
from threadline.pipeline.config import AgentConfig
from threadline.pipeline.stages import DEFAULT_GRAPH
from threadline.workers.cli import main as cli
from threadline.workers.clients.layout import request_shard
from threadline.workers.operations.status import Operations
from threadline.workers.protocol.keys import Keys
from threadline.workers.protocol.names import queues
from threadline.workers.settings import shards_from_env
from threadline.workers.storage.connect import sync_client

pytestmark = pytest.mark.integration

UNSERVED = "compact"
#: A credential inside a dead letter's arguments: `show` must not print it.
SECRET = "sk-proj-abcdefghijklmnopqrstuvwxyz0123"


@pytest.fixture(scope="module")
def env(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[OwnPool]:
    served = tuple(q for q in queues(DEFAULT_GRAPH) if q != UNSERVED)
    with own_pool(redis_url, tmp_path_factory.mktemp("logs"), tag="tlo", queues=served) as env:
        yield env


@pytest.fixture
def run(env: OwnPool, redis_url: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> Any:
    """`run("status", "--json")` -> (exit code, stdout, stderr) of `threadline ...` in this process."""
    monkeypatch.setenv("REDIS_URL", redis_url)
    monkeypatch.setenv("TL_PREFIX", env.pool.prefix)
    monkeypatch.setenv("TL_LOG_FORMAT", "json")

    def invoke(*argv: str) -> tuple[int, str, str]:
        capsys.readouterr()
        with pytest.raises(SystemExit) as exited:
            cli.main(list(argv))
        out, err = capsys.readouterr()
        return int(exited.value.code or 0), out, err

    return invoke


def listed(run: Any, queue: str | None = None) -> dict[str, dict[str, Any]]:
    code, out, _ = run("dead-letters", "list", "--json", *(("--queue", queue) if queue else ()))
    assert code == 0
    return {d["message_id"]: d for d in json.loads(out)}


def turn_shard(env: OwnPool, turn_id: str) -> Keys:
    """The keys of the shard a raw producer's first turn `turn_id` goes to (one server's: its keys)."""
    return env.client.keys.on(request_shard(env.client.keys, None, turn_id))


def stream_entries(env: OwnPool, mid: str) -> list[dict[str, str]]:
    entries = [e for k in env.client.keys.every_shard() for e in env.redis.xrange(k.dead_letters())]
    rows = [{k.decode(): v.decode() for k, v in fields.items()} for _, fields in entries]
    return [row for row in rows if row["message_id"] == mid]


def test_status_shows_the_queues_the_workers_and_a_turn_in_flight(env: OwnPool, run: Any, tmp_path: Path) -> None:
    # a message that waited a minute on the queue nobody serves
    waiting = f"old-{uuid.uuid4().hex[:8]}"
    k = turn_shard(env, waiting)
    env.redis.hset(k.queue_messages(UNSERVED), waiting,
                   raw_message(UNSERVED, waiting, UNSERVED, [{}], message_timestamp=int(time.time() * 1000) - 60_000))
    env.redis.rpush(k.queue(UNSERVED), waiting)
    release = tmp_path / "release"
    slow = f"agent-{uuid.uuid4().hex[:10]}"
    env.client.put_agent(AgentConfig.model_validate({"id": slow, "model": {
        "provider": "python", "name": "tests.support.models:streaming",
        "options": {"words": 2000, "delay_ms": 5, "until": str(release)}}}))
    turn_id = env.client.submit(turn(slow, "hold on"))
    try:
        # streaming: the turn is in flight (and the model has something to answer when released)
        assert poll(lambda: any(e.type == "text_delta" for e in env.client.events(turn_id)), timeout_s=10)
        status = json.loads(run("status", "--json")[1])
        assert status["turns"]["count"] == 1
        assert status["turns"]["oldest_turn_id"] == turn_id
        assert status["turns"]["oldest_age_s"] < 30
        # the one live worker process, from its heartbeat: which queues it consumes
        (worker,) = status["workers"]
        assert status["workers_alive"] == 1
        assert worker["pid"] == env.pool.procs[0].pid and worker["host"] and worker["since"] <= time.time()
        assert set(worker["queues"]) == set(queues(DEFAULT_GRAPH)) - {UNSERVED}
        by_name = {q["name"]: q for q in status["queues"]}
        assert list(by_name) == list(queues(DEFAULT_GRAPH))
        assert {name: q["consumers"] for name, q in by_name.items()} == {
            name: 0 if name == UNSERVED else 1 for name in by_name}
        assert by_name[UNSERVED]["depth"] == 1
        assert 59 <= by_name[UNSERVED]["oldest_age_s"] < 120
        assert by_name["resolve"]["depth"] == 0 and by_name["resolve"]["oldest_age_s"] is None
        code, out, _ = run("status")
        assert code == 0
        assert f"turns in flight: 1 (oldest {turn_id}:" in out
        assert "workers alive: 1" in out and f"no worker consumes: {UNSERVED}" in out
        rows = {line.split()[0]: line.split() for line in out.splitlines()[1:len(by_name) + 1]}
        assert rows[UNSERVED][:2] == [UNSERVED, "1"] and rows[UNSERVED][-1] == "0", out
        assert rows["invoke"][-1] == "1", out
    finally:
        release.touch()
    terminal = env.client.wait(turn_id, timeout_s=20)
    assert terminal.type == "succeeded", terminal
    env.redis.delete(k.queue(UNSERVED), k.queue_messages(UNSERVED))
    assert json.loads(run("status", "--json")[1])["turns"]["count"] == 0


def test_a_poison_message_is_listed_shown_replayed_and_purged(env: OwnPool, run: Any) -> None:
    poison = f"bad-{uuid.uuid4().hex[:8]}"
    args = [{**turn(env.agent, "hi", turn_id=poison), "api_key": SECRET}]
    k = turn_shard(env, poison)
    env.redis.hset(k.queue_messages("resolve"), poison, raw_message("resolve", poison, "no_such_actor", args))
    env.redis.rpush(k.queue("resolve"), poison)
    env.redis.publish(k.doorbell_channel(), "resolve")

    letter = poll(lambda: listed(run).get(poison))
    assert letter is not None
    assert (letter["queue"], letter["actor"], letter["reason"]) == ("resolve", "no_such_actor",
                                                                   "unknown_actor: no_such_actor")
    assert abs(letter["dead_at"] - time.time()) < 30
    code, out, _ = run("dead-letters", "list")
    assert code == 0 and poison in out and "unknown_actor: no_such_actor" in out

    code, out, _ = run("dead-letters", "show", poison)
    assert code == 0
    assert "reason: unknown_actor: no_such_actor" in out and "actor: no_such_actor" in out
    assert '"query": "hi"' in out and SECRET not in out and "***" in out
    code, out, err = run("dead-letters", "show", "no-such-id")
    assert (code, out) == (3, "") and len(err.strip().splitlines()) == 1

    # back on its queue: a worker fetches it and refuses it again, with a second stream entry
    assert run("dead-letters", "replay", poison)[:2] == (0, f"replayed {poison}\n")
    assert poll(lambda: len(stream_entries(env, poison)) == 2)
    assert poll(lambda: poison in listed(run))
    assert run("dead-letters", "replay", "no-such-id")[0] == 3

    code, _, err = run("dead-letters", "purge")
    assert code == 2 and "pass --yes" in err
    assert poison in listed(run)
    purged = run("dead-letters", "purge", "--older-than", "3600", "--yes")
    assert purged[1] == "purged 0 dead letters older than 3600 s\n"
    assert poison in listed(run)
    code, out, _ = run("dead-letters", "purge", "--yes")
    assert code == 0 and out.startswith("purged ")
    assert listed(run) == {}
    assert sum(env.redis.hlen(s.dead_queue_messages("resolve")) for s in env.client.keys.every_shard()) == 0


def test_a_replayed_turn_request_is_processed(env: OwnPool, run: Any) -> None:
    """A turn request dramatiq gave up on (its actor raised until the retries ran out, say while a
    dependency was down), left as its `nack` leaves it: replayed, the turn runs and succeeds."""
    turn_id = uuid.uuid4().hex
    request = {"schema": "threadline.turn/v1", **turn(env.agent, "again", turn_id=turn_id)}
    body = raw_message("resolve", turn_id, "resolve", [request])
    spent = json.loads(body)
    spent["options"].update(retries=5, traceback="ConnectionError: down")
    k = turn_shard(env, turn_id)
    env.redis.zadd(k.dead_queue("resolve"), {turn_id: int(time.time() * 1000)})
    env.redis.hset(k.dead_queue_messages("resolve"), turn_id, json.dumps(spent))
    env.redis.xadd(k.dead_letters(), {"queue": "resolve", "message_id": turn_id, "actor": "resolve",
                                      "reason": "failed: ConnectionError"})
    assert listed(run, "resolve")[turn_id]["reason"] == "failed: ConnectionError"

    assert run("dead-letters", "replay", turn_id, "--queue", "resolve")[0] == 0
    terminal = env.client.wait(turn_id, timeout_s=10)
    assert terminal.type == "succeeded", terminal
    assert turn_id not in listed(run)
    assert run("dead-letters", "replay", turn_id)[0] == 3


def test_usage_reads_the_tenant_counters(env: OwnPool, run: Any) -> None:
    tenant = f"tenant-{uuid.uuid4().hex[:8]}"
    terminals = [env.client.wait(env.client.submit(turn(env.agent, f"question {i}", tenant_id=tenant)), timeout_s=10)
                 for i in range(2)]
    usages = [t.usage for t in terminals if t.type == "succeeded"]
    assert len(usages) == 2
    code, out, _ = run("usage", tenant, "--json")
    assert code == 0
    assert json.loads(out) == {"tenant_id": tenant, "turns": 2, "requests": sum(u.requests for u in usages),
                               "input_tokens": sum(u.input_tokens for u in usages),
                               "output_tokens": sum(u.output_tokens for u in usages), "other": {},
                               "cache_read_tokens": 0, "cache_write_tokens": 0, "cost_usd": 0.0,
                               "unpriced_turns": 2, "conversation_id": None}
    assert sum(u.input_tokens for u in usages) > 0
    code, out, _ = run("usage", tenant)
    assert code == 0 and out.startswith(f"tenant {tenant}: 2 turns")
    assert json.loads(run("usage", "nobody", "--json")[1])["turns"] == 0

    # one conversation's turns: its rows summed the same way
    cid = terminals[0].conversation_id
    assert cid is not None
    follow = env.client.wait(env.client.submit(turn(env.agent, "and?", tenant_id=tenant, conversation_id=cid)),
                             timeout_s=10)
    assert follow.type == "succeeded"
    code, out, _ = run("usage", "--conversation", cid, "--json")
    mine = json.loads(out)
    assert code == 0 and (mine["conversation_id"], mine["tenant_id"], mine["turns"]) == (cid, tenant, 2)
    assert mine["input_tokens"] == usages[0].input_tokens + follow.usage.input_tokens
    assert mine["output_tokens"] == usages[0].output_tokens + follow.usage.output_tokens
    assert run("usage", "--conversation", cid)[1].startswith(f"conversation {cid} (tenant {tenant}): 2 turns")
    assert run("usage", "--conversation", "c-nosuch")[0] == 3
    assert run("usage")[0] == 2 and run("usage", tenant, "--conversation", cid)[0] == 2


def test_workers_alive_and_queue_consumers_come_from_the_heartbeat_keys(redis_url: str) -> None:
    """A process counts while its heartbeat key lives (it expires `TL_WORKER_TIMEOUT_S` after the
    last renewal): a registry entry the watchdog has not reaped yet is not a consumer."""
    keys = Keys(f"tlw{uuid.uuid4().hex[:8]}", shards_from_env())  # the session's layout: fleet keys share a slot
    r = sync_client(redis_url)
    try:
        r.hset(keys.workers(), mapping={"w-fast": "b1", "w-invoke": "b2", "w-dead": "b3", "w-fading": "b4"})
        r.set(keys.worker("w-fast"), json.dumps({"pid": 11, "host": "h", "queues": ["control", "resolve"],
                                                 "since": 1.5}))
        r.set(keys.worker("w-invoke"), json.dumps({"pid": 12, "host": "h", "queues": ["control", "invoke"]}))
        r.set(keys.worker("w-fading"), json.dumps({"pid": 13, "queues": ["invoke"]}), px=300)
        ops = Operations(r, keys)
        status = ops.status()
        assert status.workers_alive == 3
        assert [(w.worker_id, w.pid) for w in status.workers] == [("w-fading", 13), ("w-fast", 11), ("w-invoke", 12)]
        consumers = {q.name: q.consumers for q in status.queues}
        assert (consumers["control"], consumers["invoke"], consumers["resolve"], consumers["map"]) == (2, 2, 1, 0)
        assert poll(lambda: ops.status().workers_alive == 2, timeout_s=5)
        assert {q.name: q.consumers for q in ops.status().queues}["invoke"] == 1
        # a heartbeat whose JSON says nothing useful is still a live process, consuming nothing known
        r.set(keys.worker("w-dead"), b"not json")
        assert ops.status().workers_alive == 3 and ops.status().workers[0].queues == ()
    finally:
        drop_prefix(r, keys.prefix)
        r.close()
