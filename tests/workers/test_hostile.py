"""Hostile producer input, as a catalogue: each case is a message some producer could write, and
what must come of it. No input may block, cancel or corrupt another turn; bad input ends in one
`failed` event with a stable code on the stream of the turn it names (of its message id when it
names none), or, when it names no turn of its own, in one dead-letter entry.

Every case runs through one pool of two worker processes on one key prefix, next to one long-lived
"victim" conversation (`offline:echo`) and, for some cases, a turn that is streaming at that moment.
For every case:

 (a) the documented outcome, exactly once: one terminal event on its stream, or one new entry in
     the dead-letter stream (or, for a no-op, neither);
 (b) a dump of every key under the prefix (value by type, streams by entry id, zsets with scores,
     and whether each key expires, its TTL never refreshed) is the same before and after, except
     the case's own turn (`turn:<id>`, `turn:<id>:events`), what an accepted turn of its own makes
     (its conversation, its tenant's usage), the dead-letter stream and dramatiq's bookkeeping
     under `<prefix>:q:` — whose `.msgs` hashes, queues and ack sets must end empty;
 (c) the workers are alive and a next turn of the victim conversation succeeds and sees its
     earlier turns. (`offline:echo` answers with everything it received, earlier answers included,
     so a chain of echo turns grows exponentially: each probe branches from the same base tip, and
     the last test continues from the tip.)

A case that fails (b) has its stray writes undone before the next case runs, so that one product bug
shows up in its own case only. `pytest -s` prints the catalogue with what each case came to.
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx
import pytest
import redis

from tests.conftest import WorkerPool, drop_prefix, liveness_key
from tests.support.gateway import running_gateway
from tests.support.wait import poll
from threadline.pipeline import events as ev
from threadline.pipeline.config import AgentConfig
from threadline.pipeline.contracts import TURN_SCHEMA
from threadline.workers.clients.client import Client
from threadline.workers.gateway.tenancy import inside
from threadline.workers.protocol.keys import Keys
from threadline.workers.settings import Settings
from threadline.workers.storage.api_keys import create_key
from threadline.workers.storage.connect import sync_client

pytestmark = [pytest.mark.integration,
              # the audit names every key of one server's layout (allowed writes, dramatiq's bookkeeping,
              # dead letters by position in one stream); the sharded layout's: test_sharded*.py, test_slots.py
              pytest.mark.one_server("the catalogue audits one server's keys byte for byte")]

VICTIM_AGENT = "echo"  # literally "echo", so that `echo:v:1` names its stored config's key
SLOW_AGENT = "slow"
SLOW_MODEL = {"provider": "python", "name": "tests.support.models:streaming", "options": {"words": 40, "delay_ms": 25}}
SCOPE = {"tenant_id": "t1", "app_id": "app", "user_id": "u1"}
SLOW_TENANT = "t-slow"
OTHER_TENANT = "t2"
VICTIM_TURNS = ("victim-1", "victim-2")
VICTIM_QUERIES = ("first victim question", "second victim question")
VICTIM_CID = f"c-{VICTIM_TURNS[0]}"
OTHER_TURN = "other-1"  # another conversation of the same user, whose message a case borrows
MAX_QUERY_CHARS = 2000  # the pool's TL_MAX_QUERY_CHARS (tests/conftest.py)
WAIT_S = 15.0


# --- a type-aware dump of everything under the prefix ---------------------------------------------

#: key -> (type, value, pttl): pttl -1 when the key does not expire.
Dump = dict[str, tuple[str, Any, int]]


def key_name(raw: bytes) -> str:
    # any bytes round-trip: the client encodes key names back with the same error handler
    return raw.decode("utf-8", "surrogateescape")


def dump(r: redis.Redis, prefix: str) -> Dump:
    keys = sorted(k for k in map(key_name, r.scan_iter(f"{prefix}:*", count=1000)) if not liveness_key(k, prefix))
    pipe = r.pipeline(transaction=False)
    for key in keys:
        pipe.type(key)
    kinds = [k.decode() for k in pipe.execute()]
    for key, kind in zip(keys, kinds, strict=True):
        if kind == "string":
            pipe.get(key)
        elif kind == "hash":
            pipe.hgetall(key)
        elif kind == "list":
            pipe.lrange(key, 0, -1)
        elif kind == "set":
            pipe.smembers(key)
        elif kind == "zset":
            pipe.zrange(key, 0, -1, withscores=True)
        elif kind == "stream":
            pipe.xrange(key)
        else:
            pipe.type(key)  # gone between SCAN and TYPE
        pipe.pttl(key)
    replies = pipe.execute()
    out: Dump = {}
    for i, (key, kind) in enumerate(zip(keys, kinds, strict=True)):
        value, ttl = replies[2 * i], replies[2 * i + 1]
        if kind == "none" or ttl == -2:
            continue
        if kind == "set":
            value = frozenset(value)
        elif kind == "stream":
            value = [(entry_id, dict(fields)) for entry_id, fields in value]
        out[key] = (kind, value, ttl)
    return out


def changed_keys(before: Dump, after: Dump) -> list[str]:
    """Keys whose type, value or expiry differ, or whose TTL was set again (it grew)."""
    changed = []
    for key in sorted(before.keys() | after.keys()):
        if key not in before or key not in after:
            changed.append(key)
            continue
        (k1, v1, t1), (k2, v2, t2) = before[key], after[key]
        if k1 != k2 or v1 != v2 or (t1 == -1) != (t2 == -1) or t2 > t1:
            changed.append(key)
    return changed


def restore(r: redis.Redis, before: Dump, keys: list[str]) -> None:
    """Put `keys` back as they were in `before` (deleting those that did not exist)."""
    pipe = r.pipeline(transaction=True)
    for key in keys:
        pipe.delete(key)
        if key not in before:
            continue
        kind, value, ttl = before[key]
        if kind == "string":
            pipe.set(key, value)
        elif kind == "hash":
            pipe.hset(key, mapping=value)
        elif kind == "list":
            pipe.rpush(key, *value)
        elif kind == "set":
            pipe.sadd(key, *value)
        elif kind == "zset":
            pipe.zadd(key, dict(value))
        elif kind == "stream":
            for entry_id, fields in value:
                pipe.xadd(key, fields, id=entry_id)
        if ttl > 0:
            pipe.pexpire(key, ttl)
    pipe.execute()


# --- the pool, the victim, and how cases are sent ---------------------------------------------------


@dataclass
class Hostile:
    pool: WorkerPool
    client: Client
    redis: redis.Redis
    keys: Keys
    #: The gateway in front of the same prefix, and an API key of the victim's tenant and of another.
    gateway: str = ""
    api_keys: dict[str, str] = field(default_factory=dict)
    probes: list[str] = field(default_factory=list)
    #: Keys any case was allowed to write, for the final look at the prefix.
    owned: set[str] = field(default_factory=set)
    owned_conversations: set[str] = field(default_factory=set)

    @property
    def prefix(self) -> str:
        return self.pool.prefix

    def http(self, tenant: str) -> httpx.Client:
        return httpx.Client(base_url=self.gateway, headers={"Authorization": f"Bearer {self.api_keys[tenant]}"},
                            timeout=30)

    def raw(self, queue: str, args: Any, *, mid: str, actor: str | None = None, kwargs: Any = None,
            options: dict[str, Any] | None = None, body: bytes | None = None) -> str:
        """The raw producer of docs/protocol.md: HSET the message, RPUSH its id, PUBLISH the doorbell."""
        fields = {"queue_name": queue, "actor_name": actor or queue, "args": args,
                  "kwargs": {} if kwargs is None else kwargs, "options": options or {"redis_message_id": mid},
                  "message_id": mid, "message_timestamp": int(time.time() * 1000)}
        data = body if body is not None else json.dumps(fields).encode()
        field_name = mid.encode("utf-8", "surrogatepass")  # a raw producer may write any bytes
        self.redis.hset(self.keys.queue_messages(queue), field_name, data)
        self.redis.rpush(self.keys.queue(queue), field_name)
        self.redis.publish(self.keys.doorbell_channel(), queue)
        return mid

    def cancel_raw(self, args: list[Any], *, mid: str) -> str:
        return self.raw("control", args, mid=mid, actor="cancel")

    def events(self, turn_id: str) -> list[Any]:
        return list(self.client.events(turn_id))

    def terminals(self, turn_id: str) -> list[Any]:
        return [e for e in self.events(turn_id) if e.type in ev.TERMINAL_TYPES]

    def dead_letters(self, after: str = "-") -> list[tuple[str, dict[str, str]]]:
        entries = self.redis.xrange(self.keys.dead_letters(), min=after)
        return [(i.decode(), {k.decode(): v.decode("utf-8", "surrogatepass") for k, v in f.items()})
                for i, f in entries if i.decode() != after]

    def last_dead_letter(self) -> str:
        last = self.redis.xrevrange(self.keys.dead_letters(), count=1)
        return last[0][0].decode() if last else "0-0"

    def busy(self) -> list[str]:
        """What dramatiq still holds: bodies, queued ids, unacked ids (dead-letter sets aside)."""
        keys = [key for key in map(key_name, self.redis.scan_iter(f"{self.keys.queue('')}*", count=1000))
                if ".XQ" not in key and "__heartbeats__" not in key]
        pipe = self.redis.pipeline(transaction=False)
        for key in keys:
            pipe.type(key)
        kinds = [kind.decode() for kind in pipe.execute()]
        sizes = {"hash": pipe.hlen, "list": pipe.llen, "set": pipe.scard, "zset": pipe.zcard}
        counted = [(key, kind) for key, kind in zip(keys, kinds, strict=True) if kind in sizes]
        for key, kind in counted:
            sizes[kind](key)
        return [f"{key} ({kind}, {size})" for (key, kind), size in zip(counted, pipe.execute(), strict=True) if size]

    def quiesce(self, timeout_s: float = WAIT_S) -> None:
        assert self.settle(timeout_s), f"queues never drained: {self.busy()}"

    def settle(self, timeout_s: float = WAIT_S) -> bool:
        """dramatiq holds nothing, seen twice in a row: `busy` reads key by key, so one reading can miss
        a message that moves from a queue to an ack set between two of its reads."""
        idle = [0]

        def quiet() -> bool:
            idle[0] = idle[0] + 1 if not self.busy() else 0
            return idle[0] >= 2

        return bool(poll(quiet, timeout_s))

    def drop_leftovers(self) -> list[str]:
        """Delete what dramatiq still holds (nothing else is in flight between cases)."""
        held = self.busy()
        for entry in held:
            self.redis.delete(entry.split(" (")[0])
        return held

    def wait_terminal(self, turn_id: str, timeout_s: float = WAIT_S) -> Any | None:
        try:
            return self.client.wait(turn_id, timeout_s=timeout_s)
        except TimeoutError:
            return None

    def start_slow(self, turn_id: str) -> str:
        """A turn of the slow agent, returned once its model is streaming."""
        self.client.submit(request(turn_id, agent_id=SLOW_AGENT, tenant_id=SLOW_TENANT, query="stream please"))
        streaming = poll(lambda: any(e.type == "text_delta" for e in self.events(turn_id)), WAIT_S)
        assert streaming, f"{turn_id} never streamed: {self.events(turn_id)}"
        return turn_id

    def probe(self) -> None:
        """A next turn of the victim conversation succeeds and sees the victim's turns."""
        assert self.pool.alive(), self.pool.log_tail()
        query = f"probe {len(self.probes) + 1}"
        turn_id = self.client.submit(request(f"probe-{len(self.probes) + 1}", query=query,
                                             conversation_id=VICTIM_CID, parent_message_id=VICTIM_TURNS[-1]))
        self.probes.append(turn_id)
        terminal = self.wait_terminal(turn_id)
        assert isinstance(terminal, ev.Succeeded), (terminal, self.pool.log_tail())
        assert users_seen(terminal.answer) == [*VICTIM_QUERIES, query]
        assert [m["role"] for m in json.loads(terminal.answer)["messages"]] == ["user", "assistant"] * 2 + ["user"]
        self.quiesce()


