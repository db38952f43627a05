"""The model stage: one pydantic-ai run of the turn, ending in an outcome whatever happens.

The shell passes in the agent, the cancellation token, a clock and the run's stream handler (which
turns what the model says into events, `pipeline.streaming`); this module never touches Redis.
Whatever happens to the run (success, model error, cancel, deadline, pause), it returns an
`InvokeOutcome` holding the run's new messages, ready for the finish stage.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Protocol, cast

from pydantic import BaseModel, ConfigDict, Field
from pydantic_ai import (
    Agent,
    CallDeferred,
    CancellationToken,
    DeferredToolRequests,
    DeferredToolResults,
    RunCancelled,
    RunContext,
    Tool,
    capture_run_messages,
)
from pydantic_ai.exceptions import (
    AgentRunError,
    FallbackExceptionGroup,
    ModelAPIError,
    ModelConnectionError,
    ModelContextWindowExceededError,
    ModelQuotaExceededError,
    ModelRateLimitError,
    ModelRequestRejectedError,
    ModelServerError,
    ModelUnavailableError,
    RunTimedOut,
    UserError,
)
from pydantic_ai.messages import (
    AgentStreamEvent,
    ImageUrl,
    ModelMessage,
    ModelResponse,
    ToolCallPart,
    UserContent,
)
from pydantic_ai.models import Model
from pydantic_ai.settings import ModelSettings

from .contracts import Usage
from .cost import LocalCount, run_usage
from .errors import ErrorCode, ThreadlineError
from .events import TerminalType
from .guards import check_text, guarded_exchange, scrub_responses, spoken_text
from .history import attachment_line, encode_messages
from .limits import limit_messages, truncate_text
from .persist import prepare_snapshot, run_answer
from .records import ResolvedTurn, ToolActivity
from .redact import redact


class InvokeOutcome(BaseModel):
    """How the run ended; `snapshot` is the run's new messages, ready to store (None: keep the old)."""

    model_config = ConfigDict(frozen=True)

    status: TerminalType
    answer: str = ""
    usage: Usage = Field(default_factory=Usage)
    code: ErrorCode | None = None
    message: str | None = None
    transient: bool = False
    retry_after_s: float | None = None
    pending_tool_calls: list[dict[str, Any]] = Field(default_factory=list)
    tools: list[ToolActivity] = Field(default_factory=list)
    snapshot: str | None = None
    #: Text parts stored truncated (answers, tool results over the size limit).
    truncated_parts: int = 0
    #: Why a guard gave the answer (`pipeline.guards`): {"kind", "rule"}; None: the model's own.
    guard: dict[str, str | bool] | None = None
    #: The model that answered last (`ModelResponse.model_name`), and the models a fallback chain moved
    #: on from during the run (pydantic-ai's `failed_attempts`), in order.
    model: str | None = None
    fallback_from: list[str] = Field(default_factory=list)


class RunStream(Protocol):
    """The shell's handler of the run's stream events, and the tool activity it saw."""

    @property
    def tools(self) -> Mapping[str, ToolActivity]: ...

    async def handle(self, ctx: RunContext[TurnDeps], stream: AsyncIterable[AgentStreamEvent]) -> None: ...


# --- the run --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TurnDeps:
    now: Callable[[], float]


def clock(ctx: RunContext[TurnDeps]) -> str:
    """The current date and time (UTC, ISO 8601)."""
    return datetime.fromtimestamp(ctx.deps.now(), UTC).isoformat(timespec="seconds")


def ask_human(question: str) -> str:
    """Ask the user a question and wait for the answer; the turn pauses until it arrives."""
    raise CallDeferred(kind="question")


BUILTIN_TOOLS: dict[str, Tool[TurnDeps]] = {
    "clock": Tool(clock, takes_ctx=True),
    "ask_human": Tool(ask_human, takes_ctx=False),
}


def user_prompt(turn: ResolvedTurn, *, vision: bool) -> str | list[UserContent] | None:
    """The current query with its files: images natively for vision models, else as text lines."""
    if turn.deferred_answers is not None:
        return None
    if not turn.files:
        return turn.query
    content: list[UserContent] = [turn.query]
    for f in turn.files:
        content.append(ImageUrl(url=f.url) if vision and f.type == "image" else attachment_line(f))
    return content


def run_instructions(turn: ResolvedTurn) -> str | None:
    parts = [turn.instructions.strip()]
    if turn.context and turn.context.strip():
        parts.append(f"Context:\n{turn.context.strip()}")
    text = "\n\n".join(p for p in parts if p)
    return text or None


TurnAgent = Agent[TurnDeps, str | DeferredToolRequests]


def build_agent(model: Model, tools: Sequence[Tool[TurnDeps]] = ()) -> TurnAgent:
    """The agent a config runs: stateless between runs, so the shell builds it once and reuses it."""
    return Agent(model, output_type=[str, DeferredToolRequests], deps_type=TurnDeps, tools=list(tools))


