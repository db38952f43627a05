"""What the shell loads for a transform stage's `needs` (`pipeline.stages.Stage.needs`), by need."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from threadline.pipeline.history import extract_thread
from threadline.pipeline.records import ResolvedTurn

from .store import Store

Loader = Callable[[Store, ResolvedTurn], Awaitable[Any]]


async def load_thread(store: Store, turn: ResolvedTurn) -> Any:
    """The thread root → parent (a bounded read of the newest rows), whether the bound cut it, and
    its stored snapshots (raw JSON by message id)."""
    recent = await store.load_recent_messages(turn.conversation_id, turn.config.memory.message_limit)
    thread, truncated = extract_thread(recent, turn.parent_message_id)
    snapshots = await store.load_snapshots(turn.conversation_id, [m.id for m in thread])
    return thread, truncated, snapshots


LOADERS: dict[str, Loader] = {"thread": load_thread}
