"""Fallback models and the fleet-wide `max_concurrency`, through real turns on real worker processes:
which model answered (events, decision record), what does and does not fall back, model calls that
never overlap across processes, a cancelled wait, and a dead holder that does not block."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
from redis.cluster import RedisCluster

from tests.conftest import AgentFactory, WorkerPool, turn
from tests.support.clocks import turn_times
from tests.support.turns import assert_one_terminal, python_model, records
from tests.support.wait import wait_until
from threadline.pipeline import events as ev
from threadline.workers.clients.client import Client
from threadline.workers.storage.store import Store
from threadline.workers.worker.limiter import MAX_BACKOFF_S, FleetLimiter

pytestmark = pytest.mark.integration

CALL_MS = 300


def calls(record: Path) -> list[tuple[float, float]]:
    """(start, end) of every model call a `timed` model recorded, by start."""
    starts = [r["at"] for r in records(record) if r["event"] == "start"]
    ends = [r["at"] for r in records(record) if r["event"] == "end"]
    assert len(starts) == len(ends), records(record)
    return list(zip(sorted(starts), sorted(ends), strict=True))


def most_in_flight(intervals: list[tuple[float, float]]) -> int:
    edges = sorted([(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals])
    running = peak = 0
    for _, step in edges:
        running += step
        peak = max(peak, running)
    return peak


def run_three(client: Client, agent: str) -> list[ev.Terminal]:
    """Three turns of one agent in three conversations, at once."""
    turn_ids = [client.submit(turn(agent, f"question {i}")) for i in range(3)]
    return [client.wait(t, timeout_s=30) for t in turn_ids]


# --- fallback -------------------------------------------------------------------------------------


@pytest.mark.parametrize("status", [429, 503])
def test_a_transient_failure_falls_back_and_the_turn_says_who_answered(
        workers: WorkerPool, client: Client, make_agent: AgentFactory, tmp_path: Path, status: int) -> None:
    record = tmp_path / "primary.jsonl"
    agent = make_agent({**python_model("failing", status=status, record=str(record)), "fallback": ["offline:chat"]})
    terminal = client.wait(client.submit(turn(agent, "hello")), timeout_s=30)
    assert isinstance(terminal, ev.Succeeded), terminal
    assert terminal.model == "offline:chat"
    assert "hello" in terminal.answer
    assert len(records(record)) == 1, "the primary was asked once; its failure was not retried, it fell back"
    assert client.decisions(terminal.turn_id)["invoke"] == {"model": "offline:chat", "fallback_from": ["test:failing"]}
    assert not [e for e in client.events(terminal.turn_id) if isinstance(e, ev.Retrying)]


def test_a_bad_request_does_not_fall_back(workers: WorkerPool, client: Client, make_agent: AgentFactory,
                                          tmp_path: Path) -> None:
    primary, fallback = tmp_path / "primary.jsonl", tmp_path / "fallback.jsonl"
    agent = make_agent({**python_model("failing", status=400, record=str(primary)),
                        "fallback": [python_model("streaming", words=3, record=str(fallback))]})
    terminal = client.wait(client.submit(turn(agent, "hello")), timeout_s=30)
    assert isinstance(terminal, ev.Failed) and terminal.code == "model_bad_request", terminal
    assert len(records(primary)) == 1
    assert not records(fallback), "a 400 never reaches the fallback"


def test_without_fallback_the_model_that_answered_is_named(workers: WorkerPool, client: Client,
                                                          make_agent: AgentFactory) -> None:
    terminal = client.wait(client.submit(turn(make_agent("offline:chat"), "hello")), timeout_s=30)
    assert isinstance(terminal, ev.Succeeded) and terminal.model == "offline:chat", terminal
    assert client.decisions(terminal.turn_id)["invoke"] == {"model": "offline:chat"}


# --- max_concurrency ------------------------------------------------------------------------------


def limited(record: Path, limit: int | None) -> dict[str, Any]:
    return {**python_model("timed", ms=CALL_MS, record=str(record)), "max_concurrency": limit}


def test_max_concurrency_holds_across_worker_processes(workers: WorkerPool, client: Client,
                                                       make_agent: AgentFactory, tmp_path: Path) -> None:
    free, bounded = tmp_path / "free.jsonl", tmp_path / "bounded.jsonl"
    # the shared pool is 2 processes: without a limit, the calls overlap (the test can fail); each
    # call here waits until two have started, so a busy machine starting the turns apart still
    # has them in flight together
    meeting = {"provider": "python", "name": "tests.support.gated_models:meeting",
               "options": {"record": str(free), "calls": 2}}
    assert all(isinstance(t, ev.Succeeded) for t in run_three(client, make_agent(meeting)))
    assert most_in_flight(calls(free)) >= 2, calls(free)

    agent = make_agent(limited(bounded, 1))
    terminals = run_three(client, agent)
    assert all(isinstance(t, ev.Succeeded) for t in terminals), terminals
    intervals = calls(bounded)
    assert len(intervals) == 3 and most_in_flight(intervals) == 1, intervals
    waits = [client.decisions(t.turn_id)["invoke"]["limit_wait_ms"] for t in terminals]
    assert max(waits) >= CALL_MS, waits  # the last one waited for at least one call before it
    assert not client.redis.exists(client.keys.model_limit(agent)), "every slot was given back"


def slot_asks(client: Client, holders: str) -> int:
    """How many times the server (on a cluster: the node of the agent's `holders` key) ran the slot
    script so far (its first command: the script is the only user of ZREMRANGEBYSCORE). Other
    tests' limited turns can only add to it."""
    r = client.redis
    on_node = {"target_nodes": r.get_node_from_key(holders)} if isinstance(r, RedisCluster) else {}
    stats: Any = r.info("commandstats", **on_node)
    return int(stats.get("cmdstat_zremrangebyscore", {}).get("calls", 0))


def test_cancelling_a_turn_that_waits_for_a_slot(workers: WorkerPool, client: Client, make_agent: AgentFactory,
                                                 tmp_path: Path) -> None:
    record = tmp_path / "calls.jsonl"
    agent = make_agent(limited(record, 1))
    holders = client.keys.model_limit(agent)
    client.redis.zadd(holders, {"someone-else": time.time() * 1000 + 600_000})  # a live holder, for 10 minutes
    turn_id = client.submit(turn(agent, "wait for it"))
    wait_until(lambda: any(isinstance(e, ev.StageEvent) and e.stage == "invoke"
                           for e in client.events(turn_id)))
    asked = slot_asks(client, holders)
    wait_until(lambda: slot_asks(client, holders) >= asked + 3)  # well into the wait: the backoff has asked a few times
    client.cancel(turn_id, "no more waiting")
    terminal = client.wait(turn_id, timeout_s=60)
    assert isinstance(terminal, ev.Cancelled), terminal
    assert not records(record), "the model was never called"
    assert client.redis.zrange(holders, 0, -1) == [b"someone-else"], "nothing it did not hold was freed"
    # the cancel ended the wait, not the slot: the turn's own record says it ended while the slot was
    # still held, and (at any load) well within the cancel poll's second of the request
    times = turn_times(client, turn_id)
    assert times["finished_at"] * 1000 < (client.redis.zscore(holders, "someone-else") or 0)
    assert times["finished_at"] - times["cancel_requested_at"] < 10, times
    assert_one_terminal(client, turn_id)


def test_a_holder_whose_worker_died_does_not_block(workers: WorkerPool, client: Client, make_agent: AgentFactory,
                                                   tmp_path: Path) -> None:
    record = tmp_path / "calls.jsonl"
    agent = make_agent(limited(record, 1))
    holders = client.keys.model_limit(agent)
    client.redis.zadd(holders, {"dead-worker": time.time() * 1000 - 1_000})  # its lease ran out a second ago
    terminal = client.wait(client.submit(turn(agent, "go ahead")), timeout_s=30)
    assert isinstance(terminal, ev.Succeeded), terminal
    assert client.decisions(terminal.turn_id)["invoke"]["limit_wait_ms"] < 1_000
    assert client.redis.zscore(holders, "dead-worker") is None


# --- the slot scripts and the limiter, without workers ---------------------------------------------




async def test_slot_scripts_count_holders_and_touch_only_their_own_token(store: Store) -> None:
    holders = store.keys.model_limit("bot")
    assert await store.acquire_slot("bot", "a", limit=2)
    assert await store.acquire_slot("bot", "a", limit=2), "a holder asking again keeps its one slot"
    assert await store.acquire_slot("bot", "b", limit=2)
    assert not await store.acquire_slot("bot", "c", limit=2)
    assert 0 < await store.redis.pttl(holders) <= (store.settings.invoke_lease_s + 1) * 1000, "never kept forever"
    await store.release_slot("bot", "c")  # holds nothing: frees nothing
    assert await store.redis.zcard(holders) == 2
    await store.release_slot("bot", "a")
    assert not await store.renew_slot("bot", "a"), "a released slot is not renewed back into existence"
    assert await store.renew_slot("bot", "b")
    assert await store.acquire_slot("bot", "c", limit=2)
    await store.redis.zadd(holders, {"b": time.time() * 1000 - 1})  # b's worker died: its lease ran out
    assert await store.acquire_slot("bot", "d", limit=2)
    assert sorted(await store.redis.zrange(holders, 0, -1)) == [b"c", b"d"]


async def test_a_limiter_waits_for_a_slot_and_gives_back_what_it_holds(store: Store) -> None:
    first = FleetLimiter(store, "bot", limit=1, turn_id="t1")
    second = FleetLimiter(store, "bot", limit=1, turn_id="t2")
    await first.acquire("test")
    before = time.monotonic()
    waiting = asyncio.create_task(second.acquire("test"))
    await asyncio.sleep(0)  # the task runs to its first await: its wait has begun
    holding = time.monotonic()
    await asyncio.sleep(0.2)  # the first holds its slot this long at least
    assert not waiting.done()
    held_s = time.monotonic() - holding
    first.release()
    await asyncio.wait_for(waiting, timeout=30)
    # the limiter's own figure spans the hold and no more than the whole wait; after the release it
    # asks again within one capped backoff (plenty of slack for a loaded machine)
    assert held_s <= second.waited_s <= time.monotonic() - before
    assert second.waited_s - held_s < MAX_BACKOFF_S + 2.0, (second.waited_s, held_s)
    await first.close()
    await second.close()
    assert not await store.redis.exists(store.keys.model_limit("bot"))
