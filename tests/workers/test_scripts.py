"""Each Lua script of the turn state machine, branch by branch, through its typed `Store` method on a
real server (embedded Valkey, or REDIS_URL). No worker processes: a test drives a turn the way the
runners do (admit → begin → advance(accept) → begin/advance … → begin(claim) → finish) and asserts
on the stored keys and the turn's event stream. Every test has a key prefix of its own."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from redis.asyncio.client import PubSub

from tests.support.dump import dump
from tests.support.script_driver import (
    AGENT,
    FIRST,
    LAST,
    MODEL,
    SECOND,
    STAGES,
    THIRD,
    Turn,
    make_request,
    make_turn,
    new_id,
)
from threadline.pipeline import events
from threadline.pipeline.contracts import Envelope, Usage, new_conversation_id
from threadline.pipeline.errors import ConversationNotFound
from threadline.pipeline.persist import new_conversation, pending_row
from threadline.pipeline.resolve import resolve_turn
from threadline.pipeline.stages import DEFAULT_GRAPH
from threadline.workers.clients.client import Client
from threadline.workers.protocol.schema import conversation_to_hash
from threadline.workers.protocol.wire import build_message
from threadline.workers.storage import lua
from threadline.workers.storage.store import Store
from threadline.workers.storage.turns import WAKE_ID, Accept, Begin, Next

SCRIPTS = Path(lua.__file__).parent / "scripts"
# --- reading back -----------------------------------------------------------------------------------


async def stream(store: Store, turn_id: str) -> list[events.Event]:
    return [events.decode(fields[b"json"]) for _, fields in await store.redis.xrange(store.keys.events(turn_id))]


async def hash_of(store: Store, key: str) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in (await store.redis.hgetall(key)).items()}


async def members(store: Store, key: str) -> list[str]:
    return [m.decode() for m in await store.redis.zrange(key, 0, -1)]


async def conversation_keys(store: Store, cid: str) -> list[str]:
    return [k.decode() async for k in store.redis.scan_iter(f"{store.keys.conversation(cid)}*")]


def assert_gapless(seen: list[events.Event]) -> None:
    assert [e.seq for e in seen] == list(range(1, len(seen) + 1))


def terminals(seen: list[events.Event]) -> list[events.Event]:
    return [e for e in seen if events.is_terminal(e)]


@contextlib.asynccontextmanager
async def listening(store: Store, channel: str) -> AsyncIterator[PubSub]:
    """Subscribed to `channel`: the doorbell of the sharded layout rides sharded pub/sub (SPUBLISH)."""
    sharded = bool(store.keys.shards) and channel == store.keys.doorbell_channel()
    pubsub = store.redis.pubsub()
    await (pubsub.ssubscribe(channel) if sharded else pubsub.subscribe(channel))
    for _ in range(50):  # the confirmation comes first
        if (m := await pubsub.get_message(timeout=0.1)) is not None and m["type"] in ("subscribe", "ssubscribe"):
            break
    else:
        raise TimeoutError(f"not subscribed to {channel}")
    try:
        yield pubsub
    finally:
        await (pubsub.sunsubscribe() if sharded else pubsub.unsubscribe())
        await pubsub.aclose()


async def published(pubsub: PubSub, wait_s: float = 0.3) -> list[str]:
    """What was published on the subscribed channel so far (waits `wait_s` for the last one)."""
    seen: list[str] = []
    while (m := await pubsub.get_message(ignore_subscribe_messages=True, timeout=wait_s)) is not None:
        seen.append(m["data"].decode())
    return seen


async def queued(store: Store, queue: str) -> tuple[list[bytes], dict[bytes, bytes]]:
    """A queue's list of message ids and its messages."""
    return (await store.redis.lrange(store.keys.queue(queue), 0, -1),
            await store.redis.hgetall(store.keys.queue_messages(queue)))


def decode_message(raw: bytes) -> dict[str, Any]:
    return json.loads(raw)


# --- admit ------------------------------------------------------------------------------------------


async def test_admit_first_run_takes_the_lease_with_fence_1(store: Store) -> None:
    t = await make_turn(store)
    k = store.keys
    assert await t.admit() == ("admitted", "1")
    turn = await hash_of(store, k.turn(t.id))
    assert turn["status"] == "running" and turn["fence"] == "1" and turn["conversation_id"] == t.cid
    assert await store.redis.ttl(k.turn(t.id)) == -1  # a live turn's record never expires
    assert await hash_of(store, k.lease(t.cid)) == {"turn": t.id, "fence": "1"}
    assert await members(store, k.turn_queue(t.cid)) == [t.id]
    assert await store.redis.hget(k.waiting(t.cid), t.id) == t.request
    assert await store.redis.zscore(k.running(), t.id) is not None
    # admission is not acceptance: nothing of the conversation itself yet
    assert not await store.redis.exists(k.conversation(t.cid), k.messages(t.cid), k.message_order(t.cid))


async def test_admit_of_the_same_turn_again_keeps_its_fence(store: Store) -> None:
    t = await make_turn(store)
    assert await t.admit() == ("admitted", "1")
    assert await t.admit() == ("admitted", "1")
    assert await hash_of(store, store.keys.lease(t.cid)) == {"turn": t.id, "fence": "1"}
    assert await members(store, store.keys.turn_queue(t.cid)) == [t.id]

async def test_an_admitted_turn_has_its_admit_stage_begun_by_the_admission_and_again_by_a_redelivery(
        store: Store) -> None:
    """What begin.lua writes for a stage (its name, holder and progress, the running score) the
    admission writes for the admit stage, which therefore needs no begin of its own."""
    t = await make_turn(store)
    k = store.keys
    first = await store.admit(t.id, t.cid, now=100.0, request=t.request, holder="w1")
    assert first.status == "admitted"
    # nothing stored yet: the admit stage writes the first artifact
    assert first.begin == Begin(status="go", attempt=1, admitted="", previous="", conversation_id=t.cid, fence="1",
                                deadline_at=None)
    record = await hash_of(store, k.turn(t.id))
    assert (record["stage"], record["holder"], record["progress_at"]) == (FIRST, "w1", "100")
    assert await stream(store, t.id) == []  # the admit stage announces itself when it accepts
    assert await store.redis.zscore(k.running(), t.id) == 100.0
    again = await store.admit(t.id, t.cid, now=200.0, request=t.request, holder="w2")  # another worker's delivery
    assert again.begin is not None and again.begin.fence == "1"
    record = await hash_of(store, k.turn(t.id))
    assert (record["holder"], record["progress_at"]) == ("w2", "200")
    assert await store.redis.zscore(k.running(), t.id) == 200.0
    # a turn that waits has begun nothing
    second = await make_turn(store, conversation_id=t.cid)
    waiting = await store.admit(second.id, second.cid, now=300.0, request=second.request, holder="w1")
    assert waiting[:2] == ("waiting", t.id) and waiting.begin is None
    assert "holder" not in await hash_of(store, k.turn(second.id))



async def test_admit_of_a_second_turn_while_the_first_holds_the_lease_waits(store: Store) -> None:
    first = await make_turn(store)
    await first.accept()
    second = await make_turn(store, conversation_id=first.cid)
    k = store.keys
    assert await second.admit() == ("waiting", first.id)
    assert (await store.turn_state(second.id)).status == "waiting"
    assert (await store.turn_state(second.id)).fence == ""
    assert await store.redis.hget(k.waiting(first.cid), second.id) == second.request
    assert await members(store, k.turn_queue(first.cid)) == [first.id, second.id]
    assert await hash_of(store, k.lease(first.cid)) == {"turn": first.id, "fence": "1"}
    assert await store.redis.zscore(k.running(), second.id) is None
    # asked again (a redelivery), it still waits
    assert await second.admit() == ("waiting", first.id)


async def test_admit_of_a_cancelled_turn_writes_nothing_of_its_conversation(store: Store) -> None:
    t = await make_turn(store)
    assert (await store.cancel(t.id, "stop", now=time.time()))[0] == "signalled"
    before = await dump(store.redis, store.settings.prefix)
    assert await t.admit() == ("cancelled", "")
    assert await dump(store.redis, store.settings.prefix) == before
    assert await conversation_keys(store, t.cid) == []
    assert (await store.turn_state(t.id)).status == ""


