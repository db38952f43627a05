"""The gateway's API keys and their lifecycle, stored only as their sha256 (`Keys.api_keys`).

A key names its tenant (the gateway takes the tenant from the key, never from a request's body),
its role (`tenant`, or `admin`: may also write agent configs and manage keys) and optionally one
user it may act as. A record has a short public id (`keys list`, `keys revoke ID`), a name, when it
was made, when it expires, when it was revoked, and its own rate limits (None: the settings'
defaults), and optionally a webhook URL for its turns. Rotation makes a key with the same name,
tenant, role, user, limits and webhook URL and lets the old one live on until a grace period ends,
so clients can move. Records are never deleted: a revoked
or expired key stays listed (and refused). Sync (`redis.Redis`) for the CLI, async for the gateway.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
import time
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from typing import Any, Literal

import redis

from threadline.pipeline.contracts import valid_id
from threadline.pipeline.errors import InvalidRequest
from threadline.pipeline.webhooks import webhook_url_problem
from threadline.workers.protocol.keys import Keys

#: Every key starts with it, so a leaked one is easy to find in logs and scanners.
KEY_PREFIX = "tlk_"
Role = Literal["tenant", "admin"]
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhdw])$")
_UNITS = {"s": 1, "m": 60, "h": 3_600, "d": 86_400, "w": 604_800}
_KEY_ID = re.compile(r"^k[0-9a-f]{12}$")


@dataclass(frozen=True, slots=True)
class Limits:
    """A key's own rate limits; None: the gateway's default (`TL_KEY_*`), 0: no limit."""

    rps: int | None = None
    turns_per_min: int | None = None
    streams: int | None = None


@dataclass(frozen=True, slots=True)
class ApiKey:
    tenant_id: str
    admin: bool = False
    id: str = ""
    name: str = ""
    user_id: str | None = None
    created_at: float = 0.0
    expires_at: float | None = None
    revoked_at: float | None = None
    limits: Limits = field(default_factory=Limits)
    #: Where the terminal event of the key's turns is POSTed when a turn names no `webhook_url`
    #: (before its agent's: docs/webhooks.md).
    webhook_url: str | None = None

    @property
    def role(self) -> Role:
        return "admin" if self.admin else "tenant"

    def live(self, now: float) -> bool:
        """Neither revoked nor expired at `now` (unix s)."""
        return self.revoked_at is None and (self.expires_at is None or now < self.expires_at)

    def status(self, now: float) -> str:
        if self.revoked_at is not None:
            return "revoked"
        return "live" if self.live(now) else "expired"

    def record(self) -> dict[str, Any]:
        """The stored record (JSON), also what `keys list --json` shows with `last_used_at`."""
        return {"id": self.id, "name": self.name, "tenant_id": self.tenant_id, "role": self.role,
                "admin": self.admin, "user_id": self.user_id, "created_at": self.created_at,
                "expires_at": self.expires_at, "revoked_at": self.revoked_at, "limits": asdict(self.limits),
                "webhook_url": self.webhook_url}


def key_digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def legacy_id(digest: str) -> str:
    """The id of a key stored before keys had one: derived from its digest (stable, public)."""
    return f"k{digest[:12]}"


def parse_key(stored: bytes | str | None, digest: str = "") -> ApiKey | None:
    """A stored key record; None for none (an unknown key)."""
    if stored is None:
        return None
    record = json.loads(stored)
    limits = record.get("limits") or {}
    return ApiKey(tenant_id=str(record["tenant_id"]), admin=bool(record.get("admin")),
                  id=str(record.get("id") or legacy_id(digest)), name=str(record.get("name") or ""),
                  user_id=record.get("user_id") or None, created_at=float(record.get("created_at") or 0),
                  expires_at=_opt_float(record.get("expires_at")), revoked_at=_opt_float(record.get("revoked_at")),
                  limits=Limits(**{k: limits.get(k) for k in ("rps", "turns_per_min", "streams")}),
                  webhook_url=record.get("webhook_url") or None)


def _opt_float(value: Any) -> float | None:
    return None if value is None else float(value)


def parse_expiry(value: str, now: float) -> float:
    """`--expires`: a duration from now (`90m`, `24h`, `30d`, `2w`, `45s`) or an ISO 8601 date or
    time (UTC when it names no zone); unix seconds. A time already past is refused."""
    match = _DURATION.match(value.strip())
    if match:
        return now + float(match.group(1)) * _UNITS[match.group(2)]
    try:
        when = datetime.fromisoformat(value.strip())
    except ValueError:
        raise InvalidRequest(f"{value!r} is neither a duration (30d, 24h, 90m) nor an ISO 8601 time") from None
    stamp = (when if when.tzinfo else when.replace(tzinfo=UTC)).timestamp()
    if stamp <= now:
        raise InvalidRequest(f"{value!r} is in the past")
    return stamp


def parse_duration(value: str) -> float:
    """`--grace`: a duration (`0s`, `24h`, `7d`), in seconds."""
    match = _DURATION.match(value.strip())
    if match is None:
        raise InvalidRequest(f"{value!r} is not a duration (0s, 90m, 24h, 7d)")
    return float(match.group(1)) * _UNITS[match.group(2)]


def new_key(tenant_id: str, *, admin: bool = False, name: str = "", user_id: str | None = None,
            expires_at: float | None = None, limits: Limits | None = None, now: float | None = None,
            webhook_url: str | None = None) -> tuple[str, ApiKey]:
    """A new random key and its record (nothing stored yet); the key is shown once."""
    if valid_id(tenant_id) is None:
        raise InvalidRequest(f"{tenant_id!r} is not a tenant id")
    if user_id is not None and valid_id(user_id) is None:
        raise InvalidRequest(f"{user_id!r} is not a user id")
    if len(name) > 200:
        raise InvalidRequest("a key's name is at most 200 characters")
    for value in asdict(limits or Limits()).values():
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            raise InvalidRequest("a key's limits are integers >= 0 (0: no limit)")
    if webhook_url is not None and (problem := webhook_url_problem(webhook_url)) is not None:
        raise InvalidRequest(f"webhook_url: {problem}")
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    record = ApiKey(tenant_id=tenant_id, admin=admin, id=f"k{secrets.token_hex(6)}", name=name, user_id=user_id,
                    created_at=time.time() if now is None else now, expires_at=expires_at,
                    limits=limits or Limits(), webhook_url=webhook_url)
    return key, record


class KeyRing:
    """Key records on the sync client: the CLI's verbs and the admin endpoints (run in a thread)."""

    def __init__(self, client: redis.Redis, keys: Keys) -> None:
        self.redis = client
        self.keys = keys

    def create(self, tenant_id: str, **options: Any) -> tuple[str, ApiKey]:
        key, record = new_key(tenant_id, **options)
        self._store(key_digest(key), record)
        return key, record

    def _store(self, digest: str, record: ApiKey, *also: tuple[str, ApiKey]) -> None:
        """Write records, then their id index (in that order, so an id never points at nothing; the
        two hashes may be on two nodes of a cluster, so no MULTI)."""
        with self.redis.pipeline(transaction=False) as pipe:
            for d, r in ((digest, record), *also):
                pipe.hset(self.keys.api_keys(), d, json.dumps(r.record()))
            for d, r in ((digest, record), *also):
                pipe.hset(self.keys.api_key_ids(), r.id, d)
            pipe.execute()

    def find(self, key_id: str) -> tuple[str, ApiKey] | None:
        """(digest, record) of the key with this id; None when there is none."""
        if not _KEY_ID.match(key_id):
            return None
        digest = self.redis.hget(self.keys.api_key_ids(), key_id)
        if digest is None:  # a key made before keys had ids: its id is its digest's head
            digest = next((d for d, _ in self._scan() if legacy_id(d) == key_id), None)
        if digest is None:
            return None
        found = parse_key(self.redis.hget(self.keys.api_keys(), digest), _text(digest))
        return None if found is None else (_text(digest), found)

    def _scan(self) -> list[tuple[str, bytes]]:
        return [(_text(d), v) for d, v in self.redis.hscan_iter(self.keys.api_keys(), count=500)]

    def list(self, tenant_id: str | None = None) -> list[tuple[ApiKey, float | None]]:
        """Every key record (of one tenant) with when it was last used, the oldest first."""
        used = {_text(k): float(v) for k, v in self.redis.hgetall(self.keys.api_key_used()).items()}
        found = [parse_key(v, d) for d, v in self._scan()]
        keys = sorted((k for k in found if k is not None and tenant_id in (None, k.tenant_id)),
                      key=lambda k: (k.created_at, k.id))
        return [(k, used.get(k.id)) for k in keys]

    def revoke(self, key_id: str, now: float | None = None) -> ApiKey | None:
        """Revoke a key (refused by every gateway within a second); None when there is no such key.
        Revoking a revoked key changes nothing."""
        found = self.find(key_id)
        if found is None:
            return None
        digest, record = found
        if record.revoked_at is None:
            record = replace(record, revoked_at=time.time() if now is None else now)
            self._store(digest, record)
        return record

    def rotate(self, key_id: str, *, grace_s: float, expires_at: float | None = None,
               now: float | None = None) -> tuple[str, ApiKey, ApiKey] | None:
        """A new key like `key_id`'s (name, tenant, role, user, limits; by default the same lifetime
        from now), the old one live for `grace_s` more (or until its own expiry, if sooner).
        (new key, its record, the old record); None when there is no such live key."""
        found = self.find(key_id)
        now = time.time() if now is None else now
        if found is None or not found[1].live(now):
            return None
        digest, old = found
        if expires_at is None and old.expires_at is not None:
            expires_at = now + max(0.0, old.expires_at - old.created_at)
        key, record = new_key(old.tenant_id, admin=old.admin, name=old.name, user_id=old.user_id,
                              expires_at=expires_at, limits=old.limits, now=now, webhook_url=old.webhook_url)
        ends = now + grace_s if old.expires_at is None else min(old.expires_at, now + grace_s)
        old = replace(old, expires_at=ends)
        self._store(key_digest(key), record, (digest, old))
        return key, record, old


def create_key(client: redis.Redis, keys: Keys, tenant_id: str, *, admin: bool = False) -> str:
    """A new random key for `tenant_id` (no name, no expiry, the default limits); shown once."""
    return KeyRing(client, keys).create(tenant_id, admin=admin)[0]


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
