"""The finish stage: what a run leaves behind, prepared for storage whatever its outcome."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from pydantic_ai.messages import (
    ModelMessage,
    ModelRequest,
    ModelResponse,
    TextPart,
    ToolCallPart,
)

from .contracts import Usage
from .records import ConversationRecord, MessageRecord, MessageStatus, ResolvedTurn, ToolActivity


def prepare_snapshot(new_messages: Sequence[ModelMessage], *, paused: bool) -> list[ModelMessage] | None:
    """The run's messages as they are stored: no instruction text in any request; a trailing
    response whose tool calls never got results is marked `interrupted` so that the next turn
    continues (pydantic-ai repairs it) instead of failing on unprocessed tool calls. A paused run
    keeps its open calls as they are: the resume answers them. None when nothing was captured,
    which keeps the previous snapshot untouched."""
    if not new_messages:
        return None
    stored: list[ModelMessage] = [
        replace(m, instructions=None) if isinstance(m, ModelRequest) and m.instructions is not None else m
        for m in new_messages
    ]
    last = stored[-1]
    if not paused and isinstance(last, ModelResponse) and _has_open_calls(last) and last.state != "interrupted":
        stored[-1] = replace(last, state="interrupted")
    return stored


def _has_open_calls(response: ModelResponse) -> bool:
    return any(isinstance(p, ToolCallPart) for p in response.parts)


def run_answer(new_messages: Sequence[ModelMessage]) -> str:
    """The text of the run's last response: the (partial) answer of a run that did not succeed."""
    for message in reversed(new_messages):
        if isinstance(message, ModelResponse):
            return "".join(p.content for p in message.parts if isinstance(p, TextPart))
    return ""


def pending_row(turn: ResolvedTurn) -> MessageRecord:
    """The message row a turn writes when it is accepted."""
    return MessageRecord(
        id=turn.message_id,
        conversation_id=turn.conversation_id,
        parent_id=turn.parent_message_id,
        turn_id=turn.turn_id,
        query=turn.query,
        files=turn.files,
        created_at=turn.accepted_at,
        updated_at=turn.accepted_at,
    )


def final_row(
    turn: ResolvedTurn,
    *,
    status: MessageStatus,
    now: float,
    answer: str = "",
    usage: Usage | None = None,
    code: str | None = None,
    tools: Sequence[ToolActivity] = (),
) -> MessageRecord:
    """The message row of a finished turn: answer, status, error code, usage, tool activity."""
    return pending_row(turn).model_copy(
        update={
            "answer": answer,
            "status": status,
            "error_code": code,
            "usage": usage or Usage(),
            "tools": list(tools),
            "updated_at": now,
        }
    )


def new_conversation(turn: ResolvedTurn) -> ConversationRecord:
    """The conversation a turn starts: its scope, the config it is pinned to, its layers."""
    return ConversationRecord(
        id=turn.conversation_id,
        tenant_id=turn.tenant_id,
        app_id=turn.app_id,
        user_id=turn.user_id,
        agent_id=turn.config.id,
        config_ref=turn.config_ref,
        layers=list(turn.config.layers),
        created_at=turn.accepted_at,
    )
