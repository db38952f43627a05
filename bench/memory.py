"""Redis memory per turn: what a finished turn leaves behind, by key family.

    .venv/bin/python -m bench.memory                 # 500 turns over 50 conversations (~30 s)
    .venv/bin/python -m bench.memory --quick         # 100 turns over 10 conversations (~15 s)

A fresh `redis-server` and 2 worker processes (`bench/procs.py`). After one warm-up turn per agent:

1. `offline:chat`: `--turns` turns spread over `--conversations` conversations, each conversation's
   turns in order (its id from the first turn's terminal event), `--parallel` conversations at
   once. After all turns ended: `used_memory` before/after, and `MEMORY USAGE … SAMPLES 0` of every
   key under the prefix (SCAN), before and after, grouped by key family: turn keys
   (`<prefix>:turn:*`: turn hash / events stream / artifacts `:art:<name>` / other), conversation keys
   (`<prefix>:conv:*`, by suffix), queue keys (`<prefix>:q:*`), other.
2. `offline:echo` (its answer quotes everything the model received, earlier answers included: the
   worst case for growth): one long conversation of `--long-turns` turns, every turn measured alone
   (a snapshot after each turn), to show whether a turn's bytes grow with the conversation's length.
   Each answer quotes the previous ones, so uncapped answers grow about 3x per turn: the
   conversation stops once its next turn is predicted to take it past `--budget-mb`, and the turns
   it did not reach are extrapolated.
3. For contrast, the same for one long `offline:chat` conversation, whose answers quote only the
   earlier questions (linear growth).

Only the public client (`Client(url, prefix=...)`, `put_agent`, `submit`, `wait`, `Client.redis`)
and key patterns by prefix are used, so the benchmark survives changes to the internals: a key
family that appears or disappears shows up as its own row.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import uuid
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from threadline.workers.clients.client import Client

from .procs import Child, Processes, Server, bench_session, progress, python_env

WORKERS = 2
#: (group, part): e.g. ("turn", "events stream"), ("conv", ":msgs").
Family = tuple[str, str]
GROUPS = ("turn", "conv", "queue", "other")
GROUP_TITLES = {"turn": "turn keys", "conv": "conversation keys", "queue": "queue keys", "other": "other keys"}
#: key → (bytes by MEMORY USAGE with SAMPLES 0, PTTL in ms: -1 when the key never expires).
Snapshot = dict[str, tuple[int, int]]


@dataclass
class Options:
    turns: int
    conversations: int
    parallel: int
    threads: int
    long_turns: int
    checkpoints: list[int]
    budget_mb: float
    timeout_s: float
    keep: bool


def parse_args(argv: Sequence[str] | None) -> Options:
    parser = argparse.ArgumentParser(prog="python -m bench.memory", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="100 turns over 10 conversations")
    parser.add_argument("--turns", type=int, help="offline:chat turns (default 500; quick 100)")
    parser.add_argument("--conversations", type=int, help="conversations they are spread over (default 50; quick 10)")
    parser.add_argument("--parallel", type=int, default=8, help="conversations run at once (default 8)")
    parser.add_argument("--threads", type=int, default=8, help="threads per worker process (default 8)")
    parser.add_argument("--long-turns", type=int, default=40,
                        help="turns of each long conversation, offline:echo and offline:chat (default 40)")
    parser.add_argument("--checkpoints", default="1,5,10,20,40",
                        help="turns of a long conversation reported one by one (default 1,5,10,20,40)")
    parser.add_argument("--budget-mb", type=float, default=256.0,
                        help="stop a long conversation before it is predicted to take more (default 256)")
    parser.add_argument("--timeout-s", type=float, default=60.0, help="per-turn wait (default 60)")
    parser.add_argument("--keep", action="store_true", help="keep the run directory (worker logs)")
    a = parser.parse_args(argv)
    turns = a.turns if a.turns is not None else (100 if a.quick else 500)
    conversations = a.conversations if a.conversations is not None else (10 if a.quick else 50)
    if turns < 1 or not 1 <= conversations <= turns:
        parser.error("need turns >= conversations >= 1")
    checkpoints = sorted({int(c) for c in a.checkpoints.split(",") if c.strip()})
    return Options(turns, conversations, max(1, a.parallel), a.threads, a.long_turns, checkpoints,
                   a.budget_mb, a.timeout_s, a.keep)


# --- key families --------------------------------------------------------------------------------


def _split_id(rest: str) -> tuple[str, str]:
    """`<id><suffix>` → (id, suffix), the id either a hash tag `{…}` or up to the next `:`."""
    if rest.startswith("{") and "}" in rest:
        end = rest.index("}") + 1
        return rest[:end], rest[end:]
    head, sep, tail = rest.partition(":")
    return head, sep + tail


def classify(prefix: str, key: str) -> Family:
    """The family of one key under `<prefix>:`."""
    rest = key.removeprefix(f"{prefix}:")
    group, _, tail = rest.partition(":")
    if group == "turn" and tail:
        suffix = _split_id(tail)[1]
        if not suffix:
            return ("turn", "turn hash")
        if suffix == ":events":
            return ("turn", "events stream")
        if suffix.startswith(":art:"):
            return ("turn", f"artifact {suffix[len(':art:'):]}")
        return ("turn", f"other {suffix}")
    if group == "conv" and tail:
        suffix = _split_id(tail)[1]
        return ("conv", suffix or "conversation hash")
    if group == "q" and tail:
        if tail.endswith(".msgs"):
            return ("queue", "message bodies (.msgs)")
        if "__acks__" in tail:
            return ("queue", "acks")
        if "__heartbeats__" in tail:
            return ("queue", "heartbeats")
        return ("queue", "queues, delay/dead-letter sets")
    return ("other", group)


def snapshot(client: redis.Redis, prefix: str, chunk: int = 500) -> Snapshot:
    """Every key under the prefix with its exact MEMORY USAGE (SAMPLES 0) and its PTTL."""
    keys = sorted({k.decode() if isinstance(k, bytes) else str(k)
                   for k in client.scan_iter(match=f"{prefix}:*", count=1000)})
    sizes: Snapshot = {}
    for start in range(0, len(keys), chunk):
        part = keys[start:start + chunk]
        pipe = client.pipeline(transaction=False)
        for key in part:
            pipe.memory_usage(key, samples=0)
            pipe.pttl(key)
        replies = pipe.execute()
        for key, size, ttl in zip(part, replies[::2], replies[1::2], strict=True):
            if size is not None:  # gone between SCAN and MEMORY USAGE
                sizes[key] = (int(size), int(ttl))
    return sizes


@dataclass
class Delta:
    """What changed between two snapshots, by family: key count and bytes (after - before)."""

    keys: Counter[Family] = field(default_factory=Counter)
    bytes: Counter[Family] = field(default_factory=Counter)
    #: TTLs (ms; -1: none) of the keys that are new or changed, at the end.
    ttls: dict[Family, list[int]] = field(default_factory=dict)

    @classmethod
    def between(cls, prefix: str, before: Snapshot, after: Snapshot) -> Delta:
        delta = cls()
        for key in before.keys() | after.keys():
            family = classify(prefix, key)
            old, new = before.get(key, (0, -1)), after.get(key)
            delta.keys[family] += (new is not None) - (key in before)
            delta.bytes[family] += (new[0] if new else 0) - old[0]
            if new is not None and new[0] != old[0]:
                delta.ttls.setdefault(family, []).append(new[1])
        return delta

    def add(self, other: Delta) -> None:
        self.keys.update(other.keys)
        self.bytes.update(other.bytes)
        for family, ttls in other.ttls.items():
            self.ttls.setdefault(family, []).extend(ttls)

    def group_bytes(self, group: str) -> int:
        return sum(v for (g, _), v in self.bytes.items() if g == group)

    def group_keys(self, group: str) -> int:
        return sum(v for (g, _), v in self.keys.items() if g == group)

    def part_bytes(self, group: str, startswith: str) -> int:
        return sum(v for (g, p), v in self.bytes.items() if g == group and p.startswith(startswith))

    @property
    def total(self) -> int:
        return sum(self.bytes.values())


def used_memory(client: redis.Redis) -> tuple[int, int]:
    """(used_memory, used_memory_dataset)."""
    info: dict[str, Any] = client.info("memory")
    return int(info["used_memory"]), int(info.get("used_memory_dataset", 0))


# --- processes and turns -------------------------------------------------------------------------


def start_workers(processes: Processes, url: str, prefix: str, threads: int) -> list[Child]:
    env = python_env({"REDIS_URL": url, "TL_PREFIX": prefix, "TL_LOG_FORMAT": "json", "TL_LOG_LEVEL": "WARNING"})
    return [processes.spawn(f"threadline-worker-{i + 1}",
                            [sys.executable, "-m", "threadline.workers.worker", "--threads", str(threads)], env)
            for i in range(WORKERS)]


def wait_ready(client: Client, prefix: str, workers: Sequence[Child], timeout_s: float = 30.0) -> None:
    """Ready once every process listens on the cancel channel (as bench/systems.py checks); if that
    channel is ever renamed, give up waiting after `timeout_s`: the warm-up turns still wait for a
    worker, and memory does not depend on how the load is spread."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for child in workers:
            if not child.alive():
                raise RuntimeError(f"{child.name} exited during start-up:\n{child.log_tail()}")
        numsub: list[tuple[Any, int]] = client.redis.pubsub_numsub(f"{prefix}:cancel")
        if numsub and int(numsub[0][1]) >= len(workers):
            return
        time.sleep(0.05)
    progress(f"workers not seen on {prefix}:cancel after {timeout_s:.0f} s; going on")


