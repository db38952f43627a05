"""How records are laid out in Redis hashes, written in one place: the conversation hash and the
turn hash. `pipeline/` knows the records; only this module knows their storage encoding."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

# the record types load pydantic-ai's message types: what reads only bytes (the producers' commands)
# must not pay for them
if TYPE_CHECKING:
    from threadline.pipeline.records import ConversationRecord


def text(value: bytes | str) -> str:
    """redis-py returns bytes (no decode_responses); its types also admit str."""
    return value.decode() if isinstance(value, bytes) else value


def as_bytes(value: bytes | str | None) -> bytes | None:
    return value.encode() if isinstance(value, str) else value


def text_map(raw: Mapping[bytes | str, bytes | str]) -> dict[str, str]:
    return {text(k): text(v) for k, v in raw.items()}


# --- conversations ----------------------------------------------------------------------------------


def conversation_to_hash(record: ConversationRecord) -> dict[str, str]:
    """The fields a conversation hash starts with. `tip`, `pending`, `revision` and `message_seq`
    change with every turn (finish.lua, advance.lua)."""
    return {
        "tenant_id": record.tenant_id,
        "app_id": record.app_id,
        "user_id": record.user_id,
        "agent_id": record.agent_id,
        "config_ref": record.config_ref,
        "layers": json.dumps(record.layers),
        "revision": str(record.revision),
        "tip": record.tip or "",
        "pending": json.dumps(record.pending_tool_calls),
        "created_at": repr(record.created_at),
    }


def conversation_from_hash(conversation_id: str, data: Mapping[str, str]) -> ConversationRecord | None:
    """A conversation record from its stored hash fields; None when it does not exist."""
    if "config_ref" not in data:
        return None
    from threadline.pipeline.records import ConversationRecord

    return ConversationRecord(
        id=conversation_id,
        tenant_id=data["tenant_id"],
        app_id=data["app_id"],
        user_id=data["user_id"],
        agent_id=data["agent_id"],
        config_ref=data["config_ref"],
        layers=json.loads(data["layers"]),
        revision=int(data.get("revision", 0)),
        tip=data.get("tip") or None,
        pending_tool_calls=json.loads(data.get("pending") or "[]"),
        created_at=float(data.get("created_at", 0)),
    )


# --- turns ------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TurnState:
    """A turn's record (`Keys.turn`), as the scripts keep it."""

    #: "" (unknown), "waiting", "running", or a terminal type.
    status: str = ""
    stage: str = ""
    #: The worker running one of its stages now ("" between stages: waiting in a stage's queue).
    holder: str = ""
    attempt: int = 1
    conversation_id: str = ""
    #: Set once the turn was accepted (its message row exists).
    message_id: str = ""
    fence: str = ""
    deadline_at: float | None = None
    done: frozenset[str] = frozenset()
    recoveries: int = 0
    cancel_requested_at: float | None = None

    @classmethod
    def from_hash(cls, data: Mapping[str, str]) -> TurnState:
        return cls(
            status=data.get("status", ""),
            stage=data.get("stage", ""),
            holder=data.get("holder", ""),
            attempt=int(data.get("attempt", "1")),
            conversation_id=data.get("conversation_id", ""),
            message_id=data.get("message_id", ""),
            fence=data.get("fence", ""),
            deadline_at=float(data["deadline_at"]) if data.get("deadline_at") else None,
            done=frozenset(k.removeprefix("done:") for k in data if k.startswith("done:")),
            recoveries=int(data.get("recoveries", "0")),
            cancel_requested_at=float(data["cancel_requested_at"]) if data.get("cancel_requested_at") else None,
        )
