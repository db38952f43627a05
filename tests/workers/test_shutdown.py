"""A graceful stop: SIGTERM hands every model call in flight to another worker at once (a `retrying`
event, the claim released, the stage enqueued again without delay), lets the fast stages in flight
finish, and the supervisor is gone within its grace period."""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

import pytest

from tests.conftest import ROOT, InProcessWorker, WorkerPool, drop_prefix, turn
from tests.support.clocks import stamped
from tests.support.turns import (
    assert_gapless,
    holder_pid,
    keys_of,
    python_model,
    records,
    wait_for_event,
)
from tests.support.wait import wait_until
from threadline.pipeline import events as ev
from threadline.pipeline.config import AgentConfig
from threadline.pipeline.stages import DEFAULT_GRAPH, Stage, StageInput, StageOutput
from threadline.workers.clients.client import Client
from threadline.workers.storage.connect import sync_client
from threadline.workers.worker.process import Supervisor

pytestmark = [pytest.mark.integration, pytest.mark.slow]

#: The idle poll of the worker that takes a handed-over turn: long, so that only the doorbell makes it quick.
IDLE_POLL_S = 20.0


def test_sigterm_to_the_supervisor_mid_stream_hands_the_turn_to_another_worker_at_once(
    redis_url: str, tmp_path: Path
) -> None:
    prefix = f"tlh{uuid.uuid4().hex[:8]}"
    # no metrics endpoint: the default port is one per host, and other tests' supervisors run beside this one
    env = {"TL_PREFIX": prefix, "TL_ALLOW_PYTHON_PLUGINS": "1", "TL_LOG_FORMAT": "json", "TL_LOG_LEVEL": "INFO",
           "TL_METRICS_PORT": "0", "PYTHONPATH": str(ROOT)}
    supervisor = Supervisor(redis_url, processes=1, threads=4, env=env, log_path=tmp_path / "supervisor.log")
    # the other worker's idle consumers poll only every IDLE_POLL_S: a quick take-over was rung
    other = WorkerPool(redis_url, prefix, tmp_path, env={"TL_IDLE_POLL_MS": str(int(IDLE_POLL_S * 1000))})
    client = Client(redis_url, prefix=prefix)
    try:
        supervisor.start()
        other.wait_ready(1)  # the supervisor's one child: the turn starts there
        until, record = tmp_path / "enough", tmp_path / "calls.jsonl"
        client.put_agent(AgentConfig.model_validate({"id": "streamer", "model": python_model(
            "streaming", words=5000, delay_ms=10, until=str(until), record=str(record))}))
        turn_id = client.submit(turn("streamer", "a long answer please"))
        wait_for_event(client, turn_id, "text_delta")
        assert holder_pid(client, turn_id) == supervisor.children[0].pid
        other.start(processes=1)
        other.wait_ready(2)

        signalled = time.time()
        supervisor.stop()
        stopped = time.time()
        # within its grace by the product's own timers: the supervisor kills a child still running
        # after grace + KILL_MARGIN_S, and the child times its own stop
        assert supervisor.children[0].returncode == 0  # it stopped by itself, nobody killed it
        (child_stop_s,) = [json.loads(line)["stop_s"] for line in (tmp_path / "supervisor.log").read_text().splitlines()
                           if '"worker_stopped"' in line]
        assert child_stop_s <= supervisor.grace_s, child_stop_s

        # the hand-over was part of the stop, and another worker started attempt 2 of the model stage
        # at once, rung by the enqueue (times on the server's clock: stream entry ids)
        wait_until(lambda: any(isinstance(e, ev.StageEvent) and e.attempt == 2 for e in client.events(turn_id)),
                   timeout_s=30)
        seen = stamped(client, turn_id)
        handed_at = next(at for at, e in seen if isinstance(e, ev.Retrying))
        continued_at = next(at for at, e in seen if isinstance(e, ev.StageEvent) and e.attempt == 2)
        print(f"SIGTERM -> handed over {handed_at - signalled:.2f} s, attempt 2 started "
              f"{continued_at - handed_at:.2f} s later; the child stopped in {child_stop_s:.2f} s")
        assert signalled - 0.001 <= handed_at <= stopped + 0.001
        assert continued_at - handed_at < IDLE_POLL_S / 10
        until.touch()
        terminal = client.wait(turn_id, timeout_s=30)
        assert isinstance(terminal, ev.Succeeded) and terminal.attempt == 2, terminal
        seen = assert_gapless(client, turn_id)
        assert len([e for e in seen if isinstance(e, ev.Terminal)]) == 1
        retrying = [e for e in seen if isinstance(e, ev.Retrying)]
        assert len(retrying) == 1 and retrying[0].reason.startswith("handover") and retrying[0].attempt == 2
        assert len([r for r in records(record) if r["event"] == "request"]) == 2
        log = (tmp_path / "supervisor.log").read_text()
        assert "turn_handed_over" in log and "turns_abandoned" not in log
        assert client.redis.hget(keys_of(client, turn_id).turn(turn_id), "handovers") == b"1"
    finally:
        supervisor.stop()
        other.stop()
        drop_prefix(client.redis, prefix)
        client.close()


