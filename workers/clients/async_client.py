"""The asyncio client (`redis.asyncio`): the turn and conversation surface of `Client`, awaitable, with
events as an async iterator. The gateway streams events with it; agents stay on the sync `Client`."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from functools import cached_property
from typing import TYPE_CHECKING, Any, cast

from threadline.pipeline.busy import OnBusy, interrupts, named_on_busy
from threadline.pipeline.errors import InvalidRequest
from threadline.pipeline.ids import new_conversation_id, valid_id, valid_turn_id
from threadline.pipeline.terminal import TERMINAL_TYPES
from threadline.workers.clients.common import (
    ADMIT_ACTOR,
    ADMIT_QUEUE,
    BUSY_ATTEMPTS,
    MEMORY_ATTEMPTS,
    BaseHandle,
    TurnIdTaken,
    agent_probe,
    busy_changed,
    busy_reads,
    busy_victims,
    checked_request,
    edited_record,
    forgets_everything,
    found_memory,
    listed_memory,
    memory_edit,
    memory_forgetting,
    memory_scope,
    missing_agent,
    owner_of,
    read_block_ms,
    resume_body,
    setting_default,
    stream_entries,
    submit_call,
    submitted,
    turn_body,
    with_on_busy,
)
from threadline.workers.clients.layout import (
    UNKNOWN_TURN_POLL_MS,
    TurnShards,
    async_layout_keys,
    merged_page,
    own_shards,
    pointer_ttl_s,
    request_shard,
    taken_elsewhere,
)
from threadline.workers.clients.server import found_server, server_url
from threadline.workers.protocol.keys import Keys
from threadline.workers.protocol.names import CANCEL_ACTOR, CONTROL_QUEUE
from threadline.workers.protocol.schema import text
from threadline.workers.settings import Settings
from threadline.workers.storage import lua
from threadline.workers.storage.connect import async_plain_client, require_shards

if TYPE_CHECKING:
    from threadline.pipeline.contracts import TurnRequest
    from threadline.pipeline.events import Event, Terminal
    from threadline.pipeline.memory import MemoryRecord
    from threadline.pipeline.records import ConversationRecord, MessageRecord
    from threadline.workers.protocol.schema import TurnState
    from threadline.workers.storage.conversations import DeleteResult
    from threadline.workers.storage.memory import MemoryStore


class AsyncTurnHandle(BaseHandle):
    """`TurnHandle` for the async client: the turn id, with awaitable methods."""

    client: AsyncClient

    def entries(self, *, after: str = "0", follow: bool = True,
                timeout_s: float | None = None) -> AsyncIterator[tuple[str, Event]]:
        return self.client.entries(self, after=after, follow=follow, timeout_s=timeout_s)

    async def events(self, *, after: str = "0", follow: bool = True,
                     timeout_s: float | None = None) -> AsyncIterator[Event]:
        async for _, event in self.client.entries(self, after=after, follow=follow, timeout_s=timeout_s):
            yield event

    async def result(self, timeout: float | None = 60.0) -> Terminal:
        return await self.client.wait(self, timeout_s=timeout)

    async def cancel(self, reason: str = "") -> str:
        return await self.client.cancel(self, reason)

    async def state(self) -> TurnState:
        return await self.client.turn_state(self)

    async def resume(self, answers: Mapping[str, Any], *, turn_id: str | None = None) -> AsyncTurnHandle:
        """Answer this paused turn's pending tool calls: a new turn, started."""
        from threadline.pipeline.events import Paused

        paused = await self.client.terminal(self)
        if not isinstance(paused, Paused) or not paused.conversation_id:
            raise InvalidRequest(f"turn {self} is not paused ({paused.type if paused else 'not ended'})")
        record = None if self.request is not None else await self.client.conversation(paused.conversation_id)
        body = resume_body(paused.conversation_id, answers, request=self.request, record=record, turn_id=turn_id)
        return await self.client.start(body)


