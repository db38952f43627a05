#!/usr/bin/env python3
"""The container health check of `threadline worker`: its worker processes run, and Redis answers;
or, with `--url`, of a server that has a health endpoint (`threadline gateway`'s `/healthz`).

Installed in the image as `threadline-healthcheck`; the Dockerfile's HEALTHCHECK runs it (Docker's
health check is a command; the Kubernetes probes use the supervisor's `/healthz` and `/livez`, which
see inside the worker processes). What it checks from outside:

- live (`--live`, the Kubernetes liveness probe): the supervisor (`--parent`, PID 1 in a container)
  has a child `python -m threadline.workers.worker` that has been up for `--min-age-s` seconds. A
  child crash-looping on start-up never gets that old, so it does not count.
- ready (the default; the readiness probe and the Docker health check): live, and a PING on
  `REDIS_URL` answers within `--timeout-s`. A Redis outage makes the pods unready, not restarted.
- `--url URL` (the gateway's container): a GET of URL answers 2xx within `--timeout-s`; nothing else
  is checked.

It does not see inside a process: a worker whose consumer threads are stuck still passes.
Exit 0 healthy, 1 unhealthy, with one line saying why (never REDIS_URL: it may carry a password).
Standard library and redis-py only, so a probe costs one short Python start.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

#: What the supervisor runs per child (`workers/worker/process.py`, `Supervisor._spawn`).
WORKER_MODULE = b"threadline.workers.worker"


def _uptime_s() -> float:
    return float(Path("/proc/uptime").read_text().split()[0])


def worker_ages(parent: int) -> list[float]:
    """The age in seconds of every live worker child of `parent`."""
    ticks = os.sysconf("SC_CLK_TCK")
    now = _uptime_s()
    ages = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:  # the process ended while we looked
            continue
        # The command name (field 2) may hold spaces and parentheses: count fields after the last ")".
        fields = stat[stat.rindex(")") + 2:].split()
        state, ppid, started = fields[0], int(fields[1]), int(fields[19])
        if ppid == parent and state not in ("Z", "X") and WORKER_MODULE in argv:
            ages.append(now - started / ticks)
    return ages


def live_problem(parent: int, min_age_s: float) -> str | None:
    ages = worker_ages(parent)
    if not ages:
        return f"no worker process runs under pid {parent}"
    if max(ages) < min_age_s:
        return f"{len(ages)} worker processes, none up for {min_age_s:g} s yet (starting, or crash-looping)"
    return None


def redis_problem(url: str | None, timeout_s: float) -> str | None:
    if not url:
        return "REDIS_URL is not set (a container must not start its own embedded server)"
    import redis  # here, so that `--live` costs no redis import

    client = redis.Redis.from_url(url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s)
    try:
        client.ping()
    except redis.RedisError as e:
        # redis-py's messages name the host and port, never the password
        return f"redis did not answer a PING: {type(e).__name__}: {e}"
    finally:
        client.close()
    return None


def url_problem(url: str, timeout_s: float) -> str | None:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            status = int(response.status)
    except urllib.error.HTTPError as e:
        status = e.code
    except OSError as e:  # refused, timed out, no route
        return f"{url} did not answer: {getattr(e, 'reason', None) or e}"
    return None if 200 <= status < 300 else f"{url} answered {status}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="threadline-healthcheck",
                                     description="Is this container's `threadline worker` healthy?")
    parser.add_argument("--live", action="store_true", help="check the worker processes only, not Redis")
    parser.add_argument("--parent", type=int, default=1, help="pid of the supervisor (default 1)")
    parser.add_argument("--min-age-s", type=float, default=5.0, help="a worker process must be up this long")
    parser.add_argument("--timeout-s", type=float, default=3.0, help="for the Redis connection and PING")
    parser.add_argument("--url", help="instead: GET this URL, healthy on 2xx (the gateway's /healthz)")
    args = parser.parse_args(argv)
    if args.url:
        problem = url_problem(args.url, args.timeout_s)
        print(f"unhealthy: {problem}" if problem else "healthy")
        return 1 if problem else 0
    problem = live_problem(args.parent, args.min_age_s)
    if problem is None and not args.live:
        problem = redis_problem(os.environ.get("REDIS_URL"), args.timeout_s)
    print(f"unhealthy: {problem}" if problem else "healthy")
    return 1 if problem else 0


if __name__ == "__main__":
    sys.exit(main())
