"""Double texting (`on_busy`): a turn sent while a turn of its conversation runs — enqueued behind it,
refused, or interrupting it (keeping its partial answer, or rolling it back) — through real workers
with a streaming model; every turn ends once, and the thread is what the policy says."""

from __future__ import annotations

import dataclasses
import itertools
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import AgentFactory, WorkerPool, turn
from tests.support.cli import cli_env, cli_runner
from tests.support.gateway import running_gateway
from tests.support.script_driver import make_turn
from tests.support.turns import assert_gapless, assert_one_terminal, holder_pid, keys_of, python_model, wait_for_event
from tests.support.wait import wait_until
from threadline.pipeline import events as ev
from threadline.pipeline.busy import interrupt_victims
from threadline.pipeline.config import AgentConfig
from threadline.pipeline.contracts import new_conversation_id
from threadline.pipeline.errors import ConversationBusy
from threadline.pipeline.events import TERMINAL_TYPES
from threadline.pipeline.records import MessageRecord
from threadline.workers.clients.client import Client
from threadline.workers.clients.common import submit_call
from threadline.workers.settings import Settings
from threadline.workers.storage import lua
from threadline.workers.storage.api_keys import create_key
from threadline.workers.storage.store import Store

pytestmark = pytest.mark.integration

#: Turns per conversation in the quick suite (the slow tier sends the issue's 20).
QUICK = 6
FULL = 20


LongAnswer = Callable[[str], tuple[dict[str, Any], Path]]


@pytest.fixture
def long_answer(tmp_path: Path) -> Iterator[LongAnswer]:
    """`long_answer(name)`: a model that streams until its `stop` file exists (then ends its answer):
    every turn runs until it is interrupted, and the last one until the test lets it finish. Every
    stop file is touched after the test, so no turn streams on into the next test."""
    stops: list[Path] = []

    def make(name: str) -> tuple[dict[str, Any], Path]:
        stops.append(tmp_path / f"{name}.stop")
        return python_model("streaming", words=100_000, delay_ms=20, until=str(stops[-1])), stops[-1]

    yield make
    for stop in stops:
        stop.touch()


def entry_ms(client: Client, turn_id: str, kind: str) -> tuple[int, int]:
    """The stream entry id (server ms, sequence) of the turn's first event of `kind`."""
    for entry_id, fields in client.redis.xrange(keys_of(client, turn_id).events(turn_id)):
        if ev.decode(fields[b"json"]).type == kind:
            ms, seq = entry_id.decode().split("-")
            return int(ms), int(seq)
    raise AssertionError(f"turn {turn_id} has no {kind} event")


def terminal_kind(client: Client, turn_id: str) -> str:
    return next(e.type for e in client.events(turn_id) if e.type in TERMINAL_TYPES)


def assert_in_order(client: Client, turns: list[str]) -> None:
    """Each turn was accepted only after the one before it ended: one turn at a time, in order."""
    for before, after in itertools.pairwise(turns):
        assert entry_ms(client, before, terminal_kind(client, before)) <= entry_ms(client, after, "accepted"), (
            before, after)


def interrupting_chain(client: Client, agent: str, stop: Path, policy: str, n: int) -> tuple[str, list[str]]:
    """A conversation of `n` turns, each sent (with `policy`) while the one before it streams; the
    last is let finish. Returns the conversation id and the turn ids in submission order."""
    first = client.start(turn(agent, "q0"))
    cid = new_conversation_id(first)
    turns = [str(first)]
    for i in range(1, n):
        wait_for_event(client, turns[-1], "text_delta", timeout_s=30)
        turns.append(str(client.start(turn(agent, f"q{i}", conversation_id=cid, on_busy=policy))))
    wait_for_event(client, turns[-1], "text_delta", timeout_s=30)
    stop.touch()
    for t in turns:
        client.wait(t, timeout_s=60)
    return cid, turns


