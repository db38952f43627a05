"""Stored records (conversation, message) and the artifacts stages hand to each other."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from .config import AgentConfig
from .contracts import FileRef, Usage

MessageStatus = Literal["pending", "succeeded", "failed", "cancelled", "timed_out", "paused"]


class _Record(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class ConversationRecord(_Record):
    id: str
    tenant_id: str
    app_id: str
    user_id: str
    agent_id: str
    #: The config this conversation started with: "v<N>" (published) or "draft:<id>".
    config_ref: str
    #: The ordered layer names of the composition the stored history was made with.
    layers: list[str]
    revision: int = 0
    tip: str | None = None
    #: Tool calls the tip's paused turn waits on: [{"tool_call_id", "name", "args"}].
    pending_tool_calls: list[dict[str, Any]] = Field(default_factory=list)
    created_at: float = 0.0


class ToolActivity(_Record):
    tool_call_id: str
    name: str
    args: Any = None
    content: Any = None
    outcome: str | None = None


class MessageRecord(_Record):
    id: str
    conversation_id: str
    parent_id: str | None
    turn_id: str
    query: str = ""
    files: list[FileRef] = Field(default_factory=list)
    answer: str = ""
    status: MessageStatus = "pending"
    error_code: str | None = None
    usage: Usage = Field(default_factory=Usage)
    tools: list[ToolActivity] = Field(default_factory=list)
    created_at: float = 0.0
    updated_at: float = 0.0


class ResolvedTurn(_Record):
    """The `resolve` stage's output: everything later stages need, with the config pinned."""

    turn_id: str
    conversation_id: str
    message_id: str
    parent_message_id: str | None
    new_conversation: bool
    config_ref: str
    config: AgentConfig
    #: Instructions with `{{variables}}` expanded; run-level, never stored in history.
    instructions: str
    query: str
    files: list[FileRef] = Field(default_factory=list)
    context: str | None = None
    deferred_answers: dict[str, Any] | None = None
    deadline_s: float
    accepted_at: float
    tenant_id: str
    app_id: str
    user_id: str


def conversation_from_hash(conversation_id: str, data: Mapping[str, str]) -> ConversationRecord | None:
    """A conversation record from its stored hash fields; None when it does not exist."""
    if "config_ref" not in data:
        return None
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
