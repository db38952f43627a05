"""The answers of the gateway's front door — authentication, user scope, rate limits, key
management — as `{"code", "message"}` bodies with the headers they need (`Retry-After` on a 429)."""

from __future__ import annotations

import math
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse


class Refused(Exception):
    """A refusal: the status, a stable `code`, a message, and headers."""

    def __init__(self, status: int, code: str, message: str, *, headers: dict[str, str] | None = None,
                 **extra: Any) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message
        self.headers, self.extra = headers or {}, extra


def unauthorized(message: str) -> Refused:
    return Refused(401, "unauthorized", message, headers={"WWW-Authenticate": "Bearer"})


def forbidden(message: str) -> Refused:
    return Refused(403, "forbidden", message)


def not_found(what: str) -> Refused:
    """The same body as the gateway's other 404s: another user's turn reads like a missing one."""
    return Refused(404, "not_found", f"{what} not found")


def rate_limited(message: str, retry_after_ms: int) -> Refused:
    """429 `rate_limited`; `Retry-After` in whole seconds (at least 1), `retry_after_ms` in the body."""
    seconds = max(1, math.ceil(retry_after_ms / 1000))
    return Refused(429, "rate_limited", message, headers={"Retry-After": str(seconds)},
                   retry_after_ms=retry_after_ms)


def install_refusals(app: FastAPI) -> None:
    async def refused(_: Request, e: Exception) -> JSONResponse:
        assert isinstance(e, Refused)
        return JSONResponse({"code": e.code, "message": e.message, **e.extra}, status_code=e.status,
                            headers=e.headers)

    app.add_exception_handler(Refused, refused)
