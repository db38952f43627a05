"""Cancellation in a worker process: the turns it runs, their tokens, and the two ways a cancel
reaches them — the pub/sub broadcast (fast) and a periodic look at the durable flags (fallback)."""

from __future__ import annotations

import threading
from collections import defaultdict

import redis
import structlog
from pydantic_ai import CancellationToken

from threadline.workers.protocol.keys import Keys
from threadline.workers.storage.connect import sync_client
from threadline.workers.worker.listener import Listener

log = structlog.get_logger(__name__)


class CancelRegistry:
    """Tokens of the turns running in this process. `CancellationToken.cancel` is thread-safe, so
    the listener thread can fire it straight into the run on the event loop."""

    def __init__(self) -> None:
        self._tokens: dict[str, set[CancellationToken]] = defaultdict(set)
        #: The shard of each turn (sharded layout; None in one server's), for its cancel flag's key.
        self._shards: dict[str, int | None] = {}
        self._lock = threading.Lock()

    def register(self, turn_id: str, shard: int | None = None) -> CancellationToken:
        token = CancellationToken()
        with self._lock:
            self._tokens[turn_id].add(token)
            self._shards[turn_id] = shard
        return token

    def unregister(self, turn_id: str, token: CancellationToken) -> None:
        with self._lock:
            tokens = self._tokens.get(turn_id)
            if tokens is not None:
                tokens.discard(token)
                if not tokens:
                    del self._tokens[turn_id]
                    self._shards.pop(turn_id, None)

    def running(self) -> list[str]:
        with self._lock:
            return list(self._tokens)

    def by_shard(self) -> dict[int | None, list[str]]:
        """The running turns, grouped by their shard."""
        grouped: dict[int | None, list[str]] = defaultdict(list)
        with self._lock:
            for turn_id in self._tokens:
                grouped[self._shards.get(turn_id)].append(turn_id)
        return grouped

    def cancel(self, turn_id: str) -> bool:
        with self._lock:
            tokens = list(self._tokens.get(turn_id, ()))
        for token in tokens:
            token.cancel()
        if tokens:
            log.info("cancel_delivered", turn_id=turn_id)
        return bool(tokens)


class CancelWatcher:
    """Wires a registry to the cancel channel, and polls the durable flags of running turns every
    `poll_s` as a fallback for a missed notification (no Redis calls while nothing runs)."""

    def __init__(self, registry: CancelRegistry, listener: Listener, url: str, keys: Keys, poll_s: float = 1.0):
        self.registry = registry
        self._keys = keys
        self._client = sync_client(url, socket_timeout=5)
        self._poll_s = poll_s
        self._stop = threading.Event()
        listener.on(keys.cancel_channel(), self._on_cancel)
        self._thread = threading.Thread(target=self._poll, name="threadline-cancel-poll", daemon=True)
        self._thread.start()

    def _on_cancel(self, turn_id: str) -> None:
        self.registry.cancel(turn_id)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._client.close()

    def _poll(self) -> None:
        while not self._stop.wait(self._poll_s):
            for shard, running in self.registry.by_shard().items():  # one MGET per shard: one slot each
                keys = self._keys.on(shard)
                try:
                    flags = self._client.mget([keys.cancel_flag(t) for t in running])
                except redis.RedisError as e:
                    log.warning("cancel_poll_failed", error=str(e))
                    break
                for turn_id, flag in zip(running, flags, strict=True):
                    if flag is not None:
                        self.registry.cancel(turn_id)
