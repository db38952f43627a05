"""The Python client: register agents, submit turns, follow their events, cancel them, read threads.

It enqueues exactly what docs/protocol.md tells any other producer to write with raw Redis commands
(HSET the message, RPUSH its id, PUBLISH the doorbell), so that path is exercised on every use.
`submit` returns a `TurnHandle`: the turn id (a `str`) with the methods that follow, wait for,
cancel and resume the turn; `start` does the same after checking the request with the workers' model.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator, Mapping
from functools import cached_property
from typing import TYPE_CHECKING, Any, cast

import redis

from threadline.pipeline.busy import OnBusy, interrupts, named_on_busy
from threadline.pipeline.errors import InvalidRequest
from threadline.pipeline.ids import new_conversation_id, valid_id, valid_turn_id
from threadline.pipeline.policy import ModelPolicy
from threadline.pipeline.stages import DEFAULT_GRAPH
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
    layout_keys,
    merged_page,
    own_shards,
    pointer_ttl_s,
    raw_ids,
    request_shard,
    taken_elsewhere,
)
from threadline.workers.clients.server import found_server, server_url
from threadline.workers.protocol.keys import Keys
from threadline.workers.protocol.names import CANCEL_ACTOR, CONTROL_QUEUE
from threadline.workers.protocol.schema import text
from threadline.workers.settings import Settings, model_policy
from threadline.workers.storage import lua
from threadline.workers.storage.connect import require_shards, sync_client

# What imports pydantic-ai or builds many pydantic models (agent configs, records, history, the agent
# registry, the store) is imported inside the methods that need it: submitting or cancelling a turn,
# and the read-only commands, must not pay for it (`bench/cli.py`).
if TYPE_CHECKING:
    from pydantic_ai.messages import ModelMessage

    from threadline.pipeline.config import AgentConfig
    from threadline.pipeline.contracts import TurnRequest
    from threadline.pipeline.events import Event, Terminal
    from threadline.pipeline.memory import MemoryRecord
    from threadline.pipeline.records import ConversationRecord, MessageRecord
    from threadline.workers.protocol.schema import TurnState
    from threadline.workers.storage.agent_index import AgentSummary
    from threadline.workers.storage.agents import AgentRegistry, AgentVersions, PutResult
    from threadline.workers.storage.conversations import DeleteResult
    from threadline.workers.storage.memory import SyncMemoryStore

class TurnHandle(BaseHandle):
    """A submitted turn, to be followed, waited for, cancelled and resumed. `created` is False when
    `start(..., owner=...)` found the turn already submitted (idempotency)."""

    client: Client

    def entries(self, *, after: str = "0", follow: bool = True,
                timeout_s: float | None = None) -> Iterator[tuple[str, Event]]:
        """(stream entry id, event) pairs after the entry id `after`: resume from the last id seen."""
        return self.client.entries(self, after=after, follow=follow, timeout_s=timeout_s)

    def events(self, *, after: str = "0", follow: bool = True, timeout_s: float | None = None) -> Iterator[Event]:
        """The typed events after the entry id `after`; with `follow`, until the terminal one."""
        return self.client.events(self, after=after, follow=follow, timeout_s=timeout_s)

    def result(self, timeout: float | None = 60.0) -> Terminal:
        """The terminal event, waiting up to `timeout` seconds (None: for ever); `TimeoutError` after."""
        return self.client.wait(self, timeout_s=timeout)

    def cancel(self, reason: str = "") -> str:
        return self.client.cancel(self, reason)

    def state(self) -> TurnState:
        return self.client.turn_state(self)

    def resume(self, answers: Mapping[str, Any], *, turn_id: str | None = None) -> TurnHandle:
        """Answer this paused turn's pending tool calls (tool call id -> answer): a new turn, started."""
        paused = self.client.terminal(self)
        from threadline.pipeline.events import Paused

        if not isinstance(paused, Paused) or not paused.conversation_id:
            raise InvalidRequest(f"turn {self} is not paused ({paused.type if paused else 'not ended'})")
        record = None if self.request is not None else self.client.conversation(paused.conversation_id)
        return self.client.start(resume_body(paused.conversation_id, answers, request=self.request, record=record,
                                             turn_id=turn_id))


