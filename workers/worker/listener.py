"""One pub/sub connection per worker process, shared by the doorbell and the cancel broadcast.

It costs Redis nothing while idle. When the connection drops (a Redis restart), every handler is
told so (`on_reconnect`), so that consumers fall back to polling until the subscription is back.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import redis
import structlog

from threadline.workers.storage.connect import sync_client

if TYPE_CHECKING:
    from threadline.workers.worker.reachability import Reachability

log = structlog.get_logger(__name__)
#: The longest wait before resubscribing: the doorbell and cancels should be back soon after Redis is.
MAX_BACKOFF_S = 5.0

Handler = Callable[[str], None]


class Listener:
    def __init__(self, url: str, *, reachability: Reachability | None = None) -> None:
        self._url = url
        self._reachability = reachability
        self._handlers: dict[str, list[Handler]] = {}
        self._reconnect_hooks: list[Callable[[], None]] = []
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()

    def on(self, channel: str, handler: Handler) -> None:
        self.on_each({channel: handler})

    def on_each(self, handlers: Mapping[str, Handler]) -> None:
        """Handle several channels (the doorbell's of every shard), subscribed to in one command: the
        listener confirms its subscription (`on_reconnect`) once for them, not once per channel."""
        with self._lock:
            for channel, handler in handlers.items():
                self._handlers.setdefault(channel, []).append(handler)
        self._ensure_started()

    def on_reconnect(self, hook: Callable[[], None]) -> None:
        with self._lock:
            self._reconnect_hooks.append(hook)

    def stop(self) -> None:
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout=3)

    def _ensure_started(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="threadline-listener", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        backoff = 0.1
        while not self._stopping.is_set():
            try:
                self._listen()
                backoff = 0.1
            except (redis.RedisError, OSError) as e:
                if self._reachability is not None:
                    backoff = min(self._reachability.failed("listener", e), MAX_BACKOFF_S)
                else:
                    log.warning("listener_disconnected", error=str(e), retry_in_s=backoff)
                self._notify_reconnect()
                self._stopping.wait(backoff)
                backoff = min(backoff * 2, MAX_BACKOFF_S)

    def _listen(self) -> None:
        client = sync_client(self._url, socket_connect_timeout=2)  # a cluster's: PUBLISH reaches every node
        pubsub = client.pubsub()  # type: ignore[no-untyped-call]
        subscribed: set[str] = set()
        try:
            while not self._stopping.is_set():
                with self._lock:
                    missing = [c for c in self._handlers if c not in subscribed]
                if missing:
                    pubsub.subscribe(*missing)
                    subscribed.update(missing)
                message = pubsub.get_message(timeout=1.0)
                if message is None:
                    continue
                if message["type"] == "subscribe" and message["data"] == len(subscribed):
                    # Confirmed: anything published from now on reaches us; ring everyone once so
                    # that what was enqueued while we were away is fetched now.
                    if self._reachability is not None:
                        self._reachability.ok("listener")
                    self._notify_reconnect()
                elif message["type"] == "message":
                    self._dispatch(message["channel"].decode(), message["data"].decode())
        finally:
            pubsub.close()
            client.close()

    def _dispatch(self, channel: str, data: str) -> None:
        with self._lock:
            handlers = list(self._handlers.get(channel, ()))
        for handler in handlers:
            try:
                handler(data)
            except Exception:
                log.exception("listener_handler_failed", channel=channel)

    def _notify_reconnect(self) -> None:
        with self._lock:
            hooks = list(self._reconnect_hooks)
        for hook in hooks:
            hook()