async def test_a_turn_cancelled_while_it_waited_is_not_admitted_after_its_flag_expired(store: Store) -> None:
    """The cancel is read off the turn's record, which outlives the flag's TTL (TL_CANCEL_TTL_S)."""
    first = await make_turn(store)
    assert await first.admit() == ("admitted", "1")
    waiting = await make_turn(store, conversation_id=first.cid)
    assert (await waiting.admit())[0] == "waiting"
    assert (await store.cancel(waiting.id, "stop", now=time.time()))[0] == "signalled"
    await store.redis.delete(store.keys.cancel_flag(waiting.id))  # as its TTL would
    assert await first.end("succeeded") == "ok"  # wakes the waiting one
    assert await waiting.admit() == ("cancelled", "")
    assert "holder" not in await hash_of(store, store.keys.turn(waiting.id))


async def test_admit_of_a_terminal_turn_is_refused(store: Store) -> None:
    t = await make_turn(store)
    assert await t.admit() == ("admitted", "1")
    assert await t.end("failed") == "ok"
    before = await dump(store.redis, store.settings.prefix)
    assert await t.admit() == ("terminal", "failed")
    assert await dump(store.redis, store.settings.prefix) == before


async def test_a_live_turn_record_outlives_its_deadline(store: Store) -> None:
    store.settings = dataclasses.replace(store.settings, turn_ttl_s=60)
    t = await make_turn(store, deadline_s=3_600)  # allowed: deadlines go up to 86,400 s
    await t.run_to(MODEL)
    ttl = await store.redis.ttl(store.keys.turn(t.id))
    assert ttl == -1 or ttl >= t.resolved.accepted_at + t.resolved.deadline_s - time.time()


async def test_admit_after_the_admit_stage_ran_is_done(store: Store) -> None:
    t = await make_turn(store)
    await t.accept()
    before = await dump(store.redis, store.settings.prefix)
    assert await t.admit() == ("done", "")
    assert await dump(store.redis, store.settings.prefix) == before


# --- begin ------------------------------------------------------------------------------------------


async def test_begin_goes_with_the_artifacts_and_announces_the_start(store: Store) -> None:
    t = await make_turn(store)
    await t.accept()
    resolved = t.resolved.model_dump_json()
    b = await t.begin(SECOND)
    assert b == Begin(status="go", attempt=1, admitted=resolved, previous=resolved, conversation_id=t.cid,
                      fence="1", deadline_at=t.resolved.accepted_at + t.resolved.deadline_s)
    assert await t.advance(SECOND, artifact="<second>") == "ok"
    b = await t.begin(THIRD)
    assert (b.status, b.admitted, b.previous) == ("go", resolved, "<second>")
    seen = await stream(store, t.id)
    assert_gapless(seen)
    starts = [e for e in seen if isinstance(e, events.StageEvent) and e.status == "started"]
    assert [(e.stage, e.attempt) for e in starts] == [(FIRST, 1), (SECOND, 1), (THIRD, 1)]
    assert (await store.turn_state(t.id)).stage == THIRD


async def test_a_stage_starting_soon_after_the_last_scoring_leaves_the_running_score(store: Store) -> None:
    """The stages of a turn that moves on start within `rescore_s` of its admission: they leave its
    running score (one ZADD each fewer); a start later than that scores the turn again, and so does
    the next one after it, counted from that scoring (not from the admission)."""
    t, k, step = await make_turn(store), store.keys, store.rescore_s
    assert 0 < step <= min(store.settings.worker_timeout_s, store.settings.stall_s) / 4
    admitted = await store.admit(t.id, t.cid, now=100.0, request=t.request, holder="w1")
    t.fence = admitted.detail
    assert await t.advance(FIRST, accept=True) == "ok"
    assert (await t.begin(SECOND, now=100.0 + step / 2)).status == "go"
    assert await store.redis.zscore(k.running(), t.id) == 100.0  # left as the admission scored it
    assert await t.advance(SECOND) == "ok"
    later = 100.0 + step * 1.5
    assert (await t.begin(THIRD, now=later)).status == "go"
    assert await store.redis.zscore(k.running(), t.id) == later
    assert await t.advance(THIRD) == "ok"
    assert (await t.begin(MODEL, claim="w1", now=later + step * 0.75)).status == "go"  # 2.25 steps after admission
    assert await store.redis.zscore(k.running(), t.id) == later


async def test_begin_of_a_stage_already_done_is_done(store: Store) -> None:
    t = await make_turn(store)
    await t.run_to(THIRD)
    before = await dump(store.redis, store.settings.prefix)
    assert (await t.begin(SECOND)).status == "done"
    assert (await t.begin(FIRST)).status == "done"
    assert await dump(store.redis, store.settings.prefix) == before


async def test_begin_of_a_terminal_turn_is_terminal(store: Store) -> None:
    t = await make_turn(store)
    await t.run_to(LAST)
    assert await t.finish("succeeded") == "ok"
    before = await dump(store.redis, store.settings.prefix)
    for stage in (SECOND, MODEL, LAST):
        b = await t.begin(stage, claim="w2" if stage == MODEL else "")
        assert (b.status, b.terminal_status) == ("terminal", "succeeded")
    assert await dump(store.redis, store.settings.prefix) == before


async def test_begin_refuses_a_cancelled_turn_only_when_it_interrupts(store: Store) -> None:
    t = await make_turn(store)
    await t.accept()
    await store.cancel(t.id, "stop", now=time.time())
    before = await dump(store.redis, store.settings.prefix)
    assert (await t.begin(SECOND)).status == "cancelled"
    assert (await t.begin(MODEL, claim="w1")).status == "cancelled"
    assert await dump(store.redis, store.settings.prefix) == before  # no claim taken, no event
    assert (await t.begin(SECOND, interrupts=False)).status == "go"


async def test_begin_past_the_deadline_times_out_only_when_it_interrupts(store: Store) -> None:
    t = await make_turn(store, deadline_s=5, accepted_at=time.time() - 60)
    await t.accept()
    before = await dump(store.redis, store.settings.prefix)
    assert (await t.begin(SECOND)).status == "timed_out"
    assert await dump(store.redis, store.settings.prefix) == before
    assert (await t.begin(SECOND, now=t.resolved.accepted_at + 4)).status == "go"
    assert (await t.begin(LAST, interrupts=False)).status == "go"


async def test_begin_with_the_model_claim_held_is_a_duplicate(store: Store) -> None:
    t = await make_turn(store)
    await t.run_to(MODEL)
    k = store.keys
    b = await t.begin(MODEL, claim="w1")
    assert (b.status, b.attempt, b.previous) == ("go", 1, f"<{THIRD}>")
    assert await store.redis.get(k.model_claim(t.id)) == b"w1"
    assert 0 < await store.redis.pttl(k.model_claim(t.id)) <= store.settings.invoke_lease_s * 1000
    before = await dump(store.redis, store.settings.prefix)
    assert (await t.begin(MODEL, claim="w2")).status == "duplicate"
    assert await dump(store.redis, store.settings.prefix) == before  # no attempt counted, no event
    assert (await hash_of(store, k.turn(t.id)))["model_starts"] == "1"


async def test_a_second_claim_after_a_lost_worker_is_attempt_2_announced_as_redelivered(store: Store) -> None:
    t = await make_turn(store)
    await t.run_to(MODEL)
    assert (await t.begin(MODEL, claim="w1")).attempt == 1
    await store.release_claim(t.id, "w1")  # the claim of a dead worker ran out
    n = len(await stream(store, t.id))
    b = await t.begin(MODEL, claim="w2")
    assert (b.status, b.attempt) == ("go", 2)
    assert (await store.turn_state(t.id)).attempt == 2
    seen = await stream(store, t.id)
    assert_gapless(seen)
    retrying, started = seen[n:]
    assert isinstance(retrying, events.Retrying) and retrying.reason.startswith("redelivered")
    assert retrying.attempt == 2
    assert isinstance(started, events.StageEvent) and (started.stage, started.status) == (MODEL, "started")
    assert started.attempt == 2  # the store's attempt, not the caller's (the event came without one)


async def test_a_second_claim_after_a_scheduled_retry_adds_no_redelivered_event(store: Store) -> None:
    t = await make_turn(store)
    await t.run_to(MODEL)
    assert (await t.begin(MODEL, claim="w1")).attempt == 1
    assert await store.retry(
        t.id, next_=Next(MODEL, Envelope(turn_id=t.id, stage=MODEL, attempt=2).model_dump(), new_id("m"),
                         delay_ms=500),
        now=time.time(), now_ms=int(time.time() * 1000),
        event=events.Retrying(turn_id=t.id, attempt=2, reason="model_rate_limited: 429"), claim="w1") == "ok"
    n = len(await stream(store, t.id))
    b = await t.begin(MODEL, claim="w1")
    assert (b.status, b.attempt) == ("go", 2)
    seen = await stream(store, t.id)
    assert_gapless(seen)
    assert [type(e) for e in seen[n:]] == [events.StageEvent]
    assert seen[n].attempt == 2
    assert "retry_pending" not in await hash_of(store, store.keys.turn(t.id))
    assert len([e for e in seen if isinstance(e, events.Retrying)]) == 1


