"""Long-term memory's Lua scripts (`memory_apply`, `memory_forget`, `memory_note`, `memory_lease`),
branch by branch, through `workers/storage/memory.py` on a real server (embedded Valkey, or
REDIS_URL); and the sync face giving what the async one gives. Every test has a key prefix of its own."""

from __future__ import annotations

import itertools
import json
import uuid
from collections.abc import AsyncIterator, Iterator

import pytest

from threadline.pipeline.consolidation import Consolidation, apply_user_edit, consolidate, forget
from threadline.pipeline.extraction import Proposal
from threadline.pipeline.memory import MemoryRecord, Provenance, Scope, record_to_json
from threadline.workers.protocol.keys import Keys
from threadline.workers.protocol.wire import build_message
from threadline.workers.storage.connect import async_plain_client, sync_client
from threadline.workers.storage.memory import (
    MemoryStore,
    PendingTurn,
    SyncMemoryStore,
    expire_call,
    forget_all_call,
    lease_call,
    memory_keys,
    note_call,
    records_from,
    scope_of_partition,
)

ADA = Scope("t1", "u1")
APP = Scope("t1", "u1", app_id="app")
OTHER = Scope("t1", "u2")


@pytest.fixture
async def mem(redis_url: str) -> AsyncIterator[MemoryStore]:
    prefix = f"tlm{uuid.uuid4().hex[:8]}"
    client = async_plain_client(redis_url)
    yield MemoryStore(client, Keys(prefix))
    async for key in client.scan_iter(f"{prefix}:*", count=1000):
        await client.delete(key)
    await client.aclose()


@pytest.fixture
def sync_mem(redis_url: str) -> Iterator[SyncMemoryStore]:
    prefix = f"tlm{uuid.uuid4().hex[:8]}"
    client = sync_client(redis_url)
    yield SyncMemoryStore(client, Keys(prefix))
    for key in client.scan_iter(f"{prefix}:*", count=1000):
        client.delete(key)
    client.close()


_ids = itertools.count()


def new_id() -> str:
    return f"m{next(_ids)}"


def said(records: list[MemoryRecord], scope: Scope, *facts: tuple[str, str], at: float = 10.0,
         turn: str = "t-1", notes: tuple[str, ...] = ()) -> Consolidation:
    proposals = [Proposal("add", "fact", key=k, value=v) for k, v in facts]
    proposals += [Proposal("add", "note", value=n, vector=(1.0, 0.5, 0.25)) for n in notes]
    return consolidate(records, proposals, scope=scope, now=at, new_id=new_id, turn_ended_at=at,
                       source=Provenance("extracted", "c1", turn, turn, "offline:facts", "1"))


def pending(turn_id: str, conversation_id: str = "c1", at: float = 1.0) -> PendingTurn:
    return PendingTurn(turn_id=turn_id, conversation_id=conversation_id, message_id=turn_id, ended_at=at,
                       agent_id="a1", config_ref="v1")


async def raw_hash(mem: MemoryStore, key: str) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in (await mem.redis.hgetall(key)).items()}


async def note(mem: MemoryStore, scope: Scope, turn: PendingTurn) -> str:
    mk = memory_keys(mem.keys, scope)
    message = build_message("remember", "remember", ({"turn_id": turn.turn_id},), message_id=f"msg-{turn.turn_id}",
                            now_ms=0)
    reply = await mem.call(note_call(mk, turn, message=message, channel=mem.keys.doorbell_channel(),
                                     queue_keys=(mem.keys.queue_messages("remember"), mem.keys.queue("remember")),
                                     flag_ms=60_000))
    return reply.decode()


# --- memory_apply -----------------------------------------------------------------------------------


async def test_apply_writes_current_records_and_the_fact_index(mem: MemoryStore) -> None:
    first = said([], ADA, ("name", "Ada"), ("diet", "vegetarian"))
    assert await mem.apply(ADA, first, revision=0)
    records, revision = await mem.read(ADA)
    assert revision > 0
    assert {(r.key, r.value) for r in records} == {("name", "Ada"), ("diet", "vegetarian")}
    facts = await raw_hash(mem, memory_keys(mem.keys, ADA).facts)
    assert facts == {r.key: r.id for r in records if r.key}
    meta = await raw_hash(mem, memory_keys(mem.keys, ADA).meta)
    assert (meta["tenant_id"], meta["user_id"], meta["partition"]) == ("t1", "u1", "t1/u1")
    assert await mem.redis.smembers(memory_keys(mem.keys, ADA).partitions) == {b""}
    assert await mem.redis.zscore(mem.keys.memory_activity(), "t1/u1") is not None


