"""Long-term memory in Redis: one user's partitions (records, history, vectors, meta, the turns
waiting for extraction), the scripts that change them (`scripts/memory_*.lua`) and two faces over
the same logic — `MemoryStore` (async: workers, the gateway) and `SyncMemoryStore` (the sync `Client`).

Layout (every key built by `Keys.memory`, all of one user under the hash tag `{<tenant>/<user>}`, so
forgetting a user is one script over one Redis Cluster slot): per partition `<prefix>:mem:{t/u}<suffix>:`
`records` (id -> current record JSON), `facts` (fact key -> current id), `history` and `history_order`
(closed records, trimmed to `max_history`), `vectors` (note id -> packed float32), `meta` (revision,
updated_at, the scope's ids), `pending` (turn id -> the turn, waiting for extraction), `queued` (the
debounce flag), `lease` (the one extraction running), `turns` (consolidated turn ids: the redelivery
guard); per user `<prefix>:mem:{t/u}:partitions` (the suffixes in use).

The logic is written once, as plans: generators that yield the Redis steps they need (`Commands`, a
pipeline of plain commands; `Call`, one script) and receive the replies. Each face only runs steps.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Generator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal, TypeVar, cast

import redis
import redis.asyncio as aioredis
from pydantic import BaseModel, ConfigDict

from threadline.pipeline.consolidation import Consolidation, forget_conversation
from threadline.pipeline.memory import MemoryRecord, Scope, in_scope, record_from_json, record_to_json
from threadline.workers.protocol.keys import Keys
from threadline.workers.protocol.schema import text
from threadline.workers.storage import lua

#: Consolidated turn ids kept per partition (a redelivered memory message older than that many turns
#: finds its turns gone from `pending` anyway).
TURNS_KEPT = 1000
#: Closed records kept per partition unless the agent's `max_history` says otherwise.
DEFAULT_MAX_HISTORY = 200
#: Rounds of read-and-retry when concurrent writes keep moving a partition's revision.
ATTEMPTS = 8
MEMORY_SCRIPTS: tuple[lua.ScriptName, ...] = ("memory_apply", "memory_forget", "memory_note", "memory_lease")
_PARTS = ("records", "facts", "history", "history_order", "vectors", "meta", "pending", "queued", "lease", "turns")


@dataclass(frozen=True, slots=True)
class MemoryKeys:
    """Every key of one memory partition, and the user's partitions set."""

    partition: str
    #: "" (the user partition), `/app/<app>` or `/agent/<agent>`: the member of `partitions`.
    suffix: str
    records: str
    facts: str
    history: str
    history_order: str
    vectors: str
    meta: str
    pending: str
    queued: str
    lease: str
    turns: str
    partitions: str

    @property
    def all(self) -> tuple[str, ...]:
        """The partition's own keys (not the user's partitions set)."""
        return (self.records, self.facts, self.history, self.history_order, self.vectors, self.meta, self.pending,
                self.queued, self.lease, self.turns)


def suffix_of(scope: Scope) -> str:
    return scope.partition[len(scope.user_tag):]


def memory_keys(keys: Keys, scope: Scope) -> MemoryKeys:
    tag, suffix = scope.user_tag, suffix_of(scope)
    parts = {part: keys.memory(tag, suffix, part) for part in _PARTS}
    return MemoryKeys(partition=scope.partition, suffix=suffix, partitions=user_partitions_key(keys, scope), **parts)


def user_partitions_key(keys: Keys, scope: Scope) -> str:
    return keys.memory_partitions(scope.user_tag)


def scope_of(tenant_id: str, user_id: str, suffix: str) -> Scope:
    """The scope a stored suffix names ("" , `/app/<id>`, `/agent/<id>`)."""
    _, kind, ident = [*suffix.split("/"), "", "", ""][:3]
    if kind == "app":
        return Scope(tenant_id, user_id, app_id=ident)
    if kind == "agent":
        return Scope(tenant_id, user_id, agent_id=ident)
    return Scope(tenant_id, user_id)


def scope_of_partition(partition: str) -> Scope:
    """The scope of a `Scope.partition` string (`t/u`, `t/u/app/a`, `t/u/agent/a`)."""
    tenant_id, user_id, *rest = partition.split("/")
    return scope_of(tenant_id, user_id, "/" + "/".join(rest) if rest else "")


# --- pending turns ----------------------------------------------------------------------------------


