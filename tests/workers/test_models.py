"""Building each provider's model from a config (`workers/worker/providers.py`): the right pydantic-ai model,
pointed at the config's `base_url`, with the key from the worker's environment and no retries of the
SDK's own — one HTTP request per model call, whose 429/5xx/400 classifies to Threadline's codes.
And the secrets policy where workers build models and where `agents put` registers them."""

from __future__ import annotations

import importlib
import json
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from typing import Any, cast

import pytest
from pydantic_ai import Agent
from pydantic_ai.exceptions import ModelAPIError
from pydantic_ai.models import override_allow_model_requests

from tests.conftest import WorkerPool, turn
from tests.support.local_http import LocalServer
from threadline.pipeline import events as ev
from threadline.pipeline.caching import PromptCacheModel
from threadline.pipeline.config import AgentConfig, ModelSpec
from threadline.pipeline.errors import InvalidRequest, ThreadlineError
from threadline.pipeline.invoke import model_error_code
from threadline.pipeline.llm import StrictSystemModel
from threadline.pipeline.policy import ModelPolicy
from threadline.workers.clients.client import Client
from threadline.workers.settings import Settings
from threadline.workers.worker.providers import build_model, model_secrets

KEYS = {
    "OPENAI_API_KEY": "sk-openai-test-0001", "ANTHROPIC_API_KEY": "anthropic-test-0002",
    "GEMINI_API_KEY": "gemini-test-0003", "GROQ_API_KEY": "groq-test-0004", "MISTRAL_API_KEY": "mistral-test-0005",
    "AWS_ACCESS_KEY_ID": "AKIATEST0006", "AWS_SECRET_ACCESS_KEY": "aws-secret-test-0007",
}
#: provider → (the pydantic-ai model class by its module's name, the path its request goes to under the
#: base URL, the key (Bedrock: the access key id of its signature) one of the request's headers carries).
#: The SDKs are imported by the tests that use them (`model_class`): importing all six took ~3 s of
#: every xdist process's collection.
HOSTED: dict[str, tuple[str, str, str]] = {
    "openai": ("openai:OpenAIChatModel", "/v1/chat/completions", "sk-openai-test-0001"),
    "anthropic": ("anthropic:AnthropicModel", "/v1/messages", "anthropic-test-0002"),
    "google": ("google:GoogleModel", "/v1beta/models/m:generateContent", "gemini-test-0003"),
    "bedrock": ("bedrock:BedrockConverseModel", "/model/m/converse", "AKIATEST0006"),
    "groq": ("groq:GroqModel", "/openai/v1/chat/completions", "groq-test-0004"),
    "mistral": ("mistral:MistralModel", "/v1/chat/completions", "mistral-test-0005"),
}


def model_class(provider: str) -> type[Any]:
    """The pydantic-ai model class a hosted provider's config builds."""
    module, name = HOSTED[provider][0].split(":")
    return cast(type[Any], getattr(importlib.import_module(f"pydantic_ai.models.{module}"), name))
COMPATIBLE = ("openai-compatible", "vllm", "ollama")


@dataclass(frozen=True, slots=True)
class Request:
    path: str
    headers: dict[str, str]


class Refusing(LocalServer):
    """An HTTP server that answers every request with one error status (and `Retry-After: 7` on a
    429), recording each request's path and lower-cased headers."""

    def __init__(self, status: int, error: dict[str, Any] | None = None) -> None:
        self.status = status
        self.error = error or {"message": "refused by the test server", "code": status}
        self.requests: list[Request] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                server.requests.append(Request(self.path, {k.lower(): v for k, v in self.headers.items()}))
                body = json.dumps({"error": server.error}).encode()
                self.send_response(server.status)
                self.send_header("Content-Type", "application/json")
                if server.status == 429:
                    self.send_header("Retry-After", "7")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        super().__init__(Handler, name=f"refusing-{status}")

    def base_url(self, provider: str) -> str:
        """What a config says: the OpenAI SDK takes the `/v1` in its base URL, the others add theirs."""
        return f"{self.url}/v1" if provider in ("openai", *COMPATIBLE) else self.url