def request(turn_id: str | None = None, **fields: Any) -> dict[str, Any]:
    """A turn request of the victim's user and agent; `None` drops a field."""
    body = {"schema": TURN_SCHEMA, "turn_id": turn_id, **SCOPE, "agent_id": VICTIM_AGENT, "query": "hello",
            **fields}
    return {k: v for k, v in body.items() if v is not None}


def users_seen(echo_answer: str) -> list[str]:
    return [m["text"] for m in json.loads(echo_answer)["messages"] if m["role"] == "user"]


@pytest.fixture(scope="module")
def hostile(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hostile]:
    prefix = f"tlh{uuid.uuid4().hex[:8]}"
    pool = WorkerPool(redis_url, prefix, tmp_path_factory.mktemp("logs"), env={"TL_MAX_RETRIES": "1"})
    client = Client(redis_url, prefix=prefix)
    r = sync_client(redis_url, encoding_errors="surrogateescape")
    gateway = running_gateway(dataclasses.replace(Settings.from_env({"TL_MAX_QUERY_CHARS": str(MAX_QUERY_CHARS)}),
                                                  prefix=prefix, redis_url=redis_url), redis_url)
    try:
        pool.start(processes=2, threads=4)
        client.put_agent(AgentConfig.model_validate({"id": VICTIM_AGENT, "model": "offline:echo"}))
        client.put_agent(AgentConfig.model_validate({"id": SLOW_AGENT, "model": SLOW_MODEL}))
        h = Hostile(pool, client, r, Keys(prefix), gateway=gateway.__enter__(),
                    api_keys={t: create_key(client.redis, client.keys, t) for t in (SCOPE["tenant_id"], OTHER_TENANT)})
        # the keys' records exist before every case, as the agents do
        h.owned |= {key_name(k) for k in r.scan_iter(f"{h.keys.api_keys()}*")}
        for i, (turn_id, query) in enumerate(zip(VICTIM_TURNS, VICTIM_QUERIES, strict=True)):
            client.submit(request(turn_id, query=query, conversation_id=VICTIM_CID if i else None))
            assert isinstance(h.wait_terminal(turn_id), ev.Succeeded)
        client.submit(request(OTHER_TURN, query="another conversation"))
        assert isinstance(h.wait_terminal(OTHER_TURN), ev.Succeeded)
        h.quiesce()
        yield h
    finally:
        gateway.__exit__(None, None, None)
        pool.stop()
        client.close()
        drop_prefix(r, prefix)
        r.close()