def in_parallel(*runs: Callable[[], Any]) -> list[Any]:
    """Run the callables in threads at once (two conversations side by side); re-raise a failure."""
    results: list[Any] = [None] * len(runs)
    errors: list[BaseException] = []

    def go(i: int, run: Callable[[], Any]) -> None:
        try:
            results[i] = run()
        except BaseException as e:  # handed to the test's thread
            errors.append(e)

    threads = [threading.Thread(target=go, args=(i, r)) for i, r in enumerate(runs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    if errors:
        raise errors[0]
    return results


def check_interrupted(client: Client, cid: str, turns: list[str], *, rollback: bool) -> None:
    for t in turns:
        assert_gapless(client, t)
        assert_one_terminal(client, t)
    *interrupted, last = turns
    assert isinstance(client.wait(last, timeout_s=5), ev.Succeeded)
    for t, by in zip(interrupted, turns[1:], strict=True):
        terminal = client.wait(t, timeout_s=5)
        assert isinstance(terminal, ev.Cancelled) and terminal.code == "cancelled", terminal
        assert client.redis.hget(keys_of(client, t).turn(t), "interrupted_by") == by.encode()
    assert_in_order(client, turns)
    thread = client.thread(cid)
    if rollback:
        # no trace of a rolled-back turn: no row, not in the message order, not the parent of anything
        assert [m.id for m in thread] == [last] and thread[0].parent_id is None
        assert [m.id for m in client.messages(cid)] == [last]
        assert client.redis.zrange(client.keys.message_order(cid), 0, -1) == [last.encode()]
        return
    assert [m.id for m in thread] == turns
    for row, by in zip(thread, turns[1:], strict=False):
        assert row.status == "cancelled" and row.interrupted_by == by, row
        assert row.answer.startswith("w0"), "the partial answer is kept"
    assert thread[-1].status == "succeeded" and thread[-1].interrupted_by is None
    assert [m.parent_id for m in thread] == [None, *turns[:-1]]


def run_interrupts(client: Client, make_agent: AgentFactory, long_answer: LongAnswer, policy: str, n: int) -> None:
    chains = []
    for name in ("a", "b"):
        model, stop = long_answer(f"{policy}-{name}")
        chains.append((make_agent(model), stop))
    results = in_parallel(*(lambda a=a, s=s: interrupting_chain(client, a, s, policy, n) for a, s in chains))
    for cid, turns in results:
        check_interrupted(client, cid, turns, rollback=policy == "rollback")


@pytest.mark.parametrize("policy", ["interrupt", "rollback"])
def test_each_turn_interrupts_the_one_running(policy: str, workers: WorkerPool, client: Client,
                                              make_agent: AgentFactory, long_answer: LongAnswer) -> None:
    run_interrupts(client, make_agent, long_answer, policy, QUICK)


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["interrupt", "rollback"])
def test_twenty_turns_interrupting_in_two_conversations(policy: str, workers: WorkerPool, client: Client,
                                                        make_agent: AgentFactory, long_answer: LongAnswer) -> None:
    run_interrupts(client, make_agent, long_answer, policy, FULL)


def enqueued_chain(client: Client, agent: str, n: int, policy: str | None) -> tuple[str, list[str]]:
    first = client.start(turn(agent, "q0"))
    cid = new_conversation_id(first)
    fields = {"on_busy": policy} if policy else {}
    turns = [str(first)] + [str(client.start(turn(agent, f"q{i}", conversation_id=cid, **fields)))
                            for i in range(1, n)]
    for t in turns:
        client.wait(t, timeout_s=120)
    return cid, turns


@pytest.mark.parametrize("n", [QUICK, pytest.param(FULL, marks=pytest.mark.slow)])
def test_enqueued_turns_wait_and_run_in_order(n: int, workers: WorkerPool, client: Client,
                                              make_agent: AgentFactory) -> None:
    """`enqueue` (named, or the default) is today's line: every turn runs, one at a time, in order."""
    agent = make_agent(python_model("streaming", words=4, delay_ms=30))
    results = in_parallel(lambda: enqueued_chain(client, agent, n, "enqueue"),
                          lambda: enqueued_chain(client, agent, n, None))
    for cid, turns in results:
        for t in turns:
            assert_gapless(client, t)
            assert isinstance(assert_one_terminal(client, t), ev.Succeeded)
        assert_in_order(client, turns)
        thread = client.thread(cid)
        assert [m.id for m in thread] == turns and all(m.interrupted_by is None for m in thread)


def rejected_chain(client: Client, agent: str, stop: Path, n: int) -> tuple[str, str, list[str]]:
    """While one turn streams, `n` turns sent with `on_busy: reject` are refused at once."""
    first = client.start(turn(agent, "q0"))
    cid = new_conversation_id(first)
    wait_for_event(client, first, "text_delta", timeout_s=30)
    refused = []
    for i in range(1, n + 1):
        turn_id = f"rej-{uuid.uuid4().hex}"
        with pytest.raises(ConversationBusy) as refusal:
            client.start(turn(agent, f"q{i}", conversation_id=cid, turn_id=turn_id), on_busy="reject")
        assert refusal.value.code == "conversation_busy" and cid in refusal.value.message
        refused.append(turn_id)
    stop.touch()
    return cid, str(first), refused


@pytest.mark.parametrize("n", [QUICK, pytest.param(FULL, marks=pytest.mark.slow)])
def test_rejected_turns_are_refused_at_once_and_write_nothing(
    n: int, workers: WorkerPool, client: Client, make_agent: AgentFactory, long_answer: LongAnswer
) -> None:
    chains = []
    for name in ("a", "b"):
        model, stop = long_answer(f"reject-{name}")
        chains.append((make_agent(model), stop))
    results = in_parallel(*(lambda a=a, s=s: rejected_chain(client, a, s, n) for a, s in chains))
    for cid, first, refused in results:
        assert isinstance(client.wait(first, timeout_s=60), ev.Succeeded)
        k = client.keys.of_conversation(cid)  # a conversation's turns' keys are in its shard
        for t in refused:
            assert not client.redis.exists(k.turn(t), k.events(t), k.cancel_flag(t))
        assert [m.id for m in client.thread(cid)] == [first]
        assert client.redis.zcard(client.keys.turn_queue(cid)) == 0
    for (agent, _), (cid, _, _) in zip(chains, results, strict=True):
        # once the conversation is free, a `reject` turn is let in (its model, told to stop, says a word)
        after = client.start(turn(agent, "now", conversation_id=cid, on_busy="reject"))
        assert isinstance(client.wait(after, timeout_s=60), ev.Succeeded)
        entry_ms(client, after, "accepted")


def test_two_rejects_at_once_let_exactly_one_through(workers: WorkerPool, client: Client,
                                                     make_agent: AgentFactory) -> None:
    """The decision is the script's: of turns racing into an idle conversation, one wins."""
    agent = make_agent(python_model("streaming", words=3, delay_ms=30))
    first = client.start(turn(agent, "q0"))
    cid = new_conversation_id(first)
    client.wait(first, timeout_s=60)

    def attempt(i: int) -> Callable[[], str]:
        def send() -> str:
            try:
                return str(client.start(turn(agent, f"r{i}", conversation_id=cid, on_busy="reject")))
            except ConversationBusy:
                return ""
        return send

    through = [t for t in in_parallel(*(attempt(i) for i in range(8))) if t]
    assert len(through) == 1, through
    assert isinstance(client.wait(through[0], timeout_s=60), ev.Succeeded)


def test_the_agents_default_rejects_a_raw_producers_turn_with_one_terminal_event(
    workers: WorkerPool, client: Client, make_agent: AgentFactory, long_answer: LongAnswer
) -> None:
    """A request naming no `on_busy` runs with its agent's; a producer that writes the message itself
    (`submit`, as raw Redis does) learns of the refusal from the turn's one terminal event."""
    model, stop = long_answer("default")
    agent = make_agent(model, on_busy="reject")
    first = client.start(turn(agent, "q0"))
    cid = new_conversation_id(first)
    wait_for_event(client, first, "text_delta", timeout_s=30)
    refused = [str(client.submit(turn(agent, f"q{i}", conversation_id=cid))) for i in range(1, 4)]
    for t in refused:
        terminal = client.wait(t, timeout_s=30)
        assert isinstance(terminal, ev.Failed) and terminal.code == "conversation_busy", terminal
        assert terminal.conversation_id is None and terminal.message_id is None
        assert_one_terminal(client, t)
    assert client.redis.zrange(client.keys.turn_queue(cid), 0, -1) == [first.encode()], "only the running turn"
    stop.touch()
    assert isinstance(client.wait(first, timeout_s=60), ev.Succeeded)
    assert [m.id for m in client.thread(cid)] == [first]


def test_the_agents_default_interrupts_for_a_raw_producer(workers: WorkerPool, client: Client,
                                                          make_agent: AgentFactory, long_answer: LongAnswer) -> None:
    """A request naming no policy, written as raw producers write it, interrupts by its agent's
    `on_busy: rollback`: the workers read the turns in its way and their script cancels them."""
    model, stop = long_answer("default-rollback")
    agent = make_agent(model, on_busy="rollback")
    first = client.start(turn(agent, "q0"))
    cid = new_conversation_id(first)
    turns = [str(first)]
    for i in range(1, 4):
        wait_for_event(client, turns[-1], "text_delta", timeout_s=30)
        turns.append(str(client.submit(turn(agent, f"q{i}", conversation_id=cid))))
    wait_for_event(client, turns[-1], "text_delta", timeout_s=30)
    stop.touch()
    for t in turns:
        client.wait(t, timeout_s=60)
    check_interrupted(client, cid, turns, rollback=True)


def test_an_interrupting_turn_jumps_ahead_of_waiting_ones(workers: WorkerPool, client: Client,
                                                          make_agent: AgentFactory, long_answer: LongAnswer) -> None:
    """`interrupt` runs next, before turns that were already waiting; they run after it, in order."""
    model, stop = long_answer("jump")
    agent = make_agent(model)
    first = client.start(turn(agent, "q0"))
    cid = new_conversation_id(first)
    wait_for_event(client, first, "text_delta", timeout_s=30)
    waiting = [str(client.start(turn(agent, f"w{i}", conversation_id=cid))) for i in range(2)]
    jumper = str(client.start(turn(agent, "now", conversation_id=cid, on_busy="interrupt")))
    wait_for_event(client, jumper, "text_delta", timeout_s=30)
    stop.touch()
    for t in (first, jumper, *waiting):
        client.wait(t, timeout_s=60)
        assert_one_terminal(client, t)
    assert terminal_kind(client, first) == "cancelled"
    assert_in_order(client, [first, jumper, *waiting])
    assert [m.id for m in client.thread(cid)] == [first, jumper, *waiting]


def test_the_victims_read_and_the_scripts_agree() -> None:
    """The holder first, then the interrupting turns placed before the turn (negative places)."""
    assert interrupt_victims("t", "h", [("i1", -5.0), ("i2", -3.0)], None) == ["h", "i1", "i2"]
    assert interrupt_victims("t", "h", [("i1", -5.0), ("t", -4.0), ("i2", -3.0)], -4.0) == ["h", "i1"]
    assert interrupt_victims("t", None, [], 17.0) == []
    assert interrupt_victims("t", "t", [], None) == []


@pytest.fixture
def gateway(workers: WorkerPool, redis_url: str, prefix: str) -> Iterator[tuple[str, str]]:
    settings = dataclasses.replace(Settings.from_env({"TL_KEY_RPS": "0"}), prefix=prefix, redis_url=redis_url)
    with running_gateway(settings, redis_url) as base:
        c = Client(redis_url, prefix=prefix)
        tenant = f"tdt{uuid.uuid4().hex[:6]}"
        yield base, create_key(c.redis, c.keys, tenant)
        c.close()


def test_the_gateway_answers_409_conversation_busy(gateway: tuple[str, str], client: Client,
                                                    make_agent: AgentFactory, long_answer: LongAnswer) -> None:
    base, key = gateway
    model, stop = long_answer("gateway")
    agent = make_agent(model)
    with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {key}"}, timeout=30) as http:
        body = {"app_id": "app", "user_id": "u1", "agent_id": agent, "query": "q0"}
        accepted = http.post("/v1/turns", json=body)
        assert accepted.status_code == 202, accepted.text
        cid = accepted.json()["conversation_id"]

        def streaming() -> bool:
            events = http.get(f"/v1/turns/{accepted.json()['turn_id']}").json()
            return bool(events.get("status") == "running")

        wait_until(streaming, timeout_s=30)
        refused = http.post("/v1/turns", json={**body, "conversation_id": cid, "on_busy": "reject"})
        assert refused.status_code == 409, refused.text
        assert refused.json()["code"] == "conversation_busy" and cid in refused.json()["message"]
        interrupting = http.post("/v1/turns", json={**body, "conversation_id": cid, "on_busy": "interrupt"})
        assert interrupting.status_code == 202, interrupting.text
        stop.touch()
        wait_until(lambda: http.get(f"/v1/turns/{interrupting.json()['turn_id']}").json().get("result"),
                   timeout_s=60)


def test_the_cli_exits_5_for_a_rejected_turn(workers: WorkerPool, client: Client, make_agent: AgentFactory,
                                             tmp_path: Path, long_answer: LongAnswer, redis_url: str, prefix: str,
                                             monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    cli_env(monkeypatch, redis_url=redis_url, prefix=prefix, data_dir=tmp_path / "data")
    run = cli_runner(capsys)
    model, stop = long_answer("cli")
    agent = make_agent(model)
    first = client.start(turn(agent, "q0"))
    cid = new_conversation_id(first)
    wait_for_event(client, first, "text_delta", timeout_s=30)
    scope = ("--tenant", "t1", "--app", "app", "--user", "u1", "--agent", agent, "--conversation", cid)
    refused = run("submit", *scope, "--query", "again", "--on-busy", "reject")
    assert refused.code == 5, refused
    assert "conversation_busy" in refused.one_line()
    interrupting = run("submit", *scope, "--query", "instead", "--on-busy", "interrupt")
    assert interrupting.code == 0, interrupting
    second = interrupting.out.strip()
    wait_for_event(client, second, "text_delta", timeout_s=30)
    stop.touch()
    assert isinstance(client.wait(first, timeout_s=60), ev.Cancelled)
    assert isinstance(client.wait(second, timeout_s=60), ev.Succeeded)
    shown = run("thread", cid)
    assert shown.code == 0 and f"[cancelled, interrupted by {second}] user: q0" in shown.out, shown


FAST_RECOVERY = {"TL_STALL_S": "2", "TL_WATCHDOG_S": "0.5", "TL_INVOKE_LEASE_S": "1.5", "TL_HEARTBEAT_S": "0.3",
                 "TL_WORKER_TIMEOUT_S": "1.5"}


@pytest.mark.slow  # a pool of its own, a worker killed and taken over
@pytest.mark.parametrize("policy", ["interrupt", "rollback"])
def test_an_interrupt_of_a_turn_whose_worker_is_killed_ends_each_turn_once(
    policy: str, isolated: Callable[..., WorkerPool], long_answer: LongAnswer
) -> None:
    """The worker running the interrupted turn dies as the interrupting turn arrives: the watchdog
    takes the turn over, finds it cancelled and ends it once (marked, or rolled back); the
    interrupting turn runs next."""
    pool = isolated(env=FAST_RECOVERY).start(processes=2)
    client = Client(pool.url, prefix=pool.prefix)
    model, stop = long_answer(f"kill-{policy}")
    client.put_agent(AgentConfig.model_validate({"id": "killed", "model": model}))
    first = client.start(turn("killed", "q0"))
    cid = new_conversation_id(first)
    wait_for_event(client, first, "text_delta", timeout_s=30)
    victim = next(p for p in pool.procs if p.pid == holder_pid(client, first))
    victim.send_signal(signal.SIGKILL)
    second = str(client.start(turn("killed", "instead", conversation_id=cid, on_busy=policy)))
    victim.wait()
    wait_for_event(client, second, "text_delta", timeout_s=60)
    stop.touch()
    assert isinstance(client.wait(second, timeout_s=60), ev.Succeeded)
    assert isinstance(assert_one_terminal(client, first), ev.Cancelled)
    assert_one_terminal(client, second)
    assert_gapless(client, first)
    assert_in_order(client, [first, second])
    thread = client.thread(cid)
    if policy == "rollback":
        assert [m.id for m in thread] == [second]
    else:
        assert [m.id for m in thread] == [first, second] and thread[0].interrupted_by == second
    client.close()


# --- the scripts' branches, through the store (no workers) --------------------------------------------


async def test_admit_refuses_a_reject_turn_of_a_busy_conversation_and_writes_nothing(store: Store) -> None:
    first = await make_turn(store)
    await first.accept()
    second = await make_turn(store, conversation_id=first.cid)
    status, ahead, _ = await store.admit(second.id, second.cid, now=time.time(), request=second.request,
                                      on_busy="reject")
    assert (status, ahead) == ("busy", first.id)
    assert not await store.redis.exists(store.keys.turn(second.id), store.keys.cancel_flag(first.id))
    assert [m.decode() for m in await store.redis.zrange(store.keys.turn_queue(first.cid), 0, -1)] == [first.id]
    assert not await store.redis.hexists(store.keys.waiting(first.cid), second.id)
    # the conversation free again, the same policy lets a turn in
    assert await first.finish() == "ok"
    assert (await store.admit(second.id, second.cid, now=time.time(), request=second.request,
                              on_busy="reject"))[0] == "admitted"


@pytest.mark.parametrize("policy", ["interrupt", "rollback"])
async def test_an_interrupting_turn_cancels_marks_and_passes_the_waiting_ones(policy: str, store: Store) -> None:
    first = await make_turn(store)
    await first.accept()
    waiting = await make_turn(store, conversation_id=first.cid)
    assert (await waiting.admit())[0] == "waiting"
    jumper = await make_turn(store, conversation_id=first.cid)
    assert (await store.admit(jumper.id, jumper.cid, now=time.time(), request=jumper.request,
                              on_busy=policy))[:2] == ("waiting", first.id)
    k = store.keys
    assert await store.redis.get(k.cancel_flag(first.id)) == f"interrupted by turn {jumper.id}".encode()
    marks = await store.redis.hmget(k.turn(first.id), ["interrupted_by", "rollback"])
    assert marks == [jumper.id.encode(), b"1" if policy == "rollback" else None]
    line = await store.redis.zrange(k.turn_queue(first.cid), 0, -1, withscores=True)
    assert [m.decode() for m, _ in line] == [jumper.id, first.id, waiting.id] and line[0][1] < 0
    assert not await store.redis.exists(k.cancel_flag(waiting.id)), "a waiting turn is passed, not cancelled"

    assert await first.finish("cancelled") == "ok"
    rows = {m.decode() for m in await store.redis.hkeys(k.messages(first.cid))}
    order = [m.decode() for m in await store.redis.zrange(k.message_order(first.cid), 0, -1)]
    if policy == "rollback":
        assert first.id not in rows and order == [] and not await store.redis.hget(k.conversation(first.cid), "tip")
        assert not await store.redis.hexists(k.snapshots(first.cid), first.id)
    else:
        row = MessageRecord.model_validate_json(await store.redis.hget(k.messages(first.cid), first.id))
        assert row.status == "cancelled" and row.interrupted_by == jumper.id and row.answer == "the answer"
        assert order == [first.id]
    # the interrupting turn is next: it is let in, the waiting one still waits behind it
    assert (await jumper.admit())[0] == "admitted"
    assert (await waiting.admit())[0] == "waiting"


async def test_a_later_interrupting_turn_cancels_an_earlier_one_still_waiting(store: Store) -> None:
    first = await make_turn(store)
    await first.accept()
    one, two = await make_turn(store, conversation_id=first.cid), await make_turn(store, conversation_id=first.cid)
    assert (await store.admit(one.id, one.cid, now=time.time(), request=one.request, on_busy="interrupt"))[0] == \
        "waiting"
    assert await store.interrupt_victims(first.cid, two.id) == [first.id, one.id]
    assert (await store.admit(two.id, two.cid, now=time.time(), request=two.request, on_busy="interrupt"))[0] == \
        "waiting"
    assert await store.redis.hget(store.keys.turn(one.id), "interrupted_by") == two.id.encode()
    line = [m.decode() for m in await store.redis.zrange(store.keys.turn_queue(first.cid), 0, -1)]
    assert line == [one.id, two.id, first.id]  # `one` ends `cancelled` when woken, then `two` runs


async def test_submit_refuses_victims_it_does_not_find(client: Client, store: Store) -> None:
    """The producer's read of the turns in the way is checked by the script: 'changed', nothing written."""
    first = await make_turn(store)
    await first.accept()
    producer = Client(client.url, prefix=store.keys.prefix)
    submit = producer.redis.register_script(lua.source("submit"))
    turn_id = f"t-{uuid.uuid4().hex}"
    bound = producer.keys.on(store.keys.shard)
    for victims, answer in (([], [b"changed"]), (["nobody"], [b"changed"]), ([first.id], 1)):
        _, keys, argv = submit_call(bound, "resolve", "resolve", ({"turn_id": turn_id},), message_id=turn_id,
                                    conversation_id=first.cid, turn_id=turn_id, owner=None, now_ms=0,
                                    on_busy="interrupt", victims=victims)
        assert submit(keys=keys, args=argv) == answer
        if answer != 1:
            assert not await store.redis.exists(store.keys.cancel_flag(first.id), store.keys.turn(turn_id))
    assert await store.redis.hget(store.keys.turn(first.id), "interrupted_by") == turn_id.encode()
    producer.close()
