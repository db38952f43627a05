"""Real turns through real worker processes against local fakes of each hosted provider's API
(`tests/support/fake_providers.py`): a config per provider is accepted and its turn streams the
fake's answer, sent with the provider's conventional key (or the variable `api_key_env` names); a
missing key or extra fails with its stable code before any request; a server that always answers 429
receives exactly `TL_MAX_INVOKE_ATTEMPTS` requests per turn; and the secrets policy refuses sending a
key where it was not allowed, at `put_agent` and again on the workers."""

from __future__ import annotations

import binascii
import contextlib
import json
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from botocore.eventstream import ChecksumMismatch, EventStreamBuffer

from tests.conftest import ROOT, WorkerPool, turn
from tests.support.fake_providers import (
    INPUT_TOKENS,
    OUTPUT_TOKENS,
    Exchange,
    FakeProvider,
    ProviderName,
    event_message,
    request_tokens,
)
from threadline.pipeline import events as ev
from threadline.pipeline.config import COUNTED_BY_DEFAULT, AgentConfig, config_to_json
from threadline.pipeline.errors import ThreadlineError
from threadline.workers.clients.client import Client
from threadline.workers.settings import model_policy
from threadline.workers.worker.tokenizers import default_tokenizer

# each provider's SDK is imported by the workers on its first turn (1 to 2 s each): the slow tier
pytestmark = [pytest.mark.integration, pytest.mark.slow]

ATTEMPTS = 3
#: The fake keys the main pool's workers hold, under each provider's conventional variable.
KEYS = {
    "OPENAI_API_KEY": "sk-fake-openai", "ANTHROPIC_API_KEY": "sk-fake-anthropic", "GOOGLE_API_KEY": "fake-google",
    "GROQ_API_KEY": "gsk-fake-groq", "MISTRAL_API_KEY": "fake-mistral", "AWS_ACCESS_KEY_ID": "AKIAFAKEBEDROCK",
    "AWS_SECRET_ACCESS_KEY": "fake-aws-secret",
}
#: A variable a config may name (listed in TL_KEY_ENV_ALLOW), and one it may not though workers hold it.
ALT_KEY_ENV, ALT_KEY = "TL_TEST_ALT_KEY", "sk-fake-alt"
UNLISTED_ENV, UNLISTED_KEY = "TL_TEST_WORKER_SECRET", "sk-fake-worker-secret"
#: The secrets policy, for the workers and for `put_agent`: keys go to the fakes only.
#: A TL_KEY_ENV_ALLOW that is set replaces the default list, so it names the conventional variables too.
POLICY = {"TL_BASE_URL_ALLOW": "http://127.0.0.1:", "TL_KEY_ENV_ALLOW": ",".join([*KEYS, ALT_KEY_ENV])}
#: Variables a worker must not inherit from whoever runs the tests: no real key, no AWS profile or
#: instance metadata lookup (boto3 would otherwise go looking for credentials on the network).
SCRUBBED = (*KEYS, "AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_BEARER_TOKEN_BEDROCK", "AWS_DEFAULT_REGION")
AWS_OFFLINE = {"AWS_EC2_METADATA_DISABLED": "true", "AWS_CONFIG_FILE": "/dev/null",
               "AWS_SHARED_CREDENTIALS_FILE": "/dev/null", "AWS_REGION": "us-east-1"}
#: A directory whose `google/genai` stub fails to import (see its docstring).
MISSING_EXTRAS = ROOT / "tests" / "support" / "missing_extras"


@dataclass(frozen=True)
class Case:
    """A hosted provider (its config name is its fake's wire format), a model, its key variable."""

    provider: ProviderName
    name: str
    key_env: str

    def model(self, server: FakeProvider, **extra: Any) -> dict[str, Any]:
        return {"provider": self.provider, "name": self.name, "base_url": server.base_url, **extra}


CASES = {c.provider: c for c in [
    Case("openai", "gpt-4o-mini", "OPENAI_API_KEY"),
    Case("anthropic", "claude-sonnet-5-5", "ANTHROPIC_API_KEY"),
    Case("google", "gemini-3.5-flash-lite", "GOOGLE_API_KEY"),
    Case("bedrock", "anthropic.claude-3-5-haiku-20241022-v1:0", "AWS_ACCESS_KEY_ID"),
    Case("groq", "llama-3.3-70b-versatile", "GROQ_API_KEY"),
    Case("mistral", "mistral-small-latest", "MISTRAL_API_KEY"),
]}


# --- fixtures: two pools for the whole module -----------------------------------------------------


@dataclass(frozen=True)
class Pools:
    """`keyed`: workers holding every provider's key, the allowed override and a secret configs may
    not name. `bare`: workers holding no key but Gemini's, and without the google extra."""

    keyed: Client
    bare: Client


