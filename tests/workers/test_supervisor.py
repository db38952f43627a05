"""`threadline worker`'s supervisor: restarts a worker process that dies (with backoff while it keeps
crashing), and stops them all. A worker process started while Redis is down says so once, not once
per consumer every few seconds, and works once Redis is there."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from tests.conftest import ROOT, WorkerPool, turn
from tests.support.restartable import Restartable
from tests.support.turns import python_model
from tests.support.wait import wait_until
from threadline.pipeline import events as ev
from threadline.pipeline.config import AgentConfig
from threadline.workers.clients.client import Client
from threadline.workers.storage.connect import sync_client
from threadline.workers.worker.process import GEN0_THRESHOLD, KILL_MARGIN_S, Supervisor, restart_delay_s
from threadline.workers.worker.reachability import Reachability

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_a_dead_worker_process_is_replaced_and_stop_leaves_none(redis_url: str) -> None:
    prefix = f"tls{uuid.uuid4().hex[:6]}"
    supervisor = Supervisor(redis_url, processes=2, threads=2,
                            env={"TL_PREFIX": prefix, "TL_LOG_LEVEL": "WARNING", "TL_METRICS_PORT": "0",
                                 "PYTHONPATH": str(ROOT)})
    stop = threading.Event()
    supervisor.start()
    watcher = threading.Thread(target=supervisor.watch, args=(stop,), daemon=True)
    watcher.start()
    try:
        ready = WorkerPool(redis_url, prefix, ROOT)  # only for its readiness check
        ready.wait_ready(2)
        victim = supervisor.children[0]
        victim.send_signal(signal.SIGKILL)
        victim.wait()
        deadline = time.monotonic() + 10
        while supervisor.children[0] is victim and time.monotonic() < deadline:
            time.sleep(0.05)
        assert supervisor.children[0] is not victim
        ready.wait_ready(2)
    finally:
        stop.set()
        watcher.join(timeout=5)
        supervisor.stop()
        r = sync_client(redis_url)
        for key in r.scan_iter(f"{prefix}:*"):
            r.delete(key)
    assert all(child.poll() is not None for child in supervisor.children)


def test_a_crashing_worker_process_is_restarted_with_growing_delays(redis_url: str) -> None:
    """A child that cannot start (an unknown queue) crashes at once, every time: the supervisor
    waits 0.5 s, 1 s, 2 s, … (up to 30 s) before each restart, instead of respawning it in a loop."""
    supervisor = Supervisor(redis_url, processes=1, threads=1, queues=["no-such-queue"],
                            env={"TL_PREFIX": f"tls{uuid.uuid4().hex[:6]}", "TL_METRICS_PORT": "0",
                                 "PYTHONPATH": str(ROOT)},
                            log_path=Path(os.devnull))
    stop = threading.Event()
    supervisor.start()
    watcher = threading.Thread(target=supervisor.watch, args=(stop,), daemon=True)
    watcher.start()
    first = supervisor.children[0]
    try:
        wait_until(lambda: len(supervisor.restarts) >= 3, timeout_s=30)
    finally:
        stop.set()
        watcher.join(timeout=5)
        supervisor.stop()
    assert [delay for _, delay in supervisor.restarts[:3]] == [0.5, 1.0, 2.0]
    assert supervisor.children[0] is not first
    assert [restart_delay_s(n) for n in (1, 4, 7, 8, 50)] == [0.5, 4.0, 30.0, 30.0, 30.0]


def test_a_worker_without_redis_logs_one_error_then_works_once_redis_is_there(tmp_path: Path) -> None:
    server = Restartable(tmp_path / "valkey")  # not started yet: nothing listens on its port
    prefix = f"tlu{uuid.uuid4().hex[:6]}"
    log_path = tmp_path / "worker.log"
    env = {**os.environ, "REDIS_URL": server.url, "TL_PREFIX": prefix, "TL_LOG_FORMAT": "json",
           "TL_LOG_LEVEL": "INFO", "PYTHONPATH": str(ROOT)}
    with open(log_path, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "threadline.workers.worker", "--threads", "2"], env=env,
                                stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        wait_until(lambda: "worker_started" in log_path.read_text(), timeout_s=20)
        time.sleep(6)  # the window measured: what the worker says while Redis stays away
        lines = log_path.read_text().splitlines()
        after = lines[next(i for i, line in enumerate(lines) if "worker_started" in line) + 1:]
        assert len(after) <= 5, after
        said = [json.loads(line) for line in lines]
        assert [e["event"] for e in said].count("redis_unreachable") == 1, lines
        # its imports ran with collection off (`__main__`); it serves with collection on, its imports frozen
        started = next(e for e in said if e["event"] == "worker_started")
        assert started["gc_enabled"] is True and started["heap_frozen"] > 100_000, started
        assert started["gc_threshold"] == GEN0_THRESHOLD, started
        assert started["event_loop"] == "uvloop", started  # TL_EVENT_LOOP's default where uvloop is installed
        assert not [e for e in said if e["level"] == "critical"], lines

        server.start()
        WorkerPool(server.url, prefix, tmp_path).wait_ready(1)
        client = Client(server.url, prefix=prefix)
        client.put_agent(AgentConfig.model_validate({"id": "echo", "model": "offline:echo"}))
        terminal = client.wait(client.submit(turn("echo", "are you there?")), timeout_s=40)
        assert isinstance(terminal, ev.Succeeded), terminal
        client.close()
        assert "redis_reachable" in log_path.read_text()
    finally:
        proc.terminate()
        proc.wait(timeout=15)
        server.stop()
    # the one line names the server without its password
    assert "hunter2" not in Reachability("redis://:hunter2@db.internal:6379/0").url


def test_a_worker_process_still_running_after_its_grace_writes_its_stacks_and_is_killed(
    redis_url: str, tmp_path: Path
) -> None:
    """A child that cannot exit (a thread of its model holds it) is killed after its grace and its
    margin; before the kill it has written every thread's stack, so its log says where it hung.
    The grace is 3 s: the child's own stop takes ~0.2 s here when idle, and took more than 2 s (a
    1 s grace and the margin) once in CI on a loaded machine, which killed it before its stop ended."""
    prefix = f"tlk{uuid.uuid4().hex[:6]}"
    log_path = tmp_path / "supervisor.log"
    supervisor = Supervisor(redis_url, processes=1, threads=2, log_path=log_path,
                            env={"TL_PREFIX": prefix, "TL_ALLOW_PYTHON_PLUGINS": "1", "TL_SHUTDOWN_GRACE_S": "3",
                                 "TL_LOG_LEVEL": "INFO", "TL_LOG_FORMAT": "json", "TL_METRICS_PORT": "0",
                                 "PYTHONPATH": str(ROOT)})
    client = Client(redis_url, prefix=prefix)
    try:
        supervisor.start()
        WorkerPool(redis_url, prefix, ROOT).wait_ready(1)
        client.put_agent(AgentConfig.model_validate(
            {"id": "stuck", "model": python_model("keeps_the_process")}))
        assert client.wait(client.submit(turn("stuck", "hello")), timeout_s=60).type == "succeeded"
        started = time.monotonic()
        supervisor.stop()
        took_s = time.monotonic() - started
    finally:
        if any(c.poll() is None for c in supervisor.children):  # the test failed before its stop
            supervisor.stop()
        client.close()
        r = sync_client(redis_url)
        for key in r.scan_iter(f"{prefix}:*"):
            r.delete(key)
    (child,) = supervisor.children
    assert child.returncode == -signal.SIGKILL
    # the product's own timers: grace, margin, the moment for the stacks
    assert supervisor.grace_s + KILL_MARGIN_S <= took_s, took_s
    text = log_path.read_text()
    # its own stop ended; the process could not exit after it
    assert '"worker_stopped"' in text, text[-2000:]
    dump = text[text.index('"worker_stopped"'):]
    assert "Current thread" in dump or "Thread 0x" in dump, text[-2000:]
    assert "wait_forever" in dump and "models.py" in dump, dump
