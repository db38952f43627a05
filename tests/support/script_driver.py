"""A turn driven through the store's scripts the way the runners drive it (admit → begin → advance →
… → finish), with no worker process: shared by the script tests (`test_scripts.py`, `test_delete_script.py`)."""

from __future__ import annotations

import time
import uuid

from threadline.pipeline import events
from threadline.pipeline.config import AgentConfig
from threadline.pipeline.contracts import TURN_SCHEMA, Envelope, TurnRequest, Usage, new_conversation_id
from threadline.pipeline.persist import final_row, new_conversation, pending_row
from threadline.pipeline.records import ResolvedTurn
from threadline.pipeline.resolve import resolve_turn
from threadline.pipeline.stages import DEFAULT_GRAPH
from threadline.workers.protocol.wire import build_message
from threadline.workers.storage.store import Store
from threadline.workers.storage.turns import WAKE_ID, Accept, Begin, Finish, Next

AGENT = AgentConfig.model_validate({"id": "agent-1", "model": "offline:echo"})
STAGES = tuple(s.name for s in DEFAULT_GRAPH.turn_stages)
FIRST, SECOND, THIRD = STAGES[0], STAGES[1], STAGES[2]
MODEL = DEFAULT_GRAPH.of_kind("model")[0].name
LAST = STAGES[-1]


# --- fixtures and a turn driver ---------------------------------------------------------------------


def new_id(kind: str = "t") -> str:
    return f"{kind}-{uuid.uuid4().hex[:12]}"


def make_request(*, conversation_id: str | None = None, query: str = "hello", deadline_s: float | None = None,
                 turn_id: str | None = None) -> TurnRequest:
    return TurnRequest.model_validate({
        "schema": TURN_SCHEMA, "turn_id": turn_id or new_id(), "tenant_id": "t1", "app_id": "app", "user_id": "u1",
        "agent_id": AGENT.id, "conversation_id": conversation_id, "query": query, "deadline_s": deadline_s,
    })


