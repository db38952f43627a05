"""Every Redis key and channel Threadline uses, built here and nowhere else.

Keys of one conversation share the Redis Cluster hash tag `{<conversation_id>}` so that
conversation state can move to a cluster; turn-scoped keys are addressed by turn id.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Keys:
    prefix: str = "tl"

    # --- agent configs ------------------------------------------------------------------------
    def agent(self, agent_id: str) -> str:
        """Hash: `active` (published version number), `latest`."""
        return f"{self.prefix}:agent:{agent_id}"

    def agent_version(self, agent_id: str, version: int | str) -> str:
        """String: one immutable published config (JSON)."""
        return f"{self.prefix}:agent:{agent_id}:v:{version}"

    def agent_draft(self, agent_id: str, draft_id: str) -> str:
        """String: a draft config (JSON), updated in place."""
        return f"{self.prefix}:agent:{agent_id}:draft:{draft_id}"

    def agents(self) -> str:
        """Set of registered agent ids."""
        return f"{self.prefix}:agents"

    # --- conversations ------------------------------------------------------------------------
    def conversation(self, conversation_id: str) -> str:
        """Hash: scope, config_ref, layers, revision, tip, pending tool calls."""
        return f"{self.prefix}:conv:{{{conversation_id}}}"

    def messages(self, conversation_id: str) -> str:
        """Hash: message id -> message row (JSON)."""
        return f"{self.prefix}:conv:{{{conversation_id}}}:msgs"

    def message_order(self, conversation_id: str) -> str:
        """Sorted set: message id scored by creation order."""
        return f"{self.prefix}:conv:{{{conversation_id}}}:order"

    def snapshots(self, conversation_id: str) -> str:
        """Hash: message id -> the pydantic-ai messages that turn added (JSON)."""
        return f"{self.prefix}:conv:{{{conversation_id}}}:snaps"

    def turn_queue(self, conversation_id: str) -> str:
        """Sorted set: turns of this conversation, by submission time; the head runs."""
        return f"{self.prefix}:conv:{{{conversation_id}}}:turns"

    def lease(self, conversation_id: str) -> str:
        """Hash: `turn` (who runs now), `fence` (grows with every new holder)."""
        return f"{self.prefix}:conv:{{{conversation_id}}}:lease"

    # --- turns --------------------------------------------------------------------------------
    def turn(self, turn_id: str) -> str:
        """Hash: status, stage markers, attempt, conversation, fence, deadline."""
        return f"{self.prefix}:turn:{turn_id}"

    def events(self, turn_id: str) -> str:
        """Stream: the turn's events, one field `json` per entry."""
        return f"{self.prefix}:turn:{turn_id}:events"

    def artifact(self, turn_id: str, name: str) -> str:
        return f"{self.prefix}:turn:{turn_id}:art:{name}"

    def cancel_flag(self, turn_id: str) -> str:
        return f"{self.prefix}:turn:{turn_id}:cancel"

    def invoke_claim(self, turn_id: str) -> str:
        return f"{self.prefix}:turn:{turn_id}:claim"

    def running(self) -> str:
        """Sorted set: turns between admission and their end, scored by their last progress."""
        return f"{self.prefix}:running"

    def usage(self, tenant_id: str) -> str:
        """Hash: token and request counters per tenant, each turn counted once."""
        return f"{self.prefix}:usage:{tenant_id}"

    # --- channels -----------------------------------------------------------------------------
    def cancel_channel(self) -> str:
        return f"{self.prefix}:cancel"

    def doorbell_channel(self) -> str:
        return f"{self.prefix}:doorbell"