def check_alive(workers: Sequence[Child]) -> None:
    for child in workers:
        if not child.alive():
            raise RuntimeError(f"{child.name} exited:\n{child.log_tail()}")


def put_agents(client: Client) -> tuple[str, str]:
    chat, echo = "mem-chat", "mem-echo"
    client.put_agent(json.dumps({"id": chat, "model": {"provider": "offline", "name": "chat"}}))
    client.put_agent(json.dumps({"id": echo, "model": {"provider": "offline", "name": "echo"}}))
    return chat, echo


def request(agent: str, query: str, conversation_id: str | None) -> dict[str, Any]:
    body: dict[str, Any] = {"tenant_id": "bench", "app_id": "bench", "user_id": "u1", "agent_id": agent,
                            "query": query, "turn_id": uuid.uuid4().hex}
    if conversation_id is not None:
        body["conversation_id"] = conversation_id
    return body


def event_fields(event: object) -> dict[str, Any]:
    """A terminal event as a dict, whether `Client.wait` returns a dict or a (pydantic) model."""
    if isinstance(event, Mapping):
        return dict(event)
    dump = getattr(event, "model_dump", None)
    if callable(dump):
        return dict(dump(mode="json"))
    return dict(getattr(event, "__dict__", {}))


@dataclass
class Conversation:
    """One conversation's turns, run in order."""

    agent: str
    turns: int
    label: str
    conversation_id: str | None = None
    statuses: Counter[str] = field(default_factory=Counter)

    def one_turn(self, client: Client, k: int, timeout_s: float) -> dict[str, Any]:
        turn_id = client.submit(request(self.agent, f"{self.label} message {k}", self.conversation_id))
        event = event_fields(client.wait(turn_id, timeout_s=timeout_s))
        self.statuses[str(event.get("type"))] += 1
        if self.conversation_id is None and event.get("conversation_id"):
            self.conversation_id = str(event["conversation_id"])
        return event

    def run(self, client: Client, timeout_s: float) -> None:
        for k in range(1, self.turns + 1):
            self.one_turn(client, k, timeout_s)


