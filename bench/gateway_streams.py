"""1,000 concurrent SSE streams against ONE gateway process: does everyone else still get answers?

A fresh server and one `threadline gateway` process (its own OS process, as deployed). No worker
runs, so every turn submitted stays queued and its event stream stays open forever: the streams
are real `GET /v1/turns/{id}/events` of real (waiting) turns of one tenant ("crowd", whose key has
no rate or stream cap). A share of them is live: the harness appends `text_delta` events to their
turns' streams (XADD, as `emit.lua` does), so the one reader also fans out while the others wait;
their delivery delay is measured (write → the SSE line read back, one process and clock).

The streams are opened, and the live ones fed and read, by a client process of their own (its
event and the crowd's stream share the same clock: the delivery delay above is measured there);
the harness's process measures the rest. With every stream open, for `--seconds`: another
tenant's `GET /v1/conversations` (p50/p99; target p99 < 100 ms) and `GET /healthz` (target: 200
every time), the same measured before any stream was opened for comparison; the gateway's RSS and
CPU (from /proc) before and with the streams open, and the machine's load average (on a shared
2-core machine the probe's latency is mostly other processes' CPU); and the Redis connections the
gateway holds (`CLIENT LIST`, by the names its connections give themselves,
`tl-gateway:<pid>:<kind>`; target: at most TL_GATEWAY_POOL + 3, whatever the number of streams).

    .venv/bin/python -m bench.gateway_streams --streams 1000 --live 100 --seconds 20
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path

import httpx
import redis

from tests.support.gateway import gateway_connections
from threadline.pipeline.config import AgentConfig
from threadline.workers.clients.client import Client
from threadline.workers.settings import Settings
from threadline.workers.storage.api_keys import KeyRing, Limits

from .procs import Processes, Server, bench_session, free_port, progress, python_env
from .stats import percentile

P99_TARGET_MS = 100.0


@dataclass
class Figures:
    baseline_ms: list[float] = field(default_factory=list)
    loaded_ms: list[float] = field(default_factory=list)
    health: list[int] = field(default_factory=list)
    health_ms: list[float] = field(default_factory=list)
    other_codes: list[int] = field(default_factory=list)
    delivery_ms: list[float] = field(default_factory=list)
    written: int = 0
    opened: int = 0
    open_s: float = 0.0
    still_open: int = 0
    rss_idle_kb: int = 0
    rss_loaded_kb: int = 0
    connections: dict[str, int] = field(default_factory=dict)
    server_clients: int = 0
    #: The gateway's CPU (share of one core) while the probe measured, with and without streams.
    cpu_idle: float = 0.0
    cpu_loaded: float = 0.0
    load: str = ""


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) the process has used."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextlib.contextmanager
def cpu_share(pid: int, into: list[float]) -> Iterator[None]:
    t0, c0 = time.monotonic(), cpu_s(pid)
    yield
    into.append((cpu_s(pid) - c0) / (time.monotonic() - t0))


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


async def probe(http: httpx.AsyncClient, other: str, seconds: float, codes: list[int], times: list[float],
                health: list[int], health_ms: list[float]) -> None:
    """Another tenant's listing and the probe, each about 10 times a second, for `seconds`."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        t0 = time.perf_counter()
        listed = await http.get("/v1/conversations", headers={"Authorization": f"Bearer {other}"})
        times.append((time.perf_counter() - t0) * 1000)
        codes.append(listed.status_code)
        t0 = time.perf_counter()
        health.append((await http.get("/healthz")).status_code)
        health_ms.append((time.perf_counter() - t0) * 1000)
        await asyncio.sleep(0.1)


async def read_live(response: httpx.Response, delays: list[float]) -> None:
    """Read one live stream; every text_delta carries its write time (this process's clock)."""
    async for line in response.aiter_lines():
        if line.startswith("data: "):
            event = json.loads(line.removeprefix("data: "))
            if event.get("type") == "text_delta":
                delays.append((time.time() - float(event["text"])) * 1000)


async def write_live(r: redis.asyncio.Redis, client: Client, turns: Sequence[str], seconds: float,
                     per_s: float) -> int:
    """Append a text_delta to every live turn's stream `per_s` times a second; entries written."""
    written, seq = 0, 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        seq += 1
        async with r.pipeline(transaction=False) as pipe:
            for turn_id in turns:
                event = {"type": "text_delta", "turn_id": turn_id, "seq": seq, "text": f"{time.time():.6f}"}
                pipe.xadd(client.keys.events(turn_id), {"json": json.dumps(event)})
            await pipe.execute()
        written += len(turns)
        await asyncio.sleep(1 / per_s)
    return written


