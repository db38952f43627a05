"""Provider prompt caching over long conversations: the share of input tokens served from the cache,
the cache writes, the cost per turn against the same conversation with caching off, how often an
over-budget turn keeps the previous request's cached prefix, and the history it keeps on average.

    .venv/bin/python -m bench.prompt_caching                 # in this process, ~30-60 s
    .venv/bin/python -m bench.prompt_caching --workers       # real workers and Redis, ~60 s
    .venv/bin/python -m bench.prompt_caching --quick         # the 40-turn conversations only

The conversations (seeded): ~150-token questions whose first sentence is short (what a summary
keeps), ~100-token answers, a `clock` call and its result in every 5th turn, with a history
window of 2,000 and of 8,000 tokens, and compaction on: the turns a window drops are summarised by
`summarise` (the previous summary's lines and the first sentence of each new question, the newest
16 kept: bounded, as a model's summary is). `--summary-first`, in this process, puts the summary in
front of the kept turns, where it was before it moved behind them (`history.summary_messages`).

In this process, against the caching fake of Anthropic's API (`tests/support/fake_providers.py`,
`caching=True`: reads of the longest prefix cached at a breakpoint, writes at each breakpoint of
1,024 tokens or more): a Claude agent (`claude-sonnet-5-5`, priced by genai-prices) built as the
workers build it (`build_model`: pydantic-ai's `AnthropicModel` in `PromptCacheModel` and
`StrictSystemModel`), with ~1,200 tokens of instructions and the `clock` tool. Each turn's history
is what the history stage makes of the thread (`budgeted_history`: the window from the previous
turn's start, `memory.low_water` 0.7 by default, and the newest summary), and after each turn its
compaction summarises the turns before its window start, as the compaction stage does. The same
conversation is run with `model.cache: false`.

`--workers`: the same conversations through one worker process and a fresh server
(`bench.procs.Server`: redis-server, else embedded Valkey), against the caching fake over HTTP,
which calls the `clock` tool in every 5th turn (`clock_every_fifth`), the summariser a Python
plugin model (`summariser` below), the context window set so that the history budget is the
window for a mean question (`fixed_parts`, from one probe turn). Each turn is submitted once
the previous turn's compaction has finished, as a user who reads the answer first would; the
conversations run side by side. The answers are the fake's fixed text of ~100 words; the cost
with caching off is the same requests' tokens priced without cache reads or writes (what
`cache: false` bills for them: the windows do not depend on caching).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import genai_prices
from pydantic_ai.messages import (
    ModelMessage,
    ModelRequest,
    ModelResponse,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
    UserPromptPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel

from threadline.pipeline.budget import BudgetParts
from threadline.pipeline.config import ModelSpec
from threadline.pipeline.history import SUMMARY_HEADER, ThreadRead, budgeted_history, encode_messages, summary_messages
from threadline.pipeline.llm import first_sentence, user_prompts
from threadline.pipeline.records import MessageRecord
from threadline.pipeline.tokens import count_messages

MODEL = "claude-sonnet-5-5"
LOW_WATER = 0.7
INSTRUCTIONS = " ".join(f"Rule {i}: answer the customer of Acme politely and check the order first." for i in range(90))
WORDS = ["order", "parcel", "delivery", "address", "invoice", "refund", "courier", "warehouse", "customer", "week",
         "status", "label", "tracking", "payment", "return", "box", "size", "colour", "store", "account", "number"]
#: The lines a summary keeps (the newest): ~200 tokens, as a model's few-sentence summary.
SUMMARY_LINES = 16
WINDOWS = (2000, 8000)


def _prose(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words)) + "."


def conversation(turns: int, seed: int = 11, *, tools: bool = True) -> list[tuple[str, list[ModelMessage]]]:
    """`turns` (query, stored messages) pairs: ~150-token questions, ~100-token answers (the fake's
    tokens are words), a clock call and its result in every 5th turn (`tools`)."""
    rng = random.Random(seed)
    out: list[tuple[str, list[ModelMessage]]] = []
    for i in range(turns):
        # a short first sentence, what a summary of the turn keeps (`summarise`)
        query = (f"Question {i} is about the {rng.choice(WORDS)} of order {rng.randrange(1000, 9999)}. "
                 + _prose(rng, max(50, round(rng.gauss(130, 25)))))
        answer = _prose(rng, max(40, round(rng.gauss(95, 20))))
        messages: list[ModelMessage] = [ModelRequest(parts=[UserPromptPart(query)])]
        if tools and i % 5 == 4:
            call = f"call-{i}"
            messages += [ModelResponse(parts=[ToolCallPart("clock", {}, tool_call_id=call)]),
                         ModelRequest(parts=[ToolReturnPart("clock", "2026-12-02T10:00:00+00:00", tool_call_id=call)])]
        messages.append(ModelResponse(parts=[TextPart(answer)]))
        out.append((query, messages))
    return out


def summarise(previous: str | None, queries: Sequence[str]) -> str:
    """A bounded running summary: the previous one's lines and the first sentence of each new
    question, the newest `SUMMARY_LINES` kept."""
    lines = [*(previous.splitlines() if previous else []), *(first_sentence(q) for q in queries)]
    return "\n".join(lines[-SUMMARY_LINES:])


def summariser(options: dict[str, Any]) -> FunctionModel:
    """`summarise` as the compaction's model (a `python:` plugin of the workers' mode): it reads the
    previous summary, given first, and the questions of the turns it has not covered yet."""
    def answer(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        prompts = user_prompts(messages)[:-1]  # the last one asks for the summary
        previous = next((p.removeprefix(SUMMARY_HEADER).strip() for p in prompts if p.startswith(SUMMARY_HEADER)),
                        None)
        return ModelResponse(parts=[TextPart(summarise(previous, [p for p in prompts
                                                                  if not p.startswith(SUMMARY_HEADER)]))])

    return FunctionModel(answer, model_name="bench:summariser")


# --- what the provider received -------------------------------------------------------------------


def _plain(block: Any) -> Any:
    return {k: v for k, v in block.items() if k != "cache_control"} if isinstance(block, dict) else block


def sent_messages(body: dict[str, Any]) -> list[Any]:
    """A Messages request's messages as the cache sees them (breakpoints are not content)."""
    return [{"role": m["role"], "content": [_plain(b) for b in m["content"]] if isinstance(m["content"], list)
             else m["content"]} for m in body.get("messages") or []]


