"""The Lua scripts behind every write that must hang together, loaded from `workers/storage/scripts/*.lua`.

Each script is one atomic step of a turn's state machine. Every key it touches arrives in KEYS
(its header lists them), and its arguments are one JSON object (ARGV[1]) plus raw blobs (artifacts,
message bodies) that would only be escaped twice inside it. None of them names a stage: the stage
graph passes stage names in as data. All refuse to act on a turn that already has its terminal
state, which is what makes a redelivered message change nothing.

Cluster note: in one server's layout a script's turn keys and conversation keys sit in different
hash slots, and `advance`, `retry` and `finish` push to queue keys in yet another one; in the
sharded layout (`TL_SHARDS`, `protocol/keys.py`) every call's keys are in one slot
(`tests/workers/test_slots.py`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from functools import cache
from importlib import resources
from typing import TYPE_CHECKING, Any, Literal

from threadline.pipeline.busy import interrupt_reason
from threadline.pipeline.terminal import TERMINAL_TYPES

if TYPE_CHECKING:
    from threadline.workers.protocol.keys import Keys

ScriptName = Literal[
    "submit", "admit", "begin", "advance", "retry", "finish", "stalled", "emit", "cancel", "release", "dead_letter",
    "dispatch", "agent_version", "agent_activate", "slot_acquire", "slot_renew", "slot_release",
    "delete_conversation", "dead_letter_replay", "dead_letter_purge", "heartbeat", "reap", "rate_limit",
    "memory_apply", "memory_forget", "memory_note", "memory_lease", "webhook_attempt", "webhook_retry",
    "conversation_write", "clear_tool_results",
]
#: The scripts of the turn state machine (the broker's `dispatch` and `dead_letter`, the agent registry's `agent_*`,
#: the operations' `dead_letter_*`, a worker's `heartbeat` and the gateway's `rate_limit` are registered by
#: their consumers; long-term memory's `memory_*` by `storage/memory.py`).
SCRIPT_NAMES: tuple[ScriptName, ...] = (
    "submit", "admit", "begin", "advance", "retry", "finish", "stalled", "emit", "cancel", "release",
    "slot_acquire", "slot_renew", "slot_release", "delete_conversation", "reap", "webhook_attempt", "webhook_retry",
    "conversation_write", "clear_tool_results",
)


def constants() -> str:
    """The Lua constants every script shares, generated from their one Python definition."""
    terminal = ", ".join(f"{status}=true" for status in sorted(TERMINAL_TYPES))
    return f"local TERMINAL = {{{terminal}}}\n"


@cache
def source(name: ScriptName) -> str:
    """A script's text with the generated constants and the shared prelude in front."""
    folder = resources.files("threadline.workers.storage").joinpath("scripts")
    prelude = folder.joinpath("prelude.lua").read_text()
    return constants() + prelude + "\n" + folder.joinpath(f"{name}.lua").read_text()


def payload(**fields: Any) -> str:
    """ARGV[1] of every script: one JSON object."""
    return json.dumps(fields, separators=(",", ":"), ensure_ascii=False)


def on_busy_args(keys: Keys, turn_id: str, policy: str, victims: Sequence[str], *, cancel_ttl_s: int,
                 now: float) -> tuple[list[str], dict[str, Any]]:
    """The extra KEYS (a turn key and a cancel flag key per victim) and the payload fields with which
    submit.lua and admit.lua apply a turn's `on_busy` policy (prelude.lua's `on_busy`); `policy` ""
    applies none."""
    victim_keys = [key for v in victims for key in (keys.turn(v), keys.cancel_flag(v))]
    return victim_keys, {"on_busy": policy, "victims": list(victims), "reason": interrupt_reason(turn_id),
                         "rollback": policy == "rollback", "cancel_ttl_s": cancel_ttl_s,
                         "cancel_channel": keys.cancel_channel(), "now": now}