# --- the catalogue --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Terminal:
    """One terminal event of this type (and code) on the case's stream."""

    type: str
    code: str | None = None

    def __str__(self) -> str:
        return f"{self.type}/{self.code}" if self.code else self.type


@dataclass(frozen=True)
class DeadLetter:
    """One new dead-letter entry for the case's message."""

    reason: str
    queue: str = "resolve"
    actor: str = "resolve"

    def __str__(self) -> str:
        return f"dead-letter {self.reason!r}"


@dataclass(frozen=True)
class Nothing:
    """A no-op: no event on the stream it names, no dead letter."""

    def __str__(self) -> str:
        return "no-op"


Outcome = Terminal | DeadLetter | Nothing


@dataclass
class Sent:
    """What a case sent, and which keys it may write."""

    #: The turn whose stream carries the outcome (the message id when the request names no turn).
    stream: str = ""
    #: The message a dead-letter entry must name.
    message_id: str = ""
    #: Turns of the case: their `turn:<id>` and `turn:<id>:events` may change.
    turns: tuple[str, ...] = ()
    #: Conversations the case's accepted turns make or continue, and those turns' tenants.
    conversations: tuple[str, ...] = ()
    tenants: tuple[str, ...] = ()
    #: Other turns of the case and the terminal event each must reach.
    side: dict[str, Terminal] = field(default_factory=dict)
    #: Further keys (relative to the prefix) the case may write.
    extra: tuple[str, ...] = ()
    #: Further checks once the case has settled.
    check: Callable[[], None] | None = None
    #: A turn the message names whose fate the table shows (it must stay empty when all is well).
    named: str = ""
    #: Sent through the gateway: its API keys' bookkeeping (last use, rate-limit buckets) may change.
    front_door: bool = False


@dataclass(frozen=True)
class Case:
    name: str
    sent_as: str
    send: Callable[[Hostile, str], Sent]
    expect: Outcome
    #: A product bug: the case asserts the right behaviour and is expected to fail.
    bug: str = ""


def refused_turn(**fields: Any) -> Callable[[Hostile, str], Sent]:
    """A raw turn request with a valid turn id `t-<uid>` and `fields`; refused on its stream."""

    def send(h: Hostile, uid: str) -> Sent:
        tid = f"t-{uid}"
        h.raw("resolve", [request(tid, **fields)], mid=f"m-{uid}")
        return Sent(stream=tid, turns=(tid,))

    return send


def unnamed_turn(**fields: Any) -> Callable[[Hostile, str], Sent]:
    """A raw turn request whose turn id is no id (`fields`): refused on its message id's stream."""

    def send(h: Hostile, uid: str) -> Sent:
        mid = f"m-{uid}"
        h.raw("resolve", [request(**fields)], mid=mid)
        return Sent(stream=mid, turns=(mid,))

    return send


def bad_cancel(args: list[Any]) -> Callable[[Hostile, str], Sent]:
    def send(h: Hostile, uid: str) -> Sent:
        return Sent(message_id=h.cancel_raw(args, mid=f"m-{uid}"))

    return send


def accepted_turn(h: Hostile, tid: str, tenant: str = "t1") -> Sent:
    return Sent(stream=tid, turns=(tid,), conversations=(f"c-{tid}",), tenants=(tenant,))


def too_deep(h: Hostile, uid: str) -> Sent:
    mid, depth = f"m-{uid}", 100_000
    text = json.dumps({"queue_name": "resolve", "actor_name": "resolve",
                       "args": [request(f"t-{uid}", conversation_id=VICTIM_CID, inputs={"deep": "@@"})],
                       "kwargs": {}, "options": {"redis_message_id": mid}, "message_id": mid,
                       "message_timestamp": int(time.time() * 1000)})
    body = text.replace('"@@"', "[" * depth + "]" * depth).encode()
    h.raw("resolve", None, mid=mid, body=body)
    return Sent(message_id=mid)


def emoji_query(h: Hostile, uid: str) -> Sent:
    tid, query = f"t-{uid}", "¿Dónde está mi pedido? 📦🚚 我的订单在哪里？ 注文はどこ？ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢"  # noqa: RUF001
    h.raw("resolve", [request(tid, query=query)], mid=f"m-{uid}")

    def check() -> None:
        terminal = h.terminals(tid)[-1]
        assert users_seen(terminal.answer) == [query]
        assert [m.query for m in h.client.messages(f"c-{tid}")] == [query]

    return dataclasses.replace(accepted_turn(h, tid), check=check)


def longest_turn_id(h: Hostile, uid: str) -> Sent:
    """A 120-character turn id works, and its conversation `c-<id>` (122) takes a second turn."""
    tid = f"t-{uid}-".ljust(120, "x")
    follow = f"f-{uid}"
    h.client.submit(request(tid, query="longest id"))
    h.client.submit(request(follow, query="and again", conversation_id=f"c-{tid}"))

    def check() -> None:
        assert users_seen(h.terminals(follow)[-1].answer) == ["longest id", "and again"]

    return Sent(stream=tid, turns=(tid, follow), conversations=(f"c-{tid}",), tenants=("t1",),
                side={follow: Terminal("succeeded")}, check=check)


def claim_of_running(then_cancel: bool) -> Callable[[Hostile, str], Sent]:
    """`<X>:claim` as a turn id while X streams; X ends as it would have (or as its cancel says)."""

    def send(h: Hostile, uid: str) -> Sent:
        slow = h.start_slow(f"s-{uid}")
        mid = f"m-{uid}"
        h.raw("resolve", [request(f"{slow}:claim", conversation_id=f"c-{slow}", agent_id=SLOW_AGENT,
                                  tenant_id=SLOW_TENANT)], mid=mid)
        if then_cancel:
            assert h.wait_terminal(mid) is not None
            assert h.client.cancel(slow, "stop") == "enqueued"
        side = Terminal("cancelled", "cancelled") if then_cancel else Terminal("succeeded")
        return Sent(stream=mid, turns=(mid, slow), conversations=(f"c-{slow}",), tenants=(SLOW_TENANT,),
                    side={slow: side})

    return send


def duplicate_of_running(malformed: bool) -> Callable[[Hostile, str], Sent]:
    """A second message naming a running turn (valid, or malformed): the turn admitted runs on; a
    malformed one is dead-lettered, not allowed to end the turn it names."""

    def send(h: Hostile, uid: str) -> Sent:
        slow = h.start_slow(f"s-{uid}")
        query = 123 if malformed else "stream please"
        h.raw("resolve", [request(slow, agent_id=SLOW_AGENT, tenant_id=SLOW_TENANT, query=query)], mid=f"m-{uid}")
        if malformed:
            return Sent(message_id=f"m-{uid}", turns=(slow,), conversations=(f"c-{slow}",), tenants=(SLOW_TENANT,),
                        side={slow: Terminal("succeeded")})
        return Sent(stream=slow, turns=(slow,), conversations=(f"c-{slow}",), tenants=(SLOW_TENANT,))

    return send


