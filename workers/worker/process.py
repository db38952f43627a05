"""Worker processes: the broker with every middleware, one process's dramatiq `Worker`, and the
supervisor behind `threadline worker` that keeps N such processes alive.

Unlike the dramatiq CLI, whose parent exits when one child dies, the supervisor restarts a child
that dies (after 0.5 s, doubling up to 30 s while it keeps crashing) and stops them all on
SIGTERM/SIGINT: each child hands its turns back (`middleware/liveness.py`) within
`TL_SHUTDOWN_GRACE_S`, and the supervisor kills whatever is left a second after that, once it has
written its threads' stacks to its stderr (SIGUSR1).
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import gc
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, cast

import dramatiq
import redis
import structlog
from dramatiq.middleware import AgeLimit, CurrentMessage, Retries

from threadline.pipeline.stages import DEFAULT_GRAPH, StageGraph
from threadline.workers.protocol.keys import Keys, layout_record, layout_shards
from threadline.workers.protocol.names import CONTROL_QUEUE
from threadline.workers.protocol.names import queues as all_queues
from threadline.workers.settings import Settings
from threadline.workers.storage.connect import require_shards
from threadline.workers.telemetry import tracing
from threadline.workers.telemetry.logs import configure_logging
from threadline.workers.worker.actors import declare_actors
from threadline.workers.worker.broker import DoorbellBroker
from threadline.workers.worker.loops import loop_factory
from threadline.workers.worker.middleware import Boot, EventLoop, GiveUp, Liveness, LogContext, Metrics, Tracing
from threadline.workers.worker.runtime import RuntimeRef

if TYPE_CHECKING:
    from threadline.workers.operations.metrics_server import MetricsServer

log = structlog.get_logger(__name__)


def create_broker(settings: Settings, url: str, *, graph: StageGraph = DEFAULT_GRAPH) -> DoorbellBroker:
    """The broker of one worker, with every middleware and the actors of `graph` declared on it."""
    ref = RuntimeRef()
    middleware = [
        LogContext(),  # first: every other middleware's lines, and dramatiq's, carry the turn's context
        AgeLimit(),
        GiveUp(ref, admit_actor=graph.first.name),  # before Retries: its after-hook must run after Retries'
        Retries(max_retries=settings.max_retries, min_backoff=200, max_backoff=10_000),
        CurrentMessage(),
        EventLoop(loop_factory(settings.loop())),  # dramatiq's AsyncIO, on the loop the settings name
        Metrics(),
        Tracing(admit_actor=graph.first.name),
        Boot(settings, url, graph, ref),
        Liveness(settings, url, ref, admit_actor=graph.first.name),  # after Boot: it needs the runtime
    ]
    # producers outside the workers fill only the first stage's queue and the control queue (raw
    # Redis may ring nothing): those are polled often; every other enqueue is a worker script's, which rings
    broker = DoorbellBroker(settings=settings, url=url, middleware=middleware,
                            slow_queues=frozenset(s.queue for s in graph.of_kind("model")),
                            entry_queues=frozenset({graph.first.queue, CONTROL_QUEUE}))
    dramatiq.set_broker(broker)
    declare_actors(broker, graph, ref, max_retries=settings.max_retries)
    return broker


def start_worker(settings: Settings, url: str, *, graph: StageGraph = DEFAULT_GRAPH, queues: Sequence[str] = (),
                 threads: int | None = None) -> tuple[DoorbellBroker, dramatiq.Worker]:
    """A running worker in this process (`serve` runs one until a signal; tests run one in-process)."""
    threads = threads or settings.threads
    broker = create_broker(settings, url, graph=graph)
    try:
        claim_layout(broker.client, settings, url)
    except (redis.ConnectionError, redis.TimeoutError) as e:
        # started before Redis: its consumers wait for it with backoff, and so does the claim
        broker.reachability.failed("layout", e)
        threading.Thread(target=_claim_later, args=(broker, settings, url), name="threadline-layout",
                         daemon=True).start()
    unknown = sorted(set(queues) - set(all_queues(graph)))
    if unknown:
        raise ValueError(f"unknown queues {unknown}; the queues are {list(all_queues(graph))}")
    worker = dramatiq.Worker(broker, queues=set(queues) or None, worker_threads=threads, worker_timeout=100)
    worker.start()
    return broker, worker


def claim_layout(client: redis.Redis, settings: Settings, url: str) -> None:
    """Write the key layout (`TL_SHARDS`) if none is stored yet, in one command (SET NX GET); a
    ValueError when the stored one is another (the data under the prefix is laid out for it), or
    when a cluster would get one server's layout."""
    require_shards(url, settings.shards)
    key = Keys(settings.prefix).layout()
    stored = client.set(key, json.dumps(layout_record(settings.shards)), nx=True, get=True)
    shards = layout_shards(cast(bytes, stored)) if stored is not None else settings.shards
    if shards != settings.shards:
        raise ValueError(f"TL_SHARDS is {settings.shards}, but the data under prefix {settings.prefix!r} is laid out "
                         f"in {shards} shards ({key}): start the workers with TL_SHARDS={shards}")