class AsyncClient:
    def __init__(self, url: str | None = None, *, prefix: str | None = None, max_query_chars: int | None = None,
                 max_context_chars: int | None = None, shards: int | None = None) -> None:
        """`url` None: found as `Client()` finds it (`workers/clients/server.py`). `shards` as `Client`'s:
        the layout written when none is stored; the first call that needs keys reads it (`layout`)."""
        if url is None:
            url, prefix = found_server(prefix)
        self.url = url
        self.redis = async_plain_client(url)
        self.prefix = "tl" if prefix is None else prefix
        self.shards = own_shards(shards)
        self.turn_ttl_s = setting_default("turn_ttl_s")
        self._keys: Keys | None = None
        self._turn_shards = TurnShards()
        self.max_query_chars = max_query_chars or setting_default("max_query_chars")
        self.max_context_chars = max_context_chars or setting_default("max_context_chars")
        self.max_inputs_chars = setting_default("max_inputs_chars")
        self.max_files = setting_default("max_files")
        self._submit = self.redis.register_script(lua.source("submit"))
        self._delete = self.redis.register_script(lua.source("delete_conversation"))

    @classmethod
    def from_settings(cls, settings: Settings, url: str | None = None) -> AsyncClient:
        target = url or server_url(settings)
        client = cls(target, prefix=settings.prefix, max_query_chars=settings.max_query_chars,
                     max_context_chars=settings.max_context_chars, shards=settings.shards)
        client.max_inputs_chars, client.max_files = settings.max_inputs_chars, settings.max_files
        client.turn_ttl_s = settings.turn_ttl_s
        return client

    async def layout(self) -> Keys:
        """The stored layout's keys, read by the first call that needs them (one GET per client;
        `layout.py`). Concurrent first calls may each read it: they find the same record."""
        if self._keys is None:
            keys = await async_layout_keys(self.redis, self.prefix, self.shards)
            require_shards(self.url, keys.shards)
            self._keys = keys
        return self._keys

    @property
    def keys(self) -> Keys:
        """The layout's keys once a call read them (`layout`); before that, a `RuntimeError`: an async
        client reads nothing outside a coroutine."""
        if self._keys is None:
            raise RuntimeError("the key layout is not read yet: await AsyncClient.layout() first")
        return self._keys

    async def turn_keys(self, turn_id: str) -> Keys | None:
        """As `Client.turn_keys`: the keys of the turn's shard (None: no pointer, the turn is unknown)."""
        keys = await self.layout()
        if not keys.shards:
            return keys
        shard = self._turn_shards.get(turn_id)
        if shard is not None:
            return keys.on(shard)
        return keys.pointed(await self.redis.get(keys.turn_shard(turn_id)))

    async def close(self) -> None:
        await self.redis.aclose()

    async def webhook_secret(self, tenant_id: str, *, rotate: bool = False) -> str:
        """`Client.webhook_secret`: the tenant's webhook signing secret (docs/webhooks.md)."""
        from threadline.workers.storage.webhooks import async_webhook_secret

        return await async_webhook_secret(self.redis, await self.layout(), tenant_id, rotate=rotate)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # --- turns ---------------------------------------------------------------------------------

    async def submit(self, request: Mapping[str, Any], *, on_busy: OnBusy | None = None) -> AsyncTurnHandle:
        """Enqueue a request as given (the workers check it), as `Client.submit`."""
        body = {"schema": "threadline.turn/v1", **request, **({"on_busy": on_busy} if on_busy else {})}
        body.setdefault("turn_id", uuid.uuid4().hex)
        turn_id = str(body["turn_id"])
        cid = valid_id(body.get("conversation_id")) or new_conversation_id(turn_id)  # as Client.submit
        await self._enqueue(ADMIT_QUEUE, ADMIT_ACTOR, (body,), conversation_id=cid, turn_id=turn_id, owner=None,
                            on_busy=named_on_busy(body.get("on_busy")))
        return AsyncTurnHandle(turn_id, self)

    async def start(self, request: Mapping[str, Any] | TurnRequest, *, owner: str | None = None,
                    on_busy: OnBusy | None = None) -> AsyncTurnHandle:
        """Check (the request, and that its agent exists), then enqueue, as `Client.start`."""
        checked = checked_request(with_on_busy(request, on_busy), max_query_chars=self.max_query_chars,
                                  max_context_chars=self.max_context_chars, max_inputs_chars=self.max_inputs_chars,
                                  max_files=self.max_files)
        await self.check_agent(checked)
        cid = checked.conversation_id or new_conversation_id(checked.turn_id)
        created, existing = await self._enqueue(ADMIT_QUEUE, ADMIT_ACTOR, (turn_body(checked),), conversation_id=cid,
                                                turn_id=checked.turn_id, owner=owner, on_busy=checked.on_busy or "")
        if not created and existing != owner:
            raise TurnIdTaken(f"turn_id {checked.turn_id} is taken")
        return AsyncTurnHandle(checked.turn_id, self, request=checked, created=created)

    async def _enqueue(self, queue: str, actor: str, args: tuple[Any, ...], *, conversation_id: str | None,
                       turn_id: str | None, owner: str | None, on_busy: str = "",
                       shard: int | None = None) -> tuple[bool, str]:
        """submit.lua with the request's `on_busy` policy ("" = none named), as `Client.start`; onto
        `shard`'s queue (None: the turn's), the turn's shard pointer first, as `Client._submit_turn`."""
        layout = await self.layout()
        bound = layout.on(request_shard(layout, conversation_id, turn_id) if shard is None else shard)
        if turn_id and conversation_id and bound.shard is not None and valid_turn_id(turn_id):
            prior = await self.redis.set(bound.turn_shard(turn_id), bound.shard, nx=True, get=True,
                                         ex=pointer_ttl_s(self.turn_ttl_s))
            other = taken_elsewhere(prior, bound.shard)
            if other is not None:  # the id names a turn of another conversation: not enqueued again
                return False, text(await self.redis.hget(layout.on(other).turn(turn_id), "tenant_id") or b"")
            self._turn_shards.remember(turn_id, bound.shard)
        for _ in range(BUSY_ATTEMPTS):
            victims: list[str] = []
            if on_busy and interrupts(on_busy) and conversation_id and turn_id:
                async with self.redis.pipeline(transaction=False) as pipe:
                    busy_reads(pipe, bound, conversation_id, turn_id)
                    victims = busy_victims(turn_id, await pipe.execute())
            _, keys, argv = submit_call(bound, queue, actor, args, message_id=uuid.uuid4().hex,
                                        conversation_id=conversation_id, turn_id=turn_id, owner=owner,
                                        now_ms=int(time.time() * 1000), on_busy=on_busy, victims=victims)
            reply = await self._submit(keys=keys, args=argv)
            if not busy_changed(reply):
                break
        return submitted(reply, conversation_id or "")

    async def check_agent(self, request: TurnRequest) -> None:
        """As `Client.check_agent`: `AgentNotFound` unless the request's agent (or its draft) exists."""
        key, field = agent_probe(await self.layout(), request)
        if not await (self.redis.hexists(key, field) if field else self.redis.exists(key)):
            raise missing_agent(request)

    def handle(self, turn_id: str) -> AsyncTurnHandle:
        return AsyncTurnHandle(turn_id, self)

    async def owner(self, turn_id: str) -> str | None:
        """As `Client.owner`."""
        keys = await self.turn_keys(turn_id)
        if keys is None:
            return None
        tenant, cid = await self.redis.hmget(keys.turn(turn_id), ["tenant_id", "conversation_id"])
        conversation_tenant = None
        if not tenant and cid:
            conversation_tenant = await self.redis.hget(keys.conversation(text(cid)), "tenant_id")
        return owner_of(tenant, conversation_tenant)

    async def cancel(self, turn_id: str, reason: str = "") -> str:
        """As `Client.cancel`: "enqueued", or "noop: <status>" for a turn that already ended (or
        "noop: unknown", sharded, for a turn with no shard pointer)."""
        keys = await self.turn_keys(turn_id)
        if keys is None:
            return "noop: unknown"
        status = text(await self.redis.hget(keys.turn(turn_id), "status") or "")
        if status in TERMINAL_TYPES:
            return f"noop: {status}"
        await self._enqueue(CONTROL_QUEUE, CANCEL_ACTOR, (turn_id, reason), conversation_id=None, turn_id=None,
                            owner=None, shard=keys.shard)
        return "enqueued"

    async def entries(self, turn_id: str, *, after: str = "0", follow: bool = False,
                      timeout_s: float | None = None) -> AsyncIterator[tuple[str, Event]]:
        """(stream entry id, event) after the entry id `after`; with `follow`, until the terminal one
        (a turn not known yet is looked for again, as `Client.entries`)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        keys = await self.turn_keys(turn_id)
        while True:
            block = read_block_ms(turn_id, follow=follow, deadline=deadline, timeout_s=timeout_s)
            if keys is None:
                if not follow:
                    return
                await asyncio.sleep(min(block or 0, UNKNOWN_TURN_POLL_MS) / 1000)
                keys = await self.turn_keys(turn_id)
                continue
            found = stream_entries(await self.redis.xread({keys.events(turn_id): after}, block=block, count=500))
            for after, event in found:
                yield after, event
                if event.type in TERMINAL_TYPES:
                    return
            if not follow and not found:
                return

    async def events(self, turn_id: str, *, after: str = "0", follow: bool = False,
                     timeout_s: float | None = None) -> AsyncIterator[Event]:
        async for _, event in self.entries(turn_id, after=after, follow=follow, timeout_s=timeout_s):
            yield event

    async def terminal(self, turn_id: str) -> Terminal | None:
        from threadline.pipeline import events as ev

        keys = await self.turn_keys(turn_id)
        last: Any = await self.redis.xrevrange(keys.events(turn_id), count=1) if keys is not None else None
        event = ev.decode(last[0][1][b"json"]) if last else None
        return event if isinstance(event, ev.Terminal) else None

    async def wait(self, turn_id: str, timeout_s: float | None = 60.0) -> Terminal:
        from threadline.pipeline.events import Terminal

        async for _, event in self.entries(turn_id, follow=True, timeout_s=timeout_s):
            if isinstance(event, Terminal):
                return event
        raise TimeoutError(turn_id)

    async def turn_state(self, turn_id: str) -> TurnState:
        from threadline.workers.protocol.schema import TurnState, text_map

        keys = await self.turn_keys(turn_id)
        return TurnState.from_hash(text_map(await self.redis.hgetall(keys.turn(turn_id)) if keys is not None else {}))

    # --- conversations -------------------------------------------------------------------------

    async def conversation(self, conversation_id: str) -> ConversationRecord | None:
        from threadline.workers.protocol.schema import conversation_from_hash, text_map

        fields = text_map(await self.redis.hgetall((await self.layout()).conversation(conversation_id)))
        return conversation_from_hash(conversation_id, fields)

    async def conversations(self, tenant_id: str, *, limit: int = 50, offset: int = 0) -> list[ConversationRecord]:
        """As `Client.conversations`."""
        from threadline.workers.protocol.schema import conversation_from_hash, text_map

        keys = await self.layout()
        if not keys.shards:
            index = keys.tenant_conversations(tenant_id)
            ids = [text(cast(bytes, c)) for c in await self.redis.zrevrange(index, offset, offset + limit - 1)]
        else:  # an index per shard, merged by score
            async with self.redis.pipeline(transaction=False) as pipe:
                for shard in keys.every_shard():
                    pipe.zrevrange(shard.tenant_conversations(tenant_id), 0, offset + limit - 1, withscores=True)
                ids = merged_page(await pipe.execute(), offset, limit)
        found: list[ConversationRecord] = []
        for cid in ids:
            record = conversation_from_hash(cid, text_map(await self.redis.hgetall(keys.conversation(cid))))
            if record is None or record.tenant_id != tenant_id:
                await self.redis.zrem(keys.of_conversation(cid).tenant_conversations(tenant_id), cid)
            else:
                found.append(record)
        return found

    async def messages(self, conversation_id: str) -> list[MessageRecord]:
        from threadline.pipeline.records import MessageRecord

        rows = await self.redis.hvals((await self.layout()).messages(conversation_id))
        return sorted((MessageRecord.model_validate_json(r) for r in rows), key=lambda m: m.created_at)

    async def thread(self, conversation_id: str, message_id: str | None = None) -> list[MessageRecord]:
        """The path root → `message_id` (default: the tip), oldest first."""
        from threadline.pipeline.history import extract_thread

        conversation = await self.conversation(conversation_id)
        if conversation is None:
            return []
        thread, _ = extract_thread(await self.messages(conversation_id), message_id or conversation.tip)
        return thread

    async def conversation_decisions(self, conversation_id: str) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        keys = await self.layout()
        async for field, value in self.redis.hscan_iter(keys.decisions(conversation_id), count=500):
            turn_id, _, stage = text(cast(bytes, field)).rpartition(":")
            out.setdefault(turn_id, {})[stage] = json.loads(value)
        return out

    async def delete_conversation(self, conversation_id: str, *, tenant_id: str | None = None) -> DeleteResult:
        """As `Client.delete_conversation`."""
        from threadline.pipeline.contracts import valid_id
        from threadline.pipeline.stages import DEFAULT_GRAPH
        from threadline.workers.storage.conversations import (
            DELETE_ATTEMPTS,
            DeleteResult,
            delete_result,
            deletion,
            turn_of_row,
        )

        if valid_id(conversation_id) is None:
            raise InvalidRequest(f"{conversation_id!r} is not a conversation id")
        own = (await self.layout()).of_conversation(conversation_id)
        for _ in range(DELETE_ATTEMPTS):
            rows = {text(mid): turn_of_row(row)
                    async for mid, row in self.redis.hscan_iter(own.messages(conversation_id), count=500)}
            stored, user = await self.redis.hmget(own.conversation(conversation_id), ["tenant_id", "user_id"])
            keys, arg = deletion(own, DEFAULT_GRAPH, conversation_id, tenant_id=tenant_id, rows=rows,
                                 stored_tenant=text(stored) if stored is not None else None)
            result = delete_result(conversation_id, await self._delete(keys=keys, args=[arg]))
            if result is not None:
                if result.status == "deleted" and stored is not None and user is not None:
                    # what long-term memory extracted from it goes with it
                    await (await self._memory()).forget_conversation(text(stored), conversation_id, text(user))
                return result
        return DeleteResult("busy", conversation_id)

    # --- long-term memory: list, correct, forget -----------------------------------------------

    @cached_property
    def memory_store(self) -> MemoryStore:
        """The memory store (its keys: the layout's, once read; `_memory` reads it first)."""
        from threadline.workers.storage.memory import MemoryStore

        return MemoryStore(self.redis, self.keys)

    async def _memory(self) -> MemoryStore:
        await self.layout()
        return self.memory_store

    async def memory(self, tenant_id: str, user_id: str, *, app_id: str | None = None, agent_id: str | None = None,
                     history: bool = False) -> list[MemoryRecord]:
        """As `Client.memory`."""
        scope = memory_scope(tenant_id, user_id, app_id=app_id, agent_id=agent_id)
        store = await self._memory()
        records = (await store.read(scope))[0] if history else await store.current(scope)
        return listed_memory(records, scope, history=history)

    async def memory_record(self, tenant_id: str, user_id: str, record_id: str, *, app_id: str | None = None,
                            agent_id: str | None = None) -> MemoryRecord:
        """As `Client.memory_record`."""
        scope = memory_scope(tenant_id, user_id, app_id=app_id, agent_id=agent_id)
        store = await self._memory()
        return found_memory((await store.read(scope))[0], scope, record_id)

    async def set_memory(self, tenant_id: str, user_id: str, *, value: str, key: str | None = None,
                         record_id: str | None = None, note: bool = False, origin: str = "user",
                         app_id: str | None = None, agent_id: str | None = None) -> MemoryRecord:
        """As `Client.set_memory`."""
        scope = memory_scope(tenant_id, user_id, app_id=app_id, agent_id=agent_id)
        store = await self._memory()
        for _ in range(MEMORY_ATTEMPTS):
            records, revision = await store.read(scope)
            now = time.time()
            edit = memory_edit(records, scope, value=value, key=key, record_id=record_id, note=note, origin=origin,
                               now=now)
            if not edit.changed or await store.apply(scope, edit, revision=revision, now=now):
                return edited_record(edit)
        raise RuntimeError("the memory kept changing; try again")

    async def forget_memory(self, tenant_id: str, user_id: str, *, key: str | None = None,
                            record_id: str | None = None, all: bool = False, app_id: str | None = None,
                            agent_id: str | None = None) -> int:
        """As `Client.forget_memory`."""
        scope = memory_scope(tenant_id, user_id, app_id=app_id, agent_id=agent_id)
        store = await self._memory()
        if forgets_everything(scope, key=key, record_id=record_id, everything=all):
            return await store.forget_all(scope)
        for _ in range(MEMORY_ATTEMPTS):
            records, revision = await store.read(scope)
            gone = memory_forgetting(records, scope, key=key, record_id=record_id)
            if not gone.changed or await store.apply(scope, gone, revision=revision):
                return len(gone.deletes)
        raise RuntimeError("the memory kept changing; try again")
