"""A worker killed in the middle of a turn: the turn is picked up again by another worker (the
watchdog re-enqueues stalled turns; no waiting for dramatiq's minutes-long redelivery), ends once,
and the conversation goes on."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from threadline.pipeline.config import AgentConfig
from threadline.workers.client import Client

from tests.conftest import WorkerPool, turn
from tests.workers.test_outcomes import assert_one_terminal, python_model, records, wait_for_event

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
    assert terminal["type"] == "succeeded" and terminal["attempt"] == 2
    assert time.monotonic() - started < 15
    assert terminal["answer"].startswith("w0 ") and terminal["answer"].strip().endswith("w99")
    events = list(client.events(turn_id))
    assert [e["type"] for e in events].count("retrying") == 1
    assert len([r for r in records(record) if r["event"] == "request"]) == 2
    assert_one_terminal(client, turn_id)

    after = client.wait(client.submit(turn("survivor", "and then?", conversation_id=terminal["conversation_id"])),
                        timeout_s=30)
    assert after["type"] == "succeeded"
    assert [m.status for m in client.thread(terminal["conversation_id"])] == ["succeeded", "succeeded"]
    client.close()
