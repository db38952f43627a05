"""Every Redis key and channel Threadline uses, built here and nowhere else.

Two layouts. One server's (`shards` 0, the default): keys of one conversation share the hash tag
`{<conversation_id>}`, turn-scoped keys are addressed by turn id, queues and indexes are one key
each. The sharded layout (`TL_SHARDS`, `shard_of`, `shard_tag`): a conversation, its turns, the stage
queues they pass through and the indexes their scripts write all carry their shard's tag
(`<prefix>:{<tag>}:...`), so each script touches one Redis Cluster slot. A sharded `Keys` builds a
turn, queue or index key only when bound to a shard (`on`, `of_conversation`): a path that does not
know its turn's shard fails loudly instead of writing into another slot. Ids never contain `:` or
braces (`pipeline.ids.ID_PATTERN`), so no id can name another one's key.
"""

from __future__ import annotations

import dataclasses
import json
from binascii import crc_hqx
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cache

#: Redis Cluster's hash slots.
SLOTS = 16384
#: The version of the layout record (`Keys.layout`) and of the key names it implies.
LAYOUT_SCHEMA = "threadline.layout/v1"
#: How much longer a turn's shard pointer (`Keys.turn_shard`) lives than the turn's record does after
#: its end (`TL_TURN_TTL_S`): the pointer is written when the turn is submitted.
TURN_SHARD_SLACK_S = 86_400
#: The most shards a layout may have: each keeps a range of at least 16 slots.
MAX_SHARDS = 1024


def slot(text: str) -> int:
    """The hash slot of a key with no hash tag (`CLUSTER KEYSLOT`): CRC16 (XMODEM) modulo 16384."""
    return crc_hqx(text.encode(), 0) % SLOTS


def shard_of(conversation_id: str, count: int) -> int:
    """The shard of a conversation in a layout of `count` shards: the slot `CLUSTER KEYSLOT <id>`
    answers, modulo `count`, so a producer in any language computes it with one command."""
    return slot(conversation_id) % count


@cache
def shard_tag(shard: int, count: int) -> str:
    """The hash tag (without braces) of shard `shard` of `count`: the first of `s<i>`, `s<i>.1`,
    `s<i>.2`, ... whose slot lies in the i-th of `count` equal slot ranges, so that the shards spread
    evenly over primaries holding equal contiguous ranges (`redis-cli --cluster create`'s) when
    `count` is a multiple of their number."""
    if not 0 <= shard < count <= MAX_SHARDS:
        raise ValueError(f"no shard {shard} in a layout of {count}")
    low, high = shard * SLOTS // count, (shard + 1) * SLOTS // count
    tag, n = f"s{shard}", 0
    while not low <= slot(tag) < high:
        n += 1
        tag = f"s{shard}.{n}"
    return tag


def layout_record(shards: int) -> dict[str, object]:
    """What `Keys.layout` holds (JSON, `threadline.layout/v1`): the shard count and each shard's
    tag, for producers that do not compute tags themselves; `"shards": 0` is one server's layout."""
    return {"schema": LAYOUT_SCHEMA, "shards": shards, "tags": [shard_tag(i, shards) for i in range(shards)]}


def layout_shards(raw: bytes | str | None) -> int:
    """The shard count of a stored `layout_record` (missing: 0, one server's layout); a record that
    is no layout is a `ValueError`, never a guess that would read and write other keys."""
    if raw is None:
        return 0
    try:
        record = json.loads(raw)
        shards, schema = record.get("shards"), record.get("schema", LAYOUT_SCHEMA)
    except (ValueError, AttributeError):
        shards, schema = None, None
    if schema != LAYOUT_SCHEMA or not isinstance(shards, int) or isinstance(shards, bool) \
            or not 0 <= shards <= MAX_SHARDS:
        shown = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
        raise ValueError(f"the key layout record is no {LAYOUT_SCHEMA} layout: {shown[:200]!r}")
    return shards


class UnboundShard(RuntimeError):
    """A sharded layout's turn, queue or index key asked for without a shard."""


class CrossShard(RuntimeError):
    """A conversation's key asked for by keys bound to another shard."""


