"""What an operator asks a running deployment: the queues (waiting, delayed, in progress, dead, age
of the oldest message, consumers), the worker processes alive (their heartbeats), the turns in
flight, the dead letters (listed, shown, replayed, purged) and a tenant's usage counters. Sync, over
one `redis.Redis` and the `Keys`; it reads dramatiq's RedisBroker layout under `<prefix>:q` and the
worker heartbeats, and writes only through its two scripts.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, cast

import redis

from threadline.pipeline.redact import redact, redact_value
from threadline.pipeline.stages import DEFAULT_GRAPH, StageGraph
from threadline.workers.protocol.keys import Keys, layout_shards
from threadline.workers.protocol.names import queues as graph_queues
from threadline.workers.protocol.schema import text, text_map
from threadline.workers.protocol.wire import DEAD_LETTERS_MAXLEN, MAX_JSON_DEPTH, json_too_deep
from threadline.workers.storage import lua

#: Messages looked at from the head of a queue for the oldest one (a redelivered message goes to
#: the tail, so the head is not always the oldest).
OLDEST_SCAN = 100
#: Turns in flight looked at for the oldest admission (the set is ordered by last progress).
IN_FLIGHT_SCAN = 100
#: What `show` prints of a body that is no message.
RAW_CLIP = 2_000
#: The message options a replay drops: the retries spent, so that it gets its full retry policy again.
_SPENT_OPTIONS = ("retries", "traceback", "eta")

ReplayOutcome = Literal["replayed", "missing", "changed", "queued"]


@dataclass(frozen=True, slots=True)
class QueueStatus:
    name: str
    #: Messages waiting on the queue.
    depth: int
    #: Messages on its delay queue (`<name>.DQ`: retries waiting out their backoff).
    delayed: int
    #: Messages fetched by a worker and not acked yet (running, or prefetched).
    in_progress: int
    dead: int
    #: Seconds since the oldest waiting message was enqueued (None: none waits).
    oldest_age_s: float | None
    #: Live worker processes that consume the queue (0: its messages wait for nobody).
    consumers: int = 0


@dataclass(frozen=True, slots=True)
class WorkerStatus:
    """A live worker process, as its heartbeat (`Keys.worker`) describes it."""

    worker_id: str
    pid: int | None
    host: str
    #: The queues it consumes.
    queues: tuple[str, ...]
    #: When it started (epoch seconds; None: not said).
    since: float | None


@dataclass(frozen=True, slots=True)
class InFlight:
    """Turns between admission and their end (`<prefix>:running`)."""

    count: int
    #: The turn admitted first (among the IN_FLIGHT_SCAN stalest), its age, and its time since progress.
    oldest_turn_id: str | None = None
    oldest_age_s: float | None = None
    oldest_idle_s: float | None = None


@dataclass(frozen=True, slots=True)
class Status:
    queues: tuple[QueueStatus, ...]
    #: Worker processes whose heartbeat has not expired (it expires `TL_WORKER_TIMEOUT_S` after the
    #: last renewal, and goes at once when a process stops).
    workers_alive: int
    #: Worker ids still in dramatiq's heartbeat set (written by each worker's heartbeat; a dead one stays
    #: until the watchdog's reap has put its fetched messages back).
    workers_known: int
    turns: InFlight
    #: The live worker processes, by worker id.
    workers: tuple[WorkerStatus, ...] = ()


@dataclass(frozen=True, slots=True)
class DeadLetter:
    queue: str
    message_id: str
    #: When it was dead-lettered (epoch seconds).
    dead_at: float
    #: From the dead-letter stream ("" when its entry was trimmed away).
    actor: str = ""
    reason: str = ""


@dataclass(frozen=True, slots=True)
class DeadLetterBody:
    letter: DeadLetter
    #: The decoded dramatiq message, credentials redacted (None: the body is no JSON object).
    message: Mapping[str, Any] | None
    #: The body as text, clipped and redacted, when it is no message.
    raw: str | None = None


@dataclass(frozen=True, slots=True)
class TenantUsage:
    tenant_id: str
    input_tokens: int = 0
    output_tokens: int = 0
    requests: int = 0
    turns: int = 0
    cache_read_tokens: int = 0
    cache_write_tokens: int = 0
    #: The summed cost of the priced turns, in USD, and how many turns had no known price.
    cost_usd: float = 0.0
    unpriced_turns: int = 0
    #: Any other counter the hash holds (a newer worker's).
    other: Mapping[str, int] = field(default_factory=dict)
    #: Set when these are one conversation's counters (of its tenant), not the whole tenant's.
    conversation_id: str | None = None


class Operations:
    def __init__(self, client: redis.Redis, keys: Keys, *, graph: StageGraph = DEFAULT_GRAPH,
                 stored_layout: bool = False) -> None:
        """`stored_layout`: `keys` gives the prefix only, and the layout is the stored one
        (`Keys.layout`), read on first need and never written: a metrics server starts while Redis
        is down, and a reading tool does not choose a layout."""
        self.redis = client
        self._keys = keys
        self._stored_layout = stored_layout
        self.queues: tuple[str, ...] = graph_queues(graph)
        self._replay = client.register_script(lua.source("dead_letter_replay"))
        self._purge = client.register_script(lua.source("dead_letter_purge"))

    @property
    def keys(self) -> Keys:
        if self._stored_layout:
            self._keys, self._stored_layout = stored_layout(self.redis, self._keys.prefix), False
        return self._keys

    # --- status --------------------------------------------------------------------------------

    def status(self, *, now: float | None = None) -> Status:
        """Every queue's counts summed over the layout's shards (each shard has its own queue keys)."""
        now = time.time() if now is None else now
        # dramatiq's broker ids: whose ack sets hold the messages fetched and not acked
        workers = _scored(self.redis.zrange(self.keys.heartbeats(), 0, -1, withscores=True))
        live = self.live_workers()
        shards = self.keys.every_shard()
        pipe = self.redis.pipeline(transaction=False)
        for q in self.queues:
            for k in shards:
                pipe.llen(k.queue(q))
                pipe.llen(k.queue(f"{q}.DQ"))
                pipe.zcard(k.dead_queue(q))
                pipe.lrange(k.queue(q), 0, OLDEST_SCAN - 1)
                for worker_id, _ in workers:
                    pipe.scard(k.acks(worker_id, q))
        replies = iter(pipe.execute())
        queues = []
        for q in self.queues:
            depth = delayed = dead = in_progress = 0
            ages: list[float] = []
            for k in shards:
                depth, delayed, dead = depth + next(replies), delayed + next(replies), dead + next(replies)
                head = next(replies)
                in_progress += sum(next(replies) for _ in workers)
                if (age := self._oldest_age(k, q, head, now)) is not None:
                    ages.append(age)
            consumers = sum(1 for w in live if q in w.queues)
            queues.append(QueueStatus(q, depth, delayed, in_progress, dead, max(ages, default=None), consumers))
        return Status(tuple(queues), len(live), len(workers), self._in_flight(now), live)

    def live_workers(self) -> tuple[WorkerStatus, ...]:
        """The worker processes whose heartbeat key still lives (the registry lists every process not
        yet reaped; the key expires with its heartbeat), ordered by worker id."""
        ids = sorted(text(w) for w in cast(list[bytes], self.redis.hkeys(self.keys.workers())))
        if not ids:
            return ()
        beats = cast(list[bytes | None], self.redis.mget([self.keys.worker(w) for w in ids]))
        return tuple(_worker(w, beat) for w, beat in zip(ids, beats, strict=True) if beat is not None)

    def _oldest_age(self, keys: Keys, queue: str, ids: Sequence[bytes], now: float) -> float | None:
        if not ids:
            return None
        bodies = cast(list[bytes | None], self.redis.hmget(keys.queue_messages(queue), list(ids)))
        stamps = [_timestamp_ms(body) for body in bodies]
        known = [s for s in stamps if s is not None]
        return max(0.0, now - min(known) / 1000) if known else None

    def _in_flight(self, now: float) -> InFlight:
        """The turns in flight of every shard; the oldest among each shard's IN_FLIGHT_SCAN stalest."""
        count = 0
        stalest: list[tuple[Keys, str, float]] = []
        for k in self.keys.every_shard():
            count += self.redis.zcard(k.running())
            stalest += [(k, turn_id, progress) for turn_id, progress in
                        _scored(self.redis.zrange(k.running(), 0, IN_FLIGHT_SCAN - 1, withscores=True))]
        if not stalest:
            return InFlight(count)
        pipe = self.redis.pipeline(transaction=False)
        for k, turn_id, _ in stalest:
            pipe.hget(k.turn(turn_id), "admitted_at")
        admitted = [float(a) if a is not None else progress
                    for a, (_, _, progress) in zip(pipe.execute(), stalest, strict=True)]
        i = min(range(len(stalest)), key=admitted.__getitem__)
        return InFlight(count, stalest[i][1], max(0.0, now - admitted[i]), max(0.0, now - stalest[i][2]))

    # --- dead letters --------------------------------------------------------------------------

    def dead_letters(self, *, queue: str | None = None) -> list[DeadLetter]:
        """Every dead letter whose body is kept (dramatiq's `<queue>.XQ`, in every shard), oldest
        first. Refusals recorded without a body (the stream's other entries) cannot be replayed and
        are not listed."""
        letters = []
        names = self._queues(queue)
        for k in self.keys.every_shard():
            pipe = self.redis.pipeline(transaction=False)
            for q in names:
                pipe.zrange(k.dead_queue(q), 0, -1, withscores=True)
            reasons = self._reasons(k)
            for q, entries in zip(names, pipe.execute(), strict=True):
                for mid, score in _scored(entries):
                    actor, reason = reasons.get((q, mid), ("", ""))
                    letters.append(DeadLetter(q, mid, score / 1000, actor, reason))
        return sorted(letters, key=lambda d: d.dead_at)

    def dead_letter(self, message_id: str, *, queue: str | None = None,
                    secrets: Iterable[str] = ()) -> DeadLetterBody | None:
        """A dead letter and its body (args redacted), or None when no queue holds it."""
        found = self._find(message_id, queue)
        if found is None:
            return None
        k, q, score, body = found
        actor, reason = self._reasons(k).get((q, message_id), ("", ""))
        letter = DeadLetter(q, message_id, score / 1000, actor, reason)
        message = _decode(body)
        secrets = tuple(secrets)
        if message is None:
            return DeadLetterBody(letter, None, redact(body[:RAW_CLIP].decode(errors="replace"), secrets))
        return DeadLetterBody(letter, cast(Mapping[str, Any], redact_value(message, secrets)))

    def replay(self, message_id: str, *, queue: str | None = None) -> ReplayOutcome:
        """Enqueue a dead letter again on its queue (of the shard it died in), with its retries
        reset, and drop it from the dead letters, atomically (`dead_letter_replay.lua`)."""
        found = self._find(message_id, queue)
        if found is None:
            return "missing"
        k, q, _, body = found
        return cast(ReplayOutcome, text(self._replay(
            keys=[k.dead_queue(q), k.dead_queue_messages(q), k.queue_messages(q), k.queue(q)],
            args=[lua.payload(message_id=message_id, channel=k.doorbell_channel(), queue=q), body,
                  _fresh(body, q)],
        )))

    def replay_all(self, *, queue: str | None = None) -> dict[ReplayOutcome, int]:
        counts: dict[ReplayOutcome, int] = {}
        for letter in self.dead_letters(queue=queue):
            outcome = self.replay(letter.message_id, queue=letter.queue)
            counts[outcome] = counts.get(outcome, 0) + 1
        return counts

    def purge(self, *, queue: str | None = None, older_than_s: float | None = None,
              now: float | None = None) -> int:
        """Delete dead letters (entries and bodies, in every shard); only those older than
        `older_than_s` when given. The dead-letter stream, a capped record of what happened, stays."""
        now = time.time() if now is None else now
        cutoff = "+inf" if older_than_s is None else str(int((now - older_than_s) * 1000))
        return sum(int(self._purge(keys=[k.dead_queue(q), k.dead_queue_messages(q)], args=[cutoff]))
                   for q in self._queues(queue) for k in self.keys.every_shard())

    def _queues(self, queue: str | None) -> tuple[str, ...]:
        return self.queues if queue is None else (queue,)

    def _find(self, message_id: str, queue: str | None) -> tuple[Keys, str, float, bytes] | None:
        """Where a dead letter is: the keys of its shard, its queue, when (ms) and its body."""
        for q in self._queues(queue):
            for k in self.keys.every_shard():
                score = self.redis.zscore(k.dead_queue(q), message_id)
                body = self.redis.hget(k.dead_queue_messages(q), message_id)
                if body is not None:
                    return k, q, float(score or 0), cast(bytes, body)
        return None

    def _reasons(self, keys: Keys) -> dict[tuple[str, str], tuple[str, str]]:
        """(queue, message id) -> (actor, reason) of its latest entry in a shard's dead-letter stream."""
        found: dict[tuple[str, str], tuple[str, str]] = {}
        entries = cast(list[tuple[bytes, dict[bytes | str, bytes | str]]],
                       self.redis.xrevrange(keys.dead_letters(), count=DEAD_LETTERS_MAXLEN * 2))
        for _, raw in entries:
            fields = text_map(raw)
            found.setdefault((fields.get("queue", ""), fields.get("message_id", "")),
                             (fields.get("actor", ""), fields.get("reason", "")))
        return found

    # --- usage ---------------------------------------------------------------------------------

    def usage(self, tenant_id: str) -> TenantUsage:
        """The tenant's counters, summed over the shards (each turn counts in its own shard's hash)."""
        counters: dict[str, int] = {}
        for k in self.keys.every_shard():
            for name, value in self.redis.hgetall(k.usage(tenant_id)).items():
                counters[text(name)] = counters.get(text(name), 0) + int(value)
        return usage_of(tenant_id, counters)


