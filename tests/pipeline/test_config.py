"""Agent configs never hold credentials: what is refused, what the refusal says, what stays allowed."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError

from threadline.pipeline.config import AgentConfig, config_from_json, find_credential, parse_agent_config
from threadline.pipeline.errors import InvalidRequest

SECRET = "hunter2-Zq9xW4"
KEY = "sk-proj-Ab3dEf6hIj9kLm2nOp5qRs8tUv1wXy4z"


@pytest.mark.parametrize(
    ("doc", "field"),
    [
        (f"id: x\nmodel: {{provider: openai, name: gpt, api_key: {SECRET}}}\n", "model.api_key is named like"),
        (f"id: x\nmodel: {{provider: openai, name: gpt, options: {{api_key: {SECRET}}}}}\n", "model.options.api_key"),
        (f"id: x\nmodel: {{provider: offline, name: echo, options: {{apikey: {SECRET}}}}}\n", "model.options.apikey"),
        (
            "id: x\nmodel: {provider: offline, name: echo, options: {headers: "
            f"{{Authorization: 'Bearer {SECRET}'}}}}}}\n",
            "model.options.headers.Authorization",
        ),
        (
            f"id: x\nmodel: {{provider: offline, name: echo, options: {{auth: [{{password: {SECRET}}}]}}}}\n",
            "model.options.auth is named like",
        ),
        (
            f"id: x\nmodel: {{provider: offline, name: echo, options: {{x: [{{client_secret: {SECRET}}}]}}}}\n",
            "model.options.x[0].client_secret",
        ),
        (f"id: x\nmodel: {{provider: offline, name: echo, options: {{token: {SECRET}}}}}\n", "model.options.token"),
        (
            f"id: x\nmodel: {{provider: offline, name: echo, options: {{credentials: {SECRET}}}}}\n",
            "model.options.credentials",
        ),
        (
            f"id: x\nmodel: {{provider: offline, name: echo, options: {{private_key: {SECRET}}}}}\n",
            "model.options.private_key",
        ),
        (
            f"id: x\nmodel: {{provider: offline, name: echo, options: {{note: {KEY}}}}}\n",
            "model.options.note holds what looks like a credential",
        ),
        (f"id: x\nmodel: offline:echo\ninstructions: 'Use {KEY} to call the API.'\n", "instructions holds"),
        (
            f"id: x\nmodel: {{provider: vllm, name: q, base_url: 'https://bob:{SECRET}@llm.internal/v1'}}\n",
            "model.base_url has credentials in its URL",
        ),
        (
            "id: x\nmodel: {provider: vllm, name: q, base_url: 'https://bob@llm.internal/v1'}\n",
            "model.base_url has credentials in its URL",
        ),
        (
            f"id: x\nmodel: {{provider: vllm, name: q, base_url: 'https://llm.internal/v1?api-key={SECRET}'}}\n",
            "model.base_url has a credential in its query parameter 'api-key'",
        ),
        (
            f"id: x\nmodel: {{provider: vllm, name: q, base_url: 'https://llm.internal/v1?alt=sse&key={SECRET}'}}\n",
            "model.base_url has a credential in its query parameter 'key'",
        ),
        (
            f"id: x\nmodel: {{provider: vllm, name: q, api_key_env: '{SECRET}'}}\n",
            "model.api_key_env must be the NAME of an environment variable",
        ),
        (
            f"id: x\nmodel: {{provider: offline, name: echo, options: {{token_env: '{KEY}'}}}}\n",
            "model.options.token_env must be the NAME",
        ),
    ],
)
def test_credentials_are_refused_naming_the_field_never_the_value(doc: str, field: str) -> None:
    with pytest.raises(InvalidRequest) as refused:
        parse_agent_config(doc)
    message = refused.value.message
    assert field in message
    assert "never put an API key" in message
    assert SECRET not in message and KEY not in message and "Zq9xW4" not in message


def test_validating_a_config_object_refuses_too_and_never_quotes_the_input() -> None:
    doc: dict[str, Any] = {
        "id": "x",
        "model": {"provider": "offline", "name": "echo", "options": {"pwd": 1, "password": SECRET}},
    }
    with pytest.raises(ValidationError) as refused:
        AgentConfig.model_validate(doc)
    assert "model.options.password is named like a credential" in str(refused.value)
    assert SECRET not in str(refused.value)
    with pytest.raises(InvalidRequest) as put:
        parse_agent_config(
            '{"id": "x", "model": {"provider": "offline", "name": "echo", "options": {"n": 1}}, '
            f'"instructions": "{KEY}"}}'
        )
    assert KEY not in str(put.value)


def test_a_stored_config_is_not_walked_again_on_every_read() -> None:
    # `agents put` checked it (parse_agent_config); reading it back on every turn trusts that check,
    # so the walk costs nothing per turn; a document from anywhere else is still walked
    doc = {"id": "x", "model": {"provider": "offline", "name": "echo"}, "instructions": KEY}
    assert config_from_json(json.dumps(doc)).instructions == KEY
    with pytest.raises(ValidationError):
        AgentConfig.model_validate(doc)


def test_ordinary_configs_stay_allowed() -> None:
    config = parse_agent_config(
        "id: support-bot\n"
        "model:\n"
        "  provider: openai-compatible\n"
        "  name: qwen3.6\n"
        "  base_url: http://127.0.0.1:8000/v1?timeout=30\n"
        "  api_key_env: QWEN_API_KEY\n"
        "  options: {delay_ms: 35, max_tokens_hint: 3, token_budget_env: TOKENS}\n"
        "instructions: >\n"
        "  You help {{customer_name}} with orders. Never ask for a password or an API key;\n"
        "  explain Bearer authentication and tokens when asked. Docs: https://example.com/auth?lang=en\n"
        "settings: {temperature: 0.2, max_tokens: 256}\n"
    )
    assert config.model.api_key_env == "QWEN_API_KEY"
    assert config.model.base_url == "http://127.0.0.1:8000/v1?timeout=30"
    assert parse_agent_config("id: x\nmodel: offline:echo\n").model.name == "echo"


def test_find_credential_walks_any_depth() -> None:
    assert find_credential({"a": [{"b": {"c": {"secret": None}}}]}) == "a[0].b.c.secret is named like a credential"
    assert find_credential({"a": [1, 2.5, True, None, "plain"]}) is None
    assert find_credential(["https://u:p@h"]) == "[0] has credentials in its URL (a user or password before '@')"