@pytest.fixture
def server_429() -> Iterator[Refusing]:
    with Refusing(429) as server:
        yield server


def provider_model(model: Any) -> Any:
    """The provider's own model inside Threadline's wrappers: the strict-system one outermost, then
    the prompt cache (on by default)."""
    assert isinstance(model, StrictSystemModel) and isinstance(model.wrapped, PromptCacheModel)
    return model.wrapped.wrapped


async def call(model: Any) -> BaseException:
    """Run one request through `model`, which must fail; the error. Requests go to a local test server
    only (other test modules forbid model requests process-wide)."""
    with override_allow_model_requests(True), pytest.raises(Exception) as caught:
        await Agent(model).run("hello")
    return caught.value


# --- each provider: its class, its base URL, its key, one request per call --------------------------


@pytest.mark.parametrize("provider", sorted(HOSTED))
async def test_each_provider_sends_one_request_with_its_key_to_the_base_url(provider: str,
                                                                            server_429: Refusing) -> None:
    _, path, key = HOSTED[provider]
    spec = ModelSpec(provider=provider, name="m", base_url=server_429.base_url(provider))  # type: ignore[arg-type]
    model = build_model(spec, env=KEYS)
    assert isinstance(provider_model(model), model_class(provider))
    error = await call(model)
    # exactly one HTTP request: the SDK's own retries are off (Threadline's invoke retry is the only one)
    assert [r.path for r in server_429.requests] == [path]
    assert any(key in value for value in server_429.requests[0].headers.values()), server_429.requests[0].headers
    assert model_error_code(error) == ("model_rate_limited", True)
    assert isinstance(error, ModelAPIError) and error.retry_after == 7


@pytest.mark.parametrize(("status", "code"), [(503, ("model_unavailable", True)), (400, ("model_bad_request", False))])
@pytest.mark.parametrize("provider", sorted(HOSTED))
async def test_each_providers_errors_map_to_threadline_codes(provider: str, status: int,
                                                             code: tuple[str, bool]) -> None:
    with Refusing(status) as server:
        spec = ModelSpec(provider=provider, name="m", base_url=server.base_url(provider))  # type: ignore[arg-type]
        error = await call(build_model(spec, env=KEYS))
        assert len(server.requests) == 1
        assert model_error_code(error) == code


@pytest.mark.parametrize("provider", sorted(HOSTED))
async def test_an_exhausted_quota_maps_to_its_own_code_and_is_not_retried(provider: str) -> None:
    with Refusing(402) as server:
        spec = ModelSpec(provider=provider, name="m", base_url=server.base_url(provider))  # type: ignore[arg-type]
        error = await call(build_model(spec, env=KEYS))
    assert len(server.requests) == 1
    assert model_error_code(error) == ("model_quota_exceeded", False)


async def test_openais_insufficient_quota_429_is_not_a_rate_limit() -> None:
    quota = {"message": "You exceeded your current quota.", "type": "insufficient_quota", "code": "insufficient_quota"}
    with Refusing(429, quota) as server:
        spec = ModelSpec(provider="openai", name="m", base_url=server.base_url("openai"))
        error = await call(build_model(spec, env=KEYS))
    assert model_error_code(error) == ("model_quota_exceeded", False)


@pytest.mark.parametrize("provider", COMPATIBLE)
async def test_a_keyless_openai_compatible_server_gets_no_authorization_header(
        provider: str, server_429: Refusing, monkeypatch: pytest.MonkeyPatch) -> None:
    # the OpenAI SDK falls back to OPENAI_API_KEY from the process environment: not for this config
    monkeypatch.setenv("OPENAI_API_KEY", KEYS["OPENAI_API_KEY"])
    spec = ModelSpec(provider=provider, name="qwen3.6", base_url=server_429.base_url(provider))  # type: ignore[arg-type]
    error = await call(build_model(spec, env=KEYS))
    assert model_error_code(error) == ("model_rate_limited", True)
    [request] = server_429.requests
    assert "authorization" not in request.headers, request.headers
    assert not any(KEYS["OPENAI_API_KEY"] in value for value in request.headers.values())


