"""The agent registry: immutable config versions, drafts, which version is active, and who changed
what when (sync; `Client` is its face in Python, `threadline agents ...` on the command line).

Rules: a version is written once and never changed; `put` of the active version's document (same
digest of the canonical JSON) makes no new version; `publish` turns a draft into the next version
(the draft stays, to be edited further); `rollback` makes an existing version active again without
a new one. Every change of the active version is recorded with its author and time. Conversations
are pinned to the version they started on (`pipeline/resolve.py`), so none of this moves a running
conversation.
"""

from __future__ import annotations

import difflib
import getpass
import hashlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import redis
import yaml
from pydantic import BaseModel, ConfigDict

from threadline.pipeline.config import AgentConfig, config_from_json, config_to_json
from threadline.pipeline.errors import AgentNotFound, InvalidRequest
from threadline.workers.protocol.keys import Keys
from threadline.workers.protocol.schema import text
from threadline.workers.storage import lua
from threadline.workers.storage.agent_index import AgentSummary as AgentSummary
from threadline.workers.storage.agent_index import agent_summaries, agent_summary
from threadline.workers.storage.agent_index import render_agents as render_agents

Source = Literal["put", "publish"]
Action = Literal["put", "publish", "rollback"]
#: Rounds of read-and-retry when concurrent puts keep moving `latest` (each round is one script call).
_ATTEMPTS = 100


class VersionMeta(BaseModel):
    """What is stored about a version besides its config (the `agent_versions` hash, JSON)."""

    model_config = ConfigDict(frozen=True)

    version: int
    #: None only for versions registered before versions had metadata.
    created_at: float | None = None
    author: str | None = None
    #: sha256 of the canonical config JSON.
    digest: str = ""
    source: Source = "put"
    from_draft: str | None = None


class Activation(BaseModel):
    """One change of the active version (the `agent_activations` list, JSON)."""

    model_config = ConfigDict(frozen=True)

    version: int
    action: Action
    at: float
    author: str


@dataclass(frozen=True, slots=True)
class PutResult:
    """What a put or publish did: `ref` is "v<N>" (or "draft:<id>"); `created` is False when the
    document was the active version's and nothing was written."""

    agent_id: str
    ref: str
    created: bool
    version: int | None = None


@dataclass(frozen=True, slots=True)
class AgentVersions:
    """Every version of an agent, oldest first, and the changes of the active one, newest first."""

    agent_id: str
    active: int | None
    versions: tuple[VersionMeta, ...]
    activations: tuple[Activation, ...]

    def as_json(self) -> dict[str, Any]:
        return {"agent_id": self.agent_id, "active": self.active,
                "versions": [v.model_dump(mode="json") for v in self.versions],
                "activations": [a.model_dump(mode="json") for a in self.activations]}


def default_author() -> str:
    """Who changes a config when nobody says: `TL_AUTHOR`, else the OS user name. Read per call (not
    in `Settings`): it names the person at this terminal, not a setting of the deployment."""
    try:
        return os.environ.get("TL_AUTHOR") or getpass.getuser()
    except (KeyError, OSError):  # no user name in a bare container
        return "unknown"


def canonical_json(config: AgentConfig) -> str:
    """The stored form of a version: `config_to_json` with sorted keys, so two documents that differ
    only in the order of their mappings are the same version."""
    return json.dumps(json.loads(config_to_json(config)), sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def digest(canonical: str) -> str:
    return hashlib.sha256(canonical.encode()).hexdigest()


def parse_version(value: int | str) -> int:
    """"3" or "v3" -> 3; anything else is a bad request."""
    raw = str(value).strip().removeprefix("v")
    if not raw.isdigit() or int(raw) < 1:
        raise InvalidRequest(f"a version is a number like 3 or v3, not {str(value)!r}")
    return int(raw)


def config_yaml(config: AgentConfig) -> str:
    """A config as YAML, fields in the document's order."""
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False, allow_unicode=True)


def diff_configs(agent_id: str, a: tuple[int, AgentConfig], b: tuple[int, AgentConfig]) -> str:
    """A unified diff of two versions as YAML; "" when they are identical."""
    old, new = (config_yaml(config).splitlines(keepends=True) for _, config in (a, b))
    return "".join(difflib.unified_diff(old, new, fromfile=f"{agent_id} v{a[0]}", tofile=f"{agent_id} v{b[0]}"))