def crowd(base: str, url: str, prefix: str, key: str, turns: list[str], opts: argparse.Namespace,
          conn: Connection) -> None:
    """The crowd, in a process of its own (so its parsing does not slow the probe's client): open
    every stream, tell the harness, feed and read the live ones until told to stop, report."""
    asyncio.run(_crowd(base, url, prefix, key, turns, opts, conn))


async def _crowd(base: str, url: str, prefix: str, key: str, turns: list[str], opts: argparse.Namespace,
                 conn: Connection) -> None:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    client = Client(url, prefix=prefix)
    delays: list[float] = []
    async with httpx.AsyncClient(base_url=base, limits=limits, timeout=60) as http, \
            contextlib.AsyncExitStack() as stack:
        t0 = time.perf_counter()

        async def one(turn_id: str) -> httpx.Response:
            return await stack.enter_async_context(
                http.stream("GET", f"/v1/turns/{turn_id}/events", headers={"Authorization": f"Bearer {key}"}))

        responses: list[httpx.Response] = []
        for start in range(0, len(turns), 100):
            responses += await asyncio.gather(*(one(t) for t in turns[start:start + 100]))
        conn.send({"opened": sum(r.status_code == 200 for r in responses), "open_s": time.perf_counter() - t0})
        readers = [asyncio.ensure_future(read_live(r, delays)) for r in responses[:opts.live]]
        aredis = redis.asyncio.Redis.from_url(url)
        written = await write_live(aredis, client, turns[:opts.live], opts.seconds, opts.live_per_s)
        await asyncio.sleep(1.0)  # the last writes' deliveries
        conn.send({"written": written, "delivery_ms": delays, "still_open": sum(not r.is_closed for r in responses)})
        await asyncio.get_running_loop().run_in_executor(None, conn.recv)  # the harness has measured
        for reader in readers:
            reader.cancel()
        await aredis.aclose()
    client.close()


async def measure(base: str, url: str, prefix: str, client: Client, pid: int, opts: argparse.Namespace) -> Figures:
    figures = Figures()
    ring = KeyRing(client.redis, client.keys)
    crowd_key = ring.create("crowd", name="bench crowd", limits=Limits(rps=0, turns_per_min=0, streams=0))[0]
    other_key = ring.create("other", name="bench other")[0]
    # an agent that exists (turns of an unknown one are refused at once); no worker runs on this prefix
    client.put_agent(AgentConfig.model_validate({"id": "none", "model": "offline:echo"}))
    turns = [str(client.start({"tenant_id": "crowd", "app_id": "bench", "user_id": "u", "agent_id": "none",
                               "query": "wait"}, owner="crowd")) for _ in range(opts.streams)]
    r = redis.Redis.from_url(url)
    async with httpx.AsyncClient(base_url=base, timeout=60) as http:
        progress("baseline: no stream open")
        share: list[float] = []
        with cpu_share(pid, share):
            await probe(http, other_key, min(5.0, opts.seconds), figures.other_codes, figures.baseline_ms, [], [])
        figures.rss_idle_kb = rss_kb(pid)
        progress(f"opening {opts.streams} streams from a client process of their own")
        here, there = multiprocessing.get_context("spawn").Pipe()
        child = multiprocessing.get_context("spawn").Process(
            target=crowd, args=(base, url, prefix, crowd_key, turns, opts, there), daemon=True)
        child.start()
        try:
            opened = await asyncio.get_running_loop().run_in_executor(None, here.recv)
            figures.opened, figures.open_s = opened["opened"], opened["open_s"]
            progress(f"{figures.opened} streams open in {figures.open_s:.1f} s; measuring for {opts.seconds} s")
            with cpu_share(pid, share):
                await probe(http, other_key, opts.seconds, figures.other_codes, figures.loaded_ms, figures.health,
                            figures.health_ms)
            figures.cpu_idle, figures.cpu_loaded = share
            figures.load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
            figures.rss_loaded_kb = rss_kb(pid)
            figures.connections = gateway_connections(r, pid)
            figures.server_clients = len(r.client_list())
            report = await asyncio.get_running_loop().run_in_executor(None, here.recv)
            figures.written, figures.delivery_ms = report["written"], report["delivery_ms"]
            figures.still_open = report["still_open"]
            here.send("done")
            child.join(timeout=30)
        finally:
            if child.is_alive():
                child.kill()
    r.close()
    return figures


