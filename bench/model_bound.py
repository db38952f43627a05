"""A burst of model-bound turns: `--turns` turns of a model that streams for `--model-s` seconds at a
real model's pace, submitted at once to `--processes` worker processes with the settings they are
given (the defaults unless `--tl-env NAME=VALUE`), on a fresh server.

While the burst runs, `--cancels` turns are cancelled `--cancel-after-s` into it: half of them while
their text streams, half while they still wait in a queue. Reported:

- wall time from the first submit to the last terminal event, and the effective concurrency (the sum
  of the turns' model-stage times over the wall time) and the peak number of model stages running;
- worker RSS (the processes and their children: before the burst, at the peak, at the end; and
  what 100 open calls add) and CPU (user + system);
- the fast stages' run time (resolve, history, map) and the queue hops before history and map, from
  the ids of the turns' event stream entries (the server's clock);
- cancel latency, from `cancel` returning to the turn's terminal `cancelled` entry, for running and
  for queued turns;
- the idle path during the burst: a lone probe turn (`offline:echo`) submitted every
  `--probe-every-s`, its fast stages' run times and queue hops.

    .venv/bin/python -m bench.model_bound --turns 1000 --model-s 5
"""

from __future__ import annotations

import argparse
import os
import random
import threading
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from pydantic_ai.messages import ModelMessage
from pydantic_ai.models.function import AgentInfo, FunctionModel

from threadline.pipeline.config import AgentConfig
from threadline.pipeline.events import TERMINAL_TYPES

from .procs import Child, Processes, Server, bench_session, progress
from .stats import Summary
from .systems import ThreadlineSystem, entry_ms

#: The issue's targets (#27), for the verdict column.
TARGET_WALL_S = 15.0
TARGET_FAST_STAGE_P99_MS = 50.0
TARGET_QUEUED_CANCEL_MS = 1000.0
TARGET_RUNNING_CANCEL_P99_MS = 50.0
PROBE_AGENT = "probe"


def paced(options: dict[str, Any]) -> FunctionModel:
    """Streams `words` words, one every `delay_ms`, as a hosted model does."""
    import asyncio

    words, delay = int(options.get("words", 25)), float(options.get("delay_ms", 200)) / 1000

    async def stream(messages: list[ModelMessage], info: AgentInfo) -> AsyncIterator[str]:
        for i in range(words):
            await asyncio.sleep(delay)
            yield f"w{i} "

    return FunctionModel(stream_function=stream, model_name="bench:paced")


@dataclass
class Resources:
    """Worker processes' RSS and CPU, sampled from /proc (the processes and their children)."""

    pids: list[int]
    idle_rss_mib: float = 0.0
    peak_rss_mib: float = 0.0
    samples: list[float] = field(default_factory=list)

    def tree(self) -> list[int]:
        found, todo = [], list(self.pids)
        while todo:
            pid = todo.pop()
            found.append(pid)
            try:
                with open(f"/proc/{pid}/task/{pid}/children") as handle:
                    todo.extend(int(c) for c in handle.read().split())
            except OSError:
                pass
        return found

    def rss_mib(self) -> float:
        total = 0
        for pid in self.tree():
            try:
                with open(f"/proc/{pid}/status") as handle:
                    total += next(int(line.split()[1]) for line in handle if line.startswith("VmRSS:"))
            except (OSError, StopIteration):
                pass
        return total / 1024

    def cpu_s(self) -> float:
        ticks = os.sysconf("SC_CLK_TCK")
        total = 0
        for pid in self.tree():
            try:
                with open(f"/proc/{pid}/stat") as handle:
                    fields = handle.read().rsplit(")", 1)[1].split()
                total += int(fields[11]) + int(fields[12])
            except OSError:
                pass
        return total / ticks

    def sample(self) -> None:
        rss = self.rss_mib()
        self.samples.append(rss)
        self.peak_rss_mib = max(self.peak_rss_mib, rss)


