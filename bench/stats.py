"""Small measurement helpers: percentiles, Redis command counts from `INFO commandstats`, and the
CPU time and commands a run of turns costs."""

from __future__ import annotations

import math
import os
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import redis

#: Commands the harness itself sends while measuring idle load; never counted.
SCRIPT_COMMANDS = frozenset({"evalsha", "eval", "evalsha_ro", "eval_ro", "fcall", "fcall_ro"})
HARNESS_COMMANDS = frozenset({"info", "config", "config|resetstat", "ping", "client|setinfo", "hello",
                              "client", "client|list"})


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


def process_cpu_s(pids: Sequence[int]) -> float:
    """User + system CPU seconds used so far by these processes (Linux /proc; 0 elsewhere)."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, IndexError):
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
    return total / ticks


def server_reads(client: redis.Redis) -> int:
    """The server's read events so far (`total_reads_processed`): its requests, a pipeline as one
    as a rule, so its round trips near enough."""
    return int(cast(dict[str, Any], client.info("stats"))["total_reads_processed"])


def server_cpu_s(client: redis.Redis) -> float:
    info = client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


#: Commands the harness sends to follow completions; not part of a turn's cost.
WAIT_COMMANDS = frozenset({"xread"})


@dataclass(frozen=True, slots=True)
class Cost:
    """What `turns` turns cost: worker CPU, server CPU and server commands (per turn)."""

    turns: int
    worker_cpu_s: float
    server_cpu_s: float
    commands: dict[str, int]
    #: The server's read events (`total_reads_processed`): its requests, a pipeline as one as a rule.
    reads: int = 0
    #: The harness's XREADs among them.
    waits: int = 0

    @classmethod
    def total(cls, costs: Sequence[Cost]) -> Cost:
        """What all of `costs` cost together."""
        commands: Counter[str] = Counter()
        for c in costs:
            commands.update(c.commands)
        return cls(sum(c.turns for c in costs), sum(c.worker_cpu_s for c in costs),
                   sum(c.server_cpu_s for c in costs), dict(commands), sum(c.reads for c in costs),
                   sum(c.waits for c in costs))

    @property
    def worker_ms(self) -> float:
        return self.worker_cpu_s * 1000 / self.turns

    @property
    def server_ms(self) -> float:
        return self.server_cpu_s * 1000 / self.turns

    @property
    def commands_per_turn(self) -> float:
        return sum(self.commands.values()) / self.turns

    @property
    def scripts_per_turn(self) -> float:
        return sum(v for k, v in self.commands.items() if k in SCRIPT_COMMANDS) / self.turns

    @property
    def reads_per_turn(self) -> float:
        return self.reads / self.turns

    @property
    def waits_per_turn(self) -> float:
        return self.waits / self.turns

    def breakdown(self, top: int = 8) -> str:
        ordered = sorted(self.commands.items(), key=lambda kv: -kv[1])[:top]
        return ", ".join(f"{k} {v / self.turns:.1f}" for k, v in ordered)


class CostMeter:
    """Brackets a run: `start()` resets the server's command stats and reads CPU counters,
    `stop(turns)` reads them again. Everything on the server in between is counted, including
    the idle polling of other worker processes (a few commands per second)."""

    def __init__(self, client: redis.Redis, pids: Sequence[int]) -> None:
        self.client = client
        self.pids = list(pids)
        self._worker0 = 0.0
        self._server0 = 0.0

    def start(self) -> None:
        self.client.ping()
        self.client.config_resetstat()
        self._worker0 = process_cpu_s(self.pids)
        self._server0 = server_cpu_s(self.client)

    def stop(self, turns: int) -> Cost:
        worker = process_cpu_s(self.pids) - self._worker0
        server = server_cpu_s(self.client) - self._server0
        counts = command_counts(self.client)
        commands = {k: v for k, v in counts.items() if v and k not in HARNESS_COMMANDS | WAIT_COMMANDS}
        waits = sum(counts.get(k, 0) for k in WAIT_COMMANDS)
        return Cost(turns, worker, server, commands, server_reads(self.client), waits)
