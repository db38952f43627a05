"""`model.tokenizer: provider`: the provider's count endpoint through pydantic-ai's `count_tokens`,
against local fakes of Anthropic `count_tokens`, Gemini `countTokens` and Bedrock `CountTokens`
(`tests/support/fake_providers.py`): what is counted, what is asked once, and the labelled fallback
when the endpoint fails."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client import REGISTRY
from pydantic import ValidationError
from pydantic_ai.messages import ModelRequest, ModelResponse, TextPart, ToolCallPart, ToolReturnPart, UserPromptPart
from pydantic_ai.models import override_allow_model_requests

from tests.support.fake_providers import FakeProvider, ProviderName, request_tokens, text_tokens
from threadline.pipeline.config import ModelSpec
from threadline.workers.cli.turns import describe_budget
from threadline.workers.worker import token_counting as counters
from threadline.workers.worker.providers import build_counting_model
from threadline.workers.worker.token_counting import COUNT_RETRY_S, CountUnavailable, LocalCounter, ProviderCounter
from threadline.workers.worker.tokenizers import load_tokenizer

ENV = {"ANTHROPIC_API_KEY": "sk-fake-anthropic", "GOOGLE_API_KEY": "fake-google",
       "AWS_ACCESS_KEY_ID": "AKIAFAKEBEDROCK", "AWS_SECRET_ACCESS_KEY": "fake-aws-secret", "AWS_REGION": "us-east-1"}
NAMES: dict[ProviderName, str] = {"anthropic": "claude-sonnet-5-5", "google": "gemini-3.5-flash-lite",
                                  "bedrock": "anthropic.claude-3-5-haiku-20241022-v1:0"}
COUNT_PATHS = {"anthropic": "/v1/messages/count_tokens", "google": ":countTokens", "bedrock": "/count-tokens"}


@pytest.fixture(autouse=True)
def local_fakes_only() -> Iterator[None]:
    """Other test modules forbid model requests in the process they share with this one; these go to
    local fakes."""
    with override_allow_model_requests(True):
        yield


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def counter_for(server: FakeProvider, clock: Clock | None = None) -> ProviderCounter:
    spec = ModelSpec.model_validate({"provider": server.provider, "name": NAMES[server.provider],
                                     "base_url": server.base_url, "tokenizer": "provider"})
    fallback = LocalCounter(load_tokenizer(None, server.provider))
    return ProviderCounter(f"provider:{server.provider}", build_counting_model(spec, env=ENV), fallback,
                           clock=clock or Clock())


@pytest.fixture(params=list(NAMES))
def server(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeProvider]:
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_BEARER_TOKEN_BEDROCK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with FakeProvider(request.param) as fake:
        yield fake


def counted(server: FakeProvider) -> list[dict[str, Any]]:
    """The bodies of the count requests the fake answered, each checked for path and key."""
    bodies = []
    for exchange in server.exchanges:
        assert COUNT_PATHS[server.provider] in exchange.path, exchange.path
        assert exchange.credential in ENV.values()
        bodies.append(exchange.body)
    return bodies


TURN = [
    ModelRequest(parts=[UserPromptPart("What is the weather in Paris today?")]),
    ModelResponse(parts=[ToolCallPart("weather", {"city": "Paris"}, tool_call_id="c1")]),
    ModelRequest(parts=[ToolReturnPart("weather", "rain, 12 degrees", tool_call_id="c1")]),
    ModelResponse(parts=[TextPart("It rains in Paris: 12 degrees.")]),
]


def test_a_text_is_counted_by_the_endpoint_once_per_process(server: FakeProvider) -> None:
    counter = counter_for(server)

    async def run() -> tuple[int, int, int]:
        text = "You answer in French, briefly."
        return await counter.text(text), await counter.text(text), await counter.text("")

    first, again, empty = asyncio.run(run())
    (body,) = counted(server)
    assert first == again == request_tokens(body)
    # the fake's count: the request's 3, the message's 3, and the text's 7 tokens
    assert first == 3 + 3 + text_tokens("You answer in French, briefly.") == 13
    assert empty == 0


def test_a_turn_is_counted_as_its_texts_in_one_request(server: FakeProvider) -> None:
    counter = counter_for(server)
    counts = asyncio.run(counter.turns({"t1": TURN, "t2": TURN[:1], "empty": []}))

    bodies = counted(server)
    assert len(bodies) == 2  # an empty turn asks nothing
    assert sorted(counts.values()) == sorted([0, *map(request_tokens, bodies)])
    assert counts["empty"] == 0
    sent = str(bodies)
    for text in ("What is the weather in Paris today?", "weather", "Paris", "rain, 12 degrees", "It rains in Paris"):
        assert text in sent
    # the call and its result go as text (no tool definitions needed), so they cost more than the query alone
    assert counts["t1"] > counts["t2"] > 0


def test_a_failing_endpoint_names_the_fallback_and_is_left_alone_for_a_while() -> None:
    clock = Clock()

    async def run(server: FakeProvider) -> None:  # one event loop, as on a worker: the client is bound to it
        before = {result: count_requests(result) for result in ("ok", "failed", "skipped")}
        counter = counter_for(server, clock)
        with pytest.raises(CountUnavailable) as failed:
            await counter.text("hello")
        assert "HTTP 500" in failed.value.reason and "tiktoken:cl100k_base" in failed.value.reason
        assert failed.value.fallback.name == "tiktoken:cl100k_base"
        assert len(server.exchanges) == 1

        clock.now += COUNT_RETRY_S / 2  # still down: not asked again
        with pytest.raises(CountUnavailable):
            await counter.turns({"t1": TURN})
        assert len(server.exchanges) == 1
        assert count_requests("failed") == before["failed"] + 1 and count_requests("skipped") == before["skipped"] + 1

        clock.now += COUNT_RETRY_S  # asked again after the pause
        server.count_status = None
        assert await counter.text("hello") == request_tokens(server.exchanges[-1].body)
        assert len(server.exchanges) == 2
        assert count_requests("ok") == before["ok"] + 1

    with FakeProvider("anthropic", count_status=500) as server:
        asyncio.run(run(server))


def count_requests(result: str) -> float:
    """`threadline_token_count_requests_total` for the fakes' counters (named after their provider)."""
    value = REGISTRY.get_sample_value("threadline_token_count_requests_total",
                                      {"provider": "provider:anthropic", "result": result})
    return value or 0.0


