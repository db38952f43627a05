"""The webhook actor's runner: `deliver_webhook({"delivery_id", "attempt"})` POSTs a turn's terminal
event to the URL its delivery names, signed, and records the attempt (the next one queued with
backoff when it failed). It runs on its own queue, after the turn ended: it never holds up or fails
a turn. The HTTP call has a timeout (`TL_WEBHOOK_TIMEOUT_S`), follows no redirect, and keeps only
an excerpt of the answer; hosts are the file checks' public ones unless `TL_WEBHOOK_HOSTS=all`."""

from __future__ import annotations

import time
from typing import Any

import dramatiq
import httpx
import structlog
from dramatiq.middleware import CurrentMessage
from pydantic import ValidationError

from threadline.pipeline import webhooks
from threadline.pipeline.redact import redact
from threadline.pipeline.webhooks import AttemptResult, DeliveryJob
from threadline.workers.protocol.names import WEBHOOK_ACTOR, WEBHOOK_QUEUE
from threadline.workers.storage.webhooks import Delivery
from threadline.workers.worker.files import public_host
from threadline.workers.worker.runtime import Runtime

log = structlog.get_logger(__name__)


async def run_webhook(rt: Runtime, arg: object) -> None:
    job = await _job(rt, arg)
    if job is None:
        return
    structlog.contextvars.bind_contextvars(delivery_id=job.delivery_id, attempt=job.attempt)
    d = await rt.store.delivery(job.delivery_id)
    if d is None or d.attempts != job.attempt - 1:
        log.info("webhook_skipped", reason="gone" if d is None else "superseded")
        return
    secret = await rt.store.webhook_secret(d.tenant_id)
    result = await post(rt, d, secret, attempt=job.attempt)
    s = rt.settings
    verdict = webhooks.after_attempt(result, attempt=job.attempt, max_attempts=d.max_attempts,
                                     base_s=s.webhook_backoff_s, max_s=s.webhook_backoff_max_s)
    record = webhooks.attempt_record(result, attempt=job.attempt, at=rt.now(), verdict=verdict)
    write = await rt.store.record_webhook_attempt(job, status=verdict.status, record=record,
                                                  retry_in_s=verdict.retry_in_s, now=rt.now())
    log.info("webhook_attempt", status=verdict.status, status_code=result.status_code, error=result.error,
             retry_in_s=verdict.retry_in_s, write=write)


async def post(rt: Runtime, d: Delivery, secret: str, *, attempt: int) -> AttemptResult:
    """One signed POST of the delivery's body; never raises for what the receiver or network did."""
    if rt.settings.webhook_hosts == "public" and not await public_host(d.url):
        return AttemptResult(error="host_refused: the URL's host is not a public one (TL_WEBHOOK_HOSTS)",
                             refused=True)
    body = webhooks.delivery_body(delivery_id=d.id, turn_id=d.turn_id, tenant_id=d.tenant_id, event_json=d.event)
    headers = {"Content-Type": "application/json", "User-Agent": "threadline-webhooks/1",
               webhooks.SIGNATURE_HEADER: webhooks.signature(secret, int(rt.now()), body),
               webhooks.DELIVERY_HEADER: webhooks.shown_id(d.tenant_id, d.id), webhooks.ATTEMPT_HEADER: str(attempt)}
    t0 = time.perf_counter()
    try:
        async with (httpx.AsyncClient(timeout=rt.settings.webhook_timeout_s, follow_redirects=False) as http,
                    http.stream("POST", d.url, content=body, headers=headers) as response):
            head = await _head_of(response)
    except httpx.HTTPError as e:
        return AttemptResult(error=redact(f"{type(e).__name__}: {e}")[:200], ms=_ms(t0))
    return AttemptResult(status_code=response.status_code, excerpt=webhooks.excerpt(head), ms=_ms(t0))


async def _head_of(response: httpx.Response) -> bytes:
    """The first bytes of the answer: the rest is never read."""
    head = b""
    async for chunk in response.aiter_bytes():
        head += chunk
        if len(head) >= webhooks.EXCERPT_CHARS * 4:
            break
    return head


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1000


async def _job(rt: Runtime, arg: object) -> DeliveryJob | None:
    """The message's job; a malformed one is dead-lettered at once, not retried."""
    try:
        return DeliveryJob.model_validate(arg)
    except ValidationError:
        message: dramatiq.Message[Any] | None = CurrentMessage.get_current_message()
        await rt.store.dead_letter(WEBHOOK_QUEUE, message.message_id if message else "", WEBHOOK_ACTOR,
                                   "invalid_webhook_job")
        log.warning("message_refused", reason="invalid_webhook_job")
        return None