def _is_summary(message: Any) -> bool:
    content = message["content"]
    first = content[0] if isinstance(content, list) and content else content
    text = first.get("text", "") if isinstance(first, dict) else str(first)
    return message["role"] == "user" and text.startswith(SUMMARY_HEADER)


def stable_part(messages: Sequence[Any]) -> list[Any]:
    """What a request offers the next turn to reuse: its history, less the turn's query, and less the
    summary block when one follows the kept turns (its position moves as turns are added)."""
    history = list(messages[:-1])
    at = next((i for i, m in enumerate(history) if _is_summary(m)), None)
    return history[:at] if at else history


def prefix_kept(previous: Sequence[Any] | None, messages: Sequence[Any]) -> bool:
    if previous is None:
        return False
    stable = stable_part(previous)
    return list(messages[:len(stable)]) == stable


@dataclass
class Run:
    turns: int
    window: int
    cache: bool
    mode: str = "in-process"
    low_water: float = LOW_WATER
    input_tokens: int = 0
    cache_read_tokens: int = 0
    cache_write_tokens: int = 0
    cost_usd: float = 0.0
    #: The same requests priced with caching off (the workers' mode; in process, a run of its own).
    cost_off_usd: float | None = None
    over_budget: int = 0
    kept_prefix: int = 0
    mean_kept_tokens: float = 0.0
    mean_summary_tokens: float = 0.0
    mean_budget: float = 0.0
    seconds: float = 0.0
    kept_sizes: list[int] = field(default_factory=list, repr=False)
    summary_sizes: list[int] = field(default_factory=list, repr=False)

    @property
    def read_share(self) -> float:
        return self.cache_read_tokens / self.input_tokens if self.input_tokens else 0.0

    @property
    def stability(self) -> float:
        return self.kept_prefix / self.over_budget if self.over_budget else float("nan")

    def add_usage(self, input_tokens: int, read: int, write: int, cost: float | None) -> None:
        self.input_tokens += input_tokens
        self.cache_read_tokens += read
        self.cache_write_tokens += write
        self.cost_usd += cost or 0.0

    def over(self, kept: bool, kept_tokens: int, summary_tokens: int) -> None:
        """One over-budget turn: whether it kept the previous request's prefix, and what it kept."""
        self.over_budget += 1
        self.kept_prefix += kept
        self.kept_sizes.append(kept_tokens + summary_tokens)
        self.summary_sizes.append(summary_tokens)

    def finish(self, started: float) -> None:
        self.mean_kept_tokens = statistics.mean(self.kept_sizes) if self.kept_sizes else 0.0
        self.mean_summary_tokens = statistics.mean(self.summary_sizes) if self.summary_sizes else 0.0
        self.seconds = time.perf_counter() - started


