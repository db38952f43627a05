"""What the sync and async clients share: the wire names producers enqueue to, the turn handle's
base, and the pure steps of submitting a turn and reading its events (one implementation, two I/O styles)."""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final, Self, cast

from threadline.pipeline.busy import OnBusy, busy_error, interrupt_victims
from threadline.pipeline.errors import AgentNotFound, ConversationNotFound, InvalidRequest
from threadline.pipeline.ids import valid_id, valid_turn_id
from threadline.pipeline.stages import DEFAULT_GRAPH
from threadline.workers.protocol.keys import Keys
from threadline.workers.protocol.schema import text
from threadline.workers.protocol.wire import build_message
from threadline.workers.settings import Settings
from threadline.workers.storage import lua

# the turn request's model (pydantic) is imported where a request is checked: a command that only
# names a turn (`threadline cancel`) never loads it (`bench/cli.py`)
if TYPE_CHECKING:
    from threadline.pipeline.consolidation import Consolidation
    from threadline.pipeline.contracts import TurnRequest
    from threadline.pipeline.events import Event
    from threadline.pipeline.memory import MemoryRecord, Scope
    from threadline.pipeline.records import ConversationRecord


#: The queue and actor producers enqueue turns to: the stage graph's admit stage.
ADMIT_QUEUE: Final = DEFAULT_GRAPH.first.queue
ADMIT_ACTOR: Final = DEFAULT_GRAPH.first.name


class TurnIdTaken(InvalidRequest):
    """`start(..., owner=T)` of a turn id that already names a turn of another tenant (or of no tenant)."""


class BaseHandle(str):
    """What the sync and async turn handles share: a handle is its turn id (a `str`: code that stores
    or prints the id keeps working) and carries its client; pickled or copied, it is just the id."""

    request: TurnRequest | None
    created: bool

    def __new__(cls, turn_id: str, client: Any, *, request: TurnRequest | None = None, created: bool = True) -> Self:
        handle = super().__new__(cls, turn_id)
        handle.client, handle.request, handle.created = client, request, created  # type: ignore[attr-defined]
        return handle

    @property
    def turn_id(self) -> str:
        return str(self)

    def __reduce__(self) -> tuple[type[str], tuple[str]]:
        # the client (a connection pool) does not travel
        return str, (str(self),)


def resume_body(conversation_id: str, answers: Mapping[str, Any], *, request: TurnRequest | None,
                record: ConversationRecord | None, turn_id: str | None) -> dict[str, Any]:
    """The request that resumes a paused turn: its scope (from its request, else its conversation)."""
    if request is not None:
        scope = request.model_dump(include={"tenant_id", "app_id", "user_id", "agent_id", "invoke_from", "draft_id"})
    else:
        if record is None:
            raise InvalidRequest(f"conversation {conversation_id} of the paused turn no longer exists")
        scope = {"tenant_id": record.tenant_id, "app_id": record.app_id, "user_id": record.user_id,
                 "agent_id": record.agent_id}
        if record.config_ref.startswith("draft:"):
            scope |= {"invoke_from": "draft", "draft_id": record.config_ref.removeprefix("draft:")}
    body = {**scope, "conversation_id": conversation_id, "deferred_tool_results": {"calls": dict(answers)}}
    return body | ({"turn_id": turn_id} if turn_id else {})


def read_block_ms(turn_id: str, *, follow: bool, deadline: float | None, timeout_s: float | None) -> int | None:
    """How long one XREAD of a turn's events may block: None (not at all) unless following; at most
    1 s, so a deadline is noticed; `TimeoutError` once `deadline` passed."""
    if not follow:
        return None
    remaining = 1.0 if deadline is None else deadline - time.monotonic()
    if remaining <= 0:
        raise TimeoutError(f"turn {turn_id} did not finish in {timeout_s} s")
    return max(1, int(min(remaining, 1.0) * 1000))