# --- phases --------------------------------------------------------------------------------------


@dataclass
class Phase:
    """A measured run of turns: memory before/after and the key delta by family."""

    name: str
    turns: int
    conversations: int
    memory_before: tuple[int, int] = (0, 0)
    memory_after: tuple[int, int] = (0, 0)
    delta: Delta = field(default_factory=Delta)
    statuses: Counter[str] = field(default_factory=Counter)
    wall_s: float = 0.0
    #: Conversations whose turns never learned their conversation id (each turn started a new one).
    unthreaded: int = 0

    @property
    def used_delta(self) -> int:
        return self.memory_after[0] - self.memory_before[0]


def settle(client: Client, seconds: float = 0.5) -> None:
    """Let the last acks and bookkeeping after the terminal events land."""
    time.sleep(seconds)
    client.redis.ping()


def run_chat(opts: Options, client: Client, prefix: str, agent: str, workers: Sequence[Child]) -> Phase:
    phase = Phase("offline:chat", opts.turns, opts.conversations)
    per, extra = divmod(opts.turns, opts.conversations)
    conversations = [Conversation(agent, per + (1 if i < extra else 0), f"c{i}") for i in range(opts.conversations)]
    settle(client)
    phase.memory_before = used_memory(client.redis)
    before = snapshot(client.redis, prefix)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=opts.parallel) as pool:
        for future in [pool.submit(c.run, client, opts.timeout_s) for c in conversations]:
            future.result()
    phase.wall_s = time.perf_counter() - t0
    check_alive(workers)
    settle(client)
    phase.memory_after = used_memory(client.redis)
    phase.delta = Delta.between(prefix, before, snapshot(client.redis, prefix))
    for c in conversations:
        phase.statuses.update(c.statuses)
        phase.unthreaded += int(c.turns > 1 and c.conversation_id is None)
    return phase


