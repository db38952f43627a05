"""Cancel through the control queue, at every moment of a turn; the conversation always goes on."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import AgentFactory, WorkerPool, turn
from tests.support.turns import assert_one_terminal, keys_of, python_model, records, wait_for_event
from tests.support.wait import wait_until
from threadline.pipeline import events as ev
from threadline.pipeline.config import AgentConfig
from threadline.pipeline.stages import DEFAULT_GRAPH
from threadline.workers.clients.client import Client
from threadline.workers.clients.layout import request_shard

pytestmark = pytest.mark.integration

ALL_QUEUES = (*DEFAULT_GRAPH.names, "control")


def served_unacked(client: Client, queue: str) -> bool:
    """Whether a worker holds a message of `queue` it has not acknowledged (in any shard)."""
    return any(client.redis.scard(key) for k in client.keys.every_shard()
               for key in client.redis.scan_iter(k.acks("*", queue)))


def queued(client: Client, queue: str) -> int:
    """The messages waiting on `queue`, summed over the shards."""
    return sum(client.redis.llen(k.queue(queue)) for k in client.keys.every_shard())


def flag_raised(client: Client, turn_id: str) -> Callable[[], bool]:
    return lambda: bool(client.redis.exists(keys_of(client, turn_id).cancel_flag(turn_id)))


@pytest.mark.one_server("the sharded layout's cancel of a turn with no shard pointer yet is 'noop: unknown'")
def test_cancel_before_the_turn_is_enqueued_wins(workers: WorkerPool, client: Client, make_agent: AgentFactory,
                                                 tmp_path: Path) -> None:
    record = tmp_path / "calls.jsonl"
    agent = make_agent(python_model("streaming", record=str(record)))
    turn_id = f"early-{uuid.uuid4().hex}"
    assert client.cancel(turn_id, "changed my mind") == "enqueued"
    wait_until(flag_raised(client, turn_id))
    client.submit(turn(agent, "never runs", turn_id=turn_id))
    terminal = client.wait(turn_id, timeout_s=20)
    assert isinstance(terminal, ev.Cancelled) and terminal.code == "cancelled", terminal
    assert not records(record), "the model was never called"
    assert_one_terminal(client, turn_id)


def test_a_raw_cancel_on_the_turns_shard_before_it_is_enqueued_wins(
        workers: WorkerPool, client: Client, make_agent: AgentFactory, tmp_path: Path) -> None:
    """A producer that knows where the turn will be (its first turn's conversation's shard) sends the
    cancel there before the turn: the turn never runs, in either layout."""
    record = tmp_path / "calls.jsonl"
    agent = make_agent(python_model("streaming", record=str(record)))
    turn_id = f"early-{uuid.uuid4().hex}"
    shard = request_shard(client.keys, None, turn_id)
    client.enqueue("control", "cancel", (turn_id, "changed my mind"), shard=shard)
    wait_until(lambda: bool(client.redis.exists(client.keys.on(shard).cancel_flag(turn_id))))
    client.submit(turn(agent, "never runs", turn_id=turn_id))
    terminal = client.wait(turn_id, timeout_s=20)
    assert isinstance(terminal, ev.Cancelled) and terminal.code == "cancelled", terminal
    assert not records(record), "the model was never called"
    assert_one_terminal(client, turn_id)


@pytest.mark.slow  # two worker pools per stage, each waited for
@pytest.mark.parametrize("stage", ["resolve", "history", "map", "invoke"])
def test_a_turn_cancelled_while_queued_for_a_stage_never_reaches_the_model(
    stage: str, isolated: Callable[[], WorkerPool], tmp_path: Path
) -> None:
    """The turn waits in `stage`'s queue (nobody serves it yet) when the cancel arrives. Admitted, it
    ends `cancelled` at once (the control actor ends it), and its message is dropped once a worker
    serves that queue; not admitted yet (`resolve`), it ends there. No model call either way."""
    without = isolated().start(processes=1, queues=tuple(q for q in ALL_QUEUES if q != stage))
    client = Client(without.url, prefix=without.prefix)
    record = tmp_path / "calls.jsonl"
    agent = f"agent-{uuid.uuid4().hex[:8]}"
    client.put_agent(AgentConfig.model_validate({"id": agent, "model": python_model("streaming", record=str(record))}))
    turn_id = client.submit(turn(agent, "stop me"))
    if stage != "resolve":
        previous = ALL_QUEUES[ALL_QUEUES.index(stage) - 1]
        wait_until(lambda: any(isinstance(e, ev.StageEvent) and e.stage == previous and e.status == "finished"
                               for e in client.events(turn_id)))
    client.cancel(turn_id, "stop")
    if stage == "resolve":  # only the admit stage knows the conversation of a turn not admitted yet
        wait_until(flag_raised(client, turn_id))
        isolated().start(processes=1, queues=(stage,))
    terminal = client.wait(turn_id, timeout_s=20)
    assert isinstance(terminal, ev.Cancelled) and terminal.code == "cancelled", terminal
    assert terminal.message == "stop"  # the cancel's reason
    if stage != "resolve":
        isolated().start(processes=1, queues=(stage,))  # its message: dropped as a no-op
        wait_until(lambda: queued(client, stage) == 0 and not served_unacked(client, stage))
    assert not records(record), "no model call"
    assert_one_terminal(client, turn_id)
    # a turn cancelled after it was accepted names its conversation; before, none was made
    assert (terminal.conversation_id is None) == (stage == "resolve")
    assert not list(client.redis.scan_iter(keys_of(client, turn_id).artifact(turn_id, "*"))), "artifacts are deleted"

    # the conversation (or a new one, if the turn never got one) goes on
    follow_up = turn(agent, "and now?", conversation_id=terminal.conversation_id)
    after = client.wait(client.submit({**follow_up, "turn_id": uuid.uuid4().hex}), timeout_s=30)
    assert isinstance(after, ev.Succeeded), after
    client.close()


def test_cancel_after_the_end_is_a_noop(workers: WorkerPool, client: Client, make_agent: AgentFactory) -> None:
    agent = make_agent("offline:echo")
    terminal = client.wait(client.submit(turn(agent, "done already")), timeout_s=30)
    assert isinstance(terminal, ev.Succeeded) and terminal.conversation_id is not None, terminal
    before = list(client.events(terminal.turn_id))
    assert client.cancel(terminal.turn_id) == "noop: succeeded"
    # a raw control message (no client-side check) is a no-op in the worker too
    k = keys_of(client, terminal.turn_id)
    mid = client.enqueue("control", "cancel", (terminal.turn_id, "late"), shard=k.shard)
    wait_until(lambda: not client.redis.hexists(k.queue_messages("control"), mid))
    assert list(client.events(terminal.turn_id)) == before
    assert not client.redis.exists(keys_of(client, terminal.turn_id).cancel_flag(terminal.turn_id))
    assert client.turn_state(terminal.turn_id).status == "succeeded"
    assert client.thread(terminal.conversation_id)[-1].status == "succeeded"


def test_repeated_cancels_end_the_turn_once(workers: WorkerPool, client: Client, make_agent: AgentFactory) -> None:
    agent = make_agent(python_model("streaming", words=400, delay_ms=10))
    turn_id = client.submit(turn(agent, "go on"))
    wait_for_event(client, turn_id, "text_delta")
    for _ in range(3):
        client.cancel(turn_id, "stop")
    terminal = client.wait(turn_id, timeout_s=20)
    assert isinstance(terminal, ev.Cancelled), terminal
    # every cancel message was handled before the check (the later ones find the turn ended)
    wait_until(lambda: not client.redis.hlen(keys_of(client, turn_id).queue_messages("control")))
    assert_one_terminal(client, turn_id)


def test_cancel_a_turn_waiting_behind_a_busy_conversation(
    workers: WorkerPool, client: Client, make_agent: AgentFactory, tmp_path: Path
) -> None:
    record = tmp_path / "calls.jsonl"
    agent = make_agent(python_model("streaming", words=60, delay_ms=20, record=str(record)))
    first = client.wait(client.submit(turn(agent, "one")), timeout_s=30)
    conversation = first.conversation_id
    assert conversation is not None
    busy = client.submit(turn(agent, "two", conversation_id=conversation))
    wait_for_event(client, busy, "text_delta")
    waiting = client.submit(turn(agent, "three", conversation_id=conversation))
    wait_until(lambda: client.turn_state(waiting).status == "waiting")
    client.cancel(waiting, "not needed")
    cancelled = client.wait(waiting, timeout_s=10)
    assert isinstance(cancelled, ev.Cancelled) and cancelled.code == "cancelled", cancelled
    assert client.turn_state(busy).status == "running", "cancelled while the other turn still ran"
    assert isinstance(client.wait(busy, timeout_s=30), ev.Succeeded)
    after = client.wait(client.submit(turn(agent, "four", conversation_id=conversation)), timeout_s=30)
    assert isinstance(after, ev.Succeeded), after
    assert [m.query for m in client.thread(conversation)] == ["one", "two", "four"]
    assert len([r for r in records(record) if r["event"] == "request"]) == 3
    # nobody is left in the line, nor among the requests kept for waking
    assert not client.redis.exists(client.keys.turn_queue(conversation))
    assert not client.redis.exists(client.keys.waiting(conversation))


def test_a_missed_notification_is_caught_by_the_flag_poll(
    workers: WorkerPool, client: Client, make_agent: AgentFactory, tmp_path: Path
) -> None:
    """The model streams until the test says so (a file that only cleanup creates): a turn that ends
    cancelled with the model's stream cut short was stopped in its run by the poll of the flag, not
    by the next stage's look at the flag after the model was done."""
    record, release = tmp_path / "calls.jsonl", tmp_path / "release"
    words = 100_000
    agent = make_agent(python_model("streaming", words=words, delay_ms=10, record=str(record), until=str(release)))
    turn_id = client.submit(turn(agent, "long"))
    try:
        wait_for_event(client, turn_id, "text_delta")
        client.redis.set(keys_of(client, turn_id).cancel_flag(turn_id), "flag only, no broadcast", ex=600)
        terminal = client.wait(turn_id, timeout_s=60)
    finally:
        release.touch()
    assert isinstance(terminal, ev.Cancelled), terminal
    wait_until(lambda: any(r["event"] == "closed" for r in records(record)))
    calls = records(record)
    assert [r["event"] for r in calls].count("request") == 1
    assert calls[-1]["event"] == "closed" and len([r for r in calls if r["event"] == "chunk"]) < words