def stream_entries(reply: Any) -> list[tuple[str, Event]]:
    """An XREAD reply of one events stream as (entry id, typed event) pairs."""
    from threadline.pipeline import events as ev

    return [(text(entry_id), ev.decode(fields[b"json"])) for entry_id, fields in (reply[0][1] if reply else [])]


def submit_call(keys: Keys, queue: str, actor: str, args: tuple[Any, ...], *, message_id: str,
                conversation_id: str | None, turn_id: str | None, owner: str | None,
                now_ms: int, on_busy: str = "",
                victims: Sequence[str] = ()) -> tuple[str, list[str], list[str | bytes]]:
    """The message id, KEYS and ARGV of submit.lua: what any producer writes (sync and async clients).
    `on_busy` (the request's policy, "" = none named) is applied by the script, with the `victims`
    an interrupting turn read (`busy_reads`). `keys` are bound to the turn's shard (`layout.py`): the
    queue, the turn and the doorbell are that shard's, and its conversation must be in it."""
    target, mid, data = build_message(queue, actor, args, message_id=message_id, now_ms=now_ms)
    # only ids that name keys of their own take a place in a line (workers refuse the others)
    register = bool(conversation_id and turn_id and valid_turn_id(turn_id) and valid_id(conversation_id))
    line = keys.turn_queue(conversation_id if register and conversation_id else "-")
    turn = keys.turn(turn_id if register and turn_id else "-")
    conversation = keys.conversation(conversation_id if register and conversation_id else "-")
    policy: dict[str, Any] = {}
    extra: list[str] = []
    if register and on_busy and conversation_id and turn_id:
        victim_keys, policy = lua.on_busy_args(keys, turn_id, on_busy, victims,
                                               cancel_ttl_s=setting_default("cancel_ttl_s"), now=now_ms / 1000)
        extra = [keys.lease(conversation_id), *victim_keys]
    argv = lua.payload(message_id=mid, turn_id=turn_id if register else "", channel=keys.doorbell_channel(),
                       queue=target, owner=owner if register and owner else "", **policy)
    return mid, [keys.queue_messages(target), keys.queue(target), line, turn, conversation, *extra], [argv, data]


#: Rounds of reading the turns an interrupting turn cancels while turns keep arriving meanwhile.
BUSY_ATTEMPTS = 8


def busy_reads(pipe: Any, keys: Keys, conversation_id: str, turn_id: str) -> None:
    """Queue on a (sync or async) pipeline what `busy_victims` needs: the holder, the turn's own place
    and the interrupting turns' places."""
    pipe.hget(keys.lease(conversation_id), "turn")
    pipe.zscore(keys.turn_queue(conversation_id), turn_id)
    pipe.zrangebyscore(keys.turn_queue(conversation_id), "-inf", "(0", withscores=True)


def busy_victims(turn_id: str, replies: Sequence[Any]) -> list[str]:
    """The turns an interrupting turn cancels, from the replies of `busy_reads`."""
    holder, own, ahead = replies
    return interrupt_victims(turn_id, text(holder) if holder else None,
                             [(text(m), float(score)) for m, score in ahead], own)


def with_on_busy(request: Mapping[str, Any] | TurnRequest,
                 on_busy: OnBusy | None) -> Mapping[str, Any] | TurnRequest:
    """The request with `on_busy` (the keyword of `start` and `submit`; None: the request's own)."""
    if on_busy is None:
        return request
    if isinstance(request, Mapping):
        return {**request, "on_busy": on_busy}
    return request.model_copy(update={"on_busy": on_busy})


def busy_changed(reply: Any) -> bool:
    """submit.lua found other turns in the way than the ones read: read them again."""
    return isinstance(reply, list) and text(reply[0]) == "changed"


