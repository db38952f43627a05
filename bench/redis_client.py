"""What one command costs a worker's CPU in the asyncio Redis client, by how its connections are made:
`python -m bench.redis_client`.

A turn makes ~15 round trips from its worker's store (script calls, most of them), so the client's
own work per command is a part of the worker's CPU per turn that no change of Threadline's scripts
touches. Three ways of making the store's client, against a server started here (no other load):

- `store`: as a worker's store makes it (`StoreBase.connect`: a blocking pool, no socket timeout,
  the kernel's dead-peer detection, `untimed_socket_options`);
- `timed`: the same pool with redis-py's default socket options (a 5 s timeout on every command);
- `plain`: redis-py's non-blocking pool, no socket timeout (it raises when full, so a worker's
  hundreds of model calls cannot use it; for scale only).

Each row: the CPU time (`time.process_time`) per call of a short script (`EVALSHA`, as the stages
call theirs) and of a `GET`, on the event loop `TL_EVENT_LOOP` names (`auto`: uvloop where
installed); the settings alternate over `--rounds` rounds and each figure is the median of its
rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from threadline.workers.settings import Settings
from threadline.workers.storage.base import POOL_CONNECTIONS, POOL_TIMEOUT_S
from threadline.workers.storage.connect import async_client, untimed_socket_options
from threadline.workers.worker.loops import loop_factory

from .procs import Processes, Server

SCRIPT = "return redis.call('HGET', KEYS[1], ARGV[1])"


def clients(url: str) -> dict[str, aioredis.Redis]:
    return {
        "store": async_client(url, max_connections=POOL_CONNECTIONS, timeout_s=POOL_TIMEOUT_S,
                              **untimed_socket_options(url)),
        "timed": async_client(url, max_connections=POOL_CONNECTIONS, timeout_s=POOL_TIMEOUT_S),
        "plain": aioredis.Redis(connection_pool=aioredis.ConnectionPool.from_url(
            url, max_connections=POOL_CONNECTIONS, socket_timeout=None)),
    }


async def cpu_us(call: Callable[[], Awaitable[Any]], calls: int) -> float:
    started = time.process_time()
    for _ in range(calls):
        await call()
    return 1e6 * (time.process_time() - started) / calls


async def measure(url: str, *, calls: int, rounds: int) -> dict[tuple[str, str], list[float]]:
    made = clients(url)
    await made["store"].hset("bench:h", "f", "v")
    rows: dict[tuple[str, str], list[float]] = {}
    try:
        for _ in range(rounds):
            for name, client in made.items():
                script = client.register_script(SCRIPT)
                await script(keys=["bench:h"], args=["f"])  # loaded, and a connection made
                rows.setdefault((name, "script"), []).append(
                    await cpu_us(partial(script, keys=["bench:h"], args=["f"]), calls))
                rows.setdefault((name, "GET"), []).append(await cpu_us(partial(client.get, "bench:h:none"), calls))
    finally:
        for client in made.values():
            await client.aclose()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.redis_client", description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=5000, help="calls per row and round")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    settings = Settings.from_env()
    workdir = Path(tempfile.mkdtemp(prefix="tl-bench-client-"))
    processes = Processes(workdir / "logs")
    server = Server(processes, workdir / "data")
    try:
        url = server.start()
        with asyncio.Runner(loop_factory=loop_factory(settings.loop())) as runner:
            rows = runner.run(measure(url, calls=args.calls, rounds=args.rounds))
    finally:
        server.stop()
        processes.stop_all()
    print(f"server {server.version}, event loop {settings.loop()}, {args.calls} calls x {args.rounds} rounds")
    print(f"{'client':8s} {'command':8s} {'µs CPU per call (median)':>26s}  rounds")
    for (name, command), values in rows.items():
        print(f"{name:8s} {command:8s} {statistics.median(values):26.1f}  {' '.join(f'{v:.0f}' for v in values)}")


if __name__ == "__main__":
    main()
