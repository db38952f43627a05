"""The chaos test: three worker processes run 100 turns over 20 conversations of a streaming offline
model while five of them are SIGKILLed at random moments (each replaced at once) and their
Redis-protocol server restarts once. Afterwards every turn has exactly one terminal event, every
thread holds its turns once and in submission order, no message row is duplicated, usage is counted
once per turn, every conversation's next turn succeeds, and no turn running at the restart waits out
the stall time (`TL_STALL_S`). It prints the figures docs/reliability.md quotes.

`TL_TEST_CLUSTER=3` runs it on a Redis Cluster of 3 primaries with a replica each (`servers.py`;
the sharded layout): the restart then stops the primary serving a running turn's record.

Not part of the default test command (`-m "not chaos"` in pytest's addopts); `.ci/run` runs it alone:
`.venv/bin/python -m pytest -m chaos -n 0 -p no:randomly tests/chaos`. `CHAOS_SEED` replays a run's
plan (the seed is printed with the figures).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any, Literal, TypeVar

import pytest
import redis

from tests.chaos import figures as fig
from tests.chaos.servers import ChaosServer, chaos_server
from tests.conftest import WorkerPool, turn
from tests.support.wait import poll
from threadline.pipeline import events as ev
from threadline.pipeline.config import AgentConfig
from threadline.pipeline.contracts import new_conversation_id
from threadline.workers.clients.client import Client
from threadline.workers.protocol.keys import Keys
from threadline.workers.protocol.schema import text
from threadline.workers.settings import Settings
from threadline.workers.storage.connect import sync_client

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(180)]

T = TypeVar("T")
Action = Literal["kill", "restart"]

CONVERSATIONS = 20
TURNS_EACH = 5
WORKERS = 3
KILLS = 5
#: A wave submits the next turn of every conversation; its turns queue behind the ones still running.
WAVE_GAP_S = 2.0
#: `offline:chat` streams its 10 to 20 words this far apart: 0.5 to 1 s a turn, so kills find turns mid-stream.
WORD_DELAY_MS = 50
#: Kills and the restart fall at random moments within this window from the first submission.
CHAOS_WINDOW_S = (2.0, 12.0)
RESTART_WINDOW_S = (3.0, 9.0)
#: How long an action waits for turns in flight (a worker holding one mid-stream, for a kill), when
#: there are none at its moment.
BUSY_WAIT_S = 3.0
SERVER_DOWN_S = 1.5
#: After the last chaos action, how long the turns may take to end (the rest are counted lost).
SETTLE_S = 90.0
#: How long the next turn of every conversation may take, all together.
NEXT_TURNS_S = 30.0
#: The workers run with the default settings: what is measured is what a deployment gets. With
#: heartbeat liveness (a dead worker's turns taken over after `TL_WORKER_TIMEOUT_S`) the run takes
#: ~40 s; even a 60 s `TL_STALL_S` recovery would keep it under the hard timeout (~80 s measured).
CHAOS_ENV: dict[str, str] = {}
TENANT = "chaos"
AGENT = "chaos-chat"
#: What a call meets while the server is away; on a cluster, also while a replica takes over a
#: stopped primary's slots (redis-py's cluster client raises these once its own retries are spent).
DISCONNECTED = (redis.ConnectionError, redis.TimeoutError, redis.exceptions.ClusterError,
                redis.exceptions.ClusterDownError, redis.exceptions.TryAgainError,
                redis.exceptions.SlotNotCoveredError)


def retrying(call: Callable[[], T], *, timeout_s: float = 30.0) -> T:
    """`call()`, again while the server is away (restarting, or loading its append-only file)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return call()
        except DISCONNECTED:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def last_entry(r: redis.Redis, keys: Keys, turn_id: str) -> str:
    """The id of the turn's last event, or "0" when it has none."""
    found: Any = r.xrevrange(keys.events(turn_id), count=1)
    return text(found[0][0]) if found else "0"