def _claim_later(broker: DoorbellBroker, settings: Settings, url: str) -> None:
    """`claim_layout` once Redis answers; a layout refused then stops the process (SIGTERM: its
    consumers found nothing of theirs meanwhile, since producers write in the stored layout)."""
    while not broker.closing:
        time.sleep(broker.reachability.retry_in("layout"))
        try:
            claim_layout(broker.client, settings, url)
        except (redis.ConnectionError, redis.TimeoutError) as e:
            broker.reachability.failed("layout", e)
            continue
        except ValueError as e:
            log.error("layout_refused", error=str(e))
            os.kill(os.getpid(), signal.SIGTERM)
        broker.reachability.ok("layout")
        return


#: Allocations (less deallocations) between two young-generation collections: 10x CPython's 700.
#: The bigger budget cut worker CPU per turn 3-5% in paired `bench.run --phases throughput` runs
#: (docs/capacity.md), and runs the older generations' collections, which follow every 10th younger
#: one, as much less often.
GEN0_THRESHOLD = 7_000


def settle_heap() -> None:
    """Leave what the process has loaded out of the garbage collector's full collections: a worker
    holds ~110,000 objects from its imports and ~30,000 more from genai-prices' price table (which
    pydantic-ai loads on a run's first response, loaded here first), and a full collection scanned
    them all, 30-100 ms with every thread stopped, about 20 times in 1,300 turns. Frozen, they stay in
    memory as they would anyway; a full collection scans only what came after (docs/capacity.md).
    Collection is on from here, if the process's entry point turned it off for its imports, with a
    young generation of GEN0_THRESHOLD."""
    from genai_prices.data_snapshot import get_snapshot

    get_snapshot()
    gc.collect()
    gc.freeze()
    gc.set_threshold(GEN0_THRESHOLD, *gc.get_threshold()[1:])
    gc.enable()


def serve(settings: Settings, url: str, *, queues: Sequence[str] = (), threads: int | None = None) -> None:
    """Run one worker process until SIGTERM/SIGINT."""
    configure_logging(settings)
    tracing.setup(settings)
    settle_heap()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    # `kill -USR1 <pid>`: every thread's stack to stderr, for a process that is stuck (even one whose
    # main thread is blocked in C, which a Python-level handler would never reach)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    broker, worker = start_worker(settings, url, queues=queues, threads=threads)
    log.info("worker_started", pid=os.getpid(), queues=sorted(queues or all_queues(DEFAULT_GRAPH)),
             threads=worker.worker_threads, event_loop=settings.loop(), gc_enabled=gc.isenabled(),
             heap_frozen=gc.get_freeze_count(), gc_threshold=gc.get_threshold()[0])
    stop.wait()
    started = time.monotonic()
    log.info("worker_stopping", pid=os.getpid(), grace_s=settings.shutdown_grace_s)
    worker.stop(timeout=int(settings.shutdown_grace_s * 1000))
    broker.close()
    log.info("worker_stopped", pid=os.getpid(), stop_s=round(time.monotonic() - started, 2))


#: A crashing worker process is restarted after RESTART_MIN_S, twice as long after each crash that
#: follows, up to RESTART_MAX_S; one that lived STABLE_S starts the count again.
RESTART_MIN_S = 0.5
RESTART_MAX_S = 30.0
STABLE_S = 30.0
#: The supervisor kills a worker process still running this long after its grace.
KILL_MARGIN_S = 1.0
#: How long the supervisor gives such a process to write its threads' stacks (SIGUSR1) before the kill:
#: the dump is written by the signal handler itself (faulthandler), as soon as the signal arrives.
STACKS_S = 0.5


def restart_delay_s(crashes: int) -> float:
    """How long the supervisor waits before it restarts a worker process that crashed `crashes`
    times in a row."""
    return min(RESTART_MIN_S * 2.0 ** max(0, crashes - 1), RESTART_MAX_S)


