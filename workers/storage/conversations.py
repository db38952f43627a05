"""Conversations as the stage runners read and write them: records, the message tree and its walk,
cached token counts, decisions, summaries, tool-result clearing and deletion."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, cast

from threadline.pipeline.config import AgentConfig, config_from_json
from threadline.pipeline.errors import AgentNotFound, ConversationNotFound
from threadline.pipeline.records import ConversationRecord, MessageRecord
from threadline.pipeline.resolve import ConfigRef
from threadline.pipeline.stages import StageGraph
from threadline.workers.protocol.keys import Keys
from threadline.workers.protocol.schema import (
    as_bytes,
    conversation_from_hash,
    text,
    text_map,
)
from threadline.workers.storage import lua
from threadline.workers.storage.base import StoreBase
from threadline.workers.storage.memory import MemoryStore

DeleteStatus = Literal["deleted", "not_found", "busy"]


#: Reads of a conversation's rows a delete makes before it gives up on a conversation whose turns
#: keep coming and going between its read and its script.
DELETE_ATTEMPTS = 5


@dataclass(frozen=True, slots=True)
class DeleteResult:
    status: DeleteStatus
    conversation_id: str
    messages: int = 0
    turns: int = 0
    #: When busy: the turn holding the conversation, then those waiting in its line (up to 50).
    blocking: tuple[str, ...] = ()


ClearStatus = Literal["cleared", "busy", "gone", "changed"]


@dataclass(frozen=True, slots=True)
class CachedCounts:
    """Token counts cached for some turns, and the content version of each turn whose snapshot was
    rewritten (absent: version 0, the snapshot as the turn stored it)."""

    counts: dict[str, int]
    versions: dict[str, int]


def count_field(message_id: str, version: int, tokenizer: str) -> str:
    """The field of a turn's count in the token counts hash: per tokenizer and content version (a
    snapshot whose tool results compaction cleared is counted again, under its next version)."""
    return f"{message_id}|{tokenizer}" if version == 0 else f"{message_id}#{version}|{tokenizer}"


def version_field(message_id: str) -> str:
    return f"{message_id}|version"


def turn_of_row(row: bytes | str) -> str:
    """The turn a stored message row belongs to."""
    return str(json.loads(row)["turn_id"])


def deletion(keys: Keys, graph: StageGraph, conversation_id: str, *, tenant_id: str | None,
             rows: Mapping[str, str], stored_tenant: str | None) -> tuple[list[str], str]:
    """KEYS and ARGV[1] of delete_conversation.lua, for the rows read (message id -> turn id) and the
    tenant read from the conversation (whose conversation index loses it)."""
    cid, k = conversation_id, keys.of_conversation(conversation_id)  # its turns and indexes: its shard
    head = [k.conversation(cid), k.messages(cid), k.turn_queue(cid), k.lease(cid), k.waiting(cid)]
    turns = sorted(set(rows.values()))
    stages = [s.name for s in graph.turn_stages]
    rest = [key for key in k.conversation_keys(cid) if key not in head]
    owned = [key for turn_id in turns for key in k.turn_keys(turn_id, stages)]
    index = k.tenant_conversations(stored_tenant or "-")
    return ([*head, k.running(), k.activity(), index, *rest, *owned],
            lua.payload(conversation_id=cid, tenant_id=tenant_id or "", messages=sorted(rows), turns=turns,
                        stored_tenant=stored_tenant or ""))


def delete_result(conversation_id: str, reply: Sequence[bytes | int]) -> DeleteResult | None:
    """The script's reply; None when the rows changed since they were read (read them again)."""
    status = text(cast(bytes, reply[0]))
    if status == "deleted":
        return DeleteResult("deleted", conversation_id, messages=int(reply[1]), turns=int(reply[2]))
    if status == "busy":
        return DeleteResult("busy", conversation_id, blocking=tuple(text(cast(bytes, t)) for t in reply[1:]))
    if status == "not_found":
        return DeleteResult("not_found", conversation_id)
    return None