def render(f: Figures, opts: argparse.Namespace, version: str, command: str) -> list[str]:
    pool = Settings.from_env({}).gateway_pool
    p99 = percentile(f.loaded_ms, 99)
    ok_health = bool(f.health) and set(f.health) == {200}
    connections = sum(f.connections.values())
    kinds = ", ".join(f"{k} {v}" for k, v in sorted(f.connections.items()))
    verdict = {True: "PASS", False: "FAIL"}
    return [
        f"command: `{command}`",
        f"server: {version} (fresh); one gateway process; {opts.streams} streams of queued turns "
        f"(no worker), {opts.live} of them live ({opts.live_per_s:g} events/s each)", "",
        "| figure | value | target | verdict |", "|---|---|---|---|",
        f"| streams open (200) | {f.opened}/{opts.streams}, opened in {f.open_s:.1f} s; "
        f"{f.still_open} still open at the end | all | {verdict[f.opened == f.still_open == opts.streams]} |",
        f"| other tenant `GET /v1/conversations`, no stream open | p50 {percentile(f.baseline_ms, 50):.1f} ms, "
        f"p99 {percentile(f.baseline_ms, 99):.1f} ms ({len(f.baseline_ms)} requests) | | |",
        f"| other tenant `GET /v1/conversations`, streams open | p50 {percentile(f.loaded_ms, 50):.1f} ms, "
        f"p99 {p99:.1f} ms, max {max(f.loaded_ms, default=0):.1f} ms ({len(f.loaded_ms)} requests) | "
        f"p99 < {P99_TARGET_MS:.0f} ms | {verdict[p99 < P99_TARGET_MS]} |",
        f"| other tenant's answers | {sorted(set(f.other_codes))} | 200 | {verdict[set(f.other_codes) == {200}]} |",
        f"| `/healthz`, streams open | {f.health.count(200)}/{len(f.health)} answered 200, "
        f"p99 {percentile(f.health_ms, 99):.1f} ms | 200 throughout | {verdict[ok_health]} |",
        f"| live events delivered | {len(f.delivery_ms)}/{f.written}, delay p50 {percentile(f.delivery_ms, 50):.1f} ms,"
        f" p99 {percentile(f.delivery_ms, 99):.1f} ms | all | {verdict[len(f.delivery_ms) == f.written]} |",
        f"| gateway RSS | {f.rss_idle_kb / 1024:.0f} MiB idle, {f.rss_loaded_kb / 1024:.0f} MiB with the streams "
        f"open (+{(f.rss_loaded_kb - f.rss_idle_kb) / max(1, opts.streams):.0f} KiB a stream) | report | |",
        f"| gateway CPU (of one core) | {f.cpu_idle:.0%} with no stream, {f.cpu_loaded:.0%} with the streams open; "
        f"machine load average {f.load} ({os.cpu_count()} cores) | report | |",
        f"| gateway's Redis connections | {connections} ({kinds}); {f.server_clients} clients on the server in all "
        f"| <= {pool + 3} | {verdict[connections <= pool + 3]} |",
    ]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.gateway_streams", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=1000, help="event streams to hold open (default 1000)")
    parser.add_argument("--live", type=int, default=100, help="of them, streams that get events (default 100)")
    parser.add_argument("--live-per-s", type=float, default=5.0, help="events per live stream and second (default 5)")
    parser.add_argument("--seconds", type=float, default=20.0, help="how long to measure with them open (default 20)")
    parser.add_argument("--keep", action="store_true", help="keep the run directory")
    opts = parser.parse_args(argv)
    with bench_session("bench.gateway_streams", argv, keep=opts.keep) as (command, workdir):
        processes = Processes(workdir / "logs")
        server = Server(processes, workdir / "server")
        try:
            url = server.start()
            prefix = f"tlgs{uuid.uuid4().hex[:6]}"
            port = free_port()
            env = python_env({"REDIS_URL": url, "TL_PREFIX": prefix, "TL_LOG_FORMAT": "json"})
            gateway = processes.spawn("gateway", [sys.executable, "-m", "threadline.workers.cli", "gateway",
                                                  "--port", str(port), "--no-console"], env)
            base = f"http://127.0.0.1:{port}"
            wait_healthy(base, gateway.alive)
            progress(f"{server.version} at {url}; gateway pid {gateway.proc.pid} on {base}")
            client = Client(url, prefix=prefix)
            try:
                figures = asyncio.run(measure(base, url, prefix, client, gateway.proc.pid, opts))
            finally:
                client.close()
        finally:
            processes.stop_all()
            server.stop()
        print("\n".join(render(figures, opts, server.version, command)))


def wait_healthy(base: str, alive: object, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"{base}/healthz", timeout=1).status_code == 200:
                return
        time.sleep(0.1)
    raise TimeoutError(f"the gateway at {base} did not answer")


if __name__ == "__main__":
    main()