class Supervisor:
    """Keeps `processes` worker processes running; restarts one that dies, with backoff."""

    def __init__(self, url: str, *, processes: int, threads: int, queues: Sequence[str] = (),
                 env: dict[str, str] | None = None, log_path: Path | None = None,
                 grace_s: float | None = None) -> None:
        self.url = url
        self.processes = processes
        self.threads = threads
        self.queues = list(queues)
        self.env = {**os.environ, **(env or {}), "REDIS_URL": url}
        #: What the children are given to hand their turns back on SIGTERM (their TL_SHUTDOWN_GRACE_S).
        self.grace_s = Settings.from_env(self.env).shutdown_grace_s if grace_s is None else grace_s
        self.children: list[subprocess.Popen[bytes]] = []
        #: Per child: when it started, its crashes in a row, when it is due to be restarted.
        self._started: list[float] = []
        self._crashes: list[int] = []
        self._restart_at: list[float | None] = []
        #: Every restart scheduled: (child index, delay in seconds).
        self.restarts: list[tuple[int, float]] = []
        self.log_path = log_path
        self._stopping = False
        self.metrics: MetricsServer | None = None

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
        self._serve_metrics()
        self.children = [self._spawn() for _ in range(self.processes)]
        now = time.monotonic()
        self._started = [now] * self.processes
        self._crashes = [0] * self.processes
        self._restart_at = [None] * self.processes

    def _serve_metrics(self) -> None:
        """On `TL_METRICS_PORT` (default 9464; 0: none): one endpoint for every worker process
        (`workers/telemetry/metrics.py`), which counts into the directory handed to it in its environment. A
        port already taken (another supervisor, or `threadline demo`, on this host) costs the
        endpoint, not the workers: one warning, and the processes count in memory only."""
        settings = Settings.from_env(self.env)
        if not settings.metrics_port:
            return
        from threadline.workers.operations.metrics_server import MetricsServer

        try:
            self.metrics = MetricsServer(port=settings.metrics_port, url=self.url, prefix=settings.prefix,
                                         children=lambda: [c.pid for c in self.children if c.poll() is None])
        except OSError as e:
            log.warning("metrics_not_served", port=settings.metrics_port, reason=e.strerror or str(e),
                        hint="set TL_METRICS_PORT to a free port, or to 0 to serve none")
            return
        self.env.update(self.metrics.child_env())
        self.metrics.start()

    def watch(self, stop: threading.Event) -> None:
        while not stop.wait(0.1):
            for i, child in enumerate(self.children):
                if not self._stopping and child.poll() is not None:
                    self._revive(i, child)

    def _revive(self, i: int, child: subprocess.Popen[bytes]) -> None:
        """Schedule the restart of a dead child, or restart it when it is due."""
        now = time.monotonic()
        due = self._restart_at[i]
        if due is None:
            lived_s = now - self._started[i]
            self._crashes[i] = 1 if lived_s >= STABLE_S else self._crashes[i] + 1
            delay = restart_delay_s(self._crashes[i])
            self._restart_at[i] = now + delay
            self.restarts.append((i, delay))
            log.warning("worker_died", pid=child.pid, code=child.returncode, lived_s=round(lived_s, 1),
                        restart_in_s=delay)
        elif now >= due:
            self._restart_at[i] = None
            self._started[i] = now
            self.children[i] = self._spawn()

    def stop(self, grace_s: float | None = None) -> None:
        """SIGTERM every child, wait for them up to their grace (and a margin), and kill the rest,
        each after it wrote its threads' stacks (SIGUSR1)."""
        self._stopping = True
        started = time.monotonic()
        for child in self.children:
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)
        deadline = started + (self.grace_s + KILL_MARGIN_S if grace_s is None else grace_s)
        for child in self.children:
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.wait(timeout=max(0.1, deadline - time.monotonic()))
        stuck = [child for child in self.children if child.poll() is None]
        # first every thread's stack to their stderr (`serve`), to say where they hung: all at once,
        # so that the stop takes STACKS_S longer however many are stuck
        for child in stuck:
            child.send_signal(signal.SIGUSR1)
        asked = time.monotonic()
        for child in stuck:
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.wait(timeout=max(0.0, asked + STACKS_S - time.monotonic()))
            if child.poll() is None:
                log.warning("worker_killed", pid=child.pid, reason="still running after its grace",
                            stacks="written to its stderr")
                child.kill()
                child.wait()
        log.info("workers_stopped", codes=[c.returncode for c in self.children],
                 stop_s=round(time.monotonic() - started, 2))
        if self.metrics is not None:
            self.metrics.stop()


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

