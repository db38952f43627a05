"""OpenTelemetry tracing of turns: a span per turn and per stage message, pydantic-ai's own spans for
the model calls inside them, and the trace and span ids on every log line written inside a span.

Off unless `TL_TRACING=1` (or `OTEL_EXPORTER_OTLP_ENDPOINT` is set); needs the `tracing` extra
(`opentelemetry-sdk` and the OTLP/HTTP exporter, configured by the standard `OTEL_*` variables).

A turn's stages run in different processes, with nothing but the turn id in common: every span of a
turn joins one trace whose ids derive from that id (trace id: the first 32 hex digits of
sha256(turn_id); the turn span's id: the next 16), so no trace context travels in the messages and
an operator finds a turn's trace from its id (`trace_id_of`). The turn span is written when the turn
ends, starting at its acceptance; each stage span is its child. Model spans carry no prompt or
answer text (`include_content=False`), as log lines at INFO carry none.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, MutableMapping
from contextvars import ContextVar, Token
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import structlog
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, Status, StatusCode, TraceFlags

from threadline.pipeline import events
from threadline.workers.settings import Settings

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import SpanProcessor, TracerProvider

    from threadline.pipeline.records import ResolvedTurn

log = structlog.get_logger(__name__)

TRACER_NAME = "threadline"
#: The ids the next root span gets (the turn span), set only while it is created.
_forced_ids: ContextVar[tuple[int, int] | None] = ContextVar("threadline_forced_ids", default=None)
_tracer: trace.Tracer | None = None
_provider: TracerProvider | None = None

Attributes = Mapping[str, str | int | float | bool]


def turn_ids(turn_id: str) -> tuple[int, int]:
    """(trace id, turn span id) of a turn."""
    digest = hashlib.sha256(turn_id.encode()).hexdigest()
    return int(digest[:32], 16) or 1, int(digest[32:48], 16) or 1


def trace_id_of(turn_id: str) -> str:
    """The trace id of a turn, as tracing backends print it."""
    return format(turn_ids(turn_id)[0], "032x")


# --- set-up ----------------------------------------------------------------------------------------


def setup(settings: Settings) -> None:
    """Export spans over OTLP when the settings ask for tracing (a worker process, at start)."""
    if not settings.tracing or _tracer is not None:
        return
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        log.error("tracing_unavailable", reason="TL_TRACING is on but the tracing extra is not installed: "
                  "pip install 'threadline[tracing]'")
        return
    install(provider(BatchSpanProcessor(OTLPSpanExporter())))
    log.info("tracing_on")


def provider(processor: SpanProcessor) -> TracerProvider:
    """A tracer provider whose root spans can take a turn's ids, sending every span to `processor`."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.id_generator import RandomIdGenerator

    class TurnIds(RandomIdGenerator):
        def generate_trace_id(self) -> int:
            forced = _forced_ids.get()
            return forced[0] if forced else super().generate_trace_id()

        def generate_span_id(self) -> int:
            forced = _forced_ids.get()
            return forced[1] if forced else super().generate_span_id()

    made = TracerProvider(resource=Resource.create({"service.name": "threadline"}), id_generator=TurnIds())
    made.add_span_processor(processor)
    return made


def install(tracer_provider: TracerProvider) -> None:
    """Trace with `tracer_provider` in this process, pydantic-ai's model calls included."""
    from pydantic_ai import Agent
    from pydantic_ai.models.instrumented import InstrumentationSettings

    global _tracer, _provider
    _provider, _tracer = tracer_provider, tracer_provider.get_tracer(TRACER_NAME)
    Agent.instrument_all(InstrumentationSettings(tracer_provider=tracer_provider, include_content=False,
                                                 include_binary_content=False))


def uninstall() -> None:
    """Stop tracing in this process (tests), after flushing what was recorded."""
    from pydantic_ai import Agent

    global _tracer, _provider
    if _provider is not None:
        _provider.shutdown()
    _provider = _tracer = None
    Agent.instrument_all(False)


def enabled() -> bool:
    return _tracer is not None


# --- spans -----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StageSpan:
    span: trace.Span
    token: Token[otel_context.Context]


def start_stage(stage: str, turn_id: str, attributes: Attributes) -> StageSpan | None:
    """Open a stage span as a child of its turn's span and make it current in this thread (the
    actor's task on the event loop inherits it); None when tracing is off. Pass the result to
    `end_stage`."""
    if _tracer is None:
        return None
    trace_id, span_id = turn_ids(turn_id)
    parent = trace.set_span_in_context(NonRecordingSpan(SpanContext(
        trace_id, span_id, is_remote=True, trace_flags=TraceFlags(TraceFlags.SAMPLED))))
    span = _tracer.start_span(f"stage {stage}", context=parent, kind=SpanKind.CONSUMER,
                              attributes={"turn_id": turn_id, "stage": stage, **attributes})
    return StageSpan(span, otel_context.attach(trace.set_span_in_context(span)))


def end_stage(started: StageSpan, *, error: BaseException | None = None, detach: bool = True) -> None:
    """End the span; `detach` it from this thread too, unless `leave_stage` did (a model call ends
    on the event loop, after its actor's thread moved on)."""
    if error is not None:
        started.span.record_exception(error)
        started.span.set_status(Status(StatusCode.ERROR, type(error).__name__))
    started.span.end()
    if detach:
        leave_stage(started)


def leave_stage(started: StageSpan) -> None:
    """The span is no longer current in the thread that started it (it may still be open)."""
    otel_context.detach(started.token)


def annotate(**attributes: str | int) -> None:
    """Add what a runner learnt (the conversation, the attempt) to the current stage span."""
    span = trace.get_current_span()
    if span.is_recording():
        span.set_attributes(attributes)


def turn_ended(event: events.Terminal, *, write: str, turn: ResolvedTurn | None, now: float) -> None:
    """Write the turn span — from its acceptance to now — once, when its terminal write took effect."""
    if _tracer is None or write != "ok":
        return
    attributes: dict[str, str | int] = {"turn_id": event.turn_id, "outcome": event.type, "attempt": event.attempt}
    code = getattr(event, "code", None)
    if code:
        attributes["code"] = code
    if turn is not None:
        attributes.update(conversation_id=turn.conversation_id, agent=turn.config.id, tenant=turn.tenant_id)
    start = turn.accepted_at if turn is not None else now
    reset = _forced_ids.set(turn_ids(event.turn_id))
    try:
        span = _tracer.start_span("turn", context=otel_context.Context(), attributes=attributes,
                                  start_time=int(start * 1e9))
    finally:
        _forced_ids.reset(reset)
    if event.type in ("failed", "timed_out"):
        span.set_status(Status(StatusCode.ERROR, code or event.type))
    span.end(end_time=int(max(now, start) * 1e9))


# --- logs ------------------------------------------------------------------------------------------


def add_trace_ids(_: Any, __: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """structlog processor: the current span's trace and span ids on the line (none outside a span)."""
    span_context = trace.get_current_span().get_span_context()
    if span_context.is_valid:
        event.setdefault("trace_id", format(span_context.trace_id, "032x"))
        event.setdefault("span_id", format(span_context.span_id, "016x"))
    return event