def uncached_cost(input_tokens: int, output_tokens: int) -> float:
    """What the same tokens cost with caching off."""
    price = genai_prices.calc_price(genai_prices.Usage(input_tokens=input_tokens, output_tokens=output_tokens),
                                    MODEL, provider_id="anthropic")
    return float(price.total_price)


# --- in this process ------------------------------------------------------------------------------


async def _drain(ctx: Any, stream: AsyncIterable[Any]) -> None:
    async for _ in stream:
        pass


@dataclass
class Thread:
    """The stored side of one conversation as the history stage reads it, with its compaction."""

    window: int
    low_water: float
    compaction: bool
    tokenizer: Any
    rows: list[MessageRecord] = field(default_factory=list)
    snapshots: dict[str, bytes] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    summaries: dict[str, tuple[str, int]] = field(default_factory=dict)
    queries: list[str] = field(default_factory=list)
    summarised_to: int = -1
    previous_start: str | None = None

    def history(self, *, summary_first: bool) -> tuple[list[ModelMessage], int, int, bool]:
        """The next turn's history (the kept turns, then the summary), its kept and summary tokens,
        and whether the thread is over budget. `summary_first`: the layout before the summary moved
        behind the kept turns (for the comparison)."""
        read = ThreadRead(rows=list(self.rows), snapshots=self.snapshots, counts=self.counts, complete=True,
                          previous_start=self.previous_start, budget=BudgetParts(self.window, 0, 0, 0, 0, 0),
                          tokenizer=self.tokenizer.name, summaries=dict(self.summaries))
        messages, window, watermark, _ = budgeted_history(read, low_water=self.low_water)
        summary_tokens = self.summaries[watermark][1] if watermark else 0
        if summary_first and watermark:
            messages = [*messages[-2:], *messages[:-2]]
        self.previous_start = window.start
        return messages, window.tokens, summary_tokens, sum(self.counts.values()) > self.window

    def add(self, query: str, messages: Sequence[ModelMessage]) -> None:
        i = len(self.rows)
        mid = f"m{i}"
        self.rows.append(MessageRecord(id=mid, conversation_id="c", parent_id=f"m{i - 1}" if i else None,
                                       turn_id=mid, query=query, status="succeeded"))
        self.snapshots[mid] = encode_messages(messages)
        self.counts[mid] = count_messages(messages, self.tokenizer)
        self.queries.append(query)

    def compact(self) -> None:
        """As the compaction stage after a turn: summarise up to the turn before the window start."""
        if not self.compaction or self.previous_start is None:
            return
        watermark = int(self.previous_start[1:]) - 1
        if watermark < 0 or f"m{watermark}" in self.summaries:
            return
        previous = self.summaries[f"m{self.summarised_to}"][0] if self.summarised_to >= 0 else None
        text = summarise(previous, self.queries[self.summarised_to + 1: watermark + 1])
        self.summaries[f"m{watermark}"] = (text, count_messages(summary_messages(text), self.tokenizer))
        self.summarised_to = watermark