async def test_a_correction_closes_the_old_record_into_the_history(mem: MemoryStore) -> None:
    assert await mem.apply(ADA, said([], ADA, ("name", "Ada")), revision=0)
    records, revision = await mem.read(ADA)
    assert await mem.apply(ADA, said(records, ADA, ("name", "Ana"), at=20.0), revision=revision)
    after, _ = await mem.read(ADA)
    current = [r for r in after if r.current]
    closed = [r for r in after if not r.current]
    assert [r.value for r in current] == ["Ana"] and [r.value for r in closed] == ["Ada"]
    assert closed[0].superseded_by == current[0].id
    mk = memory_keys(mem.keys, ADA)
    assert await raw_hash(mem, mk.facts) == {"name": current[0].id}
    assert [m.decode() for m in await mem.redis.zrange(mk.history_order, 0, -1)] == [closed[0].id]


async def test_apply_is_refused_when_the_revision_moved(mem: MemoryStore) -> None:
    assert await mem.apply(ADA, said([], ADA, ("name", "Ada")), revision=0)
    stale = said([], ADA, ("diet", "vegan"))
    assert not await mem.apply(ADA, stale, revision=0)
    records, _ = await mem.read(ADA)
    assert [r.key for r in records] == ["name"]


async def test_nothing_changed_keeps_the_revision(mem: MemoryStore) -> None:
    assert await mem.apply(ADA, said([], ADA, ("name", "Ada")), revision=0)
    records, revision = await mem.read(ADA)
    again = said(records, ADA, ("name", "Ada"))
    assert not again.changed
    assert await mem.apply(ADA, again, revision=revision)
    assert await mem.revision(ADA) == revision


async def test_apply_marks_its_turns_done_and_refuses_a_turn_no_longer_pending(mem: MemoryStore) -> None:
    mk = memory_keys(mem.keys, ADA)
    assert await note(mem, ADA, pending("t-1")) == "queued"
    assert not await mem.apply(ADA, said([], ADA, ("name", "Ada")), revision=0, turn_ids=["t-1", "t-gone"])
    assert await mem.read(ADA) == ([], 0)
    assert await mem.apply(ADA, said([], ADA, ("name", "Ada")), revision=0, turn_ids=["t-1"])
    assert await mem.redis.hlen(mk.pending) == 0
    assert await mem.redis.zscore(mk.turns, "t-1") is not None


async def test_unpend_drops_pending_turns_without_marking_them(mem: MemoryStore) -> None:
    mk = memory_keys(mem.keys, ADA)
    await note(mem, ADA, pending("t-1"))
    assert await mem.apply(ADA, said([], ADA), revision=0, unpend=["t-1"])
    assert await mem.redis.hlen(mk.pending) == 0
    assert await mem.redis.zscore(mk.turns, "t-1") is None


async def test_deletes_leave_no_trace_of_the_record(mem: MemoryStore) -> None:
    assert await mem.apply(ADA, said([], ADA, ("name", "Ada")), revision=0)
    records, revision = await mem.read(ADA)
    assert await mem.apply(ADA, said(records, ADA, ("name", "Ana"), at=20.0), revision=revision)
    records, revision = await mem.read(ADA)
    gone = forget(records, scope=ADA, key="name")
    assert await mem.apply(ADA, gone, revision=revision)
    mk = memory_keys(mem.keys, ADA)
    assert await mem.read(ADA) == ([], await mem.revision(ADA))
    for key in (mk.records, mk.history, mk.facts, mk.vectors):
        assert await mem.redis.hlen(key) == 0
    assert await mem.redis.zcard(mk.history_order) == 0


async def test_history_is_trimmed_to_max_history(mem: MemoryStore) -> None:
    records: list[MemoryRecord] = []
    for i in range(5):
        _, revision = await mem.read(ADA)
        assert await mem.apply(ADA, said(records, ADA, ("name", f"Name{i}"), at=10.0 + i), revision=revision,
                               max_history=2)
        records, _ = await mem.read(ADA)
    closed = [r.value for r in records if not r.current]
    assert sorted(closed) == ["Name2", "Name3"]
    assert await mem.redis.hlen(memory_keys(mem.keys, ADA).history) == 2


