"""Small measurement helpers: percentiles, and Redis command counts from `INFO commandstats`."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import redis

#: Commands the harness itself sends while measuring idle load; never counted.
SCRIPT_COMMANDS = frozenset({"evalsha", "eval", "evalsha_ro", "eval_ro", "fcall", "fcall_ro"})
HARNESS_COMMANDS = frozenset({"info", "config", "config|resetstat", "ping", "client|setinfo", "hello"})


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), linear interpolation between closest ranks."""
    if not values:
        return math.nan
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0]
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass(frozen=True, slots=True)
class Summary:
    n: int
    p50: float
    p99: float
    max: float
    mean: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Summary:
        if not values:
            return cls(0, math.nan, math.nan, math.nan, math.nan)
        return cls(len(values), percentile(values, 50), percentile(values, 99), max(values),
                   sum(values) / len(values))


def command_counts(client: redis.Redis) -> dict[str, int]:
    """`calls` per command from INFO commandstats (commands run inside Lua scripts included:
    Redis counts every `redis.call` under its own command as well as the EVALSHA around it)."""
    stats = client.info("commandstats")
    counts: dict[str, int] = {}
    for name, value in stats.items():
        command = name.removeprefix("cmdstat_")
        counts[command] = int(value["calls"]) if isinstance(value, dict) else 0
    return counts


@dataclass(frozen=True, slots=True)
class IdleLoad:
    seconds: float
    per_command: dict[str, float]

    @property
    def total(self) -> float:
        return sum(self.per_command.values())

    @property
    def scripts(self) -> float:
        """Script invocations (client round trips that run Lua)."""
        return sum(v for k, v in self.per_command.items() if k in SCRIPT_COMMANDS)

    @property
    def others(self) -> float:
        """Every other command; an idle worker sends nothing but script calls (and no pub/sub
        commands while subscribed), so these are the calls its scripts make inside Redis."""
        return self.total - self.scripts

    def breakdown(self, top: int = 6) -> str:
        ordered = sorted(self.per_command.items(), key=lambda kv: -kv[1])[:top]
        return ", ".join(f"{k} {v:.1f}" for k, v in ordered)


def measure_idle_load(client: redis.Redis, seconds: float) -> IdleLoad:
    """Reset the server's command stats, wait, and return calls/s per command (harness excluded)."""
    client.ping()  # the connection exists before the reset, so no handshake is counted
    client.config_resetstat()
    t0 = time.monotonic()
    time.sleep(seconds)
    counts = command_counts(client)
    elapsed = time.monotonic() - t0
    per_command = {k: v / elapsed for k, v in counts.items() if k not in HARNESS_COMMANDS and v}
    return IdleLoad(elapsed, per_command)
