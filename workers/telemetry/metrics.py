"""Prometheus metrics: what a worker process counts (one definition each). The supervisor's endpoint
that serves them for all of its processes is `workers/operations/metrics_server.py`.

The supervisor hands its worker processes a directory of their own (prometheus-client's
multiprocess mode, `PROMETHEUS_MULTIPROC_DIR`): each process writes its samples there, and a scrape
of the supervisor sums them — one port per machine or pod, however many processes run. With
`TL_METRICS_PORT=0`, or when the port is taken, each process counts in memory only."""

from __future__ import annotations

from typing import TYPE_CHECKING

import structlog
from prometheus_client import Counter, Gauge, Histogram

from threadline.pipeline import events

if TYPE_CHECKING:
    from threadline.pipeline.records import ResolvedTurn

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
MODEL_CALLS_LIMIT = Gauge("threadline_model_calls_limit", "Model calls the worker processes may run at once "
                          "(TL_MODEL_CALLS each): beside threadline_stages_running{stage=invoke}, how full they are",
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
TOKENS = Counter("threadline_tokens", "Model tokens of ended turns by kind: input (cached ones included), output, "
                 "cache_read, cache_write", ["agent", "tenant", "kind"])
COST_USD = Counter("threadline_cost_usd", "Cost in USD of ended turns with a known price (genai-prices)",
                   ["agent", "tenant"])
UNPRICED_TURNS = Counter("threadline_unpriced_turns", "Ended turns with model requests and no known price",
                         ["agent", "tenant"])
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
    for kind, count in (("input", usage.input_tokens), ("output", usage.output_tokens),
                        ("cache_read", usage.cache_read_tokens), ("cache_write", usage.cache_write_tokens)):
        TOKENS.labels(*labels, kind).inc(count)
    if usage.cost_usd is not None:
        COST_USD.labels(*labels).inc(usage.cost_usd)
    elif usage.requests:
        UNPRICED_TURNS.labels(*labels).inc()


def cancel_closed(requested_at: float | None, *, now: float) -> None:
    """A cancelled model run ended: the time since its cancel was requested (`cancel_requested_at`,
    the control actor's clock: across machines, clock skew counts too)."""
    if requested_at is not None:
        CANCEL_SECONDS.observe(max(0.0, now - requested_at))