class Turn:
    """One turn, driven through the store as the runners drive it."""

    def __init__(self, store: Store, req: TurnRequest, resolved: ResolvedTurn) -> None:
        self.store, self.req, self.resolved = store, req, resolved
        self.id = req.turn_id
        self.cid = resolved.conversation_id
        self.fence = ""
        # the request as admit keeps it: a dramatiq message whose id is the wake placeholder
        _, _, self.request = build_message(FIRST, FIRST, (req.model_dump(mode="json", by_alias=True),),
                                           message_id=WAKE_ID, now_ms=int(time.time() * 1000))

    async def admit(self) -> tuple[str, str]:
        status, detail, _ = await self.store.admit(self.id, self.cid, now=time.time(), request=self.request)
        if status == "admitted":
            self.fence = detail
        return status, detail

    async def begin(self, stage: str, *, claim: str = "", interrupts: bool = True, now: float | None = None,
                    attempt_hint: int = 1, holder: str = "") -> Begin:
        started = None if stage == FIRST else events.StageEvent(turn_id=self.id, stage=stage, status="started")
        return await self.store.begin(self.id, stage, now=time.time() if now is None else now,
                                      interrupts=interrupts, claim=claim, started=started,
                                      attempt_hint=attempt_hint, holder=holder or claim)

    async def advance(self, stage: str, *, artifact: str | None = None, fence: str | None = None,
                      accept: bool = False, next_id: str | None = None, attempt: int = 1) -> str:
        following = DEFAULT_GRAPH.next(stage)
        assert following is not None
        finished = events.StageEvent(turn_id=self.id, attempt=attempt, stage=stage, status="finished", ms=1.0)
        events_: list[events.Event] = [finished]
        accepted = None
        if accept:
            events_ = [events.Accepted(turn_id=self.id, conversation_id=self.cid, message_id=self.resolved.message_id,
                                       parent_message_id=self.resolved.parent_message_id,
                                       config_version=self.resolved.config_ref),
                       events.StageEvent(turn_id=self.id, stage=stage, status="started"), finished]
            accepted = Accept(new_conversation(self.resolved), pending_row(self.resolved),
                              self.resolved.accepted_at + self.resolved.deadline_s)
        arg = Envelope(turn_id=self.id, stage=following.name, attempt=attempt).model_dump()
        return await self.store.advance(
            self.id, stage, next_=Next(following.name, arg, next_id or new_id("m")), now=time.time(),
            now_ms=int(time.time() * 1000),
            artifact=self.resolved.model_dump_json() if artifact is None else artifact, events_=events_,
            fence=self.fence if fence is None else fence, conversation_id=self.cid, accept=accepted)

    async def accept(self) -> None:
        """Through the admit stage: admitted (which begins the stage), accepted (the conversation and
        the row exist)."""
        assert (await self.admit())[0] == "admitted"
        assert await self.advance(FIRST, accept=True) == "ok"

    async def run_to(self, stage: str) -> None:
        """Accepted, and every stage before `stage` done (the model stage with its claim kept)."""
        await self.accept()
        for name in STAGES[1:STAGES.index(stage)]:
            assert (await self.begin(name, claim="w1" if name == MODEL else "")).status == "go"
            assert await self.advance(name, artifact=f"<{name}>") == "ok"

    async def finish(self, status: events.TerminalType = "succeeded", *, snapshot: str | None = "SNAP",
                     fence: str | None = None, usage: Usage | None = None, webhook_url: str = "") -> str:
        """The finish stage's write, as `run_finish` makes it."""
        usage = usage or Usage(input_tokens=11, output_tokens=7, requests=1)
        row = final_row(self.resolved, status=status, now=time.time(), answer="the answer", usage=usage,
                        code=None if status in ("succeeded", "paused") else "model_error")
        terminal = events.terminal(self.id, 1, status, answer="the answer", usage=usage,
                                   code=None if status in ("succeeded", "paused") else "model_error",
                                   conversation_id=self.cid, message_id=self.resolved.message_id)
        finished = events.StageEvent(turn_id=self.id, stage=LAST, status="finished", ms=1.0)
        return await self.store.finish(
            Finish(turn_id=self.id, event=terminal, conversation_id=self.cid, message=row, snapshot=snapshot,
                   fence=self.fence if fence is None else fence, tenant_id=self.resolved.tenant_id,
                   before=[finished], webhook_url=webhook_url),
            now=time.time())

    async def end(self, status: events.TerminalType = "failed", *, code: str = "agent_not_found") -> str:
        """An early ending, as `Runtime.end_turn` writes it: the row only when the turn was accepted
        (and then the fence is checked), never a snapshot."""
        state = await self.store.turn_state(self.id)
        accepted = bool(state.message_id)
        terminal = events.terminal(self.id, state.attempt, status, code=code, message="ended early",
                                   conversation_id=self.cid if accepted else None,
                                   message_id=self.resolved.message_id if accepted else None)
        row = final_row(self.resolved, status=status, now=time.time(), code=code) if accepted else None
        return await self.store.finish(
            Finish(turn_id=self.id, event=terminal, conversation_id=state.conversation_id or self.cid, message=row,
                   fence=state.fence, tenant_id=self.resolved.tenant_id if accepted else ""), now=time.time())


async def make_turn(store: Store, *, conversation_id: str | None = None, query: str = "hello",
                    deadline_s: float | None = None, accepted_at: float | None = None,
                    turn_id: str | None = None) -> Turn:
    """A turn resolved as the admit stage resolves it (against the conversation when it exists)."""
    req = make_request(conversation_id=conversation_id, query=query, deadline_s=deadline_s, turn_id=turn_id)
    cid = conversation_id or new_conversation_id(req.turn_id)
    conversation = await store.find_conversation(cid)
    resolved, _ = resolve_turn(req, conversation=conversation, config=AGENT, config_ref="v1",
                               new_conversation_id=cid, now=time.time() if accepted_at is None else accepted_at)
    return Turn(store, req, resolved)
