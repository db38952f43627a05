"""The HTTP + SSE gateway (`threadline gateway`): thin FastAPI handlers over the clients.

The tenant comes from the API key (`workers/storage/api_keys.py`), never from a body; a turn or conversation
of another tenant is a 404 that reads exactly like a missing one. A gateway process keeps no turn
state (everything is in Redis), so several can run behind one load balancer. Event streams are
Server-Sent Events whose ids are the turn stream's entry ids: `Last-Event-ID` (or `?after=`)
resumes after one, with nothing lost or repeated.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Annotated, Any, Literal

import redis
from fastapi import Body, Depends, FastAPI, Header, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from sse_starlette import EventSourceResponse, ServerSentEvent

from threadline.pipeline.config import parse_agent_config
from threadline.pipeline.contracts import (
    ID_PATTERN,
    Id,
    TurnRequest,
    new_conversation_id,
    valid_id,
    valid_turn_id,
)
from threadline.pipeline.errors import AgentNotFound, ConversationBusy, ConversationNotFound, Forbidden, ThreadlineError
from threadline.pipeline.history import extract_thread
from threadline.pipeline.records import ConversationRecord
from threadline.workers.clients.async_client import AsyncClient
from threadline.workers.clients.client import Client
from threadline.workers.clients.common import TurnIdTaken, checked_request
from threadline.workers.gateway import pools
from threadline.workers.gateway.admin_keys import add_key_routes
from threadline.workers.gateway.auth import Authenticator, admin, caller, turn_caller
from threadline.workers.gateway.memory_routes import add_memory_routes
from threadline.workers.gateway.middleware import (
    AccessLog,
    BodyLimit,
    BrowserHeaders,
    install_envelopes,
    printable,
    remember,
    validation_detail,
)
from threadline.workers.gateway.ratelimit import Limiter
from threadline.workers.gateway.refusals import install_refusals
from threadline.workers.gateway.streams import StreamHub
from threadline.workers.gateway.tenancy import MAX_TURN_ID, Ids, outside, shown
from threadline.workers.protocol.keys import Keys
from threadline.workers.settings import Settings
from threadline.workers.storage.agents import PutResult, parse_version
from threadline.workers.storage.api_keys import ApiKey, KeyRing
from threadline.workers.storage.connect import is_cluster
from threadline.workers.storage.rate_limits import RateLimits

#: Seconds between keep-alive comments on an idle event stream (proxies close silent connections).
PING_S = 15
#: The web console shipped with the package (plain HTML, CSS and JS: no build step), served at `/`.
CONSOLE_DIR = Path(__file__).resolve().parent / "console"
#: ASCII digits only (`\d` would take Arabic-Indic or fullwidth ones), matched whole (`$` would let a
#: trailing newline through): what Redis takes as a stream entry id.
_STREAM_ID = re.compile(r"([0-9]{1,19})(?:-([0-9]{1,19}))?")


class ApiError(Exception):
    """An answer other than 2xx: the status, a stable `code` and a message, as the JSON body."""

    def __init__(self, status: int, code: str, message: str, **extra: Any) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.extra = status, code, message, extra


def not_found(what: str) -> ApiError:
    return ApiError(404, "not_found", f"{what} not found")


class TurnBody(TurnRequest):
    """A turn request as the gateway takes it: `schema`, `turn_id` and `tenant_id` may be left out
    (the tenant is the API key's). A turn id is the tenant's own (`tenancy.py`): at most 107 characters."""

    schema_: Literal["threadline.turn/v1"] = Field(default="threadline.turn/v1", alias="schema")
    turn_id: Annotated[str, Field(min_length=1, max_length=MAX_TURN_ID, pattern=ID_PATTERN)] | None = None  # type: ignore[assignment]
    tenant_id: Id | None = None  # type: ignore[assignment]


class TurnAccepted(BaseModel):
    turn_id: str
    conversation_id: str
    events_url: str
    turn_url: str
    #: False when the turn id had been submitted before (idempotent: nothing was enqueued again).
    created: bool


class CancelBody(BaseModel):
    reason: str = Field(default="", max_length=1000)


class Gateway:
    """What the handlers share: the clients, the caller's authentication and rate limits, and the
    process's one event-stream reader (`pools.py` says which Redis connections each uses)."""

    def __init__(self, settings: Settings, url: str) -> None:
        self.client = Client.from_settings(settings, url)
        self.aclient = AsyncClient.from_settings(settings, url)
        if not is_cluster(url):  # a cluster client keeps a pool per node
            pools.use_pool(self.aclient.redis, pools.request_pool(settings, url))
        self.health = pools.health_client(url)
        # rate limits and API keys are global keys, the same in every layout: nothing is read here
        # (a gateway starts while Redis is down, and answers 503 until it is back)
        global_keys = Keys(settings.prefix)
        self.limits = Limiter(settings, RateLimits(self.aclient.redis, global_keys))
        self.auth = Authenticator(settings, self.aclient, self.limits)
        self.streams = StreamHub(url, self.aclient.turn_keys, self.aclient.redis, renew=self.limits.renew_streams)
        self.keyring = KeyRing(self.client.redis, global_keys)
        self.ids = Ids(self.aclient)

    async def own_turn(self, turn_id: str, key: ApiKey) -> str:
        """The stored id of the caller's turn `turn_id` (as the caller spells it, `tenancy.py`); a turn
        of another tenant is a 404 like a missing one."""
        stored = await self.ids.turn(key.tenant_id, turn_id) if valid_turn_id(turn_id) else None
        if stored is None or not await self.auth.sees_turn(key, stored):
            raise not_found(f"turn {turn_id}")
        return stored

    async def own_conversation(self, conversation_id: str, key: ApiKey) -> ConversationRecord:
        """The caller's conversation `conversation_id` (its `id` is the stored one), else a 404."""
        stored = await self.ids.conversation(key.tenant_id, conversation_id) if valid_id(conversation_id) else None
        record = await self.aclient.conversation(stored) if stored and valid_id(stored) else None
        if record is None or record.tenant_id != key.tenant_id or not self.auth.sees_conversation(key, record):
            raise not_found(f"conversation {conversation_id}")
        return record

    async def stored_request(self, request: dict[str, Any], tenant_id: str) -> dict[str, Any]:
        """A tenant's turn request with its ids (turn, conversation, parent message) as stored."""
        stored = dict(request)
        if request.get("turn_id"):
            stored["turn_id"] = await self.ids.new_turn(tenant_id, request["turn_id"])
        if request.get("conversation_id"):
            stored["conversation_id"] = await self.ids.conversation(tenant_id, request["conversation_id"])
            if request.get("parent_message_id") not in (None, "root"):
                stored["parent_message_id"] = await self.ids.message(stored["conversation_id"], tenant_id,
                                                                     request["parent_message_id"])
        return stored


async def _caller(request: Request, key: Annotated[ApiKey, Depends(caller)]) -> ApiKey:
    return remember(request, key)


async def _turn_caller(request: Request, key: Annotated[ApiKey, Depends(turn_caller)]) -> ApiKey:
    return remember(request, key)


async def _admin(request: Request, key: Annotated[ApiKey, Depends(admin)]) -> ApiKey:
    return remember(request, key)


# Module-level, so FastAPI can resolve them in the handlers' (string) annotations: auth.py's callers,
# each noted for the access log.
Caller = Annotated[ApiKey, Depends(_caller)]
TurnCaller = Annotated[ApiKey, Depends(_turn_caller)]
Admin = Annotated[ApiKey, Depends(_admin)]
Version = Annotated[str | None, Query(max_length=12, description="3 or v3 (default: the active one)")]
Draft = Annotated[str | None, Query(max_length=128)]
LastEventId = Annotated[str | None, Header(alias="Last-Event-ID")]


def stream_after(value: str | None) -> str:
    """A stream entry id to resume after ("0": from the start); anything else is a 422."""
    if value is None or value in ("", "0"):
        return "0"
    match = _STREAM_ID.fullmatch(value)
    if match is None or any(int(part) >= 2**64 for part in match.groups() if part):
        raise ApiError(422, "invalid_request", f"{value!r} is not an event id (a stream entry id like 1718-0)")
    return value


def _error_body(code: str, message: str, **extra: Any) -> dict[str, Any]:
    return dict(printable({"code": code, "message": message, **extra}))


_STATUS: dict[type[ThreadlineError], int] = {AgentNotFound: 404, ConversationNotFound: 404, Forbidden: 403,
                                             TurnIdTaken: 409, ConversationBusy: 409}


def install_error_handlers(app: FastAPI) -> None:
    """Every failure is `{"code", "message"}`: 401 no key, 404 unknown or another tenant's, 422 invalid."""

    async def api_error(_: Request, e: Exception) -> JSONResponse:
        assert isinstance(e, ApiError)
        return JSONResponse(_error_body(e.code, e.message, **e.extra), status_code=e.status)

    async def threadline_error(_: Request, e: Exception) -> JSONResponse:
        assert isinstance(e, ThreadlineError)
        status = next((s for cls, s in _STATUS.items() if isinstance(e, cls)), 422)
        code = "turn_id_taken" if isinstance(e, TurnIdTaken) else e.code
        return JSONResponse(_error_body(code, e.message), status_code=status)

    async def invalid(_: Request, e: Exception) -> JSONResponse:
        assert isinstance(e, RequestValidationError)
        detail = validation_detail(e.errors())  # never the refused input itself
        return JSONResponse(_error_body("invalid_request", "the request does not match the API", detail=detail),
                            status_code=422)

    async def unavailable(_: Request, e: Exception) -> JSONResponse:
        return JSONResponse(_error_body("unavailable", "the server cannot reach Redis"), status_code=503)

    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(ThreadlineError, threadline_error)
    app.add_exception_handler(RequestValidationError, invalid)
    app.add_exception_handler(redis.ConnectionError, unavailable)
    app.add_exception_handler(redis.TimeoutError, unavailable)


def create_app(settings: Settings, url: str, *, console_dir: Path | None = CONSOLE_DIR) -> FastAPI:
    """The gateway's ASGI app on the server at `url`. `console_dir`: static files served at `/`
    after every API route (default: the web console; None: no console)."""
    gw = Gateway(settings, url)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await gw.streams.close()
        await gw.health.aclose()
        await gw.aclient.close()
        gw.client.close()

    # no docs UI: FastAPI's loads Swagger UI from a CDN, which the Content-Security-Policy refuses;
    # /openapi.json is served for any OpenAPI viewer
    app = FastAPI(title="Threadline", version="1", lifespan=lifespan, docs_url=None, redoc_url=None,
                  description="Turns, their events (Server-Sent Events), conversations and agents. "
                              "Authenticate with `Authorization: Bearer <key>` (`threadline keys create TENANT`).")
    app.state.gateway = gw
    install_envelopes(app)
    install_error_handlers(app)
    # the last added runs first: the access log sees every answer, the 413s included
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    app.add_middleware(BrowserHeaders)
    app.add_middleware(AccessLog)
    install_refusals(app)
    add_turn_routes(app, gw)
    add_conversation_routes(app, gw)
    add_agent_routes(app, gw)
    add_key_routes(app, gw.keyring)
    add_memory_routes(app, gw.aclient)

    @app.get("/healthz", tags=["operations"])
    async def healthz() -> dict[str, str]:
        """For load balancers: 200 while Redis answers (on connections of its own: requests and
        streams never keep it waiting)."""
        await gw.health.ping()
        return {"status": "ok"}

    if console_dir is not None:
        from starlette.staticfiles import StaticFiles

        app.mount("/", StaticFiles(directory=console_dir, html=True), name="console")
    return app


def key_webhook(body: TurnBody, key: ApiKey) -> dict[str, str]:
    """The API key's webhook for a turn that names none (it comes before the agent's: docs/webhooks.md)."""
    return {"webhook_url": key.webhook_url} if body.webhook_url is None and key.webhook_url else {}


def add_turn_routes(app: FastAPI, gw: Gateway) -> None:
    @app.post("/v1/turns", status_code=202, response_model=TurnAccepted, tags=["turns"],
              responses={409: {"description": "the turn_id names another tenant's turn (`turn_id_taken`), or "
                                              "`on_busy: reject` found the conversation busy (`conversation_busy`)"}})
    async def post_turn(body: TurnBody, key: TurnCaller) -> TurnAccepted:
        """Enqueue a turn (`threadline.turn/v1`; `tenant_id` is the key's: another one is a 403).
        Idempotent on `turn_id`: the same id again enqueues nothing and answers the same."""
        if body.tenant_id not in (None, key.tenant_id):
            raise ApiError(403, "forbidden", "tenant_id is not the API key's tenant")
        request = {**body.model_dump(mode="json", by_alias=True, exclude_unset=True), "tenant_id": key.tenant_id,
                   **key_webhook(body, key)}
        # the tenant's ids as stored (tenancy.py); a generated turn id is stored as it is
        checked = checked_request(await gw.stored_request(request, key.tenant_id),
                                  max_query_chars=gw.aclient.max_query_chars,
                                  max_context_chars=gw.aclient.max_context_chars,
                                  max_inputs_chars=gw.aclient.max_inputs_chars, max_files=gw.aclient.max_files)
        record = None if checked.conversation_id is None else await gw.aclient.conversation(checked.conversation_id)
        if record is not None and record.tenant_id != key.tenant_id:
            raise not_found(f"conversation {body.conversation_id}")
        await gw.auth.before_turn(key, checked, record)
        try:
            handle = await gw.aclient.start(checked, owner=key.tenant_id)
        except ConversationNotFound:
            raise not_found(f"conversation {body.conversation_id}") from None
        except ConversationBusy:
            # the ids as the caller spells them, not as stored
            raise ApiError(409, "conversation_busy", f"conversation {body.conversation_id} has a turn running or "
                           "waiting; on_busy=reject refuses the new turn") from None
        turn_id = outside(key.tenant_id, str(handle))
        conversation_id = outside(key.tenant_id, checked.conversation_id or new_conversation_id(handle))
        return TurnAccepted(turn_id=turn_id, conversation_id=conversation_id,
                            events_url=f"/v1/turns/{turn_id}/events", turn_url=f"/v1/turns/{turn_id}",
                            created=handle.created)

    @app.get("/v1/turns/{turn_id}/events", tags=["turns"], response_class=EventSourceResponse,
             responses={200: {"content": {"text/event-stream": {}}, "description": "the turn's events"}})
    async def turn_events(turn_id: str, key: Caller, after: str | None = None,
                          last_event_id: LastEventId = None) -> EventSourceResponse:
        """The turn's events as Server-Sent Events (`id`: the stream entry id, `event`: the type,
        `data`: the event's JSON), until the terminal one. Resume with `Last-Event-ID` or `?after=`."""
        stored = await gw.own_turn(turn_id, key)
        start = stream_after(last_event_id or after)
        hold = await gw.limits.open_stream(key)  # 429 while the key has its limit of streams open

        async def stream() -> AsyncIterator[ServerSentEvent]:
            try:  # every stream of the process is read by one task on one connection (streams.py)
                async for entry_id, event in gw.streams.subscribe(stored, after=start, hold=hold):
                    yield ServerSentEvent(data=outside(key.tenant_id, event.model_dump_json()), event=event.type,
                                          id=entry_id)
            finally:
                gw.limits.close_stream(hold)

        return EventSourceResponse(stream(), ping=PING_S)

    @app.post("/v1/turns/{turn_id}/cancel", status_code=202, tags=["turns"])
    async def cancel_turn(turn_id: str, key: Caller, body: Annotated[CancelBody | None, Body()] = None,
                          ) -> dict[str, str]:
        """Cancel a turn: "enqueued", or "noop: <status>" when it has already ended."""
        stored = await gw.own_turn(turn_id, key)
        return {"turn_id": turn_id, "result": await gw.aclient.cancel(stored, body.reason if body else "")}

    @app.get("/v1/turns/{turn_id}", tags=["turns"])
    async def get_turn(turn_id: str, key: Caller) -> dict[str, Any]:
        """The turn's status ("queued" until a worker admits it), its terminal event once it ended
        (answer, usage), and its stages' decision records."""
        stored = await gw.own_turn(turn_id, key)
        state = await gw.aclient.turn_state(stored)
        terminal = await gw.aclient.terminal(stored)
        decisions: dict[str, Any] = {}
        if state.conversation_id:
            record = await gw.aclient.conversation(state.conversation_id)
            if record is not None and record.tenant_id == key.tenant_id:
                decisions = (await gw.aclient.conversation_decisions(state.conversation_id)).get(stored, {})
        return shown(key.tenant_id, {
            "turn_id": stored, "status": state.status or "queued", "stage": state.stage or None,
            "attempt": state.attempt, "conversation_id": state.conversation_id or None,
            "message_id": state.message_id or None,
            "result": terminal.model_dump(mode="json") if terminal else None, "decisions": decisions})


def add_conversation_routes(app: FastAPI, gw: Gateway) -> None:
    @app.get("/v1/conversations", tags=["conversations"])
    async def list_conversations(key: Caller, limit: Annotated[int, Query(ge=1, le=200)] = 50,
                                 offset: Annotated[int, Query(ge=0, le=1_000_000)] = 0) -> dict[str, Any]:
        """The key's tenant's conversations, the most recently active first."""
        found = await gw.aclient.conversations(key.tenant_id, limit=limit, offset=offset)
        # a user-scoped key sees its user's conversations only (a page may then hold fewer than `limit`)
        return shown(key.tenant_id, {"conversations": [c.model_dump(mode="json") for c in found
                                                         if gw.auth.sees_conversation(key, c)]})

    @app.get("/v1/conversations/{conversation_id}", tags=["conversations"])
    async def get_conversation(conversation_id: str, key: Caller) -> dict[str, Any]:
        """The whole tree (every message with its parent), the current path root → tip, and each
        turn's status, usage and decision records."""
        record = await gw.own_conversation(conversation_id, key)
        messages = await gw.aclient.messages(record.id)
        path, _ = extract_thread(messages, record.tip) if record.tip else ([], None)
        decisions = await gw.aclient.conversation_decisions(record.id)
        return shown(key.tenant_id, {
            "conversation": record.model_dump(mode="json"), "path": [m.id for m in path],
            "messages": [{**m.model_dump(mode="json"), "decisions": decisions.get(m.turn_id, {})} for m in messages]})

    @app.delete("/v1/conversations/{conversation_id}", tags=["conversations"],
                responses={409: {"description": "a turn of the conversation runs or waits: cancel it first"}})
    async def delete_conversation(conversation_id: str, key: Caller) -> dict[str, Any]:
        """Delete a conversation and its turns' records and events (usage counters stay)."""
        record = await gw.own_conversation(conversation_id, key)
        result = await gw.aclient.delete_conversation(record.id, tenant_id=key.tenant_id)
        if result.status == "not_found":
            raise not_found(f"conversation {conversation_id}")
        if result.status == "busy":
            raise ApiError(409, "busy", "a turn of the conversation runs or waits: cancel it first",
                           blocking=outside(key.tenant_id, list(result.blocking)))
        return {"deleted": conversation_id, "messages": result.messages, "turns": result.turns}


def _put_result(result: PutResult) -> dict[str, Any]:
    return {"agent_id": result.agent_id, "ref": result.ref, "created": result.created, "version": result.version}


def _agent_id(agent_id: str) -> str:
    if valid_id(agent_id) is None:
        raise not_found(f"agent {agent_id}")
    return agent_id


def _draft_id(draft: str | None) -> str | None:
    if draft is not None and valid_id(draft) is None:
        raise ApiError(422, "invalid_request", f"{draft!r} is not a draft id")
    return draft


def add_agent_routes(app: FastAPI, gw: Gateway) -> None:
    @app.get("/v1/agents", tags=["agents"])
    def list_agents(key: Caller) -> dict[str, Any]:
        """Every agent's id with its active and latest version (for any key: a console picks one)."""
        return {"agents": [{"agent_id": s.agent_id, "active": s.active, "latest": s.latest}
                           for s in gw.client.agents()]}

    @app.put("/v1/agents/{agent_id}", tags=["agents"])
    def put_agent(agent_id: str, body: Annotated[dict[str, Any], Body()], key: Admin,
                  draft: Draft = None) -> dict[str, Any]:
        """Register a config (the agent config document as JSON; its `id` is the path's): a new
        active version unless it is the active one, or a draft (`?draft=`) updated in place."""
        _agent_id(agent_id)
        if body.get("id", agent_id) != agent_id:
            raise ApiError(422, "invalid_request", "the config's id is not the path's agent id")
        config = parse_agent_config(json.dumps({**body, "id": agent_id}))
        return _put_result(gw.client.put_agent_result(config, draft_id=_draft_id(draft), author=f"api:{key.tenant_id}"))

    @app.get("/v1/agents/{agent_id}", tags=["agents"])
    def show_agent(agent_id: str, key: Admin, version: Version = None) -> dict[str, Any]:
        """A version's config (default: the active one)."""
        number = None if version is None else parse_version(version)
        found, config = gw.client.registry.config(_agent_id(agent_id), number)
        return {"agent_id": agent_id, "version": found, "config": config.model_dump(mode="json")}

    @app.get("/v1/agents/{agent_id}/versions", tags=["agents"])
    def agent_versions(agent_id: str, key: Admin) -> dict[str, Any]:
        """Every version (when, by whom, how), the active one, and every activation."""
        return gw.client.agent_versions(_agent_id(agent_id)).as_json()

    @app.post("/v1/agents/{agent_id}/publish", tags=["agents"])
    def publish_agent(agent_id: str, key: Admin, draft: Draft = None) -> dict[str, Any]:
        """The draft (`?draft=`, default: the agent's only one) becomes the next version, made active."""
        result = gw.client.publish_agent(_agent_id(agent_id), draft_id=_draft_id(draft), author=f"api:{key.tenant_id}")
        return _put_result(result)