async def test_vectors_are_stored_packed_and_come_back_with_their_notes(mem: MemoryStore) -> None:
    assert await mem.apply(ADA, said([], ADA, notes=("likes long walks by the sea",)), revision=0)
    [record] = await mem.current(ADA)
    assert record.vector == (1.0, 0.5, 0.25)
    stored = json.loads(await mem.redis.hget(memory_keys(mem.keys, ADA).records, record.id))
    assert stored["vector"] is None  # the float32 blob is the vector's only copy


async def test_a_user_edit_and_another_partition_stay_apart(mem: MemoryStore) -> None:
    edit = apply_user_edit([], scope=APP, value="Ada", key="name", now=5.0, new_id=new_id, origin="user")
    assert await mem.apply(APP, edit, revision=0)
    assert await mem.read(ADA) == ([], 0)
    assert [r.value for r in await mem.current(APP)] == ["Ada"]
    assert await mem.redis.smembers(memory_keys(mem.keys, APP).partitions) == {b"/app/app"}


def test_records_from_never_returns_another_partitions_record() -> None:
    mine = said([], ADA, ("name", "Ada")).writes[0]
    theirs = said([], OTHER, ("name", "Eve")).writes[0]
    stored = {mine.id.encode(): record_to_json(mine), theirs.id.encode(): record_to_json(theirs)}
    assert [r.value for r in records_from(stored, {}, ADA)] == ["Ada"]
    assert records_from(stored, {}, APP) == []


def test_a_partition_string_names_its_scope() -> None:
    for scope in (ADA, APP, Scope("t1", "u1", agent_id="bot")):
        assert scope_of_partition(scope.partition) == scope


# --- memory_forget ----------------------------------------------------------------------------------


async def test_forget_all_deletes_every_partition_of_the_user_only(mem: MemoryStore) -> None:
    assert await mem.apply(ADA, said([], ADA, ("name", "Ada")), revision=0)
    assert await mem.apply(APP, said([], APP, ("diet", "vegan")), revision=0)
    assert await mem.apply(OTHER, said([], OTHER, ("name", "Eve")), revision=0)
    await note(mem, APP, pending("t-9"))
    assert await mem.forget_all(ADA) > 0
    left = [k.decode() async for k in mem.redis.scan_iter(f"{mem.keys.prefix}:*")]
    assert left and all("{t1/u2}" in k or k.endswith(":q:remember") or k.endswith(":q:remember.msgs")
                        or k == mem.keys.memory_activity() for k in left)
    assert [m.decode() for m in await mem.redis.zrange(mem.keys.memory_activity(), 0, -1)] == ["t1/u2"]
    assert [r.value for r in await mem.current(OTHER)] == ["Eve"]


async def test_forget_all_is_refused_when_a_partition_appeared_unseen(mem: MemoryStore) -> None:
    assert await mem.apply(APP, said([], APP, ("diet", "vegan")), revision=0)
    assert await mem.call(forget_all_call(mem.keys, ADA, [""])) == -1
    assert [r.value for r in await mem.current(APP)] == ["vegan"]


async def test_retention_deletes_an_idle_partition_and_keeps_a_written_one(mem: MemoryStore) -> None:
    assert await mem.apply(ADA, said([], ADA, ("name", "Ada")), revision=0, now=100.0)
    assert await mem.apply(APP, said([], APP, ("diet", "vegan")), revision=0, now=100.0)
    assert await mem.call(expire_call(memory_keys(mem.keys, ADA), idle_before=50.0)) == -2
    assert await mem.call(expire_call(memory_keys(mem.keys, ADA), idle_before=150.0)) > 0
    assert await mem.read(ADA) == ([], 0)
    assert await mem.redis.smembers(memory_keys(mem.keys, ADA).partitions) == {b"/app/app"}
    assert [r.value for r in await mem.current(APP)] == ["vegan"]


