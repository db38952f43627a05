"""The Redis store of record, as the stage runners use it (async). Every key comes from `keys.py`;
every write that must hang together is one of the scripts in `scripts/`, one typed method each."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, cast

import redis.asyncio as aioredis
from redis.commands.core import AsyncScript
from redis.exceptions import WatchError

from threadline.pipeline import events
from threadline.pipeline.config import AgentConfig, config_from_json
from threadline.pipeline.errors import AgentNotFound, ConversationNotFound
from threadline.pipeline.records import ConversationRecord, MessageRecord
from threadline.pipeline.resolve import ConfigRef
from threadline.pipeline.stages import StageGraph
from threadline.workers.protocol.keys import Keys
from threadline.workers.protocol.schema import (
    TurnState,
    as_bytes,
    conversation_from_hash,
    conversation_to_hash,
    text,
    text_map,
)
from threadline.workers.protocol.wire import build_message
from threadline.workers.settings import Settings
from threadline.workers.storage import lua

BeginStatus = Literal["go", "unknown", "done", "terminal", "cancelled", "timed_out", "duplicate"]
Admission = Literal["admitted", "waiting", "terminal", "done", "cancelled"]
DeleteStatus = Literal["deleted", "not_found", "busy"]
#: Reads of a conversation's rows a delete makes before it gives up on a conversation whose turns
#: keep coming and going between its read and its script.
DELETE_ATTEMPTS = 5
#: The placeholder for the id of the message that wakes a waiting turn (finish.lua fills it in).
WAKE_ID = "@@WAKE_ID@@"


def with_message_id(message: str, message_id: str) -> str:
    """A kept request with its id fields set, as `with_message_id` in prelude.lua does: only the two
    quoted id fields match (a quote inside the request's text is escaped)."""
    for field in ("redis_message_id", "message_id"):
        message = message.replace(f'"{field}":"{WAKE_ID}"', f'"{field}":"{message_id}"')
    return message


@dataclass(frozen=True, slots=True)
class Begin:
    status: BeginStatus
    attempt: int = 1
    #: The admit stage's artifact (the resolved turn) and the previous stage's.
    admitted: str = ""
    previous: str = ""
    conversation_id: str = ""
    fence: str = ""
    deadline_at: float | None = None
    terminal_status: str = ""
    #: Model attempts handed to another worker by a shutting-down one: not failed attempts.
    handovers: int = 0


StallVerdict = Literal["gone", "alive", "waiting", "exhausted", "stalled"]
StallReason = Literal["worker_lost", "claim_lapsed", "no_progress", ""]


@dataclass(frozen=True, slots=True)
class Stall:
    """The watchdog's look at a turn (stalled.lua): `stalled` → enqueue `stage` again, `exhausted` →
    end the turn; `why` says what gave the turn away."""

    verdict: StallVerdict
    stage: str = ""
    attempt: int = 1
    #: The kept request (to run the first stage again).
    request: str = ""
    why: StallReason = ""
    #: The worker that held the turn, if one did.
    holder: str = ""


@dataclass(frozen=True, slots=True)
class Next:
    """The message a stage hands over to: its stage (actor = queue) and its single argument."""

    stage: str
    arg: Any
    message_id: str
    delay_ms: int | None = None


@dataclass(frozen=True, slots=True)
class Accept:
    """What the end of the admit stage makes exist: the conversation (when new) and the row."""

    conversation: ConversationRecord
    row: MessageRecord
    deadline_at: float


@dataclass(frozen=True, slots=True)
class Finish:
    turn_id: str
    event: events.Terminal
    conversation_id: str = ""
    message: MessageRecord | None = None
    snapshot: str | None = None
    pending_tool_calls: Sequence[dict[str, Any]] = ()
    fence: str = ""
    tenant_id: str = ""
    before: Sequence[events.Event] = ()


@dataclass(frozen=True, slots=True)
class DeleteResult:
    status: DeleteStatus
    conversation_id: str
    messages: int = 0
    turns: int = 0
    #: When busy: the turn holding the conversation, then those waiting in its line (up to 50).
    blocking: tuple[str, ...] = ()


ClearStatus = Literal["cleared", "busy", "gone", "changed"]


@dataclass(frozen=True, slots=True)
class CachedCounts:
    """Token counts cached for some turns, and the content version of each turn whose snapshot was
    rewritten (absent: version 0, the snapshot as the turn stored it)."""

    counts: dict[str, int]
    versions: dict[str, int]


def count_field(message_id: str, version: int, tokenizer: str) -> str:
    """The field of a turn's count in the token counts hash: per tokenizer and content version (a
    snapshot whose tool results compaction cleared is counted again, under its next version)."""
    return f"{message_id}|{tokenizer}" if version == 0 else f"{message_id}#{version}|{tokenizer}"


def version_field(message_id: str) -> str:
    return f"{message_id}|version"


def turn_of_row(row: bytes | str) -> str:
    """The turn a stored message row belongs to."""
    return str(json.loads(row)["turn_id"])


def deletion(keys: Keys, graph: StageGraph, conversation_id: str, *, tenant_id: str | None,
             rows: Mapping[str, str], stored_tenant: str | None) -> tuple[list[str], str]:
    """KEYS and ARGV[1] of delete_conversation.lua, for the rows read (message id -> turn id) and the
    tenant read from the conversation (whose conversation index loses it)."""
    cid, k = conversation_id, keys
    head = [k.conversation(cid), k.messages(cid), k.turn_queue(cid), k.lease(cid), k.waiting(cid)]
    turns = sorted(set(rows.values()))
    stages = [s.name for s in graph.turn_stages]
    rest = [key for key in k.conversation_keys(cid) if key not in head]
    owned = [key for turn_id in turns for key in k.turn_keys(turn_id, stages)]
    index = k.tenant_conversations(stored_tenant or "-")
    return ([*head, k.running(), k.activity(), index, *rest, *owned],
            lua.payload(conversation_id=cid, tenant_id=tenant_id or "", messages=sorted(rows), turns=turns,
                        stored_tenant=stored_tenant or ""))


def delete_result(conversation_id: str, reply: Sequence[bytes | int]) -> DeleteResult | None:
    """The script's reply; None when the rows changed since they were read (read them again)."""
    status = text(cast(bytes, reply[0]))
    if status == "deleted":
        return DeleteResult("deleted", conversation_id, messages=int(reply[1]), turns=int(reply[2]))
    if status == "busy":
        return DeleteResult("busy", conversation_id, blocking=tuple(text(cast(bytes, t)) for t in reply[1:]))
    if status == "not_found":
        return DeleteResult("not_found", conversation_id)
    return None


class Store:
    def __init__(self, client: aioredis.Redis, settings: Settings, graph: StageGraph) -> None:
        self.redis = client
        self.settings = settings
        self.graph = graph
        self.keys = Keys(settings.prefix)
        self._scripts: dict[str, AsyncScript] = {
            name: client.register_script(lua.source(name)) for name in lua.SCRIPT_NAMES
        }

    @classmethod
    def connect(cls, url: str, settings: Settings, graph: StageGraph) -> Store:
        return cls(aioredis.Redis.from_url(url, max_connections=64), settings, graph)

    async def close(self) -> None:
        await self.redis.aclose()

    async def _run(self, name: lua.ScriptName, keys: Sequence[str], *argv: str | bytes) -> Any:
        return await self._scripts[name](keys=list(keys), args=list(argv))

    def _message(self, next_: Next, now_ms: int) -> tuple[str, str, bytes]:
        queue = self.graph[next_.stage].queue
        return build_message(queue, next_.stage, (next_.arg,), message_id=next_.message_id, now_ms=now_ms,
                             delay_ms=next_.delay_ms)

    # --- the turn state machine ----------------------------------------------------------------

    async def admit(self, turn_id: str, conversation_id: str, *, now: float, request: bytes) -> tuple[Admission, str]:
        """Join the conversation's line; run now, or wait to be woken (`request` is kept for that)."""
        k = self.keys
        reply = await self._run(
            "admit",
            [k.turn(turn_id), k.cancel_flag(turn_id), k.running(), k.turn_queue(conversation_id),
             k.lease(conversation_id), k.waiting(conversation_id), k.queue_messages(self.graph.first.queue),
             k.queue(self.graph.first.queue), k.activity()],
            lua.payload(turn_id=turn_id, conversation_id=conversation_id, now=now,
                        done=f"done:{self.graph.first.name}", channel=k.doorbell_channel(),
                        queue=self.graph.first.queue, activity=self.settings.retention_days > 0),
            request,
        )
        status = cast(Admission, text(reply[0]))
        return status, (text(reply[1]) if len(reply) > 1 and reply[1] else "")

    async def begin(
        self, turn_id: str, stage: str, *, now: float, interrupts: bool = True, claim: str = "",
        started: events.StageEvent | None = None, attempt_hint: int = 1, holder: str = "",
    ) -> Begin:
        """Start `stage`: its inputs when it may run, else why not. `claim` takes the model claim;
        `holder` (the worker's id) names who runs the stage, for the watchdog."""
        k = self.keys
        previous = self.graph.previous(stage).name if stage != self.graph.first.name else stage
        redelivered = events.Retrying(turn_id=turn_id, attempt=attempt_hint,
                                      reason="redelivered: the worker running the previous attempt was lost")
        reply = await self._run(
            "begin",
            [k.turn(turn_id), k.events(turn_id), k.cancel_flag(turn_id), k.artifact(turn_id, self.graph.first.name),
             k.artifact(turn_id, previous), k.model_claim(turn_id), k.running()],
            lua.payload(stage=stage, turn_id=turn_id, now=now, interrupts=interrupts, claim=claim, holder=holder,
                            claim_ttl_ms=int(self.settings.invoke_lease_s * 1000),
                            started=events.encode(started, numbered_by_store=True) if started else "",
                            redelivered=events.encode(redelivered, numbered_by_store=True)),
        )
        status = cast(BeginStatus, text(reply[0]))
        if status != "go":
            return Begin(status=status, terminal_status=text(reply[1]) if len(reply) > 1 else "")
        attempt, admitted, prev, conversation_id, fence, deadline, handovers = (text(r) for r in reply[1:])
        return Begin(status="go", attempt=int(attempt), admitted=admitted, previous=prev,
                     conversation_id=conversation_id, fence=fence, deadline_at=float(deadline) if deadline else None,
                     handovers=int(handovers))

    async def advance(
        self, turn_id: str, stage: str, *, next_: Next, now: float, now_ms: int, artifact: str,
        events_: Sequence[events.Event] = (), fence: str = "", conversation_id: str = "", accept: Accept | None = None,
        decision: Mapping[str, Any] | None = None,
    ) -> str:
        """Finish `stage` and enqueue `next_` in one atomic step; see advance.lua. `decision` is stored
        with the turn's message, for the record and for the next turn (`Store.decision`)."""
        k = self.keys
        queue, message_id, data = self._message(next_, now_ms)
        cid = conversation_id or "-"
        fields: dict[str, Any] = {}
        row = ""
        if accept is not None:
            fields["accept"] = {"conversation": conversation_to_hash(accept.conversation),
                                "conversation_id": accept.conversation.id,
                                "deadline_at": repr(accept.deadline_at), "message_id": accept.row.id}
            row = accept.row.model_dump_json()
        if decision:
            fields["decision"] = json.dumps(decision, separators=(",", ":"))
        reply = await self._run(
            "advance",
            [k.turn(turn_id), k.events(turn_id), k.artifact(turn_id, stage), k.running(), k.lease(cid),
             k.conversation(cid), k.messages(cid), k.message_order(cid), k.queue_messages(queue), k.queue(queue),
             k.decisions(cid), k.tenant_conversations(accept.conversation.tenant_id if accept else "-")],
            lua.payload(stage=stage, turn_id=turn_id, fence=fence, now=now,
                            artifact_ttl_ms=self.settings.artifact_ttl_s * 1000, next_id=message_id,
                            next_queue=queue, channel=k.doorbell_channel(),
                            events=[events.encode(e) for e in events_], **fields),
            artifact, data, row,
        )
        return text(reply)

    async def retry(self, turn_id: str, *, next_: Next, now: float, now_ms: int, event: events.Retrying,
                    claim: str, handover: bool = False) -> str:
        """Schedule the next attempt of a stage (a delayed message), announced by `event`; "stale"
        when another worker holds the model claim now. A `handover` (no delay: the worker is stopping)
        does not count as a failed attempt."""
        k = self.keys
        queue, message_id, data = self._message(next_, now_ms)
        reply = await self._run(
            "retry",
            [k.turn(turn_id), k.events(turn_id), k.model_claim(turn_id), k.running(), k.queue_messages(queue),
             k.queue(queue)],
            lua.payload(turn_id=turn_id, now=now, message_id=message_id, queue=queue,
                            channel=k.doorbell_channel(), event=events.encode(event), claim=claim,
                            handover=handover),
            data,
        )
        return text(reply)

    async def finish(self, f: Finish, *, now: float) -> str:
        """The one terminal write of a turn. Returns "ok", "already" (a no-op) or "stale"."""
        k = self.keys
        cid = f.conversation_id or "-"
        usage = f.message.usage if f.message is not None else None
        admit_queue = self.graph.first.queue
        reply = await self._run(
            "finish",
            [k.turn(f.turn_id), k.events(f.turn_id), k.cancel_flag(f.turn_id), k.model_claim(f.turn_id), k.running(),
             k.conversation(cid), k.messages(cid), k.snapshots(cid), k.lease(cid), k.turn_queue(cid), k.waiting(cid),
             k.usage(f.tenant_id or "-"), k.queue_messages(admit_queue), k.queue(admit_queue), k.activity(),
             *(k.artifact(f.turn_id, s.name) for s in self.graph.turn_stages)],
            lua.payload(
                turn_id=f.turn_id, status=f.event.type, conversation_id=f.conversation_id,
                message_id=f.message.id if f.message else "", fence=f.fence, now=now, ttl_s=self.settings.turn_ttl_s,
                usage=usage.model_dump() if usage else {}, pending=json.dumps(list(f.pending_tool_calls)),
                channel=k.doorbell_channel(), admit_queue=admit_queue,
                events=[*(events.encode(e) for e in f.before), events.encode(f.event)],
                activity=self.settings.retention_days > 0,
            ),
            f.message.model_dump_json() if f.message else "", f.snapshot or "",
        )
        return text(reply[0])

    async def stalled(self, turn_id: str, *, now: float, max_recoveries: int, stall_s: float | None = None,
                      recheck_s: float | None = None) -> Stall:
        """The watchdog's look at a turn it has not looked at for a while; see stalled.lua."""
        k, settings = self.keys, self.settings
        cid, holder = (text(v or b"") for v in await self.redis.hmget(k.turn(turn_id), "conversation_id", "holder"))
        reply = await self._run(
            "stalled", [k.turn(turn_id), k.model_claim(turn_id), k.running(), k.waiting(cid or "-"),
                        k.worker_turns(holder or "-")],
            lua.payload(turn_id=turn_id, now=now, stages=[s.name for s in self.graph.turn_stages],
                        model_stages=[s.name for s in self.graph.of_kind("model")], max_recoveries=max_recoveries,
                        holder=holder, stall_s=settings.stall_s if stall_s is None else stall_s,
                        recheck_s=settings.worker_timeout_s if recheck_s is None else recheck_s),
        )
        verdict = cast(StallVerdict, text(reply[0]))
        if verdict == "exhausted":
            return Stall(verdict, stage=text(reply[1]), why=cast(StallReason, text(reply[2])), holder=holder)
        if verdict != "stalled":
            return Stall(verdict)
        return Stall(verdict, stage=text(reply[1]), attempt=int(text(reply[2])), request=text(reply[3]),
                     why=cast(StallReason, text(reply[4])), holder=holder)

    async def reap(self, worker_id: str, broker_id: str, queues: Sequence[str]) -> int:
        """Put back what a worker whose heartbeat is gone had fetched (see reap.lua): how many
        messages, or -1 when it is alive after all."""
        k = self.keys
        triples = [key for q in queues for key in (k.acks(broker_id, q), k.queue_messages(q), k.queue(q))]
        reply = await self._run(
            "reap", [k.workers(), k.worker(worker_id), k.heartbeats(), *triples],
            lua.payload(worker_id=worker_id, broker_id=broker_id, channel=k.doorbell_channel(), queues=list(queues)),
        )
        return int(reply)

    async def enqueue(self, queue: str, message_id: str, data: bytes) -> None:
        """Enqueue a ready dramatiq message (as any producer does) and ring the doorbell."""
        k = self.keys
        await self._run("submit", [k.queue_messages(queue), k.queue(queue), k.turn_queue("-"), k.turn("-")],
                        lua.payload(message_id=message_id, turn_id="", channel=k.doorbell_channel(), queue=queue),
                        data)

    async def enqueue_stage(self, stage: str, arg: Any, *, message_id: str, now_ms: int) -> None:
        queue, mid, data = self._message(Next(stage, arg, message_id), now_ms)
        await self.enqueue(queue, mid, data)

    async def emit(self, turn_id: str, event: events.Event) -> None:
        await self._run("emit", [self.keys.turn(turn_id), self.keys.events(turn_id)], events.encode(event))

    async def cancel(self, turn_id: str, reason: str, *, now: float) -> tuple[str, str]:
        k = self.keys
        reply = await self._run(
            "cancel", [k.cancel_flag(turn_id), k.turn(turn_id)],
            lua.payload(turn_id=turn_id, reason=reason or "cancelled", ttl_s=self.settings.cancel_ttl_s,
                            channel=k.cancel_channel(), now=now),
        )
        return text(reply[0]), text(reply[1])

    async def dead_letter(self, queue: str, message_id: str, actor: str, reason: str) -> None:
        """Record a message that names no turn of its own (nothing to report on a turn's stream)."""
        await self.redis.xadd(self.keys.dead_letters(), {"queue": queue, "message_id": message_id, "actor": actor,
                                                         "reason": reason}, maxlen=10_000, approximate=True)

    async def release_claim(self, turn_id: str, claim: str) -> None:
        """Let a retried delivery of this model call run at once instead of waiting out the claim,
        if `claim` still holds it."""
        await self._run("release", [self.keys.model_claim(turn_id)], claim)

    async def refresh_claim(self, turn_id: str) -> None:
        await self.redis.pexpire(self.keys.model_claim(turn_id), int(self.settings.invoke_lease_s * 1000))

    # --- model slots (`model.max_concurrency`, `limiter.py`) ------------------------------------

    async def acquire_slot(self, agent_id: str, token: str, *, limit: int) -> bool:
        """Take one of the agent's model slots for `token` (a lease of `TL_INVOKE_LEASE_S`), if one
        is free; holders whose lease ran out are dropped first."""
        reply = await self._run("slot_acquire", [self.keys.model_limit(agent_id)],
                                lua.payload(token=token, limit=limit,
                                            lease_ms=int(self.settings.invoke_lease_s * 1000)))
        return int(reply[0]) == 1

    async def renew_slot(self, agent_id: str, token: str) -> bool:
        """Extend a held slot's lease; False when `token` holds none any more."""
        reply = await self._run("slot_renew", [self.keys.model_limit(agent_id)],
                                lua.payload(token=token, lease_ms=int(self.settings.invoke_lease_s * 1000)))
        return int(reply) == 1

    async def release_slot(self, agent_id: str, token: str) -> None:
        await self._run("slot_release", [self.keys.model_limit(agent_id)], token)

    async def artifact(self, turn_id: str, stage: str) -> bytes | None:
        return as_bytes(await self.redis.get(self.keys.artifact(turn_id, stage)))

    async def turn_state(self, turn_id: str) -> TurnState:
        return TurnState.from_hash(text_map(await self.redis.hgetall(self.keys.turn(turn_id))))

    # --- reads ---------------------------------------------------------------------------------

    async def find_conversation(self, conversation_id: str) -> ConversationRecord | None:
        fields = text_map(await self.redis.hgetall(self.keys.conversation(conversation_id)))
        return conversation_from_hash(conversation_id, fields)

    async def load_conversation(self, conversation_id: str) -> ConversationRecord:
        record = await self.find_conversation(conversation_id)
        if record is None:
            raise ConversationNotFound(f"conversation {conversation_id!r} does not exist")
        return record

    async def waiting_request(self, conversation_id: str, turn_id: str) -> object:
        """The request a waiting or running turn was admitted with (the argument of its message)."""
        kept = await self.redis.hget(self.keys.waiting(conversation_id), turn_id)
        return json.loads(kept)["args"][0] if kept else None

    async def message(self, conversation_id: str, message_id: str) -> MessageRecord | None:
        row = await self.redis.hget(self.keys.messages(conversation_id), message_id)
        return MessageRecord.model_validate_json(row) if row else None

    async def has_message(self, conversation_id: str, message_id: str) -> bool:
        return bool(await self.redis.hexists(self.keys.messages(conversation_id), message_id))

    async def load_config(self, agent_id: str, ref: ConfigRef) -> tuple[AgentConfig, str]:
        """The config a turn runs and its reference ("v<N>" or "draft:<id>")."""
        k = self.keys
        if ref.kind == "draft":
            assert ref.value is not None
            data = await self.redis.get(k.agent_draft(agent_id, ref.value))
            if data is None:
                raise AgentNotFound(f"agent {agent_id!r} has no draft {ref.value!r}")
            return config_from_json(data), f"draft:{ref.value}"
        version = ref.value
        if ref.kind == "active":
            active = await self.redis.hget(k.agent(agent_id), "active")
            if active is None:
                raise AgentNotFound(f"agent {agent_id!r} is not registered")
            version = text(active)
        assert version is not None
        data = await self.redis.get(k.agent_version(agent_id, version))
        if data is None:
            raise AgentNotFound(f"agent {agent_id!r} has no version {version}")
        return config_from_json(data), f"v{version}"

    async def walk_back(self, conversation_id: str, from_id: str | None, *,
                        batch: int) -> AsyncIterator[list[MessageRecord]]:
        """Message rows from `from_id` back to the conversation's first, newest first, `batch` at first
        and twice as many each round trip (a parent is always older than its children, so a thread
        walked back from any message is found in these rows, in order)."""
        if from_id is None:
            return
        k = self.keys
        score = await self.redis.zscore(k.message_order(conversation_id), from_id)
        if score is None:
            return
        offset = 0
        while True:
            raw = cast(list[bytes], await self.redis.zrevrangebyscore(
                k.message_order(conversation_id), score, "-inf", start=offset, num=batch))
            if not raw:
                return
            offset += len(raw)
            batch = min(batch * 2, 512)  # a short walk stays short; a long one takes few round trips
            rows = await self.redis.hmget(k.messages(conversation_id), [text(i) for i in raw])
            yield [MessageRecord.model_validate_json(r) for r in rows if r is not None]

    async def token_counts(self, conversation_id: str, message_ids: Sequence[str], tokenizer: str) -> CachedCounts:
        """The cached counts of the turns' current content: one round trip, two for rewritten turns."""
        if not message_ids:
            return CachedCounts({}, {})
        key, n = self.keys.token_counts(conversation_id), len(message_ids)
        values = await self.redis.hmget(key, [*map(version_field, message_ids),
                                              *(count_field(mid, 0, tokenizer) for mid in message_ids)])
        versions = {mid: int(v) for mid, v in zip(message_ids, values[:n], strict=True) if v is not None}
        counts = {mid: int(v) for mid, v in zip(message_ids, values[n:], strict=True)
                  if v is not None and mid not in versions}
        if versions:
            later = await self.redis.hmget(key, [count_field(mid, v, tokenizer) for mid, v in versions.items()])
            counts.update({mid: int(v) for mid, v in zip(versions, later, strict=True) if v is not None})
        return CachedCounts(counts, versions)

    async def save_token_counts(self, conversation_id: str, counts: dict[str, int], tokenizer: str, *,
                                versions: Mapping[str, int] | None = None) -> None:
        """`counts` of the content versions read before the snapshots were (a count saved under a
        version a compaction has since replaced is never read)."""
        got = versions or {}
        await self.redis.hset(self.keys.token_counts(conversation_id),
                              mapping={count_field(mid, got.get(mid, 0), tokenizer): n for mid, n in counts.items()})

    async def clear_tool_results(self, conversation_id: str, snapshots: Mapping[str, tuple[bytes, bytes]], *,
                                 counts: Mapping[str, int], tokenizer: str) -> ClearStatus:
        """Replace turns' snapshots (`message id -> (stored, cleared)`), each with its content version
        bumped and its count under the new version, in one transaction; fenced like `save_summary`,
        and more: nothing is written while a turn of the conversation holds it ("busy"), once the
        conversation is gone, or when a snapshot is no longer the one read ("changed")."""
        k, ids = self.keys, list(snapshots)
        watched = (k.conversation(conversation_id), k.lease(conversation_id), k.snapshots(conversation_id),
                   k.token_counts(conversation_id))
        async with self.redis.pipeline(transaction=True) as pipe:
            for _ in range(3):  # best effort, as compaction is: a later cut clears what is left
                try:
                    await pipe.watch(*watched)
                    if not await pipe.exists(watched[0]):
                        return "gone"
                    if await pipe.hexists(watched[1], "turn"):
                        return "busy"
                    stored = await pipe.hmget(watched[2], ids)
                    if [as_bytes(v) for v in stored] != [snapshots[mid][0] for mid in ids]:
                        return "changed"
                    versions = [int(v or 0) for v in await pipe.hmget(watched[3], [version_field(m) for m in ids])]
                    pipe.multi()  # type: ignore[no-untyped-call]
                    for mid, version in zip(ids, versions, strict=True):
                        pipe.hset(watched[2], mid, snapshots[mid][1])
                        pipe.hdel(watched[3], count_field(mid, version, tokenizer))
                        pipe.hset(watched[3], mapping={version_field(mid): version + 1,
                                                       count_field(mid, version + 1, tokenizer): counts[mid]})
                    await pipe.execute()
                    return "cleared"
                except WatchError:
                    continue
        return "busy"

    async def save_decision(self, conversation_id: str, message_id: str, stage: str,
                            record: Mapping[str, Any]) -> None:
        """A decision record of a stage that runs after the turn (compaction), while the conversation
        exists (a delete in between must not find it written back)."""
        conversation = self.keys.conversation(conversation_id)
        value = json.dumps(record, separators=(",", ":"), ensure_ascii=False)
        async with self.redis.pipeline(transaction=True) as pipe:
            for _ in range(3):
                try:
                    await pipe.watch(conversation)
                    if not await pipe.exists(conversation):
                        return
                    pipe.multi()  # type: ignore[no-untyped-call]
                    pipe.hset(self.keys.decisions(conversation_id), f"{message_id}:{stage}", value)
                    await pipe.execute()
                    return
                except WatchError:
                    continue

    async def summaries(self, conversation_id: str, message_ids: Sequence[str]) -> dict[str, str]:
        """Running summaries by watermark message id (`finish`-then-compaction writes them)."""
        if not message_ids:
            return {}
        values = await self.redis.hmget(self.keys.summaries(conversation_id), list(message_ids))
        return {mid: json.loads(v)["text"] for mid, v in zip(message_ids, values, strict=True) if v is not None}

    async def save_summary(self, conversation_id: str, watermark: str, record: Mapping[str, Any]) -> None:
        """Stored only while the conversation exists: compaction runs after its turn ended, so a
        delete may come between its read and this write, and must not find the summary written back."""
        conversation = self.keys.conversation(conversation_id)
        value = json.dumps(record, separators=(",", ":"), ensure_ascii=False)
        async with self.redis.pipeline(transaction=True) as pipe:
            for _ in range(3):  # best effort, as compaction is: the next turn's covers the same turns
                try:
                    await pipe.watch(conversation)  # a turn ending meanwhile also touches it: try again
                    if not await pipe.exists(conversation):
                        return
                    pipe.multi()  # type: ignore[no-untyped-call]
                    pipe.hset(self.keys.summaries(conversation_id), watermark, value)
                    await pipe.execute()
                    return
                except WatchError:
                    continue

    async def delete_conversation(self, conversation_id: str, *, tenant_id: str | None = None) -> DeleteResult:
        """Delete a conversation and its turns' keys, unless a turn of it runs or waits (see
        delete_conversation.lua); `tenant_id` must be the conversation's, else it is "not_found"."""
        for _ in range(DELETE_ATTEMPTS):
            rows = {text(mid): turn_of_row(row)
                    async for mid, row in self.redis.hscan_iter(self.keys.messages(conversation_id), count=500)}
            stored = await self.redis.hget(self.keys.conversation(conversation_id), "tenant_id")
            keys, arg = deletion(self.keys, self.graph, conversation_id, tenant_id=tenant_id, rows=rows,
                                 stored_tenant=text(stored) if stored is not None else None)
            result = delete_result(conversation_id, await self._run("delete_conversation", keys, arg))
            if result is not None:
                return result
        return DeleteResult("busy", conversation_id)

    async def decision(self, conversation_id: str, message_id: str, stage: str) -> dict[str, Any] | None:
        """The decision record `stage` stored for a turn (`advance.lua`), or None."""
        raw = await self.redis.hget(self.keys.decisions(conversation_id), f"{message_id}:{stage}")
        return cast(dict[str, Any], json.loads(raw)) if raw else None

    async def load_recent_messages(self, conversation_id: str, limit: int) -> list[MessageRecord]:
        """The newest `limit` message rows of a conversation, newest first (a bounded read)."""
        k = self.keys
        newest = cast(list[bytes], await self.redis.zrevrange(k.message_order(conversation_id), 0, limit - 1))
        ids = [text(i) for i in newest]
        if not ids:
            return []
        rows = await self.redis.hmget(k.messages(conversation_id), ids)
        return [MessageRecord.model_validate_json(r) for r in rows if r is not None]

    async def load_snapshots(self, conversation_id: str, message_ids: Sequence[str]) -> dict[str, bytes]:
        if not message_ids:
            return {}
        values = await self.redis.hmget(self.keys.snapshots(conversation_id), list(message_ids))
        return {mid: v for mid, v in zip(message_ids, map(as_bytes, values), strict=True) if v is not None}

