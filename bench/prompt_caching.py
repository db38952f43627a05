"""Provider prompt caching over long conversations: the share of input tokens served from the cache,
the cache writes, the cost per turn against the same conversation with caching off, and how often an
over-budget turn keeps the previous request's history prefix.

    .venv/bin/python -m bench.prompt_caching            # ~30-60 s on a loaded machine
    .venv/bin/python -m bench.prompt_caching --quick    # the 40-turn conversations only

In this process, against the caching fake of Anthropic's API (`tests/support/fake_providers.py`,
`caching=True`: reads of the longest prefix cached at a breakpoint, writes at each breakpoint of
1,024 tokens or more): a Claude agent (`claude-sonnet-4-5`, priced by genai-prices) built as the
workers build it (`build_model`: pydantic-ai's `AnthropicModel` in `PromptCacheModel` and
`StrictSystemModel`), with ~1,200 tokens of instructions and the `clock` tool, runs conversations
of 40 and 200 turns (seeded: ~150-token questions, ~100-token answers, a tool call and its result in
every 5th turn) with a history window of 2,000 and of 8,000 tokens. Each turn's history is the
window `choose_window` keeps from the previous turn's start (`memory.low_water` 0.7, the default),
as the history stage keeps it (no compaction summary here); the usage is what pydantic-ai makes of
the fake's answer (`pipeline.cost.run_usage`). The same conversation is run with `model.cache: false`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
import uuid
from collections.abc import AsyncIterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from pydantic_ai.messages import (
    ModelMessage,
    ModelRequest,
    ModelResponse,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
    UserPromptPart,
)

from tests.support.fake_providers import FakeProvider
from threadline.pipeline.budget import TurnCost, choose_window
from threadline.pipeline.config import ModelSpec
from threadline.pipeline.cost import run_usage
from threadline.pipeline.invoke import BUILTIN_TOOLS, build_agent
from threadline.pipeline.tokens import count_messages
from threadline.workers.worker.providers import build_model
from threadline.workers.worker.tokenizers import load_tokenizer

MODEL = "claude-sonnet-4-5"
LOW_WATER = 0.7
INSTRUCTIONS = " ".join(f"Rule {i}: answer the customer of Acme politely and check the order first." for i in range(90))
WORDS = ["order", "parcel", "delivery", "address", "invoice", "refund", "courier", "warehouse", "customer", "week",
         "status", "label", "tracking", "payment", "return", "box", "size", "colour", "store", "account", "number"]


def _prose(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words)) + "."


def conversation(turns: int, seed: int = 11) -> list[tuple[str, list[ModelMessage]]]:
    """`turns` (query, stored messages) pairs: ~150-token questions, ~100-token answers (the fake's
    tokens are words), a clock call and its result in every 5th turn."""
    rng = random.Random(seed)
    out: list[tuple[str, list[ModelMessage]]] = []
    for i in range(turns):
        query = f"Question {i}: " + _prose(rng, max(60, round(rng.gauss(140, 25))))
        answer = _prose(rng, max(40, round(rng.gauss(95, 20))))
        messages: list[ModelMessage] = [ModelRequest(parts=[UserPromptPart(query)])]
        if i % 5 == 4:
            call = f"call-{i}"
            messages += [ModelResponse(parts=[ToolCallPart("clock", {}, tool_call_id=call)]),
                         ModelRequest(parts=[ToolReturnPart("clock", "2026-12-02T10:00:00+00:00", tool_call_id=call)])]
        messages.append(ModelResponse(parts=[TextPart(answer)]))
        out.append((query, messages))
    return out


@dataclass
class Run:
    turns: int
    window: int
    cache: bool
    input_tokens: int = 0
    cache_read_tokens: int = 0
    cache_write_tokens: int = 0
    cost_usd: float = 0.0
    over_budget: int = 0
    kept_prefix: int = 0
    mean_kept_tokens: float = 0.0
    seconds: float = 0.0

    @property
    def read_share(self) -> float:
        return self.cache_read_tokens / self.input_tokens if self.input_tokens else 0.0

    @property
    def stability(self) -> float:
        return self.kept_prefix / self.over_budget if self.over_budget else float("nan")


async def _drain(ctx: Any, stream: AsyncIterable[Any]) -> None:
    async for _ in stream:
        pass


async def run_conversation(turns: int, window: int, *, cache: bool) -> Run:
    tokenizer = load_tokenizer(None, "anthropic")
    talk = conversation(turns)
    costs = [TurnCost(f"m{i}", count_messages(messages, tokenizer)) for i, (_, messages) in enumerate(talk)]
    result = Run(turns, window, cache)
    kept_sizes: list[int] = []
    started = time.perf_counter()
    with FakeProvider("anthropic", caching=True, model=MODEL) as server:
        spec = ModelSpec(provider="anthropic", name=MODEL, base_url=server.base_url, cache=cache)
        agent = build_agent(build_model(spec, env={"ANTHROPIC_API_KEY": "sk-fake"}), [BUILTIN_TOOLS["clock"]])
        previous: str | None = None
        cid = f"c-bench-{uuid.uuid4().hex[:8]}"
        for i, (query, _) in enumerate(talk):
            history: list[ModelMessage] = []
            if i:
                chosen = choose_window(costs[:i], budget=window, previous_start=previous, low_water=LOW_WATER)
                if sum(c.tokens for c in costs[:i]) > window:
                    result.over_budget += 1
                    result.kept_prefix += chosen.start == previous
                    kept_sizes.append(chosen.tokens)
                previous = chosen.start
                kept = set(chosen.kept)
                history = [m for j, (_, messages) in enumerate(talk[:i]) if f"m{j}" in kept for m in messages]
            run = await agent.run(query, message_history=history or None, instructions=INSTRUCTIONS,
                                  conversation_id=cid, run_id=f"{cid}/{i}", event_stream_handler=_drain)
            usage = run_usage(run.new_messages())
            result.input_tokens += usage.input_tokens
            result.cache_read_tokens += usage.cache_read_tokens
            result.cache_write_tokens += usage.cache_write_tokens
            result.cost_usd += usage.cost_usd or 0.0
    result.mean_kept_tokens = statistics.mean(kept_sizes) if kept_sizes else 0.0
    result.seconds = time.perf_counter() - started
    return result


def report(runs: Sequence[Run]) -> list[str]:
    off = {(r.turns, r.window): r for r in runs if not r.cache}
    lines = ["| turns | window | input tokens | read from cache | cache writes | cost/turn on | cost/turn off | "
             "on/off | prefix kept (over-budget turns) | mean history kept |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in (r for r in runs if r.cache):
        o = off[(r.turns, r.window)]
        lines.append(f"| {r.turns} | {r.window:,} | {r.input_tokens:,} | {r.read_share:.0%} | "
                     f"{r.cache_write_tokens:,} | ${r.cost_usd / r.turns:.5f} | ${o.cost_usd / o.turns:.5f} | "
                     f"{r.cost_usd / o.cost_usd:.0%} | "
                     f"{r.kept_prefix}/{r.over_budget} ({r.stability:.0%}) | {r.mean_kept_tokens:,.0f} |")
    return lines


async def main_async(opts: argparse.Namespace) -> list[Run]:
    sizes = [40] if opts.quick else [40, 200]
    runs: list[Run] = []
    for turns in sizes:
        for window in (2000, 8000):
            for cache in (True, False):
                runs.append(await run_conversation(turns, window, cache=cache))
                print(f"[bench] {turns} turns, window {window}, cache {cache}: {runs[-1].seconds:.1f} s",
                      file=sys.stderr, flush=True)
    return runs


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.prompt_caching", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="the 40-turn conversations only")
    parser.add_argument("--json", action="store_true", help="the runs as JSON")
    opts = parser.parse_args(argv)
    runs = asyncio.run(main_async(opts))
    if opts.json:
        print(json.dumps([asdict(r) for r in runs]))
    else:
        print("\n".join(report(runs)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