# --- advance ----------------------------------------------------------------------------------------


async def test_advance_hands_over_in_one_step(store: Store) -> None:
    t = await make_turn(store)
    await t.accept()
    k = store.keys
    await t.begin(SECOND)
    n = len(await stream(store, t.id))
    mid = new_id("m")
    async with listening(store, k.doorbell_channel()) as doorbell:
        assert await t.advance(SECOND, artifact="<second>", next_id=mid) == "ok"
        rang = await published(doorbell)
    assert rang == [THIRD]
    assert "done:" + SECOND in await hash_of(store, k.turn(t.id))
    assert await store.redis.get(k.artifact(t.id, SECOND)) == b"<second>"
    assert 0 < await store.redis.pttl(k.artifact(t.id, SECOND)) <= store.settings.artifact_ttl_s * 1000
    seen = await stream(store, t.id)
    assert_gapless(seen)
    (finished,) = seen[n:]
    assert isinstance(finished, events.StageEvent) and (finished.stage, finished.status) == (SECOND, "finished")
    # the next stage's message, exactly as dramatiq's RedisBroker stores it
    assert await store.redis.lrange(store.keys.queue(THIRD), 0, -1) == [mid.encode()]
    raw = await store.redis.hget(store.keys.queue_messages(THIRD), mid)
    assert raw is not None
    message = decode_message(raw)
    assert (message["queue_name"], message["actor_name"], message["message_id"]) == (THIRD, THIRD, mid)
    assert message["options"]["redis_message_id"] == mid
    assert message["args"] == [Envelope(turn_id=t.id, stage=THIRD).model_dump()]


async def test_advance_twice_is_done_and_duplicates_nothing(store: Store) -> None:
    t = await make_turn(store)
    await t.accept()
    await t.begin(SECOND)
    assert await t.advance(SECOND, artifact="<second>") == "ok"
    before = await dump(store.redis, store.settings.prefix)
    assert await t.advance(SECOND, artifact="<other>", next_id=new_id("m")) == "done"
    assert await dump(store.redis, store.settings.prefix) == before
    assert await store.redis.hlen(store.keys.queue_messages(THIRD)) == 1
    assert await store.redis.llen(store.keys.queue(THIRD)) == 1


@pytest.mark.parametrize("lease", [{"turn": "t-someone-else", "fence": "2"}, {"fence": "2"}],
                         ids=["another-turn-took-the-lease", "the-fence-moved"])
async def test_advance_with_a_stale_fence_writes_nothing(store: Store, lease: dict[str, str]) -> None:
    t = await make_turn(store)
    await t.accept()
    await t.begin(SECOND)
    await store.redis.hset(store.keys.lease(t.cid), mapping=lease)
    before = await dump(store.redis, store.settings.prefix)
    assert await t.advance(SECOND, artifact="<second>") == "stale"
    assert await dump(store.redis, store.settings.prefix) == before


async def test_advance_of_a_terminal_turn_is_terminal(store: Store) -> None:
    t = await make_turn(store)
    await t.accept()
    await t.begin(SECOND)
    assert await t.end("cancelled", code="cancelled") == "ok"
    before = await dump(store.redis, store.settings.prefix)
    assert await t.advance(SECOND, artifact="<second>") == "terminal"
    assert await dump(store.redis, store.settings.prefix) == before


async def test_accept_creates_the_conversation_the_row_and_the_order_entry_once(store: Store) -> None:
    t = await make_turn(store)
    k = store.keys
    await t.admit()
    assert await t.advance(FIRST, accept=True) == "ok"
    expected_conversation = {**conversation_to_hash(new_conversation(t.resolved)), "message_seq": "1"}
    assert await hash_of(store, k.conversation(t.cid)) == expected_conversation
    assert await hash_of(store, k.messages(t.cid)) == {t.id: pending_row(t.resolved).model_dump_json()}
    assert await store.redis.zrange(k.message_order(t.cid), 0, -1, withscores=True) == [(t.id.encode(), 1.0)]
    # the tenant's conversation index (what `conversations` lists) holds it, under the tenant's key only
    assert await store.redis.zrange(k.tenant_conversations(t.resolved.tenant_id), 0, -1) == [t.cid.encode()]
    state = await store.turn_state(t.id)
    assert state.message_id == t.id and state.done == {FIRST}
    assert state.deadline_at == t.resolved.accepted_at + t.resolved.deadline_s
    seen = await stream(store, t.id)
    assert_gapless(seen)
    assert [e.type for e in seen] == ["accepted", "stage", "stage"]
    assert await store.artifact(t.id, FIRST) == t.resolved.model_dump_json().encode()

    # a redelivery changes nothing
    before = await dump(store.redis, store.settings.prefix)
    assert await t.advance(FIRST, accept=True) == "done"
    assert await dump(store.redis, store.settings.prefix) == before
    # even one that got past the done marker keeps the row, the order and the conversation as they are
    await store.redis.hdel(k.turn(t.id), f"done:{FIRST}")
    assert await t.advance(FIRST, accept=True) == "ok"
    assert await hash_of(store, k.conversation(t.cid)) == expected_conversation
    assert await store.redis.zcard(k.message_order(t.cid)) == 1


async def test_accept_of_a_follow_up_keeps_the_conversation_and_orders_its_row(store: Store) -> None:
    first = await make_turn(store)
    await first.run_to(LAST)
    assert await first.finish() == "ok"
    k = store.keys
    conversation = await hash_of(store, k.conversation(first.cid))
    index = k.tenant_conversations(first.resolved.tenant_id)
    first_score = await store.redis.zscore(index, first.cid)
    second = await make_turn(store, conversation_id=first.cid)
    await second.accept()
    assert second.fence == "2"
    assert await hash_of(store, k.conversation(first.cid)) == {**conversation, "message_seq": "2"}
    assert await store.redis.zrange(k.message_order(first.cid), 0, -1, withscores=True) == [
        (first.id.encode(), 1.0), (second.id.encode(), 2.0)]
    row = await store.redis.hget(k.messages(first.cid), second.id)
    assert row is not None and json.loads(row)["parent_id"] == first.id
    # one index entry, moved to the follow-up's time (the listing shows the most recently active first)
    entries = await store.redis.zrange(index, 0, -1, withscores=True)
    assert first_score is not None and [cid for cid, _ in entries] == [first.cid.encode()]
    assert entries[0][1] > first_score


# --- a conversation is written only by turns of its own tenant, and no message twice ---------------------


async def finished_turn(store: Store, turn_id: str | None = None) -> Turn:
    """A turn run to its end, whose record then expired: its conversation and message stay."""
    t = await make_turn(store, turn_id=turn_id)
    await t.run_to(LAST)
    assert await t.finish() == "ok"
    await store.redis.delete(store.keys.turn(t.id), store.keys.events(t.id))
    return t


async def stranger(store: Store, turn_id: str, *, tenant: str = "t2", conversation_id: str | None = None) -> Turn:
    """A turn of `tenant` resolved as if its conversation did not exist (what the admit stage did before it
    looked): only the scripts stand between it and the stored conversation."""
    req = make_request(turn_id=turn_id, conversation_id=conversation_id).model_copy(update={"tenant_id": tenant})
    resolved, _ = resolve_turn(req, conversation=None, config=AGENT, config_ref="v1",
                               new_conversation_id=conversation_id or new_conversation_id(turn_id), now=time.time())
    return Turn(store, req, resolved)


async def admit_as(t: Turn, *, creates: bool) -> tuple[str, str]:
    status, detail, _ = await t.store.admit(t.id, t.cid, now=time.time(), request=t.request,
                                            tenant_id=t.req.tenant_id, creates=creates)
    return status, detail


@pytest.mark.parametrize(("tenant", "why"), [("t2", "foreign_conversation"), ("t1", "conversation_exists")],
                         ids=["another-tenant", "the-same-tenant"])
async def test_admit_of_a_first_turn_whose_conversation_exists_is_refused_and_writes_nothing(
        store: Store, tenant: str, why: str) -> None:
    a = await finished_turn(store, turn_id="order-1001")
    b = await stranger(store, a.id, tenant=tenant)
    before = await dump(store.redis, store.settings.prefix)
    assert await admit_as(b, creates=True) == ("refused", why)
    assert await dump(store.redis, store.settings.prefix) == before


