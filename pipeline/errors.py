"""One root error with a stable code; permanent errors are never retried, transient ones are."""

from __future__ import annotations

from typing import Literal

ErrorCode = Literal[
    "invalid_request",
    "agent_not_found",
    "conversation_not_found",
    "forbidden",
    "context_too_large",
    "agent_session_configuration_changed",
    "snapshot_corrupt",
    "model_rate_limited",
    # The account's quota, credits or spend limit is exhausted (HTTP 402, OpenAI's `insufficient_quota`
    # 429): waiting will not help, so it is not retried; a fallback model (another account) is tried.
    "model_quota_exceeded",
    "model_unavailable",
    "model_bad_request",
    "model_error",
    # A model config's provider needs an extra the workers lack, or its key variable is unset: both
    # permanent, and both name what to install or set.
    "provider_not_installed",
    "model_key_missing",
    "internal_error",
    # A turn sent with `on_busy: reject` while a turn of its conversation runs or waits (pipeline/busy.py).
    "conversation_busy",
    # The codes of the two non-error endings: cancellation and the deadline are outcomes.
    "cancelled",
    "timed_out",
]

#: Codes worth another attempt: the same request may succeed later.
TRANSIENT_CODES: frozenset[str] = frozenset({"model_rate_limited", "model_unavailable"})


class ThreadlineError(Exception):
    """A failure that ends a turn with a terminal `failed` event carrying `code`."""

    code: ErrorCode = "internal_error"

    def __init__(self, message: str, *, code: ErrorCode | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code
        self.message = message

    @property
    def transient(self) -> bool:
        return self.code in TRANSIENT_CODES


class InvalidRequest(ThreadlineError):
    code: ErrorCode = "invalid_request"


class AgentNotFound(ThreadlineError):
    code: ErrorCode = "agent_not_found"


class ConversationNotFound(ThreadlineError):
    code: ErrorCode = "conversation_not_found"


class Forbidden(ThreadlineError):
    code: ErrorCode = "forbidden"


class ConversationBusy(ThreadlineError):
    code: ErrorCode = "conversation_busy"


class SessionConfigurationChanged(ThreadlineError):
    code: ErrorCode = "agent_session_configuration_changed"

    def __init__(self) -> None:
        super().__init__(
            "The agent configuration changed after this conversation started. "
            "Start a new conversation to continue."
        )


class ProviderNotInstalled(ThreadlineError):
    code: ErrorCode = "provider_not_installed"


class ModelKeyMissing(ThreadlineError):
    code: ErrorCode = "model_key_missing"


class SnapshotCorrupt(ThreadlineError):
    code: ErrorCode = "snapshot_corrupt"


class ContextTooLarge(ThreadlineError):
    """The fixed parts of a request (instructions, query, tools, the output reserve) exceed the
    model's context window: no history can make it fit."""

    code: ErrorCode = "context_too_large"