class AgentRegistry:
    def __init__(self, client: redis.Redis, keys: Keys, *, clock: Callable[[], float] = time.time) -> None:
        self.redis = client
        self.keys = keys
        self.clock = clock
        self._version = client.register_script(lua.source("agent_version"))
        self._activate = client.register_script(lua.source("agent_activate"))

    # --- writes ---------------------------------------------------------------------------------

    def put(self, config: AgentConfig, *, author: str) -> PutResult:
        """The config as the next version, made active; the active version when it is the same."""
        return self._new_version(config, author=author, source="put", draft_id=None)

    def put_draft(self, config: AgentConfig, draft_id: str) -> PutResult:
        """A draft, written in place (conversations started on it run its newest content)."""
        k = self.keys
        if k.shards:  # the set of agents is in another slot than the agent's keys: listed first
            self.redis.sadd(k.agents(), config.id)
        pipe = self.redis.pipeline(transaction=True)
        pipe.set(k.agent_draft(config.id, draft_id), config_to_json(config))
        pipe.sadd(k.agent_drafts(config.id), draft_id)
        if not k.shards:
            pipe.sadd(k.agents(), config.id)
        pipe.execute()
        return PutResult(config.id, f"draft:{draft_id}", created=True)

    def publish(self, agent_id: str, *, draft_id: str | None, author: str) -> PutResult:
        """The draft (the agent's only one when `draft_id` is None) as the next version, made active;
        the draft is kept. A draft equal to the active version publishes nothing."""
        draft_id = draft_id or self._only_draft(agent_id)
        data = self.redis.get(self.keys.agent_draft(agent_id, draft_id))
        if data is None:
            raise AgentNotFound(f"agent {agent_id!r} has no draft {draft_id!r}")
        return self._new_version(config_from_json(data), author=author, source="publish", draft_id=draft_id)

    def rollback(self, agent_id: str, version: int, *, author: str) -> bool:
        """Make an existing version active again. False when it already was (nothing recorded)."""
        k = self.keys
        activation = Activation(version=version, action="rollback", at=self.clock(), author=author)
        outcome = text(self._activate(
            keys=[k.agent(agent_id), k.agent_activations(agent_id), k.agent_version(agent_id, version)],
            args=[lua.payload(version=str(version)), activation.model_dump_json()]))
        if outcome == "missing":
            raise self._missing(agent_id, version)
        return outcome == "activated"

    def _new_version(self, config: AgentConfig, *, author: str, source: Source, draft_id: str | None) -> PutResult:
        k, agent_id = self.keys, config.id
        data = canonical_json(config)
        sha = digest(data)
        for _ in range(_ATTEMPTS):
            latest = self.redis.hget(k.agent(agent_id), "latest")
            number = int(text(latest)) + 1 if latest is not None else 1
            now = self.clock()
            meta = VersionMeta(version=number, created_at=now, author=author, digest=sha, source=source,
                               from_draft=draft_id)
            activation = Activation(version=number, action=source, at=now, author=author)
            if k.shards:  # the set of agents is in another slot than the agent's keys: listed first
                self.redis.sadd(k.agents(), agent_id)
            status, version = (text(v) for v in self._version(
                keys=[k.agent(agent_id), k.agent_versions(agent_id), k.agent_activations(agent_id),
                      k.agent(agent_id) if k.shards else k.agents(), k.agent_version(agent_id, number)],
                args=[lua.payload(agent_id=agent_id, version=str(number), digest=sha, index=not k.shards),
                      meta.model_dump_json(),
                      activation.model_dump_json(), data]))
            if status != "conflict":
                return PutResult(agent_id, f"v{version}", created=status == "created", version=int(version))
        raise RuntimeError(f"agent {agent_id!r}: {_ATTEMPTS} concurrent puts in a row moved its latest version")

    # --- reads ----------------------------------------------------------------------------------

    def agents(self) -> list[AgentSummary]:
        """Every registered agent with its active and latest version and its drafts, by id."""
        return agent_summaries(self.redis, self.keys)

    def _summary(self, agent_id: str) -> AgentSummary:
        return agent_summary(self.redis, self.keys, agent_id)

    def versions(self, agent_id: str) -> AgentVersions:
        summary = self._summary(agent_id)
        if summary.latest is None:
            raise AgentNotFound(f"agent {agent_id!r} has no published version")
        stored = {int(text(n)): VersionMeta.model_validate_json(m)
                  for n, m in self.redis.hgetall(self.keys.agent_versions(agent_id)).items()}
        versions = tuple(stored.get(n, VersionMeta(version=n)) for n in range(1, summary.latest + 1))
        activations = tuple(Activation.model_validate_json(a)
                            for a in self.redis.lrange(self.keys.agent_activations(agent_id), 0, -1))
        return AgentVersions(agent_id, summary.active, versions, activations)

    def config(self, agent_id: str, version: int | None = None) -> tuple[int, AgentConfig]:
        """A version's config (default: the active one) and its number."""
        if version is None:
            active = self.redis.hget(self.keys.agent(agent_id), "active")
            if active is None:
                raise AgentNotFound(f"agent {agent_id!r} is not registered")
            version = int(text(active))
        data = self.redis.get(self.keys.agent_version(agent_id, version))
        if data is None:
            raise self._missing(agent_id, version)
        return version, config_from_json(data)

    def _only_draft(self, agent_id: str) -> str:
        drafts = sorted(text(d) for d in self.redis.smembers(self.keys.agent_drafts(agent_id)))
        if not drafts:
            raise AgentNotFound(f"agent {agent_id!r} has no draft to publish")
        if len(drafts) > 1:
            raise InvalidRequest(f"agent {agent_id!r} has {len(drafts)} drafts ({', '.join(drafts)}): name one")
        return drafts[0]

    def _missing(self, agent_id: str, version: int) -> AgentNotFound:
        if not self.redis.exists(self.keys.agent(agent_id)):
            return AgentNotFound(f"agent {agent_id!r} is not registered")
        return AgentNotFound(f"agent {agent_id!r} has no version v{version}")


# --- for the terminal ------------------------------------------------------------------------------


def _when(ts: float | None) -> str:
    return "-" if ts is None else time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(ts))


def render_versions(history: AgentVersions) -> list[str]:
    """`threadline agents versions`: one line per version, then who made the active one active."""
    lines = []
    for v in history.versions:
        origin = v.source + (f" (draft {v.from_draft})" if v.from_draft else "")
        mark = "  active" if v.version == history.active else ""
        lines.append(f"v{v.version}  {_when(v.created_at)}  {v.author or '-'}  {origin}  {v.digest[:12] or '-'}{mark}")
    if history.activations:
        last = history.activations[0]
        lines.append(f"active: v{last.version} since {_when(last.at)} by {last.author} ({last.action})")
    return lines