async def test_admit_into_another_tenants_conversation_is_refused_and_writes_nothing(store: Store) -> None:
    a = await finished_turn(store)
    b = await stranger(store, new_id(), conversation_id=a.cid)
    before = await dump(store.redis, store.settings.prefix)
    assert await admit_as(b, creates=False) == ("refused", "foreign_conversation")
    assert await dump(store.redis, store.settings.prefix) == before


async def test_admit_of_a_turn_whose_message_id_names_a_row_is_refused(store: Store) -> None:
    a = await finished_turn(store)
    follow = await make_turn(store, conversation_id=a.cid)
    await follow.run_to(LAST)
    assert await follow.finish() == "ok"
    await store.redis.delete(store.keys.turn(follow.id))
    again = await make_turn(store, conversation_id=a.cid, turn_id=follow.id)
    before = await dump(store.redis, store.settings.prefix)
    assert await admit_as(again, creates=False) == ("refused", "message_exists")
    assert await dump(store.redis, store.settings.prefix) == before


async def test_admit_of_a_turn_of_the_conversations_own_tenant_goes_on(store: Store) -> None:
    a = await finished_turn(store)
    follow = await make_turn(store, conversation_id=a.cid)
    assert (await admit_as(follow, creates=False))[0] == "admitted"


async def hold(t: Turn) -> Turn:
    """The turn holds its conversation's lease as admit.lua gave it before it looked, its admit stage
    begun: only advance.lua stands in the way of its accept."""
    k = t.store.keys
    t.fence = "99"
    await t.store.redis.hset(k.lease(t.cid), mapping={"turn": t.id, "fence": t.fence})
    await t.store.redis.hset(k.turn(t.id), mapping={"status": "running", "fence": t.fence, "conversation_id": t.cid,
                                                     "stage": FIRST, "holder": "w1", "progress_at": time.time()})
    return t


async def accept_as(t: Turn, *, creates: bool) -> str:
    """The admit stage's advance (the accept)."""
    following = DEFAULT_GRAPH.next(FIRST)
    assert following is not None
    return await t.store.advance(
        t.id, FIRST, next_=Next(following.name, Envelope(turn_id=t.id, stage=following.name).model_dump(), new_id("m")),
        now=time.time(), now_ms=int(time.time() * 1000), artifact=t.resolved.model_dump_json(), fence=t.fence,
        conversation_id=t.cid, accept=Accept(new_conversation(t.resolved), pending_row(t.resolved),
                                             t.resolved.accepted_at + t.resolved.deadline_s, creates=creates))


@pytest.mark.parametrize(("tenant", "why"), [("t2", "foreign_conversation"), ("t1", "conversation_exists")],
                         ids=["another-tenant", "the-same-tenant"])
async def test_accept_of_a_first_turn_whose_conversation_exists_writes_nothing(store: Store, tenant: str,
                                                                                why: str) -> None:
    """The defect: a turn id reused after its record expired made the new turn write over the old message,
    move the tip and count the usage, whichever tenant sent it."""
    a = await finished_turn(store, turn_id="order-1001")
    b = await hold(await stranger(store, a.id, tenant=tenant))
    conversation = [k for k in (await dump(store.redis, store.settings.prefix)) if k.startswith(
        store.keys.conversation(a.cid))]
    before = await dump(store.redis, store.settings.prefix)
    assert await accept_as(b, creates=True) == why
    after = await dump(store.redis, store.settings.prefix)
    assert {k: after.get(k) for k in conversation} == {k: before[k] for k in conversation}
    assert not (await store.turn_state(b.id)).message_id and f"done:{FIRST}" not in await hash_of(
        store, store.keys.turn(b.id))


async def test_accept_into_another_tenants_conversation_or_over_a_row_writes_nothing(store: Store) -> None:
    a = await finished_turn(store)
    foreign = await hold(await stranger(store, new_id(), conversation_id=a.cid))
    before = await hash_of(store, store.keys.conversation(a.cid))
    assert await accept_as(foreign, creates=False) == "foreign_conversation"
    assert await foreign.end("failed", code="forbidden") == "ok"
    reused = await hold(await stranger(store, a.id, tenant="t1", conversation_id=a.cid))
    assert await accept_as(reused, creates=False) == "message_exists"
    assert await hash_of(store, store.keys.conversation(a.cid)) == before
    row = await store.redis.hget(store.keys.messages(a.cid), a.id)
    assert row is not None and json.loads(row)["status"] == "succeeded"


async def test_accept_again_past_the_done_marker_is_still_its_own(store: Store) -> None:
    t = await hold(await make_turn(store))
    assert await accept_as(t, creates=True) == "ok"
    await store.redis.hdel(store.keys.turn(t.id), f"done:{FIRST}")
    following = DEFAULT_GRAPH.next(FIRST)
    assert following is not None
    assert await store.advance(
        t.id, FIRST, next_=Next(following.name, {}, new_id("m")), now=time.time(), now_ms=int(time.time() * 1000),
        artifact="x", fence=t.fence, conversation_id=t.cid,
        accept=Accept(new_conversation(t.resolved), pending_row(t.resolved), time.time() + 60, creates=True)) == "ok"


async def test_finish_into_a_conversation_of_another_tenant_ends_the_turn_failed_without_a_row(store: Store) -> None:
    t = await make_turn(store)
    await t.run_to(LAST)
    k = store.keys
    await store.redis.hset(k.conversation(t.cid), "tenant_id", "t2")  # the conversation is someone else's now
    # what the conversation holds (its line, lease and waiting requests are the turn's own to leave)
    held = (k.conversation(t.cid), k.messages(t.cid), k.message_order(t.cid), k.snapshots(t.cid))
    conversation = {key: v for key, v in (await dump(store.redis, store.settings.prefix)).items() if key in held}
    assert await t.finish() == "foreign_conversation"
    after = await dump(store.redis, store.settings.prefix)
    assert {key: after.get(key) for key in conversation} == conversation
    assert not await store.redis.exists(k.usage("t1"))
    seen = await stream(store, t.id)
    assert_gapless(seen)
    (failed,) = terminals(seen)
    assert isinstance(failed, events.Failed) and failed.code == "forbidden"
    assert (await store.turn_state(t.id)).status == "failed"
    assert "turn" not in await hash_of(store, k.lease(t.cid))  # released for the conversation's own turns


async def test_finish_of_a_row_the_turn_did_not_accept_is_refused(store: Store) -> None:
    t = await make_turn(store)
    await t.run_to(LAST)
    await store.redis.hdel(store.keys.turn(t.id), "message_id")
    pending = await store.redis.hget(store.keys.messages(t.cid), t.id)
    assert await t.finish() == "message_exists"
    assert await store.redis.hget(store.keys.messages(t.cid), t.id) == pending
    (failed,) = terminals(await stream(store, t.id))
    assert isinstance(failed, events.Failed) and failed.code == "invalid_request"


# --- retry ------------------------------------------------------------------------------------------


async def test_retry_schedules_a_delayed_message_releases_the_claim_and_announces_it(store: Store) -> None:
    t = await make_turn(store)
    await t.run_to(MODEL)
    await t.begin(MODEL, claim="w1")
    k = store.keys
    n = len(await stream(store, t.id))
    ready = await queued(store, MODEL)  # the message that started this attempt
    mid, now_ms = new_id("m"), int(time.time() * 1000)
    async with listening(store, k.doorbell_channel()) as doorbell:
        assert await store.retry(
            t.id, next_=Next(MODEL, Envelope(turn_id=t.id, stage=MODEL, attempt=2).model_dump(), mid, delay_ms=500),
            now=time.time(), now_ms=now_ms,
            event=events.Retrying(turn_id=t.id, attempt=2, reason="model_rate_limited: 429"), claim="w1") == "ok"
        rang = await published(doorbell)
    assert rang == [f"{MODEL}.DQ"]
    assert not await store.redis.exists(k.model_claim(t.id))
    assert (await hash_of(store, k.turn(t.id)))["retry_pending"] == "1"
    assert await store.redis.lrange(store.keys.queue(f"{MODEL}.DQ"), 0, -1) == [mid.encode()]
    assert await queued(store, MODEL) == ready  # nothing to run now, only later
    raw = await store.redis.hget(store.keys.queue_messages(f"{MODEL}.DQ"), mid)
    assert raw is not None
    message = decode_message(raw)
    assert message["queue_name"] == f"{MODEL}.DQ" and message["options"]["eta"] == now_ms + 500
    assert message["args"] == [Envelope(turn_id=t.id, stage=MODEL, attempt=2).model_dump()]
    seen = await stream(store, t.id)
    assert_gapless(seen)
    (retrying,) = seen[n:]
    assert isinstance(retrying, events.Retrying) and retrying.attempt == 2


