"""Fleet-wide `max_concurrency` slots of an agent's model calls (leases in a sorted set)."""

from __future__ import annotations

from threadline.workers.storage import lua
from threadline.workers.storage.base import StoreBase


class SlotStore(StoreBase):
    async def acquire_slot(self, agent_id: str, token: str, *, limit: int) -> bool:
        """Take one of the agent's model slots for `token` (a lease of `TL_INVOKE_LEASE_S`), if one
        is free; holders whose lease ran out are dropped first."""
        reply = await self._run("slot_acquire", [self.keys.model_limit(agent_id)],
                                lua.payload(token=token, limit=limit,
                                            lease_ms=int(self.settings.invoke_lease_s * 1000)))
        return int(reply[0]) == 1

    async def renew_slot(self, agent_id: str, token: str) -> bool:
        """Extend a held slot's lease; False when `token` holds none any more."""
        reply = await self._run("slot_renew", [self.keys.model_limit(agent_id)],
                                lua.payload(token=token, lease_ms=int(self.settings.invoke_lease_s * 1000)))
        return int(reply) == 1

    async def release_slot(self, agent_id: str, token: str) -> None:
        await self._run("slot_release", [self.keys.model_limit(agent_id)], token)
