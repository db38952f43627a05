"""Every environment setting, read once into one frozen object."""

from __future__ import annotations

import importlib.util
import math
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from threadline.pipeline.policy import CONVENTIONAL_KEY_NAMES, ModelPolicy
from threadline.workers.protocol.keys import MAX_SHARDS


def _int(env: Mapping[str, str], name: str, default: int, *, minimum: int = 0, maximum: int | None = None) -> int:
    """An integer variable; a value that is not one, or is below `minimum` (or above `maximum`), is a
    `ValueError` naming the variable (the CLI turns it into one line and exit 2)."""
    value = env.get(name)
    if value is None or value.strip() == "":
        return default
    try:
        number = int(value)
    except ValueError:
        raise ValueError(f"{name} must be an integer >= {minimum}, not {value!r}") from None
    if number < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, not {value!r}")
    if maximum is not None and number > maximum:
        raise ValueError(f"{name} must be an integer from {minimum} to {maximum}, not {value!r}")
    return number


def _float(env: Mapping[str, str], name: str, default: float, *, positive: bool = True) -> float:
    """A number variable (seconds, days); `positive` refuses zero and below."""
    value = env.get(name)
    if value is None or value.strip() == "":
        return default
    try:
        number = float(value)
    except ValueError:
        number = math.nan
    if not math.isfinite(number) or (positive and number <= 0):
        raise ValueError(f"{name} must be a {'positive ' if positive else ''}number, not {value!r}")
    return number


def _names(env: Mapping[str, str], name: str) -> tuple[str, ...] | None:
    """A comma-separated list; None when the variable is unset (an empty value is an empty list)."""
    value = env.get(name)
    return None if value is None else tuple(item.strip() for item in value.split(",") if item.strip())


def model_policy(env: Mapping[str, str] | None = None) -> ModelPolicy:
    """`TL_KEY_ENV_ALLOW` (default: the providers' conventional key variables) and `TL_BASE_URL_ALLOW`
    (default: none): what `agents put` refuses and what workers read (`pipeline/policy.py`)."""
    env = os.environ if env is None else env
    keys = _names(env, "TL_KEY_ENV_ALLOW")
    return ModelPolicy(key_env_allow=CONVENTIONAL_KEY_NAMES if keys is None else frozenset(keys),
                       base_url_allow=_names(env, "TL_BASE_URL_ALLOW") or ())


def _uvloop_installed() -> bool:
    return importlib.util.find_spec("uvloop") is not None


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
#: Where `threadline worker` serves /metrics and its probes unless TL_METRICS_PORT says otherwise.
DEFAULT_METRICS_PORT = 9464

