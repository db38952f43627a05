"""Which agents are registered, and each one's active and latest version and drafts: the registry's
index, read without its config models (no pydantic), so `threadline agents list` starts fast
(`bench/cli.py`). The versions themselves, drafts and their writes are `agents.py`'s."""

from __future__ import annotations

from dataclasses import dataclass

import redis

from threadline.workers.protocol.keys import Keys
from threadline.workers.protocol.schema import text


@dataclass(frozen=True, slots=True)
class AgentSummary:
    agent_id: str
    active: int | None
    latest: int | None
    drafts: tuple[str, ...] = ()


def agent_summaries(client: redis.Redis, keys: Keys) -> list[AgentSummary]:
    """Every registered agent with its active and latest version and its drafts, by id."""
    ids = sorted(text(i) for i in client.smembers(keys.agents()))
    return [agent_summary(client, keys, agent_id) for agent_id in ids]


def agent_summary(client: redis.Redis, keys: Keys, agent_id: str) -> AgentSummary:
    active, latest = client.hmget(keys.agent(agent_id), ["active", "latest"])
    drafts = tuple(sorted(text(d) for d in client.smembers(keys.agent_drafts(agent_id))))
    return AgentSummary(agent_id, version_number(active), version_number(latest), drafts)


def version_number(value: bytes | str | None) -> int | None:
    return None if value is None else int(text(value))


def version_ref(version: int | None) -> str:
    """A version as the terminal shows it: `v3`, or `-` for none."""
    return "-" if version is None else f"v{version}"


def render_agents(summaries: list[AgentSummary]) -> list[str]:
    """`threadline agents list`: one line per agent."""
    return [f"{s.agent_id}  active {version_ref(s.active)}  latest {version_ref(s.latest)}"
            + (f"  drafts {', '.join(s.drafts)}" if s.drafts else "") for s in summaries]