class Chaos(threading.Thread):
    """Runs the plan (kills and the restart, at their offsets from `t0`) one action after another, on a
    connection of its own; the test reads what it did from `kills` and `restart`."""

    def __init__(self, *, pool: WorkerPool, server: ChaosServer, keys_of: Callable[[str], Keys], turn_ids: list[str],
                 plan: list[tuple[float, Action]], rng: random.Random) -> None:
        super().__init__(name="chaos", daemon=True)
        self.pool, self.server, self.turn_ids, self.plan, self.rng = pool, server, turn_ids, plan, rng
        #: A turn's keys (bound to its shard in the sharded layout): `turn_keys` of the test's client.
        self.keys_of = keys_of
        self.kills: list[fig.Kill] = []
        self.restart: fig.Restart | None = None
        self.error: BaseException | None = None
        self.t0 = time.monotonic()

    def run(self) -> None:
        try:
            for offset, action in self.plan:
                time.sleep(max(0.0, self.t0 + offset - time.monotonic()))
                if action == "kill":
                    self.kill()
                else:
                    self.restart_server()
        except BaseException as e:  # handed to the test, which re-raises it
            self.error = e

    def claims(self, r: redis.Redis) -> dict[str, int]:
        """Turn id → the pid of the worker holding its model claim (the claim is the runtime's
        worker id, `host:pid:random`)."""
        ids = list(self.turn_ids)
        pipe = r.pipeline(transaction=False)
        for turn_id in ids:
            pipe.get(self.keys_of(turn_id).model_claim(turn_id))
        return {t: int(text(v).rsplit(":", 2)[1]) for t, v in zip(ids, pipe.execute(), strict=True) if v}

    def busy(self, r: redis.Redis) -> list[subprocess.Popen[bytes]]:
        """The live workers that hold a turn mid-stream (its model claim)."""
        holders = set(retrying(lambda: self.claims(r)).values())
        return [p for p in self.pool.procs if p.pid in holders]

    def kill(self) -> None:
        """SIGKILL a random worker among those that hold a turn mid-stream (waiting up to
        `BUSY_WAIT_S` for one: late in the run most turns may have ended), and start its replacement
        at once. The turns it held are those whose claim still names it after its death (a claim
        outlives its holder by up to `TL_INVOKE_LEASE_S`)."""
        r = sync_client(self.server.url)
        try:
            busy = poll(lambda: self.busy(r), timeout_s=BUSY_WAIT_S, interval_s=0.05)
            victim = self.rng.choice(busy or self.pool.procs)
            at = time.time()
            victim.send_signal(signal.SIGKILL)
            victim.wait()
            held = [t for t, pid in retrying(lambda: self.claims(r)).items() if pid == victim.pid]
            self.kills.append(fig.Kill(at=at, pid=victim.pid,
                                       held={t: retrying(partial(last_entry, r, self.keys_of(t), t))
                                             for t in held}))
        finally:
            r.close()
        self.pool.procs.remove(victim)
        self.pool.start(processes=1)

    def running(self, r: redis.Redis) -> list[str]:
        ids = list(self.turn_ids)
        pipe = r.pipeline(transaction=False)
        for turn_id in ids:
            pipe.hget(self.keys_of(turn_id).turn(turn_id), "status")
        return [t for t, s in zip(ids, pipe.execute(), strict=True) if s == b"running"]

    def restart_server(self) -> None:
        """Once turns are running (waiting up to `BUSY_WAIT_S`), stop the server (gracefully: its
        append-only file is fsynced at every write), leave it down for a moment, start it again on
        the same port and data. On a cluster, the server is the primary serving the first running
        turn's record."""
        r = sync_client(self.server.url)
        running = poll(lambda: self.running(r), timeout_s=BUSY_WAIT_S, interval_s=0.05)
        r.close()
        near = self.keys_of(running[0]).turn(running[0]) if running else None
        stopped_at = time.time()
        self.server.stop(near_key=near)
        time.sleep(SERVER_DOWN_S)
        self.server.start()
        self.restart = fig.Restart(stopped_at=stopped_at, started_at=time.time(), running=running)


def chaos_plan(rng: random.Random) -> list[tuple[float, Action]]:
    kills: list[tuple[float, Action]] = [(rng.uniform(*CHAOS_WINDOW_S), "kill") for _ in range(KILLS)]
    return sorted([*kills, (rng.uniform(*RESTART_WINDOW_S), "restart")])


def submit_waves(client: Client, conversations: list[fig.Conversation], turn_ids: list[str],
                 rng: random.Random) -> None:
    """Wave k submits turn k of every conversation (in a random order of conversations), `WAVE_GAP_S`
    after wave k-1, whether or not turn k-1 has ended: a conversation's turns run in submission order.
    A submission the restart interrupts is sent again with the same turn id (one turn, not two)."""
    for wave in range(TURNS_EACH):
        if wave:
            time.sleep(WAVE_GAP_S)
        for c in rng.sample(conversations, len(conversations)):
            # the first turn starts the conversation named after it; the later ones name it already
            turn_id = c.first_turn_id if wave == 0 else uuid.uuid4().hex
            query = f"{c.id[-6:]}-q{wave + 1}"
            request = turn(AGENT, query, tenant_id=TENANT, turn_id=turn_id, conversation_id=c.id if wave else None)
            retrying(partial(client.submit, request))
            turn_ids.append(turn_id)
            c.turns.append((turn_id, query))


