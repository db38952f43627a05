"""Which key layout a producer or a reading tool uses, and which shard a turn's keys are in.

The layout is what `Keys.layout` holds, not what this process's `TL_SHARDS` says: whoever connects
first writes it (SET NX) and everyone uses the stored count from then on, so a client started with
another `TL_SHARDS` still writes where the workers read. A producer writes the record only when its
own count is above 0; with the key missing and a count of 0 it uses one server's layout and writes
nothing (the workers write `{"shards": 0, ...}` when they start). Resolved once per client: the
default layout costs one GET per client, and nothing else.

A turn's shard is a function of its request (`request_shard`); a reader that knows only the turn id
finds it in the turn's `Keys.turn_shard` pointer, which the submitting client writes before
submit.lua (and the workers' admit stage for raw producers). No pointer: the turn is unknown.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Final

import redis
import redis.asyncio as aioredis

from threadline.pipeline.ids import new_conversation_id, valid_id
from threadline.workers.protocol.keys import TURN_SHARD_SLACK_S, Keys, layout_record, layout_shards
from threadline.workers.protocol.schema import text
from threadline.workers.settings import shards_from_env

#: Shards of turns a client submitted, remembered per client; the memo is emptied when it is full
#: (each entry is one GET away).
REMEMBERED_TURNS: Final = 10_000


def own_shards(shards: int | None) -> int:
    """A producer's own shard count: `shards`, else `TL_SHARDS` of this process's environment."""
    return shards_from_env() if shards is None else shards


def layout_claim(own: int) -> str | None:
    """What a producer of `own` shards writes (SET NX) when no layout is stored: None for 0."""
    return json.dumps(layout_record(own)) if own > 0 else None


def layout_keys(client: redis.Redis, prefix: str, own: int) -> Keys:
    """The layout's `Keys` (see the module's doc): one GET, and a SET NX when it is missing and `own`
    is above 0. A reading tool passes `own` 0: it never writes."""
    key = Keys(prefix).layout()
    raw = client.get(key)
    if raw is None and (claim := layout_claim(own)) is not None:
        if client.set(key, claim, nx=True):
            return Keys(prefix, own)
        raw = client.get(key)
    return Keys(prefix, layout_shards(raw))


async def async_layout_keys(client: aioredis.Redis, prefix: str, own: int) -> Keys:
    """`layout_keys` on `redis.asyncio`."""
    key = Keys(prefix).layout()
    raw = await client.get(key)
    if raw is None and (claim := layout_claim(own)) is not None:
        if await client.set(key, claim, nx=True):
            return Keys(prefix, own)
        raw = await client.get(key)
    return Keys(prefix, layout_shards(raw))


def request_shard(keys: Keys, conversation_id: str | None, turn_id: str | None) -> int | None:
    """The shard of a turn (None in one server's layout): its conversation's, or the one its first
    turn starts (`new_conversation_id`); a message that names neither goes to shard 0. The rule the
    admit stage checks (`runners/admit.py`): a conversation id that is no valid id counts as none
    (the turn is refused on the shard of the conversation its id would start)."""
    if not keys.shards:
        return None
    if conversation_id := valid_id(conversation_id):
        return keys.shard_of(conversation_id)
    return keys.shard_of(new_conversation_id(turn_id)) if turn_id else 0


def raw_ids(request: object, message_id: str) -> tuple[str | None, str]:
    """The conversation and turn ids a raw request names (a malformed one names none: its turn id is
    the message id, as the workers take it)."""
    if not isinstance(request, Mapping):
        return None, message_id
    cid, tid = request.get("conversation_id"), request.get("turn_id")
    return (cid if isinstance(cid, str) and cid else None), (tid if isinstance(tid, str) and tid else message_id)


def pointer_ttl_s(turn_ttl_s: int) -> int:
    """A shard pointer's TTL: the turn's (`TL_TURN_TTL_S`) and `TURN_SHARD_SLACK_S`, so a reader that
    comes late still finds where the turn's keys were, and reads them as gone rather than unknown."""
    return turn_ttl_s + TURN_SHARD_SLACK_S


class TurnShards:
    """The shards of the turns a client submitted (bounded)."""

    def __init__(self) -> None:
        self._known: dict[str, int] = {}

    def remember(self, turn_id: str, shard: int) -> None:
        if len(self._known) >= REMEMBERED_TURNS:
            self._known.clear()
        self._known[turn_id] = shard

    def get(self, turn_id: str) -> int | None:
        return self._known.get(turn_id)


def taken_elsewhere(prior: bytes | str | bool | None, shard: int) -> int | None:
    """The other shard a turn id's pointer named before a submit's SET NX GET (None: none, or
    `shard`): the id is a turn of another conversation, not enqueued again. (redis-py types the
    reply of SET with a bool; with GET it is the prior value.)"""
    if prior is None or isinstance(prior, bool):
        return None
    try:
        other = int(text(prior))
    except ValueError:
        return None
    return None if other == shard else other


#: How often a follower of a turn not known yet (no shard pointer) looks for its pointer again.
UNKNOWN_TURN_POLL_MS: Final = 200


def merged_page(pages: list[Any], offset: int, limit: int) -> list[str]:
    """One page of an index kept per shard (ZREVRANGE 0 offset+limit-1 WITHSCORES of each): the
    members by score, highest first, ties by member, as one sorted set would order them."""
    scored = [(float(score), text(member).encode()) for page in pages for member, score in page]
    scored.sort(reverse=True)
    return [text(member) for _, member in scored[offset:offset + limit]]