#: Every variable Threadline reads, with a one-line meaning: `threadline --help` lists them (docs/operations.md's
#: settings table says more).
ENVIRONMENT: tuple[tuple[str, str], ...] = (
    ("REDIS_URL", "the Redis/Valkey server (unset: the embedded server `threadline worker` starts)"),
    ("TL_DATA_DIR", "where the embedded server keeps its data (default .threadline)"),
    ("TL_PREFIX", "prefix of every key and channel (default tl)"),
    ("TL_SHARDS", "virtual shards of the key layout, fixed for the life of the data (default 0: one server's)"),
    ("TL_AUTHOR", "the author agent changes record (default: the OS user name)"),
    ("TL_LOG_FORMAT", "json or console (default: console on a terminal)"),
    ("TL_LOG_LEVEL", "DEBUG, INFO (default), WARNING, ERROR or CRITICAL; DEBUG logs message content"),
    ("TL_PROCESSES", "worker processes (default 2)"),
    ("TL_THREADS", "threads per worker process (default 8)"),
    ("TL_MODEL_CALLS", "model calls one process runs at once (default: 500, fewer when memory is short)"),
    ("TL_INVOKE_PREFETCH", "the older name of TL_MODEL_CALLS (read when that is not set)"),
    ("TL_EVENT_LOOP", "auto (default: uvloop where installed), uvloop or asyncio: the workers' and gateway's loops"),
    ("TL_MAX_QUERY_CHARS", "longest query (default 32000)"),
    ("TL_MAX_CONTEXT_CHARS", "longest context, and longest answers to a paused turn's tool calls (default 200000)"),
    ("TL_MAX_INPUTS_CHARS", "the most characters of prompt variables, names and values (default 32000)"),
    ("TL_MAX_FILES", "the most files a turn request may carry (default 32, at most 256)"),
    ("TL_MAX_BODY_BYTES", "the largest request body the gateway reads; larger is a 413 (default 2097152)"),
    ("TL_MAX_TEXT_CHARS", "answers and tool texts are stored cut at this length (default 100000)"),
    ("TL_IDLE_POLL_MS", "an idle consumer's poll interval (default 2000)"),
    ("TL_DELAY_POLL_MS", "poll interval of the queues only workers fill: delay, later stages' (default 30000)"),
    ("TL_ARTIFACT_TTL_S", "lifetime of a turn's artifacts, a safety net (default 86400)"),
    ("TL_TURN_TTL_S", "how long an ended turn's record and events stay (default 21600)"),
    ("TL_CANCEL_TTL_S", "lifetime of a cancel flag (default 86400)"),
    ("TL_DEBOUNCE_MS", "text deltas are batched this long (default 75)"),
    ("TL_INVOKE_LEASE_S", "the model claim's lifetime (default 30)"),
    ("TL_STALL_S", "a turn no worker holds that made no progress this long runs again (default 60)"),
    ("TL_WATCHDOG_S", "how often the watchdog looks (default 2)"),
    ("TL_HEARTBEAT_S", "how often a worker process tells Redis it is alive (default 2)"),
    ("TL_WORKER_TIMEOUT_S", "a worker silent this long is dead: its turns and messages move on (default 10)"),
    ("TL_SHUTDOWN_GRACE_S", "on SIGTERM, how long running stages may take to finish (default 5)"),
    ("TL_RETENTION_DAYS", "delete conversations idle longer than this (default 0: keep)"),
    ("TL_MAX_RECOVERIES", "times a stalled turn runs again before it fails (default 3)"),
    ("TL_MAX_INVOKE_ATTEMPTS", "attempts of a model call that fails transiently (default 3)"),
    ("TL_MAX_RETRIES", "dramatiq retries before a message is dead-lettered (default 5)"),
    ("TL_ALLOW_PYTHON_PLUGINS", "1: allow python:module:function models and tools"),
    ("TL_KEY_ENV_ALLOW", "comma-separated: the variables workers may read model keys from"),
    ("TL_BASE_URL_ALLOW", "comma-separated URL prefixes a conventional key may be sent to"),
    ("TL_METRICS_PORT", "`threadline worker` serves /metrics, /healthz and /livez on this port (default 9464; 0: off)"),
    ("TL_TRACING", "1: OpenTelemetry spans per turn and stage (also on when OTEL_EXPORTER_OTLP_ENDPOINT is set)"),
    ("TL_FILE_CHECK", "public (default), all or off: the hosts workers may ask whether a file in history is there"),
    ("TL_WEBHOOK_HOSTS", "public (default) or all: the hosts completion webhooks may be POSTed to"),
    ("TL_WEBHOOK_MAX_ATTEMPTS", "attempts of a completion webhook before it is failed (default 8)"),
    ("TL_WEBHOOK_BACKOFF_S", "wait after a webhook's first failed attempt, doubled after each (default 5)"),
    ("TL_WEBHOOK_BACKOFF_MAX_S", "the longest wait between two attempts of a webhook (default 600)"),
    ("TL_WEBHOOK_TIMEOUT_S", "how long one webhook POST may take (default 10)"),
    ("TL_GATEWAY_POOL", "Redis connections of a gateway process's requests (default 32; streams share one more)"),
    ("TL_GATEWAY_POOL_TIMEOUT_S", "how long a gateway request waits for a free connection before a 503 (default 5)"),
    ("TL_KEY_RPS", "requests per second an API key may make, unless its record says (default 20; 0: no limit)"),
    ("TL_KEY_TURNS_PER_MIN", "turns per minute an API key may start, unless its record says (default 60; 0: no limit)"),
    ("TL_KEY_MAX_STREAMS", "event streams an API key may hold open at once, unless its record says (default 100)"),
    ("TL_AUTH_FAILURES_PER_MIN", "failed authentications per client address and minute before 429 (default 20)"),
)