def submitted(reply: Any, conversation_id: str = "") -> tuple[bool, str]:
    """submit.lua's reply: (enqueued, the existing turn's owner when it was not). A turn of an owner
    naming another tenant's conversation was refused: `ConversationNotFound`, as for a missing one;
    an `on_busy: reject` turn of a busy conversation: `ConversationBusy`, nothing written."""
    if isinstance(reply, list) and text(reply[0]) == "foreign_conversation":
        raise ConversationNotFound("conversation not found")
    if isinstance(reply, list) and text(reply[0]) == "busy":
        raise busy_error(conversation_id, text(reply[1]))
    if busy_changed(reply):
        raise busy_error(conversation_id, "the turns in the way kept changing")
    if isinstance(reply, list):
        return False, text(reply[1])
    return True, ""


def checked_request(request: Mapping[str, Any] | TurnRequest, *, max_query_chars: int,
                    max_context_chars: int, max_inputs_chars: int | None = None,
                    max_files: int | None = None) -> TurnRequest:
    """The request checked with the workers' own model and limits (`InvalidRequest` when refused);
    a request without a turn id gets a new one."""
    from threadline.pipeline.contracts import TURN_SCHEMA, TurnRequest, parse_turn_request

    if isinstance(request, TurnRequest):
        return request
    return parse_turn_request({"schema": TURN_SCHEMA, **request}, fallback_turn_id=uuid.uuid4().hex,
                              max_query_chars=max_query_chars, max_context_chars=max_context_chars,
                              max_inputs_chars=max_inputs_chars or setting_default("max_inputs_chars"),
                              max_files=setting_default("max_files") if max_files is None else max_files)


def turn_body(request: TurnRequest) -> dict[str, Any]:
    """A checked request as it is enqueued (JSON, the `schema` field by its name)."""
    return request.model_dump(mode="json", by_alias=True, exclude_none=True)


def agent_probe(keys: Keys, request: TurnRequest) -> tuple[str, str | None]:
    """What tells whether the agent a turn runs exists, in one cheap command: the key of the draft it
    names (EXISTS), else the agent's hash and its `active` field (HEXISTS): a published version."""
    if request.invoke_from == "draft" and request.draft_id is not None:
        return keys.agent_draft(request.agent_id, request.draft_id), None
    return keys.agent(request.agent_id), "active"


def missing_agent(request: TurnRequest) -> AgentNotFound:
    """The refusal of a turn whose agent (or draft) `agent_probe` did not find: nothing is enqueued."""
    if request.invoke_from == "draft":
        return AgentNotFound(f"agent {request.agent_id!r} has no draft {request.draft_id!r}")
    return AgentNotFound(f"agent {request.agent_id!r} is not registered (or has no published version)")


def owner_of(tenant: bytes | str | None, conversation_tenant: bytes | str | None) -> str | None:
    """The tenant a turn belongs to: recorded at submission (the gateway's), else its conversation's."""
    if tenant:
        return text(tenant)
    return text(conversation_tenant) if conversation_tenant else None


def setting_default(name: str) -> int:
    """A `Settings` field's default (the workers' own when their env does not change it)."""
    return cast(int, next(f.default for f in dataclasses.fields(Settings) if f.name == name))




# --- long-term memory: list, correct, forget ---------------------------------------------------------
# The pure steps of `memory`, `set_memory` and `forget_memory` (both clients; the CLI and the gateway
# render with `memory_view`). pipeline/consolidation.py and storage/memory.py load pydantic-ai: they
# are imported inside these functions, which only a memory call runs.

#: Rounds of read, consolidate and write while concurrent writes keep moving the partition's revision.
MEMORY_ATTEMPTS = 8
_REFUSED = {"limit": "the memory holds its maximum of records", "too long": "the value is too long",
            "empty": "the value is empty", "bad key": "not a fact key"}


class MemoryNotFound(LookupError):
    """No such record (or fact) in the partition; a record of another partition, user or tenant is
    not found either (every read is filtered by `in_scope`)."""


def memory_scope(tenant_id: str, user_id: str, *, app_id: str | None = None,
                 agent_id: str | None = None) -> Scope:
    """The partition one call reads and writes (`InvalidRequest` for an invalid id, or app and agent both)."""
    from threadline.pipeline.memory import Scope

    return Scope(tenant_id, user_id, app_id=app_id, agent_id=agent_id)