def stored_layout(client: redis.Redis, prefix: str) -> Keys:
    """The keys of the layout stored under `prefix` (`Keys.layout`; none stored: one server's)."""
    raw = client.get(Keys(prefix).layout())
    return Keys(prefix, layout_shards(cast(bytes | None, raw)))


def usage_of(tenant_id: str, counters: Mapping[str, int], *, conversation_id: str | None = None) -> TenantUsage:
    """Usage counters (a tenant's hash, or a conversation's rows summed the same way) read."""
    rest = dict(counters)
    return TenantUsage(tenant_id, input_tokens=rest.pop("input_tokens", 0), output_tokens=rest.pop("output_tokens", 0),
                       requests=rest.pop("requests", 0), turns=rest.pop("turns", 0),
                       cache_read_tokens=rest.pop("cache_read_tokens", 0),
                       cache_write_tokens=rest.pop("cache_write_tokens", 0),
                       cost_usd=rest.pop("cost_micro_usd", 0) / 1_000_000,
                       unpriced_turns=rest.pop("unpriced_turns", 0), other=rest, conversation_id=conversation_id)


def _scored(reply: Any) -> list[tuple[str, float]]:
    """A ZRANGE WITHSCORES reply as (member, score) pairs."""
    return [(text(member), float(score)) for member, score in cast(list[tuple[bytes, float]], reply)]