def _pool(redis_url: str, logs: Path, env: dict[str, str]) -> WorkerPool:
    """One worker process on a prefix of its own whose environment has exactly `env`'s keys."""
    pool = WorkerPool(redis_url, f"tlv{uuid.uuid4().hex[:8]}", logs)
    for name in SCRUBBED:
        pool.env.pop(name, None)
    pool.env.update({**AWS_OFFLINE, **POLICY, "TL_MAX_INVOKE_ATTEMPTS": str(ATTEMPTS), **env})
    return pool


@pytest.fixture(scope="module")
def pools(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pools]:
    """Both pools, started and stopped side by side (each start and stop takes about a second).

    The bare pool lacks the google extra: uninstalling google-genai from the shared virtualenv would
    break every other test running at the same time, so a stub package first on PYTHONPATH makes
    `import google.genai` fail in these worker processes only, exactly as it fails where the extra is
    not installed, while the code under test (the import check, the error it maps to) runs unchanged.
    Gemini's key is set there so that the extra is the only thing a Gemini turn lacks."""
    logs = tmp_path_factory.mktemp("logs")
    keyed = _pool(redis_url, logs, {**KEYS, ALT_KEY_ENV: ALT_KEY, UNLISTED_ENV: UNLISTED_KEY})
    bare = _pool(redis_url, logs, {"GOOGLE_API_KEY": KEYS["GOOGLE_API_KEY"], "PYTHONPATH": f"{MISSING_EXTRAS}:{ROOT}"})
    # `put_agent` applies the same policy, read from the same variables
    clients = [Client(redis_url, prefix=p.prefix, policy=model_policy(POLICY)) for p in (keyed, bare)]
    try:
        with ThreadPoolExecutor(2) as starting:
            list(starting.map(lambda p: p.start(processes=1, threads=8), (keyed, bare)))
        yield Pools(*clients)
    finally:
        for proc in [*keyed.procs, *bare.procs]:
            proc.terminate()
        for pool, client in zip((keyed, bare), clients, strict=True):
            pool.stop()
            for key in client.redis.scan_iter(f"{pool.prefix}:*", count=1000):
                client.redis.delete(key)
            client.close()


@pytest.fixture(scope="module")
def keyed(pools: Pools) -> Client:
    return pools.keyed


@pytest.fixture(scope="module")
def bare(pools: Pools) -> Client:
    return pools.bare


def _agent(client: Client, model: dict[str, Any]) -> str:
    agent_id = f"agent-{uuid.uuid4().hex[:10]}"
    client.put_agent(AgentConfig.model_validate({"id": agent_id, "model": model}))
    return agent_id


def _run(client: Client, model: dict[str, Any]) -> tuple[str, ev.Terminal]:
    turn_id = client.submit(turn(_agent(client, model), "hi"))
    return turn_id, client.wait(turn_id, timeout_s=30)


def _model_calls(server: FakeProvider) -> list[Exchange]:
    """The requests for an answer (Anthropic, Gemini and Bedrock are also asked for token counts)."""
    return [e for e in server.exchanges if e.route != "count"]


def _streamed_text(client: Client, turn_id: str) -> str:
    return "".join(e.text for e in client.events(turn_id) if isinstance(e, ev.TextDelta))


# --- the fakes themselves -------------------------------------------------------------------------


def test_the_bedrock_event_stream_framing_is_what_botocore_parses() -> None:
    frames = event_message("messageStart", {"role": "assistant"}) + event_message("messageStop", {"stopReason": "x"})
    buffer = EventStreamBuffer()
    buffer.add_data(frames)
    parsed = [(m.headers[":event-type"], m.headers[":message-type"], json.loads(m.payload)) for m in buffer]
    assert parsed == [("messageStart", "event", {"role": "assistant"}), ("messageStop", "event", {"stopReason": "x"})]

    corrupt = bytearray(event_message("messageStart", {"role": "assistant"}))
    corrupt[-5] ^= 0xFF  # a payload byte: the message CRC no longer matches
    buffer = EventStreamBuffer()
    buffer.add_data(bytes(corrupt))
    with pytest.raises(ChecksumMismatch):
        next(iter(buffer))
    assert binascii.crc32(bytes(corrupt[:8])) == int.from_bytes(corrupt[8:12], "big")  # the prelude CRC holds


# --- a turn per provider --------------------------------------------------------------------------


