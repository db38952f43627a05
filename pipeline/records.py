"""Stored records (conversation, message) and the artifacts stages hand to each other."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from .config import AgentConfig
from .contracts import FileRef, Usage
from .guards import GuardDecision

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
    #: Why a guard answered instead of the model, or replaced its answer: {"kind", "rule"} (and
    #: rows stored before guards ran on RE2 may also carry "timed_out").
    guard: dict[str, str | bool] | None = None
    #: The turn that interrupted this one (`on_busy: interrupt`): `answer` is what it had said by then.
    interrupted_by: str | None = None


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
    #: The input guards' verdict: the turn is answered with its reply, without calling the model.
    guard: GuardDecision | None = None
    deadline_s: float
    accepted_at: float
    tenant_id: str
    app_id: str
    user_id: str
    agent_id: str = ""
    #: The request's `memory` flag: "off" turns neither recall nor feed long-term memory.
    memory: Literal["on", "off"] = "on"
    #: Where the terminal event is POSTed: the request's `webhook_url`, else its agent's.
    webhook_url: str | None = None
