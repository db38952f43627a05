"""Each tenant's turn and conversation ids in a namespace of its own, so that ids chosen by one
tenant can neither reveal nor block another's.

A turn id a tenant chooses (`order-1001`) is stored as `order-1001@<tag>`, the tag being 12 hex
digits of a hash of the tenant id; its conversation is `c-order-1001@<tag>`, its message the turn
id. Tenant A's `order-1001` and tenant B's are two turns: neither answers 409 or 404 because of the
other, and neither can be claimed ahead of the other. Every answer and event the gateway serves a
tenant has that tenant's tag taken out again, so the tenant only ever sees its own spelling.

Ids the gateway generates (a random UUID, when a request names no turn id) and ids of turns that
trusted producers (the Python client, the CLI, raw Redis) submitted into a tenant's conversation are
stored as they are: an id the caller names is looked up as its own tagged id first, then as such an
untagged id of its own tenant — never as another tenant's, which reads as a missing one.
"""

from __future__ import annotations

from typing import Any

from threadline.pipeline.contracts import new_conversation_id, valid_id, valid_turn_id
from threadline.pipeline.namespaces import TAG_CHARS, tenant_tag
from threadline.workers.clients.async_client import AsyncClient

#: A tenant's own turn ids are this much shorter than the stored ones (120): room for the tag.
MAX_TURN_ID = 120 - TAG_CHARS


def tag(tenant_id: str) -> str:
    """The suffix of the tenant's namespace (`pipeline/namespaces.py`: the webhooks take it out too)."""
    return tenant_tag(tenant_id)


def inside(tenant_id: str, external: str) -> str:
    """The stored id of the tenant's id `external`."""
    return external + tag(tenant_id)


def outside(tenant_id: str, value: Any) -> Any:
    """`value` (JSON-like) with the tenant's tag taken out of every string: what the tenant is shown."""
    suffix = tag(tenant_id)
    if isinstance(value, str):
        return value.replace(suffix, "")
    if isinstance(value, dict):
        return {outside(tenant_id, k): outside(tenant_id, v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [outside(tenant_id, v) for v in value]
    return value


def shown(tenant_id: str, answer: dict[str, Any]) -> dict[str, Any]:
    """An answer (a JSON object) as the tenant is shown it: `outside`."""
    return dict(outside(tenant_id, answer))


class Ids:
    """Maps a tenant's ids to the stored ones, looking up which of them exist and are its own."""

    def __init__(self, client: AsyncClient) -> None:
        self.client = client

    async def turn(self, tenant_id: str, external: str) -> str | None:
        """The stored id of the tenant's turn `external`, or None when the tenant has no such turn."""
        for candidate in (inside(tenant_id, external), external):
            if valid_turn_id(candidate) and await self.client.owner(candidate) == tenant_id:
                return candidate
        return None

    async def new_turn(self, tenant_id: str, external: str) -> str:
        """The id a tenant's turn `external` is submitted under: its own turn's when it has one (the
        same turn again: idempotent), else the tagged id."""
        return await self.turn(tenant_id, external) or inside(tenant_id, external)

    async def conversation(self, tenant_id: str, external: str) -> str:
        """The stored id of the tenant's conversation `external`: the tagged one, or an untagged one
        of its own (existing, or the one its own untagged first turn is about to start); else the
        tagged id, which names nothing of anyone else's."""
        tagged = inside(tenant_id, external)
        for candidate in (tagged, external):
            record = await self.client.conversation(candidate) if valid_id(candidate) else None
            if record is not None and record.tenant_id == tenant_id:
                return candidate
        first = external.removeprefix("c-")
        if first != external and await self.turn(tenant_id, first) == first and new_conversation_id(first) == external:
            return external
        return tagged

    async def message(self, conversation_id: str, tenant_id: str, external: str) -> str:
        """The stored id of the message `external` of the (stored) conversation: tagged, or as it is."""
        tagged = inside(tenant_id, external)
        messages = (await self.client.layout()).messages(conversation_id)
        if valid_id(tagged) and await self.client.redis.hexists(messages, tagged):
            return tagged
        if await self.client.redis.hexists(messages, external):
            return external
        return tagged
