"""The endpoint `threadline worker` serves for all of its processes: `/metrics` (every process's
samples, summed, and what Redis says of the queues, read on each scrape by the supervisor only),
`/healthz` and `/livez` for probes. The metric definitions are `workers/telemetry/metrics.py`."""

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

import redis
import structlog
from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead
from prometheus_client.registry import Collector

from threadline.workers.operations.status import Operations
from threadline.workers.protocol.keys import Keys
from threadline.workers.storage.connect import sync_client
from threadline.workers.telemetry.metrics import MULTIPROC_ENV, PATHS

if TYPE_CHECKING:
    from _typeshed.wsgi import StartResponse, WSGIEnvironment

log = structlog.get_logger(__name__)


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
        # the port first: taken, it is an OSError before anything needs cleaning up
        try:
            self._server = make_server(host, port, self._app, server_class=_ThreadingServer, handler_class=_Quiet)
        except OSError as e:
            raise OSError(e.errno, f"cannot serve metrics on TL_METRICS_PORT {port}: {e.strerror}") from None
        self.port: int = self._server.server_port
        self.directory = Path(tempfile.mkdtemp(prefix="threadline-metrics-"))
        self.children = children
        self._redis = sync_client(url, socket_connect_timeout=1, socket_timeout=2)
        self.registry = CollectorRegistry()
        MultiProcessCollector(self.registry, path=str(self.directory))  # type: ignore[no-untyped-call]
        self.registry.register(QueueCollector(Operations(self._redis, Keys(prefix), stored_layout=True)))
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
