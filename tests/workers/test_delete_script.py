"""delete_conversation.lua branch by branch, through `Store.delete_conversation` on a real server, and
the activity index that admit.lua and finish.lua keep for retention. No worker processes: turns are
driven through the store as the runners drive them (`tests/workers/test_scripts.py`)."""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import AsyncIterator, Callable

import pytest

from tests.support.dump import Dump, dump
from tests.support.script_driver import LAST, MODEL, make_turn
from threadline.pipeline.stages import DEFAULT_GRAPH
from threadline.workers.clients.client import Client
from threadline.workers.settings import Settings
from threadline.workers.storage import lua
from threadline.workers.storage.connect import async_plain_client
from threadline.workers.storage.conversations import DeleteResult, delete_result, deletion
from threadline.workers.storage.store import Store

StoreFactory = Callable[..., Store]


@pytest.fixture
async def stores(redis_url: str) -> AsyncIterator[StoreFactory]:
    """`stores(retention_days=...)`: a store on a key prefix of its own, removed afterwards."""
    made: list[Store] = []

    def make(retention_days: float = 1.0) -> Store:
        settings = dataclasses.replace(Settings.from_env({}), prefix=f"tld{uuid.uuid4().hex[:8]}",
                                       redis_url=redis_url, retention_days=retention_days)
        made.append(Store(async_plain_client(redis_url), settings, DEFAULT_GRAPH))
        return made[-1]

    yield make
    for s in made:
        async for key in s.redis.scan_iter(f"{s.settings.prefix}:*", count=1000):
            await s.redis.delete(key)
        await s.close()


async def finished_conversation(store: Store, turns: int = 2) -> tuple[str, list[str]]:
    """A conversation of `turns` finished turns, with token counts, a summary and a decision record."""
    first = await make_turn(store)
    ids, cid = [], first.cid
    for n in range(turns):
        t = first if n == 0 else await make_turn(store, conversation_id=cid)
        await t.run_to(LAST)
        assert await t.finish() == "ok"
        ids.append(t.id)
    await store.save_token_counts(cid, dict.fromkeys(ids, 42), "tiktoken:o200k_base")
    await store.save_summary(cid, ids[0], {"text": "a summary"})
    await store.redis.hset(store.keys.decisions(cid), f"{ids[-1]}:history", "{}")
    return cid, ids


def keys_of(seen: Dump, *names: str) -> set[str]:
    return {key for key in seen if any(name in key for name in names)}


async def test_delete_removes_the_conversation_and_its_turns_and_nothing_else(stores: StoreFactory) -> None:
    store = stores()
    k = store.keys
    cid, ids = await finished_conversation(store)
    other, _ = await finished_conversation(store, turns=1)
    running = await make_turn(store, conversation_id=other)  # the other conversation is busy meanwhile
    await running.run_to(MODEL)
    before = await dump(store.redis, store.settings.prefix)
    mine = keys_of(before, cid, *ids)
    stages = [s.name for s in DEFAULT_GRAPH.turn_stages]
    # what there was to delete: every kind of the conversation's keys, and its turns' records and events
    assert {k.conversation(cid), k.messages(cid), k.message_order(cid), k.snapshots(cid), k.token_counts(cid),
            k.summaries(cid), k.decisions(cid), k.lease(cid), *(k.turn(t) for t in ids),
            *(k.events(t) for t in ids)} <= mine
    assert mine <= {*k.conversation_keys(cid), *(key for t in ids for key in k.turn_keys(t, stages))}

    assert await store.delete_conversation(cid) == DeleteResult("deleted", cid, messages=2, turns=2)

    after = await dump(store.redis, store.settings.prefix)
    assert keys_of(after, cid, *ids) == set()
    # the activity index and the tenant's conversation index lose exactly this conversation
    indexes = (k.activity(), k.tenant_conversations("t1"))
    for index in indexes:
        kind, members, expires = before[index]
        assert after[index] == (kind, [(m, score) for m, score in members if m != cid.encode()], expires)
    assert {key: v for key, v in before.items() if key not in mine and key not in indexes} == {
        key: v for key, v in after.items() if key not in indexes}
    assert await store.redis.zscore(k.running(), running.id) is not None
    assert await store.delete_conversation(cid) == DeleteResult("not_found", cid)