@dataclass
class LongTurn:
    turn: int
    answer_chars: int
    used_delta: int
    delta: Delta


@dataclass
class Long:
    """One long conversation, every turn measured alone."""

    phase: Phase
    turns: list[LongTurn] = field(default_factory=list)
    stopped: str = ""

    def growth(self, last: int = 3) -> float:
        """Geometric mean of the turn-over-turn ratio of bytes added, over the last `last` turns."""
        sizes = [t.delta.total for t in self.turns[-(last + 1):]]
        if len(sizes) < 2 or min(sizes) <= 0:
            return math.nan
        return float((sizes[-1] / sizes[0]) ** (1 / (len(sizes) - 1)))

    def at(self, turn: int) -> LongTurn | None:
        return next((t for t in self.turns if t.turn == turn), None)


def _stop_reason(long: Long, budget: int) -> str:
    """Why the next turn should not run (empty: run it): the next turn is predicted to add the last
    turn's bytes times the last turn-over-turn ratio."""
    if len(long.turns) < 2:
        return ""
    last, previous = long.turns[-1].delta.total, long.turns[-2].delta.total
    ratio = max(1.0, last / previous) if previous > 0 else 1.0
    predicted = last * ratio
    if long.phase.delta.total + predicted > budget:
        return (f"stopped before turn {len(long.turns) + 1}: it would add ~{_size(predicted)} "
                f"(x{ratio:.1f} the last turn), past the {_size(budget)} budget (--budget-mb)")
    return ""


def run_long(opts: Options, client: Client, prefix: str, agent: str, name: str,
             workers: Sequence[Child]) -> Long:
    """One conversation of up to `--long-turns` turns, alone on the system; a snapshot after each
    turn, so each turn's bytes are measured alone."""
    long = Long(Phase(name, 0, 1))
    conversation = Conversation(agent, opts.long_turns, name.replace(":", "-"))
    budget = int(opts.budget_mb * 1024 * 1024)
    settle(client)
    long.phase.memory_before = used_memory(client.redis)
    previous, memory = snapshot(client.redis, prefix), long.phase.memory_before[0]
    t0 = time.perf_counter()
    for k in range(1, opts.long_turns + 1):
        long.stopped = _stop_reason(long, budget)
        if long.stopped:
            break
        event = conversation.one_turn(client, k, opts.timeout_s)
        check_alive(workers)
        settle(client, 0.1)
        current, now = snapshot(client.redis, prefix), used_memory(client.redis)[0]
        delta = Delta.between(prefix, previous, current)
        long.turns.append(LongTurn(k, len(str(event.get("answer", ""))), now - memory, delta))
        long.phase.delta.add(delta)
        previous, memory = current, now
    long.phase.wall_s = time.perf_counter() - t0
    long.phase.turns = len(long.turns)
    long.phase.memory_after = used_memory(client.redis)
    long.phase.statuses = conversation.statuses
    long.phase.unthreaded = int(len(long.turns) > 1 and conversation.conversation_id is None)
    return long