class Client:
    def __init__(self, url: str | None = None, *, prefix: str | None = None, policy: ModelPolicy | None = None,
                 max_query_chars: int | None = None, max_context_chars: int | None = None,
                 shards: int | None = None) -> None:
        """`url` None: the server the CLI would talk to (`REDIS_URL`, else the embedded server a running
        `threadline worker` started; `NoServer` when there is none), and `TL_PREFIX` for `prefix`.
        Otherwise `prefix` defaults to "tl". `shards` (None: `TL_SHARDS`) is the layout this client
        writes when it finds none stored; the stored one is used (`layout.py`)."""
        if url is None:
            url, prefix = found_server(prefix)
        self.url = url
        #: What `put_agent` refuses (TL_KEY_ENV_ALLOW, TL_BASE_URL_ALLOW); default: this process's env.
        self.policy = policy if policy is not None else model_policy()
        #: The limits `start` checks a request against (the workers' TL_MAX_QUERY_CHARS, TL_MAX_CONTEXT_CHARS).
        self.max_query_chars = max_query_chars or setting_default("max_query_chars")
        self.max_context_chars = max_context_chars or setting_default("max_context_chars")
        self.max_inputs_chars = setting_default("max_inputs_chars")
        self.max_files = setting_default("max_files")
        self.redis = sync_client(url)
        self.prefix = "tl" if prefix is None else prefix
        #: This client's own shard count (`layout.py`: what it writes when no layout is stored).
        self.shards = own_shards(shards)
        #: How long the workers keep a turn's record (TL_TURN_TTL_S): its shard pointer outlives it.
        self.turn_ttl_s = setting_default("turn_ttl_s")
        self.namespace = f"{self.prefix}:q"
        self._turn_shards = TurnShards()
        self._submit = self.redis.register_script(lua.source("submit"))
        self._delete = self.redis.register_script(lua.source("delete_conversation"))

    @cached_property
    def keys(self) -> Keys:
        """The stored layout's keys, read on first need (one GET per client; `layout.py`)."""
        keys = layout_keys(self.redis, self.prefix, self.shards)
        require_shards(self.url, keys.shards)
        return keys

    def turn_keys(self, turn_id: str) -> Keys | None:
        """The keys bound to the turn's shard: remembered for the turns this client submitted, else
        its pointer's (None: no pointer, the turn is unknown). One server's layout: `keys`."""
        keys = self.keys
        if not keys.shards:
            return keys
        shard = self._turn_shards.get(turn_id)
        if shard is not None:
            return keys.on(shard)
        return keys.pointed(self.redis.get(keys.turn_shard(turn_id)))

    @cached_property
    def registry(self) -> AgentRegistry:
        from threadline.workers.storage.agents import AgentRegistry

        return AgentRegistry(self.redis, self.keys)

    @classmethod
    def from_settings(cls, settings: Settings, url: str | None = None) -> Client:
        target = url or server_url(settings)
        client = cls(target, prefix=settings.prefix, policy=settings.policy, max_query_chars=settings.max_query_chars,
                     max_context_chars=settings.max_context_chars, shards=settings.shards)
        client.max_inputs_chars, client.max_files = settings.max_inputs_chars, settings.max_files
        client.turn_ttl_s = settings.turn_ttl_s
        return client

    def close(self) -> None:
        self.redis.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- agents --------------------------------------------------------------------------------

    def put_agent(self, config: AgentConfig | str | bytes, *, draft_id: str | None = None,
                  author: str | None = None) -> str:
        """Register a config: a new immutable version made active, or a draft updated in place.
        Returns the config reference ("v<N>" or "draft:<id>"); a document identical to the active
        version returns that version and writes nothing (`put_agent_result` says which happened)."""
        return self.put_agent_result(config, draft_id=draft_id, author=author).ref

    def put_agent_result(self, config: AgentConfig | str | bytes, *, draft_id: str | None = None,
                         author: str | None = None) -> PutResult:
        """`put_agent`, telling whether a version was created."""
        from threadline.pipeline.config import AgentConfig, parse_agent_config
        from threadline.workers.storage.agents import default_author

        if not isinstance(config, AgentConfig):
            config = parse_agent_config(config)
        self.policy.check_agent(config)
        if draft_id is not None:
            return self.registry.put_draft(config, draft_id)
        return self.registry.put(config, author=author or default_author())

    def publish_agent(self, agent_id: str, *, draft_id: str | None = None, author: str | None = None) -> PutResult:
        """The draft (the only one when `draft_id` is None) becomes the next version, made active."""
        from threadline.workers.storage.agents import default_author

        return self.registry.publish(agent_id, draft_id=draft_id, author=author or default_author())

    def rollback_agent(self, agent_id: str, version: int | str, *, author: str | None = None) -> bool:
        """Make an existing version ("3" or "v3") active for new conversations; False if it already was."""
        from threadline.workers.storage.agents import default_author, parse_version

        return self.registry.rollback(agent_id, parse_version(version), author=author or default_author())

    def agents(self) -> list[AgentSummary]:
        """Every registered agent with its active and latest version and drafts (the registry's
        index: no config is read, nor its models imported)."""
        from threadline.workers.storage.agent_index import agent_summaries

        return agent_summaries(self.redis, self.keys)

    def agent_versions(self, agent_id: str) -> AgentVersions:
        return self.registry.versions(agent_id)

    def agent_config(self, agent_id: str, version: int | str | None = None) -> AgentConfig:
        """A version's config (default: the active one); `AgentNotFound` when there is none."""
        from threadline.workers.storage.agents import parse_version

        return self.registry.config(agent_id, None if version is None else parse_version(version))[1]

    # --- turns ---------------------------------------------------------------------------------

    def submit(self, request: Mapping[str, Any], *, on_busy: OnBusy | None = None) -> TurnHandle:
        """Enqueue a turn request as given (the workers check it: an invalid one ends `failed`);
        returns its handle, which is its turn id (generated when the request has none). `on_busy`
        (else the request's) is applied at once: `ConversationBusy` for `reject` (docs/protocol.md)."""
        from threadline.pipeline.contracts import TURN_SCHEMA

        body = {"schema": TURN_SCHEMA, **request, **({"on_busy": on_busy} if on_busy else {})}
        body.setdefault("turn_id", uuid.uuid4().hex)
        turn_id = str(body["turn_id"])
        # a first turn takes its place in the line of the conversation it will start, so follow-ups
        # that name that conversation before it exists wait behind it (an invalid id names none, as
        # for the admit stage that refuses it)
        conversation_id = valid_id(body.get("conversation_id")) or new_conversation_id(turn_id)
        self.enqueue(ADMIT_QUEUE, ADMIT_ACTOR, (body,), conversation_id=str(conversation_id), turn_id=turn_id,
                     on_busy=named_on_busy(body.get("on_busy")))
        return TurnHandle(turn_id, self)

    def start(self, request: Mapping[str, Any] | TurnRequest, *, owner: str | None = None,
              on_busy: OnBusy | None = None) -> TurnHandle:
        """Check the request with the workers' model and that its agent (or the draft it names) exists
        (`InvalidRequest`, `AgentNotFound` now rather than a `failed` event later), then enqueue it.
        With `owner` (a tenant), the turn is recorded as that tenant's, and a turn id that exists
        already is not enqueued again: the handle says `created=False`, or `TurnIdTaken` when the turn
        is not `owner`'s. `on_busy` (else the request's; neither: the agent's, applied by the workers)
        says what the turn does while its conversation is busy: `ConversationBusy` for `reject`."""
        checked = checked_request(with_on_busy(request, on_busy), max_query_chars=self.max_query_chars,
                                  max_context_chars=self.max_context_chars, max_inputs_chars=self.max_inputs_chars,
                                  max_files=self.max_files)
        self.check_agent(checked)
        cid = checked.conversation_id or new_conversation_id(checked.turn_id)
        _, reply = self._submit_turn(ADMIT_QUEUE, ADMIT_ACTOR, (turn_body(checked),), message_id=uuid.uuid4().hex,
                                     conversation_id=cid, turn_id=checked.turn_id, owner=owner,
                                     on_busy=checked.on_busy or "")
        created, existing = submitted(reply, cid)
        if not created and existing != owner:
            raise TurnIdTaken(f"turn_id {checked.turn_id} is taken")
        return TurnHandle(checked.turn_id, self, request=checked, created=created)

    def _submit_turn(self, queue: str, actor: str, args: tuple[Any, ...], *, message_id: str,
                     conversation_id: str | None, turn_id: str | None, owner: str | None,
                     on_busy: str, shard: int | None = None) -> tuple[str, Any]:
        """submit.lua (the message id and its reply), applying `on_busy` ("" = none named: the workers
        apply the agent's at admission); an interrupting turn first reads the turns in its way. The
        message goes to `shard`'s queue (None: the turn's, `request_shard`); a turn it registers
        gets its shard pointer first (sharded layout)."""
        bound = self.keys.on(request_shard(self.keys, conversation_id, turn_id) if shard is None else shard)
        if turn_id and conversation_id and bound.shard is not None and valid_turn_id(turn_id):
            # one command (SET NX GET): what the pointer said before, None when this wrote it
            prior = self.redis.set(bound.turn_shard(turn_id), bound.shard, nx=True, get=True,
                                   ex=pointer_ttl_s(self.turn_ttl_s))
            other = taken_elsewhere(prior, bound.shard)
            if other is not None:  # the id names a turn of another conversation: not enqueued again
                return message_id, [b"exists", self.redis.hget(self.keys.on(other).turn(turn_id), "tenant_id") or b""]
            self._turn_shards.remember(turn_id, bound.shard)
        for _ in range(BUSY_ATTEMPTS):
            victims: list[str] = []
            if on_busy and interrupts(on_busy) and conversation_id and turn_id:
                pipe = self.redis.pipeline(transaction=False)
                busy_reads(pipe, bound, conversation_id, turn_id)
                victims = busy_victims(turn_id, pipe.execute())
            mid, keys, argv = submit_call(bound, queue, actor, args, message_id=message_id,
                                          conversation_id=conversation_id, turn_id=turn_id, owner=owner,
                                          now_ms=int(time.time() * 1000), on_busy=on_busy, victims=victims)
            reply = self._submit(keys=keys, args=argv)
            if not busy_changed(reply):
                break
        return mid, reply

    def check_agent(self, request: TurnRequest) -> None:
        """`AgentNotFound` unless the request's agent has a published version (or the draft it names
        exists): one EXISTS or HEXISTS. `submit` enqueues without it, as raw producers do."""
        key, field = agent_probe(self.keys, request)
        if not (self.redis.hexists(key, field) if field else self.redis.exists(key)):
            raise missing_agent(request)

    def handle(self, turn_id: str) -> TurnHandle:
        """The handle of a turn submitted earlier (by any producer)."""
        return TurnHandle(turn_id, self)

    def owner(self, turn_id: str) -> str | None:
        """The tenant a turn belongs to (None: unknown, or not accepted yet and submitted without owner)."""
        keys = self.turn_keys(turn_id)
        if keys is None:
            return None
        tenant, cid = self.redis.hmget(keys.turn(turn_id), ["tenant_id", "conversation_id"])
        conversation_tenant = None
        if not tenant and cid:
            conversation_tenant = self.redis.hget(self.keys.conversation(text(cid)), "tenant_id")
        return owner_of(tenant, conversation_tenant)

    def submit_raw(self, request: object, *, message_id: str | None = None) -> str:
        """Enqueue anything as the `resolve` argument (tests use it for malformed input). Returns the
        dramatiq message id, which is the turn id of a request that names none. It goes to the shard
        of the ids it names, as the workers will read it (the admit stage writes its pointer)."""
        mid = message_id or uuid.uuid4().hex
        return self.enqueue(ADMIT_QUEUE, ADMIT_ACTOR, (request,), message_id=mid,
                            shard=request_shard(self.keys, *raw_ids(request, mid)))

    def enqueue(self, queue: str, actor: str, args: tuple[Any, ...], *, message_id: str | None = None,
                conversation_id: str | None = None, turn_id: str | None = None, on_busy: str = "",
                shard: int | None = None) -> str:
        """What any producer does: store a dramatiq message, push its id on the queue, ring the
        doorbell; and a turn for an existing conversation takes its place in that conversation's
        line now, so that turns run in the order they were submitted, with its `on_busy` policy
        applied (`ConversationBusy` for `reject`, nothing written). Returns the message id. The
        sharded layout's queue is `shard`'s (None: the turn's)."""
        mid, reply = self._submit_turn(queue, actor, args, message_id=message_id or uuid.uuid4().hex,
                                       conversation_id=conversation_id, turn_id=turn_id, owner=None, on_busy=on_busy,
                                       shard=shard)
        if on_busy:
            submitted(reply, conversation_id or "")
        return mid

    def cancel(self, turn_id: str, reason: str = "") -> str:
        """Ask the control queue to cancel a turn. Returns "enqueued", or "noop: <status>" when the
        turn has already finished (cancelling a finished turn changes nothing). The sharded layout's
        cancel goes to the turn's shard; a turn with no shard pointer is unknown: "noop: unknown"."""
        keys = self.turn_keys(turn_id)
        if keys is None:
            return "noop: unknown"
        # the one field read directly: `TurnState` (workers/protocol/schema.py) imports the records, and so pydantic-ai
        status = text(self.redis.hget(keys.turn(turn_id), "status") or "")
        if status in TERMINAL_TYPES:
            return f"noop: {status}"
        self.enqueue(CONTROL_QUEUE, CANCEL_ACTOR, (turn_id, reason), shard=keys.shard)
        return "enqueued"

    def turn_exists(self, turn_id: str) -> bool:
        """True when the turn has a record or events, or its request waits in (or is being taken from)
        the admit queue: a turn a worker has not picked up yet exists too (with no shard pointer, in
        any shard's admit queue)."""
        keys = self.turn_keys(turn_id)
        if keys is not None and self.redis.exists(keys.turn(turn_id), keys.events(turn_id)):
            return True
        needle = json.dumps(turn_id).encode()
        for shard in [keys] if keys is not None else self.keys.every_shard():
            for queue in (ADMIT_QUEUE, f"{ADMIT_QUEUE}.DQ"):
                for message_id, data in self.redis.hscan_iter(shard.queue_messages(queue), count=500):
                    if text(message_id) == turn_id or (needle in data and _request_turn_id(data) == turn_id):
                        return True
        return False

    def events(self, turn_id: str, *, follow: bool = False, timeout_s: float | None = None,
               after: str = "0") -> Iterator[Event]:
        """The turn's events in order after the stream entry id `after`; with `follow`, wait for new
        ones until the terminal event."""
        for _, event in self.entries(turn_id, follow=follow, timeout_s=timeout_s, after=after):
            yield event

    def entries(self, turn_id: str, *, follow: bool = False, timeout_s: float | None = None,
                after: str = "0") -> Iterator[tuple[str, Event]]:
        """`events` with each event's stream entry id, the id to resume after. A turn not known yet
        (no shard pointer) has no events; followed, it is looked for again until its deadline."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        keys = self.turn_keys(turn_id)
        while True:
            block = read_block_ms(turn_id, follow=follow, deadline=deadline, timeout_s=timeout_s)
            if keys is None:
                if not follow:
                    return
                time.sleep(min(block or 0, UNKNOWN_TURN_POLL_MS) / 1000)
                keys = self.turn_keys(turn_id)
                continue
            try:
                found = stream_entries(self.redis.xread({keys.events(turn_id): after}, block=block, count=500))
            except redis.ConnectionError:
                if not (follow and isinstance(self.redis, redis.RedisCluster)):
                    raise
                # a node fails over: redis-py asks its default node for XREAD's keys, outside its
                # retries, and that node may be the dead one
                self.redis.replace_default_node()
                time.sleep(UNKNOWN_TURN_POLL_MS / 1000)
                continue
            for after, event in found:
                yield after, event
                if event.type in TERMINAL_TYPES:
                    return
            if not follow and not found:
                return

    def terminal(self, turn_id: str) -> Terminal | None:
        """The turn's terminal event, None while it has not ended (or is unknown); never waits."""
        from threadline.pipeline import events as ev

        keys = self.turn_keys(turn_id)
        last: Any = self.redis.xrevrange(keys.events(turn_id), count=1) if keys is not None else None
        event = ev.decode(last[0][1][b"json"]) if last else None
        return event if isinstance(event, ev.Terminal) else None

    def wait(self, turn_id: str, timeout_s: float | None = 60.0) -> Terminal:
        """Block until the turn's terminal event and return it."""
        from threadline.pipeline.events import Terminal

        for event in self.events(turn_id, follow=True, timeout_s=timeout_s):
            if isinstance(event, Terminal):
                return event
        raise TimeoutError(turn_id)

    def decisions(self, turn_id: str, *, conversation_id: str | None = None) -> dict[str, dict[str, Any]]:
        """The decision records the turn's stages stored with its message, by stage."""

        cid = conversation_id or self.turn_state(turn_id).conversation_id
        if not cid:
            return {}
        names = list(DEFAULT_GRAPH.names)
        values = self.redis.hmget(self.keys.decisions(cid), [f"{turn_id}:{name}" for name in names])
        return {name: json.loads(v) for name, v in zip(names, values, strict=True) if v is not None}

    def turn_state(self, turn_id: str) -> TurnState:
        from threadline.workers.protocol.schema import TurnState, text_map

        keys = self.turn_keys(turn_id)
        return TurnState.from_hash(text_map(self.redis.hgetall(keys.turn(turn_id)) if keys is not None else {}))

    # --- conversations -------------------------------------------------------------------------

    def conversation(self, conversation_id: str) -> ConversationRecord | None:
        from threadline.workers.protocol.schema import conversation_from_hash, text_map

        fields = text_map(self.redis.hgetall(self.keys.conversation(conversation_id)))
        return conversation_from_hash(conversation_id, fields)

    def conversations(self, tenant_id: str, *, limit: int = 50, offset: int = 0) -> list[ConversationRecord]:
        """The tenant's conversations, the most recently active first. Ids whose conversation is gone
        other than by a delete (which removes them) leave the index as they are met."""
        from threadline.workers.protocol.schema import conversation_from_hash, text_map

        ids = self._conversation_ids(tenant_id, limit=limit, offset=offset)
        pipe = self.redis.pipeline(transaction=False)
        for cid in ids:
            pipe.hgetall(self.keys.conversation(cid))
        found: list[ConversationRecord] = []
        for cid, fields in zip(ids, pipe.execute(), strict=True):
            record = conversation_from_hash(cid, text_map(fields))
            if record is None or record.tenant_id != tenant_id:
                self.redis.zrem(self.keys.of_conversation(cid).tenant_conversations(tenant_id), cid)
            else:
                found.append(record)
        return found

    def _conversation_ids(self, tenant_id: str, *, limit: int, offset: int) -> list[str]:
        """A page of the tenant's conversation index (one per shard: merged by score)."""
        if not self.keys.shards:
            index = self.keys.tenant_conversations(tenant_id)
            return [text(cast(bytes, c)) for c in self.redis.zrevrange(index, offset, offset + limit - 1)]
        pipe = self.redis.pipeline(transaction=False)
        for shard in self.keys.every_shard():
            pipe.zrevrange(shard.tenant_conversations(tenant_id), 0, offset + limit - 1, withscores=True)
        return merged_page(pipe.execute(), offset, limit)

    def conversation_decisions(self, conversation_id: str) -> dict[str, dict[str, Any]]:
        """Every decision record of a conversation: turn id -> stage -> record."""
        out: dict[str, dict[str, Any]] = {}
        for field, value in self.redis.hscan_iter(self.keys.decisions(conversation_id), count=500):
            turn_id, _, stage = text(cast(bytes, field)).rpartition(":")
            out.setdefault(turn_id, {})[stage] = json.loads(value)
        return out

    def messages(self, conversation_id: str) -> list[MessageRecord]:
        from threadline.pipeline.records import MessageRecord

        rows = self.redis.hvals(self.keys.messages(conversation_id))
        return sorted((MessageRecord.model_validate_json(r) for r in rows), key=lambda m: m.created_at)

    def conversation_usage(self, conversation_id: str) -> dict[str, int]:
        """What every turn of a conversation used, all its branches: its message rows' usage summed
        into the counters a tenant's usage holds (`pipeline.cost.usage_counters`, the cost in
        millionths of a dollar) and `turns`. A conversation with no message row sums to nothing."""
        from threadline.pipeline.cost import usage_counters

        totals: dict[str, int] = {}
        for row in self.messages(conversation_id):
            for name, count in {**usage_counters(row.usage), "turns": 1}.items():
                totals[name] = totals.get(name, 0) + count
        return totals

    def thread(self, conversation_id: str, message_id: str | None = None) -> list[MessageRecord]:
        """The path root → `message_id` (default: the tip), oldest first."""
        from threadline.pipeline.history import extract_thread

        conversation = self.conversation(conversation_id)
        if conversation is None:
            return []
        thread, _ = extract_thread(self.messages(conversation_id), message_id or conversation.tip)
        return thread

    def import_conversation(
        self,
        *,
        conversation_id: str,
        tenant_id: str,
        app_id: str,
        user_id: str,
        agent_id: str,
        turns: list[tuple[str, str, list[ModelMessage] | None]],
        layers: list[str] | None = None,
    ) -> str:
        """Import a conversation made elsewhere (a migration): each turn is (query, answer, and the
        pydantic-ai messages it added, or None for a text-only message). The conversation is
        pinned to the agent's active version. Returns the id of the last message (the tip)."""
        from threadline.pipeline.config import AgentConfig
        from threadline.pipeline.history import encode_messages
        from threadline.pipeline.records import ConversationRecord, MessageRecord
        from threadline.workers.protocol.schema import conversation_to_hash

        active = self.redis.hget(self.keys.agent(agent_id), "active")
        stored = self.redis.get(self.keys.agent_version(agent_id, text(active))) if active is not None else None
        if active is None or stored is None:
            raise ValueError(f"agent {agent_id!r} is not registered")
        version = text(active)
        config = AgentConfig.model_validate_json(stored)
        if self.redis.exists(self.keys.conversation(conversation_id)):
            raise ValueError(f"conversation {conversation_id!r} exists")
        pipe = self.redis.pipeline(transaction=True)
        parent: str | None = None
        now = time.time()
        for seq, (query, answer, messages) in enumerate(turns, start=1):
            message_id = f"{conversation_id}-m{seq}"
            row = MessageRecord(id=message_id, conversation_id=conversation_id, parent_id=parent,
                                turn_id=message_id, query=query, answer=answer, status="succeeded",
                                created_at=now + seq / 1000, updated_at=now + seq / 1000)
            pipe.hset(self.keys.messages(conversation_id), message_id, row.model_dump_json())
            pipe.zadd(self.keys.message_order(conversation_id), {message_id: seq})
            if messages is not None:
                pipe.hset(self.keys.snapshots(conversation_id), message_id, encode_messages(messages))
            parent = message_id
        record = ConversationRecord(id=conversation_id, tenant_id=tenant_id, app_id=app_id, user_id=user_id,
                                    agent_id=agent_id, config_ref=f"v{version}", layers=layers or config.layers,
                                    revision=len(turns), tip=parent, created_at=now)
        fields = {**conversation_to_hash(record), "message_seq": str(len(turns))}
        pipe.hset(self.keys.conversation(conversation_id), mapping=cast(Any, fields))
        # indexed whether or not the workers' retention is on (the client does not know): an entry
        # costs nothing unread, and goes with the conversation
        pipe.zadd(self.keys.of_conversation(conversation_id).activity(), {conversation_id: now})
        pipe.execute()
        return parent or ""

    def delete_conversation(self, conversation_id: str, *, tenant_id: str | None = None) -> DeleteResult:
        """Delete a conversation: its rows, snapshots, summaries, token counts, decision records and
        every key of its turns (records, events, artifacts). "busy" while a turn of it runs or waits
        (cancel them first); "not_found" when it does not exist or `tenant_id` is not its tenant's.
        Usage counters are billing history, not conversation content: they stay."""
        from threadline.workers.protocol.schema import text
        from threadline.workers.storage.conversations import (
            DELETE_ATTEMPTS,
            DeleteResult,
            delete_result,
            deletion,
            turn_of_row,
        )

        if valid_id(conversation_id) is None:
            raise InvalidRequest(f"{conversation_id!r} is not a conversation id")
        for _ in range(DELETE_ATTEMPTS):
            rows = {text(mid): turn_of_row(row)
                    for mid, row in self.redis.hscan_iter(self.keys.messages(conversation_id), count=500)}
            stored, user = self.redis.hmget(self.keys.conversation(conversation_id), ["tenant_id", "user_id"])
            keys, arg = deletion(self.keys.of_conversation(conversation_id), DEFAULT_GRAPH, conversation_id,
                                 tenant_id=tenant_id, rows=rows,
                                 stored_tenant=text(stored) if stored is not None else None)
            result = delete_result(conversation_id, self._delete(keys=keys, args=[arg]))
            if result is not None:
                if result.status == "deleted" and stored is not None and user is not None:
                    # what long-term memory extracted from it goes with it
                    self.memory_store.forget_conversation(text(stored), conversation_id, text(user))
                return result
        return DeleteResult("busy", conversation_id)

    def snapshot(self, conversation_id: str, message_id: str) -> bytes | None:
        from threadline.workers.protocol.schema import as_bytes

        return as_bytes(self.redis.hget(self.keys.snapshots(conversation_id), message_id))

    # --- completion webhooks --------------------------------------------------------------------

    def webhook_secret(self, tenant_id: str, *, rotate: bool = False) -> str:
        """The tenant's webhook signing secret, created on first use (`rotate` replaces it): what a
        receiver checks `Threadline-Signature` with (docs/webhooks.md)."""
        from threadline.workers.storage.webhooks import sync_webhook_secret

        return sync_webhook_secret(self.redis, self.keys, tenant_id, rotate=rotate)

    # --- long-term memory: list, correct, forget -----------------------------------------------

    @cached_property
    def memory_store(self) -> SyncMemoryStore:
        from threadline.workers.storage.memory import SyncMemoryStore

        return SyncMemoryStore(self.redis, self.keys)

    def memory(self, tenant_id: str, user_id: str, *, app_id: str | None = None, agent_id: str | None = None,
               history: bool = False) -> list[MemoryRecord]:
        """The user's long-term memory in one partition (the user's, or an app's or agent's): the
        current records, and with `history` the closed versions after them."""
        scope = memory_scope(tenant_id, user_id, app_id=app_id, agent_id=agent_id)
        records = self.memory_store.read(scope)[0] if history else self.memory_store.current(scope)
        return listed_memory(records, scope, history=history)

    def memory_record(self, tenant_id: str, user_id: str, record_id: str, *, app_id: str | None = None,
                      agent_id: str | None = None) -> MemoryRecord:
        """One record of the partition, current or closed (`MemoryNotFound` otherwise)."""
        scope = memory_scope(tenant_id, user_id, app_id=app_id, agent_id=agent_id)
        return found_memory(self.memory_store.read(scope)[0], scope, record_id)

    def set_memory(self, tenant_id: str, user_id: str, *, value: str, key: str | None = None,
                   record_id: str | None = None, note: bool = False, origin: str = "user",
                   app_id: str | None = None, agent_id: str | None = None) -> MemoryRecord:
        """Set a fact (`key`), correct a current record (`record_id`: `MemoryNotFound` if none), or
        add a note (`note=True`); the old version is closed and kept in the history. Returns the
        current record (the one found, when the value is the same)."""
        scope = memory_scope(tenant_id, user_id, app_id=app_id, agent_id=agent_id)
        for _ in range(MEMORY_ATTEMPTS):
            records, revision = self.memory_store.read(scope)
            now = time.time()
            edit = memory_edit(records, scope, value=value, key=key, record_id=record_id, note=note, origin=origin,
                               now=now)
            if not edit.changed or self.memory_store.apply(scope, edit, revision=revision, now=now):
                return edited_record(edit)
        raise RuntimeError("the memory kept changing; try again")

    def forget_memory(self, tenant_id: str, user_id: str, *, key: str | None = None, record_id: str | None = None,
                      all: bool = False, app_id: str | None = None, agent_id: str | None = None) -> int:
        """Erase a fact (every version of `key`) or a record (its every version): the number of
        records deleted (0: none such). `all`: everything stored about the user, in every partition
        (the number of keys deleted)."""
        scope = memory_scope(tenant_id, user_id, app_id=app_id, agent_id=agent_id)
        if forgets_everything(scope, key=key, record_id=record_id, everything=all):
            return self.memory_store.forget_all(scope)
        for _ in range(MEMORY_ATTEMPTS):
            records, revision = self.memory_store.read(scope)
            gone = memory_forgetting(records, scope, key=key, record_id=record_id)
            if not gone.changed or self.memory_store.apply(scope, gone, revision=revision):
                return len(gone.deletes)
        raise RuntimeError("the memory kept changing; try again")


def _request_turn_id(data: bytes) -> str | None:
    """The `turn_id` of the request in a stored admit message (None when it names none)."""
    try:
        args = json.loads(data).get("args") or [None]
    except (ValueError, AttributeError):
        return None
    request = args[0]
    return str(request.get("turn_id")) if isinstance(request, dict) and request.get("turn_id") else None
