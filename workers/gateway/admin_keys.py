"""`/v1/admin/keys`: the API keys' lifecycle over HTTP, for admin keys only — what `threadline keys
create/list/revoke/rotate` do (`storage/api_keys.py`). A key is in an answer only when it was just
made (shown once); listings show records (id, name, tenant, role, user, times, limits), never keys.
Admin keys are the operator's (like agents, which every tenant shares): they manage every tenant's keys."""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from fastapi import Body, FastAPI, Query
from pydantic import BaseModel, Field

from threadline.pipeline.contracts import Id
from threadline.pipeline.webhooks import WebhookUrl
from threadline.workers.gateway.auth import Admin
from threadline.workers.gateway.refusals import Refused, not_found
from threadline.workers.storage.api_keys import ApiKey, KeyRing, Limits, parse_duration, parse_expiry


class LimitsBody(BaseModel):
    rps: int | None = Field(default=None, ge=0, le=1_000_000)
    turns_per_min: int | None = Field(default=None, ge=0, le=1_000_000)
    streams: int | None = Field(default=None, ge=0, le=1_000_000)


class NewKey(BaseModel):
    tenant_id: Id
    name: str = Field(default="", max_length=200)
    role: Literal["tenant", "admin"] = "tenant"
    user_id: Id | None = None
    #: A duration from now (`30d`, `24h`) or an ISO 8601 time; none: the key does not expire.
    expires: str | None = Field(default=None, max_length=64)
    limits: LimitsBody = Field(default_factory=LimitsBody)
    #: POSTed the terminal event of the key's turns that name no `webhook_url` (docs/webhooks.md).
    webhook_url: WebhookUrl | None = None


class Rotation(BaseModel):
    #: How long the old key stays live (`0s`: not at all).
    grace: str = Field(default="24h", max_length=64)
    expires: str | None = Field(default=None, max_length=64)


def shown(key: ApiKey, last_used_at: float | None = None) -> dict[str, Any]:
    """A key record as listed: never the key, never its digest."""
    return {**key.record(), "status": key.status(time.time()), "last_used_at": last_used_at}


def add_key_routes(app: FastAPI, ring: KeyRing) -> None:
    @app.get("/v1/admin/keys", tags=["admin"])
    def list_keys(key: Admin, tenant: Annotated[Id | None, Query()] = None) -> dict[str, Any]:
        """Every API key's record (of one tenant with `?tenant=`), the oldest first; never a key."""
        return {"keys": [shown(k, used) for k, used in ring.list(tenant)]}

    @app.post("/v1/admin/keys", status_code=201, tags=["admin"])
    def create_key(key: Admin, body: Annotated[NewKey, Body()]) -> dict[str, Any]:
        """A new key: `key` is in this answer only (only its sha256 is stored)."""
        expires_at = None if body.expires is None else parse_expiry(body.expires, time.time())
        secret, record = ring.create(body.tenant_id, admin=body.role == "admin", name=body.name,
                                     user_id=body.user_id, expires_at=expires_at,
                                     limits=Limits(**body.limits.model_dump()), webhook_url=body.webhook_url)
        return {"key": secret, "record": shown(record)}

    @app.delete("/v1/admin/keys/{key_id}", tags=["admin"])
    def revoke_key(key_id: str, key: Admin) -> dict[str, Any]:
        """Revoke a key: every gateway refuses it within a second."""
        record = ring.revoke(key_id)
        if record is None:
            raise not_found(f"key {key_id}")
        return {"record": shown(record)}

    @app.post("/v1/admin/keys/{key_id}/rotate", status_code=201, tags=["admin"])
    def rotate_key(key_id: str, key: Admin, body: Annotated[Rotation | None, Body()] = None) -> dict[str, Any]:
        """A new key like this one (name, tenant, role, user, limits); the old one stays live for
        `grace` (default 24h) or until it expires or is revoked."""
        rotation = body or Rotation()
        grace_s = parse_duration(rotation.grace)
        expires_at = None if rotation.expires is None else parse_expiry(rotation.expires, time.time())
        rotated = ring.rotate(key_id, grace_s=grace_s, expires_at=expires_at)
        if rotated is None:
            found = ring.find(key_id)
            if found is None:
                raise not_found(f"key {key_id}")
            raise Refused(409, "key_not_live", f"key {key_id} is {found[1].status(time.time())}: nothing to rotate")
        secret, record, old = rotated
        return {"key": secret, "record": shown(record), "previous": shown(old)}