async def test_an_openai_compatible_server_gets_the_key_its_config_names(server_429: Refusing) -> None:
    spec = ModelSpec(provider="vllm", name="q", base_url=server_429.base_url("vllm"), api_key_env="QWEN_API_KEY")
    await call(build_model(spec, env={"QWEN_API_KEY": "qwen-key-0008"}))
    assert server_429.requests[0].headers["authorization"] == "Bearer qwen-key-0008"
    with pytest.raises(ThreadlineError, match="'QWEN_API_KEY' is unset or empty") as caught:
        build_model(spec, env={})  # named but unset: never a placeholder, never keyless
    assert caught.value.code == "model_key_missing"


def test_the_openai_shorthand_uses_openai_api_key() -> None:
    config = AgentConfig.model_validate({"id": "a", "model": "openai:gpt-4o-mini"})
    model = build_model(config.model, env={"OPENAI_API_KEY": KEYS["OPENAI_API_KEY"]})
    openai = provider_model(model)
    assert isinstance(openai, model_class("openai"))
    assert openai.client.api_key == KEYS["OPENAI_API_KEY"]
    assert openai.client.max_retries == 0


@pytest.mark.parametrize(("provider", "variables"), [
    ("openai", "'OPENAI_API_KEY' is"),
    ("anthropic", "'ANTHROPIC_API_KEY' is"),
    ("google", "'GOOGLE_API_KEY' and 'GEMINI_API_KEY' are"),
    ("groq", "'GROQ_API_KEY' is"),
    ("mistral", "'MISTRAL_API_KEY' is"),
    ("bedrock", "'AWS_ACCESS_KEY_ID' and 'AWS_SECRET_ACCESS_KEY' are"),
])
def test_a_missing_key_names_its_variables(provider: str, variables: str) -> None:
    with pytest.raises(ThreadlineError) as caught:
        build_model(ModelSpec(provider=provider, name="m"), env={"UNRELATED": "x"})  # type: ignore[arg-type]
    assert caught.value.code == "model_key_missing"
    assert caught.value.message.startswith("no API key: the worker's environment variable")
    assert variables in caught.value.message
    assert not caught.value.transient


def test_gemini_takes_gemini_api_key_only_when_google_api_key_is_unset() -> None:
    spec = ModelSpec(provider="google", name="gemini-3.5-flash-lite")
    both = build_model(spec, env={"GOOGLE_API_KEY": "google-key-0009", "GEMINI_API_KEY": "gemini-key-0010"})
    google = provider_model(both)
    assert isinstance(google, model_class("google"))
    assert google.client._api_client.api_key == "google-key-0009"
    assert model_secrets(spec, {"GOOGLE_API_KEY": "google-key-0009", "GEMINI_API_KEY": "gemini-key-0010"}) == [
        "google-key-0009", "gemini-key-0010"]


def test_bedrock_takes_a_bearer_token_and_its_region_from_the_environment() -> None:
    spec = ModelSpec(provider="bedrock", name="m")
    model = build_model(spec, env={"AWS_BEARER_TOKEN_BEDROCK": "bedrock-token-0011", "AWS_REGION": "eu-west-3"})
    bedrock = provider_model(model)
    assert isinstance(bedrock, model_class("bedrock"))
    client = bedrock.client
    assert client.meta.region_name == "eu-west-3"
    assert client.meta.config.signature_version == "bearer"
    assert client.meta.config.retries["total_max_attempts"] == 1


def test_a_missing_extra_names_the_extra_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "google.genai", None)  # how Python sees an uninstalled package
    with pytest.raises(ThreadlineError) as caught:
        build_model(ModelSpec(provider="google", name="m"), env=KEYS)
    assert caught.value.code == "provider_not_installed"
    assert caught.value.message == ("the google provider is not installed on these workers: "
                                    "pip install 'threadline[google]'")