class PendingTurn(BaseModel):
    """A turn that ended and waits for its partition's extraction (the `pending` hash, JSON)."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    turn_id: str
    conversation_id: str
    message_id: str
    ended_at: float
    agent_id: str
    config_ref: str


def pending_from(raw: Mapping[bytes, bytes]) -> list[PendingTurn]:
    """The pending turns, oldest first (a row that does not parse is left out)."""
    found = []
    for value in raw.values():
        try:
            found.append(PendingTurn.model_validate_json(value))
        except ValueError:
            continue
    return sorted(found, key=lambda p: (p.ended_at, p.turn_id))


# --- command builders (no I/O) ----------------------------------------------------------------------

ScriptCall = tuple[lua.ScriptName, list[str], list[str | bytes]]


def pack_vector(vector: Sequence[float]) -> bytes:
    return struct.pack(f"<{len(vector)}f", *vector)


def unpack_vector(blob: bytes) -> tuple[float, ...]:
    return struct.unpack(f"<{len(blob) // 4}f", blob[: len(blob) // 4 * 4])


def apply_call(mk: MemoryKeys, consolidation: Consolidation, *, revision: int, turn_id: str | None, now: float,
               turn_ids: Sequence[str] = (), unpend: Sequence[str] = (),
               max_history: int = DEFAULT_MAX_HISTORY) -> ScriptCall:
    """memory_apply.lua for `consolidation`, guarded by `revision` (the one read). `turn_id` /
    `turn_ids`: the turns it consolidated (marked done, taken off `pending`; refused if one is no
    longer pending); `unpend`: pending turns to drop without marking them."""
    scope = scope_of_partition(mk.partition)
    writes, blobs, vectors = [], [], []
    for r in consolidation.writes:
        writes.append({"id": r.id, "kind": r.kind, "key": r.key, "current": r.current, "invalid_at": r.invalid_at,
                       "vector": r.current and r.vector is not None})
        blobs.append(record_to_json(replace(r, vector=None)))
        if r.current and r.vector is not None:
            vectors.append(pack_vector(r.vector))
    done = [*([turn_id] if turn_id else []), *turn_ids]
    arg = lua.payload(revision=revision, now=now, suffix=mk.suffix, max_history=max_history, turns_kept=TURNS_KEPT,
                      turn_ids=done, unpend=list(unpend), deletes=list(consolidation.deletes), writes=writes,
                      meta={"tenant_id": scope.tenant_id, "user_id": scope.user_id, "app_id": scope.app_id or "",
                            "agent_id": scope.agent_id or "", "partition": mk.partition})
    return "memory_apply", list(_apply_keys(mk)), [arg, *blobs, *vectors]


def _apply_keys(mk: MemoryKeys) -> tuple[str, ...]:
    return (mk.records, mk.facts, mk.history, mk.history_order, mk.vectors, mk.meta, mk.turns, mk.pending,
            mk.partitions)


def forget_all_call(keys: Keys, scope: Scope, suffixes: Sequence[str]) -> ScriptCall:
    """memory_forget.lua deleting every partition of `scope`'s user, the ones in `suffixes` (read
    from the partitions set; the user partition "" is always included)."""
    named = sorted({"", *suffixes})
    user = Scope(scope.tenant_id, scope.user_id)
    owned = [key for s in named for key in memory_keys(keys, scope_of(scope.tenant_id, scope.user_id, s)).all]
    return "memory_forget", [user_partitions_key(keys, user), *owned], [lua.payload(suffixes=named, all=True)]


def expire_call(mk: MemoryKeys, *, idle_before: float) -> ScriptCall:
    """memory_forget.lua deleting one partition unless it was written after `idle_before` (retention)."""
    arg = lua.payload(suffixes=[mk.suffix], all=False, idle_before=idle_before, meta=2 + mk.all.index(mk.meta))
    return "memory_forget", [mk.partitions, *mk.all], [arg]


def note_call(mk: MemoryKeys, turn: PendingTurn, *, message: tuple[str, str, bytes], channel: str,
              queue_keys: tuple[str, str] | None, flag_ms: int) -> ScriptCall:
    """memory_note.lua: `turn` joins the partition's pending turns; `message` (queue, id, body) is
    enqueued on `queue_keys` (messages hash, list) unless one is queued already (None: the caller
    enqueues it when the answer is 'queued')."""
    queue, message_id, data = message
    arg = lua.payload(turn_id=turn.turn_id, suffix=mk.suffix, flag_ms=flag_ms, message_id=message_id,
                      channel=channel, queue=queue)
    return ("memory_note", [mk.pending, mk.queued, mk.turns, mk.partitions, *(queue_keys or ())],
            [arg, turn.model_dump_json(), data])


LeaseOp = Literal["take", "renew", "release"]


def lease_call(mk: MemoryKeys, op: LeaseOp, token: str, *, lease_ms: int) -> ScriptCall:
    return "memory_lease", [mk.lease, mk.pending, mk.queued], [lua.payload(op=op, token=token, lease_ms=lease_ms)]


# --- parsers ----------------------------------------------------------------------------------------


def records_from(current: Mapping[bytes, bytes], history: Mapping[bytes, bytes], scope: Scope, *,
                 vectors: Mapping[bytes, bytes] | None = None) -> list[MemoryRecord]:
    """The stored records of `scope`'s partition (current, then closed), each checked with
    `in_scope`: a record of another partition is never returned, whatever storage held."""
    found = []
    for raw in (*current.values(), *history.values()):
        record = record_from_json(raw)
        if not in_scope(record, scope):
            continue
        blob = (vectors or {}).get(record.id.encode()) if record.current else None
        found.append(replace(record, vector=unpack_vector(blob)) if blob else record)
    return sorted(found, key=lambda r: (not r.current, r.recorded_at, r.id))


def revision_from(meta: Mapping[bytes, bytes] | bytes | str | None) -> int:
    """A partition's revision (0: never written), from its meta hash or the field's value."""
    value = meta.get(b"revision") if isinstance(meta, Mapping) else meta
    return int(text(value)) if value else 0


def applied_from(reply: Sequence[Any]) -> bool:
    return int(reply[0]) == 1


# --- plans: the logic, once -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Commands:
    """Plain commands run in one pipeline (no transaction): (method name, args) each."""

    commands: tuple[tuple[str, tuple[Any, ...]], ...]


@dataclass(frozen=True, slots=True)
class Call:
    script: ScriptCall


Step = Commands | Call
T = TypeVar("T")
Plan = Generator[Step, Any, T]


def _read_plan(mk: MemoryKeys, scope: Scope, *, history: bool = True) -> Plan[tuple[list[MemoryRecord], int]]:
    """The partition's records (closed ones too with `history`) and its revision, in one round trip."""
    read = [mk.records, mk.vectors, mk.meta, *([mk.history] if history else [])]
    current, vectors, meta, *closed = yield Commands(tuple(("hgetall", (key,)) for key in read))
    return records_from(current, closed[0] if closed else {}, scope, vectors=vectors), revision_from(meta)