async def test_retry_of_a_terminal_turn_is_terminal(store: Store) -> None:
    t = await make_turn(store)
    await t.run_to(MODEL)
    await t.begin(MODEL, claim="w1")
    assert await t.end("cancelled", code="cancelled") == "ok"
    before = await dump(store.redis, store.settings.prefix)
    assert await store.retry(
        t.id, next_=Next(MODEL, Envelope(turn_id=t.id, stage=MODEL, attempt=2).model_dump(), new_id("m"),
                         delay_ms=500),
        now=time.time(), now_ms=int(time.time() * 1000),
        event=events.Retrying(turn_id=t.id, attempt=2, reason="model_unavailable: 503"), claim="w1") == "terminal"
    assert await dump(store.redis, store.settings.prefix) == before


async def test_retry_from_a_worker_that_lost_its_claim_leaves_the_new_claim_alone(store: Store) -> None:
    t = await make_turn(store)
    await t.run_to(MODEL)
    await t.begin(MODEL, claim="w1")
    await store.release_claim(t.id, "w1")  # w1's claim ran out (it stalled); w2 took over
    assert (await t.begin(MODEL, claim="w2")).attempt == 2
    # w1 comes back with a transient error and schedules its retry
    await store.retry(
        t.id, next_=Next(MODEL, Envelope(turn_id=t.id, stage=MODEL, attempt=2).model_dump(), new_id("m"),
                         delay_ms=500),
        now=time.time(), now_ms=int(time.time() * 1000),
        event=events.Retrying(turn_id=t.id, attempt=2, reason="model_unavailable: 503"), claim="w1")
    # w2 still runs the model: its claim must keep a third delivery out
    assert await store.redis.get(store.keys.model_claim(t.id)) == b"w2"


# --- finish -----------------------------------------------------------------------------------------


async def test_finish_writes_the_turn_and_cleans_up_after_it(store: Store) -> None:
    t = await make_turn(store)
    await t.run_to(LAST)
    k = store.keys
    await store.cancel(t.id, "too late", now=time.time())  # a cancel that lost the race
    assert (await t.begin(LAST, interrupts=False)).status == "go"
    assert await store.redis.exists(k.model_claim(t.id), k.cancel_flag(t.id)) == 2
    usage = Usage(input_tokens=11, output_tokens=7, requests=1)
    assert await t.finish("succeeded", snapshot="SNAP", usage=usage) == "ok"

    row = await store.redis.hget(k.messages(t.cid), t.id)
    assert row is not None and json.loads(row) == {
        **json.loads(pending_row(t.resolved).model_dump_json()),
        "answer": "the answer", "status": "succeeded", "usage": usage.model_dump(),
        "updated_at": json.loads(row)["updated_at"]}
    assert await store.redis.hget(k.snapshots(t.cid), t.id) == b"SNAP"
    conversation = await hash_of(store, k.conversation(t.cid))
    assert (conversation["tip"], conversation["pending"], conversation["revision"]) == (t.id, "[]", "1")
    # a counter the turn adds 0 to is not written (the cache tokens): a missing one reads 0
    assert await hash_of(store, k.usage("t1")) == {"input_tokens": "11", "output_tokens": "7", "requests": "1",
                                                    "unpriced_turns": "1", "turns": "1"}
    seen = await stream(store, t.id)
    assert_gapless(seen)
    assert isinstance(seen[-1], events.Succeeded) and len(terminals(seen)) == 1
    assert isinstance(seen[-2], events.StageEvent) and (seen[-2].stage, seen[-2].status) == (LAST, "finished")
    # the turn's scratch state is gone; its record and events expire
    assert not await store.redis.exists(*(k.artifact(t.id, s) for s in STAGES), k.model_claim(t.id),
                                        k.cancel_flag(t.id))
    state = await store.turn_state(t.id)
    assert state.status == "succeeded"
    for key in (k.turn(t.id), k.events(t.id)):
        assert 0 < await store.redis.ttl(key) <= store.settings.turn_ttl_s
    assert await store.redis.zscore(k.running(), t.id) is None
    # the conversation is free again (its fence stays for the next holder)
    assert await hash_of(store, k.lease(t.cid)) == {"fence": "1"}
    assert not await store.redis.exists(k.turn_queue(t.cid), k.waiting(t.cid))


async def test_finish_twice_is_already_and_the_stream_keeps_one_terminal_event(store: Store) -> None:
    t = await make_turn(store)
    await t.run_to(LAST)
    assert await t.finish("succeeded") == "ok"
    before = await dump(store.redis, store.settings.prefix)
    assert await t.finish("failed") == "already"
    assert await t.end("cancelled", code="cancelled") == "already"
    assert await dump(store.redis, store.settings.prefix) == before
    seen = await stream(store, t.id)
    assert [e.type for e in terminals(seen)] == ["succeeded"]
    assert (await hash_of(store, store.keys.conversation(t.cid)))["revision"] == "1"


@pytest.mark.parametrize("lease", [{"turn": "t-someone-else", "fence": "2"}, {"fence": "2"}],
                         ids=["another-turn-took-the-lease", "the-fence-moved"])
async def test_finish_with_a_stale_fence_writes_nothing(store: Store, lease: dict[str, str]) -> None:
    t = await make_turn(store)
    await t.run_to(LAST)
    await store.redis.hset(store.keys.lease(t.cid), mapping=lease)
    before = await dump(store.redis, store.settings.prefix)
    assert await t.finish("succeeded") == "stale"
    assert await dump(store.redis, store.settings.prefix) == before


async def test_finish_releases_the_lease_and_wakes_the_next_turn_in_line(store: Store) -> None:
    first = await make_turn(store)
    await first.run_to(LAST)
    second = await make_turn(store, conversation_id=first.cid)
    assert (await second.admit())[0] == "waiting"
    k = store.keys
    async with listening(store, k.doorbell_channel()) as doorbell:
        assert await first.finish() == "ok"
        rang = await published(doorbell)
    assert rang == [FIRST]
    wake = f"wake.{second.id}.{first.id}"
    assert await store.redis.lrange(store.keys.queue(FIRST), 0, -1) == [wake.encode()]
    raw = await store.redis.hget(store.keys.queue_messages(FIRST), wake)
    assert raw is not None
    message = decode_message(raw)
    assert message["message_id"] == wake and message["options"]["redis_message_id"] == wake
    assert message["args"] == [second.req.model_dump(mode="json", by_alias=True)]
    assert raw == second.request.replace(WAKE_ID.encode(), wake.encode())
    assert await hash_of(store, k.lease(first.cid)) == {"fence": "1"}
    assert await members(store, k.turn_queue(first.cid)) == [second.id]
    assert await store.redis.hkeys(k.waiting(first.cid)) == [second.id.encode()]
    # the woken turn runs now, with the next fence
    assert await second.admit() == ("admitted", "2")


async def test_the_wake_id_is_substituted_for_the_message_id_only(store: Store) -> None:
    first = await make_turn(store)
    await first.run_to(LAST)
    query = f"what does {WAKE_ID} mean?"
    second = await make_turn(store, conversation_id=first.cid, query=query)
    assert (await second.admit())[0] == "waiting"
    assert await first.finish() == "ok"
    raw = await store.redis.hget(store.keys.queue_messages(FIRST), f"wake.{second.id}.{first.id}")
    assert raw is not None
    assert decode_message(raw)["args"][0]["query"] == query


async def test_a_turn_that_finishes_out_of_line_leaves_the_holder_alone(store: Store) -> None:
    first = await make_turn(store)
    await first.accept()
    second = await make_turn(store, conversation_id=first.cid)
    assert (await second.admit())[0] == "waiting"
    assert await second.end("cancelled", code="cancelled") == "ok"  # cancelled while it waited
    k = store.keys
    assert await hash_of(store, k.lease(first.cid)) == {"turn": first.id, "fence": "1"}
    assert await members(store, k.turn_queue(first.cid)) == [first.id]
    assert await store.redis.hkeys(k.waiting(first.cid)) == [first.id.encode()]
    assert not await store.redis.exists(store.keys.queue(FIRST))  # nobody woken


