"""The turn state machine in Redis: admit, begin, advance, retry, finish, stall and reap, claims,
events and artifacts — one script each (`scripts/*.lua`), one typed method each."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, cast

from threadline.pipeline import events
from threadline.pipeline.busy import DEFAULT_ON_BUSY, OnBusy, interrupt_victims, interrupts
from threadline.pipeline.cost import usage_counters
from threadline.pipeline.records import ConversationRecord, MessageRecord
from threadline.pipeline.resolve import Refusal, refusal_error
from threadline.workers.protocol.keys import TURN_SHARD_SLACK_S, Keys
from threadline.workers.protocol.names import WEBHOOK_ACTOR, WEBHOOK_QUEUE
from threadline.workers.protocol.schema import (
    TurnState,
    as_bytes,
    conversation_to_hash,
    text,
    text_map,
)
from threadline.workers.protocol.wire import build_message
from threadline.workers.storage import lua
from threadline.workers.storage.base import StoreBase

#: What a cancel flag holds when the cancellation gave no reason.
NO_CANCEL_REASON = "cancelled"

BeginStatus = Literal["go", "unknown", "done", "terminal", "cancelled", "timed_out", "duplicate"]


#: Rounds of reading the turns an interrupting turn cancels while turns keep arriving meanwhile.
BUSY_ATTEMPTS = 8

#: A stage starting less than this long after the turn was last scored in the running index leaves
#: the score as it is (begin.lua): the stages of a turn that moves on start within it, one `ZADD`
#: each fewer; the watchdog's next look comes at most this much earlier.
RESCORE_S = 1.0

#: "busy": refused by `on_busy: reject`; "changed": the victims named are not the turns in the way.
Admission = Literal["admitted", "waiting", "terminal", "done", "cancelled", "refused", "busy", "changed"]

#: What advance.lua and finish.lua answer when a write into a conversation is refused (see
#: `pipeline.resolve.Refusal`): nothing was written.
REFUSALS: frozenset[str] = frozenset({"foreign_conversation", "conversation_exists", "message_exists"})


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


class Admitted(NamedTuple):
    """admit.lua's answer: the admission; its detail (the fence when admitted, the turn in the way
    when waiting or busy, the refusal, the ended turn's status); when admitted, its admit stage begun."""

    status: Admission
    detail: str
    begin: Begin | None = None


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
class Settle:
    """The stage's own message, acked by the script that hands its turn over (dispatch.lua's ack, in
    the same step, so its worker sends no ack of its own): the queue it was fetched from, the id of the
    worker's broker (whose ack set holds it) and its Redis message id. Its keys are the store's, of
    the shard the message was fetched from (the store is bound to it)."""

    queue: str
    broker_id: str
    message_id: str


@dataclass(frozen=True, slots=True)
class Accept:
    """What the end of the admit stage makes exist: the conversation (when new) and the row."""

    conversation: ConversationRecord
    row: MessageRecord
    deadline_at: float
    #: The turn starts the conversation: advance.lua refuses when it exists already.
    creates: bool = False


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
    #: POSTed the terminal event (a delivery created with it, once: docs/webhooks.md); "" = none.
    webhook_url: str = ""
    #: The finish stage's own message, acked with the write when it answers "ok".
    settle: Settle | None = None


