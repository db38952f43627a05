"""The Redis store of record, as the stage actors use it (async). Every key comes from `keys.py`;
every write that must hang together is one of the Lua scripts in `lua.py`."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, cast

import redis.asyncio as aioredis
from redis.commands.core import AsyncScript
from threadline.pipeline.config import AgentConfig, config_from_json
from threadline.pipeline.contracts import Stage, TerminalType
from threadline.pipeline.errors import AgentNotFound, ConversationNotFound
from threadline.pipeline.events import Event
from threadline.pipeline.records import ConversationRecord, MessageRecord, conversation_from_hash
from threadline.pipeline.resolve import ConfigRef

from . import lua
from .broker import build_message
from .keys import Keys
from .settings import Settings

BeginStatus = Literal["go", "done", "terminal", "cancelled", "timed_out", "duplicate"]


@dataclass(frozen=True, slots=True)
class Begin:
    status: BeginStatus
    attempt: int = 1
    artifacts: tuple[str, str] = ("", "")
    conversation_id: str = ""
    fence: str = ""
    deadline_at: float | None = None
    terminal_status: str = ""


@dataclass(frozen=True, slots=True)
class Next:
    """The message a stage hands over to: actor (= queue) and its single argument."""

    queue: str
    arg: Any
    message_id: str
    delay_ms: int | None = None


@dataclass(frozen=True, slots=True)
class Finish:
    turn_id: str
    status: TerminalType
    event: Event
    conversation_id: str = ""
    message: MessageRecord | None = None
    snapshot: str | None = None
    pending_tool_calls: Sequence[dict[str, Any]] = ()
    fence: str = ""
    tenant_id: str = ""
    before: Sequence[Event] = ()


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


class Store:
    def __init__(self, client: aioredis.Redis, settings: Settings) -> None:
        self.redis = client
        self.settings = settings
        self.keys = Keys(settings.prefix)
        self._scripts: dict[str, AsyncScript] = {
            name: client.register_script(getattr(lua, name))
            for name in ("BEGIN", "ADMIT", "ADVANCE", "RETRY", "FINISH", "EMIT", "CANCEL")
        }

    @classmethod
    def connect(cls, url: str, settings: Settings) -> Store:
        return cls(aioredis.Redis.from_url(url, max_connections=64), settings)

    async def close(self) -> None:
        await self.redis.aclose()

    async def _run(self, name: str, keys: Sequence[str], args: Sequence[Any]) -> Any:
        return await self._scripts[name](keys=list(keys), args=list(args))

    # --- the turn state machine ----------------------------------------------------------------

    async def begin(
        self,
        turn_id: str,
        stage: Stage,
        *,
        now: float,
        inputs: tuple[str, str] = ("-", "-"),
        check_interrupts: bool = True,
        claim: str = "",
        announce: bool = True,
    ) -> Begin:
        k = self.keys
        reply = await self._run(
            "BEGIN",
            [k.turn(turn_id), k.events(turn_id), k.cancel_flag(turn_id),
             k.artifact(turn_id, inputs[0]), k.artifact(turn_id, inputs[1]), k.invoke_claim(turn_id), k.running()],
            [stage, turn_id, now, "1" if check_interrupts else "0", claim, int(self.settings.invoke_lease_s * 1000),
             "1" if announce else "0"],
        )
        status = reply[0].decode()
        if status != "go":
            return Begin(status=status, terminal_status=reply[1].decode() if len(reply) > 1 else "")
        attempt, art_a, art_b, conversation_id, fence, deadline = (r.decode() for r in reply[1:])
        return Begin(
            status="go",
            attempt=int(attempt),
            artifacts=(art_a, art_b),
            conversation_id=conversation_id,
            fence=fence,
            deadline_at=float(deadline) if deadline else None,
        )

    async def admit(self, turn_id: str, conversation_id: str, *, now: float, wake: bytes) -> tuple[str, str]:
        k = self.keys
        reply = await self._run(
            "ADMIT",
            [k.turn(turn_id), k.turn_queue(conversation_id), k.lease(conversation_id), k.cancel_flag(turn_id),
             k.running()],
            [turn_id, "", now, conversation_id, f"wake.{turn_id}", wake, self.settings.turn_ttl_s],
        )
        return reply[0].decode(), (reply[1].decode() if len(reply) > 1 and reply[1] else "")

    async def advance(
        self,
        turn_id: str,
        stage: Stage,
        *,
        next_: Next,
        now: float,
        now_ms: int,
        artifact: tuple[str, str] | None = None,
        events: Sequence[Event] = (),
        fence: str = "",
        conversation_id: str = "",
        accept: tuple[dict[str, str], MessageRecord, float] | None = None,
    ) -> str:
        """Finish `stage` and enqueue `next_` in one atomic step. `accept` (conversation fields,
        pending message row, deadline) makes the turn's conversation and message exist."""
        k = self.keys
        queue, message_id, data = build_message(
            next_.queue, next_.queue, (next_.arg,), message_id=next_.message_id, now_ms=now_ms,
            delay_ms=next_.delay_ms,
        )
        art_name, art_value = artifact or ("-", "")
        conv_fields, message_id_arg, row = "", "", ""
        if accept is not None:
            fields, pending, deadline_at = accept
            conv_fields = _dumps({"conversation": fields, "deadline_at": repr(deadline_at)})
            message_id_arg, row = pending.id, pending.model_dump_json()
        cid = conversation_id or "-"
        reply = await self._run(
            "ADVANCE",
            [k.turn(turn_id), k.events(turn_id), k.artifact(turn_id, art_name), k.conversation(cid),
             k.messages(cid), k.message_order(cid), k.lease(cid), k.running()],
            [stage, turn_id, fence, art_value, self.settings.artifact_ttl_s * 1000, self.settings.broker_namespace,
             queue, message_id, data, k.doorbell_channel(), now, conv_fields, message_id_arg, row,
             *(_dumps(e) for e in events)],
        )
        return str(reply.decode() if isinstance(reply, bytes) else reply)

    async def retry_invoke(self, turn_id: str, *, next_: Next, now_ms: int, event: Event) -> str:
        """Schedule the next attempt (a delayed message), announced by `event`."""
        k = self.keys
        queue, message_id, data = build_message(
            "invoke", "invoke", (next_.arg,), message_id=next_.message_id, now_ms=now_ms, delay_ms=next_.delay_ms
        )
        reply = await self._run(
            "RETRY",
            [k.turn(turn_id), k.events(turn_id), k.invoke_claim(turn_id), k.running()],
            [self.settings.broker_namespace, queue, message_id, data, k.doorbell_channel(), _dumps(event), turn_id,
             now_ms / 1000],
        )
        return str(reply.decode())

    async def finish(self, f: Finish, *, now: float) -> str:
        """The one terminal write of a turn. Returns "ok", "already" (a no-op) or "stale"."""
        k = self.keys
        cid = f.conversation_id or "-"
        usage = f.message.usage if f.message is not None else None
        reply = await self._run(
            "FINISH",
            [k.turn(f.turn_id), k.events(f.turn_id), k.conversation(cid), k.messages(cid), k.snapshots(cid),
             k.lease(cid), k.turn_queue(cid), k.usage(f.tenant_id or "-"), k.invoke_claim(f.turn_id), k.running()],
            [f.turn_id, f.status, _dumps(f.event), f.message.id if f.message else "",
             f.message.model_dump_json() if f.message else "", f.snapshot or "", _dumps(list(f.pending_tool_calls)),
             f.fence, self.settings.broker_namespace, k.doorbell_channel(), now, self.settings.turn_ttl_s,
             usage.input_tokens if usage else 0, usage.output_tokens if usage else 0, usage.requests if usage else 0,
             f.conversation_id, self.settings.prefix, *(_dumps(e) for e in f.before)],
        )
        return str(reply[0].decode())

    async def emit(self, turn_id: str, event: Event) -> None:
        await self._run("EMIT", [self.keys.turn(turn_id), self.keys.events(turn_id)], [_dumps(event)])

    async def cancel(self, turn_id: str, reason: str, *, now: float) -> tuple[str, str]:
        k = self.keys
        reply = await self._run(
            "CANCEL",
            [k.cancel_flag(turn_id), k.turn(turn_id)],
            [reason or "cancelled", self.settings.cancel_ttl_s, k.cancel_channel(), turn_id, now],
        )
        return reply[0].decode(), reply[1].decode()

    async def release_claim(self, turn_id: str) -> None:
        """Let a retried delivery of this invoke run at once instead of waiting out the claim."""
        await self.redis.delete(self.keys.invoke_claim(turn_id))

    async def refresh_claim(self, turn_id: str) -> None:
        await self.redis.pexpire(self.keys.invoke_claim(turn_id), int(self.settings.invoke_lease_s * 1000))

    async def artifact(self, turn_id: str, name: str) -> bytes | None:
        return as_bytes(await self.redis.get(self.keys.artifact(turn_id, name)))

    async def turn_state(self, turn_id: str) -> dict[str, str]:
        return text_map(await self.redis.hgetall(self.keys.turn(turn_id)))

    # --- reads ---------------------------------------------------------------------------------

    async def load_conversation(self, conversation_id: str) -> ConversationRecord:
        record = conversation_from_hash(
            conversation_id, text_map(await self.redis.hgetall(self.keys.conversation(conversation_id)))
        )
        if record is None:
            raise ConversationNotFound(f"conversation {conversation_id!r} does not exist")
        return record

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

    async def load_recent_messages(self, conversation_id: str, limit: int) -> list[MessageRecord]:
        """The newest `limit` message rows of a conversation, newest first (a bounded read)."""
        k = self.keys
        # no scores asked for: members only
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


def text(value: bytes | str) -> str:
    """redis-py returns bytes (no decode_responses); its types also admit str."""
    return value.decode() if isinstance(value, bytes) else value


def as_bytes(value: bytes | str | None) -> bytes | None:
    return value.encode() if isinstance(value, str) else value


def text_map(raw: Mapping[bytes | str, bytes | str]) -> dict[str, str]:
    return {text(k): text(v) for k, v in raw.items()}
