"""Stage 2, history: extract the one path the model must see from a branching message tree, and
assemble the pydantic-ai message history along it."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from pydantic_ai.messages import (
    ModelMessage,
    ModelMessagesTypeAdapter,
    ModelRequest,
    ModelResponse,
    TextPart,
    UserPromptPart,
)
from pydantic_core import ValidationError

from .errors import InvalidRequest, SnapshotCorrupt
from .records import MessageRecord


@dataclass(frozen=True, slots=True)
class ThreadDecision:
    """How the history was assembled: the thread's length and where each message came from."""

    messages: int
    from_snapshots: int
    from_text: int


def extract_thread(messages: Iterable[MessageRecord], start_id: str | None) -> tuple[list[MessageRecord], bool]:
    """The path root → `start_id`, oldest first, following `parent_id` links.

    `messages` is any bounded read of the conversation (Dify reads the newest N by time). Unlike
    Dify's walk over a time-ordered list, which stops at the first regeneration root it meets even
    when that root belongs to another branch, this follows the parent links themselves, so unrelated
    branches between a message and its parent cannot cut the thread short. Returns the thread and
    whether it was truncated by the read bound (a parent id that was not among `messages`).
    """
    if start_id is None:
        return [], False
    by_id = {m.id: m for m in messages}
    if start_id not in by_id:
        raise InvalidRequest(f"parent message {start_id!r} is not in this conversation")
    thread: list[MessageRecord] = []
    seen: set[str] = set()
    current: str | None = start_id
    while current is not None:
        record = by_id.get(current)
        if record is None:
            return thread[::-1], True
        if current in seen:
            raise SnapshotCorrupt(f"message tree has a cycle at {current!r}")
        seen.add(current)
        thread.append(record)
        current = record.parent_id
    return thread[::-1], False


def decode_messages(data: bytes | str, *, where: str) -> list[ModelMessage]:
    try:
        return list(ModelMessagesTypeAdapter.validate_json(data))
    except (ValidationError, ValueError) as e:
        raise SnapshotCorrupt(f"stored history for {where} cannot be read: {str(e)[:200]}") from None


def encode_messages(messages: Sequence[ModelMessage]) -> bytes:
    return ModelMessagesTypeAdapter.dump_json(list(messages))


def assemble_history(
    thread: Sequence[MessageRecord], snapshots: Mapping[str, Sequence[ModelMessage]]
) -> tuple[list[ModelMessage], ThreadDecision]:
    """Concatenate each thread message's stored pydantic-ai messages (agent path); a message with
    none falls back to its stored query and answer text (classic path)."""
    history: list[ModelMessage] = []
    from_snapshots = from_text = 0
    for record in thread:
        stored = snapshots.get(record.id)
        if stored:
            history.extend(stored)
            from_snapshots += 1
        elif record.status == "succeeded" and record.answer:
            history.append(ModelRequest(parts=[UserPromptPart(record.query)]))
            history.append(ModelResponse(parts=[TextPart(record.answer)]))
            from_text += 1
    decision = ThreadDecision(len(thread), from_snapshots, from_text)
    return history, decision
