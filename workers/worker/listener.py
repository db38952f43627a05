"""The pub/sub connection of a worker process, shared by the doorbell and the cancel broadcast.

It costs Redis nothing while idle. When the connection drops (a Redis restart), every handler is
told so (`on_reconnect`), so that consumers fall back to polling until the subscription is back.

A channel named with a hash tag (a shard's doorbell, in the sharded layout) is a shard channel,
subscribed with `SSUBSCRIBE`; the others (the cancel broadcast) with `SUBSCRIBE`. On a Redis Cluster
a shard channel is heard on the node serving its slot only: the listener then holds one connection
per node that serves some of its channels, each read by a thread of its own, and when one fails (a
failover, or the cluster moving a slot: `sunsubscribe`) it finds the nodes again and subscribes anew.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import redis
import structlog

from threadline.workers.protocol.schema import text
from threadline.workers.storage.connect import is_cluster, nodes_serving

if TYPE_CHECKING:
    from threadline.workers.worker.reachability import Reachability

log = structlog.get_logger(__name__)
#: The longest wait before resubscribing: the doorbell and cancels should be back soon after Redis is.
MAX_BACKOFF_S = 5.0
#: How long one read waits for a message before it looks for new channels or a stop: how long a
#: broker's close waits on its listener, and a channel added later waits to be subscribed. A read that
#: times out sends nothing to the server (idle load stayed 6.0 commands/s at 1.0 s and at 0.2 s).
READ_TIMEOUT_S = 0.2

Handler = Callable[[str], None]


def shard_channel(channel: str) -> bool:
    return "{" in channel


class Listener:
    def __init__(self, url: str, *, reachability: Reachability | None = None) -> None:
        self._url = url
        self._cluster = is_cluster(url)
        self._reachability = reachability
        self._handlers: dict[str, list[Handler]] = {}
        #: Bumped when channels are added: a cluster's connections are regrouped for them.
        self._generation = 0
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
            self._generation += 1
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

    def _channels(self) -> list[str]:
        with self._lock:
            return list(self._handlers)

    def _listen(self) -> None:
        """One server: one connection, which subscribes to new channels as they come. A cluster: one
        reader per node serving some channel, until one fails or channels are added (then regrouped)."""
        if not self._cluster:
            self._read(self._url, self._channels, threading.Event())
            return
        with self._lock:
            generation = self._generation
        groups = nodes_serving(self._url, self._channels())
        stop = threading.Event()
        failed: list[BaseException] = []

        def read(url: str, channels: list[str]) -> None:
            try:
                self._read(url, lambda: channels, stop)
            except BaseException as e:  # handed to the listening thread, which reconnects
                failed.append(e)
            finally:
                stop.set()

        readers = [threading.Thread(target=read, args=(url, channels), name=f"threadline-listener:{url}", daemon=True)
                   for url, channels in groups.items()]
        for reader in readers:
            reader.start()
        try:
            while not (stop.is_set() or self._stopping.is_set()) and self._generation == generation:
                stop.wait(0.2)
        finally:
            stop.set()
            for reader in readers:
                reader.join(timeout=READ_TIMEOUT_S * 3)
        if failed:
            raise failed[0]

    def _read(self, url: str, channels: Callable[[], list[str]], stop: threading.Event) -> None:
        """Subscribe one connection (a server's, or a cluster node's) to `channels()` and dispatch what
        it hears until `stop` (or the listener stops)."""
        client = redis.Redis.from_url(url, socket_connect_timeout=2)
        pubsub: Any = client.pubsub()  # type: ignore[no-untyped-call, unused-ignore]  # untyped before redis 8.2
        subscribed: set[str] = set()
        confirmations = 0
        try:
            while not (stop.is_set() or self._stopping.is_set()):
                missing = [c for c in channels() if c not in subscribed]
                if missing:
                    if plain := [c for c in missing if not shard_channel(c)]:
                        pubsub.subscribe(*plain)
                    for channel in (c for c in missing if shard_channel(c)):
                        pubsub.ssubscribe(channel)  # one slot per SSUBSCRIBE
                    subscribed.update(missing)
                message = pubsub.get_message(timeout=READ_TIMEOUT_S)
                if message is None:
                    continue
                kind = text(message["type"])
                if kind in ("subscribe", "ssubscribe"):
                    # one confirmation per channel; all confirmed: anything published from now on
                    # reaches us, so ring everyone once to fetch what was enqueued while we were away
                    confirmations += 1
                    if confirmations == len(subscribed):
                        if self._reachability is not None:
                            self._reachability.ok("listener")
                        self._notify_reconnect()
                elif kind in ("message", "smessage"):
                    self._dispatch(text(message["channel"]), text(message["data"]))
                elif kind == "sunsubscribe":  # the cluster moved the channel's slot to another node
                    raise redis.ConnectionError(f"shard channel {text(message['channel'])} moved")
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