@dataclass
class Burst:
    wall_s: float
    statuses: dict[str, int]
    model_s: list[float]
    peak_concurrency: int
    fast_stage_ms: dict[str, list[float]]
    cancel_ms: dict[str, list[float]]
    #: The probe turns' fast stages (one turn submitted every `--probe-every-s` while the burst runs).
    probe_ms: dict[str, list[float]] = field(default_factory=dict)


def request(agent_id: str, turn_id: str) -> dict[str, Any]:
    return {"tenant_id": "bench", "app_id": "bench", "user_id": "u1", "agent_id": agent_id,
            "query": "Tell me about my order.", "turn_id": turn_id}


def terminal_count(system: ThreadlineSystem, ids: Sequence[str]) -> int:
    """How many of the turns have a terminal entry (the last entry of each stream, pipelined)."""
    pipe = system.client.redis.pipeline(transaction=False)
    for turn_id in ids:
        pipe.xrevrange(system.client.keys.events(turn_id), count=1)
    done = 0
    for entries in pipe.execute():
        if entries and _event(entries[0][1]).get("type") in TERMINAL_TYPES:
            done += 1
    return done


def _event(fields: dict[bytes, bytes]) -> dict[str, Any]:
    import json

    return dict(json.loads(fields[b"json"]))


def pick_cancels(system: ThreadlineSystem, ids: Sequence[str], count: int) -> tuple[list[str], list[str]]:
    """Up to `count // 2` turns whose text streams and as many whose model call has not started (in
    a queue: the invoke stage's, usually)."""
    streaming, queued = [], []
    want = count // 2
    for turn_id in random.sample(list(ids), len(ids)):
        seen = [_event(f) for _, f in system.client.redis.xrange(system.client.keys.events(turn_id))]
        kinds = {e.get("type") for e in seen}
        if kinds & TERMINAL_TYPES:
            continue
        if "text_delta" in kinds and len(streaming) < want:
            streaming.append(turn_id)
        elif not any(e.get("stage") == "invoke" for e in seen) and len(queued) < count - want:
            queued.append(turn_id)
        if len(streaming) >= want and len(queued) >= count - want:
            break
    return streaming, queued


def probe(system: ThreadlineSystem, probes: list[str], stop: threading.Event, every_s: float) -> None:
    """The idle path while the burst runs: a lone turn every `every_s`, whose fast stages are timed
    (its model call queues behind the burst's)."""
    while every_s and not stop.wait(every_s):
        probes.append(system.client.submit(request(PROBE_AGENT, uuid.uuid4().hex)).turn_id)


def run_burst(system: ThreadlineSystem, agent_id: str, args: argparse.Namespace, res: Resources) -> Burst:
    ids = [uuid.uuid4().hex for _ in range(args.turns)]
    cancelled_at: dict[str, tuple[str, float]] = {}
    probes: list[str] = []
    stop = threading.Event()
    prober = partial(probe, system, probes, stop, args.probe_every_s)

    def sampler() -> None:
        while not stop.wait(0.25):
            res.sample()

    def canceller() -> None:
        if stop.wait(args.cancel_after_s) or not args.cancels:
            return
        streaming, queued = pick_cancels(system, ids, args.cancels)
        for kind, group in (("running", streaming), ("queued", queued)):
            for turn_id in group:
                system.client.cancel(turn_id, "bench")
                cancelled_at[turn_id] = (kind, time.time() * 1000)

    threads = [threading.Thread(target=target, daemon=True) for target in (sampler, canceller, prober)]
    t0 = time.perf_counter()
    for thread in threads:
        thread.start()
    for turn_id in ids:
        system.client.submit(request(agent_id, turn_id))
    progress(f"submitted {len(ids)} turns in {time.perf_counter() - t0:.2f} s")
    deadline = t0 + args.timeout_s
    while (done := terminal_count(system, ids)) < len(ids):
        if time.perf_counter() > deadline:
            raise TimeoutError(f"{len(ids) - done} turns did not end within {args.timeout_s:g} s")
        time.sleep(0.05)
    wall_s = time.perf_counter() - t0
    stop.set()
    for thread in threads:
        thread.join()
    burst = summarise(system, ids, wall_s, cancelled_at)
    burst.probe_ms = summarise(system, probes, wall_s, {}).fast_stage_ms
    return burst


