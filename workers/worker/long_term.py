"""Long-term memory as the worker sees it: whether a turn recalls and feeds it, whose partition it
is (always the turn's own ids), and the process's `MemoryStore`."""

from __future__ import annotations

import weakref

from threadline.pipeline.config import LongTermSpec
from threadline.pipeline.memory import Scope, scope_for
from threadline.pipeline.records import ConversationRecord, ResolvedTurn
from threadline.workers.storage.memory import MemoryStore
from threadline.workers.storage.store import Store

_stores: weakref.WeakKeyDictionary[Store, MemoryStore] = weakref.WeakKeyDictionary()


def memory_store(store: Store) -> MemoryStore:
    """The process's `MemoryStore` over the store's connection (its scripts registered once)."""
    found = _stores.get(store)
    if found is None:
        found = _stores[store] = MemoryStore(store.redis, store.keys)
    return found


def long_term_of(turn: ResolvedTurn) -> LongTermSpec | None:
    """The turn's long-term memory config, unless the agent has none or the turn said `memory: off`."""
    return turn.config.memory.long_term if turn.memory != "off" else None


def turn_scope(spec: LongTermSpec, turn: ResolvedTurn | ConversationRecord) -> Scope:
    """Whose memory: always the turn's own ids (never a model's output)."""
    return scope_for(spec.scope, tenant_id=turn.tenant_id, user_id=turn.user_id, app_id=turn.app_id,
                     agent_id=turn.agent_id)
