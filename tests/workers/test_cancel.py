"""Cancel through the control queue, at every moment of a turn; the conversation always goes on."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
from threadline.pipeline.config import AgentConfig
from threadline.workers.client import Client

from tests.conftest import AgentFactory, WorkerPool, turn
from tests.workers.test_outcomes import assert_one_terminal, python_model, records, wait_for_event

pytestmark = pytest.mark.integration

ALL_QUEUES = ("resolve", "history", "map", "invoke", "persist", "control")


def wait_until(predicate: Callable[[], bool], timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met")
        time.sleep(0.02)


def flag_raised(client: Client, turn_id: str) -> Callable[[], bool]:
    return lambda: bool(client.redis.exists(client.keys.cancel_flag(turn_id)))


def test_cancel_before_the_turn_is_enqueued_wins(workers: WorkerPool, client: Client, make_agent: AgentFactory,
                                                 tmp_path: Path) -> None:
    record = tmp_path / "calls.jsonl"
    agent = make_agent(python_model("streaming", record=str(record)))
    turn_id = f"early-{uuid.uuid4().hex}"
    assert client.cancel(turn_id, "changed my mind") == "enqueued"
    wait_until(flag_raised(client, turn_id))
    client.submit(turn(agent, "never runs", turn_id=turn_id))
    terminal = client.wait(turn_id, timeout_s=20)
    assert (terminal["type"], terminal["code"]) == ("cancelled", "cancelled")
    assert not records(record), "the model was never called"


@pytest.mark.parametrize("stage", ["resolve", "history", "map", "invoke"])
def test_a_turn_cancelled_while_queued_for_a_stage_never_reaches_the_model(
    stage: str, isolated: Callable[[], WorkerPool], tmp_path: Path
) -> None:
    """The turn waits in `stage`'s queue (nobody serves it yet) when the cancel arrives; once a
    worker serves that queue, the turn ends `cancelled` there, before any model call."""
    without = isolated().start(processes=1, queues=tuple(q for q in ALL_QUEUES if q != stage))
    client = Client(without.url, prefix=without.prefix)
    record = tmp_path / "calls.jsonl"
    agent = f"agent-{uuid.uuid4().hex[:8]}"
    client.put_agent(AgentConfig.model_validate({"id": agent, "model": python_model("streaming", record=str(record))}))
    turn_id = client.submit(turn(agent, "stop me"))
    if stage != "resolve":
        previous = ALL_QUEUES[ALL_QUEUES.index(stage) - 1]
        wait_until(lambda: any(e["type"] == "stage" and e["stage"] == previous and e["status"] == "finished"
                               for e in client.events(turn_id)))
    client.cancel(turn_id, "stop")
    wait_until(flag_raised(client, turn_id))

    isolated().start(processes=1, queues=(stage,))  # now someone serves the stage
    terminal = client.wait(turn_id, timeout_s=20)
    assert (terminal["type"], terminal["code"]) == ("cancelled", "cancelled")
    assert stage in terminal["message"]
    assert not records(record), "no model call"
    assert_one_terminal(client, turn_id)

    # the conversation (or a new one, if the turn never got one) goes on
    follow_up = turn(agent, "and now?", conversation_id=terminal.get("conversation_id"))
    after = client.wait(client.submit({**follow_up, "turn_id": uuid.uuid4().hex}), timeout_s=30)
    assert after["type"] == "succeeded", after
    client.close()


def test_cancel_after_the_end_is_a_noop(workers: WorkerPool, client: Client, make_agent: AgentFactory) -> None:
    agent = make_agent("offline:echo")
    terminal = client.wait(client.submit(turn(agent, "done already")), timeout_s=30)
    before = list(client.events(terminal["turn_id"]))
    assert client.cancel(terminal["turn_id"]) == "noop: succeeded"
    # a raw control message (no client-side check) is a no-op in the worker too
    mid = client.enqueue("control", "cancel", (terminal["turn_id"], "late"))
    wait_until(lambda: not client.redis.hexists(f"{client.namespace}:control.msgs", mid))
    assert list(client.events(terminal["turn_id"])) == before
    assert not client.redis.exists(client.keys.cancel_flag(terminal["turn_id"]))
    assert client.thread(terminal["conversation_id"])[-1].status == "succeeded"


def test_repeated_cancels_end_the_turn_once(workers: WorkerPool, client: Client, make_agent: AgentFactory) -> None:
    agent = make_agent(python_model("streaming", words=400, delay_ms=10))
    turn_id = client.submit(turn(agent, "go on"))
    wait_for_event(client, turn_id, "text_delta")
    for _ in range(3):
        client.cancel(turn_id, "stop")
    terminal = client.wait(turn_id, timeout_s=20)
    assert terminal["type"] == "cancelled"
    time.sleep(0.3)
    assert_one_terminal(client, turn_id)


def test_cancel_a_turn_waiting_behind_a_busy_conversation(
    workers: WorkerPool, client: Client, make_agent: AgentFactory, tmp_path: Path
) -> None:
    record = tmp_path / "calls.jsonl"
    agent = make_agent(python_model("streaming", words=60, delay_ms=20, record=str(record)))
    first = client.wait(client.submit(turn(agent, "one")), timeout_s=30)
    conversation = first["conversation_id"]
    busy = client.submit(turn(agent, "two", conversation_id=conversation))
    wait_for_event(client, busy, "text_delta")
    waiting = client.submit(turn(agent, "three", conversation_id=conversation))
    wait_until(lambda: client.turn_state(waiting).get("status") == "waiting")
    client.cancel(waiting, "not needed")
    cancelled = client.wait(waiting, timeout_s=10)
    assert (cancelled["type"], cancelled["code"]) == ("cancelled", "cancelled")
    assert client.turn_state(busy).get("status") == "running", "cancelled while the other turn still ran"
    assert client.wait(busy, timeout_s=30)["type"] == "succeeded"
    after = client.wait(client.submit(turn(agent, "four", conversation_id=conversation)), timeout_s=30)
    assert after["type"] == "succeeded"
    assert [m.query for m in client.thread(conversation)] == ["one", "two", "four"]
    assert len([r for r in records(record) if r["event"] == "request"]) == 3


def test_a_missed_notification_is_caught_by_the_flag_poll(
    workers: WorkerPool, client: Client, make_agent: AgentFactory
) -> None:
    agent = make_agent(python_model("streaming", words=1000, delay_ms=10))
    turn_id = client.submit(turn(agent, "long"))
    wait_for_event(client, turn_id, "text_delta")
    started = time.monotonic()
    client.redis.set(client.keys.cancel_flag(turn_id), "flag only, no broadcast", ex=600)
    terminal = client.wait(turn_id, timeout_s=20)
    assert terminal["type"] == "cancelled" and time.monotonic() - started < 3
