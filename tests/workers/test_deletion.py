"""Deleting a conversation through real workers: every key of it goes (rows, snapshots, summaries,
token counts, decision records, its turns' records and events) and every other key stays
byte-identical (`DUMP`); a busy conversation is refused; another tenant's is not found; retention
deletes the idle ones from the workers' periodic loop."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import redis

from tests.conftest import AgentFactory, WorkerPool, liveness_key, turn
from tests.support.turns import keys_of
from tests.support.wait import wait_until
from threadline.pipeline import events as ev
from threadline.pipeline.config import AgentConfig
from threadline.pipeline.records import MessageRecord
from threadline.pipeline.stages import DEFAULT_GRAPH
from threadline.workers.cli import common
from threadline.workers.cli import main as cli
from threadline.workers.clients.client import Client
from threadline.workers.protocol.keys import Keys
from threadline.workers.storage.conversations import DeleteResult

pytestmark = pytest.mark.integration

#: dramatiq's own bookkeeping (heartbeats, ack sets) and the workers' heartbeats change on their own;
#: they hold no conversation.
DumpAll = dict[str, tuple[bytes | None, bool]]


def dump_all(r: redis.Redis, keys: Keys) -> DumpAll:
    """Every key under the prefix (but the broker's queues, the workers' heartbeats and the rate-limit
    buckets, which earlier tests' requests leave to expire within a minute) as `DUMP` serialises it,
    and whether it expires."""
    prefix = keys.prefix
    skipped = (*(k.queue("") for k in keys.every_shard()), keys.heartbeats(), keys.worker(""), keys.workers(),
               f"{prefix}:ratelimit:")
    out: DumpAll = {}
    for raw in r.scan_iter(f"{prefix}:*", count=1000):
        key = raw.decode()
        if not key.startswith(skipped) and not liveness_key(key, prefix):
            out[key] = (r.dump(key), r.pttl(key) >= 0)
    return out


def tenant_listed(client: Client, tenant_id: str) -> list[str]:
    """The tenant's conversation index (one per shard in the sharded layout), its members by id."""
    return sorted(m.decode() for k in client.keys.every_shard()
                  for m in client.redis.zrange(k.tenant_conversations(tenant_id), 0, -1))


def run(client: Client, agent: str, queries: list[str], **fields: Any) -> tuple[str, list[str]]:
    """A conversation of one turn per query, each waited for; (its id, its turn ids)."""
    cid: str | None = fields.pop("conversation_id", None)
    ids = []
    for query in queries:
        terminal = client.wait(client.submit(turn(agent, query, conversation_id=cid, **fields)), timeout_s=30)
        assert isinstance(terminal, ev.Succeeded), terminal
        cid = terminal.conversation_id
        ids.append(terminal.turn_id)
    assert cid is not None
    return cid, ids


def compaction_settled(client: Client) -> bool:
    """No compaction message waits or runs (dramatiq deletes a message's body when it is acked)."""
    return all(client.redis.hlen(k.queue_messages(s.queue)) == 0
               for s in DEFAULT_GRAPH.of_kind("compaction") for k in client.keys.every_shard())


def delete_cli(client: Client, monkeypatch: pytest.MonkeyPatch, *args: str) -> int:
    monkeypatch.setenv("REDIS_URL", client.url)
    monkeypatch.setenv("TL_PREFIX", client.keys.prefix)
    with pytest.raises(SystemExit) as exited:
        cli.main(["conversations", "delete", *args])
    return int(exited.value.code or 0)


def test_delete_removes_every_key_of_the_conversation_and_leaves_every_other_key_byte_identical(
        workers: WorkerPool, client: Client, make_agent: AgentFactory, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    chat = make_agent({"provider": "offline", "name": "chat", "context_window": 600, "max_output_tokens": 80},
                      memory={"safety_margin_tokens": 40, "compaction": {"summariser": "offline:summary"}})
    a, a_turns = run(client, chat, [f"Question {n}: tell me something new, with more words to fill the window."
                                    for n in range(1, 7)])
    _, branch = run(client, chat, ["A branch from the first answer."], conversation_id=a, parent_message_id=a_turns[0])
    a_turns += branch
    tools = make_agent({"provider": "python", "name": "tests.support.models:tool_then_answer",
                        "options": {"tool": "clock", "only_when_asked": True}}, tools=["clock"])
    b, b_turns = run(client, tools, ["hello", "please use the tool", "thanks"])
    wait_until(lambda: compaction_settled(client) and client.redis.exists(client.keys.summaries(a)))
    k, r = client.keys, client.redis
    assert r.hlen(k.summaries(a)) and r.hlen(k.token_counts(a)) and r.hlen(k.decisions(a)) and r.hlen(k.snapshots(a))
    before = dump_all(r, k)
    ka = k.of_conversation(a)  # its turns' keys and the tenant's index it is listed in are in its shard
    index = ka.tenant_conversations("t1")
    listed = tenant_listed(client, "t1")
    assert a in listed and b in listed
    # its turns' shard pointers (sharded layout) hold no content: they stay until they expire
    pointers = {k.turn_shard(t) for t in a_turns}
    mine = {key for key in before if any(name in key for name in (a, *a_turns))} - pointers
    assert {ka.turn(t) for t in a_turns} | {ka.events(t) for t in a_turns} <= mine

    assert delete_cli(client, monkeypatch, a, "--tenant", "t1") == 0
    assert capsys.readouterr().out.strip() == f"deleted conversation {a}: 7 messages, 7 turns"

    after = dump_all(r, k)
    assert [key for key in after if any(name in key for name in (a, *a_turns)) and key not in pointers] == []
    # the tenant's conversation index loses exactly this conversation; every other key is as it was
    assert tenant_listed(client, "t1") == [c for c in listed if c != a]
    assert {key: v for key, v in after.items() if key != index} == {
        key: v for key, v in before.items() if key not in mine and key != index}
    assert ka.usage("t1") in after  # usage counters are billing history: kept
    assert client.thread(a) == [] and list(client.events(a_turns[-1])) == []
    # the other conversation goes on; the deleted one is not found, by a turn or by a second delete
    assert len(run(client, tools, ["and the tool again"], conversation_id=b)[1]) == 1
    gone = client.wait(client.submit(turn(chat, "anyone there?", conversation_id=a)), timeout_s=30)
    assert isinstance(gone, ev.Failed) and gone.code == "conversation_not_found"
    assert client.delete_conversation(a) == DeleteResult("not_found", a)
    other = client.conversation(b)
    assert other is not None and other.revision == len(b_turns) + 1


def test_busy_another_tenants_and_bad_ids_change_nothing(workers: WorkerPool, client: Client,
                                                         make_agent: AgentFactory,
                                                         monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    slow = make_agent({"provider": "offline", "name": "chat", "options": {"delay_ms": 50}})
    cid, _ = run(client, slow, ["first"])
    k = client.keys
    assert delete_cli(client, monkeypatch, cid, "--tenant", "someone-else") == 3
    assert delete_cli(client, monkeypatch, "not an id") == 2
    assert delete_cli(client, monkeypatch, "c-no-such-conversation") == 3
    running = client.submit(turn(slow, "a long answer, " * 20, conversation_id=cid))
    wait_until(lambda: client.turn_state(running).message_id)  # accepted: its row is written
    rows, conversation = client.redis.hgetall(k.messages(cid)), client.redis.hgetall(k.conversation(cid))
    assert delete_cli(client, monkeypatch, cid) == common.EXIT_BUSY
    assert f"turn {running} runs or waits" in capsys.readouterr().err
    # refused: the conversation as it was (the turn is still streaming its answer)
    assert client.turn_state(running).status == "running"
    assert (client.redis.hgetall(k.messages(cid)), client.redis.hgetall(k.conversation(cid))) == (rows, conversation)
    # --cancel: its turns are cancelled, then it is deleted once idle
    assert delete_cli(client, monkeypatch, cid, "--cancel", "--timeout", "20") == 0
    assert not client.redis.exists(*k.conversation_keys(cid))
    kt = keys_of(client, running)
    assert not client.redis.exists(kt.turn(running), kt.events(running))


#: How long the "old" conversations have been idle, by their own records (rewritten by the test):
#: far beyond the retention, which is far beyond anything a loaded machine adds to the fresh one's age.
IDLE_S = 3600.0
RETENTION_DAYS = 0.01  # 864 s


def age_message_rows(client: Client, conversation_id: str, by_s: float) -> None:
    """Make the conversation's messages `by_s` older, as the backfill reads them (their `updated_at`)."""
    key = client.keys.messages(conversation_id)
    for message_id, raw in client.redis.hgetall(key).items():
        row = MessageRecord.model_validate_json(raw)
        older = row.model_copy(update={"created_at": row.created_at - by_s, "updated_at": row.updated_at - by_s})
        client.redis.hset(key, message_id, older.model_dump_json())


def age_activity(client: Client, conversation_id: str, by_s: float) -> None:
    """Move the conversation's last activity (its score in the activity index) `by_s` back."""
    activity = client.keys.of_conversation(conversation_id).activity()
    score = client.redis.zscore(activity, conversation_id)
    assert score is not None, conversation_id
    client.redis.zadd(activity, {conversation_id: score - by_s}, xx=True)


def test_retention_deletes_idle_conversations_and_keeps_fresh_ones(isolated: Any, redis_url: str) -> None:
    """Idle an hour (their records say so: the test moves their times back instead of waiting), the
    old ones go at the next sweep; the fresh one, seconds old, stays."""
    pool: WorkerPool = isolated(env={"TL_RETENTION_DAYS": str(RETENTION_DAYS), "TL_WATCHDOG_S": "0.5"})
    client = Client(redis_url, prefix=pool.prefix)
    agent = f"agent-{uuid.uuid4().hex[:8]}"
    client.put_agent(AgentConfig.model_validate({"id": agent, "model": "offline:echo"}))
    # stored while retention was off (no index entry), its last message an hour ago: the first pass
    # puts it in the index
    legacy = f"c-legacy-{uuid.uuid4().hex[:8]}"
    client.import_conversation(conversation_id=legacy, tenant_id="t1", app_id="app", user_id="u1", agent_id=agent,
                               turns=[("q", "a", None)])
    client.redis.zrem(client.keys.of_conversation(legacy).activity(), legacy)
    age_message_rows(client, legacy, IDLE_S)
    pool.start()
    old, _ = run(client, agent, ["an old question"])
    imported = f"c-imported-{uuid.uuid4().hex[:8]}"
    client.import_conversation(conversation_id=imported, tenant_id="t1", app_id="app", user_id="u1", agent_id=agent,
                               turns=[("q", "a", None)])
    fresh, _ = run(client, agent, ["a fresh question"])
    for conversation in (old, imported):  # their turn has ended: nothing moves their activity again
        age_activity(client, conversation, IDLE_S)
    wait_until(lambda: all(client.conversation(c) is None for c in (old, imported, legacy)), timeout_s=30)
    assert client.conversation(fresh) is not None
    assert client.redis.zscore(client.keys.of_conversation(old).activity(), old) is None
    assert not client.redis.exists(*client.keys.conversation_keys(old))
    assert "conversation_expired" in pool.log_tail(200) and "activity_backfilled" in pool.log_tail(200)
    client.close()
