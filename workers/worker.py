"""Worker processes: the broker with every middleware, one process's dramatiq `Worker`, and the
supervisor behind `threadline worker` that keeps N such processes alive.

Unlike the dramatiq CLI, whose parent exits when one child dies, the supervisor restarts a child
that dies and stops them all, gracefully, on SIGTERM/SIGINT.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import dramatiq
import structlog
from dramatiq.asyncio import get_event_loop_thread
from dramatiq.middleware import Middleware

from .actors import declare_actors
from .broker import QUEUES, DoorbellBroker, make_broker
from .client import Client
from .control import CancelRegistry, CancelWatcher
from .logs import configure_logging
from .runtime import Runtime, runtime, set_runtime
from .settings import Settings
from .store import Store
from .watchdog import Watchdog

log = structlog.get_logger(__name__)


class Boot(Middleware):
    """Sets up the process's runtime (store, cancel registry and watcher) when its worker boots."""

    def __init__(self, settings: Settings, url: str) -> None:
        self.settings = settings
        self.url = url
        self.watcher: CancelWatcher | None = None
        self.watchdog: Watchdog | None = None

    def before_worker_boot(self, broker: dramatiq.Broker, worker: dramatiq.Worker) -> None:
        assert isinstance(broker, DoorbellBroker)
        registry = CancelRegistry()
        set_runtime(Runtime(Store.connect(self.url, self.settings), registry))
        self.watcher = CancelWatcher(registry, broker.listener, self.url, broker.keys)
        self.watchdog = Watchdog(Client(self.url, prefix=self.settings.prefix), stall_s=self.settings.stall_s,
                                 every_s=self.settings.watchdog_s)

    def before_worker_shutdown(self, broker: dramatiq.Broker, worker: dramatiq.Worker) -> None:
        assert isinstance(broker, DoorbellBroker)
        broker.before_shutdown()

    def after_worker_shutdown(self, broker: dramatiq.Broker, worker: dramatiq.Worker) -> None:
        if self.watcher is not None:
            self.watcher.stop()
        if self.watchdog is not None:
            self.watchdog.stop()
        set_runtime(None)


class GiveUp(Middleware):
    """When a message exhausts its retries (it goes to the dead-letter queue), its turn still gets
    its one terminal event: `failed` with `internal_error`."""

    def after_process_message(self, broker: dramatiq.Broker, message: dramatiq.MessageProxy, *,
                              result: Any = None, exception: BaseException | None = None) -> None:
        if exception is None or not message.failed:
            return
        turn_id = _turn_id_of(message)
        if turn_id is None:
            return
        loop = get_event_loop_thread()
        if loop is None:
            return
        try:
            loop.run_coroutine(runtime().end_turn(
                turn_id, "failed", code="internal_error",
                message=f"{message.actor_name} failed after retries: {type(exception).__name__}",
            ))
        except Exception:
            log.exception("give_up_failed", turn_id=turn_id)


def _turn_id_of(message: dramatiq.MessageProxy) -> str | None:
    arg = message.args[0] if message.args else None
    if isinstance(arg, dict) and isinstance(arg.get("turn_id"), str):
        return str(arg["turn_id"])
    if message.actor_name == "resolve":
        return str(message.message_id)
    return None


def create_broker(settings: Settings, url: str) -> DoorbellBroker:
    broker = make_broker(settings, url, extra=[Boot(settings, url), GiveUp()])
    declare_actors(broker)
    return broker


def serve(settings: Settings, url: str, *, queues: Sequence[str] = (), threads: int | None = None) -> None:
    """Run one worker process until SIGTERM/SIGINT."""
    configure_logging(settings)
    threads = threads or settings.threads
    settings = dataclasses.replace(settings, invoke_prefetch=settings.invoke_prefetch or max(1, threads // 2))
    broker = create_broker(settings, url)
    worker = dramatiq.Worker(broker, queues=set(queues) or None, worker_threads=threads, worker_timeout=100)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    worker.start()
    log.info("worker_started", pid=os.getpid(), queues=sorted(queues or QUEUES), threads=worker.worker_threads)
    stop.wait()
    log.info("worker_stopping", pid=os.getpid())
    worker.stop(timeout=10_000)
    broker.close()


class Supervisor:
    """Keeps `processes` worker processes running; restarts one that dies."""

    def __init__(self, url: str, *, processes: int, threads: int, queues: Sequence[str] = (),
                 env: dict[str, str] | None = None, log_path: Path | None = None) -> None:
        self.url = url
        self.processes = processes
        self.threads = threads
        self.queues = list(queues)
        self.env = {**os.environ, **(env or {}), "REDIS_URL": url}
        self.children: list[subprocess.Popen[bytes]] = []
        self.log_path = log_path
        self._stopping = False

    def _spawn(self) -> subprocess.Popen[bytes]:
        command = [sys.executable, "-m", "threadline.workers.worker", "--threads", str(self.threads)]
        if self.queues:
            command += ["--queues", *self.queues]
        if self.log_path is None:
            return subprocess.Popen(command, env=self.env)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log_file:
            return subprocess.Popen(command, env=self.env, stdout=log_file, stderr=subprocess.STDOUT)

    def start(self) -> None:
        self.children = [self._spawn() for _ in range(self.processes)]

    def watch(self, stop: threading.Event) -> None:
        while not stop.wait(0.5):
            for i, child in enumerate(self.children):
                if child.poll() is not None and not self._stopping:
                    log.warning("worker_died", pid=child.pid, code=child.returncode)
                    self.children[i] = self._spawn()

    def stop(self, grace_s: float = 15.0) -> None:
        self._stopping = True
        for child in self.children:
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for child in self.children:
            try:
                child.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()


def main(argv: Sequence[str] | None = None) -> None:
    """One worker process (spawned by the supervisor): `python -m threadline.workers.worker`."""
    parser = argparse.ArgumentParser(prog="python -m threadline.workers.worker")
    parser.add_argument("--queues", nargs="*", default=[])
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    settings = Settings.from_env()
    if settings.redis_url is None:
        raise SystemExit("REDIS_URL is not set: start workers with `threadline worker`")
    serve(settings, settings.redis_url, queues=args.queues, threads=args.threads)


if __name__ == "__main__":
    main()