@pytest.mark.parametrize("admitted", [True, False], ids=["admitted-then-refused", "refused-before-admission"])
async def test_finish_without_a_conversation_leaves_no_lease_line_or_waiting_keys(store: Store,
                                                                                  admitted: bool) -> None:
    t = await make_turn(store)
    if admitted:
        assert await t.admit() == ("admitted", "1")
    else:  # its producer took its place in the line; the admit stage refused it before admission
        client = Client(store.settings.redis_url or "", prefix=store.settings.prefix)
        client.submit(t.req.model_dump(mode="json", by_alias=True))
        client.close()
        assert await members(store, store.keys.turn_queue(t.cid)) == [t.id]
    assert await t.end("failed", code="agent_not_found") == "ok"
    assert await conversation_keys(store, t.cid) == []
    seen = await stream(store, t.id)
    assert [e.type for e in seen] == ["failed"] and seen[0].seq == 1
    assert (await store.turn_state(t.id)).status == "failed"
    assert await store.redis.zscore(store.keys.running(), t.id) is None


async def test_finish_without_a_snapshot_keeps_the_stored_history(store: Store) -> None:
    first = await make_turn(store)
    await first.run_to(LAST)
    assert await first.finish(snapshot="S1") == "ok"
    second = await make_turn(store, conversation_id=first.cid)
    await second.run_to(LAST)
    k = store.keys
    assert await second.finish("failed", snapshot=None) == "ok"
    assert await hash_of(store, k.snapshots(first.cid)) == {first.id: "S1"}
    conversation = await hash_of(store, k.conversation(first.cid))
    assert (conversation["tip"], conversation["revision"]) == (second.id, "2")
    row = await store.redis.hget(k.messages(first.cid), second.id)
    assert row is not None and json.loads(row)["status"] == "failed"


# --- stalled ----------------------------------------------------------------------------------------


async def beat(store: Store, worker_id: str, turns: list[str], *, ttl_ms: int = 10_000, stop: bool = False,
               broker_id: str = "b-1") -> int:
    """A worker process's heartbeat, as `middleware/liveness.py` sends it."""
    k = store.keys
    script = store.redis.register_script(lua.source("heartbeat"))
    return int(await script(keys=[k.worker(worker_id), k.worker_turns(worker_id), k.workers(), k.heartbeats()],
                            args=[lua.payload(worker_id=worker_id, broker_id=broker_id, info="{}", ttl_ms=ttl_ms,
                                              now_ms=int(time.time() * 1000), turns=turns, stop=stop)]))


async def test_stalled_turn_nobody_holds_is_run_again_from_its_first_stage_not_done(store: Store) -> None:
    t = await make_turn(store)
    await t.admit()
    now = time.time() + 120
    look = await store.stalled(t.id, now=now, max_recoveries=3)
    assert (look.verdict, look.stage, look.attempt, look.request, look.why) == (
        "stalled", FIRST, 1, t.request.decode(), "no_progress")
    assert await store.redis.zscore(store.keys.running(), t.id) == pytest.approx(now)  # the clock restarts
    t2 = await make_turn(store)
    await t2.run_to(THIRD)
    look = await store.stalled(t2.id, now=now, max_recoveries=3)
    assert (look.verdict, look.stage, look.request) == ("stalled", THIRD, t2.request.decode())


async def test_stalled_turn_nobody_holds_waits_out_the_stall_time_and_is_looked_at_again_then(store: Store) -> None:
    t = await make_turn(store)
    await t.run_to(THIRD)  # its THIRD message waits in a queue: nobody holds the turn
    progress = float((await hash_of(store, store.keys.turn(t.id)))["progress_at"])
    look = await store.stalled(t.id, now=progress + 5, max_recoveries=3, stall_s=30, recheck_s=10)
    assert look.verdict == "waiting"
    # looked at again exactly when its stall time is up (the sweep takes scores up to now - recheck_s)
    assert await store.redis.zscore(store.keys.running(), t.id) == pytest.approx(progress + 30 - 10)
    assert (await store.stalled(t.id, now=progress + 31, max_recoveries=3, stall_s=30)).verdict == "stalled"


async def test_stalled_turn_whose_holder_lists_it_is_alive_however_long_it_runs(store: Store) -> None:
    t = await make_turn(store)
    await t.run_to(MODEL)
    await t.begin(MODEL, claim="w1")
    await beat(store, "w1", [t.id])
    look = await store.stalled(t.id, now=time.time() + 3600, max_recoveries=3)
    assert look.verdict == "alive"
    assert "recoveries" not in await hash_of(store, store.keys.turn(t.id))
    assert await store.redis.get(store.keys.model_claim(t.id)) == b"w1"


async def test_stalled_turn_whose_holder_is_gone_is_taken_over_at_once_and_its_claim_released(
    store: Store,
) -> None:
    t = await make_turn(store)
    await t.run_to(MODEL)
    await t.begin(MODEL, claim="w1")
    await beat(store, "w1", [t.id])
    await beat(store, "w1", [], stop=True)  # its heartbeat is gone (the process died, or stopped)
    look = await store.stalled(t.id, now=time.time(), max_recoveries=3)
    assert (look.verdict, look.stage, look.why, look.holder) == ("stalled", MODEL, "worker_lost", "w1")
    assert await store.redis.exists(store.keys.model_claim(t.id)) == 0
    turn = await hash_of(store, store.keys.turn(t.id))
    assert "holder" not in turn and turn["recoveries"] == "1"
    b = await t.begin(MODEL, claim="w2")  # the re-enqueued message runs the model as the next attempt
    assert (b.status, b.attempt) == ("go", 2)


async def test_stalled_turn_whose_live_holder_no_longer_lists_it_is_taken_over(store: Store) -> None:
    """A worker that lives on but no longer runs the turn (its stage failed and the retry was lost)."""
    t = await make_turn(store)
    await t.run_to(THIRD)
    await t.begin(THIRD, holder="w1")
    await beat(store, "w1", ["another-turn"])
    look = await store.stalled(t.id, now=time.time(), max_recoveries=3)
    assert (look.verdict, look.stage, look.why) == ("stalled", THIRD, "worker_lost")


async def test_stalled_model_stage_whose_claim_lapsed_is_taken_over_though_its_holder_lives(store: Store) -> None:
    t = await make_turn(store)
    await t.run_to(MODEL)
    await t.begin(MODEL, claim="w1")
    await beat(store, "w1", [t.id])
    await store.redis.delete(store.keys.model_claim(t.id))  # the run stopped renewing it (a stuck loop)
    look = await store.stalled(t.id, now=time.time(), max_recoveries=3)
    assert (look.verdict, look.why) == ("stalled", "claim_lapsed")


async def test_stalled_turn_that_moved_on_since_it_was_read_is_alive(store: Store) -> None:
    t = await make_turn(store)
    await t.run_to(THIRD)
    await t.begin(THIRD, holder="w1")
    # the holder stalled.py read ("w1") is not the one that holds it by the time the script runs
    reply = await store._run(
        "stalled", [store.keys.turn(t.id), store.keys.model_claim(t.id), store.keys.running(),
                    store.keys.waiting(t.cid), store.keys.worker_turns("w0")],
        lua.payload(turn_id=t.id, now=time.time(), stages=list(STAGES), model_stages=[MODEL], max_recoveries=3,
                    holder="w0", stall_s=60, recheck_s=10))
    assert reply == [b"alive"]


async def test_stalled_terminal_turn_is_gone_and_leaves_the_running_set(store: Store) -> None:
    t = await make_turn(store)
    await t.run_to(LAST)
    assert await t.finish() == "ok"
    k = store.keys
    await store.redis.zadd(k.running(), {t.id: time.time()})  # a leftover entry
    assert (await store.stalled(t.id, now=time.time(), max_recoveries=3)).verdict == "gone"
    assert await store.redis.zscore(k.running(), t.id) is None
    assert (await store.stalled(new_id(), now=time.time(), max_recoveries=3)).verdict == "gone"  # unknown turn


async def test_stalled_too_often_is_exhausted(store: Store) -> None:
    t = await make_turn(store)
    await t.run_to(THIRD)
    later = time.time() + 3600
    verdicts = [(look.verdict, look.stage) for look in
                [await store.stalled(t.id, now=later + i * 100, max_recoveries=2) for i in range(3)]]
    assert verdicts == [("stalled", THIRD), ("stalled", THIRD), ("exhausted", THIRD)]


# --- heartbeat and reap -----------------------------------------------------------------------------


