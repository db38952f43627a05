"""Prometheus metrics: what a worker process counts, and the one endpoint `threadline worker` serves
for all of its processes (`/metrics`, and `/healthz` and `/livez` for probes).

The supervisor hands its worker processes a directory of their own (prometheus-client's
multiprocess mode, `PROMETHEUS_MULTIPROC_DIR`): each process writes its samples there, and a scrape
of the supervisor sums them — one port per machine or pod, however many processes run, which is
what a Kubernetes scrape and probe want. What Redis says of the queues (the reads of `threadline
status`, `Operations.status`) is read on each scrape, by the supervisor only. It serves on
`TL_METRICS_PORT` (default 9464); with 0, or when the port is taken (a second supervisor on the
host), nothing is served and each process counts in memory only.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from socketserver import ThreadingMixIn
from typing import TYPE_CHECKING, Any, cast
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead
from prometheus_client.registry import Collector

from threadline.pipeline import events

if TYPE_CHECKING:
    from _typeshed.wsgi import StartResponse, WSGIEnvironment

    from threadline.pipeline.records import ResolvedTurn
    from threadline.workers.operations.status import Operations

log = structlog.get_logger(__name__)

#: What the supervisor's endpoint serves (the Kubernetes probes point at the last two).
PATHS = ("/metrics", "/healthz", "/livez")
#: The variable prometheus-client reads at import to count in files (multiprocess mode).
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"

_STAGE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_CANCEL_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

# --- what a worker process counts ----------------------------------------------------------------

TURNS = Counter("threadline_turns", "Turns ended, by outcome (the terminal event's type) and error code",
                ["outcome", "code"])
STAGE_SECONDS = Histogram("threadline_stage_seconds",
                          "Time a worker spent on one stage message, by stage (actor) and outcome (ok, error)",
                          ["stage", "outcome"], buckets=_STAGE_BUCKETS)
STAGES_RUNNING = Gauge("threadline_stages_running", "Stage messages being processed now, by stage", ["stage"],
                       multiprocess_mode="livesum")
REDELIVERIES = Counter("threadline_redeliveries", "Messages delivered again after their actor raised (dramatiq's "
                       "retries), by stage", ["stage"])
TAKEOVERS = Counter("threadline_watchdog_takeovers", "Stalled turns the watchdog enqueued again, by the stage they "
                    "stalled at", ["stage"])
ORPHANS_REQUEUED = Counter("threadline_orphaned_messages_requeued", "Messages a consumer put back because its "
                           "process held them no more (fetched by a consumer that lost its connection), by queue",
                           ["queue"])
TOKEN_COUNTS = Counter("threadline_token_count_requests", "Requests to providers' token count endpoints, by provider "
                       "and result (ok; failed: the turn counted locally; skipped: left alone after a failure)",
                       ["provider", "result"])
CANCEL_SECONDS = Histogram("threadline_cancel_latency_seconds",
                           "From a cancel request to the end of the cancelled model run", buckets=_CANCEL_BUCKETS)
INPUT_TOKENS = Counter("threadline_model_input_tokens", "Model input tokens of ended turns", ["agent", "tenant"])
OUTPUT_TOKENS = Counter("threadline_model_output_tokens", "Model output tokens of ended turns", ["agent", "tenant"])
MODEL_REQUESTS = Counter("threadline_model_requests", "Model requests of ended turns", ["agent", "tenant"])
CONSUMERS = Gauge("threadline_worker_consumers", "dramatiq consumer threads alive, per worker process",
                  multiprocess_mode="liveall")
WORKER_READY = Gauge("threadline_worker_ready", "1 while every consumer and worker thread of a worker process runs",
                     multiprocess_mode="liveall")


def turn_ended(event: events.Terminal, *, write: str, turn: ResolvedTurn | None) -> None:
    """Count a turn's end (once: only the terminal write that took effect, `write == "ok"`), and its
    model usage by agent and tenant."""
    if write != "ok":
        return
    TURNS.labels(event.type, getattr(event, "code", "")).inc()
    usage = event.usage
    if turn is None or usage is None:
        return
    labels = (turn.config.id, turn.tenant_id)
    INPUT_TOKENS.labels(*labels).inc(usage.input_tokens)
    OUTPUT_TOKENS.labels(*labels).inc(usage.output_tokens)
    MODEL_REQUESTS.labels(*labels).inc(usage.requests)


def cancel_closed(requested_at: float | None, *, now: float) -> None:
    """A cancelled model run ended: the time since its cancel was requested (`cancel_requested_at`,
    the control actor's clock: across machines, clock skew counts too)."""
    if requested_at is not None:
        CANCEL_SECONDS.observe(max(0.0, now - requested_at))


# --- what the supervisor serves ------------------------------------------------------------------

#: (metric, `QueueStatus` field, help) of the per-queue gauges.
_QUEUE_GAUGES: tuple[tuple[str, str, str], ...] = (
    ("threadline_queue_depth", "depth", "Messages waiting on a queue"),
    ("threadline_queue_delayed", "delayed", "Messages on a queue's delay queue (retries waiting out their backoff)"),
    ("threadline_queue_in_progress", "in_progress", "Messages of a queue fetched by workers and not acked yet"),
    ("threadline_queue_dead", "dead", "Dead letters of a queue (bodies kept)"),
    ("threadline_queue_oldest_age_seconds", "oldest_age_s", "Age of the oldest message waiting on a queue (0: none)"),
    ("threadline_queue_consumers", "consumers", "Live worker processes consuming a queue (their heartbeats say)"),
)


class QueueCollector(Collector):
    """On each scrape, the queues, the workers alive and the turns in flight as `threadline status`
    reads them (`Operations.status`), and whether Redis answered. Every supervisor of a deployment
    reports the same fleet-wide values: aggregate them with `max`, not `sum`."""

    def __init__(self, operations: Operations) -> None:
        self.operations = operations

    def collect(self) -> Iterator[Metric]:
        import redis

        up = GaugeMetricFamily("threadline_redis_up", "1 when Redis answered the last scrape's reads")
        try:
            status = self.operations.status()
        except (redis.RedisError, OSError):
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        for name, field, help_text in _QUEUE_GAUGES:
            family = GaugeMetricFamily(name, help_text, labels=["queue"])
            for q in status.queues:
                family.add_metric([q.name], float(getattr(q, field) or 0))
            yield family
        yield _gauge("threadline_turns_in_flight", "Turns between admission and their end", status.turns.count)
        yield _gauge("threadline_oldest_turn_age_seconds", "Age of the oldest turn in flight (0: none)",
                     status.turns.oldest_age_s or 0)
        yield _gauge("threadline_workers_alive", "Worker processes whose heartbeat has not expired",
                     status.workers_alive)


def _gauge(name: str, help_text: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, help_text, value=float(value))


_LIVE_FILE = re.compile(r"gauge_live\w+?_(\d+)\.db")


class MetricsServer:
    """The supervisor's endpoint: `/metrics` (every process's samples, summed, and the queues),
    `/healthz` (ready: Redis answers and every worker process's consumers run; 503 otherwise) and
    `/livez` (alive: some worker process's consumers run; Redis is not asked, so that an outage
    makes pods unready but never restarts them). Any other path is a 404."""

    def __init__(self, *, port: int, url: str, prefix: str, children: Callable[[], Iterable[int]],
                 host: str = "0.0.0.0") -> None:
        import redis

        from threadline.workers.operations.status import Operations
        from threadline.workers.protocol.keys import Keys

        # the port first: taken, it is an OSError before anything needs cleaning up
        try:
            self._server = make_server(host, port, self._app, server_class=_ThreadingServer, handler_class=_Quiet)
        except OSError as e:
            raise OSError(e.errno, f"cannot serve metrics on TL_METRICS_PORT {port}: {e.strerror}") from None
        self.port: int = self._server.server_port
        self.directory = Path(tempfile.mkdtemp(prefix="threadline-metrics-"))
        self.children = children
        self._redis = redis.Redis.from_url(url, socket_connect_timeout=1, socket_timeout=2)
        self.registry = CollectorRegistry()
        MultiProcessCollector(self.registry, path=str(self.directory))  # type: ignore[no-untyped-call]
        self.registry.register(QueueCollector(Operations(self._redis, Keys(prefix))))
        self._metrics_app = make_wsgi_app(self.registry)
        self._thread = threading.Thread(target=self._server.serve_forever, name="threadline-metrics", daemon=True)

    def child_env(self) -> dict[str, str]:
        """What a worker process needs in its environment to count into this server's directory."""
        return {MULTIPROC_ENV: str(self.directory)}

    def start(self) -> None:
        self._thread.start()
        log.info("metrics_serving", port=self.port, paths=list(PATHS))

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._redis.close()
        shutil.rmtree(self.directory, ignore_errors=True)

    def health(self) -> dict[str, Any]:
        """Whether this machine's workers can work: Redis, and each worker process's readiness."""
        live = set(self.children())
        self._forget_dead(live)
        ready = {pid: v for pid, v in self._per_process("threadline_worker_ready").items() if pid in live}
        processes = {str(pid): bool(ready.get(pid)) for pid in sorted(live)}
        try:
            redis_ok = bool(self._redis.ping())
        except Exception:  # redis-py's errors, and a socket's
            redis_ok = False
        return {"redis": redis_ok, "processes": processes,
                "live": any(processes.values()), "ready": redis_ok and bool(processes) and all(processes.values())}

    def _per_process(self, name: str) -> dict[int, float]:
        values: dict[int, float] = {}
        collector = MultiProcessCollector(None, path=str(self.directory))  # type: ignore[no-untyped-call]
        for family in cast(Iterable[Metric], collector.collect()):  # type: ignore[no-untyped-call]
            if family.name == name:
                values.update({int(s.labels["pid"]): s.value for s in family.samples if "pid" in s.labels})
        return values

    def _forget_dead(self, live: set[int]) -> None:
        """Drop the live gauges of worker processes that are gone (a restarted process has a new pid);
        their counters stay, so that totals never go backwards."""
        for path in self.directory.glob("gauge_live*.db"):
            match = _LIVE_FILE.fullmatch(path.name)
            if match and int(match[1]) not in live:
                mark_process_dead(int(match[1]), str(self.directory))  # type: ignore[no-untyped-call]

    def _app(self, environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "/")
        if path == "/metrics":
            self._forget_dead(set(self.children()))
            return cast(Iterable[bytes], self._metrics_app(environ, start_response))
        if path not in PATHS:
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [f"not found; served: {', '.join(PATHS)}\n".encode()]
        health = self.health()
        ok = health["ready" if path == "/healthz" else "live"]
        start_response("200 OK" if ok else "503 Service Unavailable", [("Content-Type", "application/json")])
        return [json.dumps(health).encode()]


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    """One thread per request: a slow Redis on `/healthz` never holds up a scrape."""

    daemon_threads = True


class _Quiet(WSGIRequestHandler):
    """No access log line per probe and scrape."""

    def log_message(self, format: str, *args: Any) -> None:
        pass