def new_conversations() -> list[fig.Conversation]:
    """Conversation ids are the ones their first turns will start (`c-<turn id>`): known up front."""
    firsts = [uuid.uuid4().hex for _ in range(CONVERSATIONS)]
    return [fig.Conversation(id=new_conversation_id(first), first_turn_id=first) for first in firsts]


def wait_ended(client: Client, turn_ids: list[str], timeout_s: float) -> None:
    """Until every turn's record says it ended, or `timeout_s` (what has not ended then is lost)."""

    def ended() -> bool:
        pipe = client.redis.pipeline(transaction=False)
        for turn_id in turn_ids:
            pipe.hget(bound(client, turn_id).turn(turn_id), "status")
        return all(s is not None and text(s) in ev.TERMINAL_TYPES for s in pipe.execute())

    poll(lambda: retrying(ended), timeout_s=timeout_s, interval_s=0.25)


def bound(client: Client, turn_id: str) -> Keys:
    """The keys of a turn this client submitted (bound to its shard in the sharded layout)."""
    keys = client.turn_keys(turn_id)
    assert keys is not None, f"turn {turn_id} is unknown"
    return keys


def read_events(client: Client, turn_ids: list[str]) -> dict[str, list[fig.Stamped]]:
    found: dict[str, list[fig.Stamped]] = {}
    for turn_id in turn_ids:
        entries: Any = client.redis.xrange(bound(client, turn_id).events(turn_id))
        found[turn_id] = [fig.Stamped(fig.entry(text(i)), ev.decode(f[b"json"])) for i, f in entries]
    return found


def read_stored(client: Client, conversations: list[fig.Conversation]) -> dict[str, fig.Stored]:
    return {c.id: fig.Stored(thread=[m.turn_id for m in client.thread(c.id)],
                             rows=[m.turn_id for m in client.messages(c.id)]) for c in conversations}


def answers(events: dict[str, list[fig.Stamped]]) -> dict[str, str]:
    return {t: s.event.answer for t, e in events.items() for s in e if isinstance(s.event, ev.Succeeded)}


def usage_counters(client: Client) -> dict[str, int]:
    """The tenant's usage counters, summed over the shards (each has a usage hash of its own)."""
    counted: dict[str, int] = {}
    for shard in client.keys.every_shard():
        for k, v in client.redis.hgetall(shard.usage(TENANT)).items():
            counted[text(k)] = counted.get(text(k), 0) + int(v)
    return counted


def next_turns(client: Client, conversations: list[fig.Conversation]) -> list[ev.Terminal | None]:
    """One more turn per conversation, after the chaos: each must run normally (None: no end in time)."""
    for c in conversations:
        query = f"{c.id[-6:]}-after"
        turn_id = client.submit(turn(AGENT, query, tenant_id=TENANT, conversation_id=c.id))
        c.turns.append((turn_id, query))
    deadline = time.monotonic() + NEXT_TURNS_S
    ended: list[ev.Terminal | None] = []
    for c in conversations:
        try:
            ended.append(client.wait(c.turns[-1][0], timeout_s=max(0.1, deadline - time.monotonic())))
        except TimeoutError:
            ended.append(None)
    return ended


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ChaosServer]:
    """The test's own persisted server, started: one Valkey, or a cluster with `TL_TEST_CLUSTER`."""
    started = chaos_server(tmp_path)
    started.start()
    yield started
    started.close()


@pytest.fixture
def pool(server: ChaosServer, tmp_path: Path) -> Iterator[WorkerPool]:
    p = WorkerPool(server.url, f"tlx{uuid.uuid4().hex[:6]}", tmp_path, env={**CHAOS_ENV, **server.env})
    yield p.start(processes=WORKERS)
    p.stop()


def recovery_settings(pool: WorkerPool) -> dict[str, float]:
    """The workers' settings that decide how fast a turn is taken over (those this version has)."""
    settings = Settings.from_env(pool.env)
    names = ("stall_s", "watchdog_s", "invoke_lease_s", "heartbeat_s", "worker_timeout_s")
    return {name: getattr(settings, name) for name in names if hasattr(settings, name)}