def _apply_plan(keys: Keys, scope: Scope, consolidation: Consolidation, *, revision: int, now: float,
                **options: Any) -> Plan[bool]:
    mk = memory_keys(keys, scope)
    done = applied_from((yield Call(apply_call(mk, consolidation, revision=revision, now=now, **options))))
    if done and consolidation.changed:
        yield Commands((("zadd", (keys.memory_activity(), {scope.partition: now})),))
    return done


def _suffixes_plan(keys: Keys, scope: Scope) -> Plan[list[str]]:
    (members,) = yield Commands((("smembers", (user_partitions_key(keys, scope),)),))
    return sorted({"", *(text(m) for m in members)})


def _forget_all_plan(keys: Keys, scope: Scope) -> Plan[int]:
    for _ in range(ATTEMPTS):
        suffixes = yield from _suffixes_plan(keys, scope)
        deleted = int((yield Call(forget_all_call(keys, scope, suffixes))))
        if deleted >= 0:
            partitions = [scope_of(scope.tenant_id, scope.user_id, s).partition for s in suffixes]
            yield Commands((("zrem", (keys.memory_activity(), *partitions)),))
            return deleted
    raise RuntimeError("the user's memory partitions kept changing; try again")


def _forget_conversation_plan(keys: Keys, tenant_id: str, conversation_id: str, user_id: str, *,
                              now: float) -> Plan[int]:
    """Every record extracted from the conversation, in every partition of the user, deleted (and
    its turns still pending dropped); the number of records deleted."""
    deleted = 0
    for suffix in (yield from _suffixes_plan(keys, Scope(tenant_id, user_id))):
        scope = scope_of(tenant_id, user_id, suffix)
        mk = memory_keys(keys, scope)
        for _ in range(ATTEMPTS):
            records, revision = yield from _read_plan(mk, scope)
            (raw,) = yield Commands((("hgetall", (mk.pending,)),))
            drop = [p.turn_id for p in pending_from(raw) if p.conversation_id == conversation_id]
            forgotten = forget_conversation(records, scope=scope, conversation_id=conversation_id)
            if not (forgotten.changed or drop):
                break
            if (yield from _apply_plan(keys, scope, forgotten, revision=revision, now=now, turn_id=None, unpend=drop)):
                deleted += len(forgotten.deletes)
                break
    return deleted


# --- the two faces ----------------------------------------------------------------------------------