def test_model_secrets_cover_every_key_a_chain_may_send() -> None:
    spec = ModelSpec.model_validate({"provider": "bedrock", "name": "m", "fallback": [
        {"provider": "vllm", "name": "q", "base_url": "http://127.0.0.1:1/v1", "api_key_env": "QWEN_API_KEY"}]})
    env = {**KEYS, "AWS_SESSION_TOKEN": "session-0012", "QWEN_API_KEY": "qwen-key-0008"}
    assert set(model_secrets(spec, env)) == {"AKIATEST0006", "aws-secret-test-0007", "session-0012", "qwen-key-0008"}


# --- the policy where configs are registered and where models are built -----------------------------


def test_settings_read_the_policy_and_hand_builders_only_allowed_variables() -> None:
    settings = Settings.from_env({"TL_KEY_ENV_ALLOW": "QWEN_API_KEY, OPENAI_API_KEY",
                                  "TL_BASE_URL_ALLOW": "https://api.example.com/,http://127.0.0.1:",
                                  "QWEN_API_KEY": "q", "OPENAI_API_KEY": "o", "ANTHROPIC_API_KEY": "a",
                                  "AWS_DEFAULT_REGION": "eu-west-1", "DATABASE_URL": "postgres://x"})
    assert settings.policy == ModelPolicy(key_env_allow=frozenset({"QWEN_API_KEY", "OPENAI_API_KEY"}),
                                          base_url_allow=("https://api.example.com/", "http://127.0.0.1:"))
    assert settings.model_env == {"QWEN_API_KEY": "q", "OPENAI_API_KEY": "o", "AWS_DEFAULT_REGION": "eu-west-1"}
    assert Settings.from_env({}).policy == ModelPolicy()


def test_agents_put_refuses_what_the_policy_refuses(client: Client, monkeypatch: pytest.MonkeyPatch) -> None:
    agent_id = f"leaky-{uuid.uuid4().hex[:8]}"
    leaking = f"id: {agent_id}\nmodel: {{provider: anthropic, name: c, base_url: 'http://127.0.0.1:9'}}\n"
    monkeypatch.delenv("TL_BASE_URL_ALLOW", raising=False)
    monkeypatch.delenv("TL_KEY_ENV_ALLOW", raising=False)
    strict = Client(client.url, prefix=client.keys.prefix)
    with pytest.raises(InvalidRequest, match="TL_BASE_URL_ALLOW"):
        strict.put_agent(leaking)
    with pytest.raises(InvalidRequest, match="TL_KEY_ENV_ALLOW"):
        strict.put_agent(f"id: {agent_id}\nmodel: {{provider: vllm, name: q, base_url: 'http://h/v1', "
                         "api_key_env: HOME}\n")
    strict.close()
    assert not client.redis.exists(client.keys.agent(agent_id))
    # the client reads the policy from its environment
    monkeypatch.setenv("TL_BASE_URL_ALLOW", "http://127.0.0.1:")
    allowed = Client(client.url, prefix=client.keys.prefix)
    try:
        assert allowed.put_agent(leaking).startswith("v")
    finally:
        allowed.close()


@pytest.mark.integration
def test_workers_refuse_a_stored_config_the_policy_refuses(workers: WorkerPool, redis_url: str,
                                                           server_429: Refusing) -> None:
    # registered by a client with a laxer policy (an older client, another tenant's tooling): the
    # workers still refuse to send the workers' key to that URL, and the server hears nothing
    lax = Client(redis_url, prefix=workers.prefix, policy=ModelPolicy(base_url_allow=(server_429.url,)))
    agent_id = f"leaky-{uuid.uuid4().hex[:8]}"
    model = {"provider": "openai", "name": "m", "base_url": server_429.base_url("openai")}
    try:
        lax.put_agent(AgentConfig.model_validate({"id": agent_id, "model": model}))
        terminal = lax.wait(lax.submit(turn(agent_id, "hello")), timeout_s=20)
    finally:
        lax.close()
    assert isinstance(terminal, ev.Failed) and terminal.code == "invalid_request", terminal
    assert "TL_BASE_URL_ALLOW" in terminal.message
    assert server_429.requests == []