# --- report --------------------------------------------------------------------------------------


def _size(value: float) -> str:
    """Bytes, human-readable (binary units), sign kept."""
    if math.isnan(value):
        return "—"
    sign, v = ("-" if value < 0 else ""), abs(value)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"):
        if v < 1024 or unit == "EiB":
            return f"{sign}{v:,.0f} {unit}" if unit == "B" else f"{sign}{v:,.1f} {unit}"
        v /= 1024
    raise AssertionError("unreachable")


def _ttl(ttls: Sequence[int]) -> str:
    """The TTL of a family's new/changed keys: "none", one value, or a range."""
    if not ttls:
        return ""
    if max(ttls) < 0:
        return "none"

    def one(ms: int) -> str:
        if ms < 0:
            return "none"
        s = ms / 1000
        return f"{s / 86400:.1f} d" if s >= 86400 else f"{s / 3600:.1f} h" if s >= 3600 else f"{s:.0f} s"

    low, high = one(min(ttls)), one(max(ttls))
    return low if low == high else f"{low} to {high}"


def _table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|",
            *("| " + " | ".join(row) + " |" for row in rows)]


def _bytes_per_turn(value: float, turns: int) -> str:
    return f"{value / turns:,.0f}" if turns else "—"


def family_rows(delta: Delta, turns: int) -> list[tuple[str, str, str, str, str, str]]:
    """One row per family that changed, a subtotal per group, then the total."""
    total = delta.total

    def share(b: int) -> str:
        return f"{100 * b / total:.1f}%" if total > 0 else "—"

    rows: list[tuple[str, str, str, str, str, str]] = []
    for group in GROUPS:
        parts = sorted({p for (g, p) in delta.bytes.keys() | delta.keys.keys()
                        if g == group and (delta.bytes[(g, p)] or delta.keys[(g, p)])},
                       key=lambda p: -delta.bytes[(group, p)])
        for part in parts:
            b = delta.bytes[(group, part)]
            rows.append((f"{GROUP_TITLES[group]}: {part}", f"{delta.keys[(group, part)]:+,}", f"{b:,}",
                         _bytes_per_turn(b, turns), share(b), _ttl(delta.ttls.get((group, part), []))))
        b = delta.group_bytes(group)
        rows.append((f"**{GROUP_TITLES[group]}, all**", f"{delta.group_keys(group):+,}", f"{b:,}",
                     _bytes_per_turn(b, turns), share(b), ""))
    rows.append(("**all keys under the prefix**", f"{sum(delta.keys.values()):+,}", f"{total:,}",
                 _bytes_per_turn(total, turns), "100%" if total > 0 else "—", ""))
    return rows