def test_a_turn_queued_behind_busy_model_calls_ends_at_once_and_its_conversation_goes_on(
    isolated: Callable[..., WorkerPool], tmp_path: Path
) -> None:
    """One model call at a time (`TL_MODEL_CALLS=1`), held open: the next turn waits in the
    invoke queue. Its cancel ends it while the held call still runs (not when a worker reaches its
    message), the turn after it in its conversation is admitted, and the dropped message calls no model."""
    pool = isolated({"TL_MODEL_CALLS": "1"}).start(processes=1, threads=4)
    client = Client(pool.url, prefix=pool.prefix)
    release, record = tmp_path / "release", tmp_path / "calls.jsonl"
    agent = f"agent-{uuid.uuid4().hex[:8]}"
    client.put_agent(AgentConfig.model_validate({"id": agent, "model": python_model(
        "streaming", words=100_000, delay_ms=20, until=str(release), record=str(record))}))
    holding = client.submit(turn(agent, "hold the slot"))
    wait_for_event(client, holding, "text_delta")
    queued = client.submit(turn(agent, "wait behind it"))
    wait_until(lambda: any(isinstance(e, ev.StageEvent) and e.stage == "map" and e.status == "finished"
                           for e in client.events(queued)))
    after = client.submit(turn(agent, "and then", conversation_id=client.turn_state(queued).conversation_id))
    wait_until(lambda: client.turn_state(after).status == "waiting")

    client.cancel(queued, "not needed")
    cancelled = client.wait(queued, timeout_s=20)
    assert isinstance(cancelled, ev.Cancelled) and cancelled.message == "not needed", cancelled
    assert client.turn_state(holding).status == "running", "ended while the held call still ran"
    wait_until(lambda: client.turn_state(after).status == "running")  # its conversation's next turn goes on

    release.touch()
    assert isinstance(client.wait(holding, timeout_s=30), ev.Succeeded)
    assert isinstance(client.wait(after, timeout_s=30), ev.Succeeded)
    assert_one_terminal(client, queued)
    assert len([r for r in records(record) if r["event"] == "request"]) == 2, "no model call for the cancelled turn"
    client.close()