async def test_forget_conversation_removes_only_what_that_conversation_said(mem: MemoryStore) -> None:
    first = said([], ADA, ("name", "Ada"))
    assert await mem.apply(ADA, first, revision=0)
    records, revision = await mem.read(ADA)
    other = consolidate(records, [Proposal("add", "fact", key="diet", value="vegan")], scope=ADA, now=20.0,
                        new_id=new_id, turn_ended_at=20.0, source=Provenance("extracted", "c2", "t-2", "t-2"))
    assert await mem.apply(ADA, other, revision=revision)
    await note(mem, ADA, pending("t-3", conversation_id="c1"))
    assert await mem.forget_conversation("t1", "c1", "u1") == 1
    assert [r.value for r in await mem.current(ADA)] == ["vegan"]
    assert await mem.redis.hlen(memory_keys(mem.keys, ADA).pending) == 0


# --- memory_note ------------------------------------------------------------------------------------


async def test_note_enqueues_once_then_folds_then_skips_a_done_turn(mem: MemoryStore) -> None:
    mk = memory_keys(mem.keys, ADA)
    assert await note(mem, ADA, pending("t-1")) == "queued"
    assert await note(mem, ADA, pending("t-2")) == "folded"
    assert await mem.redis.llen(mem.keys.queue("remember")) == 1
    assert await mem.redis.hlen(mk.pending) == 2
    assert await mem.apply(ADA, said([], ADA), revision=0, turn_ids=["t-1", "t-2"])
    assert await note(mem, ADA, pending("t-1")) == "done"
    assert await mem.redis.hlen(mk.pending) == 0


# --- memory_lease -----------------------------------------------------------------------------------


async def test_the_lease_is_taken_by_one_and_clears_the_queued_flag(mem: MemoryStore) -> None:
    mk = memory_keys(mem.keys, ADA)
    await note(mem, ADA, pending("t-1"))
    assert await mem.call(lease_call(mk, "take", "a", lease_ms=30_000)) == [1, 1]
    assert not await mem.redis.exists(mk.queued)
    taken, left = await mem.call(lease_call(mk, "take", "b", lease_ms=30_000))
    assert taken == 0 and 0 < left <= 30_000
    assert await mem.call(lease_call(mk, "take", "a", lease_ms=30_000)) == [1, 1]  # its message, redelivered


async def test_renew_only_by_the_holder(mem: MemoryStore) -> None:
    mk = memory_keys(mem.keys, ADA)
    await mem.call(lease_call(mk, "take", "a", lease_ms=1_000))
    assert await mem.call(lease_call(mk, "renew", "b", lease_ms=60_000)) == [0, 0]
    assert await mem.call(lease_call(mk, "renew", "a", lease_ms=60_000)) == [1, 0]
    assert await mem.redis.pttl(mk.lease) > 1_000


async def test_release_keeps_the_lease_while_turns_are_pending(mem: MemoryStore) -> None:
    mk = memory_keys(mem.keys, ADA)
    await mem.call(lease_call(mk, "take", "a", lease_ms=30_000))
    await note(mem, ADA, pending("t-1"))  # ended during the extraction: its message bounces off the lease
    assert await mem.call(lease_call(mk, "release", "b", lease_ms=30_000)) == [-1, 0]
    assert await mem.call(lease_call(mk, "release", "a", lease_ms=30_000)) == [1, 1]
    assert await mem.redis.get(mk.lease) == b"a"
    assert await mem.apply(ADA, said([], ADA), revision=0, turn_ids=["t-1"])
    assert await mem.call(lease_call(mk, "release", "a", lease_ms=30_000)) == [0, 0]
    assert not await mem.redis.exists(mk.lease)


# --- the sync face ----------------------------------------------------------------------------------


def test_the_sync_face_reads_writes_and_forgets_alike(sync_mem: SyncMemoryStore) -> None:
    assert sync_mem.apply(ADA, said([], ADA, ("name", "Ada")), revision=0)
    _, revision = sync_mem.read(ADA)
    assert sync_mem.revision(ADA) == revision > 0
    assert not sync_mem.apply(ADA, said([], ADA, ("diet", "vegan")), revision=0)
    assert [r.value for r in sync_mem.current(ADA)] == ["Ada"]
    assert sync_mem.forget_conversation("t1", "c1", "u1") == 1
    assert sync_mem.apply(ADA, said([], ADA, ("name", "Ada")), revision=sync_mem.revision(ADA))
    assert sync_mem.forget_all(ADA) > 0
    assert list(sync_mem.redis.scan_iter(f"{sync_mem.keys.prefix}:*")) == []
