"""structlog setup: JSON in production, console in development; dramatiq's stdlib logs go through
the same formatter. Context (turn_id, conversation_id, stage, attempt) is bound per message.

Two rules hold for every line written: no credential (`redact`), and no user text at INFO or above.
dramatiq renders a whole message, arguments included, into some of its lines ("Failed to process
message resolve({...query...}) with unhandled exception."); `ContentFreeMessages` rewrites those."""

from __future__ import annotations

import logging
import sys
import threading
import warnings
from collections.abc import Iterable, Mapping, MutableMapping
from typing import IO, Any

import dramatiq
import structlog

from threadline.pipeline.redact import MASK, MIN_SECRET_CHARS, is_secret_name, redact, redact_value
from threadline.workers.settings import Settings
from threadline.workers.telemetry.tracing import add_trace_ids

_ELIDED = "<message content elided>"
#: Argument strings shorter than this are not scrubbed out of tracebacks: ids and names, not text.
_MIN_SCRUBBED_CHARS = 8
_SCRUBBED = "threadline_scrubbed_exc_text"

#: Python warnings whose text names code, models and versions, never a value: logged with their text
#: at every level. Any other warning's text (pydantic's serializer names the value it could not
#: serialize, say) is logged at DEBUG only, like message content.
_CODE_WARNINGS: tuple[type[Warning], ...] = (DeprecationWarning, PendingDeprecationWarning, FutureWarning,
                                             ImportWarning)
_warnings_log = structlog.get_logger("py.warnings")

_secrets_lock = threading.Lock()
_secrets: tuple[str, ...] = ()


def add_secret(value: str) -> None:
    """Scrub `value` (an API key read from the environment, say) out of every log line from now on."""
    global _secrets
    with _secrets_lock:
        if len(value) >= MIN_SECRET_CHARS and value not in _secrets:
            _secrets = (*_secrets, value)


def redact_secrets(_: Any, __: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """Logs never contain secrets: credentials in string values (the formatted traceback included)
    are masked, and so is any value logged under a name like `api_key` or `token`."""
    secrets = _secrets
    for key, value in event.items():
        if isinstance(value, str):
            event[key] = MASK if is_secret_name(key) else redact(value, secrets)
        elif isinstance(value, dict | list | tuple):
            event[key] = redact_value(value, secrets)
        elif value is not None and not isinstance(value, bool) and is_secret_name(key):
            event[key] = MASK
    return event


class _Label(str):
    """Renders as itself under both `%s` and `%r`."""

    __slots__ = ()

    def __repr__(self) -> str:
        return str(self)


class ContentFreeMessages(logging.Filter):
    """At INFO and above, a dramatiq message in a record's arguments is rendered as
    `resolve(message_id='…')` instead of with its arguments, other containers dramatiq passes are
    elided, and the message's strings are scrubbed out of the record's traceback. DEBUG records
    are left as they are: that level is for looking at what the messages hold.

    Installed on the handler: a filter on the `dramatiq` logger would not see the records of its
    children (`dramatiq.worker.WorkerThread`, ...), which are the ones that render messages."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.INFO or not record.args:
            return True
        from_dramatiq = record.name == "dramatiq" or record.name.startswith("dramatiq.")
        if isinstance(record.args, Mapping):
            record.args = {k: _content_free(v, from_dramatiq) for k, v in record.args.items()}
            return True
        messages = [a for a in record.args if isinstance(a, dramatiq.Message | dramatiq.MessageProxy)]
        if messages or from_dramatiq:
            record.args = tuple(_content_free(a, from_dramatiq) for a in record.args)
        if messages and record.exc_info:
            scrubbed = _scrub(logging.Formatter().formatException(record.exc_info), _texts_of(messages))
            record.exc_text = scrubbed  # what stdlib formatters print instead of formatting exc_info
            record.__dict__[_SCRUBBED] = scrubbed  # what `_scrubbed_traceback` hands structlog
        return True


class QuietReconnects(logging.Filter):
    """Drops dramatiq's lines about a consumer that lost Redis (a `critical` per consumer per try,
    and its "Restarting consumer" line): `worker/reachability.py` tells that story once instead, and
    the consumers retry with backoff."""

    _PREFIXES = ("Consumer encountered a connection error", "Restarting consumer in")

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.name.startswith("dramatiq.worker.ConsumerThread")
                    and isinstance(record.msg, str) and record.msg.startswith(self._PREFIXES))


def _content_free(arg: object, from_dramatiq: bool) -> object:
    if isinstance(arg, dramatiq.Message | dramatiq.MessageProxy):
        return _Label(f"{arg.actor_name}(message_id={arg.message_id!r})")
    if from_dramatiq and isinstance(arg, tuple | list | dict):
        return _Label(f"<{len(arg)} items elided>")
    return arg


def _texts_of(messages: Iterable[dramatiq.Message[Any] | dramatiq.MessageProxy]) -> list[str]:
    """Every form in which a message's content can appear in a traceback, longest first."""
    texts: set[str] = set()
    for message in messages:
        texts.update((str(message), repr(message)))
        for leaf in _strings(message.args, message.kwargs):
            if len(leaf) >= _MIN_SCRUBBED_CHARS:
                texts.update((leaf, repr(leaf)[1:-1], leaf.encode("unicode_escape").decode()))
    return sorted(texts, key=len, reverse=True)


