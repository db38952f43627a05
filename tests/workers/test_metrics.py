"""Metrics, health and tracing, from outside: `threadline worker` on `TL_METRICS_PORT` (two worker
processes, one endpoint; a second supervisor on the same port runs without one) runs real turns —
succeeded, failed, cancelled mid-stream, redelivered and dead-lettered — and a scrape of `/metrics`
over HTTP shows every family move; `/healthz` follows Redis. Tracing runs in-process (a real
dramatiq worker) into the SDK's in-memory exporter."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
import structlog
from dramatiq import Message, MessageProxy
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import ROOT, InProcessWorker, WorkerPool, drop_prefix, turn
from tests.support.clocks import turn_times
from tests.support.local_http import free_port
from tests.support.turns import python_model, raw_message, wait_for_event
from tests.support.wait import poll, wait_until
from threadline.pipeline import events as ev
from threadline.pipeline.config import AgentConfig
from threadline.pipeline.stages import DEFAULT_GRAPH
from threadline.workers.clients.client import Client
from threadline.workers.protocol.names import queues
from threadline.workers.settings import DEFAULT_METRICS_PORT, Settings
from threadline.workers.storage.connect import sync_client
from threadline.workers.telemetry import tracing
from threadline.workers.telemetry.logs import configure_logging
from threadline.workers.worker.middleware.metrics import Metrics

pytestmark = pytest.mark.integration

UNSERVED = "compact"
STAGES = ("resolve", "history", "map", "invoke", "persist")
Samples = list[tuple[str, dict[str, str], float]]


def get(port: int, path: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return int(response.status), bytes(response.read())
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except OSError:
        return 0, b""


def scrape(port: int) -> Samples:
    status, body = get(port, "/metrics")
    assert status == 200, status
    return [(s.name, dict(s.labels), s.value)
            for family in text_string_to_metric_families(body.decode()) for s in family.samples]


#: The supervised processes' TL_MODEL_CALLS.
MODEL_CALLS = 7


def value(samples: Samples, name: str, **labels: str) -> float:
    """The sum of the samples named `name` whose labels include `labels` (over every process)."""
    return sum(v for n, have, v in samples if n == name and labels.items() <= have.items())


def supervisor(url: str, prefix: str, port: int, log: Path, *args: str) -> subprocess.Popen[bytes]:
    """`threadline worker`, as a deployment runs it, with its metrics endpoint on `port`."""
    env = {**os.environ, "REDIS_URL": url, "TL_PREFIX": prefix, "TL_METRICS_PORT": str(port),
           "TL_ALLOW_PYTHON_PLUGINS": "1", "TL_MAX_RETRIES": "1", "TL_DELAY_POLL_MS": "100",
           "TL_LOG_FORMAT": "json", "TL_MODEL_CALLS": str(MODEL_CALLS), "PYTHONPATH": str(ROOT)}
    threadline = shutil.which("threadline", path=str(Path(sys.executable).parent)) or "threadline"
    with open(log, "ab") as out:
        return subprocess.Popen([threadline, "worker", *args], env=env, stdout=out, stderr=subprocess.STDOUT)


def stop(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    try:
        process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@dataclass
class Served:
    port: int
    client: Client
    redis: redis.Redis
    prefix: str
    log: Path


@pytest.fixture(scope="module")
def served(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    prefix = f"tlm{uuid.uuid4().hex[:8]}"
    port = free_port()
    log = tmp_path_factory.mktemp("logs") / "supervisor.log"
    served_queues = [q for q in queues(DEFAULT_GRAPH) if q != UNSERVED]
    process = supervisor(redis_url, prefix, port, log, "--processes", "2", "--threads", "4",
                         "--queues", *served_queues)
    client = Client(redis_url, prefix=prefix)
    r = sync_client(redis_url)
    try:
        ready = poll(lambda: get(port, "/healthz")[0] == 200 or process.poll() is not None, timeout_s=40,
                     interval_s=0.1)
        assert ready and process.poll() is None, log.read_text()[-3000:]
        yield Served(port, client, r, prefix, log)
    finally:
        stop(process)
        client.close()
        drop_prefix(r, prefix)
        r.close()


def agent(client: Client, model: str | dict[str, Any]) -> str:
    agent_id = f"agent-{uuid.uuid4().hex[:10]}"
    client.put_agent(AgentConfig.model_validate({"id": agent_id, "model": model}))
    return agent_id


def test_health_and_paths(served: Served) -> None:
    status, body = get(served.port, "/healthz")
    health = json.loads(body)
    assert status == 200 and health["redis"] is True and health["ready"] is True, health
    assert len(health["processes"]) == 2 and all(health["processes"].values()), health
    assert get(served.port, "/livez")[0] == 200
    assert get(served.port, "/nothing-here")[0] == 404


def test_every_metric_moves_with_real_turns(served: Served) -> None:
    client, port = served.client, served.port
    before = scrape(port)
    # a message that has waited 30 s on the queue nobody serves (in one shard of a sharded layout): its depth and age
    waiting = f"old-{uuid.uuid4().hex[:8]}"
    shard = client.keys.on(0)
    served.redis.hset(shard.queue_messages(UNSERVED), waiting, raw_message(
        UNSERVED, waiting, UNSERVED, [{}], message_timestamp=int(time.time() * 1000) - 30_000))
    served.redis.rpush(shard.queue(UNSERVED), waiting)

    # a long stream, cancelled in the middle
    slow = client.submit(turn(agent(client, python_model("streaming", words=3000, delay_ms=10)), "talk"))
    wait_for_event(client, slow, "text_delta")
    during = scrape(port)
    client.cancel(slow, "enough")
    assert isinstance(client.wait(slow, timeout_s=20), ev.Cancelled)

    echo = agent(client, "offline:echo")
    for query in ("one", "two"):
        assert isinstance(client.wait(client.submit(turn(echo, query)), timeout_s=20), ev.Succeeded)
    unknown = client.wait(client.submit(turn(f"missing-{uuid.uuid4().hex[:6]}", "who?")), timeout_s=20)
    assert isinstance(unknown, ev.Failed) and unknown.code == "agent_not_found"
    # a model stage that raises on every delivery: redelivered once (TL_MAX_RETRIES=1), then dead-lettered
    broken = client.wait(client.submit(turn(agent(client, python_model("broken")), "crash")), timeout_s=30)
    assert isinstance(broken, ev.Failed) and broken.code == "internal_error", broken

    def moved() -> Samples | None:
        # a stage's time is counted, and it stops counting as running, as its call ends, which may be just
        # after the turn's terminal event
        after = scrape(port)
        errors = ("threadline_stage_seconds_count", {"stage": "invoke", "outcome": "error"})
        done = value(after, "threadline_turns_total", outcome="failed", code="internal_error") > value(
            before, "threadline_turns_total", outcome="failed", code="internal_error") and value(
            after, errors[0], **errors[1]) - value(before, errors[0], **errors[1]) >= 2 and value(
            after, "threadline_stages_running") == 0
        return after if done else None

    after = poll(moved, timeout_s=10)
    scraped_by = time.time()
    assert after, "the broken turn's end was never counted, or a stage still runs"

    def delta(name: str, **labels: str) -> float:
        assert after is not None
        return value(after, name, **labels) - value(before, name, **labels)

    # the queues, the turns in flight and the workers, as Redis says
    assert value(during, "threadline_turns_in_flight") >= 1
    assert value(during, "threadline_stages_running", stage="invoke") >= 1
    assert value(during, "threadline_model_calls_limit") == 2 * MODEL_CALLS  # both processes' TL_MODEL_CALLS
    assert value(during, "threadline_queue_depth", queue=UNSERVED) == 1
    assert value(during, "threadline_queue_oldest_age_seconds", queue=UNSERVED) >= 30
    assert {labels["queue"] for name, labels, _ in during if name == "threadline_queue_depth"} == set(
        queues(DEFAULT_GRAPH))
    assert value(during, "threadline_workers_alive") >= 2 and value(during, "threadline_redis_up") == 1
    assert len([1 for name, _, v in during if name == "threadline_worker_consumers" and v > 0]) == 2
    assert delta("threadline_queue_dead", queue="invoke") >= 1
    # turns by outcome and code
    assert delta("threadline_turns_total", outcome="succeeded", code="") == 2
    assert delta("threadline_turns_total", outcome="failed", code="agent_not_found") == 1
    assert delta("threadline_turns_total", outcome="cancelled", code="cancelled") == 1
    assert delta("threadline_turns_total", outcome="failed", code="internal_error") == 1
    # stage latency of every stage; the broken model stage's two deliveries, one of them a redelivery
    for stage in STAGES:
        assert delta("threadline_stage_seconds_count", stage=stage, outcome="ok") >= 2, stage
    assert delta("threadline_stage_seconds_count", stage="invoke", outcome="error") == 2
    assert delta("threadline_redeliveries_total", stage="invoke") == 1
    # the cancel, from request to the run's end
    assert delta("threadline_cancel_latency_seconds_count") == 1
    # the worker's figure (the run's end minus the request, both on this machine's clock) is no longer
    # than from the turn's recorded request to the scrape that read it
    requested_at = turn_times(client, slow)["cancel_requested_at"]
    assert 0 <= delta("threadline_cancel_latency_seconds_sum") <= scraped_by - requested_at
    # tokens by agent and tenant
    for name in ("threadline_model_input_tokens_total", "threadline_model_output_tokens_total",
                 "threadline_model_requests_total"):
        assert delta(name, agent=echo, tenant="t1") > 0, name


def test_a_redelivery_that_starts_before_its_first_delivery_ends_is_counted_once() -> None:
    """A model call that raises enqueues its message again before its own end is counted: the two
    deliveries share a message id, and the gauge of stages running comes back to where it was."""
    middleware, stage = Metrics(), "test-redelivered"
    first = Message(queue_name=stage, actor_name=stage, args=(), kwargs={}, options={"redis_message_id": "a"})
    second = first.copy(options={"redis_message_id": "b", "retries": 1})
    def running() -> float | None:
        return REGISTRY.get_sample_value("threadline_stages_running", {"stage": stage})

    middleware.before_process_message(None, MessageProxy(first))  # type: ignore[arg-type]
    middleware.before_process_message(None, MessageProxy(second))  # type: ignore[arg-type]
    assert running() == 2
    middleware._done(MessageProxy(first), "error")
    middleware._done(MessageProxy(second), "ok")
    assert running() == 0


@pytest.mark.slow
def test_a_second_supervisor_on_a_taken_port_warns_once_and_its_workers_run(
        served: Served, redis_url: str, tmp_path: Path) -> None:
    """The default port is one per host: a second `threadline worker` (or `threadline demo`) next to
    one that serves it loses the endpoint, not its workers."""
    prefix = f"tlm{uuid.uuid4().hex[:8]}"
    log = tmp_path / "second.log"
    process = supervisor(redis_url, prefix, served.port, log, "--processes", "1", "--threads", "2")
    try:
        WorkerPool(redis_url, prefix, tmp_path).wait_ready(1)
        assert process.poll() is None, log.read_text()[-3000:]
        said = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
        warnings = [e for e in said if e["event"] == "metrics_not_served"]
        assert len(warnings) == 1 and warnings[0]["port"] == served.port, said
        assert "in use" in warnings[0]["reason"] and "TL_METRICS_PORT" in warnings[0]["hint"]
        assert not [e for e in said if e["event"] == "metrics_serving"]
        # the first one still answers, for its own processes only
        status, body = get(served.port, "/healthz")
        assert status == 200 and len(json.loads(body)["processes"]) == 2
    finally:
        stop(process)
        drop_prefix(served.redis, prefix)
    assert process.returncode == 0


def test_the_endpoint_is_on_by_default_and_off_with_zero() -> None:
    assert Settings.from_env({}).metrics_port == DEFAULT_METRICS_PORT == 9464
    assert Settings.from_env({"TL_METRICS_PORT": "0"}).metrics_port == 0
    with pytest.raises(ValueError, match="TL_METRICS_PORT"):
        Settings.from_env({"TL_METRICS_PORT": "70000"})


@pytest.mark.slow
def test_healthz_is_unavailable_while_redis_cannot_be_reached(tmp_path: Path) -> None:
    port = free_port()
    dead = f"redis://127.0.0.1:{free_port()}/0"
    process = supervisor(dead, "tlmdead", port, tmp_path / "supervisor.log", "--processes", "1", "--threads", "2")
    try:
        answered = poll(lambda: get(port, "/healthz")[0] != 0 or process.poll() is not None, timeout_s=30)
        assert answered and process.poll() is None, (tmp_path / "supervisor.log").read_text()[-3000:]
        status, body = get(port, "/healthz")
        assert status == 503 and json.loads(body)["redis"] is False, body
        # alive all the same: a Redis outage makes a pod unready, it must not get it restarted
        assert poll(lambda: get(port, "/livez")[0] == 200, timeout_s=15), get(port, "/livez")
        scraped = scrape(port)
        assert value(scraped, "threadline_redis_up") == 0
        assert not [name for name, _, _ in scraped if name.startswith("threadline_queue_")]
    finally:
        stop(process)


# --- tracing ---------------------------------------------------------------------------------------


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    tracing.install(tracing.provider(SimpleSpanProcessor(exporter)))
    yield exporter
    tracing.uninstall()


@pytest.fixture
def log_lines() -> Iterator[io.StringIO]:
    import logging

    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    stream = io.StringIO()
    configure_logging(Settings(redis_url=None, data_dir=Path("."), log_format="json"), stream=stream)
    yield stream
    root.handlers[:] = handlers
    root.setLevel(level)
    structlog.reset_defaults()


def test_spans_per_turn_and_stage_with_the_model_call_inside(
        inprocess: Callable[..., InProcessWorker], spans: InMemorySpanExporter, log_lines: io.StringIO) -> None:
    worker = inprocess()
    client = worker.client
    client.put_agent(AgentConfig.model_validate({"id": "echo", "model": "offline:echo"}))
    turn_id = client.submit(turn("echo", "trace me"))
    terminal = client.wait(turn_id, timeout_s=20)
    assert isinstance(terminal, ev.Succeeded)
    trace_id, turn_span_id = tracing.turn_ids(turn_id)

    def recorded() -> list[ReadableSpan]:
        return [s for s in spans.get_finished_spans() if s.context is not None and s.context.trace_id == trace_id]

    # the persist stage's span ends just after the turn's, once its message is processed
    wait_until(lambda: {"turn", *(f"stage {s}" for s in STAGES)} <= {s.name for s in recorded()})
    by_name = {s.name: s for s in recorded()}
    root = by_name["turn"]
    assert root.context is not None and root.context.span_id == turn_span_id and root.parent is None
    assert root.attributes is not None
    assert root.attributes["outcome"] == "succeeded" and root.attributes["conversation_id"] == terminal.conversation_id
    for stage in STAGES:
        span = by_name[f"stage {stage}"]
        assert span.parent is not None and span.parent.span_id == turn_span_id, stage
        assert span.attributes is not None
        assert span.attributes["turn_id"] == turn_id and span.attributes["stage"] == stage
        assert span.attributes["attempt"] == 1 and span.attributes["conversation_id"] == terminal.conversation_id
    # pydantic-ai's own spans for the model call, inside the invoke stage's span, without the text
    invoke = by_name["stage invoke"]
    assert invoke.context is not None
    inside = [s for s in recorded() if s.parent is not None and s.parent.span_id == invoke.context.span_id]
    assert inside, [s.name for s in recorded()]
    assert "trace me" not in json.dumps([dict(s.attributes or {}) for s in recorded()])
    # the log lines of the turn's stages carry the trace id
    turn_lines = [json.loads(line) for line in log_lines.getvalue().splitlines() if turn_id in line]
    assert turn_lines and all(line.get("trace_id") == tracing.trace_id_of(turn_id) for line in turn_lines
                              if line.get("stage") in STAGES)
    # and the in-process worker counted it in this process's registry
    assert (REGISTRY.get_sample_value("threadline_turns_total", {"outcome": "succeeded", "code": ""}) or 0) >= 1
