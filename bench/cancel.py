"""Cancel latency: from `cancel` being enqueued to the model stream stopping.

Two real worker processes on a fresh server run turns of a model that streams until it is stopped;
each turn is cancelled once its text is flowing, and the model itself records (on the same host
clock) the moment its stream was closed. Prints p50/p99/max over `--cancels` cancels, for
"cancel enqueued → model stream closed" and "cancel enqueued → terminal `cancelled` event".

    .venv/bin/python -m bench.cancel --cancels 200
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from pydantic_ai.messages import ModelMessage, ModelRequest, UserPromptPart
from pydantic_ai.models.function import AgentInfo, FunctionModel

from threadline.pipeline import events as ev
from threadline.pipeline.config import AgentConfig
from threadline.workers.clients.client import Client

from .procs import Processes, Server, raise_on_sigterm
from .stats import Summary
from .systems import ThreadlineSystem

TARGET_P99_MS = 200.0


def endless(options: dict[str, Any]) -> FunctionModel:
    """Streams a word every `delay_ms` until it is stopped; records when its stream was closed,
    keyed by the turn's query (the benchmark makes the query the turn id)."""
    import asyncio

    delay = float(options.get("delay_ms", 5)) / 1000
    record = options["record"]

    async def stream(messages: list[ModelMessage], info: AgentInfo) -> AsyncIterator[str]:
        query = next(p.content for m in reversed(messages) if isinstance(m, ModelRequest)
                     for p in m.parts if isinstance(p, UserPromptPart))
        try:
            for i in range(1_000_000):
                yield f"w{i} "
                await asyncio.sleep(delay)
        finally:
            with open(record, "a") as handle:
                handle.write(json.dumps({"turn": query, "closed_at": time.time()}) + "\n")

    return FunctionModel(stream_function=stream, model_name="bench:endless")


def closed_at(record: Path, turn_id: str, timeout_s: float = 10) -> float:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if record.exists():
            for line in record.read_text().splitlines():
                entry = json.loads(line)
                if entry["turn"] == turn_id:
                    return float(entry["closed_at"])
        time.sleep(0.005)
    raise TimeoutError(f"the model of {turn_id} never closed its stream")


def one_cancel(client: Client, agent: str, record: Path) -> tuple[float, float]:
    turn_id = f"cancel-{uuid.uuid4().hex[:12]}"
    client.submit({"turn_id": turn_id, "tenant_id": "bench", "app_id": "bench", "user_id": "bench",
                   "agent_id": agent, "query": turn_id})
    events = client.events(turn_id, follow=True, timeout_s=30)
    for event in events:
        if isinstance(event, ev.TextDelta):
            break
    started = time.time()
    client.cancel(turn_id, "bench")
    terminal: ev.Event | None = None
    for event in events:
        if isinstance(event, ev.Terminal):
            terminal = event
    terminal_at = time.time()
    if not isinstance(terminal, ev.Cancelled):
        raise RuntimeError(f"turn {turn_id} ended {terminal}")
    return (closed_at(record, turn_id) - started) * 1000, (terminal_at - started) * 1000


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.cancel", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cancels", type=int, default=200)
    parser.add_argument("--processes", type=int, default=2)
    args = parser.parse_args(argv)
    raise_on_sigterm()
    work = Path(tempfile.mkdtemp(prefix="tl-bench-cancel-"))
    processes = Processes(work / "logs")
    server = Server(processes, work / "server")
    prefix = f"tlcancel{uuid.uuid4().hex[:6]}"
    try:
        system = ThreadlineSystem(processes, server.start(), prefix=prefix, threads=8,
                                  env={"TL_ALLOW_PYTHON_PLUGINS": "1", "TL_LOG_LEVEL": "WARNING"})
        system.start(args.processes)
        client = system.client
        record = work / "closed.jsonl"
        client.put_agent(AgentConfig.model_validate({
            "id": "endless", "model": {"provider": "python", "name": "bench.cancel:endless",
                                       "options": {"delay_ms": 5, "record": str(record)}}}))
        one_cancel(client, "endless", record)  # warm-up: imports and model construction in a worker
        to_stream, to_event = [], []
        for _ in range(args.cancels):
            stream_ms, event_ms = one_cancel(client, "endless", record)
            to_stream.append(stream_ms)
            to_event.append(event_ms)
        stream, event = Summary.of(to_stream), Summary.of(to_event)
        print(f"cancel latency, {args.cancels} cancels, {args.processes} worker processes, {server.version}")
        print("| from cancel enqueued to | p50 ms | p99 ms | max ms | target |")
        print("|---|---|---|---|---|")
        verdict = "pass" if stream.p99 < TARGET_P99_MS else "FAIL"
        print(f"| model stream closed | {stream.p50:.1f} | {stream.p99:.1f} | {stream.max:.1f} "
              f"| p99 < {TARGET_P99_MS:.0f} ms: {verdict} |")
        print(f"| terminal `cancelled` event seen by the client | {event.p50:.1f} | {event.p99:.1f} "
              f"| {event.max:.1f} | |")
        system.close()
        return 0 if verdict == "pass" else 1
    finally:
        processes.stop_all()
        server.stop()


if __name__ == "__main__":
    raise SystemExit(main())
