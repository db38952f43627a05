"""The Python client: register agents, submit turns, follow their events, cancel them, read threads.

It enqueues exactly what the README tells any other producer to write with raw Redis commands
(HSET the message, RPUSH its id, PUBLISH the doorbell), so that path is exercised on every use.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator, Mapping
from typing import Any, cast

import redis
from pydantic_ai.messages import ModelMessage

from threadline.pipeline import events as ev
from threadline.pipeline.config import AgentConfig, config_to_json, parse_agent_config
from threadline.pipeline.contracts import TURN_SCHEMA, new_conversation_id, valid_id, valid_turn_id
from threadline.pipeline.events import TERMINAL_TYPES, Event, Terminal
from threadline.pipeline.history import encode_messages, extract_thread
from threadline.pipeline.records import ConversationRecord, MessageRecord
from threadline.pipeline.stages import DEFAULT_GRAPH

from . import lua
from .broker import build_message
from .control import CANCEL_ACTOR, CONTROL_QUEUE
from .keys import Keys
from .schema import TurnState, as_bytes, conversation_from_hash, conversation_to_hash, text, text_map
from .settings import Settings

#: The stage producers enqueue turns to: the graph's admit stage.
ADMIT = DEFAULT_GRAPH.first


class Client:
    def __init__(self, url: str, *, prefix: str = "tl") -> None:
        self.url = url
        self.redis = redis.Redis.from_url(url)
        self.keys = Keys(prefix)
        self.namespace = f"{prefix}:q"
        self._submit = self.redis.register_script(lua.source("submit"))

    @classmethod
    def from_settings(cls, settings: Settings, url: str | None = None) -> Client:
        target = url or settings.redis_url
        if target is None:
            raise RuntimeError("no Redis URL: set REDIS_URL or start `threadline worker` first")
        return cls(target, prefix=settings.prefix)

    def close(self) -> None:
        self.redis.close()

    # --- agents --------------------------------------------------------------------------------

    def put_agent(self, config: AgentConfig | str | bytes, *, draft_id: str | None = None) -> str:
        """Register a config: a new immutable published version made active, or a draft updated in
        place. Returns the config reference ("v<N>" or "draft:<id>")."""
        if not isinstance(config, AgentConfig):
            config = parse_agent_config(config)
        data = config_to_json(config)
        if draft_id is not None:
            self.redis.set(self.keys.agent_draft(config.id, draft_id), data)
            self.redis.sadd(self.keys.agents(), config.id)
            return f"draft:{draft_id}"
        version = int(self.redis.hincrby(self.keys.agent(config.id), "latest", 1))
        pipe = self.redis.pipeline(transaction=True)
        pipe.set(self.keys.agent_version(config.id, version), data)
        pipe.hset(self.keys.agent(config.id), "active", version)
        pipe.sadd(self.keys.agents(), config.id)
        pipe.execute()
        return f"v{version}"

    # --- turns ---------------------------------------------------------------------------------

    def submit(self, request: Mapping[str, Any]) -> str:
        """Enqueue a turn request; returns its turn id (generated when the request has none)."""
        body = {"schema": TURN_SCHEMA, **request}
        body.setdefault("turn_id", uuid.uuid4().hex)
        turn_id = str(body["turn_id"])
        # a first turn takes its place in the line of the conversation it will start, so follow-ups
        # that name that conversation before it exists wait behind it
        conversation_id = body.get("conversation_id") or new_conversation_id(turn_id)
        self.enqueue(ADMIT.queue, ADMIT.name, (body,), conversation_id=str(conversation_id), turn_id=turn_id)
        return turn_id

    def submit_raw(self, request: object, *, message_id: str | None = None) -> str:
        """Enqueue anything as the `resolve` argument (tests use it for malformed input). Returns the
        dramatiq message id, which is the turn id of a request that names none."""
        return self.enqueue(ADMIT.queue, ADMIT.name, (request,), message_id=message_id)

    def enqueue(self, queue: str, actor: str, args: tuple[Any, ...], *, message_id: str | None = None,
                conversation_id: str | None = None, turn_id: str | None = None) -> str:
        """What any producer does: store a dramatiq message, push its id on the queue, ring the
        doorbell; and a turn for an existing conversation takes its place in that conversation's
        line now, so that turns run in the order they were submitted. Returns the message id."""
        target, mid, data = build_message(queue, actor, args, message_id=message_id or uuid.uuid4().hex,
                                          now_ms=int(time.time() * 1000))
        # only ids that name keys of their own take a place in a line (workers refuse the others)
        register = bool(conversation_id and turn_id and valid_turn_id(turn_id) and valid_id(conversation_id))
        line = self.keys.turn_queue(conversation_id if register and conversation_id else "-")
        turn = self.keys.turn(turn_id if register and turn_id else "-")
        self._submit(keys=[self.keys.queue_messages(target), self.keys.queue(target), line, turn],
                     args=[lua.payload(message_id=mid, turn_id=turn_id if register else "",
                                           channel=self.keys.doorbell_channel(), queue=target), data])
        return mid

    def cancel(self, turn_id: str, reason: str = "") -> str:
        """Ask the control queue to cancel a turn. Returns "enqueued", or "noop: <status>" when the
        turn has already finished (cancelling a finished turn changes nothing)."""
        status = self.turn_state(turn_id).status
        if status in TERMINAL_TYPES:
            return f"noop: {status}"
        self.enqueue(CONTROL_QUEUE, CANCEL_ACTOR, (turn_id, reason))
        return "enqueued"

    def events(self, turn_id: str, *, follow: bool = False, timeout_s: float | None = None,
               after: str = "0") -> Iterator[Event]:
        """The turn's events in order; with `follow`, wait for new ones until the terminal event."""
        key = self.keys.events(turn_id)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            block = None
            if follow:
                remaining = 1.0 if deadline is None else deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"turn {turn_id} did not finish in {timeout_s} s")
                block = max(1, int(min(remaining, 1.0) * 1000))
            reply: Any = self.redis.xread({key: after}, block=block, count=500)
            entries = reply[0][1] if reply else []
            for entry_id, fields in entries:
                after = text(entry_id)
                event = ev.decode(fields[b"json"])
                yield event
                if event.type in TERMINAL_TYPES:
                    return
            if not follow and not entries:
                return

    def wait(self, turn_id: str, timeout_s: float = 60.0) -> Terminal:
        """Block until the turn's terminal event and return it."""
        for event in self.events(turn_id, follow=True, timeout_s=timeout_s):
            if isinstance(event, Terminal):
                return event
        raise TimeoutError(turn_id)

    def decisions(self, turn_id: str, *, conversation_id: str | None = None) -> dict[str, dict[str, Any]]:
        """The decision records the turn's stages stored with its message, by stage."""
        cid = conversation_id or self.turn_state(turn_id).conversation_id
        if not cid:
            return {}
        names = list(DEFAULT_GRAPH.names)
        values = self.redis.hmget(self.keys.decisions(cid), [f"{turn_id}:{name}" for name in names])
        return {name: json.loads(v) for name, v in zip(names, values, strict=True) if v is not None}

    def turn_state(self, turn_id: str) -> TurnState:
        return TurnState.from_hash(text_map(self.redis.hgetall(self.keys.turn(turn_id))))

    # --- conversations -------------------------------------------------------------------------

    def conversation(self, conversation_id: str) -> ConversationRecord | None:
        fields = text_map(self.redis.hgetall(self.keys.conversation(conversation_id)))
        return conversation_from_hash(conversation_id, fields)

    def messages(self, conversation_id: str) -> list[MessageRecord]:
        rows = self.redis.hvals(self.keys.messages(conversation_id))
        return sorted((MessageRecord.model_validate_json(r) for r in rows), key=lambda m: m.created_at)

    def thread(self, conversation_id: str, message_id: str | None = None) -> list[MessageRecord]:
        """The path root → `message_id` (default: the tip), oldest first."""
        conversation = self.conversation(conversation_id)
        if conversation is None:
            return []
        thread, _ = extract_thread(self.messages(conversation_id), message_id or conversation.tip)
        return thread

    def import_conversation(
        self,
        *,
        conversation_id: str,
        tenant_id: str,
        app_id: str,
        user_id: str,
        agent_id: str,
        turns: list[tuple[str, str, list[ModelMessage] | None]],
        layers: list[str] | None = None,
    ) -> str:
        """Import a conversation made elsewhere (a migration): each turn is (query, answer, and the
        pydantic-ai messages it added, or None for a text-only message). The conversation is
        pinned to the agent's active version. Returns the id of the last message (the tip)."""
        active = self.redis.hget(self.keys.agent(agent_id), "active")
        stored = self.redis.get(self.keys.agent_version(agent_id, text(active))) if active is not None else None
        if active is None or stored is None:
            raise ValueError(f"agent {agent_id!r} is not registered")
        version = text(active)
        config = AgentConfig.model_validate_json(stored)
        if self.redis.exists(self.keys.conversation(conversation_id)):
            raise ValueError(f"conversation {conversation_id!r} exists")
        pipe = self.redis.pipeline(transaction=True)
        parent: str | None = None
        now = time.time()
        for seq, (query, answer, messages) in enumerate(turns, start=1):
            message_id = f"{conversation_id}-m{seq}"
            row = MessageRecord(id=message_id, conversation_id=conversation_id, parent_id=parent,
                                turn_id=message_id, query=query, answer=answer, status="succeeded",
                                created_at=now + seq / 1000, updated_at=now + seq / 1000)
            pipe.hset(self.keys.messages(conversation_id), message_id, row.model_dump_json())
            pipe.zadd(self.keys.message_order(conversation_id), {message_id: seq})
            if messages is not None:
                pipe.hset(self.keys.snapshots(conversation_id), message_id, encode_messages(messages))
            parent = message_id
        record = ConversationRecord(id=conversation_id, tenant_id=tenant_id, app_id=app_id, user_id=user_id,
                                    agent_id=agent_id, config_ref=f"v{version}", layers=layers or config.layers,
                                    revision=len(turns), tip=parent, created_at=now)
        fields = {**conversation_to_hash(record), "message_seq": str(len(turns))}
        pipe.hset(self.keys.conversation(conversation_id), mapping=cast(Any, fields))
        pipe.execute()
        return parent or ""

    def snapshot(self, conversation_id: str, message_id: str) -> bytes | None:
        return as_bytes(self.redis.hget(self.keys.snapshots(conversation_id), message_id))