async def test_a_heartbeat_lists_the_turns_of_its_worker_until_it_expires_or_says_goodbye(store: Store) -> None:
    k = store.keys
    assert await beat(store, "w1", ["t-1", "t-2"], ttl_ms=5_000) == 2
    assert sorted(await store.redis.smembers(k.worker_turns("w1"))) == [b"t-1", b"t-2"]
    assert 0 < await store.redis.pttl(k.worker("w1")) <= 5_000
    assert 0 < await store.redis.pttl(k.worker_turns("w1")) <= 5_000
    assert await store.redis.hget(k.workers(), "w1") == b"b-1"
    assert await store.redis.zscore(k.heartbeats(), "b-1") is not None  # dramatiq's, kept fresh too
    await beat(store, "w1", ["t-2"])
    assert await store.redis.smembers(k.worker_turns("w1")) == {b"t-2"}
    await beat(store, "w1", [], stop=True)
    assert await store.redis.exists(k.worker("w1"), k.worker_turns("w1")) == 0
    assert await store.redis.hget(k.workers(), "w1") == b"b-1"  # left for the reaper


async def test_reap_puts_back_what_a_dead_worker_fetched_and_refuses_a_live_one(store: Store) -> None:
    k = store.keys
    await beat(store, "w1", [], broker_id="b-9")
    for mid in ("m-1", "m-2", "m-gone"):
        await store.redis.sadd(k.acks("b-9", "history"), mid)
    await store.redis.hset(k.queue_messages("history"), mapping={"m-1": "{}", "m-2": "{}"})  # m-gone was handled
    await store.redis.sadd(k.acks("b-9", "invoke.DQ"), "m-3")
    await store.redis.hset(k.queue_messages("invoke.DQ"), "m-3", "{}")
    queues = ["history", "invoke.DQ", "persist"]
    assert await store.reap("w1", "b-9", queues) == -1  # alive: nothing moves
    assert await store.redis.scard(k.acks("b-9", "history")) == 3
    await beat(store, "w1", [], stop=True, broker_id="b-9")
    async with listening(store, k.doorbell_channel()) as channel:
        assert await store.reap("w1", "b-9", queues) == 3
        rung = await published(channel)
    assert sorted(await store.redis.lrange(k.queue("history"), 0, -1)) == [b"m-1", b"m-2"]
    assert await store.redis.lrange(k.queue("invoke.DQ"), 0, -1) == [b"m-3"]
    assert sorted(rung) == ["history", "invoke.DQ"]
    assert await store.redis.exists(k.acks("b-9", "history"), k.acks("b-9", "invoke.DQ")) == 0
    assert await store.redis.hget(k.workers(), "w1") is None
    assert await store.redis.zscore(k.heartbeats(), "b-9") is None
    assert await store.reap("w1", "b-9", queues) == 0  # a second reaper finds nothing left


async def test_a_handover_enqueues_the_model_stage_at_once_and_is_no_failed_attempt(store: Store) -> None:
    t = await make_turn(store)
    await t.run_to(MODEL)
    assert (await t.begin(MODEL, claim="w1")).attempt == 1
    arg = Envelope(turn_id=t.id, stage=MODEL, attempt=2).model_dump()
    assert await store.retry(
        t.id, next_=Next(MODEL, arg, "m-handover"), now=time.time(), now_ms=int(time.time() * 1000),
        event=events.Retrying(turn_id=t.id, attempt=2, reason="handover: shutting down"), claim="w1",
        handover=True) == "ok"
    queue = DEFAULT_GRAPH[MODEL].queue
    assert await store.redis.lrange(store.keys.queue(queue), -1, -1) == [b"m-handover"]  # not the delay queue
    assert await store.redis.exists(store.keys.model_claim(t.id)) == 0
    assert "holder" not in await hash_of(store, store.keys.turn(t.id))
    b = await t.begin(MODEL, claim="w2")
    assert (b.status, b.attempt, b.handovers) == ("go", 2, 1)
    seen = await stream(store, t.id)
    assert_gapless(seen)
    assert [e.reason for e in seen if isinstance(e, events.Retrying)] == ["handover: shutting down"]


# --- cancel -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("known", [True, False], ids=["live-turn", "unknown-turn"])
async def test_cancel_of_a_live_or_unknown_turn_raises_the_flag_and_tells_every_worker(store: Store,
                                                                                      known: bool) -> None:
    t = await make_turn(store)
    if known:
        await t.accept()
    k = store.keys
    async with listening(store, k.cancel_channel()) as channel:
        assert await store.cancel(t.id, "user pressed stop", now=time.time()) == (
            "signalled", "running" if known else "unknown")
        told = await published(channel)
    assert told == [t.id]
    assert await store.redis.get(k.cancel_flag(t.id)) == b"user pressed stop"
    assert 0 < await store.redis.ttl(k.cancel_flag(t.id)) <= store.settings.cancel_ttl_s
    assert (await store.turn_state(t.id)).cancel_requested_at is not None
    assert await store.redis.ttl(k.turn(t.id)) > 0  # an unknown turn's record expires too


async def test_cancel_of_a_waiting_turn_says_so(store: Store) -> None:
    first = await make_turn(store)
    await first.accept()
    second = await make_turn(store, conversation_id=first.cid)
    await second.admit()
    assert await store.cancel(second.id, "", now=time.time()) == ("signalled", "waiting")


async def test_cancel_of_a_terminal_turn_is_a_noop(store: Store) -> None:
    t = await make_turn(store)
    await t.run_to(LAST)
    assert await t.finish() == "ok"
    k = store.keys
    before = await dump(store.redis, store.settings.prefix)
    async with listening(store, k.cancel_channel()) as channel:
        assert await store.cancel(t.id, "stop", now=time.time()) == ("noop", "succeeded")
        told = await published(channel)
    assert told == []
    assert not await store.redis.exists(k.cancel_flag(t.id))
    assert await dump(store.redis, store.settings.prefix) == before


# --- emit -------------------------------------------------------------------------------------------


async def test_emit_appends_with_the_next_seq(store: Store) -> None:
    t = await make_turn(store)
    await t.run_to(MODEL)
    await t.begin(MODEL, claim="w1")
    n = len(await stream(store, t.id))
    await store.emit(t.id, events.TextDelta(turn_id=t.id, text="Hel"))
    script = store.redis.register_script(lua.source("emit"))
    delta = events.encode(events.TextDelta(turn_id=t.id, text="lo"))
    assert await script(keys=[store.keys.turn(t.id), store.keys.events(t.id)], args=[delta]) == n + 2
    seen = await stream(store, t.id)
    assert_gapless(seen)
    assert [(e.type, getattr(e, "text", None)) for e in seen[n:]] == [("text_delta", "Hel"), ("text_delta", "lo")]


async def test_emit_to_a_terminal_turn_appends_nothing(store: Store) -> None:
    t = await make_turn(store)
    await t.run_to(LAST)
    assert await t.finish() == "ok"
    before = await dump(store.redis, store.settings.prefix)
    await store.emit(t.id, events.TextDelta(turn_id=t.id, text="late"))
    script = store.redis.register_script(lua.source("emit"))
    delta = events.encode(events.TextDelta(turn_id=t.id, text="later"))
    assert await script(keys=[store.keys.turn(t.id), store.keys.events(t.id)], args=[delta]) == 0
    assert await dump(store.redis, store.settings.prefix) == before


# --- submit -----------------------------------------------------------------------------------------


async def test_store_enqueue_takes_no_place_in_any_line(store: Store) -> None:
    k, prefix = store.keys, store.settings.prefix
    mid = new_id("m")
    _, _, data = build_message(FIRST, FIRST, ({"anything": 1},), message_id=mid, now_ms=int(time.time() * 1000))
    async with listening(store, k.doorbell_channel()) as doorbell:
        await store.enqueue(FIRST, mid, data)
        rang = await published(doorbell)
    assert rang == [FIRST]
    assert await store.redis.hget(store.keys.queue_messages(FIRST), mid) == data
    assert await store.redis.lrange(store.keys.queue(FIRST), 0, -1) == [mid.encode()]
    assert [key async for key in store.redis.scan_iter(f"{prefix}:conv:*")] == []


async def test_client_enqueue_takes_a_place_in_the_line_only_when_asked(store: Store) -> None:
    prefix, k = store.settings.prefix, store.keys
    client = Client(store.settings.redis_url or "", prefix=prefix)
    try:
        cid = new_id("c")
        client.enqueue(FIRST, FIRST, ({"x": 1},), conversation_id=cid)  # no turn id: no place
        client.enqueue(FIRST, FIRST, ({"x": 2},), turn_id="t-lonely")  # no conversation: no place
        assert [key async for key in store.redis.scan_iter(f"{prefix}:conv:*")] == []
        client.enqueue(FIRST, FIRST, ({"x": 3},), conversation_id=cid, turn_id="t-placed")
        assert await members(store, k.turn_queue(cid)) == ["t-placed"]
        first_turn = client.submit({"tenant_id": "t1", "app_id": "app", "user_id": "u1", "agent_id": AGENT.id,
                                    "query": "hi"})
        assert await members(store, k.turn_queue(new_conversation_id(first_turn))) == [first_turn]
        assert await store.redis.llen(store.keys.queue(FIRST)) == 4
    finally:
        client.close()


