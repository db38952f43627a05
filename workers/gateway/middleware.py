"""The gateway's front door, as ASGI middleware (outermost first): one access-log line per request,
the browser-hardening headers on every answer, and the body limit; and the `{"code", "message"}`
envelope every failure is answered in — parse, route, method, size and validation errors included.

The body limit counts bytes as they arrive and answers 413 `payload_too_large` as soon as they pass
`TL_MAX_BODY_BYTES` (a `Content-Length` over it is refused before a byte is read): nothing past the
limit is ever held. A body within it whose JSON nests deeper than `MAX_JSON_DEPTH` is refused (422)
before any parser sees it. No error message echoes input that cannot be encoded (a lone surrogate is
written as its escape).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from typing import Any

import anyio
import structlog
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.datastructures import Headers, MutableHeaders
from starlette.exceptions import HTTPException
from starlette.routing import Mount

from threadline.pipeline.contracts import MAX_JSON_DEPTH, json_too_deep
from threadline.workers.storage.api_keys import ApiKey, key_digest

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

log = structlog.get_logger("threadline.gateway.access")

#: Every answer: no script, style, frame or connection but the gateway's own (the console's files
#: are separate files: no inline script or style), never framed, no referrer sent on.
BROWSER_HEADERS: tuple[tuple[str, str], ...] = (
    ("content-security-policy", "default-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'"),
    ("x-content-type-options", "nosniff"),
    ("x-frame-options", "DENY"),
    ("referrer-policy", "no-referrer"),
)
#: Bodies bigger than this are checked for depth off the event loop.
_THREAD_AT = 256 * 1024
#: Reasons for a status the envelope names when Starlette raises it.
_CODES = {400: "invalid_request", 404: "not_found", 405: "method_not_allowed", 413: "payload_too_large",
          422: "invalid_request", 429: "rate_limited"}


def printable(value: Any) -> Any:
    """`value` (JSON-like) with every string encodable as UTF-8: a lone surrogate becomes its escape."""
    if isinstance(value, str):
        return value.encode("utf-8", "backslashreplace").decode("utf-8")
    if isinstance(value, Mapping):
        return {printable(k): printable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [printable(v) for v in value]
    return value


def envelope(status: int, code: str, message: str, *, headers: Mapping[str, str] | None = None,
             **extra: Any) -> JSONResponse:
    """The one shape of every failure: `{"code", "message", ...}`."""
    return JSONResponse(printable({"code": code, "message": message, **extra}), status_code=status,
                        headers=dict(headers or {}))


def validation_detail(errors: Any) -> list[dict[str, Any]]:
    """A validation error's items without the input they refused (it may be huge or unencodable)."""
    return [printable({"loc": list(e.get("loc", ())), "msg": str(e.get("msg", "")), "type": str(e.get("type", ""))})
            for e in errors]


def install_envelopes(app: FastAPI) -> None:
    """Starlette's own errors (unrouted path, method, body it cannot parse) and any unhandled one in
    the envelope; an unhandled error's message is never shown (its traceback goes to the log)."""

    async def http_error(_: Request, e: Exception) -> JSONResponse:
        assert isinstance(e, HTTPException)
        code = _CODES.get(e.status_code, "invalid_request" if e.status_code < 500 else "internal_error")
        message = e.detail if isinstance(e.detail, str) else "the request was refused"
        if e.status_code == 404:
            message = "not found"
        return envelope(e.status_code, code, message, headers=e.headers)

    async def internal(_: Request, e: Exception) -> JSONResponse:
        return envelope(500, "internal_error", "internal error", headers=dict(BROWSER_HEADERS))

    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(Exception, internal)


def remember(request: Request, key: ApiKey) -> ApiKey:
    """Note the caller's key for the access log (never the key itself: its id and tenant)."""
    request.state.api_key = key
    return key


class BodyLimit:
    """Reads the body (never more than `max_bytes`), refuses it whole or passes it on as it came."""

    def __init__(self, app: App, *, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_bytes:
            await self._too_large(scope, receive, send)
            return
        body, first = await self._read(receive)
        if body is None:
            await self._too_large(scope, receive, send)
            return
        if body and await self._too_deep(body):
            await envelope(422, "invalid_request", f"the request body nests deeper than {MAX_JSON_DEPTH} levels")(
                scope, receive, send)
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return first if first["type"] == "http.disconnect" else {"type": "http.request", "body": body,
                                                                        "more_body": False}

        await self.app(scope, replay, send)

    async def _read(self, receive: Receive) -> tuple[bytes | None, Message]:
        """The body (None: past the limit, where reading stopped) and the last message read."""
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return b"".join(chunks), message
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                return None, message
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks), message

    async def _too_deep(self, body: bytes) -> bool:
        if len(body) < _THREAD_AT:
            return json_too_deep(body)
        return await anyio.to_thread.run_sync(json_too_deep, body)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = envelope(413, "payload_too_large", f"the request body is larger than {self.max_bytes} bytes",
                            headers={"connection": "close"})
        await response(scope, receive, send)


class BrowserHeaders:
    """The hardening headers on every answer; `Cache-Control: no-store` on all but the console's files."""

    def __init__(self, app: App) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                for name, value in BROWSER_HEADERS:
                    headers.setdefault(name, value)
                if not isinstance(scope.get("route"), Mount):
                    headers["cache-control"] = "no-store"
            await send(message)

        await self.app(scope, receive, with_headers)


class AccessLog:
    """One INFO line per request, when its answer has been sent: the key's id (or its digest's first 8
    hex digits when no key record was found), the tenant, method, route template (never the raw
    path), status, bytes sent and duration. Never a body, a query string or a key."""

    def __init__(self, app: App) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        scope.setdefault("state", {})
        started, seen = time.perf_counter(), {"status": 500, "bytes": 0}

        async def counted(message: Message) -> None:
            if message["type"] == "http.response.start":
                seen["status"] = message["status"]
            elif message["type"] == "http.response.body":
                seen["bytes"] += len(message.get("body", b""))
            await send(message)

        try:
            await self.app(scope, receive, counted)
        finally:
            key, tenant = _caller(scope)
            log.info("request", key=key, tenant=tenant, method=scope.get("method"), route=_route(scope),
                     status=seen["status"], bytes=seen["bytes"],
                     duration_ms=round((time.perf_counter() - started) * 1000, 2))


def _caller(scope: Scope) -> tuple[str | None, str | None]:
    key = scope.get("state", {}).get("api_key")
    if isinstance(key, ApiKey) and key.id:
        return key.id, key.tenant_id
    scheme, _, token = Headers(scope=scope).get("authorization", "").partition(" ")
    digest = key_digest(token.strip())[:8] if scheme.lower() == "bearer" and token.strip() else None
    return digest, key.tenant_id if isinstance(key, ApiKey) else None


def _route(scope: Scope) -> str:
    route = scope.get("route")
    if isinstance(route, Mount):
        return f"{route.path}/{{path}}"
    path = getattr(route, "path", None)
    return path if isinstance(path, str) else "-"