def summarise(system: ThreadlineSystem, ids: Sequence[str], wall_s: float,
              cancelled_at: dict[str, tuple[str, float]]) -> Burst:
    statuses: dict[str, int] = {}
    model_s: list[float] = []
    intervals: list[tuple[int, int]] = []
    fast: dict[str, list[float]] = {"resolve": [], "history": [], "map": [], "hop→history": [], "hop→map": []}
    cancel_ms: dict[str, list[float]] = {"running": [], "queued": []}
    for turn_id in ids:
        entries = [(entry_ms(i.decode()), _event(f)) for i, f in
                   system.client.redis.xrange(system.client.keys.events(turn_id))]
        finished: dict[str, int] = {}
        started: dict[str, int] = {}
        for at, event in entries:
            if event.get("type") == "stage":
                stage = event["stage"]
                if event.get("status") == "started":
                    started.setdefault(stage, at)
                elif event.get("status") == "finished":
                    finished.setdefault(stage, at)
                    if stage in ("resolve", "history", "map"):
                        fast[stage].append(float(event.get("ms") or 0.0))
        for stage, before in (("history", "resolve"), ("map", "history")):
            if stage in started and before in finished:
                fast[f"hop→{stage}"].append(float(started[stage] - finished[before]))
        if "invoke" in started and "invoke" in finished:
            intervals.append((started["invoke"], finished["invoke"]))
            model_s.append((finished["invoke"] - started["invoke"]) / 1000)
        terminal = entries[-1][1]["type"] if entries else "none"
        statuses[terminal] = statuses.get(terminal, 0) + 1
        if turn_id in cancelled_at and terminal == "cancelled":
            kind, at_ms = cancelled_at[turn_id]
            cancel_ms[kind].append(entries[-1][0] - at_ms)
    return Burst(wall_s, statuses, model_s, _peak(intervals), fast, cancel_ms)


def _peak(intervals: Sequence[tuple[int, int]]) -> int:
    edges = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    running = peak = 0
    for _, delta in edges:
        running += delta
        peak = max(peak, running)
    return peak


