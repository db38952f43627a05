"""Who is calling: the gateway's caller dependency (`Caller`, `TurnCaller`, `Admin`).

`Authorization: Bearer <key>` is parsed, looked up by its sha256 (`storage/api_keys.py`), and refused
(401 `unauthorized`) when it is unknown, revoked or expired. Records are cached in the process for
at most `KEY_CACHE_S`, so a revocation reaches every gateway process within a second and an expiry
applies at once (it is checked against the clock on every request, cached or not). Failed
authentications are counted per client address (`request.client`: run uvicorn with
`--forwarded-allow-ips` behind a proxy) and answered 429 once the address has none left. Every
authenticated request is then counted against the key's rate limits (`ratelimit.py`), and its
`last_used_at` written at most once a minute per key and process.

A user-scoped key (`keys create T --user U`) acts only as U: a turn naming another `user_id` is
403 `forbidden`; another user's turns and conversations read as missing ones (404).
"""

from __future__ import annotations

import time
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from threadline.pipeline.contracts import TurnRequest, new_conversation_id
from threadline.pipeline.records import ConversationRecord
from threadline.workers.clients.async_client import AsyncClient
from threadline.workers.gateway.ratelimit import Limiter
from threadline.workers.gateway.refusals import Refused, forbidden, not_found, unauthorized
from threadline.workers.protocol.schema import text
from threadline.workers.settings import Settings
from threadline.workers.storage.api_keys import ApiKey, key_digest, parse_key

#: How long a looked-up key record is trusted in the process: a revocation's delay at most.
KEY_CACHE_S = 0.5
#: `last_used_at` is written at most this often per key (and process).
USED_EVERY_S = 60.0
#: Cached records per process; the cache is emptied when it is full (records are one HGET away).
CACHE_SIZE = 10_000


class Authenticator:
    def __init__(self, settings: Settings, client: AsyncClient, limiter: Limiter) -> None:
        self.settings = settings
        #: The gateway's client: its connections, its key layout and the shards of turns (`layout.py`).
        self.client = client
        self.redis = client.redis
        self.limiter = limiter
        self._cache: dict[str, tuple[float, ApiKey]] = {}
        self._used: dict[str, float] = {}

    async def authenticate(self, request: Request, credentials: HTTPAuthorizationCredentials | None, *,
                           turn: bool = False) -> ApiKey:
        """The caller's key, live and within its limits (`turn`: the request starts a turn)."""
        if credentials is None:
            raise unauthorized("an API key is required: Authorization: Bearer <key>")
        address = request.client.host if request.client else "-"
        key = await self._lookup(key_digest(credentials.credentials), address)
        if key is None or not key.live(time.time()):
            await self.limiter.failed_auth(address)
            state = "unknown" if key is None else key.status(time.time())
            raise unauthorized("unknown API key" if key is None else f"the API key is {state}")
        await self.limiter.request(key, turn=turn)
        await self._touch(key)
        return key

    async def _lookup(self, digest: str, address: str) -> ApiKey | None:
        now = time.monotonic()
        cached = self._cache.get(digest)
        if cached is not None and now - cached[0] < KEY_CACHE_S:
            return cached[1]
        await self.limiter.check_address(address)  # a throttled address learns nothing of its guesses
        keys = await self.client.layout()
        key = parse_key(await self.redis.hget(keys.api_keys(), digest), digest)
        if key is not None:  # unknown keys are not cached: one made a moment ago works at once
            if len(self._cache) >= CACHE_SIZE:
                self._cache.clear()
            self._cache[digest] = (now, key)
        return key

    async def _touch(self, key: ApiKey) -> None:
        now = time.monotonic()
        if now - self._used.get(key.id, -USED_EVERY_S) >= USED_EVERY_S:
            self._used[key.id] = now
            await self.redis.hset((await self.client.layout()).api_key_used(), key.id, f"{time.time():.3f}")

    # --- user scope ---------------------------------------------------------------------------

    async def before_turn(self, key: ApiKey, checked: TurnRequest, conversation: ConversationRecord | None) -> None:
        """A user-scoped key's turn: its own user only, in its own user's conversation; its user is
        recorded with the turn id, so the key reads the turn before a worker admitted it."""
        if key.user_id is None:
            return
        if checked.user_id != key.user_id:
            raise forbidden("user_id is not the API key's user")
        if conversation is not None and conversation.user_id != key.user_id:
            raise not_found(f"conversation {conversation.id}")
        # the marker is in the turn's shard: the one its request names (`layout.request_shard`)
        layout = await self.client.layout()
        keys = layout.of_conversation(checked.conversation_id or new_conversation_id(checked.turn_id))
        marker = keys.turn_user(checked.turn_id)
        ttl = self.settings.artifact_ttl_s + self.settings.turn_ttl_s
        claimed = await self.redis.set(marker, key.user_id, nx=True, ex=ttl)
        if not claimed and text(await self.redis.get(marker) or b"") != key.user_id:
            raise Refused(409, "turn_id_taken", f"turn_id {checked.turn_id} is taken")

    async def sees_turn(self, key: ApiKey, turn_id: str) -> bool:
        """Whether the key may read the turn (already known to be its tenant's): the user it was
        submitted as by a user-scoped key, else its conversation's (none yet: not this key's)."""
        if key.user_id is None:
            return True
        keys = await self.client.turn_keys(turn_id)
        if keys is None:  # no shard pointer: no such turn
            return False
        marker = await self.redis.get(keys.turn_user(turn_id))
        if marker is not None:
            return text(marker) == key.user_id
        conversation_id = await self.redis.hget(keys.turn(turn_id), "conversation_id")
        if not conversation_id:
            return False
        user = await self.redis.hget(keys.conversation(text(conversation_id)), "user_id")
        return user is not None and text(user) == key.user_id

    @staticmethod
    def sees_conversation(key: ApiKey, record: ConversationRecord) -> bool:
        return key.user_id is None or record.user_id == key.user_id


BEARER = HTTPBearer(auto_error=False, description="an API key made with `threadline keys create TENANT`")


def _auth(request: Request) -> Authenticator:
    auth: Authenticator = request.app.state.gateway.auth
    return auth


async def caller(request: Request,
                 credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(BEARER)]) -> ApiKey:
    return await _auth(request).authenticate(request, credentials)


async def turn_caller(request: Request,
                      credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(BEARER)]) -> ApiKey:
    """A caller starting a turn: also counted against its turns per minute."""
    return await _auth(request).authenticate(request, credentials, turn=True)


async def admin(key: Annotated[ApiKey, Depends(caller)]) -> ApiKey:
    if not key.admin:
        raise forbidden("this needs an admin key (`keys create T --admin`)")
    return key


Caller = Annotated[ApiKey, Depends(caller)]
TurnCaller = Annotated[ApiKey, Depends(turn_caller)]
Admin = Annotated[ApiKey, Depends(admin)]