class ConversationStore(StoreBase):
    async def find_conversation(self, conversation_id: str) -> ConversationRecord | None:
        fields = text_map(await self.redis.hgetall(self.keys.conversation(conversation_id)))
        return conversation_from_hash(conversation_id, fields)

    async def load_conversation(self, conversation_id: str) -> ConversationRecord:
        record = await self.find_conversation(conversation_id)
        if record is None:
            raise ConversationNotFound(f"conversation {conversation_id!r} does not exist")
        return record

    async def message(self, conversation_id: str, message_id: str) -> MessageRecord | None:
        row = await self.redis.hget(self.keys.messages(conversation_id), message_id)
        return MessageRecord.model_validate_json(row) if row else None

    async def load_config(self, agent_id: str, ref: ConfigRef) -> tuple[AgentConfig, str]:
        """The config a turn runs and its reference ("v<N>" or "draft:<id>"), in one command: the
        active version's document is kept in the agent's hash (`active_config`)."""
        return (await self._with_config(agent_id, ref, lambda pipe: None))[1]

    async def find_with_config(self, conversation_id: str, agent_id: str,
                               ref: ConfigRef) -> tuple[ConversationRecord | None, tuple[AgentConfig, str]]:
        """A conversation's record (None: it does not exist) and the config `ref` names, read in one
        round trip: a new conversation's first turn needs both, and neither depends on the other."""
        (fields,), config = await self._with_config(
            agent_id, ref, lambda pipe: pipe.hgetall(self.keys.conversation(conversation_id)))
        return conversation_from_hash(conversation_id, text_map(fields)), config

    async def config_and_rows(self, agent_id: str, ref: ConfigRef, conversation_id: str,
                              message_ids: Sequence[str]) -> tuple[tuple[AgentConfig, str], list[bool]]:
        """The config `ref` names and whether each of `message_ids` is a row of the conversation, in
        one round trip: what a turn of an existing conversation checks besides its record."""
        def rows(pipe: Any) -> None:
            for message_id in message_ids:
                pipe.hexists(self.keys.messages(conversation_id), message_id)

        found, config = await self._with_config(agent_id, ref, rows)
        return config, [bool(r) for r in found]

    async def _with_config(self, agent_id: str, ref: ConfigRef,
                           queue: Callable[[Any], None]) -> tuple[list[Any], tuple[AgentConfig, str]]:
        """The replies of the reads `queue` puts on a pipeline, and the config `ref` names, read with
        them in the same round trip."""
        async with self.redis.pipeline(transaction=False) as pipe:
            queue(pipe)
            self._read_config(pipe, agent_id, ref)
            *replies, reply = await pipe.execute()
        return replies, await self._config(agent_id, ref, reply)

    def _read_config(self, pipe: Any, agent_id: str, ref: ConfigRef) -> None:
        """Queue on `pipe` the read of the config `ref` names (`_config` makes it one)."""
        k = self.keys
        if ref.kind == "active":
            pipe.hmget(k.agent(agent_id), ["active", "active_config"])
        else:
            assert ref.value is not None
            pipe.get(k.agent_draft(agent_id, ref.value) if ref.kind == "draft"
                     else k.agent_version(agent_id, ref.value))

    async def _config(self, agent_id: str, ref: ConfigRef, reply: Any) -> tuple[AgentConfig, str]:
        """The config out of `load_config`'s read: a draft's or a version's document, or the active
        version and its document (an agent made active before the hash kept it: read by number)."""
        if ref.kind == "draft":
            if reply is None:
                raise AgentNotFound(f"agent {agent_id!r} has no draft {ref.value!r}")
            return config_from_json(reply), f"draft:{ref.value}"
        version, data = ref.value, reply
        if ref.kind == "active":
            active, data = reply
            if active is None:
                raise AgentNotFound(f"agent {agent_id!r} is not registered")
            version = text(active)
            if data is None:
                data = await self.redis.get(self.keys.agent_version(agent_id, version))
        if data is None:
            raise AgentNotFound(f"agent {agent_id!r} has no version {version}")
        return config_from_json(data), f"v{version}"

    async def walk_back(self, conversation_id: str, from_id: str | None, *,
                        batch: int) -> AsyncIterator[list[MessageRecord]]:
        """Message rows from `from_id` back to the conversation's first, newest first, `batch` at first
        and twice as many each round trip (a parent is always older than its children, so a thread
        walked back from any message is found in these rows, in order)."""
        if from_id is None:
            return
        k = self.keys
        score = await self.redis.zscore(k.message_order(conversation_id), from_id)
        if score is None:
            return
        offset = 0
        while True:
            raw = cast(list[bytes], await self.redis.zrevrangebyscore(
                k.message_order(conversation_id), score, "-inf", start=offset, num=batch))
            if not raw:
                return
            offset += len(raw)
            batch = min(batch * 2, 512)  # a short walk stays short; a long one takes few round trips
            rows = await self.redis.hmget(k.messages(conversation_id), [text(i) for i in raw])
            yield [MessageRecord.model_validate_json(r) for r in rows if r is not None]

    async def token_counts(self, conversation_id: str, message_ids: Sequence[str], tokenizer: str) -> CachedCounts:
        """The cached counts of the turns' current content: one round trip, two for rewritten turns."""
        if not message_ids:
            return CachedCounts({}, {})
        key, n = self.keys.token_counts(conversation_id), len(message_ids)
        values = await self.redis.hmget(key, [*map(version_field, message_ids),
                                              *(count_field(mid, 0, tokenizer) for mid in message_ids)])
        versions = {mid: int(v) for mid, v in zip(message_ids, values[:n], strict=True) if v is not None}
        counts = {mid: int(v) for mid, v in zip(message_ids, values[n:], strict=True)
                  if v is not None and mid not in versions}
        if versions:
            later = await self.redis.hmget(key, [count_field(mid, v, tokenizer) for mid, v in versions.items()])
            counts.update({mid: int(v) for mid, v in zip(versions, later, strict=True) if v is not None})
        return CachedCounts(counts, versions)

    async def save_token_counts(self, conversation_id: str, counts: dict[str, int], tokenizer: str, *,
                                versions: Mapping[str, int] | None = None) -> None:
        """`counts` of the content versions read before the snapshots were (a count saved under a
        version a compaction has since replaced is never read)."""
        got = versions or {}
        await self.redis.hset(self.keys.token_counts(conversation_id),
                              mapping={count_field(mid, got.get(mid, 0), tokenizer): n for mid, n in counts.items()})

    async def clear_tool_results(self, conversation_id: str, snapshots: Mapping[str, tuple[bytes, bytes]], *,
                                 counts: Mapping[str, int], tokenizer: str) -> ClearStatus:
        """Replace turns' snapshots (`message id -> (stored, cleared)`), each with its content version
        bumped and its count under the new version, in one script (clear_tool_results.lua); fenced
        like `save_summary`, and more: nothing is written while a turn of the conversation holds it
        ("busy"), once the conversation is gone, or when a snapshot or its version is no longer the
        one read ("changed"): a later cut clears what is left."""
        k, ids = self.keys, list(snapshots)
        counts_key = k.token_counts(conversation_id)
        read = await self.redis.hmget(counts_key, [version_field(m) for m in ids])
        versions = [int(v or 0) for v in read]
        turns = [{"id": mid, "version_field": version_field(mid), "version": version, "count": counts[mid],
                  "old_count": count_field(mid, version, tokenizer),
                  "new_count": count_field(mid, version + 1, tokenizer)}
                 for mid, version in zip(ids, versions, strict=True)]
        values = [value for mid in ids for value in snapshots[mid]]
        reply = await self._run("clear_tool_results", [k.conversation(conversation_id), k.lease(conversation_id),
                                                       k.snapshots(conversation_id), counts_key],
                                lua.payload(turns=turns), *values)
        return cast(ClearStatus, text(reply))

    async def save_decision(self, conversation_id: str, message_id: str, stage: str,
                            record: Mapping[str, Any]) -> None:
        """A decision record of a stage that runs after the turn (compaction), while the conversation
        exists (a delete in between must not find it written back: conversation_write.lua)."""
        value = json.dumps(record, separators=(",", ":"), ensure_ascii=False)
        await self._run("conversation_write", [self.keys.conversation(conversation_id),
                                               self.keys.decisions(conversation_id)],
                        lua.payload(field=f"{message_id}:{stage}"), value)

    async def summaries(self, conversation_id: str, message_ids: Sequence[str]) -> dict[str, str]:
        """Running summaries by watermark message id (`finish`-then-compaction writes them)."""
        if not message_ids:
            return {}
        values = await self.redis.hmget(self.keys.summaries(conversation_id), list(message_ids))
        return {mid: json.loads(v)["text"] for mid, v in zip(message_ids, values, strict=True) if v is not None}

    async def save_summary(self, conversation_id: str, watermark: str, record: Mapping[str, Any]) -> None:
        """Stored only while the conversation exists: compaction runs after its turn ended, so a
        delete may come between its read and this write, and must not find the summary written back."""
        value = json.dumps(record, separators=(",", ":"), ensure_ascii=False)
        await self._run("conversation_write", [self.keys.conversation(conversation_id),
                                               self.keys.summaries(conversation_id)],
                        lua.payload(field=watermark), value)

    async def delete_conversation(self, conversation_id: str, *, tenant_id: str | None = None) -> DeleteResult:
        """Delete a conversation and its turns' keys, unless a turn of it runs or waits (see
        delete_conversation.lua); `tenant_id` must be the conversation's, else it is "not_found"."""
        for _ in range(DELETE_ATTEMPTS):
            rows = {text(mid): turn_of_row(row)
                    async for mid, row in self.redis.hscan_iter(self.keys.messages(conversation_id), count=500)}
            stored, user = await self.redis.hmget(self.keys.conversation(conversation_id), ["tenant_id", "user_id"])
            keys, arg = deletion(self.keys, self.graph, conversation_id, tenant_id=tenant_id, rows=rows,
                                 stored_tenant=text(stored) if stored is not None else None)
            result = delete_result(conversation_id, await self._run("delete_conversation", keys, arg))
            if result is not None:
                if result.status == "deleted" and stored is not None and user is not None:
                    # what long-term memory extracted from it goes with it
                    await MemoryStore(self.redis, self.keys).forget_conversation(text(stored), conversation_id,
                                                                                 text(user))
                return result
        return DeleteResult("busy", conversation_id)

    async def decision(self, conversation_id: str, message_id: str, stage: str) -> dict[str, Any] | None:
        """The decision record `stage` stored for a turn (`advance.lua`), or None."""
        raw = await self.redis.hget(self.keys.decisions(conversation_id), f"{message_id}:{stage}")
        return cast(dict[str, Any], json.loads(raw)) if raw else None

    async def load_recent_messages(self, conversation_id: str, limit: int) -> list[MessageRecord]:
        """The newest `limit` message rows of a conversation, newest first (a bounded read)."""
        k = self.keys
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