def report(command: str, server: str, args: argparse.Namespace, burst: Burst, res: Resources, cpu_s: float) -> None:
    def row(name: str, values: Sequence[float], target: float | None = None) -> str:
        if not values:
            return f"| {name} | — | — | — | (none) |"
        s = Summary.of(list(values))
        verdict = "" if target is None else (f"p99 < {target:g}: " + ("pass" if s.p99 < target else "FAIL"))
        return f"| {name} | {s.p50:.1f} | {s.p99:.1f} | {s.max:.1f} | {verdict} |"

    effective = sum(burst.model_s) / burst.wall_s if burst.wall_s else 0.0
    env = " ".join(args.tl_env) or "defaults"
    print(f"\nCommand: `{command}`\nserver: {server}; {args.processes} worker processes ({env}); "
          f"{args.turns} turns of a {args.model_s:g} s streaming model at once\n")
    print("| figure | value | target |\n|---|---|---|")
    wall_ok = "pass" if burst.wall_s <= TARGET_WALL_S else "FAIL"
    print(f"| wall, first submit → last terminal event | {burst.wall_s:.1f} s | <= {TARGET_WALL_S:g} s "
          f"(1,000 turns of 5 s): {wall_ok} |")
    print(f"| terminal events | {burst.statuses} | one per turn |")
    print(f"| effective concurrency (model time / wall) | {effective:.0f} | |")
    print(f"| peak model stages running at once | {burst.peak_concurrency} | |")
    print(f"| worker RSS, before / peak / end | {res.idle_rss_mib:.0f} / {res.peak_rss_mib:.0f} / "
          f"{res.rss_mib():.0f} MiB | |")
    if burst.peak_concurrency:
        per_100 = (res.peak_rss_mib - res.idle_rss_mib) / burst.peak_concurrency * 100
        print(f"| RSS per 100 open calls ((peak - before) / peak open x 100) | {per_100:.1f} MiB | |")
    print(f"| worker CPU (user + system) | {cpu_s:.1f} s ({cpu_s / max(args.turns, 1) * 1000:.1f} ms a turn) | |")
    print("\n| during the burst, ms | p50 | p99 | max | target |\n|---|---|---|---|---|")
    for name, values in burst.fast_stage_ms.items():
        print(row(f"{name} (run time)" if not name.startswith("hop") else f"{name} (queue hop)", values,
                  TARGET_FAST_STAGE_P99_MS))
    for name, values in burst.probe_ms.items():
        print(row(f"probe turn: {name}" + (" (run time)" if not name.startswith("hop") else " (queue hop)"), values,
                  TARGET_FAST_STAGE_P99_MS))
    print(row("cancel → `cancelled`, a streaming turn", burst.cancel_ms["running"], TARGET_RUNNING_CANCEL_P99_MS))
    print(row("cancel → `cancelled`, a queued turn", burst.cancel_ms["queued"], TARGET_QUEUED_CANCEL_MS))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.model_bound", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", type=int, default=1000)
    parser.add_argument("--model-s", type=float, default=5.0, help="each turn's streaming time (default 5)")
    parser.add_argument("--words", type=int, default=25, help="words streamed over that time (default 25)")
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--cancels", type=int, default=20)
    parser.add_argument("--cancel-after-s", type=float, default=2.0)
    parser.add_argument("--timeout-s", type=float, default=600.0)
    parser.add_argument("--probe-every-s", type=float, default=0.5,
                        help="submit a lone probe turn this often while the burst runs (0: none)")
    parser.add_argument("--tl-env", action="append", default=[], metavar="NAME=VALUE",
                        help="a setting for the workers (repeatable), e.g. TL_THREADS=32")
    parser.add_argument("--keep", action="store_true", help="keep the run directory")
    args = parser.parse_args(argv)
    extra = dict(item.split("=", 1) for item in args.tl_env)
    with bench_session("bench.model_bound", argv, keep=args.keep) as (command, workdir):
        processes = Processes(workdir / "logs")
        server = Server(processes, workdir / "server")
        try:
            system = ThreadlineSystem(processes, server.start(), prefix=f"tlmb{uuid.uuid4().hex[:6]}", threads=8,
                                      env={"TL_ALLOW_PYTHON_PLUGINS": "1", "TL_LOG_LEVEL": "WARNING", **extra})
            workers: list[Child] = system.start(args.processes)
            agent_id = "paced"
            system.client.put_agent(AgentConfig.model_validate({
                "id": agent_id, "model": {"provider": "python", "name": "bench.model_bound:paced",
                                          "options": {"words": args.words,
                                                      "delay_ms": args.model_s * 1000 / args.words}}}))
            system.client.put_agent(AgentConfig.model_validate({"id": PROBE_AGENT, "model": "offline:echo"}))
            system.client.wait(system.client.submit(request(agent_id, uuid.uuid4().hex)).turn_id, timeout_s=120)
            res = Resources([w.proc.pid for w in workers])
            res.idle_rss_mib = res.rss_mib()
            cpu0 = res.cpu_s()
            burst = run_burst(system, agent_id, args, res)
            report(command, server.version, args, burst, res, res.cpu_s() - cpu0)
            system.close()
        finally:
            processes.stop_all()
            server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
