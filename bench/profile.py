"""Where a turn's work goes: `python -m bench.profile [--turns 300] [--inflight 50]`.

`bench.run` says how much a turn costs; this says what it is spent on, so that a cut can aim at
the biggest item and be measured again with the same command. One run starts its own server and
one Threadline worker process (`--threads` threads), warms it up, then:

1. idle: `--idle-s` of the idle process alone, every command it sends, by name and by script;
2. saturated: `--turns` turns of `offline:echo` on new conversations (with `--conversation-turns N`,
   each conversation takes N turns one after another: N - 1 follow-ups), `--inflight` kept in flight
   (closed loop), metered from the first submission to the last terminal event. While it runs the
   server's `MONITOR` is written to a file by `redis-cli` (the commands a Lua script runs follow
   the EVALSHA that runs it, marked `lua`), `SLOWLOG` records every top-level command with its
   server time (`slowlog-log-slower-than 0`), and, when `py-spy` is on PATH or given with
   `--py-spy`, the worker process is sampled.

It prints markdown tables, per turn: commands by name; EVALSHA by script (the sha mapped back to
`workers/storage/scripts/*.lua`; `dispatch.lua`, ours or dramatiq's, named by its command) with the commands
each runs inside and its server time; the same per stage (a script's `stage` field, or the queue a
dramatiq command names); and where the worker's CPU goes (py-spy samples by function, self and
inclusive, and by package). MONITOR and SLOWLOG slow the server down: the run's own CPU and
throughput figures are not comparable with `bench.run`'s, its counts are.
"""

from __future__ import annotations

import argparse
import hashlib
import re
import shutil
import subprocess
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, get_args

import redis

from threadline.pipeline.contracts import new_conversation_id
from threadline.pipeline.stages import DEFAULT_GRAPH

try:
    from threadline.workers.storage import lua
except ImportError:  # the layout before issue #19 (eb2b1e3): profiling an older commit
    from threadline.workers import lua  # type: ignore[no-redef,attr-defined]

from .procs import Processes, Server, bench_session, progress
from .stats import HARNESS_COMMANDS, WAIT_COMMANDS, process_cpu_s, server_cpu_s, server_reads
from .systems import ThreadlineSystem, ended

_TOKEN = re.compile(r'"((?:[^"\\]|\\.)*)"')
_LINE = re.compile(r"^\d+\.\d+ \[\d+ ([^\]]+)\] (.*)$")
_STAGE = re.compile(r'\\"stage\\":\\"([A-Za-z0-9_.-]+)\\"')
#: What is not a turn's cost: the harness's own reads and the run's bookkeeping.
NOT_COUNTED = HARNESS_COMMANDS | WAIT_COMMANDS | {"slowlog", "slowlog|get", "slowlog|reset", "config|set",
                                                  "monitor", "select"}


def script_names() -> dict[str, str]:
    """sha1 → script name: ours (as `lua.source` builds them) and dramatiq's (`dramatiq:`)."""
    names = {hashlib.sha1(lua.source(n).encode()).hexdigest(): n for n in get_args(lua.ScriptName)}
    folder = resources.files("dramatiq.brokers").joinpath("redis")
    for entry in folder.iterdir():
        if entry.name.endswith(".lua"):
            names[hashlib.sha1(entry.read_bytes()).hexdigest()] = "dramatiq:" + entry.name.removesuffix(".lua")
    return names


@dataclass
class Tally:
    """Commands seen in a MONITOR capture, attributed to the script that ran them and a stage."""

    calls: Counter[str] = field(default_factory=Counter)  # top-level command or script → round trips
    inner: Counter[str] = field(default_factory=Counter)  # script → commands run inside it
    inner_names: dict[str, Counter[str]] = field(default_factory=lambda: defaultdict(Counter))
    by_name: Counter[str] = field(default_factory=Counter)  # every command by name (inner too)
    stage_calls: Counter[str] = field(default_factory=Counter)
    stage_commands: Counter[str] = field(default_factory=Counter)

    def total(self) -> int:
        return sum(self.by_name.values())


def _label(tokens: list[str], shas: dict[str, str], queues: dict[str, str]) -> tuple[str, str]:
    """(what ran, its stage) for one top-level command."""
    command = tokens[0].lower()
    if command not in ("evalsha", "eval") or len(tokens) < 3:
        return command, "-"
    name = shas.get(tokens[1], f"sha:{tokens[1][:8]}")
    numkeys = int(tokens[2]) if tokens[2].isdigit() else 0
    args = tokens[3 + numkeys:]
    if name == "dramatiq:dispatch" and len(args) >= 3:  # stock dramatiq's (the bare chain's)
        queue = args[2]
        return f"dramatiq:{args[0]}", queues.get(queue.removesuffix(".DQ"), queue)
    if name == "dispatch" and numkeys and args:  # ours: KEYS[1] is the queue
        queue = tokens[3].rpartition(":q:")[2].removesuffix(".msgs")
        return f"dispatch:{args[0]}", queues.get(queue.removesuffix(".DQ"), queue)
    stage = next((m.group(1) for a in args[:1] if (m := _STAGE.search(a))), "-")
    return name, stage


