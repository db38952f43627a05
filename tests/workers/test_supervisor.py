"""`threadline worker`'s supervisor: restarts a worker process that dies, and stops them all."""

from __future__ import annotations

import signal
import threading
import time
import uuid

import pytest
import redis

from tests.conftest import ROOT, WorkerPool
from threadline.workers.worker import Supervisor

pytestmark = pytest.mark.integration


def test_a_dead_worker_process_is_replaced_and_stop_leaves_none(redis_url: str) -> None:
    prefix = f"tls{uuid.uuid4().hex[:6]}"
    supervisor = Supervisor(redis_url, processes=2, threads=2,
                            env={"TL_PREFIX": prefix, "TL_LOG_LEVEL": "WARNING", "PYTHONPATH": str(ROOT)})
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
        r = redis.Redis.from_url(redis_url)
        for key in r.scan_iter(f"{prefix}:*"):
            r.delete(key)
    assert all(child.poll() is not None for child in supervisor.children)