def _worker(worker_id: str, beat: bytes) -> WorkerStatus:
    """A heartbeat's JSON (`pid`, `host`, `queues`, `since`) as a `WorkerStatus`; what it lacks or
    gets wrong is left unknown (a process alive all the same)."""
    info = _decode(beat) or {}
    pid, since, queues = info.get("pid"), info.get("since"), info.get("queues")
    return WorkerStatus(
        worker_id,
        pid if isinstance(pid, int) and not isinstance(pid, bool) else None,
        str(info.get("host") or ""),
        tuple(q for q in queues if isinstance(q, str)) if isinstance(queues, list) else (),
        float(since) if isinstance(since, int | float) and not isinstance(since, bool) else None,
    )


def _decode(body: bytes) -> dict[str, Any] | None:
    """The JSON object a body holds, or None (undecodable, nested too deep, not an object)."""
    if json_too_deep(body, MAX_JSON_DEPTH):
        return None
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def _timestamp_ms(body: bytes | None) -> float | None:
    message = _decode(body) if body is not None else None
    stamp = message.get("message_timestamp") if message else None
    return float(stamp) if isinstance(stamp, int | float) and not isinstance(stamp, bool) else None


def _fresh(body: bytes, queue: str) -> bytes:
    """The body to replay: its retries spent dropped, and a delay queue's message moved to its queue;
    a body that is no message goes back as it is (it is refused again, with its reason)."""
    message = _decode(body)
    if message is None:
        return body
    options = message.get("options")
    spent = isinstance(options, dict) and any(k in options for k in _SPENT_OPTIONS)
    delayed = message.get("queue_name") == f"{queue}.DQ"
    if not spent and not delayed:
        return body
    if isinstance(options, dict):
        message["options"] = {k: v for k, v in options.items() if k not in _SPENT_OPTIONS}
    if delayed:
        message["queue_name"] = queue
    return json.dumps(message, separators=(",", ":")).encode()