@pytest.mark.parametrize("how", ["running", "waiting", "submitted"])
async def test_a_conversation_with_a_turn_running_or_waiting_is_refused(stores: StoreFactory, how: str) -> None:
    store = stores()
    cid, _ = await finished_conversation(store, turns=1)
    t = await make_turn(store, conversation_id=cid)
    blocking = [t.id]
    if how == "running":
        await t.run_to(MODEL)
    elif how == "waiting":  # behind a turn that holds the conversation
        holder = await make_turn(store, conversation_id=cid)
        await holder.accept()
        assert (await t.admit())[0] == "waiting"
        blocking = [holder.id, t.id]
    else:  # its producer took its place in the line; no worker has seen it yet
        client = Client(store.settings.redis_url or "", prefix=store.settings.prefix)
        client.submit(t.req.model_dump(mode="json", by_alias=True))
        client.close()
    before = await dump(store.redis, store.settings.prefix)
    result = await store.delete_conversation(cid)
    assert (result.status, list(result.blocking)) == ("busy", blocking)
    assert await dump(store.redis, store.settings.prefix) == before


async def test_a_missing_conversation_or_another_tenants_is_not_found_and_nothing_changes(
        stores: StoreFactory) -> None:
    store = stores()
    cid, _ = await finished_conversation(store, turns=1)
    before = await dump(store.redis, store.settings.prefix)
    assert (await store.delete_conversation("c-no-such-conversation")).status == "not_found"
    assert (await store.delete_conversation(cid, tenant_id="t2")).status == "not_found"
    assert await dump(store.redis, store.settings.prefix) == before
    assert (await store.delete_conversation(cid, tenant_id="t1")).status == "deleted"


async def test_rows_that_changed_since_they_were_read_are_read_again(stores: StoreFactory) -> None:
    store = stores()
    cid, ids = await finished_conversation(store)
    before = await dump(store.redis, store.settings.prefix)
    script = store.redis.register_script(lua.source("delete_conversation"))
    rows = {mid: mid for mid in ids}
    for stale, tenant in (({ids[0]: ids[0]}, "t1"), ({**rows, "m-gone": "m-gone"}, "t1"),  # a row missing, unknown
                          (rows, "t2")):  # the index of another tenant than the conversation's
        keys, arg = deletion(store.keys, DEFAULT_GRAPH, cid, tenant_id=None, rows=stale, stored_tenant=tenant)
        assert delete_result(cid, await script(keys=keys, args=[arg])) is None
    assert await dump(store.redis, store.settings.prefix) == before
    assert (await store.delete_conversation(cid)).turns == 2


async def test_the_activity_index_follows_admissions_and_turn_ends_while_retention_is_on(
        stores: StoreFactory) -> None:
    store = stores(retention_days=1.0)
    index = store.keys.activity()
    t = await make_turn(store)
    t0 = time.time()
    await t.run_to(MODEL)
    admitted = await store.redis.zscore(index, t.cid)
    assert admitted is not None and t0 <= admitted <= time.time()
    assert await t.finish() == "ok"
    ended = await store.redis.zscore(index, t.cid)
    assert ended is not None and ended > admitted
    # a first turn refused after its admission leaves no conversation, and no index entry
    refused = await make_turn(store)
    assert (await refused.admit())[0] == "admitted"
    assert await store.redis.zscore(index, refused.cid) is not None
    assert await refused.end("failed", code="agent_not_found") == "ok"
    assert await store.redis.zscore(index, refused.cid) is None


async def test_without_retention_no_index_is_kept(stores: StoreFactory) -> None:
    store = stores(retention_days=0)
    t = await make_turn(store)
    await t.run_to(MODEL)
    assert await t.finish() == "ok"
    assert not await store.redis.exists(store.keys.activity())


async def test_an_index_entry_without_a_conversation_goes_unless_its_first_turn_is_on_its_way(
        stores: StoreFactory) -> None:
    store = stores()
    index = store.keys.activity()
    await store.redis.zadd(index, {"c-never-created": 1.0})
    assert (await store.delete_conversation("c-never-created")).status == "not_found"
    assert await store.redis.zscore(index, "c-never-created") is None
    first = await make_turn(store)
    assert (await first.admit())[0] == "admitted"  # it creates its conversation only when accepted
    assert (await store.delete_conversation(first.cid)).status == "not_found"
    assert await store.redis.zscore(index, first.cid) is not None