async def test_an_owners_submission_into_another_tenants_conversation_writes_nothing(store: Store) -> None:
    a = await finished_turn(store)
    client = Client(store.settings.redis_url or "", prefix=store.settings.prefix)
    client.put_agent(AGENT)  # the agent exists: what refuses the turn is the conversation's owner
    try:
        before = await dump(store.redis, store.settings.prefix)
        with pytest.raises(ConversationNotFound):
            client.start({"tenant_id": "t2", "app_id": "app", "user_id": "u1", "agent_id": AGENT.id,
                          "turn_id": "t-refused", "conversation_id": a.cid, "query": "let me in"}, owner="t2")
        after = await dump(store.redis, store.settings.prefix)
        if store.keys.shards:
            # the sharded layout's one write: the id's shard pointer, taken before the submission (to
            # refuse an id of another shard's turn); it holds the shard's number and expires
            pointer = store.keys.turn_shard("t-refused")
            assert after.pop(pointer)[1] == b"0" and await store.redis.ttl(pointer) > 0
        assert after == before
        # its own tenant's turn takes its place as before
        handle = client.start({"tenant_id": "t1", "app_id": "app", "user_id": "u1", "agent_id": AGENT.id,
                               "conversation_id": a.cid, "query": "mine"}, owner="t1")
        assert await members(store, store.keys.turn_queue(a.cid)) == [str(handle)]
    finally:
        client.close()


async def test_submission_scores_are_exact_microseconds_and_keep_the_order(store: Store) -> None:
    client = Client(store.settings.redis_url or "", prefix=store.settings.prefix)
    try:
        cid = new_id("c")
        seconds, micros = await store.redis.time()
        before = seconds * 1_000_000 + micros
        ids = [client.submit({"tenant_id": "t1", "app_id": "app", "user_id": "u1", "agent_id": AGENT.id,
                              "conversation_id": cid, "query": f"q{i}"}) for i in range(2)]
        seconds, micros = await store.redis.time()
        after = seconds * 1_000_000 + micros
    finally:
        client.close()
    line = store.keys.turn_queue(cid)
    assert await members(store, line) == ids
    scores = [await raw_score(store, line, i) for i in ids]
    assert all(re.fullmatch(r"\d{16}", s) for s in scores), scores  # integers: no rounding, no exponent
    assert before <= int(scores[0]) < int(scores[1]) <= after
    # admission keeps the place the producer took
    t = await make_turn(store, conversation_id=cid, turn_id=ids[1])
    assert (await t.admit())[0] == "waiting"  # behind the first, which was never picked up
    assert await raw_score(store, line, ids[1]) == scores[1]


async def raw_score(store: Store, key: str, member: str) -> str:
    """A score as the server prints it (redis-py would parse it into a float first)."""
    raw = await store.redis.eval("return redis.call('ZSCORE', KEYS[1], ARGV[1])", 1, key, member)  # type: ignore[misc]
    return raw.decode()


# --- the scripts name no stage ----------------------------------------------------------------------

STAGE_WORDS = ("resolve", "history", "map", "invoke", "persist")
@pytest.mark.parametrize("path", [pytest.param(p, id=p.name) for p in sorted(SCRIPTS.glob("*.lua"))])
def test_no_script_names_a_stage(path: Path) -> None:
    source = path.read_text()
    named = [w for w in STAGE_WORDS if re.search(rf"\b{w}\b", source)]
    assert named == [], f"{path.name} names {named}"


@pytest.mark.parametrize("path", sorted(SCRIPTS.glob("*.lua")), ids=lambda p: p.name)
def test_no_script_code_names_a_stage(path: Path) -> None:
    code = "\n".join(line.split("--", 1)[0] for line in path.read_text().splitlines())
    named = [w for w in STAGE_WORDS if re.search(rf"\b{w}\b", code)]
    assert named == [], f"{path.name} names {named}"


# --- rate_limit (the gateway's buckets and stream holds) ----------------------------------------------


def limits_of(store: Store) -> Any:
    from threadline.workers.storage.rate_limits import RateLimits

    return RateLimits(store.redis, store.keys)


def bucket(store: Store, name: str, *, per_s: float = 1.0, burst: float = 2.0, cost: int = 1) -> Any:
    from threadline.workers.storage.rate_limits import Bucket

    return Bucket(store.keys.rate_bucket("rps", name), per_s=per_s, burst=burst, cost=cost)


async def test_rate_limit_takes_from_a_full_bucket_until_it_is_empty_and_says_when_to_retry(store: Store) -> None:
    limits, b = limits_of(store), bucket(store, "k1", per_s=0.5, burst=2)
    assert not await store.redis.exists(b.key)  # an absent bucket is a full one
    assert [(await limits.take([b])).allowed for _ in range(3)] == [True, True, False]
    refused = await limits.take([b])
    # empty, refilling half a token a second: the next token is about 2 s away (server time)
    assert not refused.allowed and refused.short == b and 1_500 < refused.retry_after_ms <= 2_000
    assert float((await hash_of(store, b.key))["tokens"]) < 0.1
    # it expires once it would be full again (2 tokens at 0.5/s: 4 s, plus a second)
    assert 0 < await store.redis.pttl(b.key) <= 5_000


async def test_rate_limit_refills_by_the_servers_clock(store: Store) -> None:
    limits, b = limits_of(store), bucket(store, "k2", per_s=1, burst=2)
    assert (await limits.take([bucket(store, "k2", per_s=1, burst=2, cost=2)])).allowed
    assert not (await limits.take([b])).allowed
    # as if 1.5 s had passed since the last take: one and a half tokens came back
    at = int((await hash_of(store, b.key))["at"])
    await store.redis.hset(b.key, "at", str(at - 1_500))
    assert (await limits.take([b])).allowed
    assert float((await hash_of(store, b.key))["tokens"]) == pytest.approx(0.5, abs=0.05)


async def test_rate_limit_is_all_or_nothing_and_a_peek_takes_nothing(store: Store) -> None:
    limits = limits_of(store)
    roomy, tight = bucket(store, "roomy", burst=10), bucket(store, "tight", burst=1)
    assert (await limits.take([tight])).allowed
    refused = await limits.take([roomy, tight])
    assert not refused.allowed and refused.short == tight
    assert not await store.redis.exists(roomy.key)  # the roomy bucket gave nothing for a refused request
    peek = bucket(store, "peek", burst=1, cost=0)
    assert (await limits.take([peek])).allowed and not await store.redis.exists(peek.key)
    assert (await limits.take([bucket(store, "peek", burst=1)])).allowed
    assert not (await limits.take([peek])).allowed  # cost 0: allowed only while a whole token is left


async def test_rate_limit_holds_a_keys_streams_up_to_its_limit_and_drops_lapsed_holders(store: Store) -> None:
    limits = limits_of(store)
    holders = store.keys.stream_holders("kid")
    assert (await limits.take([], hold=("kid", "s1", 2))).allowed
    assert (await limits.take([], hold=("kid", "s1", 2))).allowed  # the same token holds one place
    assert (await limits.take([], hold=("kid", "s2", 2))).allowed
    full = await limits.take([bucket(store, "kid-rps", burst=5)], hold=("kid", "s3", 2))
    assert (full.allowed, full.retry_after_ms, full.short) == (False, 1000, None)
    assert not await store.redis.exists(store.keys.rate_bucket("rps", "kid-rps"))  # nothing taken
    assert await members(store, holders) == ["s1", "s2"] and 0 < await store.redis.pttl(holders) <= 31_000
    # a holder whose lease lapsed (its gateway died) is dropped before counting
    await store.redis.zadd(holders, {"s1": 1})
    assert (await limits.take([], hold=("kid", "s3", 2))).allowed
    assert sorted(await members(store, holders)) == ["s2", "s3"]
    await limits.renew_streams([("kid", "s2"), ("kid", "gone")])
    # renewed s2's lease to at least s3's (later, or in the same millisecond); "gone" not added
    assert sorted(await members(store, holders)) == ["s2", "s3"]
    assert (await store.redis.zscore(holders, "s2") or 0) >= (await store.redis.zscore(holders, "s3") or 0)
    await limits.release_stream("kid", "s3")
    assert await limits.open_streams("kid") == 1
