"""The admit stage's logic: check scope, pin the agent config version, validate the session, expand variables."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from .budget import answering_limits
from .config import AgentConfig, expand_variables, whitelisted_settings
from .contracts import TurnRequest
from .errors import Forbidden, InvalidRequest, SessionConfigurationChanged, ThreadlineError
from .guards import GuardDecision, check_input
from .records import ConversationRecord, ResolvedTurn


@dataclass(frozen=True, slots=True)
class ConfigRef:
    """Which config version a turn runs: the active published one, a pinned one, or a draft."""

    kind: Literal["active", "version", "draft"]
    value: str | None = None

    @classmethod
    def parse(cls, text: str) -> ConfigRef:
        if text.startswith("draft:"):
            return cls("draft", text.removeprefix("draft:"))
        return cls("version", text.removeprefix("v"))


@dataclass(frozen=True, slots=True)
class ResolveDecision:
    """What resolve decided and why, for the log line."""

    config_ref: str
    new_conversation: bool
    missing_variables: list[str] = field(default_factory=list)
    #: The input guards' verdict (None: the model answers).
    guard: GuardDecision | None = None


def choose_config(request: TurnRequest, conversation: ConversationRecord | None) -> ConfigRef:
    """A draft for debugger runs, the pinned version for an existing conversation, else the active one."""
    if conversation is not None:
        pinned = ConfigRef.parse(conversation.config_ref)
        wants_draft = request.invoke_from == "draft"
        if wants_draft != (pinned.kind == "draft") or (wants_draft and pinned.value != request.draft_id):
            raise Forbidden("this conversation belongs to another config surface (draft vs published)")
        return pinned
    if request.invoke_from == "draft":
        return ConfigRef("draft", request.draft_id)
    return ConfigRef("active")


def check_scope(request: TurnRequest, conversation: ConversationRecord) -> None:
    owner = (conversation.tenant_id, conversation.app_id, conversation.user_id, conversation.agent_id)
    if owner != (request.tenant_id, request.app_id, request.user_id, request.agent_id):
        raise Forbidden("the conversation does not belong to this tenant, app, user and agent")


#: Why a script (admit.lua, advance.lua, finish.lua) refused to write into a conversation; the same
#: rules `check_target` applies before anything is written.
Refusal = Literal["foreign_conversation", "conversation_exists", "message_exists"]


def refusal_error(why: Refusal, *, turn_id: str, conversation_id: str) -> ThreadlineError:
    """The stable error a refusal ends its turn with: another tenant's conversation is `forbidden`; a
    turn id used before (its record expired, its conversation or message is still there) is
    `invalid_request` — an existing message is never overwritten, so the producer picks a new id."""
    if why == "foreign_conversation":
        return Forbidden(f"conversation {conversation_id} belongs to another tenant")
    what = f"conversation {conversation_id}" if why == "conversation_exists" else f"message {turn_id}"
    return InvalidRequest(f"turn id {turn_id} was used before: {what} exists (the earlier turn's record expired); "
                          "send this turn with a new turn id")


def check_target(request: TurnRequest, *, existing: ConversationRecord | None, message_taken: bool,
                 conversation_id: str) -> None:
    """A turn may only create a conversation that does not exist (`existing`: the one its derived id
    names) and may never write over a message of another turn (`message_taken`: its message id, the
    turn id, already names a row). Another tenant's conversation is refused before the rest."""
    if existing is not None and existing.tenant_id != request.tenant_id:
        raise refusal_error("foreign_conversation", turn_id=request.turn_id, conversation_id=conversation_id)
    if existing is not None:
        raise refusal_error("conversation_exists", turn_id=request.turn_id, conversation_id=conversation_id)
    if message_taken:
        raise refusal_error("message_exists", turn_id=request.turn_id, conversation_id=conversation_id)


def resolve_turn(
    request: TurnRequest,
    *,
    conversation: ConversationRecord | None,
    config: AgentConfig,
    config_ref: str,
    new_conversation_id: str,
    now: float,
    parent_known: bool = True,
    existing: ConversationRecord | None = None,
    message_taken: bool = False,
) -> tuple[ResolvedTurn, ResolveDecision]:
    """Pin everything the turn needs; raise a `ThreadlineError` with a stable code when it can't run.
    `parent_known`: the request's `parent_message_id` is a message of this conversation (the shell
    looked it up), so a turn can never branch from another conversation's message. `existing` (a new
    conversation's turn: the conversation its id names, when it exists) and `message_taken` (the turn's
    message id names a row already, not its own): see `check_target`."""
    if not parent_known:
        raise InvalidRequest(f"parent message {request.parent_message_id!r} is not in this conversation")
    if conversation is not None:
        check_scope(request, conversation)
    check_target(request, existing=existing, message_taken=message_taken,
                 conversation_id=conversation.id if conversation else new_conversation_id)
    if conversation is not None and list(conversation.layers) != list(config.layers):
        raise SessionConfigurationChanged()
    deferred = _check_resume(request, conversation)
    instructions, missing = expand_variables(config.instructions, request.inputs)
    settings = whitelisted_settings(config.settings)
    if "max_tokens" not in settings:
        settings["max_tokens"] = answering_limits(config.model).max_output
    pinned = config.model_copy(update={"settings": settings})
    # a resume carries the human's answers to the model's own question, not a new query: not guarded
    guard = check_input(config.guards, request.query, request.inputs) if deferred is None else None
    resolved = ResolvedTurn(
        turn_id=request.turn_id,
        conversation_id=conversation.id if conversation else new_conversation_id,
        message_id=request.turn_id,
        parent_message_id=_parent(request, conversation),
        new_conversation=conversation is None,
        config_ref=config_ref,
        config=pinned,
        instructions=instructions,
        query=request.query,
        files=list(request.files),
        context=request.context,
        deferred_answers=deferred,
        guard=guard,
        deadline_s=request.deadline_s or config.deadline_s,
        accepted_at=now,
        tenant_id=request.tenant_id,
        app_id=request.app_id,
        user_id=request.user_id,
        agent_id=request.agent_id,
        memory=request.memory,
        webhook_url=request.webhook_url or config.webhook_url,
    )
    return resolved, ResolveDecision(config_ref, conversation is None, missing, guard)


def _parent(request: TurnRequest, conversation: ConversationRecord | None) -> str | None:
    if request.parent_message_id == "root" or conversation is None:
        return None
    return request.parent_message_id or conversation.tip


def _check_resume(request: TurnRequest, conversation: ConversationRecord | None) -> dict[str, object] | None:
    """A resume must answer exactly the calls the conversation's paused tip waits on."""
    if request.deferred_tool_results is None:
        return None
    if conversation is None or not conversation.pending_tool_calls:
        raise InvalidRequest("nothing to resume: the conversation has no paused turn waiting for answers")
    if request.parent_message_id not in (None, conversation.tip):
        raise InvalidRequest("a resume continues the paused message; it cannot branch")
    pending = {call["tool_call_id"] for call in conversation.pending_tool_calls}
    answered = set(request.deferred_tool_results.calls)
    unknown = sorted(answered - pending)
    if unknown:
        raise InvalidRequest(f"unknown or already answered tool call ids: {unknown}")
    missing = sorted(pending - answered)
    if missing:
        raise InvalidRequest(f"answers missing for pending tool calls: {missing}")
    return dict(request.deferred_tool_results.calls)
