"""A Redis server's CPU per command against how many clients keep a request in flight at once:
`python -m bench.server_batching`.

Why a cluster's CPU per turn, summed over its primaries, is higher than one server's for the same
turns: each primary sees a third of the requests, so fewer of them arrive in one turn of its event
loop, and each wake-up (epoll, the loop's housekeeping, the reply's write) is paid by fewer
commands. This measures that effect alone, without Threadline: `redis-benchmark` (SET and HSET on
random keys, no pipelining) against a server started here, with 16, 5, 2 and 1 clients, the
server's CPU (INFO cpu) per command; and the same at 16 clients on a node started with
`--cluster-enabled yes` that holds every slot (what cluster mode itself costs per command).
Rounds alternate the settings; the figures are per round.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import redis

from .procs import Processes, Server
from .stats import server_cpu_s


def start_node(processes: Processes, data_dir: Path) -> redis.Redis:
    """A server started with `--cluster-enabled yes` that holds every slot: a cluster of one node."""
    server = Server(processes, data_dir, "redis",
                    options=["--cluster-enabled", "yes", "--cluster-config-file", str(data_dir / "nodes.conf")])
    client = redis.Redis.from_url(server.start(), socket_timeout=10)
    client.execute_command("CLUSTER", "ADDSLOTSRANGE", 0, 16383)
    deadline = time.monotonic() + 30
    while "cluster_state:ok" not in client.execute_command("CLUSTER", "INFO").decode():
        if time.monotonic() > deadline:
            raise SystemExit("the one-node cluster did not come up")
        time.sleep(0.05)
    return client


def cpu_us_per_command(client: redis.Redis, *, clients: int, requests: int) -> float:
    port = client.connection_pool.connection_kwargs["port"]
    before = server_cpu_s(client)
    subprocess.run(["redis-benchmark", "-p", str(port), "-q", "-c", str(clients), "-n", str(requests),
                    "-r", "100000", "-t", "set,hset"], check=True, stdout=subprocess.DEVNULL)
    return 1e6 * (server_cpu_s(client) - before) / (2 * requests)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.server_batching", description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=200_000, help="requests per command and setting")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    if shutil.which("redis-server") is None or shutil.which("redis-benchmark") is None:
        raise SystemExit("needs redis-server and redis-benchmark on PATH")
    workdir = Path(tempfile.mkdtemp(prefix="tl-bench-batching-"))
    processes = Processes(workdir / "logs")
    rows: dict[tuple[str, int], list[float]] = {}
    try:
        plain = Server(processes, workdir / "plain", "redis")
        plain_client = redis.Redis.from_url(plain.start(), socket_timeout=10)
        node_client = start_node(processes, workdir / "node")
        settings = [("one server", plain_client, c) for c in (16, 5, 2, 1)]
        settings.append(("cluster-enabled node", node_client, 16))
        for _ in range(args.rounds):
            for name, client, clients in settings:
                rows.setdefault((name, clients), []).append(
                    cpu_us_per_command(client, clients=clients, requests=args.requests))
    finally:
        processes.stop_all()
        shutil.rmtree(workdir, ignore_errors=True)
    base = rows[("one server", 16)]
    print(f"\nredis-benchmark SET + HSET, {args.requests} requests each, {args.rounds} rounds\n")
    print("| server | clients in flight | server CPU per command (µs), per round | x one server at 16 |")
    print("|---|---|---|---|")
    for (name, clients), values in rows.items():
        ratios = ", ".join(f"{v / b:.2f}" for v, b in zip(values, base, strict=True))
        print(f"| {name} | {clients} | {', '.join(f'{v:.1f}' for v in values)} | {ratios} |")


if __name__ == "__main__":
    main()