async def run_turn(
    turn: ResolvedTurn,
    history: Sequence[ModelMessage],
    *,
    agent: TurnAgent,
    attempt: int,
    stream: RunStream,
    token: CancellationToken,
    clock: Callable[[], float],
    timeout_s: float,
    max_chars: int,
    secrets: Sequence[str] = (),
    model: Model | None = None,
    local: LocalCount | None = None,
) -> InvokeOutcome:
    """Run the agent once; every way it can end becomes an `InvokeOutcome`. Texts longer than
    `max_chars` are stored truncated; `secrets` (the model's key) never reach an error message.
    `model` replaces the agent's own for this run (the shell wraps it in a concurrency limit);
    `local` counts the offline models' usage (`pipeline.cost`)."""
    run_id = f"{turn.turn_id}/{attempt}"
    deferred = DeferredToolResults(calls=dict(turn.deferred_answers)) if turn.deferred_answers else None
    with capture_run_messages() as captured:
        try:
            result = await agent.run(
                user_prompt(turn, vision=turn.config.model.vision),
                message_history=list(history) or None,
                deferred_tool_results=deferred,
                instructions=run_instructions(turn),
                model_settings=cast(ModelSettings, turn.config.settings),
                deps=TurnDeps(now=clock),
                cancellation_token=token,
                timeout=max(timeout_s, 0.001),
                run_id=run_id,
                conversation_id=turn.conversation_id,
                event_stream_handler=stream.handle,
                model=model,
            )
            output: str | DeferredToolRequests | None = result.output
            failure: BaseException | None = None
        except Exception as e:  # a broken tool too: the turn ends `failed`, its history kept
            output, failure = None, e
    new = [m for m in captured if m.run_id == run_id]
    usage = run_usage(new, history=history, local=local)
    outcome = _outcome(output, failure, new, list(stream.tools.values()), max_chars=max_chars, secrets=secrets,
                       usage=usage)
    return guard_output(outcome, new, turn, max_chars=max_chars)


def answer_without_model(turn: ResolvedTurn) -> InvokeOutcome:
    """The outcome of a turn the input guards answered (`turn.guard`): their reply, no model call."""
    assert turn.guard is not None, "only a guarded turn is answered without the model"
    exchange = guarded_exchange(turn.query, turn.guard, at=turn.accepted_at)
    return InvokeOutcome(status="succeeded", answer=turn.guard.reply, snapshot=encode_messages(exchange).decode(),
                         guard=turn.guard.record()["guard"])


def guard_output(outcome: InvokeOutcome, new: list[ModelMessage], turn: ResolvedTurn, *,
                 max_chars: int) -> InvokeOutcome:
    """The outcome with the output guard's reply in place of an answer that breaks its rules: in the
    answer and in the stored messages. The check sees all the text the run said, as its stream did."""
    rules = turn.config.guards.output
    if not rules.active:
        return outcome
    hit = (check_text(rules, spoken_text(new), where="output")
           or check_text(rules, outcome.answer, where="output"))
    if hit is None:
        return outcome
    snapshot = prepare_snapshot(scrub_responses(new, hit.reply), paused=outcome.status == "paused")
    if snapshot is not None:
        snapshot, _ = limit_messages(snapshot, max_chars)
    return outcome.model_copy(update={
        "answer": hit.reply, "guard": hit.record()["guard"],
        "snapshot": encode_messages(snapshot).decode() if snapshot is not None else None,
    })


def _outcome(
    output: str | DeferredToolRequests | None,
    failure: BaseException | None,
    new: list[ModelMessage],
    tools: list[ToolActivity],
    *,
    max_chars: int,
    secrets: Sequence[str],
    usage: Usage,
) -> InvokeOutcome:
    status, code, message, transient, retry_after = _classify(output, failure, secrets)
    snapshot = prepare_snapshot(new, paused=status == "paused")
    truncated = 0
    if snapshot is not None:
        snapshot, truncated = limit_messages(snapshot, max_chars)
    pending = _pending_calls(output) if isinstance(output, DeferredToolRequests) else []
    if isinstance(output, str):
        answer = output
    elif pending:
        answer = "\n".join(str(call["args"].get("question", "")) for call in pending).strip()
    else:
        answer = run_answer(new)
    answer, cut = truncate_text(answer, max_chars)
    model, fallback_from = answered_by(new, failure)
    return InvokeOutcome(
        status=status,
        answer=answer,
        usage=usage,
        code=code,
        message=message,
        transient=transient,
        retry_after_s=retry_after,
        pending_tool_calls=pending,
        tools=tools,
        snapshot=encode_messages(snapshot).decode() if snapshot is not None else None,
        truncated_parts=max(truncated, int(cut)),
        model=model,
        fallback_from=fallback_from,
    )


