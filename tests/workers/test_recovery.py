"""A worker killed in the middle of a turn: the turn is picked up again by another worker (the
watchdog takes over a turn whose holder's heartbeat is gone; no waiting for dramatiq's minutes-long
redelivery), ends once, and the conversation goes on — within 30 s with the default settings. A
live long turn is never run twice."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import WorkerPool, turn
from tests.support.clocks import stamped
from tests.support.turns import (
    assert_gapless,
    assert_one_terminal,
    holder_pid,
    keys_of,
    python_model,
    records,
    wait_for_event,
)
from threadline.pipeline import events as ev
from threadline.pipeline.config import AgentConfig
from threadline.workers.clients.client import Client

pytestmark = [pytest.mark.integration, pytest.mark.slow]

FAST_RECOVERY = {"TL_STALL_S": "2", "TL_WATCHDOG_S": "0.5", "TL_INVOKE_LEASE_S": "1.5", "TL_HEARTBEAT_S": "0.3",
                 "TL_WORKER_TIMEOUT_S": "1.5"}


def test_a_worker_killed_mid_stream_with_default_settings_is_taken_over_within_30_s(
    isolated: Callable[..., WorkerPool], tmp_path: Path
) -> None:
    """No recovery setting is changed: the survivor's watchdog sees the dead holder's heartbeat gone
    (TL_WORKER_TIMEOUT_S, 10 s) at its next look (TL_WATCHDOG_S, 2 s) and runs the model again."""
    pool = isolated().start(processes=2)
    client = Client(pool.url, prefix=pool.prefix)
    record = tmp_path / "calls.jsonl"
    client.put_agent(AgentConfig.model_validate(
        {"id": "survivor", "model": python_model("streaming", words=100, delay_ms=20, record=str(record))}))
    turn_id = client.submit(turn("survivor", "keep going"))
    wait_for_event(client, turn_id, "text_delta")
    victim = next(p for p in pool.procs if p.pid == holder_pid(client, turn_id))
    killed = time.time()
    victim.send_signal(signal.SIGKILL)
    victim.wait()

    terminal = client.wait(turn_id, timeout_s=60)
    assert isinstance(terminal, ev.Succeeded) and terminal.attempt == 2, terminal
    # taken over = attempt 2 of the model stage started on the survivor, on the server's clock: the
    # default settings' promise (a worker timeout and a watchdog look, ~12 s) without the re-run's
    # stream, whose length is the machine's speed
    taken_over_at = next(at for at, e in stamped(client, turn_id)
                         if isinstance(e, ev.StageEvent) and e.attempt == 2 and e.status == "started")
    print(f"SIGKILL -> attempt 2 started: {taken_over_at - killed:.1f} s")
    assert taken_over_at - killed <= 30, f"taken over {taken_over_at - killed:.1f} s after the kill"
    assert terminal.answer.startswith("w0 ") and terminal.answer.strip().endswith("w99")
    seen = assert_gapless(client, turn_id)
    assert len([e for e in seen if isinstance(e, ev.Terminal)]) == 1
    retrying = [e for e in seen if isinstance(e, ev.Retrying)]
    assert len(retrying) == 1 and "redelivered" in retrying[0].reason
    assert len([r for r in records(record) if r["event"] == "request"]) == 2
    assert "worker_lost" in pool.log_path.read_text()
    conversation = terminal.conversation_id
    assert conversation is not None
    after = client.wait(client.submit(turn("survivor", "and then?", conversation_id=conversation)), timeout_s=30)
    assert isinstance(after, ev.Succeeded), after
    assert [m.status for m in client.thread(conversation)] == ["succeeded", "succeeded"]
    client.close()


def test_a_live_long_turn_is_not_run_again_by_another_workers_watchdog(
    isolated: Callable[..., WorkerPool], tmp_path: Path
) -> None:
    """The turn streams for many worker timeouts and stall times: its holder's heartbeat keeps
    listing it, so neither watchdog (two processes, looking every 0.2 s) touches it."""
    quick = {**FAST_RECOVERY, "TL_WATCHDOG_S": "0.2", "TL_STALL_S": "0.5", "TL_WORKER_TIMEOUT_S": "1"}
    pool = isolated(quick).start(processes=2)
    client = Client(pool.url, prefix=pool.prefix)
    record = tmp_path / "calls.jsonl"
    client.put_agent(AgentConfig.model_validate(
        {"id": "long", "model": python_model("streaming", words=120, delay_ms=30, record=str(record))}))
    terminal = client.wait(client.submit(turn("long", "take your time")), timeout_s=30)
    assert isinstance(terminal, ev.Succeeded) and terminal.attempt == 1, terminal
    assert terminal.answer.strip().endswith("w119")
    assert len([r for r in records(record) if r["event"] == "request"]) == 1
    assert not [e for e in client.events(terminal.turn_id) if isinstance(e, ev.Retrying)]
    assert "stalled_turn_requeued" not in pool.log_path.read_text()
    assert pool.alive()
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
    history = keys_of(client, turn_id).queue_messages("history")
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
