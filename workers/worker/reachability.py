"""Whether this worker process reaches Redis, told once for all the sources that talk to it (each
consumer, the pub/sub listener, the watchdog, the heartbeat), with one backoff per source."""

from __future__ import annotations

import threading
import time

import structlog

from threadline.pipeline.redact import redact

log = structlog.get_logger(__name__)

#: A failing source's first retry comes after this long, each next one after twice as long, up to the cap.
RETRY_MIN_S = 0.5
RETRY_MAX_S = 30.0
#: While Redis stays unreachable, one reminder line this often.
REMIND_S = 60.0


class Reachability:
    """Whether this process reaches Redis, told once: the first failure is one error line
    (`redis_unreachable`, with the URL, its password masked), a long outage a reminder every
    `REMIND_S`, the return one info line (`redis_reachable`). Every source that talks to Redis on
    its own (each consumer, the listener, the watchdog, the heartbeat) reports here and waits the
    delay it is given (exponential per source, capped at `RETRY_MAX_S`) before it tries again."""

    def __init__(self, url: str) -> None:
        self.url = redact(url)
        self._lock = threading.Lock()
        self._failures: dict[str, int] = {}
        self._down_since: float | None = None
        self._reminded = 0.0

    @property
    def up(self) -> bool:
        with self._lock:
            return self._down_since is None

    def failed(self, source: str, error: BaseException) -> float:
        """`source` could not reach Redis: how long it should wait before its next try."""
        now = time.monotonic()
        with self._lock:
            failures = self._failures[source] = self._failures.get(source, 0) + 1
            first = self._down_since is None
            remind = not first and now - self._reminded >= REMIND_S
            if first:
                self._down_since = now
            if first or remind:
                self._reminded = now
            down_s = now - (self._down_since or now)
        delay = min(RETRY_MIN_S * 2.0 ** (failures - 1), RETRY_MAX_S)
        if first:
            log.error("redis_unreachable", url=self.url, error=f"{type(error).__name__}: {error}", source=source,
                      retry_in_s=delay)
        elif remind:
            log.warning("redis_still_unreachable", url=self.url, down_s=round(down_s, 1), retry_in_s=delay)
        return delay

    def retry_in(self, source: str) -> float:
        """How long `source` waits before its next try (0 when its last one went through)."""
        with self._lock:
            failures = self._failures.get(source, 0)
        return min(RETRY_MIN_S * 2.0 ** (failures - 1), RETRY_MAX_S) if failures else 0.0

    def ok(self, source: str) -> None:
        """`source` reached Redis."""
        with self._lock:
            if not self._failures and self._down_since is None:
                return
            self._failures.pop(source, None)
            down_since, self._down_since = self._down_since, None
        if down_since is not None:
            log.info("redis_reachable", url=self.url, down_s=round(time.monotonic() - down_since, 1), source=source)