async def run_conversation(turns: int, window: int, *, cache: bool, low_water: float = LOW_WATER,
                           compaction: bool = True, summary_first: bool = False) -> Run:
    from tests.support.fake_providers import FakeProvider
    from threadline.pipeline.cost import run_usage
    from threadline.pipeline.invoke import BUILTIN_TOOLS, build_agent
    from threadline.workers.worker.providers import build_model
    from threadline.workers.worker.tokenizers import load_tokenizer

    tokenizer = load_tokenizer(None, "anthropic")
    talk = conversation(turns)
    thread = Thread(window, low_water, compaction, tokenizer)
    result = Run(turns, window, cache, low_water=low_water)
    started = time.perf_counter()
    with FakeProvider("anthropic", caching=True, model=MODEL) as server:
        spec = ModelSpec(provider="anthropic", name=MODEL, base_url=server.base_url, cache=cache)
        agent = build_agent(build_model(spec, env={"ANTHROPIC_API_KEY": "sk-fake"}), [BUILTIN_TOOLS["clock"]])
        cid = f"c-bench-{uuid.uuid4().hex[:8]}"
        previous: list[Any] | None = None
        for i, (query, stored) in enumerate(talk):
            history, kept, summary_tokens, over = thread.history(summary_first=summary_first) if i else ([], 0, 0,
                                                                                                          False)
            run = await agent.run(query, message_history=history or None, instructions=INSTRUCTIONS,
                                  conversation_id=cid, run_id=f"{cid}/{i}", event_stream_handler=_drain)
            sent = sent_messages(server.exchanges[-1].body)
            if over:
                result.over(prefix_kept(previous, sent), kept, summary_tokens)
            previous = sent
            usage = run_usage(run.new_messages())
            result.add_usage(usage.input_tokens, usage.cache_read_tokens, usage.cache_write_tokens, usage.cost_usd)
            thread.add(query, stored)
            thread.compact()
    result.mean_budget = float(window)
    result.finish(started)
    return result


# --- through real workers -------------------------------------------------------------------------


MAX_OUTPUT, MARGIN = 1024, 256


def _agent_config(agent_id: str, base_url: str, context_window: int, low_water: float) -> dict[str, Any]:
    return {"id": agent_id, "instructions": INSTRUCTIONS, "tools": ["clock"],
            "model": {"provider": "anthropic", "name": MODEL, "base_url": base_url,
                      "context_window": context_window, "max_output_tokens": MAX_OUTPUT},
            "memory": {"safety_margin_tokens": MARGIN, "low_water": low_water,
                       "compaction": {"summariser": {"provider": "python", "name": "bench.prompt_caching:summariser"}}}}


def fixed_parts(client: Any) -> int:
    """The instructions, the tools and a mean question as the history stage counts them, from one turn
    of a probe agent (against a fake of its own): a context window of the history window plus these,
    the answer's reserve and the margin leaves the history about the window."""
    from tests.support.fake_providers import FakeProvider
    from threadline.workers.worker.tokenizers import load_tokenizer

    tokenizer = load_tokenizer(None, "anthropic")
    questions = [q for q, _ in conversation(200, tools=False)]
    with FakeProvider("anthropic", model=MODEL) as probe:
        agent_id = f"bench-pc-probe-{uuid.uuid4().hex[:6]}"
        client.put_agent_result(json.dumps(_agent_config(agent_id, probe.base_url, 100_000, LOW_WATER)))
        terminal = client.wait(client.submit({"tenant_id": "bench-probe", "app_id": "bench", "user_id": "u1",
                                              "agent_id": agent_id, "query": questions[0]}), timeout_s=120)
        budget = client.decisions(terminal.turn_id, conversation_id=terminal.conversation_id)["history"]["budget"]
    query = budget["query"] - tokenizer.count(questions[0]) + statistics.mean(tokenizer.count(q) for q in questions)
    return int(budget["instructions"] + budget["tools"] + round(query))


