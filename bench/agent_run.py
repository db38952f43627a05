"""What the model stage's pydantic-ai run costs in CPU, in this process, with no Redis and no worker:
the floor under a turn's worker CPU that no change of Threadline's own can lower.

    .venv/bin/python -m bench.agent_run              # ~10 s
    .venv/bin/python -m bench.agent_run --runs 2000
    .venv/bin/python -m bench.agent_run --spacing-s 0.3 --runs 100   # also runs 0.3 s apart, ~1 min
    .venv/bin/python -m bench.agent_run --loops asyncio,uvloop       # on each event loop, ~1 min

Two rows, each the median CPU time (`time.process_time`) of `--runs` runs after `--warmup`:

- `pydantic-ai alone`: `Agent.run` of a `FunctionModel` that streams one text chunk, with an
  `event_stream_handler` that drains its events: the streaming path a turn takes, and nothing of
  Threadline's.
- `run_turn (offline:echo)`: the model stage's call as a worker makes it (`pipeline.invoke.run_turn`
  with the agent the shell builds, the `offline:echo` model, `TurnStream` with `RunEvents`
  translating the stream, a sink that stores nothing), the outcome, its usage and its snapshot.

With `--spacing-s S` each row is also timed with S seconds of idleness before every run, as the
turns of `bench.run`'s idle-latency phase come: a run after a pause finds the CPU's caches cold and
costs more than one right after another.

With `--loops asyncio,uvloop` every row is timed on each kind of event loop a worker may run
(`TL_EVENT_LOOP`), the kinds alternated over `--rounds` rounds (default 3), each figure the median
of its rounds' medians.

Compare them with `bench.run`'s worker CPU per turn, Threadline's and the bare dramatiq chain's
(five no-op hops): the issue's target for the whole turn is at most 3x the bare chain's.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from typing import Any, Literal, cast

from pydantic_ai import Agent, CancellationToken
from pydantic_ai.messages import ModelMessage
from pydantic_ai.models.function import AgentInfo, FunctionModel

from threadline.pipeline.config import AgentConfig
from threadline.pipeline.contracts import TURN_SCHEMA, TurnRequest, new_conversation_id
from threadline.pipeline.invoke import build_agent, run_turn
from threadline.pipeline.records import ResolvedTurn
from threadline.pipeline.resolve import resolve_turn
from threadline.pipeline.streaming import RunEvents, TextDebouncer
from threadline.workers.worker.loops import loop_factory
from threadline.workers.worker.providers import offline_model
from threadline.workers.worker.stream import TurnStream


def _turn() -> ResolvedTurn:
    config = AgentConfig.model_validate({"id": "bench", "model": "offline:echo"})
    request = TurnRequest.model_validate({
        "schema": TURN_SCHEMA, "turn_id": "bench-turn", "tenant_id": "t", "app_id": "a", "user_id": "u",
        "agent_id": config.id, "query": "hello",
    })
    resolved, _ = resolve_turn(request, conversation=None, config=config, config_ref="v1",
                               new_conversation_id=new_conversation_id(request.turn_id), now=time.time())
    return resolved


async def _median_cpu_ms(run: Callable[[], Awaitable[Any]], *, runs: int, warmup: int,
                         spacing_s: float = 0.0) -> float:
    for _ in range(warmup):
        await run()
    times: list[float] = []
    for _ in range(runs):
        if spacing_s:
            await asyncio.sleep(spacing_s)
        t0 = time.process_time()
        await run()
        times.append((time.process_time() - t0) * 1000)
    return statistics.median(times)


async def _measure(runs: int, warmup: int, spacing_s: float) -> list[tuple[str, list[float]]]:
    async def one_chunk(messages: list[ModelMessage], info: AgentInfo) -> AsyncIterator[str]:
        yield "hello"

    async def drain(_: Any, stream: AsyncIterable[Any]) -> None:
        async for _event in stream:
            pass

    plain: Agent[None, str] = Agent(FunctionModel(stream_function=one_chunk))

    async def alone() -> None:
        await plain.run("hello", event_stream_handler=drain)

    turn = _turn()
    agent = build_agent(offline_model("echo", {}))

    async def nowhere(_: object) -> None:
        return None

    async def ours() -> None:
        translator = RunEvents(turn.turn_id, 1, TextDebouncer(window_s=0.075), tool_payload_chars=100_000)
        async with TurnStream(translator, nowhere, time.time) as stream:
            outcome = await run_turn(turn, [], agent=agent, attempt=1, stream=stream, token=CancellationToken(),
                                     clock=time.time, timeout_s=30, max_chars=100_000)
        assert outcome.status == "succeeded", outcome

    spacings = (0.0, spacing_s) if spacing_s else (0.0,)
    rows: list[tuple[str, list[float]]] = []
    for name, run in (("pydantic-ai alone (FunctionModel, one streamed chunk)", alone),
                      ("run_turn (offline:echo, TurnStream)", ours)):
        rows.append((name, [await _median_cpu_ms(run, runs=runs, warmup=warmup, spacing_s=s) for s in spacings]))
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.agent_run", description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=500, help="timed runs per row (default 500)")
    parser.add_argument("--warmup", type=int, default=50, help="untimed runs first (default 50)")
    parser.add_argument("--spacing-s", type=float, default=0.0,
                        help="also time each row with this much idleness before every run (default: not)")
    parser.add_argument("--loops", default="asyncio",
                        help="comma-separated event loops to time each row on: asyncio, uvloop (default asyncio)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="rounds of every loop, alternated (default 1; 3 with several loops)")
    a = parser.parse_args(argv)
    loops = [name.strip() for name in a.loops.split(",") if name.strip()]
    unknown = set(loops) - {"asyncio", "uvloop"}
    if unknown or not loops:
        parser.error(f"--loops: asyncio and/or uvloop, not {a.loops!r}")
    rounds = a.rounds or (3 if len(loops) > 1 else 1)
    measured: dict[str, list[list[tuple[str, list[float]]]]] = {name: [] for name in loops}
    for _ in range(rounds):
        for name in loops:
            with asyncio.Runner(loop_factory=loop_factory(cast(Literal["uvloop", "asyncio"], name))) as runner:
                measured[name].append(runner.run(_measure(a.runs, a.warmup, a.spacing_s)))
    spaced = f" --spacing-s {a.spacing_s:g}" if a.spacing_s else ""
    looped = f" --loops {','.join(loops)} --rounds {rounds}" if loops != ["asyncio"] or rounds > 1 else ""
    print(f"command: `python -m bench.agent_run --runs {a.runs} --warmup {a.warmup}{spaced}{looped}`\n")
    if a.spacing_s:
        print(f"| run | loop | CPU per run, median (ms): back to back | {a.spacing_s:g} s apart |\n|---|---|---|---|")
    else:
        print("| run | loop | CPU per run, median (ms) |\n|---|---|---|")
    for row, (title, _) in enumerate(measured[loops[0]][0]):
        for name in loops:
            columns = zip(*(each[row][1] for each in measured[name]), strict=True)
            print(f"| {title} | {name} | " + " | ".join(f"{statistics.median(ms):.2f}" for ms in columns) + " |")


if __name__ == "__main__":
    main()