def parse_monitor(path: Path, shas: dict[str, str], queues: dict[str, str]) -> Tally:
    tally = Tally()
    current, stage = "", "-"
    for line in path.read_text(errors="replace").splitlines():
        m = _LINE.match(line)
        if m is None:
            continue
        tokens = _TOKEN.findall(m.group(2))
        if not tokens:
            continue
        command = tokens[0].lower()
        if m.group(1) == "lua":
            tally.by_name[command] += 1
            tally.inner[current] += 1
            tally.inner_names[current][command] += 1
            tally.stage_commands[stage] += 1
            continue
        if command in NOT_COUNTED:
            current, stage = "", "-"
            continue
        current, stage = _label(tokens, shas, queues)
        tally.by_name[command] += 1
        tally.calls[current] += 1
        tally.stage_calls[stage] += 1
        tally.stage_commands[stage] += 1
    return tally


def slowlog_usec(client: redis.Redis, shas: dict[str, str], queues: dict[str, str]) -> Counter[str]:
    """Server µs per top-level command or script, from SLOWLOG (every command logged)."""
    usec: Counter[str] = Counter()
    for entry in client.slowlog_get(10_000_000):
        raw = entry["command"]
        tokens = (raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)).split(" ")
        if not tokens or tokens[0].lower() in NOT_COUNTED:
            continue
        usec[_label(tokens, shas, queues)[0]] += int(entry["duration"])
    return usec