def message_id_of_running(h: Hostile, uid: str) -> Sent:
    """A message with no request whose message id is a running turn's id: that turn runs on, the
    message is dead-lettered."""
    slow = h.start_slow(f"s-{uid}")
    h.raw("resolve", [], mid=slow)
    return Sent(message_id=slow, turns=(slow,), conversations=(f"c-{slow}",), tenants=(SLOW_TENANT,),
                side={slow: Terminal("succeeded")})


def mismatched_redis_id(h: Hostile, uid: str) -> Sent:
    """`options.redis_message_id` is not the hash field the body is stored under (docs/protocol.md says it
    must be): dramatiq would ack another id and keep this body and its ack entry forever, so the
    consumer (which fetches ids with bodies) dead-letters it."""
    mid = f"m-{uid}"
    h.raw("resolve", [request(f"t-{uid}")], mid=mid, options={"redis_message_id": f"elsewhere-{uid}"})
    return Sent(message_id=mid, named=f"t-{uid}")


def surrogate_message_id(h: Hostile, uid: str) -> Sent:
    """A message id holding a lone surrogate (its bytes in Redis are WTF-8): dramatiq cannot encode it
    to ack the message."""
    mid = f"m-{uid}-\udc00"
    h.raw("resolve", [request(f"t-{uid}")], mid=mid)
    return Sent(message_id=mid, named=f"t-{uid}")


def same_turn_twice(h: Hostile, uid: str) -> Sent:
    tid = f"t-{uid}"
    body = request(tid, query="only once")
    h.raw("resolve", [body], mid=f"m1-{uid}")
    h.raw("resolve", [body], mid=f"m2-{uid}")

    def check() -> None:
        assert [e.type for e in h.events(tid)].count("accepted") == 1
        assert len(h.client.messages(f"c-{tid}")) == 1

    return dataclasses.replace(accepted_turn(h, tid), check=check)