@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_a_turn_against_each_provider_streams_its_answer_sent_with_the_conventional_key(
    keyed: Client, case: Case
) -> None:
    with FakeProvider(case.provider) as server:
        turn_id, terminal = _run(keyed, case.model(server))

    assert isinstance(terminal, ev.Succeeded), terminal
    assert terminal.answer == server.text == f"hello from {case.provider}"
    assert _streamed_text(keyed, turn_id) == server.text
    assert (terminal.usage.input_tokens, terminal.usage.output_tokens) == (INPUT_TOKENS, OUTPUT_TOKENS)
    (exchange,) = _model_calls(server)
    assert exchange.streamed is True, exchange.path
    assert exchange.credential == KEYS[case.key_env]
    # the history budget counts with the provider's own endpoint where it has one (no tokenizer configured)
    counted = [e for e in server.exchanges if e.route == "count"]
    assert all(e.credential == KEYS[case.key_env] for e in counted)
    assert bool(counted) == (case.provider in COUNTED_BY_DEFAULT)
    assert keyed.decisions(turn_id)["history"]["tokenizer"] == (
        f"provider:{case.provider}:{case.name}" if counted else default_tokenizer(case.provider))


def test_api_key_env_names_the_variable_whose_key_is_sent(keyed: Client) -> None:
    case = CASES["anthropic"]
    with FakeProvider(case.provider) as server:
        _, terminal = _run(keyed, case.model(server, api_key_env=ALT_KEY_ENV))

    assert isinstance(terminal, ev.Succeeded), terminal
    assert {e.credential for e in server.exchanges} == {ALT_KEY}  # the model call and its token counts


@pytest.mark.parametrize("provider", ["openai-compatible", "vllm", "ollama"])
def test_a_keyless_openai_compatible_server_gets_no_authorization_header(keyed: Client, provider: str) -> None:
    """These workers hold OPENAI_API_KEY: a self-hosted server's config without `api_key_env` must
    not receive it, nor a placeholder."""
    with FakeProvider("openai") as server:
        _, terminal = _run(keyed, {"provider": provider, "name": "qwen3.6", "base_url": server.base_url})

    assert isinstance(terminal, ev.Succeeded), terminal
    assert terminal.answer == server.text
    (exchange,) = server.exchanges
    assert "authorization" not in exchange.headers, exchange.headers


# --- what is missing fails the turn before any request --------------------------------------------


# (not anthropic: importing its SDK takes these workers two seconds, for the same code path as groq's)
@pytest.mark.parametrize("case", [CASES[p] for p in ("openai", "bedrock", "groq", "mistral")],
                         ids=["openai", "bedrock", "groq", "mistral"])
def test_a_missing_key_fails_the_turn_naming_its_variable(bare: Client, case: Case) -> None:
    with FakeProvider(case.provider) as server:
        _, terminal = _run(bare, case.model(server))

    assert isinstance(terminal, ev.Failed) and terminal.code == "model_key_missing", terminal
    assert case.key_env in terminal.message
    assert server.exchanges == []


def test_a_missing_extra_fails_the_turn_naming_the_extra(bare: Client) -> None:
    case = CASES["google"]
    with FakeProvider(case.provider) as server:
        _, terminal = _run(bare, case.model(server))

    assert isinstance(terminal, ev.Failed) and terminal.code == "provider_not_installed", terminal
    assert "threadline[google]" in terminal.message
    assert server.exchanges == []


# --- one retry layer ------------------------------------------------------------------------------


def test_a_server_that_always_answers_429_gets_exactly_the_attempts_per_turn(keyed: Client) -> None:
    """All providers at once, so the backoff between attempts (0.5 s, 1 s: `Retry-After: 0` asks for
    no particular delay) is waited once for the whole test."""
    with contextlib.ExitStack() as stack:
        servers = {name: stack.enter_context(FakeProvider(case.provider, always_status=429, retry_after="0"))
                   for name, case in CASES.items()}
        turns = {name: keyed.submit(turn(_agent(keyed, case.model(servers[name])), "hi"))
                 for name, case in CASES.items()}
        terminals = {name: keyed.wait(turn_id, timeout_s=30) for name, turn_id in turns.items()}

    for name, terminal in terminals.items():
        assert isinstance(terminal, ev.Failed) and terminal.code == "model_rate_limited", (name, terminal)
        assert [e.status for e in _model_calls(servers[name])] == [429] * ATTEMPTS, name
        retrying = [e for e in keyed.events(turns[name]) if isinstance(e, ev.Retrying)]
        assert len(retrying) == ATTEMPTS - 1, name


# --- the secrets policy ---------------------------------------------------------------------------


def _unlisted_variable(server: FakeProvider) -> tuple[dict[str, Any], str]:
    return CASES["openai"].model(server, api_key_env=UNLISTED_ENV), UNLISTED_ENV


def _unlisted_url(server: FakeProvider) -> tuple[dict[str, Any], str]:
    # the same fake server, under a name TL_BASE_URL_ALLOW does not list: a worker that sent the key
    # anyway would reach it, so an empty exchange log means it was not sent
    url = server.base_url.replace("127.0.0.1", "localhost")
    return {"provider": "openai", "name": "gpt-4o-mini", "base_url": url}, url


