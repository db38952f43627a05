"""Provider prompt caching through real worker processes and the caching fakes of Anthropic and OpenAI
(`tests/support/fake_providers.py`, `caching=True`): what a Claude agent's requests carry (breakpoints
after the tools and instructions, at the end of the stable history prefix, within four), what an OpenAI
agent's carry (`prompt_cache_key` from the conversation), and the usage that comes back — cache reads
and writes and the cost, on the terminal event, the message rows and the tenant's counters. An offline
turn reports the tokens it received, counted with the agent's tokenizer."""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import genai_prices
import pytest
from pydantic import ValidationError
from pydantic_ai.messages import (
    CachePoint,
    InstructionPart,
    ModelMessage,
    ModelRequest,
    ModelResponse,
    TextPart,
    UserPromptPart,
)
from pydantic_ai.models import ModelRequestParameters
from pydantic_ai.tools import ToolDefinition

from tests.conftest import AgentFactory, WorkerPool, drop_prefix, turn
from tests.support.browser import CHROMIUM, DESKTOP
from tests.support.fake_providers import FakeProvider
from tests.support.gateway import running_gateway
from tests.support.wait import wait_until
from threadline.pipeline import events as ev
from threadline.pipeline.caching import (
    cache_plan,
    cache_setting,
    count_breakpoints,
    fixed_prefix_tokens,
    mark_stable_prefix,
    min_cacheable_tokens,
    prompt_cache_key,
)
from threadline.pipeline.config import AgentConfig, ModelSpec
from threadline.pipeline.contracts import Usage
from threadline.pipeline.cost import LocalCount, cached_share, run_usage, usage_counters
from threadline.pipeline.history import SUMMARY_HEADER, summary_messages
from threadline.pipeline.invoke import BUILTIN_TOOLS
from threadline.pipeline.tokens import CharsTokenizer, count_messages, count_tool_definitions
from threadline.workers.cli import main as cli
from threadline.workers.clients.client import Client
from threadline.workers.operations.status import Operations
from threadline.workers.settings import Settings, model_policy
from threadline.workers.storage.api_keys import create_key
from threadline.workers.worker.tokenizers import load_tokenizer

pytestmark = pytest.mark.integration

KEYS = {"ANTHROPIC_API_KEY": "sk-fake-anthropic", "OPENAI_API_KEY": "sk-fake-openai"}
POLICY = {"TL_BASE_URL_ALLOW": "http://127.0.0.1:", "TL_KEY_ENV_ALLOW": ",".join(KEYS)}
#: Instructions long enough to be cached (~1,500 tokens by the fake's count; Anthropic's minimum is 1,024).
INSTRUCTIONS = " ".join(f"Rule {i}: answer the customer politely." for i in range(250))
TENANT_TEXT = "Where is my order 4711?"
CLAUDE, GPT = "claude-sonnet-5-5", "gpt-4o-mini"


@pytest.fixture(scope="module")
def keyed(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Client]:
    """One worker process holding fake Anthropic and OpenAI keys, on a prefix of its own."""
    pool = WorkerPool(redis_url, f"tlpc{uuid.uuid4().hex[:8]}", tmp_path_factory.mktemp("logs"))
    for name in (*KEYS, "AWS_PROFILE"):
        pool.env.pop(name, None)
    pool.env.update({**POLICY, **KEYS})
    client = Client(redis_url, prefix=pool.prefix, policy=model_policy(POLICY))
    pool.start(processes=1, threads=4)
    try:
        yield client
    finally:
        pool.stop()
        drop_prefix(client.redis, pool.prefix)
        client.close()


def _agent(client: Client, model: dict[str, Any], **fields: Any) -> str:
    agent_id = f"agent-{uuid.uuid4().hex[:10]}"
    client.put_agent(AgentConfig.model_validate({"id": agent_id, "model": model, "instructions": INSTRUCTIONS,
                                                 "tools": ["clock"], **fields}))
    return agent_id