def log_counts(pool: WorkerPool, *names: str) -> dict[str, int]:
    """How many times the workers logged each of these events (watchdog takeovers)."""
    log = pool.log_path.read_text()
    return {name: log.count(f'"{name}"') for name in names}


def measure(client: Client, pool: WorkerPool, chaos: Chaos, conversations: list[fig.Conversation],
            turn_ids: list[str]) -> dict[str, Any]:
    """The figures of the run, then of one more turn per conversation."""
    events = read_events(client, turn_ids)
    figures: dict[str, Any] = {**fig.turn_figures(events),
                               **fig.thread_figures(conversations, read_stored(client, conversations), answers(events)),
                               **fig.usage_figures(usage_counters(client), events),
                               **fig.recovery_figures(chaos.kills, chaos.restart, events),
                               **log_counts(pool, "stalled_turn_requeued", "worker_reaped")}
    after = next_turns(client, conversations)
    stored = read_stored(client, conversations)
    figures["next_turns_succeeded"] = sum(isinstance(t, ev.Succeeded) for t in after)
    figures["next_turns_in_order"] = sum(stored[c.id].thread == [t for t, _ in c.turns] for c in conversations)
    # the next turns' answers show what their model saw: every earlier query, once each, in order
    figures["next_turns_history_mismatches"] = fig.thread_figures(
        conversations, stored, answers(events) | {t.turn_id: t.answer for t in after if isinstance(t, ev.Succeeded)},
    )["history_mismatches"]
    return figures


def test_turns_survive_worker_kills_and_a_server_restart(server: ChaosServer, pool: WorkerPool,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    seed = int(os.environ.get("CHAOS_SEED") or random.randrange(1 << 32))
    rng = random.Random(seed)
    client = Client(server.url, prefix=pool.prefix, shards=Settings.from_env(pool.env).shards)
    client.put_agent(AgentConfig.model_validate(
        {"id": AGENT, "model": {"provider": "offline", "name": "chat", "options": {"delay_ms": WORD_DELAY_MS}}}))
    conversations, turn_ids = new_conversations(), list[str]()
    chaos = Chaos(pool=pool, server=server, keys_of=partial(bound, client), turn_ids=turn_ids, plan=chaos_plan(rng),
                  rng=rng)
    started = time.monotonic()
    chaos.start()
    submit_waves(client, conversations, turn_ids, rng)
    chaos.join(timeout=120)
    assert not chaos.is_alive(), "the chaos plan did not finish"
    if chaos.error is not None:
        raise chaos.error
    wait_ended(client, turn_ids, SETTLE_S)
    figures = {"seed": seed, "server": server.describe(), "settings": recovery_settings(pool), "turns": len(turn_ids),
               "run_s": round(time.monotonic() - started, 1), **measure(client, pool, chaos, conversations, turn_ids)}
    client.close()
    with capsys.disabled():
        print("\n" + fig.report(figures))

    assert len(turn_ids) == CONVERSATIONS * TURNS_EACH and len(chaos.kills) == KILLS and chaos.restart is not None
    assert (figures["lost"], figures["duplicated"], figures["seq_gaps"]) == ([], [], []), figures
    assert (figures["out_of_order"], figures["duplicate_rows"]) == ([], []), figures
    # a turn the watchdog had to run again more than TL_MAX_RECOVERIES times ends failed/internal_error:
    # an outcome the contract allows (exactly once, recorded); the figures count it
    assert set(figures["outcomes"]) <= {"succeeded", "failed:internal_error"}, figures["outcomes"]
    assert figures["history_mismatches"] == figures["next_turns_history_mismatches"] == [], figures
    assert figures["turns_counted"] == figures["turns_accepted"] == len(turn_ids), figures
    assert figures["tokens_counted"] == figures["tokens_in_events"], figures
    assert figures["next_turns_succeeded"] == figures["next_turns_in_order"] == CONVERSATIONS, figures
    # no turn waits out the stall time after the restart: a message a consumer had fetched when its
    # connection dropped is put back by the next consumer (`DoorbellConsumer._requeue_orphans`)
    restart = figures["restart"]
    waited = (restart or {}).get("next_event_s") or {"max": 0.0}
    assert waited["max"] < figures["settings"]["stall_s"] / 2, restart
    assert pool.alive() and len(pool.procs) == WORKERS, pool.log_tail()
