"""A completion-webhook receiver on 127.0.0.1 for the webhook tests: it records every POST (headers,
body) and answers 500 to the first `fail_first` attempts of each delivery (by its
`Threadline-Delivery` id), then 200 — or 401 when a `verify` function is given and refuses the
signature. `delivered()` is what a receiver keeps after de-duplicating on the delivery id."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from typing import Self

from tests.support.local_http import LocalServer

Verify = Callable[[str, str, bytes], bool]


@dataclass(frozen=True, slots=True)
class Received:
    path: str
    headers: dict[str, str]
    body: bytes
    answered: int


class WebhookReceiver:
    def __init__(self, *, fail_first: int = 0, secret: Callable[[], str] | None = None,
                 verify: Verify | None = None) -> None:
        self.fail_first = fail_first
        self.secret = secret
        self.verify = verify
        self.received: list[Received] = []
        self._seen: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._server = LocalServer(self._handler(), name="webhook-receiver")

    @property
    def url(self) -> str:
        return f"{self._server.url}/hooks/threadline"

    def _answer(self, headers: dict[str, str], body: bytes) -> int:
        delivery = headers.get("threadline-delivery", "")
        with self._lock:
            self._seen[delivery] += 1
            if self._seen[delivery] <= self.fail_first:
                return 500
        signed = headers.get("threadline-signature", "")
        if self.verify is not None and self.secret is not None and not self.verify(self.secret(), signed, body):
            return 401
        return 200

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # http.server's name for it
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                headers = {k.lower(): v for k, v in self.headers.items()}
                status = receiver._answer(headers, body)
                with receiver._lock:
                    receiver.received.append(Received(self.path, headers, body, status))
                self.send_response(status)
                self.send_header("Content-Type", "text/plain")
                self.end_headers()
                self.wfile.write(b"ok" if status == 200 else b"try again later " + b"x" * 1000)

            def log_message(self, *args: object) -> None:
                pass

        return Handler

    def delivered(self) -> list[str]:
        """The delivery ids this receiver accepted, each once (after de-duplication)."""
        with self._lock:
            return list(dict.fromkeys(r.headers.get("threadline-delivery", "") for r in self.received
                                      if r.answered == 200))

    def attempts(self, delivery_id: str) -> list[Received]:
        with self._lock:
            return [r for r in self.received if r.headers.get("threadline-delivery") == delivery_id]

    def start(self) -> Self:
        self._server.start()
        return self

    def stop(self) -> None:
        self._server.stop()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