def _conversation(client: Client, agent: str, tenant: str, turns: int) -> list[ev.Succeeded]:
    """`turns` turns of one conversation of `tenant`, each asserted to succeed."""
    ended: list[ev.Succeeded] = []
    conversation = None
    for n in range(turns):
        terminal = client.wait(client.submit(turn(agent, _query(n), conversation_id=conversation, tenant_id=tenant)),
                               timeout_s=30)
        assert isinstance(terminal, ev.Succeeded), terminal
        conversation = terminal.conversation_id
        ended.append(terminal)
    return ended


def _model_calls(server: FakeProvider) -> list[dict[str, Any]]:
    return [e.body for e in server.exchanges if e.route != "count"]


def _marked(blocks: Any) -> list[int]:
    """The positions of the blocks of a list that carry a `cache_control` breakpoint."""
    return [i for i, b in enumerate(blocks) if isinstance(b, dict) and "cache_control" in b] if isinstance(
        blocks, list) else []


def _message_breakpoints(body: dict[str, Any]) -> list[tuple[int, int]]:
    return [(m, b) for m, message in enumerate(body["messages"]) for b in _marked(message["content"])]


def test_a_claude_agent_caches_its_tools_instructions_and_stable_prefix_and_reports_reads_and_cost(
    keyed: Client, redis_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    tenant = f"tenant-{uuid.uuid4().hex[:8]}"
    with FakeProvider("anthropic", caching=True, model=CLAUDE) as server:
        agent = _agent(keyed, {"provider": "anthropic", "name": CLAUDE, "base_url": server.base_url})
        ended = _conversation(keyed, agent, tenant, turns=3)
        sent = _model_calls(server)

    last = sent[-1]
    # pydantic-ai's breakpoints: the last tool definition, the instructions, the conversation (top level)
    assert _marked(last["tools"]) == [len(last["tools"]) - 1]
    assert _marked(last["system"]) == [len(last["system"]) - 1]
    assert last["cache_control"]["type"] == "ephemeral"
    # Threadline's: the end of the history the turn was given, the block before its query
    messages = last["messages"]
    assert _message_breakpoints(last) == [(len(messages) - 2, len(messages[-2]["content"]) - 1)]
    assert messages[-1]["role"] == "user" and TENANT_TEXT in str(messages[-1]["content"])
    assert 1 + 1 + 1 + len(_message_breakpoints(last)) <= 4  # within Anthropic's limit
    # the first turn has no history: no breakpoint of Threadline's
    assert _message_breakpoints(sent[0]) == []

    first, *later = [t.usage for t in ended]
    assert first.cache_read_tokens == 0 and first.cache_write_tokens > 1024
    for usage in later:  # each turn reads what the turn before wrote
        assert usage.cache_read_tokens > 1024 and usage.cache_write_tokens > 0
        assert usage.input_tokens > usage.cache_read_tokens + usage.cache_write_tokens
    assert [u.cache_read_tokens for u in later] == [u["read"] for u in server.usages[1:]]
    for usage in [first, *later]:
        assert usage.cost_usd is not None and usage.cost_usd > 0 and usage.counted_by is None
        uncached = genai_prices.calc_price(genai_prices.Usage(input_tokens=usage.input_tokens,
                                                              output_tokens=usage.output_tokens),
                                           CLAUDE, provider_id="anthropic").total_price
        if usage.cache_read_tokens:
            assert usage.cost_usd < float(uncached) / 2  # a read costs a tenth of plain input

    rows = {m.turn_id: m for m in keyed.thread(ended[-1].conversation_id or "")}
    assert [rows[t.turn_id].usage for t in ended] == [t.usage for t in ended]
    counters = Operations(keyed.redis, keyed.keys).usage(tenant)
    assert counters.cache_read_tokens == sum(t.usage.cache_read_tokens for t in ended)
    assert counters.cache_write_tokens == sum(t.usage.cache_write_tokens for t in ended)
    assert counters.unpriced_turns == 0
    assert counters.cost_usd == pytest.approx(sum(t.usage.cost_usd or 0 for t in ended), abs=1e-5)

    # `threadline usage`, of the tenant and of the conversation, says the same
    monkeypatch.setenv("REDIS_URL", redis_url)
    monkeypatch.setenv("TL_PREFIX", keyed.keys.prefix)
    reads = sum(t.usage.cache_read_tokens for t in ended)
    for argv in ([tenant], ["--conversation", ended[-1].conversation_id or ""]):
        for extra in (["--json"], []):
            capsys.readouterr()
            with pytest.raises(SystemExit) as exited:
                cli.main(["usage", *argv, *extra])
            out = capsys.readouterr().out
            assert exited.value.code in (0, None), out
            if extra:
                shown = json.loads(out)
                assert shown["cache_read_tokens"] == reads and shown["unpriced_turns"] == 0
                assert shown["cost_usd"] == pytest.approx(counters.cost_usd, abs=1e-5) and shown["cost_usd"] > 0
            else:
                assert f"({reads} read from cache, " in out and "  cost: $" in out and "unknown" not in out


def test_with_a_summary_the_breakpoint_ends_the_kept_turns_and_the_turn_after_a_cut_reads_them_back(
    keyed: Client,
) -> None:
    """The running summary follows the kept turns: the summary a cut's compaction writes changes
    what the next turn sends after them, not the cached prefix in front."""
    tokenizer = load_tokenizer(None, "anthropic")
    fixed = (tokenizer.count(INSTRUCTIONS) + count_tool_definitions([BUILTIN_TOOLS["clock"].tool_def], tokenizer)
             + tokenizer.count(_query(0)))
    memory = {"safety_margin_tokens": 0, "low_water": 0.5, "compaction": {"summariser": "offline:summary"}}
    tenant = f"tenant-{uuid.uuid4().hex[:8]}"
    with FakeProvider("anthropic", caching=True, model=CLAUDE) as server:
        agent = _agent(keyed, {"provider": "anthropic", "name": CLAUDE, "base_url": server.base_url,
                               "context_window": fixed + 256 + 1000, "max_output_tokens": 256}, memory=memory)
        conversation, decisions = None, []
        for n in range(9):
            terminal = keyed.wait(keyed.submit(turn(agent, _query(n), conversation_id=conversation,
                                                    tenant_id=tenant)), timeout_s=30)
            assert isinstance(terminal, ev.Succeeded), terminal
            conversation = terminal.conversation_id or ""
            wait_until(lambda t=terminal.turn_id, c=conversation: "compact" in keyed.decisions(t, conversation_id=c))
            decisions.append(keyed.decisions(terminal.turn_id, conversation_id=conversation)["history"])
        sent, reads = _model_calls(server), [u["read"] for u in server.usages]

    reasons = [d["window"]["reason"] for d in decisions]
    cut = reasons.index("pruned_to_low_water")
    after = cut + 1
    assert reasons[after] == "prefix_kept" and decisions[after]["summary"] is not None, reasons
    messages = sent[after]["messages"]
    at = next(i for i, m in enumerate(messages) if m["role"] == "user" and _text(m).startswith(SUMMARY_HEADER))
    assert at == len(messages) - 3  # the summary, its acknowledgement, the turn's query
    # the one breakpoint of Threadline's: the last block of the kept turns, right before the summary
    assert _message_breakpoints(sent[after]) == [(at - 1, len(messages[at - 1]["content"]) - 1)]
    # the cut moved the prefix (tools and instructions read back); the turn after it reads the kept turns too
    assert reads[cut] < reads[after]


def _query(n: int) -> str:
    return f"{TENANT_TEXT} Question {n}: " + "please tell me more about it. " * 30


def _text(message: dict[str, Any]) -> str:
    content = message["content"]
    return str(content[0].get("text", "") if isinstance(content, list) else content)


def test_an_openai_agent_sends_a_prompt_cache_key_of_its_conversation_and_reads_in_128_token_steps(
    keyed: Client,
) -> None:
    tenant = f"tenant-{uuid.uuid4().hex[:8]}"
    with FakeProvider("openai", caching=True, model=GPT) as server:
        agent = _agent(keyed, {"provider": "openai", "name": GPT, "base_url": server.base_url})
        ended = _conversation(keyed, agent, tenant, turns=2)
        sent = _model_calls(server)

    key = prompt_cache_key(ended[0].conversation_id or "")
    assert [body["prompt_cache_key"] for body in sent] == [key] * len(sent)
    assert tenant not in key and ended[0].conversation_id not in key
    first, second = ended[0].usage, ended[1].usage
    assert first.cache_read_tokens == 0
    assert second.cache_read_tokens >= 1024 and (second.cache_read_tokens - 1024) % 128 == 0
    assert second.cost_usd is not None and second.cost_usd > 0


def test_cache_off_sends_no_breakpoint_and_no_cache_key(keyed: Client) -> None:
    tenant = f"tenant-{uuid.uuid4().hex[:8]}"
    with FakeProvider("anthropic", caching=True, model=CLAUDE) as claude, \
            FakeProvider("openai", caching=True, model=GPT) as gpt:
        for server, provider, name in ((claude, "anthropic", CLAUDE), (gpt, "openai", GPT)):
            agent = _agent(keyed, {"provider": provider, "name": name, "base_url": server.base_url, "cache": False})
            ended = _conversation(keyed, agent, tenant, turns=2)
            assert ended[1].usage.cache_write_tokens == 0
        for body in _model_calls(claude):
            assert "cache_control" not in body and _marked(body["tools"]) == []
            assert _marked(body["system"]) == [] and _message_breakpoints(body) == []
        assert all("prompt_cache_key" not in body for body in _model_calls(gpt))


def test_a_fallback_chain_caches_each_model_by_its_own_setting(keyed: Client) -> None:
    tenant = f"tenant-{uuid.uuid4().hex[:8]}"
    with FakeProvider("anthropic", always_status=503, model=CLAUDE) as down, \
            FakeProvider("openai", caching=True, model=GPT) as gpt:
        agent = _agent(keyed, {"provider": "anthropic", "name": CLAUDE, "base_url": down.base_url, "cache": "1h",
                               "fallback": [{"provider": "openai", "name": GPT, "base_url": gpt.base_url}]})
        ended = _conversation(keyed, agent, tenant, turns=1)
        claude_calls, gpt_calls = _model_calls(down), _model_calls(gpt)

    assert ended[0].model == GPT
    assert claude_calls and all(body["system"][-1]["cache_control"]["ttl"] == "1h" for body in claude_calls)
    assert gpt_calls and gpt_calls[0]["prompt_cache_key"] == prompt_cache_key(ended[0].conversation_id or "")


def test_an_offline_turn_reports_the_tokens_it_received_counted_with_the_agents_tokenizer(
    workers: WorkerPool, client: Client, make_agent: AgentFactory,
) -> None:
    agent = make_agent("offline:echo", instructions="You answer briefly.", tools=["clock"])
    first = client.wait(client.submit(turn(agent, "Hello there, how are you today?")), timeout_s=30)
    assert isinstance(first, ev.Succeeded), first
    second = client.wait(client.submit(turn(agent, "And what did I just ask?",
                                            conversation_id=first.conversation_id)), timeout_s=30)
    assert isinstance(second, ev.Succeeded), second

    for terminal in (first, second):
        record = client.decisions(terminal.turn_id)["history"]
        budget, window = record["budget"], record["window"]
        counted = budget["instructions"] + budget["query"] + budget["tools"] + window["kept_tokens"]
        assert terminal.usage.input_tokens == counted, record
        assert terminal.usage.counted_by == record["tokenizer"]
        assert terminal.usage.cost_usd is None  # unknown, never 0
    assert second.usage.input_tokens > first.usage.input_tokens


# --- the pure parts, plain data in and out ---------------------------------------------------------


def test_model_cache_maps_onto_pydantic_ais_cache_setting() -> None:
    def spec(cache: Any) -> ModelSpec:
        return ModelSpec(provider="anthropic", name=CLAUDE, cache=cache)

    assert [cache_setting(spec(v)) for v in (True, "on", False, "off", "1h")] == [True, True, False, False, "1h"]
    assert cache_setting(spec({"messages": False})) == {"messages": False}
    assert cache_setting(spec({"retention": "5m", "messages": False})) == {"messages": False, "retention": "5m"}
    assert ModelSpec(provider="anthropic", name=CLAUDE).cache is True  # the default: on
    with pytest.raises(ValidationError):
        spec("2h")
    tokenizer = CharsTokenizer()
    assert cache_plan(spec(False), tokenizer) is None
    assert cache_plan(spec({"messages": False}), tokenizer).breakpoints is False  # type: ignore[union-attr]
    gpt = cache_plan(ModelSpec(provider="openai", name=GPT), tokenizer)
    assert gpt is not None and gpt.cache_key and not gpt.breakpoints
    assert min_cacheable_tokens("claude-3-5-haiku-latest") == 2048 and min_cacheable_tokens(CLAUDE) == 1024


def test_the_breakpoint_marks_the_end_of_the_kept_turns_before_the_summary_and_never_a_short_prefix() -> None:
    turns: list[ModelMessage] = [ModelRequest(parts=[UserPromptPart("and then? " * 200)], run_id="old"),
                                 ModelResponse(parts=[TextPart("it shipped")], run_id="old")]
    summary = summary_messages("the customer asked about order 4711. " * 60)
    new = ModelRequest(parts=[UserPromptPart("where is it now?")], run_id="now")
    tokenizer = CharsTokenizer()
    # the summary follows the kept turns (it changes the turn after a cut): the point goes at its head
    marked = mark_stable_prefix([*turns, *summary, new], run_id="now", min_tokens=100, tokenizer=tokenizer)
    assert count_breakpoints(marked) == 1
    summary_part = marked[2].parts[0]
    assert isinstance(summary_part, UserPromptPart) and isinstance(summary_part.content, list)
    assert isinstance(summary_part.content[0], CachePoint)
    # no summary: at the head of the turn's query
    marked = mark_stable_prefix([*turns, new], run_id="now", min_tokens=100, tokenizer=tokenizer)
    query_part = marked[-1].parts[0]
    assert isinstance(query_part, UserPromptPart) and isinstance(query_part.content, list)
    assert isinstance(query_part.content[0], CachePoint) and query_part.content[1] == "where is it now?"
    # a summary and no kept turn: at the summary's end; in front of turns, at its end and theirs
    marked = mark_stable_prefix([*summary, new], run_id="now", min_tokens=100, tokenizer=tokenizer)
    first = marked[0].parts[0]
    assert count_breakpoints(marked) == 1 and isinstance(first, UserPromptPart)
    assert isinstance(first.content, list) and isinstance(first.content[-1], CachePoint)
    assert count_breakpoints(mark_stable_prefix([*summary, *turns, new], run_id="now", min_tokens=100,
                                                tokenizer=tokenizer)) == 2
    assert count_breakpoints([*turns, *summary]) == 0  # the stored history is left as it was
    assert count_breakpoints(mark_stable_prefix([*turns, new], run_id="now", min_tokens=10**6,
                                                tokenizer=tokenizer)) == 0
    assert count_breakpoints(mark_stable_prefix([new], run_id="now", min_tokens=0, tokenizer=tokenizer)) == 0


def test_the_minimum_cacheable_length_counts_the_tool_definitions_and_instructions_before_the_messages() -> None:
    """Anthropic caches tools, system and messages as one prefix: a short history after long
    instructions is worth a breakpoint, the same history alone is not."""
    turns: list[ModelMessage] = [ModelRequest(parts=[UserPromptPart("where is my parcel?")], run_id="old"),
                                 ModelResponse(parts=[TextPart("on its way")], run_id="old")]
    new = ModelRequest(parts=[UserPromptPart("and now?")], run_id="now")
    tokenizer = CharsTokenizer()
    history = count_messages(turns, tokenizer)
    assert history < 1024
    alone = mark_stable_prefix([*turns, new], run_id="now", min_tokens=1024, tokenizer=tokenizer)
    assert count_breakpoints(alone) == 0
    tool = ToolDefinition(name="lookup", description="Look an order up. " * 200,
                          parameters_json_schema={"type": "object", "properties": {}})
    params = ModelRequestParameters(function_tools=[tool], instruction_parts=[InstructionPart(INSTRUCTIONS)])
    fixed = fixed_prefix_tokens(params, tokenizer)
    assert fixed == count_tool_definitions([tool], tokenizer) + tokenizer.count(INSTRUCTIONS)
    assert count_tool_definitions([tool], tokenizer) + history < 1024 <= fixed + history
    counted = mark_stable_prefix([*turns, new], run_id="now", min_tokens=1024, tokenizer=tokenizer,
                                 fixed_tokens=fixed)
    assert count_breakpoints(counted) == 1


def test_a_cost_nobody_knows_is_none_and_counted_apart() -> None:
    unknown = Usage(input_tokens=100, output_tokens=10, requests=1)
    assert usage_counters(unknown) == {"input_tokens": 100, "output_tokens": 10, "requests": 1,
                                       "cache_read_tokens": 0, "cache_write_tokens": 0, "unpriced_turns": 1}
    priced = unknown.model_copy(update={"cost_usd": 0.0012346, "cache_read_tokens": 60})
    assert usage_counters(priced)["cost_micro_usd"] == 1235 and "unpriced_turns" not in usage_counters(priced)
    assert cached_share(priced) == 0.6 and cached_share(Usage()) is None
    offline = ModelResponse(parts=[TextPart("hi")], model_name="offline:echo")
    assert run_usage([offline]).cost_usd is None
    local = run_usage([ModelRequest(parts=[UserPromptPart("one two three")]), offline],
                      local=LocalCount(CharsTokenizer(), fixed_tokens=7))
    assert (local.input_tokens, local.output_tokens, local.counted_by) == (7 + 4 + 4, 1, "chars/4")


# --- the console -----------------------------------------------------------------------------------


@pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="Debian's chromium is not installed: apt-get install chromium")
def test_the_console_shows_the_cached_share_of_each_turn(keyed: Client, redis_url: str) -> None:
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is in the `test` extra")
    expect = sync_api.expect
    settings = dataclasses.replace(Settings.from_env({}), prefix=keyed.keys.prefix, redis_url=redis_url)
    key = create_key(keyed.redis, keyed.keys, f"tpc{uuid.uuid4().hex[:6]}")
    with FakeProvider("anthropic", caching=True, model=CLAUDE) as server, \
            running_gateway(settings, redis_url) as base, sync_api.sync_playwright() as p:
        agent = _agent(keyed, {"provider": "anthropic", "name": CLAUDE, "base_url": server.base_url})
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True)
        try:
            page = browser.new_page(viewport=DESKTOP)
            page.set_default_timeout(20_000)
            page.on("pageerror", lambda error: print("the console's script failed:", error))
            page.goto(base)
            page.fill("#key", key)
            page.click("#connect")
            expect(page.locator("#status")).to_contain_text("connected", timeout=20_000)
            page.select_option("#agent", agent)
            for n in (1, 2):
                page.fill("#query", f"{TENANT_TEXT} Question {n}: " + "please tell me more about it. " * 30)
                page.click("#send")
                # the first turn loads the Anthropic SDK and a tokenizer in the worker: seconds on a busy machine
                expect(page.locator("#chat .turn:not(.live)")).to_have_count(n, timeout=60_000)
                expect(page.locator("#chat .turn.live")).to_have_count(0, timeout=60_000)
            first, second = page.locator("#chat .turn").nth(0), page.locator("#chat .turn").nth(1)
            expect(first.locator(".budget .cache")).to_have_attribute("data-cached-share", "0%")
            expect(second.locator(".budget .cache")).to_contain_text("served from the provider's cache")
            share = second.locator(".budget .cache").get_attribute("data-cached-share") or "0%"
            assert int(share.rstrip("%")) > 50, share  # the instructions and the first turn, read back
            expect(second.locator(".meta")).to_contain_text(f"{share} cached")
            expect(second.locator(".meta")).to_contain_text("$")
        finally:
            browser.close()
