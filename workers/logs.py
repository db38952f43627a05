"""structlog setup: JSON in production, console in development; dramatiq's stdlib logs go through
the same formatter. Context (turn_id, conversation_id, stage, attempt) is bound per message."""

from __future__ import annotations

import logging
import re
import sys
from collections.abc import MutableMapping
from typing import Any

import structlog

from .settings import Settings

_SECRET = re.compile(r"(?i)(api[_-]?key|authorization|password|secret|token)(['\"]?\s*[:=]\s*['\"]?)([^\s'\",}]+)")


def redact_secrets(_: Any, __: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """Logs never contain secrets: mask anything shaped like `api_key=...` in string values."""
    for key, value in event.items():
        if isinstance(value, str) and _SECRET.search(value):
            event[key] = _SECRET.sub(r"\1\2***", value)
    return event


def configure_logging(settings: Settings) -> None:
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        redact_secrets,
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
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=shared,
            processors=[
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                structlog.processors.format_exc_info if settings.log_format == "json" else _identity,
                renderer,
            ],
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(settings.log_level)
    for noisy in ("httpx", "httpcore", "openai"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def _identity(_: Any, __: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    return event
