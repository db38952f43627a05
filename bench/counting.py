"""The history stage counting with the provider's count endpoint (`model.tokenizer: provider`) and
with a local tokenizer, in one run.

    .venv/bin/python -m bench.counting                  # ~10 s
    .venv/bin/python -m bench.counting --latency-ms 250 # a slower endpoint

One run starts its own `redis-server` (`bench/procs.py`) and a local fake of Anthropic's API whose
`count_tokens` answers after `--latency-ms` (`tests/support/fake_providers.py`: a hosted endpoint's
round trip, without the internet), imports a conversation of `--turns` turns (`bench.history`'s
prose, ~166 tokens a turn) for each of two agents on the same Anthropic model, one counting with
`tiktoken:cl100k_base`, one with `provider`, and runs the whole history stage in this process
(`load_thread` + `history_stage`, every Redis read included, as `bench.history` (a) does): the cold
run (every turn it walks is counted) and `--reps` warm runs, each a new turn with a new query whose
parent's count was just deleted, as for a real turn. It reports the stage's time and the count
requests the fake received per run.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tests.support.fake_providers import FakeProvider
from threadline.pipeline.config import AgentConfig
from threadline.pipeline.stages import DEFAULT_GRAPH, StageInput, history_stage
from threadline.workers.clients.client import Client
from threadline.workers.settings import Settings, model_policy
from threadline.workers.storage.store import Store
from threadline.workers.worker.cancellation import CancelRegistry
from threadline.workers.worker.loaders import load_thread
from threadline.workers.worker.runtime import Runtime

from .history import Talk, _resolve
from .procs import Processes, Server, bench_session, progress
from .run import code_version
from .stats import Summary

KEY = {"ANTHROPIC_API_KEY": "sk-bench-fake"}
POLICY = {"TL_BASE_URL_ALLOW": "http://127.0.0.1:"}


@dataclass
class CounterRun:
    tokenizer: str
    cold_ms: float = 0.0
    cold_requests: int = 0
    warm_ms: list[float] = field(default_factory=list)
    warm_requests: list[int] = field(default_factory=list)
    kept_turns: int = 0


async def _measure(url: str, prefix: str, agents: dict[str, str], convs: dict[str, tuple[str, str]],
                   fake: FakeProvider, reps: int) -> dict[str, CounterRun]:
    settings = Settings(redis_url=url, data_dir=Path(tempfile.gettempdir()), prefix=prefix, secrets=KEY,
                        policy=model_policy(POLICY))
    store = Store.connect(url, settings, DEFAULT_GRAPH)
    rt = Runtime(store, CancelRegistry())
    talk = Talk(5)
    out: dict[str, CounterRun] = {}
    try:
        for label, agent in agents.items():
            cid, tip = convs[label]
            run: CounterRun | None = None
            for i in range(reps + 1):
                turn = await _resolve(rt, agent, cid, talk.prompt())
                counter = rt.counter(turn.config.model)
                if i > 0:  # the parent: just written, not counted yet
                    await store.redis.hdel(store.keys.token_counts(cid), f"{tip}|{counter.name}")
                before = len(fake.exchanges)
                t0 = time.perf_counter()
                read = await load_thread(rt, turn, "history")
                result = history_stage(StageInput(turn, turn.model_dump_json(), {"thread": read}))
                ms = (time.perf_counter() - t0) * 1000
                requests = len(fake.exchanges) - before
                if run is None:
                    run = CounterRun(read.tokenizer, ms, requests, kept_turns=result.decision["window"]["kept_turns"])
                else:
                    run.warm_ms.append(ms)
                    run.warm_requests.append(requests)
            assert run is not None
            out[label] = run
            s = Summary.of(run.warm_ms)
            progress(f"  {run.tokenizer}: cold {run.cold_ms:.1f} ms ({run.cold_requests} count requests), warm p50 "
                     f"{s.p50:.1f} ms p99 {s.p99:.1f} ms ({max(run.warm_requests)} count requests at most)")
    finally:
        await store.close()
    return out


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.counting", description=__doc__.split("\n\n")[0])
    parser.add_argument("--latency-ms", type=float, default=100.0, help="the count endpoint's answer time (100)")
    parser.add_argument("--reps", type=int, default=20, help="warm runs per counter (20)")
    parser.add_argument("--turns", type=int, default=1000, help="turns in each imported conversation (1000)")
    parser.add_argument("--server", choices=("auto", "redis", "valkey"), default="auto")
    a = parser.parse_args(argv)
    with bench_session("bench.counting", argv, keep=False) as (command, workdir):
        processes = Processes(workdir / "logs")
        server = Server(processes, workdir / "server", a.server)
        try:
            url = server.start()
            prefix = f"tlcount{uuid.uuid4().hex[:8]}"
            client = Client(url, prefix=prefix, policy=model_policy(POLICY))
            with FakeProvider("anthropic", count_delay_s=a.latency_ms / 1000) as fake:
                model = {"provider": "anthropic", "name": "claude-sonnet-5-5", "base_url": fake.base_url,
                         "context_window": 8192, "max_output_tokens": 1024}
                agents = {label: f"bench-{label}-{uuid.uuid4().hex[:8]}" for label in ("local", "provider")}
                for label, tokenizer in (("local", "tiktoken:cl100k_base"), ("provider", "provider")):
                    client.put_agent(AgentConfig.model_validate(
                        {"id": agents[label], "model": {**model, "tokenizer": tokenizer}}))
                talk = Talk(1)
                turns = [talk.turn(i) for i in range(a.turns)]
                convs = {}
                for label, agent in agents.items():
                    cid = f"count-{label}-{uuid.uuid4().hex[:8]}"
                    convs[label] = cid, client.import_conversation(
                        conversation_id=cid, tenant_id="bench", app_id="bench", user_id="u1", agent_id=agent,
                        turns=list(turns))
                progress(f"imported {a.turns:,} turns twice; count endpoint answers after {a.latency_ms:g} ms")
                runs = asyncio.run(_measure(url, prefix, agents, convs, fake, a.reps))
            client.close()
        finally:
            processes.stop_all()
            server.stop()
    local, provider = runs["local"], runs["provider"]
    lo, pr = Summary.of(local.warm_ms), Summary.of(provider.warm_ms)
    print(f"command: `{command}`\ncode: {code_version()}\nserver: {server.version}; count endpoint latency "
          f"{a.latency_ms:g} ms (local fake); {a.turns:,}-turn conversations, context window 8,192\n")
    print("| history stage | tiktoken:cl100k_base | provider | difference |\n|---|---|---|---|")
    print(f"| cold run, ms (every kept turn counted) | {local.cold_ms:.1f} | {provider.cold_ms:.1f} "
          f"| +{provider.cold_ms - local.cold_ms:.1f} |")
    print(f"| count requests, cold run | — | {provider.cold_requests} | |")
    print(f"| warm p50, ms (a new query, the parent counted) | {lo.p50:.1f} | {pr.p50:.1f} | +{pr.p50 - lo.p50:.1f} |")
    print(f"| warm p99, ms | {lo.p99:.1f} | {pr.p99:.1f} | +{pr.p99 - lo.p99:.1f} |")
    print(f"| count requests per warm run (max) | — | {max(provider.warm_requests)} | |")
    print(f"| turns kept | {local.kept_turns} | {provider.kept_turns} | |")


if __name__ == "__main__":
    main()