def render_phase(phase: Phase) -> list[str]:
    turns, d = phase.turns, phase.delta
    lines = [f"### {phase.name}: {turns} turns over {phase.conversations} conversation"
             f"{'s' if phase.conversations != 1 else ''} ({phase.wall_s:.1f} s; terminal events: "
             f"{dict(phase.statuses)})", ""]
    if phase.unthreaded:
        lines += [f"WARNING: {phase.unthreaded} conversation(s) got no conversation_id from their first turn's "
                  "terminal event, so each of their turns started a new conversation", ""]
    lines += _table(("key family (MEMORY USAGE, SAMPLES 0; after - before)", "new keys", "bytes", "bytes/turn", "share",
                     "TTL at the end"),
                    family_rows(d, turns))
    (before, before_ds), (after, after_ds) = phase.memory_before, phase.memory_after
    unaccounted = phase.used_delta - d.total
    copies, own = d.group_bytes("turn"), d.group_bytes("conv")
    rest = d.total - copies - own
    lines += ["", *_table(("metric", "before", "after", "difference", "per turn"), [
        ("Redis used_memory (bytes)", f"{before:,}", f"{after:,}", f"{after - before:+,}",
         _bytes_per_turn(after - before, turns)),
        ("Redis used_memory_dataset (bytes)", f"{before_ds:,}", f"{after_ds:,}", f"{after_ds - before_ds:+,}",
         _bytes_per_turn(after_ds - before_ds, turns)),
        ("used_memory not in any key's MEMORY USAGE (keyspace/expires dicts, allocator)", "", "",
         f"{unaccounted:+,}", _bytes_per_turn(unaccounted, turns)),
    ])]
    lines += ["", *_table(("after the turns ended, kept", "bytes", "bytes/turn", "share of key bytes"), [
        ("per-turn copies: turn hashes, events streams, artifacts, other turn keys", f"{copies:,}",
         _bytes_per_turn(copies, turns), f"{100 * copies / d.total:.1f}%" if d.total > 0 else "—"),
        ("  of which artifacts", f"{d.part_bytes('turn', 'artifact'):,}",
         _bytes_per_turn(d.part_bytes("turn", "artifact"), turns), ""),
        ("  of which events streams", f"{d.part_bytes('turn', 'events'):,}",
         _bytes_per_turn(d.part_bytes("turn", "events"), turns), ""),
        ("the conversations' own rows, snapshots and bookkeeping (conversation keys)", f"{own:,}",
         _bytes_per_turn(own, turns), f"{100 * own / d.total:.1f}%" if d.total > 0 else "—"),
        ("queues and other keys", f"{rest:,}", _bytes_per_turn(rest, turns),
         f"{100 * rest / d.total:.1f}%" if d.total > 0 else "—"),
        ("ratio per-turn copies : conversation's own", f"{copies / own:.2f} : 1" if own > 0 else "—", "", ""),
    ])]
    return lines


def _largest(delta: Delta, group: str, prefix: str) -> str:
    """The family of `group` whose part starts with `prefix` that grew most: "<name> <bytes>"."""
    parts = [(b, p) for (g, p), b in delta.bytes.items() if g == group and p.startswith(prefix)]
    if not parts:
        return ""
    size, part = max(parts)
    return f"{part.removeprefix(prefix)} {size:,}"


def render_long(opts: Options, long: Long, title: str) -> list[str]:
    """The bytes one turn adds at turn k of one conversation; turns not reached are extrapolated."""
    if not long.turns:
        return [f"{title}: no turn ran ({long.stopped})"]
    first = long.turns[0].delta.total
    every = len(long.turns) <= 12
    shown = [t for t in long.turns if every or t.turn in opts.checkpoints or t.turn == long.turns[-1].turn]
    rows = []
    for t in shown:
        d = t.delta
        rows.append((str(t.turn), f"{t.answer_chars:,}", f"{d.total:,}", f"{d.group_bytes('turn'):,}",
                     f"{d.part_bytes('turn', 'artifact'):,}", _largest(d, "turn", "artifact "),
                     f"{d.part_bytes('turn', 'events'):,}", f"{d.group_bytes('conv'):,}", f"{t.used_delta:+,}",
                     f"x{d.total / first:,.1f}" if first > 0 else "—"))
    lines = [f"{title} (each turn measured alone; terminal events: {dict(long.phase.statuses)}):", "",
             *_table(("turn k", "answer chars", "key bytes added", "turn copies", "artifacts", "largest artifact",
                      "events",
                      "conversation keys", "used_memory Δ (noisy)", "vs turn 1"), rows)]
    if long.phase.unthreaded:
        lines += ["", "WARNING: the first turn's terminal event had no conversation_id: every turn above "
                      "started a new conversation"]
    growth = long.growth()
    missing = [c for c in opts.checkpoints if long.turns[-1].turn < c <= opts.long_turns]
    if missing and not math.isnan(growth):
        last = long.turns[-1]
        guesses = ", ".join(f"turn {c} ~{_size(last.delta.total * growth ** (c - last.turn))}" for c in missing)
        lines += ["", f"not reached: {long.stopped or 'stopped'}; extrapolated at x{growth:.2f} per turn "
                      f"(last 3 turns): {guesses}"]
    return lines