def invoke_decision(outcome: InvokeOutcome, *, limit_wait_s: float | None = None) -> dict[str, Any] | None:
    """The model stage's decision record: which model answered, the models a fallback chain moved on
    from, how long the run waited for a slot of the agent's `max_concurrency`, and whether what was
    stored is not all the model said (TL_MAX_TEXT_CHARS); None when there is nothing to say."""
    decision: dict[str, Any] = {}
    if outcome.model:
        decision["model"] = outcome.model
    if outcome.fallback_from:
        decision["fallback_from"] = list(outcome.fallback_from)
    if limit_wait_s is not None:
        decision["limit_wait_ms"] = round(limit_wait_s * 1000, 1)
    if outcome.truncated_parts:
        decision["truncated_parts"] = outcome.truncated_parts
    if outcome.guard:
        decision["guard"] = outcome.guard  # the output guard replaced the answer
    return decision or None


def answered_by(new: Sequence[ModelMessage], failure: BaseException | None) -> tuple[str | None, list[str]]:
    """Which model gave the run's last response, and which models a fallback chain gave up on
    before (on any request of the run, or all of them when the whole chain failed)."""
    responses = [m for m in new if isinstance(m, ModelResponse)]
    attempts = [a for r in responses for a in r.failed_attempts or ()]
    if isinstance(failure, FallbackExceptionGroup):
        attempts.extend(failure.attempts)
    return (responses[-1].model_name if responses else None), list(dict.fromkeys(a.model_name for a in attempts))


def _pending_calls(output: DeferredToolRequests) -> list[dict[str, Any]]:
    calls: list[ToolCallPart] = [*output.calls, *output.approvals]
    return [{"tool_call_id": c.tool_call_id, "name": c.tool_name, "args": c.args_as_dict()} for c in calls]


Classified = tuple[TerminalType, ErrorCode | None, str | None, bool, float | None]


def _classify(output: object, failure: BaseException | None, secrets: Sequence[str]) -> Classified:
    if failure is None:
        return ("paused" if isinstance(output, DeferredToolRequests) else "succeeded"), None, None, False, None
    if isinstance(failure, RunTimedOut):
        return "timed_out", "timed_out", "the turn's deadline passed", False, None
    if isinstance(failure, RunCancelled):
        return "cancelled", "cancelled", "the turn was cancelled", False, None
    failure = deciding_error(failure)
    code, transient = model_error_code(failure)
    retry_after = failure.retry_after if isinstance(failure, ModelAPIError) else None
    return "failed", code, _safe_message(failure, secrets), transient, retry_after


def deciding_error(error: BaseException) -> BaseException:
    """The error that classifies a failure: of a fallback chain that failed as a whole, the first
    transient one (trying again later may help), else the first."""
    if not isinstance(error, FallbackExceptionGroup) or not error.exceptions:
        return error
    members = [deciding_error(e) for e in error.exceptions]
    return next((e for e in members if is_transient(e)), members[0])


def is_transient(error: BaseException) -> bool:
    """Whether trying again (or another model) may help: rate limits, 5xx, connection errors, and
    not a bad request. A fallback chain moves on exactly on these."""
    return model_error_code(deciding_error(error))[1]


def falls_back(error: BaseException) -> bool:
    """Whether a fallback chain moves on to its next model: where Threadline would try again, and on
    an exhausted quota (the next model is usually another account)."""
    code, transient = model_error_code(deciding_error(error))
    return transient or code == "model_quota_exceeded"


def retry_delay_s(outcome: InvokeOutcome, *, attempt: int, max_attempts: int) -> float | None:
    """Seconds before the next attempt of a transiently failed run (bounded exponential backoff,
    or what the provider asked for), or None: the outcome is final."""
    if outcome.status != "failed" or not outcome.transient or attempt >= max_attempts:
        return None
    backoff = min(0.5 * 2 ** (attempt - 1), 10.0)
    # a provider's Retry-After is honoured up to 30 s: a turn is not left waiting longer
    return min(outcome.retry_after_s, 30.0) if outcome.retry_after_s else backoff


def model_error_code(error: BaseException) -> tuple[ErrorCode, bool]:
    """A stable code for a model failure, and whether trying again may help."""
    if isinstance(error, ThreadlineError):
        return error.code, error.transient
    if isinstance(error, ModelQuotaExceededError):  # a 429 too, at OpenAI: before the rate limits
        return "model_quota_exceeded", False
    if isinstance(error, ModelRateLimitError):
        return "model_rate_limited", True
    if isinstance(error, ModelUnavailableError | ModelServerError | ModelConnectionError):
        return "model_unavailable", True
    if isinstance(error, ModelContextWindowExceededError):
        return "context_too_large", False
    if isinstance(error, ModelRequestRejectedError):
        return "model_bad_request", False
    status = getattr(error, "status_code", None)
    if isinstance(status, int):
        if status == 429:
            return "model_rate_limited", True
        if status >= 500 or status == 408:
            return "model_unavailable", True
        if status >= 400:
            return "model_bad_request", False
    return ("model_error" if isinstance(error, AgentRunError | UserError) else "internal_error"), False


def _safe_message(error: BaseException, secrets: Sequence[str]) -> str:
    """A short description that never carries request headers or keys: provider error bodies may
    echo the request's `Authorization` header."""
    text = str(error).splitlines()[0] if str(error) else type(error).__name__
    return redact(text, secrets)[:300]