def listed_memory(records: Sequence[MemoryRecord], scope: Scope, *, history: bool) -> list[MemoryRecord]:
    """The partition's records as listed: the current ones, and with `history` the closed ones too."""
    from threadline.pipeline.memory import in_scope

    return [r for r in records if in_scope(r, scope) and (history or r.current)]


def found_memory(records: Sequence[MemoryRecord], scope: Scope, record_id: str) -> MemoryRecord:
    """The partition's record `record_id` (current or closed), else `MemoryNotFound`."""
    found = next((r for r in listed_memory(records, scope, history=True) if r.id == record_id), None)
    if found is None:
        raise MemoryNotFound(f"memory record {record_id} not found")
    return found


def new_memory_id() -> str:
    return uuid.uuid4().hex


def memory_edit(records: Sequence[MemoryRecord], scope: Scope, *, value: str, key: str | None, record_id: str | None,
                note: bool, origin: str, now: float) -> Consolidation:
    """`set_memory` as a consolidation of the records read: a fact set by `key`, the current record
    `record_id` corrected, or (`note`) a new note. The old version is closed, not deleted."""
    from threadline.pipeline.consolidation import apply_user_edit

    if origin not in ("user", "operator"):
        raise InvalidRequest(f"origin is 'user' or 'operator', not {origin!r}")
    if key is not None and (record_id is not None or note):
        raise InvalidRequest("name a fact key, or a record id, or a note: one of them")
    if key is None and record_id is None and not note:
        raise InvalidRequest("name a fact key, a record id to correct, or note=True")
    if not isinstance(value, str):
        raise InvalidRequest("a memory value is text")
    if record_id is not None and not any(r.id == record_id for r in listed_memory(records, scope, history=False)):
        raise MemoryNotFound(f"memory record {record_id} not found")
    return apply_user_edit(records, scope=scope, value=value, now=now, new_id=new_memory_id,
                           origin="operator" if origin == "operator" else "user", key=key, record_id=record_id)


def edited_record(edit: Consolidation) -> MemoryRecord:
    """The record a `memory_edit` leaves current: the new one, or the one found unchanged (the same
    value, a note alike); `InvalidRequest` when the value was refused (empty, too long, the limit)."""
    applied = edit.applied[-1]
    if not applied.records:
        raise InvalidRequest(_REFUSED.get(applied.reason, f"not applied: {applied.reason}"))
    return next(r for r in edit.current if r.id == applied.records[0])


def memory_forgetting(records: Sequence[MemoryRecord], scope: Scope, *, key: str | None,
                      record_id: str | None) -> Consolidation:
    """`forget_memory` of a fact (every version of its key) or a record (its whole chain of versions)."""
    from threadline.pipeline.consolidation import forget

    if (key is None) == (record_id is None):
        raise InvalidRequest("name a fact key or a record id (or all)")
    return forget(records, scope=scope, key=key, record_id=record_id)


def forgets_everything(scope: Scope, *, key: str | None, record_id: str | None, everything: bool) -> bool:
    """Whether `forget_memory` forgets all the user's memory (every partition: refused with an app or
    agent named, so no one forgets more than they named)."""
    if everything and (key is not None or record_id is not None):
        raise InvalidRequest("forget all, or a fact key, or a record id: one of them")
    if everything and (scope.app_id is not None or scope.agent_id is not None):
        raise InvalidRequest("all forgets every partition of the user: name no app or agent")
    return everything


def memory_view(record: MemoryRecord) -> dict[str, Any]:
    """A record as the CLI prints it and the gateway answers it (JSON): no vector."""
    return {"id": record.id, "kind": record.kind, "key": record.key, "value": record.value,
            "current": record.current, "partition": record.partition, "valid_at": record.valid_at,
            "recorded_at": record.recorded_at, "invalid_at": record.invalid_at,
            "superseded_by": record.superseded_by, "source": dataclasses.asdict(record.source)}