def shards_from_env(env: Mapping[str, str] | None = None) -> int:
    """`TL_SHARDS` alone (producers read nothing else of the environment)."""
    return _int(os.environ if env is None else env, "TL_SHARDS", 0, maximum=MAX_SHARDS)


@dataclass(frozen=True, slots=True)
class Settings:
    #: None: start (or join) the embedded Valkey server under `data_dir`.
    redis_url: str | None
    data_dir: Path
    prefix: str = "tl"
    #: Virtual shards of the key layout (`protocol/keys.py`); 0: one server's layout.
    shards: int = 0
    log_format: Literal["json", "console"] = "console"
    log_level: str = "INFO"
    processes: int = 2
    threads: int = 8
    #: Model calls one process runs at once, on its event loop (no thread each: `worker/calls.py`);
    #: the model queue's prefetch. None: `calls.default_model_calls()`, from the memory available.
    model_calls: int | None = None
    max_query_chars: int = 32_000
    max_context_chars: int = 200_000
    #: Prompt variables (`inputs`), every name and value counted as text; files per request.
    max_inputs_chars: int = 32_000
    max_files: int = 32
    #: The gateway reads at most this much of a request body (counted as it arrives); more is a 413.
    max_body_bytes: int = 2 * 1024 * 1024
    #: Answers, tool arguments and tool results longer than this are stored truncated, with a marker.
    max_text_chars: int = 100_000
    #: Upper bound for an idle consumer's sleep between polls; a doorbell wakes it sooner.
    idle_poll_ms: int = 2_000
    #: The same for the queues only the workers' own scripts fill (the delay queues, every stage's
    #: but the first, the webhooks'): every enqueue onto them rings, so their poll only covers a ring
    #: lost with a connection.
    delay_poll_ms: int = 30_000
    #: A safety net: a turn's artifacts are deleted when it ends.
    artifact_ttl_s: int = 86_400
    #: How long an ended turn's record and events stay readable (and its id stays taken).
    turn_ttl_s: int = 6 * 3_600
    cancel_ttl_s: int = 86_400
    debounce_ms: int = 75
    invoke_lease_s: float = 30.0
    #: A turn that no live worker holds (its next stage's message waits in a queue, or was lost) and
    #: that made no progress for this long is enqueued again; a turn whose worker died is taken over
    #: after `worker_timeout_s` instead.
    stall_s: float = 60.0
    watchdog_s: float = 2.0
    #: Every worker process renews its heartbeat (and the list of turns it runs) this often ...
    heartbeat_s: float = 2.0
    #: ... and is dead once its heartbeat is this old: the watchdog takes over its turns and puts the
    #: messages it had fetched back on their queues.
    worker_timeout_s: float = 10.0
    #: On SIGTERM: model calls are handed to another worker at once; other stages get this long.
    shutdown_grace_s: float = 5.0
    #: Conversations idle (no turn admitted or ended) longer than this many days are deleted by the
    #: watchdog; 0 keeps them forever (and keeps no activity index).
    retention_days: float = 0.0
    #: Which file URLs of earlier turns the workers ask (HEAD) whether they are still there: `public`
    #: only hosts with global addresses (no SSRF into the workers' network), `all`, or `off`.
    file_check: Literal["public", "all", "off"] = "public"
    #: Completion webhooks (docs/webhooks.md): `public` POSTs only to hosts whose every address is a
    #: global one (the file checks' rule: no SSRF), `all` to any (tests, trusted deployments); attempts
    #: before a delivery fails, the backoff between them (doubled each time, capped), one POST's timeout.
    webhook_hosts: Literal["public", "all"] = "public"
    webhook_max_attempts: int = 8
    webhook_backoff_s: float = 5.0
    webhook_backoff_max_s: float = 600.0
    webhook_timeout_s: float = 10.0
    #: Times the watchdog runs a stalled turn again before it ends the turn `failed`.
    max_recoveries: int = 3
    max_invoke_attempts: int = 3
    #: dramatiq's retries of a message whose actor raised; then it is dead-lettered and its turn ends.
    max_retries: int = 5
    #: Configs may name `python:module:function` models and tools (tests, trusted deployments).
    allow_python_models: bool = False
    secrets: Mapping[str, str] = field(default_factory=dict, repr=False)
    #: The key variables configs may name and the URLs a conventional key may go to.
    policy: ModelPolicy = field(default_factory=ModelPolicy)
    #: `threadline worker` serves /metrics, /healthz and /livez on this port; 0: no endpoint. A port
    #: already taken (a second supervisor on the host) is one warning and no endpoint, never a crash.
    metrics_port: int = DEFAULT_METRICS_PORT
    #: OpenTelemetry spans per turn and stage, exported over OTLP (`workers/telemetry/tracing.py`).
    tracing: bool = False
    #: The event loops of a worker process and of the gateway (`loop()`): `uvloop` (libuv's loop: less
    #: CPU per Redis round trip and per model run, docs/capacity.md), `asyncio` (the standard one), or
    #: `auto`: uvloop where it is installed (a dependency, but for Windows).
    event_loop: Literal["auto", "uvloop", "asyncio"] = "auto"
    #: A gateway process's Redis connections for requests (a blocking pool: a request waits up to
    #: `gateway_pool_timeout_s` for one); `/healthz` has two of its own, every event stream shares one.
    gateway_pool: int = 32
    gateway_pool_timeout_s: float = 5.0
    #: Per API key, unless its record says otherwise (0: no limit): requests per second (a bucket of
    #: one second's worth), turns per minute (a minute's worth), event streams open at once.
    key_rps: int = 20
    key_turns_per_min: int = 60
    key_max_streams: int = 100
    #: Failed authentications one client address may make per minute; then 429 until it refills.
    auth_failures_per_min: int = 20

    def loop(self) -> Literal["uvloop", "asyncio"]:
        """The event loop `event_loop` names, `auto` resolved (`from_env` refused `uvloop` where it
        is not installed)."""
        if self.event_loop == "auto":
            return "uvloop" if _uvloop_installed() else "asyncio"
        return self.event_loop

    @property
    def broker_namespace(self) -> str:
        return f"{self.prefix}:q"

    @property
    def model_env(self) -> dict[str, str]:
        """The only variables model builders see: the allowed key variables and the region."""
        return self.policy.readable_env(self.secrets)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if env is None else env
        file_check = env.get("TL_FILE_CHECK") or "public"
        if file_check not in ("public", "all", "off"):
            raise ValueError(f"TL_FILE_CHECK must be public, all or off, not {file_check!r}")
        webhook_hosts = env.get("TL_WEBHOOK_HOSTS") or "public"
        if webhook_hosts not in ("public", "all"):
            raise ValueError(f"TL_WEBHOOK_HOSTS must be public or all, not {webhook_hosts!r}")
        log_format = env.get("TL_LOG_FORMAT") or ("console" if sys.stderr.isatty() else "json")
        if log_format not in ("json", "console"):
            raise ValueError(f"TL_LOG_FORMAT must be json or console, not {log_format!r}")
        event_loop = env.get("TL_EVENT_LOOP") or "auto"
        if event_loop not in ("auto", "uvloop", "asyncio"):
            raise ValueError(f"TL_EVENT_LOOP must be auto, uvloop or asyncio, not {event_loop!r}")
        if event_loop == "uvloop" and not _uvloop_installed():
            raise ValueError("TL_EVENT_LOOP is uvloop, but uvloop is not installed: pip install uvloop")
        log_level = (env.get("TL_LOG_LEVEL") or "INFO").upper()
        if log_level not in LOG_LEVELS:
            raise ValueError(f"TL_LOG_LEVEL must be one of {', '.join(LOG_LEVELS)}, not {env.get('TL_LOG_LEVEL')!r}")
        return cls(
            redis_url=env.get("REDIS_URL") or None,
            data_dir=Path(env.get("TL_DATA_DIR") or ".threadline").resolve(),
            prefix=env.get("TL_PREFIX") or "tl",
            shards=shards_from_env(env),
            log_format=log_format,  # type: ignore[arg-type]
            log_level=log_level,
            processes=_int(env, "TL_PROCESSES", 2, minimum=1),
            threads=_int(env, "TL_THREADS", 8, minimum=1),
            # TL_INVOKE_PREFETCH: its name before model calls left the threads
            model_calls=_int(env, "TL_MODEL_CALLS", _int(env, "TL_INVOKE_PREFETCH", 0)) or None,
            max_query_chars=_int(env, "TL_MAX_QUERY_CHARS", 32_000, minimum=1),
            max_context_chars=_int(env, "TL_MAX_CONTEXT_CHARS", 200_000, minimum=1),
            max_inputs_chars=_int(env, "TL_MAX_INPUTS_CHARS", 32_000, minimum=1),
            max_files=_int(env, "TL_MAX_FILES", 32, maximum=256),
            max_body_bytes=_int(env, "TL_MAX_BODY_BYTES", 2 * 1024 * 1024, minimum=1024),
            max_text_chars=_int(env, "TL_MAX_TEXT_CHARS", 100_000, minimum=1),
            idle_poll_ms=_int(env, "TL_IDLE_POLL_MS", 2_000, minimum=1),
            delay_poll_ms=_int(env, "TL_DELAY_POLL_MS", 30_000, minimum=1),
            artifact_ttl_s=_int(env, "TL_ARTIFACT_TTL_S", 86_400, minimum=1),
            turn_ttl_s=_int(env, "TL_TURN_TTL_S", 6 * 3_600, minimum=1),
            cancel_ttl_s=_int(env, "TL_CANCEL_TTL_S", 86_400, minimum=1),
            debounce_ms=_int(env, "TL_DEBOUNCE_MS", 75),
            invoke_lease_s=_float(env, "TL_INVOKE_LEASE_S", 30.0),
            stall_s=_float(env, "TL_STALL_S", 60.0),
            watchdog_s=_float(env, "TL_WATCHDOG_S", 2.0),
            heartbeat_s=_float(env, "TL_HEARTBEAT_S", 2.0),
            worker_timeout_s=_float(env, "TL_WORKER_TIMEOUT_S", 10.0),
            shutdown_grace_s=_float(env, "TL_SHUTDOWN_GRACE_S", 5.0),
            retention_days=max(0.0, _float(env, "TL_RETENTION_DAYS", 0.0, positive=False)),
            file_check=file_check,  # type: ignore[arg-type]
            webhook_hosts=webhook_hosts,  # type: ignore[arg-type]
            webhook_max_attempts=_int(env, "TL_WEBHOOK_MAX_ATTEMPTS", 8, minimum=1),
            webhook_backoff_s=_float(env, "TL_WEBHOOK_BACKOFF_S", 5.0),
            webhook_backoff_max_s=_float(env, "TL_WEBHOOK_BACKOFF_MAX_S", 600.0),
            webhook_timeout_s=_float(env, "TL_WEBHOOK_TIMEOUT_S", 10.0),
            max_recoveries=_int(env, "TL_MAX_RECOVERIES", 3),
            max_invoke_attempts=_int(env, "TL_MAX_INVOKE_ATTEMPTS", 3, minimum=1),
            max_retries=_int(env, "TL_MAX_RETRIES", 5),
            allow_python_models=env.get("TL_ALLOW_PYTHON_PLUGINS", "") in ("1", "true", "yes"),
            secrets=dict(env),
            policy=model_policy(env),
            metrics_port=_int(env, "TL_METRICS_PORT", DEFAULT_METRICS_PORT, maximum=65_535),
            tracing=env.get("TL_TRACING", "") in ("1", "true", "yes") or bool(env.get("OTEL_EXPORTER_OTLP_ENDPOINT")),
            event_loop=event_loop,  # type: ignore[arg-type]
            gateway_pool=_int(env, "TL_GATEWAY_POOL", 32, minimum=1),
            gateway_pool_timeout_s=_float(env, "TL_GATEWAY_POOL_TIMEOUT_S", 5.0),
            key_rps=_int(env, "TL_KEY_RPS", 20),
            key_turns_per_min=_int(env, "TL_KEY_TURNS_PER_MIN", 60),
            key_max_streams=_int(env, "TL_KEY_MAX_STREAMS", 100),
            auth_failures_per_min=_int(env, "TL_AUTH_FAILURES_PER_MIN", 20),
        )
