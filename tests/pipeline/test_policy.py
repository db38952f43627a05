"""The secrets policy of model configs: which key variables a config may name, and where a provider's
conventional key may be sent (`pipeline/policy.py`)."""

from __future__ import annotations

from typing import Any

import pytest

from threadline.pipeline.config import AgentConfig, ModelSpec
from threadline.pipeline.errors import InvalidRequest
from threadline.pipeline.policy import (
    CONVENTIONAL_KEY_NAMES,
    ModelPolicy,
    agent_models,
    check_model_policy,
    url_allowed,
)

LOCAL = "http://127.0.0.1:"
POLICY = ModelPolicy(key_env_allow=CONVENTIONAL_KEY_NAMES | {"QWEN_API_KEY"}, base_url_allow=(LOCAL,))


def spec(**fields: Any) -> ModelSpec:
    return ModelSpec.model_validate({"name": "m", **fields})


def refusal(model: ModelSpec, policy: ModelPolicy = POLICY) -> str:
    with pytest.raises(InvalidRequest) as caught:
        policy.check(model)
    assert caught.value.code == "invalid_request"
    return caught.value.message


def test_a_config_may_name_only_the_allowed_key_variables() -> None:
    message = refusal(spec(provider="openai-compatible", base_url="https://llm.internal/v1", api_key_env="HOME"))
    assert "'HOME'" in message and "TL_KEY_ENV_ALLOW" in message
    POLICY.check(spec(provider="openai-compatible", base_url="https://llm.internal/v1", api_key_env="QWEN_API_KEY"))
    # the conventional names are allowed by default, whatever the provider
    ModelPolicy().check(spec(provider="anthropic", api_key_env="ANTHROPIC_API_KEY"))
    assert "QWEN_API_KEY" in refusal(spec(provider="vllm", base_url="http://x/v1", api_key_env="QWEN_API_KEY"),
                                     ModelPolicy())


def test_a_provider_whose_key_variables_are_all_outside_the_allow_list_is_refused_saying_so() -> None:
    narrow = ModelPolicy(key_env_allow=frozenset({"QWEN_API_KEY", "AWS_ACCESS_KEY_ID"}))
    message = refusal(spec(provider="anthropic"), narrow)
    assert "ANTHROPIC_API_KEY" in message and "TL_KEY_ENV_ALLOW" in message and "allows none" in message
    assert "GOOGLE_API_KEY / GEMINI_API_KEY" in refusal(spec(provider="google"), narrow)
    narrow.check(spec(provider="bedrock"))  # one of its variables is allowed
    narrow.check(spec(provider="anthropic", api_key_env="QWEN_API_KEY"))  # its own, allowed variable
    narrow.check(spec(provider="vllm", base_url="http://x/v1"))  # keyless


@pytest.mark.parametrize("provider", ["openai", "anthropic", "google", "bedrock", "groq", "mistral"])
def test_a_providers_own_key_goes_only_to_an_allowed_base_url(provider: str) -> None:
    message = refusal(spec(provider=provider, base_url="https://evil.example.com/v1"))
    assert "'https://evil.example.com/v1'" in message and "TL_BASE_URL_ALLOW" in message
    POLICY.check(spec(provider=provider, base_url="http://127.0.0.1:8000/v1"))
    POLICY.check(spec(provider=provider))  # the provider's own endpoint
    # by default no base_url may receive a conventional key
    refusal(spec(provider=provider, base_url="http://127.0.0.1:8000/v1"), ModelPolicy())


def test_naming_a_conventional_variable_is_sending_a_conventional_key() -> None:
    message = refusal(spec(provider="openai-compatible", base_url="https://evil.example.com/v1",
                           api_key_env="OPENAI_API_KEY"))
    assert "OPENAI_API_KEY" in message


def test_a_keyless_or_own_key_config_may_point_anywhere() -> None:
    for provider in ("openai-compatible", "vllm", "ollama"):
        ModelPolicy().check(spec(provider=provider, base_url="https://anywhere.example.com/v1"))
    POLICY.check(spec(provider="openai", base_url="https://anywhere.example.com/v1", api_key_env="QWEN_API_KEY"))


def test_fallback_models_and_the_summariser_are_checked_too() -> None:
    bad = {"provider": "anthropic", "name": "c", "base_url": "https://evil.example.com"}
    chained = spec(provider="offline", name="echo", fallback=[bad])
    assert "evil.example.com" in refusal(chained)
    config = AgentConfig.model_validate(
        {"id": "a", "model": "offline:echo", "memory": {"compaction": {"summariser": bad}}})
    with pytest.raises(InvalidRequest, match=r"evil\.example\.com"):
        POLICY.check_agent(config)
    assert [s.provider for s in agent_models(config)] == ["offline", "anthropic"]


def test_prefixes_match_from_the_start_and_never_across_a_user_part() -> None:
    assert url_allowed("https://api.example.com/v1", ["https://api.example.com/"])
    assert not url_allowed("https://api.example.com.evil.io/v1", ["https://api.example.com/"])
    assert not url_allowed("http://127.0.0.1:80@evil.io/v1", [LOCAL])
    assert not url_allowed("https://api.example.com/v1", [])
    assert not url_allowed("https://api.example.com/v1", [""])


def test_workers_read_only_the_allowed_variables_and_the_region() -> None:
    env = {"QWEN_API_KEY": "q", "OPENAI_API_KEY": "o", "AWS_REGION": "eu-west-1", "DATABASE_PASSWORD": "p"}
    assert ModelPolicy(key_env_allow=frozenset({"QWEN_API_KEY"})).readable_env(env) == {
        "QWEN_API_KEY": "q", "AWS_REGION": "eu-west-1"}
    assert ModelPolicy().readable_env(env) == {"OPENAI_API_KEY": "o", "AWS_REGION": "eu-west-1"}


def test_the_pure_function_takes_its_lists_as_arguments() -> None:
    with pytest.raises(InvalidRequest, match="TL_KEY_ENV_ALLOW"):
        check_model_policy(spec(provider="vllm", base_url="http://x/v1", api_key_env="X"),
                           key_env_allow=(), base_url_allow=())
    check_model_policy(spec(provider="offline", name="echo"), key_env_allow=(), base_url_allow=())


def test_a_prefix_allows_its_own_host_only() -> None:
    prefixes = ("https://api.example.com",)
    assert url_allowed("https://api.example.com/v1", prefixes)
    assert url_allowed("https://api.example.com", prefixes)
    assert not url_allowed("https://api.example.com.evil.net/v1", prefixes)
    assert not url_allowed("https://api.example.comx/v1", prefixes)
    assert url_allowed("http://127.0.0.1:8000/v1", ("http://127.0.0.1:",))