def _strings(*values: object) -> Iterable[str]:
    for value in values:
        if isinstance(value, str):
            yield value
        elif isinstance(value, Mapping):
            yield from _strings(*value.keys(), *value.values())
        elif isinstance(value, list | tuple):
            yield from _strings(*value)


def _scrub(text: str, texts: Iterable[str]) -> str:
    for t in texts:
        if t:
            text = text.replace(t, _ELIDED)
    return text


def _scrubbed_traceback(_: Any, __: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """Render the traceback `ContentFreeMessages` scrubbed rather than the live exception."""
    record = event.get("_record")
    scrubbed = record.__dict__.get(_SCRUBBED) if isinstance(record, logging.LogRecord) else None
    if scrubbed is not None:
        event.pop("exc_info", None)
        event["exception"] = scrubbed
    return event


def _log_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                 file: IO[str] | None = None, line: str | None = None) -> None:
    """`warnings.showwarning` while logging is configured: a warning is one log line like every
    other (JSON in production), not plain text in the middle of the stream. A model its provider
    deprecated (pydantic-ai's `DeprecatedModelWarning`, once per model per process) is
    `model_deprecated`; any other warning is `python_warning`."""
    source = f"{filename}:{lineno}"
    exceptions = sys.modules.get("pydantic_ai.exceptions")  # loaded wherever the warning can come from
    if exceptions is not None and issubclass(category, exceptions.DeprecatedModelWarning):
        _warnings_log.warning("model_deprecated", detail=str(message), source=source)
    elif issubclass(category, _CODE_WARNINGS):
        _warnings_log.warning("python_warning", category=category.__name__, detail=str(message), source=source)
    else:
        _warnings_log.warning("python_warning", category=category.__name__, source=source)
        _warnings_log.debug("python_warning_text", category=category.__name__, detail=str(message), source=source)


#: What the logging module looks up for every record that no line written here prints: the thread,
#: the process and the asyncio task (3.12+) it was logged from.
_LOOKUPS = ("logThreads", "logProcesses", "logMultiprocessing", "logAsyncioTasks")
_CALLER_LOOKUP = logging._srcfile


def record_lookups(on: bool) -> None:
    """Make records with (True: the logging module's defaults) or without the lookups no line
    prints: `_LOOKUPS`, and the caller's file and line (the logging HOWTO's "Optimization" section
    names these switches). `python -m bench.log_lines` measures what they cost a line."""
    for name in _LOOKUPS:
        setattr(logging, name, on)
    logging._srcfile = _CALLER_LOOKUP if on else None


def configure_logging(settings: Settings, *, stream: IO[str] | None = None) -> None:
    """Route structlog and stdlib logging (dramatiq's included) and Python warnings through one
    handler on `stream` (stderr by default) that redacts credentials and keeps message content out of
    INFO+ lines."""
    for name, value in settings.secrets.items():
        if is_secret_name(name):
            add_secret(value)
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        add_trace_ids,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer: Any = (
        structlog.processors.JSONRenderer()
        if settings.log_format == "json"
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )
    handler = logging.StreamHandler(sys.stderr if stream is None else stream)
    handler.addFilter(ContentFreeMessages())
    handler.addFilter(QuietReconnects())
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[*shared, _scrubbed_traceback],
            processors=[
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                # Tracebacks are formatted here, in both formats, so that they are redacted too, and
                # plainly: the console renderer's rich tracebacks would print every frame's locals.
                structlog.processors.format_exc_info,
                redact_secrets,
                renderer,
            ],
        )
    )
    warnings.showwarning = _log_warning
    record_lookups(False)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(settings.log_level)
    # a line per HTTP request at INFO; the provider SDKs and pydantic-ai moved to httpx2
    for noisy in ("httpx", "httpcore", "httpx2", "httpcore2", "openai"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
