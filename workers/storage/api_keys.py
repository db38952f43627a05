"""The gateway's API keys: one per tenant or more, stored only as their sha256 (`Keys.api_keys`).

A key names its tenant: the gateway takes the tenant from the key, never from a request's body.
An `admin` key may also write agent configs (agents are shared by every tenant)."""

from __future__ import annotations

import hashlib
import json
import secrets
import time
from dataclasses import dataclass

import redis

from threadline.pipeline.contracts import valid_id
from threadline.pipeline.errors import InvalidRequest
from threadline.workers.protocol.keys import Keys

#: Every key starts with it, so a leaked one is easy to find in logs and scanners.
KEY_PREFIX = "tlk_"


@dataclass(frozen=True, slots=True)
class ApiKey:
    tenant_id: str
    admin: bool = False


def key_digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def create_key(client: redis.Redis, keys: Keys, tenant_id: str, *, admin: bool = False) -> str:
    """A new random key for `tenant_id`; only its digest is stored, so it is shown once."""
    if valid_id(tenant_id) is None:
        raise InvalidRequest(f"{tenant_id!r} is not a tenant id")
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    record = {"tenant_id": tenant_id, "admin": admin, "created_at": time.time()}
    client.hset(keys.api_keys(), key_digest(key), json.dumps(record))
    return key


def parse_key(stored: bytes | str | None) -> ApiKey | None:
    """A stored key record; None for none (an unknown key)."""
    if stored is None:
        return None
    record = json.loads(stored)
    return ApiKey(tenant_id=str(record["tenant_id"]), admin=bool(record.get("admin")))