class MemoryStore:
    """Long-term memory over an async connection (workers, the gateway)."""

    def __init__(self, client: aioredis.Redis, keys: Keys) -> None:
        self.redis = client
        self.keys = keys
        self._scripts = {name: client.register_script(lua.source(name)) for name in MEMORY_SCRIPTS}

    async def run(self, plan: Plan[T]) -> T:
        reply: Any = None
        try:
            while True:
                step = plan.send(reply)
                reply = await self._step(step)
        except StopIteration as stop:
            return cast(T, stop.value)

    async def _step(self, step: Step) -> Any:
        if isinstance(step, Call):
            name, keys, argv = step.script
            return await self._scripts[name](keys=keys, args=argv)
        async with self.redis.pipeline(transaction=False) as pipe:
            for method, args in step.commands:
                getattr(pipe, method)(*args)
            return await pipe.execute()

    async def read(self, scope: Scope) -> tuple[list[MemoryRecord], int]:
        """The partition's records (current, then closed) and its revision."""
        return await self.run(_read_plan(memory_keys(self.keys, scope), scope))

    async def current(self, scope: Scope) -> list[MemoryRecord]:
        return (await self.current_and_revision(scope))[0]

    async def current_and_revision(self, scope: Scope) -> tuple[list[MemoryRecord], int]:
        return await self.run(_read_plan(memory_keys(self.keys, scope), scope, history=False))

    async def revision(self, scope: Scope) -> int:
        """The partition's revision alone (one field: what a cache of its records is checked by)."""
        return revision_from(await self.redis.hget(memory_keys(self.keys, scope).meta, "revision"))

    async def apply(self, scope: Scope, consolidation: Consolidation, *, revision: int, turn_id: str | None = None,
                    now: float | None = None, **options: Any) -> bool:
        """Write `consolidation` unless the revision moved since `revision` was read (False: read
        again and consolidate again). `options`: `turn_ids`, `unpend`, `max_history` (`apply_call`)."""
        return await self.run(_apply_plan(self.keys, scope, consolidation, revision=revision, turn_id=turn_id,
                                          now=_now(now), **options))

    async def forget_all(self, scope_user: Scope) -> int:
        """Everything stored about the user, in every partition; the number of keys deleted."""
        return await self.run(_forget_all_plan(self.keys, scope_user))

    async def forget_conversation(self, tenant_id: str, conversation_id: str, user_id: str) -> int:
        """The records extracted from one conversation (being deleted); the number deleted."""
        return await self.run(_forget_conversation_plan(self.keys, tenant_id, conversation_id, user_id, now=_now(None)))

    async def call(self, script: ScriptCall) -> Any:
        """One of the builders' script calls (`note_call`, `lease_call`, `expire_call`)."""
        return await self.run(_one(script))


class SyncMemoryStore:
    """The same over a sync connection (the sync `Client`)."""

    def __init__(self, client: redis.Redis, keys: Keys) -> None:
        self.redis = client
        self.keys = keys
        self._scripts = {name: client.register_script(lua.source(name)) for name in MEMORY_SCRIPTS}

    def run(self, plan: Plan[T]) -> T:
        reply: Any = None
        try:
            while True:
                reply = self._step(plan.send(reply))
        except StopIteration as stop:
            return cast(T, stop.value)

    def _step(self, step: Step) -> Any:
        if isinstance(step, Call):
            name, keys, argv = step.script
            return self._scripts[name](keys=keys, args=argv)
        with self.redis.pipeline(transaction=False) as pipe:
            for method, args in step.commands:
                getattr(pipe, method)(*args)
            return pipe.execute()

    def read(self, scope: Scope) -> tuple[list[MemoryRecord], int]:
        return self.run(_read_plan(memory_keys(self.keys, scope), scope))

    def current(self, scope: Scope) -> list[MemoryRecord]:
        return self.run(_read_plan(memory_keys(self.keys, scope), scope, history=False))[0]

    def revision(self, scope: Scope) -> int:
        return revision_from(cast(bytes | None, self.redis.hget(memory_keys(self.keys, scope).meta, "revision")))

    def apply(self, scope: Scope, consolidation: Consolidation, *, revision: int, turn_id: str | None = None,
              now: float | None = None, **options: Any) -> bool:
        return self.run(_apply_plan(self.keys, scope, consolidation, revision=revision, turn_id=turn_id,
                                    now=_now(now), **options))

    def forget_all(self, scope_user: Scope) -> int:
        return self.run(_forget_all_plan(self.keys, scope_user))

    def forget_conversation(self, tenant_id: str, conversation_id: str, user_id: str) -> int:
        return self.run(_forget_conversation_plan(self.keys, tenant_id, conversation_id, user_id, now=_now(None)))

    def call(self, script: ScriptCall) -> Any:
        return self.run(_one(script))


def _one(script: ScriptCall) -> Plan[Any]:
    return (yield Call(script))


def _now(now: float | None) -> float:
    return time.time() if now is None else now