def test_a_slow_endpoint_is_given_up_on_after_the_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(counters, "COUNT_TIMEOUT_S", 0.2)

    async def run(server: FakeProvider) -> float:
        counter = counter_for(server)
        started = time.monotonic()
        with pytest.raises(CountUnavailable, match=r"no answer within 0\.2 s"):
            await counter.turns({"t1": TURN, "t2": TURN[:1]})
        return time.monotonic() - started

    # the endpoint answers far later than any loaded machine takes to time out at 0.2 s: the count
    # raised on its own timer, without waiting for the answer
    answer_s = 30.0
    with FakeProvider("anthropic", count_delay_s=answer_s) as server:
        assert asyncio.run(run(server)) < answer_s


def test_the_fallback_counts_locally_with_four_tokens_per_message() -> None:
    fallback = LocalCounter(load_tokenizer(None, "anthropic"))
    counts = asyncio.run(fallback.turns({"t1": TURN}))
    assert counts["t1"] > 4 * len(TURN)
    assert asyncio.run(fallback.text("hello")) == 1 + 4


@pytest.mark.parametrize("provider", ["openai", "openai-compatible", "vllm", "ollama", "groq", "mistral", "offline"])
def test_tokenizer_provider_is_refused_for_a_provider_without_a_count_endpoint(provider: str) -> None:
    with pytest.raises(ValidationError, match="has none: use it with anthropic, bedrock, google, python"):
        ModelSpec.model_validate({"provider": provider, "name": "m", "base_url": "http://127.0.0.1:1/v1",
                                  "tokenizer": "provider"})


def test_turn_show_says_which_tokenizer_counted_instead_of_the_provider() -> None:
    decision = {"tokenizer": "tiktoken:cl100k_base",
                "tokenizer_fallback": "provider:anthropic:m: the count endpoint failed (HTTP 503)",
                "budget": {"history": 100, "context_window": 300, "instructions": 10, "query": 5, "tools": 0,
                           "max_output": 40, "safety_margin": 0},
                "window": {"kept_turns": 1, "kept_tokens": 50, "dropped_turns": 0, "dropped_tokens": 0,
                           "reason": "all_fit"}}
    assert describe_budget(decision).endswith(
        "counted with tiktoken:cl100k_base (instead of provider:anthropic:m: the count endpoint failed (HTTP 503))")
    del decision["tokenizer_fallback"]
    assert describe_budget(decision).endswith("counted with tiktoken:cl100k_base")