def slow(given: StageInput) -> StageOutput:
    """A transform stage that takes a while (it blocks its worker's event loop: fine in a test)."""
    time.sleep(1.5)
    return StageOutput(given.artifact, {"slept_s": 1.5})


SLOW_GRAPH = DEFAULT_GRAPH.with_stage(Stage("slow", "transform", slow), after="map")


def test_a_fast_stage_in_flight_when_its_worker_stops_completes(redis_url: str) -> None:
    worker = InProcessWorker(redis_url, SLOW_GRAPH)
    client = worker.client
    try:
        client.put_agent(AgentConfig.model_validate({"id": "echo", "model": "offline:echo"}))
        turn_id = client.submit(turn("echo", "slowly"))

        def slow_started() -> bool:
            return any(isinstance(e, ev.StageEvent) and e.stage == "slow" for e in client.events(turn_id))

        wait_until(slow_started, timeout_s=15)
        worker.worker.stop(timeout=int(worker.settings.shutdown_grace_s * 1000))  # as a worker process stops
        worker.broker.close()
        # the stop waited for the stage to finish within its grace, not out: every thread of it has ended
        threads = [*worker.worker.workers, *worker.worker.consumers.values()]
        assert threads and not [t for t in threads if t.is_alive()]
        stages = [(e.stage, e.status) for e in client.events(turn_id) if isinstance(e, ev.StageEvent)]
        assert ("slow", "finished") in stages
        state = client.turn_state(turn_id)
        assert state.status == "running" and "slow" in state.done
        # its hand-over happened: the next stage waits on its queue for any other worker
        keys = keys_of(client, turn_id)
        assert client.redis.llen(keys.queue(SLOW_GRAPH.next("slow").queue)) == 1  # type: ignore[union-attr]
        assert not client.redis.hget(keys.turn(turn_id), "holder")  # nobody holds it ("")
    finally:
        drop_prefix(client.redis, worker.prefix)
        client.close()


def test_stopping_workers_put_back_what_they_fetched_and_say_goodbye(redis_url: str, tmp_path: Path) -> None:
    """A process asked for its stacks writes them and goes on; a stopped one leaves no heartbeat
    behind (its turns are taken over at once, not after a timeout) and no message in its ack sets."""
    prefix = f"tlg{uuid.uuid4().hex[:8]}"
    pool = WorkerPool(redis_url, prefix, tmp_path).start(processes=1)
    r = sync_client(redis_url)
    with Client(redis_url, prefix=prefix) as client:
        keys = client.keys  # the layout the worker stored
    heartbeats = keys.worker("*")
    try:
        wait_until(lambda: bool(list(r.scan_iter(heartbeats))), timeout_s=10)  # its first heartbeat
        # asked, a process writes every thread's stack to its log (and goes on: SIGUSR1 is no stop)
        pool.dump_stacks(pool.procs[0])
        stacks = pool.log_path.read_text()
        assert "Current thread" in stacks and "listener.py" in stacks and pool.alive(), pool.log_tail()
        pool.stop()
        assert pool.procs[0].returncode == 0, pool.log_tail(200)  # -9: killed; the log ends with its stacks
        assert not list(r.scan_iter(heartbeats))
        assert not [k for shard in keys.every_shard() for k in r.scan_iter(shard.acks("*", "*")) if r.scard(k)]
    finally:
        pool.stop()
        drop_prefix(r, prefix)
        r.close()