class Monitor:
    """`redis-cli MONITOR` into a file for the length of a `with` block."""

    def __init__(self, url: str, path: Path) -> None:
        self.url, self.path = url, path
        self._proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Monitor:
        binary = shutil.which("redis-cli")
        if binary is None:
            raise SystemExit("bench.profile needs redis-cli on PATH")
        self._file = open(self.path, "wb")
        self._proc = subprocess.Popen([binary, "-u", self.url, "monitor"], stdout=self._file,
                                      stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
        time.sleep(0.3)
        return self

    def __exit__(self, *exc: object) -> None:
        time.sleep(0.2)
        assert self._proc is not None
        self._proc.terminate()
        self._proc.wait(timeout=5)
        self._file.close()


class PySpy:
    """Samples a process with py-spy (collapsed stacks) while a `with` block runs; no-op without it."""

    def __init__(self, binary: str | None, pid: int, path: Path, rate: int) -> None:
        self.binary, self.pid, self.path, self.rate = binary, pid, path, rate
        self._proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> PySpy:
        if self.binary:
            self._proc = subprocess.Popen(
                [self.binary, "record", "--pid", str(self.pid), "--format", "raw", "--rate", str(self.rate),
                 "--output", str(self.path), "--nonblocking", "--gil"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
            time.sleep(1.0)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._proc is not None:
            self._proc.send_signal(2)  # SIGINT: py-spy writes its output and exits
            self._proc.wait(timeout=30)


def _frame_name(frame: str) -> str:
    """`func (path/to/module.py:12)` → `func (module.py)`; py-spy's raw format."""
    m = re.match(r"(.*) \((.*?):\d+\)$", frame.strip())
    if m is None:
        return frame.strip()
    path = m.group(2)
    short = "/".join(path.split("/")[-2:])
    return f"{m.group(1)} ({short})"


#: Packages a sample is charged to: the innermost frame from a file under one of these (py-spy
#: names files by their path below site-packages, or the project root).
PACKAGES = (("redis client", "(redis/"), ("dramatiq", "(dramatiq/"), ("pydantic-ai", "(pydantic_ai/"),
            ("pydantic", "(pydantic"), ("structlog", "(structlog/"), ("logging", "(logging/"),
            ("prometheus_client", "(prometheus_client/"), ("opentelemetry", "(opentelemetry/"),
            ("json", "(json/"), ("asyncio", "(asyncio/"), ("selectors", "(selectors.py"), ("anyio", "(anyio/"),
            ("threading", "(threading.py"), ("threadline.pipeline", "(pipeline/"),
            ("threadline.workers", "(workers/"))


def _ours(frames: Sequence[str]) -> str:
    """The innermost frame of the project's own code: which of our code paths a sample serves."""
    for frame in reversed(frames):
        if "(workers/" in frame or "(pipeline/" in frame:
            return _frame_name(frame)
    return "(no frame of ours)"


def spy_tables(path: Path, turns: int, top: int) -> list[str]:
    if not path.exists():
        return ["(no py-spy profile: install py-spy or pass --py-spy)"]
    self_samples: Counter[str] = Counter()
    incl: Counter[str] = Counter()
    package: Counter[str] = Counter()
    ours: Counter[str] = Counter()
    total = 0
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = [f for f in stack.split(";") if f.strip()]
        if not frames:
            continue
        total += count
        names = [_frame_name(f) for f in frames]
        self_samples[names[-1]] += count
        for name in set(names):
            incl[name] += count
        charged = "other"
        for frame in reversed(frames):
            hit = next((label for label, marker in PACKAGES if marker in frame), None)
            if hit is not None:
                charged = hit
                break
        package[charged] += count
        ours[_ours(frames)] += count
    if not total:
        return ["(py-spy recorded no samples)"]
    lines = [f"py-spy samples of the worker process holding the GIL (`--gil`): {total}", "",
             "| package (innermost frame) | share |", "|---|---|"]
    lines += [f"| {name} | {n / total:.1%} |" for name, n in package.most_common()]
    lines += ["", "| innermost function of ours (its library calls included) | share |", "|---|---|"]
    lines += [f"| `{name}` | {n / total:.1%} |" for name, n in ours.most_common(top)]
    lines += ["", "| function (self) | share |", "|---|---|"]
    lines += [f"| `{name}` | {n / total:.1%} |" for name, n in self_samples.most_common(top)]
    lines += ["", "| function (inclusive) | share |", "|---|---|"]
    lines += [f"| `{name}` | {n / total:.1%} |" for name, n in incl.most_common(top)]
    return lines


def closed_loop(tl: ThreadlineSystem, agent: str, turns: int, inflight: int, timeout_s: float = 300,
                per_conversation: int = 1) -> dict[str, int]:
    """Run `turns` turns with `inflight` in flight, each conversation `per_conversation` turns one
    after another; statuses of their terminal events."""
    following: dict[str, str] = {}
    #: per followed events key: its conversation and how many turns that conversation has had
    threads: dict[str, tuple[str, int]] = {}
    submitted = 0
    statuses: Counter[str] = Counter()

    def submit(conversation: str | None = None, had: int = 0) -> None:
        nonlocal submitted
        turn_id = uuid.uuid4().hex
        key = tl.client.keys.events(turn_id)
        following[key] = "0"
        threads[key] = (conversation or new_conversation_id(turn_id), had + 1)
        request = tl.request(agent, turn_id)
        if conversation is not None:
            request["conversation_id"] = conversation
        tl.client.submit(request)
        submitted += 1

    for _ in range(min(inflight, turns)):
        submit()
    deadline = time.perf_counter() + timeout_s
    while following:
        if time.perf_counter() > deadline:
            raise TimeoutError(f"{len(following)} turns did not end")
        reply = tl.client.redis.xread(dict[Any, Any](following), block=100, count=100)
        for key, _, event in ended(following, reply):
            statuses[event["type"]] += 1
            conversation, had = threads.pop(key)
            if submitted < turns:
                if had < per_conversation:
                    submit(conversation, had)
                else:
                    submit()
    return dict(statuses)


def render_tally(title: str, tally: Tally, per: float, unit: str, usec: Counter[str] | None = None) -> list[str]:
    lines = [f"### {title}", "", f"all commands (inside Lua included): {tally.total() / per:.1f} {unit}", "",
             f"| command | {unit} |", "|---|---|"]
    lines += [f"| {name} | {n / per:.2f} |" for name, n in tally.by_name.most_common()]
    head = "| top-level command or script | calls | commands inside | commands inside, by name |"
    if usec is not None:
        head += " server µs (SLOWLOG) |"
    lines += ["", head, "|---|---|---|---|" + ("---|" if usec is not None else "")]
    for name, n in tally.calls.most_common():
        inside = ", ".join(f"{c} {v / per:.1f}" for c, v in tally.inner_names[name].most_common(8))
        row = f"| {name} | {n / per:.2f} | {tally.inner[name] / per:.1f} | {inside} |"
        if usec is not None:
            row += f" {usec[name] / per:.0f} |"
        lines.append(row)
    lines += ["", "| stage (script's `stage`, or the queue) | round trips | commands (inside Lua included) |",
              "|---|---|---|"]
    lines += [f"| {s} | {tally.stage_calls[s] / per:.2f} | {n / per:.1f} |"
              for s, n in tally.stage_commands.most_common()]
    return lines


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.profile", description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=300, help="turns in the saturated run (default 300)")
    parser.add_argument("--inflight", type=int, default=50, help="turns kept in flight (default 50)")
    parser.add_argument("--conversation-turns", type=int, default=1,
                        help="turns per conversation, one after another (default 1: every turn a new one)")
    parser.add_argument("--threads", type=int, default=8, help="threads of the worker process (default 8)")
    parser.add_argument("--idle-s", type=float, default=10.0, help="idle window (default 10 s)")
    parser.add_argument("--py-spy", default=shutil.which("py-spy"), help="py-spy binary (default: on PATH)")
    parser.add_argument("--rate", type=int, default=200, help="py-spy samples per second (default 200)")
    parser.add_argument("--top", type=int, default=25, help="functions listed (default 25)")
    parser.add_argument("--tl-env", action="append", default=[], metavar="NAME=VALUE",
                        help="extra environment for the worker, e.g. TL_HEARTBEAT_S=5")
    parser.add_argument("--keep", action="store_true", help="keep the run's directory (MONITOR capture, profile)")
    a = parser.parse_args(argv)
    env = dict(item.split("=", 1) for item in a.tl_env)
    with bench_session("bench.profile", argv, keep=a.keep) as (command, workdir):
        print("\n".join(run(a, env, command, workdir)))


def run(a: argparse.Namespace, env: dict[str, str], command: str, workdir: Path) -> list[str]:
    from .run import code_version

    processes = Processes(workdir / "logs")
    server = Server(processes, workdir / "server", "redis")
    try:
        url = server.start()
        tl = ThreadlineSystem(processes, url, prefix=f"tlprof{uuid.uuid4().hex[:6]}", threads=a.threads, env=env)
        client = redis.Redis.from_url(url)
        shas = script_names()
        queues = {s.queue: s.name for s in DEFAULT_GRAPH.stages}
        worker = tl.start(1)[0]
        agent = tl.put_agent("offline:echo")
        progress(f"server {server.version}; warm-up")
        for _ in range(5):
            tl.turn(agent)
        closed_loop(tl, agent, 50, a.inflight)
        time.sleep(3)  # let the consumers settle into their idle polls

        progress(f"idle: {a.idle_s} s")
        client.config_resetstat()
        with Monitor(url, workdir / "idle.monitor"):
            t0 = time.monotonic()
            time.sleep(a.idle_s)
            idle_s = time.monotonic() - t0
        idle = parse_monitor(workdir / "idle.monitor", shas, queues)

        progress(f"saturated, counted: {a.turns} turns, {a.inflight} in flight (MONITOR; py-spy: {a.py_spy})")
        client.config_resetstat()
        spy = workdir / "worker.pyspy"
        with Monitor(url, workdir / "busy.monitor"), PySpy(a.py_spy, worker.proc.pid, spy, a.rate):
            statuses = closed_loop(tl, agent, a.turns, a.inflight, per_conversation=a.conversation_turns)
        time.sleep(2)
        progress(f"saturated, timed: {a.turns} turns (SLOWLOG only)")
        client.config_set("slowlog-max-len", 10_000_000)
        client.config_set("slowlog-log-slower-than", 0)
        client.slowlog_reset()
        cpu0, srv0, t0 = process_cpu_s([worker.proc.pid]), server_cpu_s(client), time.monotonic()
        reads0 = server_reads(client)
        timed = closed_loop(tl, agent, a.turns, a.inflight, per_conversation=a.conversation_turns)
        wall = time.monotonic() - t0
        cpu, srv = process_cpu_s([worker.proc.pid]) - cpu0, server_cpu_s(client) - srv0
        reads = server_reads(client) - reads0
        client.config_set("slowlog-log-slower-than", -1)
        usec = slowlog_usec(client, shas, queues)
        busy = parse_monitor(workdir / "busy.monitor", shas, queues)
        client.close()
        tl.close()
    finally:
        processes.stop_all()
        server.stop()

    n = a.turns
    lines = [f"command: `{command}`", f"code: {code_version()}",
             f"server: {server.version}; 1 worker process x {a.threads} threads; env overrides: {env or 'none'}", "",
             f"counted run: {n} turns {statuses} (MONITOR{' and py-spy' if a.py_spy else ''}); timed run: {n} turns "
             f"{timed} in {wall:.1f} s ({n / wall:.1f} turns/s with SLOWLOG on): worker CPU {cpu * 1000 / n:.1f} "
             f"ms/turn, server CPU {srv * 1000 / n:.2f} ms/turn, of which SLOWLOG's top-level commands "
             f"{sum(usec.values()) / n / 1000:.2f} ms; the server's read events {reads / n:.1f} per turn (a request, "
             f"or a pipeline of them, is one as a rule; the harness's XREADs and submissions included)", ""]
    lines += render_tally("Idle: one worker process, per second", idle, idle_s, "per s")
    lines += ["", *render_tally("Saturated: per turn", busy, n, "per turn", usec)]
    lines += ["", "### Worker CPU", "", *spy_tables(spy, n, a.top)]
    return lines


if __name__ == "__main__":
    main()
