"""`/v1/users/{user_id}/memory`: a user's long-term memory over HTTP — list it, read a record,
correct it, forget a record or everything (`AsyncClient.memory`, `set_memory`, `forget_memory`).

The tenant is the API key's (never the body's): another tenant's user of the same id is another
user, whose records are not found. A user-scoped key acts on its own user only: another user's
memory is a 404 like a missing record. A tenant key's edits are recorded as the user's (the app
relays them), an admin key's as an operator's. Ids in provenance are shown as the tenant spells them.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Body, Depends, FastAPI, Query, Request
from pydantic import BaseModel, ConfigDict, Field

from threadline.pipeline.contracts import Id
from threadline.workers.clients.async_client import AsyncClient
from threadline.workers.clients.common import MemoryNotFound, memory_view
from threadline.workers.gateway.auth import caller
from threadline.workers.gateway.middleware import remember
from threadline.workers.gateway.refusals import Refused, not_found
from threadline.workers.gateway.tenancy import shown
from threadline.workers.storage.api_keys import ApiKey

#: A value or note as the API takes it (the edit itself refuses one past `MemoryLimits.max_value_chars`: 422).
MAX_BODY_VALUE = 20_000
AppId = Annotated[Id | None, Query(description="the app's partition (default: the user's own)")]
AgentId = Annotated[Id | None, Query(description="the agent's partition (default: the user's own)")]


async def _caller(request: Request, key: Annotated[ApiKey, Depends(caller)]) -> ApiKey:
    return remember(request, key)  # noted for the access log, as app.py's callers are


# not app.py's `Caller`: app.py imports this module (no import circle)
Caller = Annotated[ApiKey, Depends(_caller)]


class MemorySet(BaseModel):
    """`{"key": K, "value": V}` sets a fact; `{"note": TEXT}` adds a note."""

    model_config = ConfigDict(extra="forbid")
    key: str | None = Field(default=None, min_length=1, max_length=256)
    value: str | None = Field(default=None, max_length=MAX_BODY_VALUE)
    note: str | None = Field(default=None, max_length=MAX_BODY_VALUE)


class MemoryCorrection(BaseModel):
    model_config = ConfigDict(extra="forbid")
    value: str = Field(max_length=MAX_BODY_VALUE)


def _user(key: ApiKey, user_id: str, what: str) -> str:
    """The path's user, when the key may act on them; a user-scoped key's other user reads as `what` missing."""
    if key.user_id is not None and key.user_id != user_id:
        raise not_found(what)
    return user_id


def _origin(key: ApiKey) -> str:
    return "operator" if key.admin else "user"


def _answer(key: ApiKey, record: Any) -> dict[str, Any]:
    return shown(key.tenant_id, {"record": memory_view(record)})


def add_memory_routes(app: FastAPI, client: AsyncClient) -> None:

    @app.get("/v1/users/{user_id}/memory", tags=["memory"])
    async def list_memory(user_id: str, key: Caller, history: bool = False, app_id: AppId = None,
                          agent_id: AgentId = None) -> dict[str, Any]:
        """The user's current records (`?history=true`: the closed versions too, after them)."""
        _user(key, user_id, f"memory of user {user_id}")
        records = await client.memory(key.tenant_id, user_id, app_id=app_id, agent_id=agent_id, history=history)
        return shown(key.tenant_id, {"user_id": user_id, "records": [memory_view(r) for r in records]})

    @app.get("/v1/users/{user_id}/memory/{record_id}", tags=["memory"])
    async def get_memory(user_id: str, record_id: str, key: Caller, app_id: AppId = None,
                         agent_id: AgentId = None) -> dict[str, Any]:
        """One record, current or closed, with its provenance (origin, conversation, message, turn,
        extractor, valid_at, invalid_at, superseded_by)."""
        _user(key, user_id, f"memory record {record_id}")
        try:
            record = await client.memory_record(key.tenant_id, user_id, record_id, app_id=app_id, agent_id=agent_id)
        except MemoryNotFound:
            raise not_found(f"memory record {record_id}") from None
        return _answer(key, record)

    @app.put("/v1/users/{user_id}/memory", tags=["memory"])
    async def set_memory(user_id: str, key: Caller, body: Annotated[MemorySet, Body()], app_id: AppId = None,
                         agent_id: AgentId = None) -> dict[str, Any]:
        """Set a fact (`{"key", "value"}`: its old value is closed, kept in the history) or add a
        note (`{"note"}`); the current record."""
        _user(key, user_id, f"memory of user {user_id}")
        if body.key is not None and body.value is not None and body.note is None:
            value, fact = body.value, body.key
        elif body.note is not None and body.key is None and body.value is None:
            value, fact = body.note, None
        else:
            raise Refused(422, "invalid_request", 'the body is {"key": K, "value": V} or {"note": TEXT}')
        record = await client.set_memory(key.tenant_id, user_id, value=value, key=fact, note=fact is None,
                                         origin=_origin(key), app_id=app_id, agent_id=agent_id)
        return _answer(key, record)

    @app.put("/v1/users/{user_id}/memory/{record_id}", tags=["memory"])
    async def correct_memory(user_id: str, record_id: str, key: Caller, body: Annotated[MemoryCorrection, Body()],
                             app_id: AppId = None, agent_id: AgentId = None) -> dict[str, Any]:
        """Correct a current record (fact or note): a new version, the old one closed; the new record."""
        _user(key, user_id, f"memory record {record_id}")
        try:
            record = await client.set_memory(key.tenant_id, user_id, value=body.value, record_id=record_id,
                                             origin=_origin(key), app_id=app_id, agent_id=agent_id)
        except MemoryNotFound:
            raise not_found(f"memory record {record_id}") from None
        return _answer(key, record)

    @app.delete("/v1/users/{user_id}/memory/{record_id}", tags=["memory"])
    async def forget_record(user_id: str, record_id: str, key: Caller, app_id: AppId = None,
                            agent_id: AgentId = None) -> dict[str, Any]:
        """Erase a record and every version of it (for a fact: every version of its key)."""
        _user(key, user_id, f"memory record {record_id}")
        forgotten = await client.forget_memory(key.tenant_id, user_id, record_id=record_id, app_id=app_id,
                                               agent_id=agent_id)
        if forgotten == 0:
            raise not_found(f"memory record {record_id}")
        return {"user_id": user_id, "forgotten": forgotten}

    @app.delete("/v1/users/{user_id}/memory", tags=["memory"])
    async def forget_user(user_id: str, key: Caller) -> dict[str, Any]:
        """Erase everything stored about the user, in every partition (the user's, its apps', its agents')."""
        _user(key, user_id, f"memory of user {user_id}")
        await client.forget_memory(key.tenant_id, user_id, all=True)
        return {"user_id": user_id, "forgotten": "all"}
