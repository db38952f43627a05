"""Turns/s and server CPU per turn on one server and on a three-primary Redis Cluster, and how the
load spreads over the cluster's primaries: `python -m bench.cluster`.

Three setups, one after the other, each on servers of its own started here (`redis-server`; the
cluster with `tests/support/cluster.py`, no replicas): one server in one server's layout, one
server in the sharded layout (`--shards`), and the cluster in the sharded layout. Each runs
`--processes` worker processes (`offline:echo`), warms up, then runs `--turns` turns on
`--conversations` conversations: a first turn on each, then follow-ups round by round, every
conversation's turn of a round in flight at once. Measured per setup: the wall time (turns/s), the
servers' CPU (INFO cpu, summed over the primaries) and commands (INFO commandstats, without the
harness's XREADs) per turn, and on the cluster each primary's share of the CPU and of the
commands, against the mean of the primaries. Then the idle latency: `--idle-turns` turns one at a
time, each after `--spacing-s` of quiet (the consumers idle), from submit to the terminal event."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import redis

from tests.support.cluster import Cluster
from threadline.pipeline.config import AgentConfig
from threadline.workers.clients.client import Client

from .procs import ROOT, free_port
from .stats import WAIT_COMMANDS, command_counts, percentile, server_cpu_s


@dataclass(frozen=True)
class Result:
    setup: str
    turns: int
    seconds: float
    server_cpu_s: list[float]
    commands: list[int]
    #: Idle turns' submit-to-terminal latency (ms).
    idle_ms: list[float]

    @property
    def rate(self) -> float:
        return self.turns / self.seconds

    def per_turn_ms(self) -> float:
        return 1000 * sum(self.server_cpu_s) / self.turns

    def busiest(self, values: list[float] | list[int]) -> float:
        mean = sum(values) / len(values)
        return max(values) / mean if mean else 0.0


def run_setup(setup: str, url: str, nodes: list[redis.Redis], *, shards: int, processes: int, threads: int,
              turns: int, conversations: int, idle_turns: int, spacing_s: float, workdir: Path) -> Result:
    prefix = f"bc{uuid.uuid4().hex[:6]}"
    env = {**os.environ, "REDIS_URL": url, "TL_PREFIX": prefix, "TL_SHARDS": str(shards), "TL_LOG_FORMAT": "json",
           "TL_LOG_LEVEL": "WARNING", "PYTHONPATH": str(ROOT)}
    log = open(workdir / f"{setup}.log", "wb")  # noqa: SIM115 - closed with the workers
    workers = [subprocess.Popen([sys.executable, "-m", "threadline.workers.worker", "--threads", str(threads)],
                                env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT) for _ in range(processes)]
    client = Client(url, prefix=prefix, shards=shards)
    try:
        registry = client.keys.workers()
        deadline = time.monotonic() + 60
        while client.redis.hlen(registry) < processes:
            if time.monotonic() > deadline or any(w.poll() is not None for w in workers):
                raise SystemExit(f"{setup}: workers did not start; see {workdir / f'{setup}.log'}")
            time.sleep(0.1)
        agent = f"bench-{uuid.uuid4().hex[:6]}"
        client.put_agent(AgentConfig.model_validate({"id": agent, "model": "offline:echo"}))

        def request(turn_id: str, conversation_id: str | None) -> dict[str, object]:
            return {"tenant_id": "bench", "app_id": "bench", "user_id": "u1", "agent_id": agent, "query": "hello",
                    "turn_id": turn_id, **({"conversation_id": conversation_id} if conversation_id else {})}

        for warm in [client.submit(request(f"w-{uuid.uuid4().hex[:10]}", None)) for _ in range(20)]:
            client.wait(warm, timeout_s=120)
        for node in nodes:
            node.config_resetstat()
        cpu0 = [server_cpu_s(node) for node in nodes]
        started = time.monotonic()
        firsts = [client.submit(request(f"t-{uuid.uuid4().hex[:10]}", None)) for _ in range(conversations)]
        for turn_id in firsts:
            client.wait(turn_id, timeout_s=300)
        ids = [f"c-{t}" for t in firsts]
        done = len(firsts)
        while done < turns:
            batch = [client.submit(request(f"t-{uuid.uuid4().hex[:10]}", c)) for c in ids[:turns - done]]
            for turn_id in batch:
                client.wait(turn_id, timeout_s=300)
            done += len(batch)
        seconds = time.monotonic() - started
        cpu = [server_cpu_s(node) - c0 for node, c0 in zip(nodes, cpu0, strict=True)]
        commands = [sum(v for k, v in command_counts(node).items() if k not in WAIT_COMMANDS) for node in nodes]
        idle_ms = []
        for _ in range(idle_turns):
            time.sleep(spacing_s)
            began = time.perf_counter()
            client.wait(client.submit(request(f"i-{uuid.uuid4().hex[:10]}", None)), timeout_s=60)
            idle_ms.append(1000 * (time.perf_counter() - began))
        return Result(setup, done, seconds, cpu, commands, idle_ms)
    finally:
        client.close()
        for w in workers:
            w.terminate()
        for w in workers:
            try:
                w.wait(timeout=15)
            except subprocess.TimeoutExpired:
                w.kill()
        log.close()


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.cluster", description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=1000)
    parser.add_argument("--conversations", type=int, default=200)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--shards", type=int, default=6, help="virtual shards (a multiple of the 3 primaries)")
    parser.add_argument("--idle-turns", type=int, default=50)
    parser.add_argument("--spacing-s", type=float, default=0.3, help="quiet before each idle turn")
    args = parser.parse_args()
    if shutil.which("redis-server") is None:
        raise SystemExit("needs redis-server and redis-cli on PATH")
    workdir = Path(tempfile.mkdtemp(prefix="tl-bench-cluster-"))
    results: list[Result] = []
    common = {"processes": args.processes, "threads": args.threads, "turns": args.turns,
              "conversations": args.conversations, "idle_turns": args.idle_turns, "spacing_s": args.spacing_s,
              "workdir": workdir}
    try:
        for setup, shards in (("one server", 0), (f"one server, {args.shards} shards", args.shards)):
            port = free_port()
            server = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                       "--appendonly", "no", "--dir", str(workdir)],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            try:
                node = redis.Redis(port=port)
                while True:
                    try:
                        node.ping()
                        break
                    except redis.ConnectionError:
                        time.sleep(0.05)
                results.append(run_setup(setup, f"redis://127.0.0.1:{port}/0", [node], shards=shards, **common))
            finally:
                server.kill()
                server.wait()
        with Cluster(workdir / "cluster", replicas=0) as cluster:
            url = cluster.every_node_url
            primaries = [n.client() for n in cluster.primary_nodes()]
            results.append(run_setup(f"3-primary cluster, {args.shards} shards", url, primaries, shards=args.shards,
                                     **common))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    base = results[0]
    print(f"\n{args.turns} turns on {args.conversations} conversations, {args.processes} worker processes x "
          f"{args.threads} threads, offline:echo; load average {os.getloadavg()[0]:.1f}\n")
    print("| setup | turns/s | x one server | server CPU per turn (ms, summed) | x one server | commands per turn "
          "| per primary: CPU s | busiest CPU / mean | per primary: commands | busiest commands / mean "
          "| idle latency p50 / p99 (ms) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r.setup} | {r.rate:.1f} | {r.rate / base.rate:.2f} | {r.per_turn_ms():.2f} | "
              f"{r.per_turn_ms() / base.per_turn_ms():.2f} | {sum(r.commands) / r.turns:.1f} | "
              f"{', '.join(f'{c:.2f}' for c in r.server_cpu_s)} | {r.busiest(r.server_cpu_s):.2f} | "
              f"{', '.join(str(c) for c in r.commands)} | {r.busiest(r.commands):.2f} | "
              f"{percentile(r.idle_ms, 50):.1f} / {percentile(r.idle_ms, 99):.1f} |")


if __name__ == "__main__":
    main()
