"""Every event stream of a gateway process read by ONE task on ONE connection, fanned out to queues.

A stream is a subscriber: a queue and a position (the last entry id it was given). It first reads
its backlog after `after` itself, with non-blocking XRANGEs on the request pool, then joins the hub.
The hub's task loops on one `XREAD BLOCK ... STREAMS k1 k2 ... id1 id2 ...` over every open turn's
stream key, each from the lowest position among its subscribers, on a connection of its own; each
entry goes to every subscriber of its key whose position is before it (so a subscriber that joins
behind the others is caught up and nobody gets an entry twice), and a terminal event ends the
subscriber. A new subscriber wakes the hub (`CLIENT UNBLOCK` of the reader's connection) so its key
is read at once; the XREAD blocks at most `BLOCK_MS` anyway. Open streams thus cost the process one
Redis connection and memory, never a connection each: `/healthz` and other requests keep their pool.

On a Redis Cluster one XREAD cannot name keys of two slots: the hub has a reader (a `Lane`) per slot
with open streams, each on a connection to the node serving it, found again after a failover. In the
sharded layout a turn's events are in its shard's slot, so that is one connection per shard with
open streams (`TL_SHARDS` at most).

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
from typing import Any, cast

import redis
import redis.asyncio as aioredis

from threadline.pipeline.events import TERMINAL_TYPES, Event
from threadline.workers.clients.common import stream_entries
from threadline.workers.gateway.pools import client_name
from threadline.workers.protocol.keys import Keys
from threadline.workers.storage.connect import is_cluster, node_url

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


@dataclass(eq=False)
class Lane:
    """The open streams one reader reads with one XREAD on one connection: every stream of the
    process on one server; on a Redis Cluster, those of one slot (a command's keys share a slot),
    which in the sharded layout are one shard's."""

    slot: int | None
    subs: dict[str, set[Subscriber]] = field(default_factory=dict)
    joined: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None
    reader: aioredis.Redis | None = None
    reader_id: int | None = None
    #: The cluster node the reader is connected to (None: one server).
    node: Any = None
    blocked: bool = False


class StreamHub:
    """The process's multiplexer: `subscribe` yields a turn's entries after `after` until its end."""

    def __init__(self, url: str, turn_keys: Callable[[str], Awaitable[Keys | None]], requests: aioredis.Redis,
                 renew: Callable[[Sequence[tuple[str, str]]], Awaitable[None]] | None = None) -> None:
        """`turn_keys`: the keys of a turn's shard (`AsyncClient.turn_keys`; None: an unknown turn).
        `requests`: the request pool's client (a `RedisCluster` when `url` names a cluster)."""
        self.url = url
        self.cluster = is_cluster(url)
        self.turn_keys = turn_keys
        self.requests = requests
        self._renew = renew
        self._lanes: dict[int | None, Lane] = {}
        self._renewer: asyncio.Task[None] | None = None
        self._closed = False
        self._wakes: set[asyncio.Task[None]] = set()

    @property
    def open_streams(self) -> int:
        return sum(len(subs) for lane in self._lanes.values() for subs in lane.subs.values())

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
        """Read what is there after the subscriber's position (non-blocking); True when it ended. An
        `XRANGE` from just after it: a cluster client routes it by its key, where an `XREAD` would
        first ask a node for its keys (`COMMAND GETKEYS`), on one connection shared by every request."""
        while True:
            entries = await self.requests.xrange(sub.key, min=f"({sub.position}", count=COUNT)
            found = stream_entries([(sub.key, entries)])
            for entry_id, event in found:
                if sub.offer(entry_id, event):
                    return True
            if len(found) < COUNT:
                return False

    def _lane(self, key: str) -> Lane:
        slot = cast(Any, self.requests).keyslot(key) if self.cluster else None
        lane = self._lanes.get(slot)
        if lane is None:
            lane = self._lanes[slot] = Lane(slot)
        return lane

    def _join(self, sub: Subscriber) -> None:
        lane = self._lane(sub.key)
        lane.subs.setdefault(sub.key, set()).add(sub)
        lane.joined.set()
        self._start(lane)
        if lane.blocked and lane.reader_id is not None:
            # wake the reader so this key is in its next XREAD (fire and forget: BLOCK_MS bounds it)
            task = asyncio.get_running_loop().create_task(self._wake(lane))
            self._wakes.add(task)  # held until done: the loop keeps only weak references to tasks
            task.add_done_callback(self._wakes.discard)

    def _leave(self, sub: Subscriber) -> None:
        lane = self._lane(sub.key)
        subs = lane.subs.get(sub.key)
        if subs is not None:
            subs.discard(sub)
            if not subs:
                del lane.subs[sub.key]

    async def _wake(self, lane: Lane) -> None:
        with contextlib.suppress(redis.RedisError):
            if lane.node is None:
                await self.requests.client_unblock(cast(int, lane.reader_id))
            else:  # the reader's own node
                await cast(Any, self.requests).execute_command("CLIENT UNBLOCK", lane.reader_id, target_nodes=lane.node)

    def _start(self, lane: Lane) -> None:
        if self._closed:
            raise RuntimeError("the stream hub is closed")
        if lane.task is None or lane.task.done():
            lane.task = asyncio.get_running_loop().create_task(self._run(lane), name=f"stream-hub:{lane.slot}")
        if self._renew is not None and (self._renewer is None or self._renewer.done()):
            self._renewer = asyncio.get_running_loop().create_task(self._renew_holds(), name="stream-holds")

    async def _run(self, lane: Lane) -> None:
        while not self._closed:
            if not lane.subs:
                lane.joined.clear()
                await lane.joined.wait()
                continue
            try:
                await self._read_once(lane)
            except (redis.ConnectionError, redis.TimeoutError, OSError) as e:
                log.warning("stream hub: Redis read failed (%s); retrying", e)
                await self._retry(lane)
            except redis.ResponseError as e:
                if not self.cluster:
                    raise
                # MOVED / CLUSTERDOWN: the slot's node changed (a failover); find it again
                log.warning("stream hub: the cluster moved slot %s (%s); retrying", lane.slot, e)
                await self._retry(lane)

    async def _retry(self, lane: Lane) -> None:
        await self._drop_reader(lane)
        await asyncio.sleep(RETRY_S)
        if self.cluster:
            with contextlib.suppress(redis.RedisError, OSError):
                await cast(Any, self.requests).nodes_manager.initialize()

    async def _read_once(self, lane: Lane) -> None:
        reader = await self._connect(lane)
        began = time.monotonic()
        streams = {key: min((s.position for s in subs), key=entry_key) for key, subs in lane.subs.items()}
        lane.blocked = True
        try:
            reply: Any = await reader.xread(streams, count=COUNT, block=BLOCK_MS)  # type: ignore[arg-type]
        finally:
            lane.blocked = False
        for raw_key, entries in reply or []:
            self._fan_out(lane, raw_key.decode() if isinstance(raw_key, bytes) else str(raw_key), entries)
        if reply and (pause := COALESCE_S - (time.monotonic() - began)) > 0:
            await asyncio.sleep(pause)

    def _fan_out(self, lane: Lane, key: str, entries: Any) -> None:
        found = stream_entries([(key, entries)])
        for sub in list(lane.subs.get(key, ())):
            for entry_id, event in found:
                if sub.offer(entry_id, event):
                    self._leave(sub)
                    break

    async def _connect(self, lane: Lane) -> aioredis.Redis:
        """The lane reader's own connection (one, named `streams`; on a cluster, to the node serving
        its slot), and its id for `CLIENT UNBLOCK`."""
        if lane.reader is None:
            url = self.url
            if self.cluster:
                lane.node = cast(Any, self.requests).get_node_from_key(next(iter(lane.subs)))
                url = node_url(self.url, lane.node.host, lane.node.port)
            lane.reader = aioredis.Redis.from_url(url, single_connection_client=True,
                                                  client_name=client_name("streams"), socket_connect_timeout=5)
            lane.reader_id = int(await lane.reader.client_id())
        return lane.reader

    async def _drop_reader(self, lane: Lane) -> None:
        reader, lane.reader, lane.reader_id, lane.node = lane.reader, None, None, None
        if reader is not None:
            with contextlib.suppress(Exception):
                await reader.aclose()

    async def _renew_holds(self) -> None:
        assert self._renew is not None
        while not self._closed:
            await asyncio.sleep(RENEW_S)
            holds = [s.hold for lane in self._lanes.values() for subs in lane.subs.values() for s in subs
                     if s.hold is not None]
            if holds:
                try:
                    await self._renew(holds)
                except (redis.RedisError, OSError) as e:
                    log.warning("stream hub: renewing %d stream holds failed (%s)", len(holds), e)

    async def close(self) -> None:
        """Stop the readers (at shutdown); open subscribers end."""
        self._closed = True
        for lane in self._lanes.values():
            lane.joined.set()
        for task in (*(lane.task for lane in self._lanes.values()), self._renewer):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        for lane in self._lanes.values():
            for subs in lane.subs.values():
                for sub in subs:
                    sub.queue.put_nowait(None)
            lane.subs.clear()
            await self._drop_reader(lane)