def _long_summary(long: Long, checkpoints: Sequence[int]) -> str:
    if not long.turns:
        return f"{long.phase.name}: no turn ran"
    marks = sorted({1, *(c for c in checkpoints if long.at(c)), long.turns[-1].turn})
    text = f"{long.phase.name} one conversation, bytes added by turn " + ", ".join(
        f"{k}: {_size(t.delta.total)}" for k in marks if (t := long.at(k)) is not None)
    if long.stopped:
        text += f" ({long.stopped.split(':')[0]}, x{long.growth():.2f}/turn)"
    return text


def summary(chat: Phase, longs: Sequence[Long], checkpoints: Sequence[int]) -> str:
    d = chat.delta
    text = (f"summary: offline:chat {chat.turns} turns / {chat.conversations} conversations: used_memory "
            f"{_size(chat.used_delta / chat.turns)}/turn, key bytes {_size(d.total / chat.turns)}/turn, "
            f"{100 * d.group_bytes('turn') / d.total if d.total > 0 else math.nan:.0f}% of them per-turn copies "
            f"({_size(d.group_bytes('turn') / chat.turns)}/turn) vs conversation rows "
            f"{_size(d.group_bytes('conv') / chat.turns)}/turn")
    return "; ".join([text, *(_long_summary(long, checkpoints) for long in longs)]) + "."


# --- main ----------------------------------------------------------------------------------------


def run(opts: Options, workdir: Path) -> tuple[str, Phase, Long, Long]:
    processes = Processes(workdir / "logs")
    server = Server(processes, workdir / "server", kind="redis")
    prefix = f"tlmem{uuid.uuid4().hex[:6]}"
    client: Client | None = None
    try:
        url = server.start()
        progress(f"{server.version} at {url}; starting {WORKERS} worker processes")
        workers = start_workers(processes, url, prefix, opts.threads)
        client = Client(url, prefix=prefix)
        wait_ready(client, prefix, workers)
        chat_agent, echo_agent = put_agents(client)
        for agent in (chat_agent, echo_agent):  # warm-up (imports, scripts, queue keys); not measured
            Conversation(agent, 1, "warm-up").run(client, opts.timeout_s)
        progress(f"offline:chat: {opts.turns} turns over {opts.conversations} conversations")
        chat = run_chat(opts, client, prefix, chat_agent, workers)
        progress(f"offline:echo: one conversation, up to {opts.long_turns} turns")
        echo = run_long(opts, client, prefix, echo_agent, "offline:echo", workers)
        progress(f"offline:chat: one conversation, up to {opts.long_turns} turns")
        chat_long = run_long(opts, client, prefix, chat_agent, "offline:chat", workers)
        return server.version, chat, echo, chat_long
    finally:
        if client is not None:
            client.close()
        processes.stop_all()
        server.stop()


def main(argv: Sequence[str] | None = None) -> None:
    opts = parse_args(argv)
    with bench_session("bench.memory", argv, keep=opts.keep) as (command, workdir):
        version, chat, echo, chat_long = run(opts, workdir)
        lines = [f"command: `{command}`",
                 f"server: {version} (fresh, no persistence); {WORKERS} worker processes x {opts.threads} threads; "
                 f"{opts.parallel} conversations at once", "",
                 *render_phase(chat), "", *render_phase(echo.phase), "",
                 *render_long(opts, echo, "offline:echo, bytes added by one turn at turn k of one conversation"), "",
                 *render_long(opts, chat_long, "For contrast, offline:chat (answers quote only the earlier "
                                               "questions), bytes added by one turn at turn k of one conversation"),
                 "", summary(chat, [echo, chat_long], opts.checkpoints)]
        print("\n".join(lines))


if __name__ == "__main__":
    main()