class TurnStore(StoreBase):
    @property
    def rescore_s(self) -> float:
        """How soon after the last scoring a stage's start leaves the turn's running score as it is
        (begin.lua): `RESCORE_S`, and well under the shortest time the watchdog waits to look."""
        return min(RESCORE_S, self.settings.worker_timeout_s / 4, self.settings.stall_s / 4)

    def _message(self, next_: Next, now_ms: int) -> tuple[str, str, bytes]:
        queue = self.graph[next_.stage].queue
        return build_message(queue, next_.stage, (next_.arg,), message_id=next_.message_id, now_ms=now_ms,
                             delay_ms=next_.delay_ms)

    async def admit(self, turn_id: str, conversation_id: str, *, now: float, request: bytes, tenant_id: str = "",
                    creates: bool = False, on_busy: OnBusy = DEFAULT_ON_BUSY, holder: str = "") -> Admitted:
        """Join the conversation's line; run now, or wait to be woken (`request` is kept for that).
        "refused" (with why, one of `REFUSALS`) when the turn may not write into the conversation:
        another tenant's (`tenant_id` given), one that exists when the turn `creates` it, or one
        whose messages hold the turn's id already. On its first admission the turn's `on_busy`
        applies: "busy" (with the turn in its way) refuses a `reject` turn. A turn admitted has its
        admit stage begun (`holder`, the worker's id, runs it): no `begin` of its own."""
        for _ in range(BUSY_ATTEMPTS):
            victims = await self.interrupt_victims(conversation_id, turn_id) if interrupts(on_busy) else []
            admitted = await self._admit(turn_id, conversation_id, now=now, request=request, tenant_id=tenant_id,
                                         creates=creates, on_busy=on_busy, victims=victims, holder=holder)
            if admitted.status != "changed":
                return admitted
        return admitted

    async def interrupt_victims(self, conversation_id: str, turn_id: str) -> list[str]:
        """The turns an interrupting turn would cancel now (read before its script checks them)."""
        k = self.keys
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hget(k.lease(conversation_id), "turn")
            pipe.zscore(k.turn_queue(conversation_id), turn_id)
            pipe.zrangebyscore(k.turn_queue(conversation_id), "-inf", "(0", withscores=True)
            holder, own, ahead = await pipe.execute()
        return interrupt_victims(turn_id, text(holder) if holder else None,
                                 [(text(m), float(score)) for m, score in ahead], own)

    async def _admit(self, turn_id: str, conversation_id: str, *, now: float, request: bytes, tenant_id: str,
                     creates: bool, on_busy: OnBusy, victims: Sequence[str], holder: str) -> Admitted:
        k = self.keys
        victim_keys, policy = lua.on_busy_args(k, turn_id, on_busy, victims, cancel_ttl_s=self.settings.cancel_ttl_s,
                                               now=now)
        reply = await self._run(
            "admit",
            [k.turn(turn_id), k.running(), k.turn_queue(conversation_id),
             k.lease(conversation_id), k.waiting(conversation_id), k.queue_messages(self.graph.first.queue),
             k.queue(self.graph.first.queue), k.activity(), k.conversation(conversation_id),
             k.messages(conversation_id), *victim_keys],
            lua.payload(turn_id=turn_id, conversation_id=conversation_id,
                        stage=self.graph.first.name, holder=holder, channel=k.doorbell_channel(),
                        queue=self.graph.first.queue, activity=self.settings.retention_days > 0,
                        tenant_id=tenant_id, creates=creates, **policy),
            request,
        )
        status = cast(Admission, text(reply[0]))
        detail = text(reply[1]) if len(reply) > 1 and reply[1] else ""
        if status != "admitted":
            return Admitted(status, detail)
        attempt, handovers = (text(r) for r in reply[2:4])
        return Admitted(status, detail, Begin(status="go", attempt=int(attempt), conversation_id=conversation_id,
                                              fence=detail, handovers=int(handovers)))

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
            [k.turn(turn_id), k.events(turn_id), k.artifact(turn_id, self.graph.first.name),
             k.artifact(turn_id, previous), k.model_claim(turn_id), k.running()],
            lua.payload(stage=stage, turn_id=turn_id, now=now, interrupts=interrupts, claim=claim, holder=holder,
                            claim_ttl_ms=int(self.settings.invoke_lease_s * 1000), rescore_s=self.rescore_s,
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
        decision: Mapping[str, Any] | None = None, settle: Settle | None = None,
    ) -> str:
        """Finish `stage` and enqueue `next_` in one atomic step; see advance.lua. `decision` is stored
        with the turn's message, for the record and for the next turn (`Store.decision`). An `accept`
        into a conversation the turn may not write is refused: the answer is one of `REFUSALS`. The
        message of `settle` is acked in the same step when the answer is "ok"."""
        k = self.keys
        queue, message_id, data = self._message(next_, now_ms)
        cid = conversation_id or "-"
        fields: dict[str, Any] = {}
        row = ""
        if accept is not None:
            fields["accept"] = {"conversation": conversation_to_hash(accept.conversation),
                                "conversation_id": accept.conversation.id,
                                "deadline_at": repr(accept.deadline_at), "message_id": accept.row.id,
                                "creates": accept.creates}
            row = accept.row.model_dump_json()
        if decision:
            fields["decision"] = json.dumps(decision, separators=(",", ":"))
        settled: list[str] = []
        if settle is not None:
            fields["settle_id"] = settle.message_id
            settled = [k.acks(settle.broker_id, settle.queue), k.queue_messages(settle.queue)]
        reply = await self._run(
            "advance",
            [k.turn(turn_id), k.events(turn_id), k.artifact(turn_id, stage), k.lease(cid),
             k.conversation(cid), k.messages(cid), k.message_order(cid), k.queue_messages(queue), k.queue(queue),
             k.decisions(cid), k.tenant_conversations(accept.conversation.tenant_id if accept else "-"), *settled],
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
        """The one terminal write of a turn. Returns "ok", "already" (a no-op) or "stale"; or one of
        `REFUSALS` when the row may not be written (another tenant's conversation, or a row the turn
        did not accept): then the turn ends `failed` with the refusal's code and no row instead."""
        reply = await self._finish(f, now=now)
        if text(reply[0]) != "refused":
            return text(reply[0])
        why = text(reply[1])
        error = refusal_error(cast(Refusal, why), turn_id=f.turn_id, conversation_id=f.conversation_id)
        failed = events.terminal(f.turn_id, f.event.attempt, "failed", code=error.code, message=error.message)
        await self._finish(dataclasses.replace(f, event=failed, message=None, snapshot=None, pending_tool_calls=()),
                           now=now)
        return why

    async def _finish(self, f: Finish, *, now: float) -> Any:
        k = self.keys
        cid = f.conversation_id or "-"
        usage = f.message.usage if f.message is not None else None
        admit_queue = self.graph.first.queue
        webhook, first = self._webhook(f, now=now)
        return await self._run(
            "finish",
            [k.turn(f.turn_id), k.events(f.turn_id), k.cancel_flag(f.turn_id), k.model_claim(f.turn_id), k.running(),
             k.conversation(cid), k.messages(cid), k.snapshots(cid), k.lease(cid), k.turn_queue(cid), k.waiting(cid),
             k.usage(f.tenant_id or "-"), k.queue_messages(admit_queue), k.queue(admit_queue), k.activity(),
             k.webhook(f.turn_id), k.webhooks(), k.queue_messages(WEBHOOK_QUEUE), k.queue(WEBHOOK_QUEUE),
             k.message_order(cid),
             *(k.artifact(f.turn_id, s.name) for s in self.graph.turn_stages),
             *((k.acks(f.settle.broker_id, f.settle.queue), k.queue_messages(f.settle.queue)) if f.settle else ())],
            lua.payload(
                artifacts=len(self.graph.turn_stages), settle_id=f.settle.message_id if f.settle else "",
                turn_id=f.turn_id, status=f.event.type, conversation_id=f.conversation_id,
                message_id=f.message.id if f.message else "", fence=f.fence, now=now, ttl_s=self.settings.turn_ttl_s,
                usage=usage_counters(usage) if usage else {}, pending=json.dumps(list(f.pending_tool_calls)),
                channel=k.doorbell_channel(), admit_queue=admit_queue,
                events=[*(events.encode(e) for e in f.before), events.encode(f.event)],
                activity=self.settings.retention_days > 0, tenant_id=f.tenant_id, **webhook,
            ),
            f.message.model_dump_json() if f.message else "", f.snapshot or "", first,
        )

    def _webhook(self, f: Finish, *, now: float) -> tuple[dict[str, Any], bytes]:
        """The finish script's `webhook` field and the delivery's first message (the delivery id is
        the turn id: the idempotency id a receiver de-duplicates on)."""
        if not f.webhook_url:
            return {}, b""
        job = {"delivery_id": f.turn_id, "attempt": 1}
        queue, message_id, data = build_message(WEBHOOK_QUEUE, WEBHOOK_ACTOR, (job,), message_id=f"wh.{f.turn_id}.1",
                                                now_ms=int(now * 1000))
        return {"webhook": {"id": f.turn_id, "url": f.webhook_url, "tenant_id": f.tenant_id,
                            "max_attempts": self.settings.webhook_max_attempts,
                            "ttl_s": self.settings.turn_ttl_s, "message_id": message_id, "queue": queue}}, data

    async def stalled(self, turn_id: str, *, now: float, max_recoveries: int, stall_s: float | None = None,
                      recheck_s: float | None = None) -> Stall:
        """The watchdog's look at a turn it has not looked at for a while; see stalled.lua. (In the
        sharded layout the holder's turns are in another slot: read here, passed in.)"""
        k, settings = self.keys, self.settings
        cid, holder = (text(v or b"") for v in await self.redis.hmget(k.turn(turn_id), "conversation_id", "holder"))
        keys = [k.turn(turn_id), k.model_claim(turn_id), k.running(), k.waiting(cid or "-")]
        listed: dict[str, bool] = {}
        if not k.shards:
            keys.append(k.worker_turns(holder or "-"))
        elif holder:
            listed["listed"] = bool(await self.redis.sismember(k.worker_turns(holder), turn_id))
        reply = await self._run(
            "stalled", keys,
            lua.payload(turn_id=turn_id, now=now, stages=[s.name for s in self.graph.turn_stages],
                        model_stages=[s.name for s in self.graph.of_kind("model")], max_recoveries=max_recoveries,
                        holder=holder, stall_s=settings.stall_s if stall_s is None else stall_s,
                        recheck_s=settings.worker_timeout_s if recheck_s is None else recheck_s, **listed),
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
        messages, or -1 when it is alive after all. In the sharded layout one call per shard puts
        its queues back and a last one forgets the worker (a worker that comes back in between
        gets its fetched messages delivered again: every stage is idempotent)."""
        layout = self.layout
        fleet = [layout.workers(), layout.worker(worker_id), layout.heartbeats()]
        if not layout.shards:
            return await self._reap(fleet, layout, broker_id, worker_id, queues)
        if await self.redis.exists(layout.worker(worker_id)):
            return -1
        requeued = 0
        for k in layout.every_shard():
            requeued += await self._reap([], k, broker_id, worker_id, queues)
        forgotten = await self._reap(fleet, layout, broker_id, worker_id, ())
        return -1 if forgotten < 0 else requeued

    async def _reap(self, fleet: list[str], k: Keys, broker_id: str, worker_id: str, queues: Sequence[str]) -> int:
        triples = [key for q in queues for key in (k.acks(broker_id, q), k.queue_messages(q), k.queue(q))]
        reply = await self._run(
            "reap", [*fleet, *triples],
            lua.payload(worker_id=worker_id, broker_id=broker_id, channel=k.doorbell_channel() if queues else "",
                        queues=list(queues), fleet=bool(fleet)),
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

    async def point(self, turn_id: str) -> None:
        """Sharded layout: write the pointer by which readers that know only the turn's id find its
        shard (the client writes it too, when it submits; the first write stays)."""
        k = self.keys
        if k.shard is not None:
            await self.redis.set(k.turn_shard(turn_id), k.shard, nx=True,
                                 ex=self.settings.turn_ttl_s + TURN_SHARD_SLACK_S)

    async def emit(self, turn_id: str, event: events.Event) -> None:
        await self._run("emit", [self.keys.turn(turn_id), self.keys.events(turn_id)], events.encode(event))

    async def cancel(self, turn_id: str, reason: str, *, now: float) -> tuple[str, str]:
        k = self.keys
        reply = await self._run(
            "cancel", [k.cancel_flag(turn_id), k.turn(turn_id)],
            lua.payload(turn_id=turn_id, reason=reason or NO_CANCEL_REASON, ttl_s=self.settings.cancel_ttl_s,
                            channel=k.cancel_channel(), now=now),
        )
        return text(reply[0]), text(reply[1])

    async def cancel_reason(self, turn_id: str) -> str:
        """The reason the turn's cancel flag holds, for its `cancelled` event ("" when none was given)."""
        reason = text(await self.redis.get(self.keys.cancel_flag(turn_id)) or b"")
        return "" if reason == NO_CANCEL_REASON else reason

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

    async def artifact(self, turn_id: str, stage: str) -> bytes | None:
        return as_bytes(await self.redis.get(self.keys.artifact(turn_id, stage)))

    async def turn_state(self, turn_id: str) -> TurnState:
        return TurnState.from_hash(text_map(await self.redis.hgetall(self.keys.turn(turn_id))))

    async def waiting_request(self, conversation_id: str, turn_id: str) -> object:
        """The request a waiting or running turn was admitted with (the argument of its message)."""
        kept = await self.redis.hget(self.keys.waiting(conversation_id), turn_id)
        return json.loads(kept)["args"][0] if kept else None
