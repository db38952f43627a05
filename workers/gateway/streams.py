"""Every event stream of a gateway process read by ONE task on ONE connection, fanned out to queues.

A stream is a subscriber: a queue and a position (the last entry id it was given). It first reads
its backlog after `after` itself, with non-blocking XREADs on the request pool, then joins the hub.
The hub's task loops on one `XREAD BLOCK ... STREAMS k1 k2 ... id1 id2 ...` over every open turn's
stream key, each from the lowest position among its subscribers, on a connection of its own; each
entry goes to every subscriber of its key whose position is before it (so a subscriber that joins
behind the others is caught up and nobody gets an entry twice), and a terminal event ends the
subscriber. A new subscriber wakes the hub (`CLIENT UNBLOCK` of the reader's connection) so its key
is read at once; the XREAD blocks at most `BLOCK_MS` anyway. Open streams thus cost the process one
Redis connection and memory, never a connection each: `/healthz` and other requests keep their pool.

The hub also renews the stream holds of `ratelimit.py` (an API key's cap of open streams) while
their streams are open; a gateway that dies lets them lapse (`storage/rate_limits.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis
import redis.asyncio as aioredis

from threadline.pipeline.events import TERMINAL_TYPES, Event
from threadline.workers.clients.common import stream_entries
from threadline.workers.gateway.pools import client_name
from threadline.workers.protocol.keys import Keys

log = logging.getLogger(__name__)

#: The longest a hub's XREAD blocks: the latest a subscriber's first live entry can come if the wake
#: did not reach the reader (it was between two reads).
BLOCK_MS = 200
#: After a read that found entries the next one waits until this long after it began: while some
#: streams are busy, one XREAD names every open key, so reading at every single entry would cost the
#: whole key list each time; entries that come meanwhile are read together (latency <= this).
COALESCE_S = 0.02
#: Entries one read takes per stream (a backlog, or one XREAD of the hub).
COUNT = 500
#: Holds (and nothing else) are renewed this often: a third of their lease.
RENEW_S = 10.0
#: After a Redis error the hub waits this long before it reads again (its subscribers just wait).
RETRY_S = 0.5


def entry_key(entry_id: str) -> tuple[int, int]:
    """A stream entry id as a sortable pair (`1718-3` → (1718, 3); `0` → (0, 0))."""
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


@dataclass(eq=False)
class Subscriber:
    """One open stream: what it was last given, and the queue its entries wait in."""

    key: str
    position: str
    hold: tuple[str, str] | None = None
    queue: asyncio.Queue[tuple[str, Event] | None] = field(default_factory=asyncio.Queue)

    def offer(self, entry_id: str, event: Event) -> bool:
        """Queue an entry after the position; True when it ended the stream."""
        if entry_key(entry_id) <= entry_key(self.position):
            return False
        self.position = entry_id
        self.queue.put_nowait((entry_id, event))
        if event.type in TERMINAL_TYPES:
            self.queue.put_nowait(None)
            return True
        return False


class StreamHub:
    """The process's multiplexer: `subscribe` yields a turn's entries after `after` until its end."""

    def __init__(self, url: str, turn_keys: Callable[[str], Awaitable[Keys | None]], requests: aioredis.Redis,
                 renew: Callable[[Sequence[tuple[str, str]]], Awaitable[None]] | None = None) -> None:
        """`turn_keys`: the keys of a turn's shard (`AsyncClient.turn_keys`; None: an unknown turn)."""
        self.url = url
        self.turn_keys = turn_keys
        self.requests = requests
        self._renew = renew
        self._subs: dict[str, set[Subscriber]] = {}
        self._joined = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._renewer: asyncio.Task[None] | None = None
        self._reader: aioredis.Redis | None = None
        self._reader_id: int | None = None
        self._blocked = False
        self._closed = False
        self._wakes: set[asyncio.Task[None]] = set()

    @property
    def open_streams(self) -> int:
        return sum(len(subs) for subs in self._subs.values())

    async def subscribe(self, turn_id: str, after: str = "0",
                        hold: tuple[str, str] | None = None) -> AsyncIterator[tuple[str, Event]]:
        """(entry id, event) of the turn after `after`, live, until the terminal one. `hold`: the
        (key id, token) of a stream hold to renew while the stream is open. An unknown turn (no shard
        pointer, sharded layout) has no events: the stream ends at once."""
        keys = await self.turn_keys(turn_id)
        if keys is None:
            return
        sub = Subscriber(keys.events(turn_id), after, hold)
        if not await self._backlog(sub):
            self._join(sub)
        try:
            while (item := await sub.queue.get()) is not None:
                yield item
        finally:
            self._leave(sub)

    async def _backlog(self, sub: Subscriber) -> bool:
        """Read what is there after the subscriber's position (non-blocking); True when it ended."""
        while True:
            found = stream_entries(await self.requests.xread({sub.key: sub.position}, count=COUNT))
            for entry_id, event in found:
                if sub.offer(entry_id, event):
                    return True
            if len(found) < COUNT:
                return False

    def _join(self, sub: Subscriber) -> None:
        self._subs.setdefault(sub.key, set()).add(sub)
        self._joined.set()
        self._start()
        if self._blocked and self._reader_id is not None:
            # wake the reader so this key is in its next XREAD (fire and forget: BLOCK_MS bounds it)
            task = asyncio.get_running_loop().create_task(self._wake(self._reader_id))
            self._wakes.add(task)  # held until done: the loop keeps only weak references to tasks
            task.add_done_callback(self._wakes.discard)

    def _leave(self, sub: Subscriber) -> None:
        subs = self._subs.get(sub.key)
        if subs is not None:
            subs.discard(sub)
            if not subs:
                del self._subs[sub.key]

    async def _wake(self, reader_id: int) -> None:
        with contextlib.suppress(redis.RedisError):
            await self.requests.client_unblock(reader_id)

    def _start(self) -> None:
        if self._closed:
            raise RuntimeError("the stream hub is closed")
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name="stream-hub")
        if self._renew is not None and (self._renewer is None or self._renewer.done()):
            self._renewer = asyncio.get_running_loop().create_task(self._renew_holds(), name="stream-holds")

    async def _run(self) -> None:
        while not self._closed:
            if not self._subs:
                self._joined.clear()
                await self._joined.wait()
                continue
            try:
                await self._read_once()
            except (redis.ConnectionError, redis.TimeoutError, OSError) as e:
                log.warning("stream hub: Redis read failed (%s); retrying", e)
                await self._drop_reader()
                await asyncio.sleep(RETRY_S)

    async def _read_once(self) -> None:
        reader = await self._connect()
        began = time.monotonic()
        streams = {key: min((s.position for s in subs), key=entry_key) for key, subs in self._subs.items()}
        self._blocked = True
        try:
            reply: Any = await reader.xread(streams, count=COUNT, block=BLOCK_MS)  # type: ignore[arg-type]
        finally:
            self._blocked = False
        for raw_key, entries in reply or []:
            self._fan_out(raw_key.decode() if isinstance(raw_key, bytes) else str(raw_key), entries)
        if reply and (pause := COALESCE_S - (time.monotonic() - began)) > 0:
            await asyncio.sleep(pause)

    def _fan_out(self, key: str, entries: Any) -> None:
        found = stream_entries([(key, entries)])
        for sub in list(self._subs.get(key, ())):
            for entry_id, event in found:
                if sub.offer(entry_id, event):
                    self._leave(sub)
                    break

    async def _connect(self) -> aioredis.Redis:
        """The reader's own connection (one, named `streams`), and its id for `CLIENT UNBLOCK`."""
        if self._reader is None:
            self._reader = aioredis.Redis.from_url(self.url, single_connection_client=True,
                                                   client_name=client_name("streams"), socket_connect_timeout=5)
            self._reader_id = int(await self._reader.client_id())
        return self._reader

    async def _drop_reader(self) -> None:
        reader, self._reader, self._reader_id = self._reader, None, None
        if reader is not None:
            with contextlib.suppress(Exception):
                await reader.aclose()

    async def _renew_holds(self) -> None:
        assert self._renew is not None
        while not self._closed:
            await asyncio.sleep(RENEW_S)
            holds = [s.hold for subs in self._subs.values() for s in subs if s.hold is not None]
            if holds:
                try:
                    await self._renew(holds)
                except (redis.RedisError, OSError) as e:
                    log.warning("stream hub: renewing %d stream holds failed (%s)", len(holds), e)

    async def close(self) -> None:
        """Stop the reader (at shutdown); open subscribers end."""
        self._closed = True
        self._joined.set()
        for task in (self._task, self._renewer):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        for subs in list(self._subs.values()):
            for sub in subs:
                sub.queue.put_nowait(None)
        self._subs.clear()
        await self._drop_reader()