@pytest.mark.parametrize("refused", [_unlisted_variable, _unlisted_url], ids=["unlisted-variable", "unlisted-url"])
def test_a_key_sent_where_it_is_not_allowed_is_refused_at_put_and_on_the_workers(
    keyed: Client, refused: Callable[[FakeProvider], tuple[dict[str, Any], str]]
) -> None:
    with FakeProvider("openai") as server:
        model, named = refused(server)
        config = AgentConfig.model_validate({"id": f"agent-{uuid.uuid4().hex[:10]}", "model": model})
        with pytest.raises(ThreadlineError) as refusal:
            keyed.put_agent(config)
        assert refusal.value.code == "invalid_request" and named in str(refusal.value)

        # written straight into Redis, past the client: the workers apply the same policy
        _write_raw(keyed, config)
        terminal = keyed.wait(keyed.submit(turn(config.id, "hi")), timeout_s=30)

    assert isinstance(terminal, ev.Failed) and terminal.code == "invalid_request", terminal
    assert named in terminal.message
    assert server.exchanges == []


def _write_raw(client: Client, config: AgentConfig) -> None:
    client.redis.set(client.keys.agent_version(config.id, 1), config_to_json(config))
    client.redis.hset(client.keys.agent(config.id), mapping={"active": 1, "latest": 1})
    client.redis.sadd(client.keys.agents(), config.id)


# --- model.tokenizer: provider --------------------------------------------------------------------

WINDOW, MAX_OUTPUT, TURNS = 300, 40, 10
INSTRUCTIONS = "You are a terse assistant. Answer in one short sentence."


def _conversation(client: Client, model: dict[str, Any], queries: list[str]) -> list[tuple[str, ev.Terminal]]:
    agent = f"agent-{uuid.uuid4().hex[:10]}"
    client.put_agent(AgentConfig.model_validate({"id": agent, "model": model, "instructions": INSTRUCTIONS,
                                                 "memory": {"safety_margin_tokens": 0}}))
    ended: list[tuple[str, ev.Terminal]] = []
    conversation: dict[str, str] = {}
    for query in queries:
        turn_id = client.submit(turn(agent, query, **conversation))
        terminal = client.wait(turn_id, timeout_s=30)
        assert isinstance(terminal, ev.Succeeded), terminal
        conversation = {"conversation_id": terminal.conversation_id}
        ended.append((turn_id, terminal))
    return ended


@pytest.mark.parametrize("provider", ["anthropic", "google", "bedrock"])
def test_tokenizer_provider_fits_every_request_by_the_providers_own_count(keyed: Client, provider: str) -> None:
    case = CASES[provider]
    queries = [f"Question {i}: " + "tell me more about the history of this old town " * 3 for i in range(TURNS)]
    with FakeProvider(case.provider) as server:
        model = case.model(server, tokenizer="provider", context_window=WINDOW, max_output_tokens=MAX_OUTPUT)
        ended = _conversation(keyed, model, queries)

    sent = _model_calls(server)
    counts = [e for e in server.exchanges if e.route == "count"]
    assert len(sent) == TURNS
    # the contract, by the provider's own count: no request exceeds the window less the answer's reserve
    assert max(request_tokens(e.body) for e in sent) <= WINDOW - MAX_OUTPUT
    # and the budget was used: early turns were dropped, a later request still carries history
    assert queries[0] not in json.dumps(sent[-1].body) and queries[-2] in json.dumps(sent[-1].body)
    # each text counted once: the instructions once per process, then the query and the turn before it
    assert len(counts) <= 1 + 2 * TURNS
    decision = keyed.decisions(ended[-1][0])["history"]
    assert decision["tokenizer"] == f"provider:{provider}:{case.name}" and "tokenizer_fallback" not in decision
    assert decision["window"]["dropped_turns"] > 0 and decision["window"]["kept_turns"] > 0


def test_tokenizer_provider_counts_locally_and_says_so_when_the_endpoint_fails(keyed: Client) -> None:
    case = CASES["anthropic"]
    with FakeProvider(case.provider, count_status=503) as server:
        model = case.model(server, tokenizer="provider", context_window=WINDOW, max_output_tokens=MAX_OUTPUT)
        ended = _conversation(keyed, model, ["first question", "second question"])

    for turn_id, _ in ended:
        decision = keyed.decisions(turn_id)["history"]
        assert decision["tokenizer"] == "tiktoken:cl100k_base"
        assert decision["tokenizer_fallback"].startswith(f"provider:anthropic:{case.name}: the count endpoint failed")
        assert "HTTP 503" in decision["tokenizer_fallback"]
    # the endpoint is left alone after its failure: only the first turn's texts (asked at the same time)
    # went to it, the second turn asked nothing
    asked = [json.dumps(e.body) for e in server.exchanges if e.route == "count"]
    assert 1 <= len(asked) <= 2 and not any("second question" in body for body in asked)