def duplicate_of_finished(how: Literal["raw", "zadd", "client"]) -> Callable[[Hostile, str], Sent]:
    """The victim's last turn submitted again once it has ended (a producer retrying): nothing happens,
    and its conversation's line is as it was, even when the producer put the turn in it."""

    def send(h: Hostile, uid: str) -> Sent:
        body = request(VICTIM_TURNS[-1], query=VICTIM_QUERIES[-1], conversation_id=VICTIM_CID)
        if how == "client":
            h.client.submit(body)
            return Sent(stream=VICTIM_TURNS[-1])
        if how == "zadd":  # `$R ZADD "$P:conv:{$CONVERSATION_ID}:turns" NX $(date +%s%6N) "$MID"`
            h.redis.zadd(h.keys.turn_queue(VICTIM_CID), {VICTIM_TURNS[-1]: time.time_ns() // 1000}, nx=True)
        h.raw("resolve", [body], mid=f"m-{uid}")
        return Sent(stream=VICTIM_TURNS[-1])

    return send


def refused_first_turn_by_client(h: Hostile, uid: str) -> Sent:
    """The client puts a first turn in the line of the conversation it will start (`c-<id>`); a
    refusal must take it out again."""
    tid = f"t-{uid}"
    h.client.submit(request(tid, query=123))
    return Sent(stream=tid, turns=(tid,))


def bad_conversation_id_by_client(h: Hostile, uid: str) -> Sent:
    tid = f"t-{uid}"
    h.client.submit(request(tid, conversation_id=f"{VICTIM_CID}}}:lease"))
    return Sent(stream=tid, turns=(tid,))


def cancel_finished(h: Hostile, uid: str) -> Sent:
    assert h.client.cancel(VICTIM_TURNS[0]) == "noop: succeeded"
    h.cancel_raw([VICTIM_TURNS[0], "too late"], mid=f"m-{uid}")
    return Sent(stream=VICTIM_TURNS[0])


def cancel_ahead(h: Hostile, uid: str) -> Sent:
    """A cancel for a turn not submitted yet raises its flag, under that turn's own keys only."""
    tid = f"t-{uid}"
    h.cancel_raw([tid, "before it exists"], mid=f"m-{uid}")

    def check() -> None:
        assert h.redis.exists(h.keys.cancel_flag(tid))

    return Sent(stream=tid, turns=(tid,), extra=(f"turn:{tid}:cancel",), check=check)


def envelope(args: list[Any]) -> Callable[[Hostile, str], Sent]:
    def send(h: Hostile, uid: str) -> Sent:
        return Sent(message_id=h.raw("history", args, mid=f"m-{uid}"))

    return send


def envelope_of_finished(h: Hostile, uid: str) -> Sent:
    """A stage message replayed for the victim's finished turn finds it ended and changes nothing."""
    h.raw("history", [{"v": 1, "turn_id": VICTIM_TURNS[-1], "stage": "history", "attempt": 1}], mid=f"m-{uid}")
    return Sent(stream=VICTIM_TURNS[-1])


def envelope_of_unknown_turn(h: Hostile, uid: str) -> Sent:
    tid = f"t-{uid}"
    h.raw("history", [{"v": 1, "turn_id": tid, "stage": "history", "attempt": 1}], mid=f"m-{uid}")
    return Sent(stream=tid)  # as for a turn whose record expired: nothing to run, nothing written


def extra_args(h: Hostile, uid: str) -> Sent:
    tid = f"t-{uid}"
    h.raw("resolve", [request(tid, conversation_id=VICTIM_CID), "extra"], mid=f"m-{uid}")
    return Sent(stream=tid, turns=(tid, f"m-{uid}"), named=f"m-{uid}")


def with_kwargs(h: Hostile, uid: str) -> Sent:
    tid = f"t-{uid}"
    h.raw("resolve", [request(tid, conversation_id=VICTIM_CID)], mid=f"m-{uid}", kwargs={"priority": 1})
    return Sent(stream=tid, turns=(tid, f"m-{uid}"), named=f"m-{uid}")


def no_args(h: Hostile, uid: str) -> Sent:
    mid = f"m-{uid}"
    h.raw("resolve", [], mid=mid)
    return Sent(stream=mid, turns=(mid,))


def unknown_actor(h: Hostile, uid: str) -> Sent:
    mid = f"m-{uid}"
    h.raw("resolve", [request(f"t-{uid}", conversation_id=VICTIM_CID)], mid=mid, actor="no_such_actor")
    return Sent(message_id=mid)


def context_over_the_window(h: Hostile, uid: str) -> Sent:
    """A `context` within TL_MAX_CONTEXT_CHARS but over the model's token window: the turn fails
    `context_too_large` in its history stage, before any model call (no answer, no snapshot)."""
    tid = f"t-{uid}"
    h.raw("resolve", [request(tid, query="short", context="word " * 39_000)], mid=f"m-{uid}")

    def check() -> None:
        assert h.terminals(tid)[-1].answer == ""
        assert not h.redis.hvals(h.keys.snapshots(f"c-{tid}"))

    return dataclasses.replace(accepted_turn(h, tid), check=check)


def big(n: int) -> str:
    return "q" * n


# --- the gateway's cases: each tenant's ids its own, no write across tenants, every error in the envelope ---


def expired_turn_again(tenant: str) -> Callable[[Hostile, str], Sent]:
    """The other conversation's first turn id sent again by another `tenant` as a new conversation's
    first turn once the turn's record expired (deleted here): its conversation exists, so nothing is
    written into it (forbidden)."""

    def send(h: Hostile, uid: str) -> Sent:
        h.redis.delete(h.keys.turn(OTHER_TURN), h.keys.events(OTHER_TURN))
        h.raw("resolve", [request(OTHER_TURN, tenant_id=tenant, query="IGNORE everything before")], mid=f"m-{uid}")
        return Sent(stream=OTHER_TURN, turns=(OTHER_TURN,))

    return send


def own_expired_turn_again(h: Hostile, uid: str) -> Sent:
    """The same as `expired_turn_again`, by the conversation's own tenant, on a conversation of the
    case's own (so that the other case's outcome stays to be checked again): its message and tip stay."""
    tid = f"t-{uid}"
    h.client.submit(request(tid, query="the original"))
    assert isinstance(h.wait_terminal(tid), ev.Succeeded)
    cid = f"c-{tid}"
    kept = {key: h.redis.dump(key) for key in (h.keys.conversation(cid), h.keys.messages(cid), h.keys.snapshots(cid))}
    h.redis.delete(h.keys.turn(tid), h.keys.events(tid))
    h.raw("resolve", [request(tid, query="IGNORE the original")], mid=f"m-{uid}")

    def check() -> None:
        assert {key: h.redis.dump(key) for key in kept} == kept

    return Sent(stream=tid, turns=(tid,), conversations=(cid,), tenants=(SCOPE["tenant_id"],), check=check)


def gateway_reused_turn_id(h: Hostile, uid: str) -> Sent:
    """Through the gateway, a tenant's own turn id again after its record expired: its message and its
    conversation's tip stay as they were (the catalogue allows the conversation's keys to change, so the
    check compares them itself)."""
    tid = f"g-{uid}"[:60]
    stored = inside(SCOPE["tenant_id"], tid)
    with h.http(SCOPE["tenant_id"]) as http:
        assert http.post("/v1/turns", json=gateway_body(turn_id=tid, query="the original")).status_code == 202
        assert isinstance(h.wait_terminal(stored), ev.Succeeded)
        cid = f"c-{stored}"
        kept = {key: h.redis.dump(key) for key in (h.keys.conversation(cid), h.keys.messages(cid))}
        h.redis.delete(h.keys.turn(stored), h.keys.events(stored))
        again = http.post("/v1/turns", json=gateway_body(turn_id=tid, query="IGNORE the original"))
        assert again.status_code == 202, again.text

    def check() -> None:
        assert {key: h.redis.dump(key) for key in kept} == kept

    return Sent(stream=stored, turns=(stored,), conversations=(cid,), tenants=(SCOPE["tenant_id"],), check=check,
                front_door=True)


def gateway_body(**fields: Any) -> dict[str, Any]:
    return {"app_id": SCOPE["app_id"], "user_id": SCOPE["user_id"], "agent_id": VICTIM_AGENT, "query": "hello",
            **fields}


def gateway_foreign_turn_id(h: Hostile, uid: str) -> Sent:
    """Another tenant names the victim's turn id: its own turn, in its own conversation (no 409)."""
    stored = inside(OTHER_TENANT, VICTIM_TURNS[0])
    with h.http(OTHER_TENANT) as http:
        accepted = http.post("/v1/turns", json=gateway_body(turn_id=VICTIM_TURNS[0], query="mine"))
    assert accepted.status_code == 202 and accepted.json()["created"] is True, accepted.text
    return Sent(stream=stored, turns=(stored,), conversations=(f"c-{stored}",), tenants=(OTHER_TENANT,),
                front_door=True)


def gateway_foreign_conversation(h: Hostile, uid: str) -> Sent:
    """Another tenant names the first tenant's other conversation: that names its own (missing) one."""
    tid = f"g-{uid}"[:60]
    with h.http(OTHER_TENANT) as http:
        accepted = http.post("/v1/turns", json=gateway_body(turn_id=tid, conversation_id=f"c-{OTHER_TURN}",
                                                            parent_message_id=OTHER_TURN))
    assert accepted.status_code == 202, accepted.text
    stored = inside(OTHER_TENANT, tid)
    return Sent(stream=stored, turns=(stored,), front_door=True)


def gateway_refused(method: str, path: str, status: int, code: str, **request: Any) -> Callable[[Hostile, str], Sent]:
    """A request the gateway answers `status` in the `{"code", "message"}` envelope, writing nothing."""

    def send(h: Hostile, uid: str) -> Sent:
        with h.http(SCOPE["tenant_id"]) as http:
            response = http.request(method, path.replace("<victim>", VICTIM_TURNS[-1]), **request)

        def check() -> None:
            assert (response.status_code, response.json()["code"]) == (status, code), response.text
            assert set(response.json()) >= {"code", "message"}  # never Starlette's bare {"detail"}

        return Sent(check=check, front_door=True)

    return send


JSON = {"Content-Type": "application/json"}


V2 = VICTIM_TURNS[-1]
ENDS_ANOTHER_MESSAGES_TURN = (
    "run_admit ends the turn a refused message names (its request's turn id, else its message id) through "
    "Runtime.end_turn without checking that this message admitted it: a running turn ends failed/invalid_request"
)
CASES: list[Case] = [
    # ids that end in the key suffixes the store uses, aimed at the victim's keys
    Case("turn id <victim>:claim", "raw resolve", unnamed_turn(turn_id=f"{V2}:claim", conversation_id=VICTIM_CID),
         Terminal("failed", "invalid_request")),
    Case("turn id <victim>:cancel", "raw resolve", unnamed_turn(turn_id=f"{V2}:cancel", conversation_id=VICTIM_CID),
         Terminal("failed", "invalid_request")),
    Case("turn id <finished>:events", "raw resolve", unnamed_turn(turn_id=f"{VICTIM_TURNS[0]}:events"),
         Terminal("failed", "invalid_request")),
    Case("turn id <victim>:art:resolve", "raw resolve", unnamed_turn(turn_id=f"{V2}:art:resolve"),
         Terminal("failed", "invalid_request")),
    Case("conversation id <victim cid>}:lease", "raw resolve", refused_turn(conversation_id=f"{VICTIM_CID}}}:lease"),
         Terminal("failed", "invalid_request")),
    Case("agent id echo:v:1", "raw resolve", refused_turn(agent_id=f"{VICTIM_AGENT}:v:1",
                                                          conversation_id=VICTIM_CID),
         Terminal("failed", "invalid_request")),
    Case("turn id {<victim cid>}", "raw resolve", unnamed_turn(turn_id=f"{{{VICTIM_CID}}}"),
         Terminal("failed", "invalid_request")),
    Case("conversation id <victim cid>}", "raw resolve", refused_turn(conversation_id=f"{VICTIM_CID}}}"),
         Terminal("failed", "invalid_request")),
    Case("turn id with a space", "raw resolve", unnamed_turn(turn_id="victim 2"),
         Terminal("failed", "invalid_request")),
    Case("turn id *", "raw resolve", unnamed_turn(turn_id="*"), Terminal("failed", "invalid_request")),
    Case("turn id <victim>\\n", "raw resolve", unnamed_turn(turn_id=f"{V2}\n", conversation_id=VICTIM_CID),
         Terminal("failed", "invalid_request")),
    Case("user id <u1>\\n", "raw resolve", refused_turn(user_id="u1\n", conversation_id=VICTIM_CID),
         Terminal("failed", "invalid_request")),
    Case("turn id in unicode letters", "raw resolve", unnamed_turn(turn_id="tür-ид-名"),
         Terminal("failed", "invalid_request")),
    Case("turn id of 121 characters", "raw resolve", unnamed_turn(turn_id="t" * 121),
         Terminal("failed", "invalid_request")),
    Case("turn id of 120 characters, continued", "client.submit x2", longest_turn_id, Terminal("succeeded")),
    # a turn that is running
    Case("turn id X:claim while X streams", "client.submit + raw resolve", claim_of_running(False),
         Terminal("failed", "invalid_request")),
    Case("turn id Y:claim while Y streams, then cancel Y", "client.submit + raw resolve + client.cancel",
         claim_of_running(True), Terminal("failed", "invalid_request")),
    Case("duplicate of a streaming turn", "client.submit + raw resolve", duplicate_of_running(malformed=False),
         Terminal("succeeded")),
    Case("malformed duplicate of a streaming turn", "client.submit + raw resolve",
         duplicate_of_running(malformed=True), DeadLetter("refused_duplicate: invalid_request")),
    Case("args: [] with a streaming turn's id as message id", "client.submit + raw resolve",
         message_id_of_running, DeadLetter("refused_duplicate: invalid_request")),
    # unicode
    Case("lone surrogate in the query", "raw resolve (JSON text \\ud800)",
         refused_turn(query="\ud800 where?", conversation_id=VICTIM_CID), Terminal("failed", "invalid_request")),
    Case("emoji and CJK query", "raw resolve", emoji_query, Terminal("succeeded")),
    # depth and size
    Case("request nested 100,000 deep", "raw resolve", too_deep, DeadLetter("too_deep", actor="")),
    Case("inputs holding objects", "raw resolve", refused_turn(inputs={"a": {"b": 1}}, conversation_id=VICTIM_CID),
         Terminal("failed", "invalid_request")),
    Case(f"query of {MAX_QUERY_CHARS + 1} characters", "raw resolve",
         refused_turn(query=big(MAX_QUERY_CHARS + 1), conversation_id=VICTIM_CID),
         Terminal("failed", "invalid_request")),
    Case("5 MB query", "raw resolve", refused_turn(query=big(5_000_000), conversation_id=VICTIM_CID),
         Terminal("failed", "invalid_request")),
    Case("5 MB context", "raw resolve", refused_turn(query="short", context=big(5_000_000),
                                                     conversation_id=VICTIM_CID),
         Terminal("failed", "invalid_request")),
    Case("context over the model's token window", "raw resolve", context_over_the_window,
         Terminal("failed", "context_too_large")),
    # types
    Case("query is a number", "raw resolve", refused_turn(query=42, conversation_id=VICTIM_CID),
         Terminal("failed", "invalid_request")),
    Case("files is a string", "raw resolve", refused_turn(files="a.png", conversation_id=VICTIM_CID),
         Terminal("failed", "invalid_request")),
    Case("unknown field", "raw resolve", refused_turn(conversation_idd=VICTIM_CID),
         Terminal("failed", "invalid_request")),
    Case("schema v2", "raw resolve", refused_turn(schema="threadline.turn/v2", conversation_id=VICTIM_CID),
         Terminal("failed", "invalid_request")),
    Case("args: []", "raw resolve", no_args, Terminal("failed", "invalid_request")),
    Case("args: [request, extra]", "raw resolve", extra_args, Terminal("failed", "invalid_request")),
    Case("kwargs present", "raw resolve", with_kwargs, Terminal("failed", "invalid_request")),
    Case("history message with garbage args", "raw history", envelope(["garbage"]),
         DeadLetter("invalid_envelope", queue="history", actor="history")),
    Case("history message for the finished victim turn", "raw history", envelope_of_finished, Nothing()),
    Case("history message for a turn never submitted", "raw history", envelope_of_unknown_turn, Nothing()),
    # foreign scope, on the victim conversation
    Case("another user's turn", "raw resolve", refused_turn(user_id="u2", conversation_id=VICTIM_CID),
         Terminal("failed", "forbidden")),
    Case("parent message of another conversation", "raw resolve",
         refused_turn(conversation_id=VICTIM_CID, parent_message_id=OTHER_TURN),
         Terminal("failed", "invalid_request")),
    Case("resume of a conversation not paused", "raw resolve",
         refused_turn(conversation_id=VICTIM_CID, query="", deferred_tool_results={"calls": {"call-1": "yes"}}),
         Terminal("failed", "invalid_request")),
    Case("invoke_from draft on the published victim", "raw resolve",
         refused_turn(conversation_id=VICTIM_CID, invoke_from="draft", draft_id="d1"),
         Terminal("failed", "forbidden")),
    Case("unknown agent", "raw resolve", refused_turn(agent_id="no-such-agent", conversation_id=VICTIM_CID),
         Terminal("failed", "agent_not_found")),
    Case("unknown conversation", "raw resolve", refused_turn(conversation_id="c-no-such-conversation"),
         Terminal("failed", "conversation_not_found")),
    # actors and control
    Case("redis_message_id is not its hash field", "raw resolve", mismatched_redis_id,
         DeadLetter("malformed: options.redis_message_id")),
    Case("lone surrogate in the message id", "raw resolve (id bytes ED B0 80)", surrogate_message_id,
         DeadLetter("malformed: options.redis_message_id")),
    Case("unknown actor on the resolve queue", "raw resolve", unknown_actor,
         DeadLetter("unknown_actor: no_such_actor", actor="no_such_actor")),
    Case("cancel args []", "raw control", bad_cancel([]),
         DeadLetter("invalid_cancel_arguments", queue="control", actor="cancel")),
    Case("cancel args ['*']", "raw control", bad_cancel(["*"]),
         DeadLetter("invalid_cancel_arguments", queue="control", actor="cancel")),
    Case("cancel args [123]", "raw control", bad_cancel([123]),
         DeadLetter("invalid_cancel_arguments", queue="control", actor="cancel")),
    Case("cancel args ['ok-id', {'a': 1}]", "raw control", bad_cancel(["ok-id", {"a": 1}]),
         DeadLetter("invalid_cancel_arguments", queue="control", actor="cancel")),
    Case("cancel args ['a:b']", "raw control", bad_cancel(["a:b"]),
         DeadLetter("invalid_cancel_arguments", queue="control", actor="cancel")),
    Case("cancel args ['<victim>:claim']", "raw control", bad_cancel([f"{V2}:claim"]),
         DeadLetter("invalid_cancel_arguments", queue="control", actor="cancel")),
    Case("cancel of a finished turn", "client.cancel + raw control", cancel_finished, Nothing()),
    Case("cancel of a turn not submitted yet", "raw control", cancel_ahead, Nothing()),
    # duplicates
    Case("same turn id twice", "raw resolve x2", same_turn_twice, Terminal("succeeded")),
    Case("finished victim turn again", "raw resolve", duplicate_of_finished("raw"), Nothing()),
    Case("finished victim turn again", "client.submit", duplicate_of_finished("client"), Nothing()),
    Case("finished victim turn again", "raw resolve + docs/protocol.md's ZADD NX", duplicate_of_finished("zadd"),
         Nothing()),
    Case("refused first turn", "client.submit", refused_first_turn_by_client, Terminal("failed", "invalid_request")),
    Case("conversation id <victim cid>}:lease", "client.submit", bad_conversation_id_by_client,
         Terminal("failed", "invalid_request")),
    # a conversation is written only by turns of its tenant; no message is written twice (issue 21)
    Case("another tenant's first turn whose conversation exists (record expired)", "raw resolve",
         expired_turn_again(OTHER_TENANT), Terminal("failed", "forbidden")),
    Case("the same tenant's first turn whose conversation exists (record expired)", "raw resolve",
         own_expired_turn_again, Terminal("failed", "invalid_request")),
    Case("8 MB of inputs", "raw resolve", refused_turn(inputs={f"k{i}": "x" * 8_000 for i in range(1_000)},
                                                       conversation_id=VICTIM_CID),
         Terminal("failed", "invalid_request")),
    Case("a tenant's turn id again after its record expired", "gateway POST", gateway_reused_turn_id,
         Terminal("failed", "invalid_request")),
    Case("another tenant names the victim's turn id", "gateway POST", gateway_foreign_turn_id, Terminal("succeeded")),
    Case("another tenant names another tenant's conversation", "gateway POST", gateway_foreign_conversation,
         Terminal("failed", "conversation_not_found")),
    Case("lone surrogate in turn_id", "gateway POST",
         gateway_refused("POST", "/v1/turns", 422, "invalid_request", content=b'{"turn_id": "\\ud800"}',
                         headers=JSON), Nothing()),
    Case("lone surrogate in a field name", "gateway POST",
         gateway_refused("POST", "/v1/turns", 422, "invalid_request", content=b'{"\\ud800": 1}', headers=JSON),
         Nothing()),
    Case("JSON nested 100,000 deep", "gateway POST",
         gateway_refused("POST", "/v1/turns", 422, "invalid_request",
                         content=b'{"inputs": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", headers=JSON), Nothing()),
    Case("invalid UTF-8", "gateway POST",
         gateway_refused("POST", "/v1/turns", 400, "invalid_request", content=b'{"query": "\xff"}', headers=JSON),
         Nothing()),
    Case("unrouted path", "gateway GET", gateway_refused("GET", "/v1/nothing-here", 404, "not_found"), Nothing()),
    Case("3 MB body", "gateway POST", gateway_refused("POST", "/v1/turns", 413, "payload_too_large",
                                                      content=b"x" * 3_000_000, headers=JSON), Nothing()),
    Case("?after=1-0 and a newline", "gateway GET",
         gateway_refused("GET", "/v1/turns/<victim>/events?after=1-0%0A", 422, "invalid_request"), Nothing()),
]


# --- running a case -------------------------------------------------------------------------------

#: case id -> (name, sent as, expected, observed), for the table.
RESULTS: dict[str, tuple[str, str, str, str]] = {}
#: Cases that met every check, with what they sent, for the last look; and every case's dead letters.
PASSED: list[tuple[Case, Sent]] = []
DEAD_LETTERS: dict[str, int] = {}


def case_id(case: Case) -> str:
    return f"{case.name} [{case.sent_as}]"


def slug(case: Case) -> str:
    words = re.sub(r"[^A-Za-z0-9]+", "-", case_id(case)).strip("-").lower()
    return f"{words[:48].strip('-')}-{uuid.uuid4().hex[:6]}"


def allowed(h: Hostile, sent: Sent) -> Callable[[str], bool]:
    k = h.keys
    exact = {k.dead_letters(), *(f"{h.prefix}:{x}" for x in sent.extra)}
    for tid in sent.turns:
        exact |= {k.turn(tid), k.events(tid)}
    exact |= {k.usage(t) for t in sent.tenants} | {k.tenant_conversations(t) for t in sent.tenants}
    exact |= {k.conversation(c) for c in sent.conversations}
    prefixes: tuple[str, ...] = (k.queue(""), *(f"{k.conversation(c)}:" for c in sent.conversations))
    if sent.front_door:
        exact |= {k.api_key_used()}
        prefixes = (*prefixes, f"{h.prefix}:ratelimit:")
    return lambda key: key in exact or key.startswith(prefixes)


def observe(h: Hostile, sent: Sent, new_dead: list[dict[str, str]], stray: list[str], leftovers: list[str],
            before_events: dict[str, list[Any]]) -> str:
    parts = []
    if sent.stream in before_events:
        new = h.events(sent.stream)[len(before_events[sent.stream]):]
        parts.append(f"new events on {sent.stream}: {[e.type for e in new]}" if new else f"{sent.stream} unchanged")
    elif sent.stream:
        terminals = h.terminals(sent.stream)
        where = "message id" if sent.stream.startswith("m-") else "turn id"
        shown = " + ".join(str(Terminal(t.type, getattr(t, "code", None))) for t in terminals)
        parts.append(f"{shown or ('no terminal' if h.events(sent.stream) else 'no event')} on its {where}'s stream")
    parts += [f"dead-letter {d['reason']!r}" for d in new_dead]
    for tid in sent.side:
        got = h.terminals(tid)
        parts.append(f"{tid[:12]}: " + (" + ".join(str(Terminal(t.type, getattr(t, "code", None))) for t in got)
                                         or "no terminal"))
    if sent.named:
        which = "its message id's stream" if sent.named.startswith("m-") else "the turn it names"
        got = [str(Terminal(t.type, getattr(t, "code", None))) for t in h.terminals(sent.named)]
        parts.append(f"{which}: {' + '.join(got) or 'nothing'}")
    if leftovers:
        kept = (re.sub(r"__acks__\.[^.]+\.", "__acks__.<worker>.", x.split(":q:")[-1]) for x in leftovers)
        parts.append(f"dramatiq kept {', '.join(sorted(kept))}")
    if stray:
        shown = [s.removeprefix(h.prefix + ":") for s in stray]
        parts.append(f"wrote {', '.join(shown[:2])}" + (f" and {len(shown) - 2} more keys" if len(shown) > 2 else ""))
    return "; ".join(parts) or "nothing"


def check_outcome(h: Hostile, case: Case, sent: Sent, new_dead: list[dict[str, str]]) -> None:
    expect = case.expect
    if isinstance(expect, DeadLetter):
        want = {"queue": expect.queue, "message_id": sent.message_id, "actor": expect.actor, "reason": expect.reason}
        assert new_dead == [want]
    else:
        assert new_dead == [], "no dead letter"
    if isinstance(expect, Terminal):
        terminals = h.terminals(sent.stream)
        assert [(t.type, getattr(t, "code", None)) for t in terminals] == [(expect.type, expect.code)]
        seqs = [e.seq for e in h.events(sent.stream)]
        assert seqs == list(range(1, len(seqs) + 1)), "seq 1, 2, ... without gaps"
    for tid, want in sent.side.items():
        assert [(t.type, getattr(t, "code", None)) for t in h.terminals(tid)] == [(want.type, want.code)], tid


def run_case(h: Hostile, case: Case) -> None:
    h.quiesce()
    before, dead_mark = dump(h.redis, h.prefix), h.last_dead_letter()
    before_events = {t: h.events(t) for t in VICTIM_TURNS}
    sent = case.send(h, slug(case))
    # every outcome is written before its message is acked, and every hand-over enqueues the next
    # message in the script that ends the stage: once dramatiq holds nothing, the case has settled
    settled = h.settle(3.0 if case.bug else WAIT_S)
    # the turns a case expects to end have ended before anything is compared, its own included: the
    # scan of dramatiq's keys read empty twice while a gateway-submitted turn was still at its invoke
    # stage (once, in a fresh clone's run; why it read empty is not known)
    ending = [*sent.side, *([sent.stream] if isinstance(case.expect, Terminal) and sent.stream else [])]
    if ending:
        for tid in ending:
            h.wait_terminal(tid, timeout_s=3.0 if case.bug else WAIT_S)
        settled = settled and h.settle(3.0 if case.bug else WAIT_S)
    leftovers = [] if settled else h.drop_leftovers()
    new_dead = [fields for _, fields in h.dead_letters(dead_mark)]
    after = dump(h.redis, h.prefix)
    is_allowed = allowed(h, sent)
    stray = [key for key in changed_keys(before, after) if not is_allowed(key)]
    observed = observe(h, sent, new_dead, stray, leftovers, before_events)
    RESULTS[case_id(case)] = (case.name, case.sent_as, str(case.expect), observed)
    DEAD_LETTERS[case_id(case)] = len(new_dead)
    h.owned |= {key for key in after if is_allowed(key)}
    h.owned_conversations |= set(sent.conversations)
    if stray:
        restore(h.redis, before, stray)  # so that this case's damage stays in this case
    # (a) the outcome, exactly once
    check_outcome(h, case, sent, new_dead)
    if isinstance(case.expect, Nothing):
        assert h.events(sent.stream) == before_events.get(sent.stream, [])
    if sent.check is not None:
        sent.check()
    # (b) nothing else changed: the victim's keys byte-identical, its lease fence included; dramatiq's
    # bookkeeping drained
    assert stray == [], {key: (before.get(key), after.get(key)) for key in stray}
    assert leftovers == [], "dramatiq's bookkeeping never drained"
    # (c) the workers are alive and the victim conversation goes on
    h.probe()
    PASSED.append((case, sent))


def recheck(h: Hostile, case: Case, sent: Sent) -> None:
    """A case's outcome is still there, still exactly once, after every later case."""
    expect = case.expect
    if isinstance(expect, Terminal):
        got = [(t.type, getattr(t, "code", None)) for t in h.terminals(sent.stream)]
        assert got == [(expect.type, expect.code)], case_id(case)
    elif isinstance(expect, DeadLetter):
        entries = [f for _, f in h.dead_letters() if f["message_id"] == sent.message_id]
        assert len(entries) == 1 and entries[0]["reason"] == expect.reason, case_id(case)


@pytest.mark.parametrize("case", [
    pytest.param(c, id=case_id(c), marks=[pytest.mark.xfail(strict=True, reason=c.bug)] if c.bug else [])
    for c in CASES
])
def test_hostile_input(hostile: Hostile, case: Case) -> None:
    run_case(hostile, case)


def test_catalogue_leaves_nothing_behind(hostile: Hostile) -> None:
    """After every case: only the cases' own keys, the victim's, the agents', dramatiq's bookkeeping."""
    h, k = hostile, hostile.keys
    print_table()
    for case, sent in PASSED:
        recheck(h, case, sent)
    assert len(h.dead_letters()) == sum(DEAD_LETTERS.values()), "no dead letter but the cases' own"
    # the victim conversation continues from its tip, and sees every turn on its thread
    victim = h.client.conversation(VICTIM_CID)
    assert victim is not None and victim.tip == (h.probes[-1] if h.probes else VICTIM_TURNS[-1])
    last = h.client.submit(request("victim-last", query="still there?", conversation_id=VICTIM_CID))
    terminal = h.wait_terminal(last)
    assert isinstance(terminal, ev.Succeeded), terminal
    expected = [*VICTIM_QUERIES, *([f"probe {len(h.probes)}"] if h.probes else []), "still there?"]
    assert users_seen(terminal.answer) == expected
    h.quiesce()
    assert not h.redis.exists(k.running())
    known_turns = {*VICTIM_TURNS, OTHER_TURN, *h.probes, last}
    expected_keys = {
        k.layout(), k.agents(), k.agent(VICTIM_AGENT), k.agent_version(VICTIM_AGENT, 1), k.agent(SLOW_AGENT),
        k.agent_version(SLOW_AGENT, 1), k.usage("t1"), k.tenant_conversations("t1"), k.dead_letters(),
        *(key for a in (VICTIM_AGENT, SLOW_AGENT) for key in (k.agent_versions(a), k.agent_activations(a))),
        *(key for t in known_turns for key in (k.turn(t), k.events(t))),
    }
    # the victim conversation's keys are the documented ones, and no more
    victim_keys = {k.conversation(VICTIM_CID), k.messages(VICTIM_CID), k.message_order(VICTIM_CID),
                   k.snapshots(VICTIM_CID), k.lease(VICTIM_CID), k.token_counts(VICTIM_CID),
                   k.decisions(VICTIM_CID)}
    assert {key_name(key) for key in h.redis.scan_iter(f"{k.conversation(VICTIM_CID)}*")} == victim_keys
    conversations = {f"c-{OTHER_TURN}", *h.owned_conversations}
    expected_keys |= victim_keys | {k.conversation(c) for c in conversations}
    prefixes = (k.queue(""), *(f"{k.conversation(c)}:" for c in conversations))
    stray = []
    for raw in h.redis.scan_iter(f"{h.prefix}:*", count=1000):
        key = key_name(raw)
        if key in expected_keys or key in h.owned or key.startswith(prefixes) or liveness_key(key, h.prefix):
            continue
        stray.append(key)
    assert sorted(stray) == []
    assert h.pool.alive(), h.pool.log_tail()


def print_table() -> None:
    if not RESULTS:
        return
    rows = [("case", "sent as", "expected", "observed"), *RESULTS.values()]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    print()
    for name, sent, expected, observed in rows:
        print(f"{name:<{widths[0]}}  {sent:<{widths[1]}}  {expected:<{widths[2]}}  {observed}")