@dataclass(frozen=True, slots=True)
class Keys:
    prefix: str = "tl"
    #: Virtual shards of the layout; 0: one server's layout.
    shards: int = 0
    #: The shard this builder's turn, queue and index keys are in (sharded layout only).
    shard: int | None = None

    # --- shards -------------------------------------------------------------------------------
    def on(self, shard: int | None) -> Keys:
        """The same keys bound to `shard` (one server's layout has one: itself)."""
        if not self.shards or shard == self.shard:
            return self
        if shard is None or not 0 <= shard < self.shards:
            raise UnboundShard(f"no shard {shard!r} in a layout of {self.shards}")
        return dataclasses.replace(self, shard=shard)

    def shard_of(self, conversation_id: str) -> int | None:
        """The shard of a conversation (None in one server's layout)."""
        return shard_of(conversation_id, self.shards) if self.shards else None

    def of_conversation(self, conversation_id: str) -> Keys:
        """The keys bound to the shard of `conversation_id` (where its turns' keys live)."""
        return self.on(self.shard_of(conversation_id))

    def pointed(self, raw: bytes | str | None) -> Keys | None:
        """The keys of the shard a turn's pointer (`turn_shard`) names; None: no pointer, or none of
        this layout's shards."""
        try:
            shard = int(raw.decode() if isinstance(raw, bytes) else raw) if raw is not None else -1
        except ValueError:
            return None
        return self.on(shard) if 0 <= shard < self.shards else None

    def every_shard(self) -> list[Keys]:
        """One bound builder per shard (one server's layout: itself), for readers of every index."""
        return [self.on(i) for i in range(self.shards)] if self.shards else [self]

    @property
    def _scoped(self) -> str:
        """What a turn, queue or index key starts with: the prefix, or the bound shard's tag."""
        if not self.shards:
            return self.prefix
        if self.shard is None:
            raise UnboundShard("a sharded layout's turn, queue and index keys need the turn's shard")
        return f"{self.prefix}:{{{shard_tag(self.shard, self.shards)}}}"

    @property
    def _fleet(self) -> str:
        """What a worker process's keys start with: they share one slot in the sharded layout."""
        return f"{self.prefix}:{{fleet}}" if self.shards else self.prefix

    def _agent(self, agent_id: str) -> str:
        """What an agent's registry keys start with: tagged with its id in the sharded layout (one
        slot per agent; the set of agents is elsewhere)."""
        return f"{self.prefix}:agent:{{{agent_id}}}" if self.shards else f"{self.prefix}:agent:{agent_id}"

    def _conv(self, conversation_id: str) -> str:
        if not self.shards:
            return f"{self.prefix}:conv:{{{conversation_id}}}"
        if conversation_id == "-":  # the placeholder of a script call that names no conversation
            return f"{self._scoped}:conv:-"
        shard = shard_of(conversation_id, self.shards)
        if self.shard is not None and shard != self.shard:
            raise CrossShard(f"conversation {conversation_id!r} is in shard {shard}, not {self.shard}")
        return f"{self.prefix}:{{{shard_tag(shard, self.shards)}}}:conv:{conversation_id}"

    def layout(self) -> str:
        """String: the layout's `layout_record` (JSON), written by the first worker to start; a
        worker started with another `TL_SHARDS` refuses to run, and clients read the count here."""
        return f"{self.prefix}:layout"

    # --- agent configs ------------------------------------------------------------------------
    def agent(self, agent_id: str) -> str:
        """Hash: `active` (published version number), `latest`."""
        return f"{self._agent(agent_id)}"

    def agent_version(self, agent_id: str, version: int | str) -> str:
        """String: one immutable published config (JSON)."""
        return f"{self._agent(agent_id)}:v:{version}"

    def agent_draft(self, agent_id: str, draft_id: str) -> str:
        """String: a draft config (JSON), updated in place."""
        return f"{self._agent(agent_id)}:draft:{draft_id}"

    def agents(self) -> str:
        """Set of registered agent ids."""
        return f"{self.prefix}:agents"

    def agent_versions(self, agent_id: str) -> str:
        """Hash: version number -> who made it, when, how, and its config's digest (JSON)."""
        return f"{self._agent(agent_id)}:versions"

    def agent_activations(self, agent_id: str) -> str:
        """List: every change of the active version (version, action, who, when; JSON), newest first."""
        return f"{self._agent(agent_id)}:activations"

    def agent_drafts(self, agent_id: str) -> str:
        """Set: the agent's draft ids."""
        return f"{self._agent(agent_id)}:drafts"

    # --- conversations ------------------------------------------------------------------------
    def conversation(self, conversation_id: str) -> str:
        """Hash: scope, config_ref, layers, revision, tip, pending tool calls."""
        return self._conv(conversation_id)

    def messages(self, conversation_id: str) -> str:
        """Hash: message id -> message row (JSON)."""
        return f"{self._conv(conversation_id)}:msgs"

    def message_order(self, conversation_id: str) -> str:
        """Sorted set: message id scored by creation order."""
        return f"{self._conv(conversation_id)}:order"

    def snapshots(self, conversation_id: str) -> str:
        """Hash: message id -> the pydantic-ai messages that turn added (JSON)."""
        return f"{self._conv(conversation_id)}:snaps"

    def token_counts(self, conversation_id: str) -> str:
        """Hash: `<message id>|<tokenizer>` -> the tokens that turn costs in a history (counted once);
        `<message id>|version` -> its content version once compaction rewrote its snapshot, counted
        then under `<message id>#<version>|<tokenizer>` (`store.count_field`)."""
        return f"{self._conv(conversation_id)}:tokens"

    def summaries(self, conversation_id: str) -> str:
        """Hash: watermark message id -> the running summary of the thread from the root to it (JSON);
        every branch below the watermark reuses it."""
        return f"{self._conv(conversation_id)}:summaries"

    def decisions(self, conversation_id: str) -> str:
        """Hash: `<message id>:<stage>` -> the stage's decision record for that turn (JSON)."""
        return f"{self._conv(conversation_id)}:decisions"

    def turn_queue(self, conversation_id: str) -> str:
        """Sorted set: turns of this conversation, by submission time; the head runs."""
        return f"{self._conv(conversation_id)}:turns"

    def lease(self, conversation_id: str) -> str:
        """Hash: `turn` (who runs now), `fence` (grows with every new holder)."""
        return f"{self._conv(conversation_id)}:lease"

    def waiting(self, conversation_id: str) -> str:
        """Hash: turn id -> its request as a dramatiq message, kept from admission to its end, so the
        turn before it can wake it and the watchdog can run it again."""
        return f"{self._conv(conversation_id)}:waiting"

    def conversation_keys(self, conversation_id: str) -> tuple[str, ...]:
        """Every key of a conversation (a delete removes them all; its turns' keys go by turn id)."""
        return (self.conversation(conversation_id), self.messages(conversation_id),
                self.message_order(conversation_id), self.snapshots(conversation_id),
                self.token_counts(conversation_id), self.summaries(conversation_id), self.decisions(conversation_id),
                self.turn_queue(conversation_id), self.lease(conversation_id), self.waiting(conversation_id))

    def activity(self) -> str:
        """Sorted set: conversation id scored by its last activity (a turn admitted, a turn's row
        written), kept while `TL_RETENTION_DAYS` is set; the watchdog deletes the idle ones."""
        return f"{self._scoped}:activity"

    def activity_backfill(self) -> str:
        """String: set once the conversations stored before retention was on entered `activity`."""
        return f"{self.prefix}:activity:backfilled"

    def tenant_conversations(self, tenant_id: str) -> str:
        """Sorted set: the tenant's conversation ids scored by their last accepted turn (advance.lua
        writes it with the conversation's own tenant, delete_conversation.lua removes it); listing drops ids
        whose conversation is gone some other way."""
        return f"{self._scoped}:tenant:{tenant_id}:convs"

    def api_keys(self) -> str:
        """Hash: sha256 of an API key (hex) -> its tenant and role (JSON); keys themselves are never stored."""
        return f"{self.prefix}:apikeys"

    def api_key_ids(self) -> str:
        """Hash: an API key's public id -> the sha256 it is stored under (`keys revoke ID`, rotation)."""
        return f"{self.prefix}:apikeys:ids"

    def api_key_used(self) -> str:
        """Hash: an API key's id -> when it was last used (unix s), written at most once a minute."""
        return f"{self.prefix}:apikeys:used"

    def rate_bucket(self, limit: str, subject: str) -> str:
        """Hash: one token bucket (`tokens`, `at` ms of server time) of the gateway's rate limits:
        `limit` is rps, turns or auth; `subject` a key id (or a client address for auth). The subject
        is the hash tag: a request's buckets and its key's stream holds are one slot of a cluster."""
        return f"{self.prefix}:ratelimit:{{{subject}}}:{limit}"

    def stream_holders(self, key_id: str) -> str:
        """Sorted set: the open event streams of an API key, each a token scored by its lease's
        expiry (ms, server time), renewed while the stream is open."""
        return f"{self.prefix}:ratelimit:{{{key_id}}}:streams"

    def turn_user(self, turn_id: str) -> str:
        """String: the user a user-scoped API key submitted the turn as (expires with the turn's
        artifacts): such a key reads only its own user's turns, also before they are admitted."""
        return f"{self._scoped}:turn:{turn_id}:user"

    def model_limit(self, agent_id: str) -> str:
        """Sorted set: the holders of the agent's model slots (`model.max_concurrency`), each a token
        scored by its lease's expiry (ms, server time); an expired holder's worker died."""
        return f"{self.prefix}:limit:{agent_id}"

    # --- long-term memory ---------------------------------------------------------------------
    def memory(self, user_tag: str, suffix: str, part: str) -> str:
        """One key of a user's memory partition (`storage/memory.py` names the parts). `user_tag` is
        `<tenant>/<user>` and the hash tag of every key of that user (one Redis Cluster slot);
        `suffix` is "" (the user partition), `/app/<app>` or `/agent/<agent>`."""
        return f"{self.prefix}:mem:{{{user_tag}}}{suffix}:{part}"

    def memory_partitions(self, user_tag: str) -> str:
        """Set: the partition suffixes of the user's memory in use ("" for the user partition)."""
        return f"{self.prefix}:mem:{{{user_tag}}}:partitions"

    def memory_activity(self) -> str:
        """Sorted set: memory partition (`Scope.partition`) scored by its last write, kept while
        `TL_RETENTION_DAYS` is set; the watchdog deletes the idle ones."""
        return f"{self.prefix}:memactivity"

    # --- turns --------------------------------------------------------------------------------
    def turn(self, turn_id: str) -> str:
        """Hash: status, stage markers, attempt, conversation, fence, deadline."""
        return f"{self._scoped}:turn:{turn_id}"

    def events(self, turn_id: str) -> str:
        """Stream: the turn's events, one field `json` per entry."""
        return f"{self._scoped}:turn:{turn_id}:events"

    def artifact(self, turn_id: str, stage: str) -> str:
        """String: the output of one stage of the turn (JSON), deleted when the turn ends."""
        return f"{self._scoped}:turn:{turn_id}:art:{stage}"

    def cancel_flag(self, turn_id: str) -> str:
        return f"{self._scoped}:turn:{turn_id}:cancel"

    def model_claim(self, turn_id: str) -> str:
        """String: the worker running the turn's model call; expires unless renewed."""
        return f"{self._scoped}:turn:{turn_id}:claim"

    def turn_keys(self, turn_id: str, stages: Iterable[str]) -> tuple[str, ...]:
        """Every key of a turn: its record, events, the artifacts of `stages`, cancel flag, model claim."""
        return (self.turn(turn_id), self.events(turn_id), *(self.artifact(turn_id, s) for s in stages),
                self.cancel_flag(turn_id), self.model_claim(turn_id))

    def turn_shard(self, turn_id: str) -> str:
        """String (sharded layout): the shard a turn's keys are in, written once when it is
        submitted, for readers that know only its id; it expires with the turn's record."""
        return f"{self.prefix}:turnshard:{turn_id}"

    def running(self) -> str:
        """Sorted set: turns between admission and their end, scored by when the watchdog should look
        at them next (their last progress, or its last look)."""
        return f"{self._scoped}:running"

    # --- worker processes ---------------------------------------------------------------------
    def worker(self, worker_id: str) -> str:
        """String: a live worker process's heartbeat (JSON: pid, host, broker id, queues, since);
        expires `TL_WORKER_TIMEOUT_S` after its last renewal."""
        return f"{self._fleet}:worker:{worker_id}"

    def worker_turns(self, worker_id: str) -> str:
        """Set: the turns a worker process runs a stage of now, rewritten with every heartbeat (and
        expiring with it): the watchdog takes over a running turn that is in no live worker's set."""
        return f"{self._fleet}:worker:{worker_id}:turns"

    def workers(self) -> str:
        """Hash: worker id -> its dramatiq broker id, for every worker process not yet reaped: when
        its heartbeat is gone, the watchdog puts the messages it had fetched back on their queues."""
        return f"{self._fleet}:workers"

    def usage(self, tenant_id: str) -> str:
        """Hash: token and request counters per tenant, each turn counted once."""
        return f"{self._scoped}:usage:{tenant_id}"

    def dead_letters(self) -> str:
        """Stream: one entry per dead-lettered message (`queue`, `message_id`, `actor`, `reason`),
        capped; dramatiq's own dead-letter sets (`<queue>.XQ`) keep the message bodies."""
        return f"{self._scoped}:deadletters"

    # --- completion webhooks (docs/webhooks.md) ------------------------------------------------
    def webhook(self, delivery_id: str) -> str:
        """Hash: one delivery (turn_id, tenant_id, url, status, attempts, max_attempts, created_at,
        the terminal event); written once, by the script that writes the turn's terminal event."""
        return f"{self._scoped}:webhook:{delivery_id}"

    def webhook_attempts(self, delivery_id: str) -> str:
        """List: every attempt of a delivery (JSON: attempt, at, status_code, error, excerpt, ms, outcome)."""
        return f"{self._scoped}:webhook:{delivery_id}:attempts"

    def webhooks(self) -> str:
        """Sorted set: delivery ids by creation time (`threadline webhooks list`)."""
        return f"{self._scoped}:webhooks"

    def webhook_secret(self, tenant_id: str) -> str:
        """String: the tenant's webhook signing secret, created on first use."""
        return f"{self.prefix}:tenant:{tenant_id}:webhook_secret"

    # --- the broker's queues (dramatiq's RedisBroker layout) -----------------------------------
    def queue(self, name: str) -> str:
        """List: ids of the messages waiting on a queue (`<name>.DQ`: its delay queue)."""
        return f"{self._scoped}:q:{name}"

    def queue_messages(self, name: str) -> str:
        """Hash: message id -> message body, for a queue."""
        return f"{self._scoped}:q:{name}.msgs"

    def dead_queue(self, name: str) -> str:
        """Sorted set: ids of the dead-lettered messages of a queue (its canonical name: a delay
        queue's go to its queue's), scored by when (ms); `dead_queue_messages` keeps their bodies."""
        return f"{self._scoped}:q:{name}.XQ"

    def dead_queue_messages(self, name: str) -> str:
        return f"{self._scoped}:q:{name}.XQ.msgs"

    def heartbeats(self) -> str:
        """Sorted set: dramatiq's worker (broker) ids scored by their last fetch (ms, the worker's clock)."""
        return f"{self._fleet}:q:__heartbeats__"

    def acks(self, worker_id: str, queue: str) -> str:
        """Set: ids of the messages of `queue` a worker fetched and has not acked yet."""
        return f"{self._scoped}:q:__acks__.{worker_id}.{queue}"

    # --- channels -----------------------------------------------------------------------------
    def cancel_channel(self) -> str:
        return f"{self.prefix}:cancel"

    def doorbell_channel(self) -> str:
        return f"{self._scoped}:doorbell"
