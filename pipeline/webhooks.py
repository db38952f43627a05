"""Completion webhooks, the pure part: which URLs a turn may name, the body POSTed when it ends, its
signature, and the schedule of attempts. The shell (`workers/worker/runners/webhook.py`) makes the
HTTP call, checks the host, and records every attempt (`workers/storage/webhooks.py`).

The scheme a receiver verifies (docs/webhooks.md): `Threadline-Signature: t=<unix seconds>,v1=<hex>`,
where `v1` is HMAC-SHA256 with the tenant's secret over `f"{t}.{body}"`; `Threadline-Delivery` is
the delivery's id, the same on every attempt (the turn id, as the tenant spells it): a receiver
de-duplicates on it.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from dataclasses import dataclass
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from .namespaces import tenant_tag

WEBHOOK_SCHEMA = "threadline.webhook/v1"
SIGNATURE_HEADER = "Threadline-Signature"
DELIVERY_HEADER = "Threadline-Delivery"
ATTEMPT_HEADER = "Threadline-Attempt"
#: The longest URL a turn, an agent config or an API key may name.
MAX_URL_CHARS = 2048
#: How much of a receiver's answer is kept with the attempt's record (never the whole body).
EXCERPT_CHARS = 200

DeliveryStatus = Literal["pending", "retrying", "delivered", "failed"]
#: `pending`/`retrying`: an attempt is queued; `delivered` and `failed` are final (until a manual retry).
FINAL: frozenset[DeliveryStatus] = frozenset({"delivered", "failed"})


def check_webhook_url(url: str) -> str:
    """`url` when a turn may name it as its webhook: `http(s)`, a host, no credentials, no spaces.
    Whether the host is a public one is decided when the workers connect (DNS may change: the
    check belongs to the call), under `TL_WEBHOOK_HOSTS`."""
    problem = webhook_url_problem(url)
    if problem is not None:
        raise ValueError(problem)
    return url


def webhook_url_problem(url: str) -> str | None:
    """What is wrong with a webhook URL, or None."""
    if len(url) > MAX_URL_CHARS:
        return f"a webhook URL has at most {MAX_URL_CHARS} characters"
    if any(c.isspace() or ord(c) < 32 for c in url):
        return "a webhook URL may not contain spaces or control characters"
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises on a port that is not a number
    except ValueError:
        return "the webhook URL cannot be parsed"
    if parts.scheme not in ("http", "https"):
        return "a webhook URL must start with http:// or https://"
    if not parts.hostname:
        return "a webhook URL must name a host"
    if parts.username is not None or parts.password is not None:
        return "a webhook URL may not carry credentials (the signature authenticates the sender)"
    return None


WebhookUrl = Annotated[str, Field(min_length=1, max_length=MAX_URL_CHARS), AfterValidator(check_webhook_url)]


def signature(secret: str, timestamp: int, body: bytes) -> str:
    """The `Threadline-Signature` header's value for `body` sent at `timestamp` (unix seconds)."""
    mac = hmac.new(secret.encode(), str(timestamp).encode() + b"." + body, hashlib.sha256).hexdigest()
    return f"t={timestamp},v1={mac}"


def delivery_body(*, delivery_id: str, turn_id: str, tenant_id: str, event_json: str) -> bytes:
    """The bytes POSTed: the same on every attempt of a delivery (the signature's timestamp changes).
    Ids are the tenant's own spelling, as the gateway shows them (`shown_id`)."""
    body = {"schema": WEBHOOK_SCHEMA, "delivery_id": delivery_id, "turn_id": turn_id, "tenant_id": tenant_id,
            "event": json.loads(event_json)}
    # the tag is "@" and hex digits: JSON text holds it exactly where its strings do
    return json.dumps(body, separators=(",", ":"), ensure_ascii=False).replace(tenant_tag(tenant_id), "").encode()


def shown_id(tenant_id: str, stored_id: str) -> str:
    """An id as its tenant knows it: without the tag of the tenant's namespace (`pipeline.namespaces`)."""
    return stored_id.replace(tenant_tag(tenant_id), "")


class DeliveryJob(BaseModel):
    """The one argument of a message on the webhook queue: which delivery, which attempt."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    delivery_id: Annotated[str, Field(min_length=1, max_length=128)]
    attempt: Annotated[int, Field(ge=1)]


@dataclass(frozen=True, slots=True)
class AttemptResult:
    """What one POST ended in: an HTTP status, or an error that kept it from an answer. `refused`: the
    URL's host is not allowed (`TL_WEBHOOK_HOSTS`), a permanent failure that no retry changes."""

    status_code: int | None = None
    error: str = ""
    excerpt: str = ""
    ms: float = 0.0
    refused: bool = False

    @property
    def ok(self) -> bool:
        return self.status_code is not None and 200 <= self.status_code < 300


@dataclass(frozen=True, slots=True)
class Verdict:
    """After an attempt: the delivery's status, and when the next attempt runs (seconds; None: none)."""

    status: DeliveryStatus
    retry_in_s: float | None = None


def backoff_s(attempt: int, *, base_s: float, max_s: float) -> float:
    """How long after failed attempt `attempt` (1, 2, …) the next one runs: `base_s` doubled each
    time, at most `max_s`."""
    return float(min(base_s * 2.0 ** (attempt - 1), max_s))


def after_attempt(result: AttemptResult, *, attempt: int, max_attempts: int, base_s: float, max_s: float) -> Verdict:
    """Delivered on a 2xx; else retried with backoff until `max_attempts` attempts were made."""
    if result.ok:
        return Verdict("delivered")
    if result.refused or attempt >= max_attempts:
        return Verdict("failed")
    return Verdict("retrying", backoff_s(attempt, base_s=base_s, max_s=max_s))


def excerpt(body: bytes, limit: int = EXCERPT_CHARS) -> str:
    """The start of a receiver's answer, as text, for the attempt's record."""
    return body[: limit * 4].decode("utf-8", "replace")[:limit]


def attempt_record(result: AttemptResult, *, attempt: int, at: float, verdict: Verdict) -> dict[str, Any]:
    """One attempt as `threadline webhooks list` shows it."""
    return {"attempt": attempt, "at": at, "status_code": result.status_code, "error": result.error,
            "excerpt": result.excerpt, "ms": round(result.ms, 1), "outcome": verdict.status}
