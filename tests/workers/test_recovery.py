"""A worker killed in the middle of a turn: the turn is picked up again by another worker (the
watchdog re-enqueues stalled turns; no waiting for dramatiq's minutes-long redelivery), ends once,
and the conversation goes on."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import WorkerPool, turn
from tests.workers.test_outcomes import assert_one_terminal, python_model, records, wait_for_event
from threadline.pipeline import events as ev
from threadline.pipeline.config import AgentConfig
from threadline.workers.client import Client

pytestmark = pytest.mark.integration

FAST_RECOVERY = {"TL_STALL_S": "2", "TL_WATCHDOG_S": "0.5", "TL_INVOKE_LEASE_S": "1.5"}


def test_a_turn_whose_worker_was_killed_mid_stream_is_run_again(
    isolated: Callable[..., WorkerPool], tmp_path: Path
) -> None:
    doomed = isolated(FAST_RECOVERY).start(processes=1)
    client = Client(doomed.url, prefix=doomed.prefix)
    record = tmp_path / "calls.jsonl"
    client.put_agent(AgentConfig.model_validate(
        {"id": "survivor", "model": python_model("streaming", words=100, delay_ms=10, record=str(record))}))
    turn_id = client.submit(turn("survivor", "keep going"))
    wait_for_event(client, turn_id, "text_delta")
    doomed.procs[0].send_signal(signal.SIGKILL)
    doomed.procs[0].wait()

    started = time.monotonic()
    isolated(FAST_RECOVERY).start(processes=1)
    terminal = client.wait(turn_id, timeout_s=30)
    assert isinstance(terminal, ev.Succeeded) and terminal.attempt == 2, terminal
    assert time.monotonic() - started < 15
    assert terminal.answer.startswith("w0 ") and terminal.answer.strip().endswith("w99")
    events = list(client.events(turn_id))
    retrying = [e for e in events if isinstance(e, ev.Retrying)]
    assert len(retrying) == 1 and retrying[0].attempt == 2 and "redelivered" in retrying[0].reason
    assert len([r for r in records(record) if r["event"] == "request"]) == 2
    assert_one_terminal(client, turn_id)
    state = client.turn_state(turn_id)
    assert (state.status, state.attempt) == ("succeeded", 2) and state.recoveries >= 1
    assert state.done >= {"resolve", "history", "map", "invoke"}

    conversation = terminal.conversation_id
    assert conversation is not None
    after = client.wait(client.submit(turn("survivor", "and then?", conversation_id=conversation)), timeout_s=30)
    assert isinstance(after, ev.Succeeded), after
    assert [m.status for m in client.thread(conversation)] == ["succeeded", "succeeded"]
    client.close()


def test_a_turn_that_stalls_more_than_max_recoveries_times_ends_failed_once(
    isolated: Callable[..., WorkerPool],
) -> None:
    """Nobody serves the history queue: the watchdog enqueues the stalled stage again, up to
    TL_MAX_RECOVERIES times, then ends the turn `failed` instead of trying forever. Once the queue is
    served, the messages it left there change nothing, and the conversation goes on."""
    without_history = isolated({**FAST_RECOVERY, "TL_MAX_RECOVERIES": "1"}).start(
        processes=1, queues=("resolve", "map", "invoke", "persist", "control"))
    client = Client(without_history.url, prefix=without_history.prefix)
    client.put_agent(AgentConfig.model_validate({"id": "echo", "model": "offline:echo"}))
    turn_id = client.submit(turn("echo", "anyone there?"))
    terminal = client.wait(turn_id, timeout_s=30)
    assert isinstance(terminal, ev.Failed) and terminal.code == "internal_error", terminal
    assert "history" in terminal.message
    state = client.turn_state(turn_id)
    assert (state.status, state.recoveries) == ("failed", 2)  # one re-run, then the one too many
    assert "history" not in state.done

    isolated(FAST_RECOVERY).start(processes=1, queues=("history",))
    history = client.keys.queue_messages("history")
    deadline = time.monotonic() + 15
    while client.redis.hlen(history) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not client.redis.hlen(history), "the left-over history messages were handled"
    assert_one_terminal(client, turn_id)
    conversation = terminal.conversation_id
    assert conversation is not None
    after = client.wait(client.submit(turn("echo", "and now?", conversation_id=conversation)), timeout_s=30)
    assert isinstance(after, ev.Succeeded), after
    assert [(m.status, m.error_code) for m in client.thread(conversation)] == [("failed", "internal_error"),
                                                                               ("succeeded", None)]
    client.close()