def _wait_compacted(client: Any, turn_id: str, cid: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while "compact" not in client.decisions(turn_id, conversation_id=cid):
        if time.monotonic() > deadline:
            raise TimeoutError(f"turn {turn_id}: no compaction within {timeout_s:g} s")
        time.sleep(0.02)


def clock_every_fifth(body: dict[str, Any]) -> str | None:
    """The fake's tool call (`FakeProvider(tool_call=...)`): `clock` for the question of every 5th
    turn, as in this process's conversations; the text once the call's result is back."""
    last = (body.get("messages") or [{}])[-1]
    blocks = last.get("content") if isinstance(last.get("content"), list) else [{"text": last.get("content")}]
    if any(isinstance(b, dict) and b.get("type") == "tool_result" for b in blocks):
        return None
    text = " ".join(str(b.get("text") or "") for b in blocks if isinstance(b, dict))
    number = text.removeprefix("Question ").split(" ", 1)[0]
    return "clock" if text.startswith("Question ") and number.isdigit() and int(number) % 5 == 4 else None


def worker_conversation(client: Any, turns: int, window: int, low_water: float, fixed: int, out: list[Run]) -> None:
    """One conversation through the workers against a caching fake of its own."""
    from tests.support.fake_providers import FakeProvider
    from threadline.pipeline import events as ev

    result = Run(turns, window, True, mode="workers", low_water=low_water, cost_off_usd=0.0)
    started = time.perf_counter()
    budgets: list[int] = []
    with FakeProvider("anthropic", caching=True, model=MODEL, tool_call=clock_every_fifth) as server:
        server.text = _prose(random.Random(window + turns), 95)  # a ~100-token answer
        agent_id = f"bench-pc-{turns}-{window}-{uuid.uuid4().hex[:6]}"
        context_window = window + MAX_OUTPUT + MARGIN + fixed
        client.put_agent_result(json.dumps(_agent_config(agent_id, server.base_url, context_window, low_water)))
        cid: str | None = None
        previous: list[Any] | None = None
        for query, _ in conversation(turns, tools=False):
            request = {"tenant_id": "bench", "app_id": "bench", "user_id": "u1", "agent_id": agent_id,
                       "query": query, **({"conversation_id": cid} if cid else {})}
            asked = len([e for e in server.exchanges if e.route != "count"])
            terminal = client.wait(client.submit(request), timeout_s=120)
            if not isinstance(terminal, ev.Succeeded):
                raise RuntimeError(f"turn failed: {terminal}")
            cid = terminal.conversation_id or ""
            _wait_compacted(client, terminal.turn_id, cid)
            usage, decision = terminal.usage, client.decisions(terminal.turn_id, conversation_id=cid)["history"]
            result.add_usage(usage.input_tokens, usage.cache_read_tokens, usage.cache_write_tokens, usage.cost_usd)
            result.cost_off_usd = (result.cost_off_usd or 0.0) + uncached_cost(usage.input_tokens, usage.output_tokens)
            # the turn's first request (a tool call's result goes back in a second one)
            sent = sent_messages([e for e in server.exchanges if e.route != "count"][asked].body)
            window_record, summary = decision["window"], decision.get("summary")
            budgets.append(decision["budget"]["history"])
            if window_record["dropped_turns"] or not decision["read"]["complete"]:
                result.over(prefix_kept(previous, sent), window_record["kept_tokens"],
                            summary["tokens"] if summary else 0)
            previous = sent
    result.mean_budget = statistics.mean(budgets)
    result.finish(started)
    out.append(result)


def run_workers(sizes: Sequence[int], low_water: float) -> list[Run]:
    """Every conversation side by side, through one worker process and a fresh server."""
    from bench.procs import Processes, Server, bench_session, progress
    from bench.systems import ThreadlineSystem
    from threadline.workers.clients.client import Client
    from threadline.workers.settings import model_policy

    policy = {"TL_BASE_URL_ALLOW": "http://127.0.0.1:", "TL_KEY_ENV_ALLOW": "ANTHROPIC_API_KEY"}
    runs: list[Run] = []
    with bench_session("bench.prompt_caching", None, keep=False) as (_, workdir):
        processes = Processes(workdir / "logs")
        server = Server(processes, workdir / "server")
        try:
            url = server.start()
            prefix = f"tlpc{uuid.uuid4().hex[:6]}"
            system = ThreadlineSystem(processes, url, prefix=prefix, threads=8, env={
                **policy, "ANTHROPIC_API_KEY": "sk-fake", "TL_ALLOW_PYTHON_PLUGINS": "1", "TL_LOG_LEVEL": "WARNING"})
            system.start(1)
            progress(f"server {server.version}, 1 worker process")
            client = Client(url, prefix=prefix, policy=model_policy(policy))
            fixed = fixed_parts(client)
            threads = [threading.Thread(target=worker_conversation,
                                        args=(client, turns, window, low_water, fixed, runs))
                       for turns in sizes for window in WINDOWS]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            client.close()
            system.close()
        finally:
            processes.stop_all()
            server.stop()
    return sorted(runs, key=lambda r: (r.turns, r.window))


# --- the report -----------------------------------------------------------------------------------


def report(runs: Sequence[Run]) -> list[str]:
    off = {(r.turns, r.window): r.cost_usd for r in runs if not r.cache}
    lines = ["| turns | window (mean budget) | input tokens | read from cache | cache writes | cost/turn on | "
             "cost/turn off | on/off | prefix kept (over-budget turns) | mean history kept (of which summary) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in (r for r in runs if r.cache):
        cost_off = r.cost_off_usd if r.cost_off_usd is not None else off[(r.turns, r.window)]
        lines.append(f"| {r.turns} | {r.window:,} ({r.mean_budget:,.0f}) | {r.input_tokens:,} | {r.read_share:.0%} | "
                     f"{r.cache_write_tokens:,} | ${r.cost_usd / r.turns:.5f} | ${cost_off / r.turns:.5f} | "
                     f"{r.cost_usd / cost_off:.0%} | {r.kept_prefix}/{r.over_budget} ({r.stability:.0%}) | "
                     f"{r.mean_kept_tokens:,.0f} ({r.mean_summary_tokens:,.0f}) |")
    return lines


async def main_async(opts: argparse.Namespace) -> list[Run]:
    sizes = [40] if opts.quick else [40, 200]
    runs: list[Run] = []
    for turns in sizes:
        for window in WINDOWS:
            for cache in (True, False):
                runs.append(await run_conversation(turns, window, cache=cache, low_water=opts.low_water,
                                                   compaction=not opts.no_compaction,
                                                   summary_first=opts.summary_first))
                print(f"[bench] {turns} turns, window {window}, cache {cache}: {runs[-1].seconds:.1f} s",
                      file=sys.stderr, flush=True)
    return runs


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.prompt_caching", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="the 40-turn conversations only")
    parser.add_argument("--workers", action="store_true", help="through a worker process and a fresh server")
    parser.add_argument("--low-water", type=float, default=LOW_WATER, help=f"memory.low_water (default {LOW_WATER})")
    parser.add_argument("--no-compaction", action="store_true", help="in process: no summary")
    parser.add_argument("--summary-first", action="store_true",
                        help="in process: the summary in front of the kept turns (the layout before)")
    parser.add_argument("--json", action="store_true", help="the runs as JSON")
    opts = parser.parse_args(argv)
    started = time.perf_counter()
    if opts.workers:
        runs = run_workers([40] if opts.quick else [40, 200], opts.low_water)
    else:
        runs = asyncio.run(main_async(opts))
    if opts.json:
        print(json.dumps([asdict(r) for r in runs]))
    else:
        print("\n".join(report(runs)))
        print(f"\n(low_water {opts.low_water}; {time.perf_counter() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
