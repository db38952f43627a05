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

import dramatiq
import structlog
from dramatiq.middleware import AgeLimit, AsyncIO, CurrentMessage, Retries

from threadline.pipeline.stages import DEFAULT_GRAPH, StageGraph

from .actors import declare_actors
from .actors import queues as all_queues
from .broker import DoorbellBroker
from .logs import configure_logging
from .middleware import Boot, GiveUp, LogContext
from .runtime import RuntimeRef
from .settings import Settings

log = structlog.get_logger(__name__)


def create_broker(settings: Settings, url: str, *, graph: StageGraph = DEFAULT_GRAPH) -> DoorbellBroker:
    """The broker of one worker, with every middleware and the actors of `graph` declared on it."""
    ref = RuntimeRef()
    middleware = [
        AgeLimit(),
        GiveUp(ref, admit_actor=graph.first.name),  # before Retries: its after-hook must run after Retries'
        Retries(max_retries=settings.max_retries, min_backoff=200, max_backoff=10_000),
        CurrentMessage(),
        AsyncIO(),
        LogContext(),
        Boot(settings, url, graph, ref),
    ]
    broker = DoorbellBroker(settings=settings, url=url, middleware=middleware,
                            slow_queues=frozenset(s.queue for s in graph.of_kind("model")))
    dramatiq.set_broker(broker)
    declare_actors(broker, graph, ref, max_retries=settings.max_retries)
    return broker


def start_worker(settings: Settings, url: str, *, graph: StageGraph = DEFAULT_GRAPH, queues: Sequence[str] = (),
                 threads: int | None = None) -> tuple[DoorbellBroker, dramatiq.Worker]:
    """A running worker in this process (`serve` runs one until a signal; tests run one in-process)."""
    threads = threads or settings.threads
    settings = dataclasses.replace(settings, invoke_prefetch=settings.invoke_prefetch or max(1, threads // 2))
    broker = create_broker(settings, url, graph=graph)
    unknown = sorted(set(queues) - set(all_queues(graph)))
    if unknown:
        raise ValueError(f"unknown queues {unknown}; the queues are {list(all_queues(graph))}")
    worker = dramatiq.Worker(broker, queues=set(queues) or None, worker_threads=threads, worker_timeout=100)
    worker.start()
    return broker, worker


def serve(settings: Settings, url: str, *, queues: Sequence[str] = (), threads: int | None = None) -> None:
    """Run one worker process until SIGTERM/SIGINT."""
    configure_logging(settings)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    broker, worker = start_worker(settings, url, queues=queues, threads=threads)
    log.info("worker_started", pid=os.getpid(), queues=sorted(queues or all_queues(DEFAULT_GRAPH)),
             threads=worker.worker_threads)
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
