"""Agent config documents: parsing, validation, the settings whitelist and prompt variables."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .contracts import Id
from .errors import InvalidRequest

Provider = Literal["offline", "openai", "openai-compatible", "vllm", "ollama", "anthropic", "python"]

#: Model settings a config may set; anything else is refused when the config is registered.
SETTINGS_WHITELIST: frozenset[str] = frozenset(
    {"temperature", "top_p", "presence_penalty", "frequency_penalty", "max_tokens", "stop_sequences"}
)
BUILTIN_TOOLS: frozenset[str] = frozenset({"clock", "ask_human"})
_VARIABLE = re.compile(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}")


class _Doc(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSpec(_Doc):
    provider: Provider
    name: Annotated[str, Field(min_length=1, max_length=256)]
    base_url: str | None = None
    #: The NAME of an environment variable on the workers; never the key itself.
    api_key_env: Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")] | None = None
    context_window: Annotated[int, Field(gt=0)] = 32768
    max_output_tokens: Annotated[int, Field(gt=0)] = 1024
    #: Exactly one leading system message on every request (strict chat templates).
    strict_system: bool = True
    #: Images in `files` go to the model natively; otherwise files are described as text.
    vision: bool = False
    #: Offline and test models only: options passed to the model factory.
    options: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _from_shorthand(cls, value: Any) -> Any:
        if isinstance(value, str):
            provider, sep, name = value.partition(":")
            if not sep:
                raise ValueError("model shorthand must look like 'provider:name', e.g. 'offline:echo'")
            return {"provider": provider, "name": name}
        if isinstance(value, dict) and "api_key" in value:
            raise ValueError("never put an API key in a config: name its environment variable in api_key_env")
        return value


class MemorySpec(_Doc):
    message_limit: Annotated[int, Field(gt=0, le=10000)] = 500
    safety_margin_tokens: Annotated[int, Field(ge=0)] = 256


class AgentConfig(_Doc):
    id: Id
    model: ModelSpec
    instructions: str = ""
    settings: dict[str, Any] = Field(default_factory=dict)
    layers: list[Annotated[str, Field(min_length=1)]] = Field(default_factory=lambda: ["history"])
    tools: list[str] = Field(default_factory=list)
    memory: MemorySpec = Field(default_factory=MemorySpec)
    deadline_s: Annotated[float, Field(gt=0, le=86400)] = 120.0

    @field_validator("settings")
    @classmethod
    def _whitelisted(cls, value: dict[str, Any]) -> dict[str, Any]:
        unknown = sorted(set(value) - SETTINGS_WHITELIST)
        if unknown:
            raise ValueError(f"settings not allowed: {unknown}; allowed: {sorted(SETTINGS_WHITELIST)}")
        return value

    @field_validator("tools")
    @classmethod
    def _known_tools(cls, value: list[str]) -> list[str]:
        unknown = sorted(t for t in value if t not in BUILTIN_TOOLS and not t.startswith("python:"))
        if unknown:
            raise ValueError(f"unknown tools: {unknown}; available: {sorted(BUILTIN_TOOLS)} or python:module:function")
        return value

    @field_validator("layers")
    @classmethod
    def _one_history_layer(cls, value: list[str]) -> list[str]:
        if len(set(value)) != len(value):
            raise ValueError("layer names must be unique")
        return value


def parse_agent_config(text: str | bytes) -> AgentConfig:
    """Parse a YAML or JSON agent config document, or raise `InvalidRequest` saying what is wrong."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise InvalidRequest(f"agent config is not valid YAML/JSON: {e}") from None
    if not isinstance(data, dict):
        raise InvalidRequest("agent config must be a mapping")
    try:
        return AgentConfig.model_validate(data)
    except ValidationError as e:
        details = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or 'config'}: {err['msg']}" for err in e.errors()[:5]
        )
        raise InvalidRequest(f"invalid agent config: {details}") from None


def config_to_json(config: AgentConfig) -> str:
    return config.model_dump_json()


def config_from_json(text: str | bytes) -> AgentConfig:
    return AgentConfig.model_validate(json.loads(text))


def whitelisted_settings(settings: Mapping[str, Any]) -> dict[str, Any]:
    """Only the whitelisted model settings pass, whatever a stored config holds."""
    return {k: v for k, v in settings.items() if k in SETTINGS_WHITELIST}


def expand_variables(template: str, inputs: Mapping[str, object]) -> tuple[str, list[str]]:
    """Replace `{{name}}` with `inputs[name]`; return the text and the names that had no value."""
    missing: list[str] = []

    def substitute(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in inputs:
            missing.append(name)
            return ""
        return str(inputs[name])

    return _VARIABLE.sub(substitute, template), missing
