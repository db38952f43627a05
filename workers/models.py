"""Models and tools by config, built in the shell: keys come from the worker's environment (by the
name a config gives, never from the config), providers are constructed here, and `python:` plugins
are imported here, where workers allow them. What the offline models answer is pure logic in
`pipeline/models.py`; here they get their pace."""

from __future__ import annotations

import asyncio
import importlib
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any

from pydantic_ai import Tool
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart
from pydantic_ai.models import Model
from pydantic_ai.models.function import AgentInfo, FunctionModel

from threadline.pipeline.config import ModelSpec
from threadline.pipeline.errors import InvalidRequest, ThreadlineError
from threadline.pipeline.invoke import BUILTIN_TOOLS, TurnDeps
from threadline.pipeline.models import (
    StrictSystemModel,
    chat_answer,
    echo,
    echo_stream,
    profile_for,
    summary_answer,
    words,
)


def build_model(spec: ModelSpec, *, env: Mapping[str, str], allow_python: bool = False) -> Model:
    """The pydantic-ai model a config names, wrapped in its provider profile."""
    return StrictSystemModel(_base_model(spec, env=env, allow_python=allow_python), profile_for(spec))


def model_secrets(spec: ModelSpec, env: Mapping[str, str]) -> list[str]:
    """The key values a model uses: scrubbed from anything its errors say."""
    value = env.get(spec.api_key_env, "") if spec.api_key_env else ""
    return [value] if value else []


def build_tools(names: Sequence[str], *, allow_python: bool) -> list[Tool[TurnDeps]]:
    """The tools a config names: built-ins, or `python:module:function` where workers allow plugins."""
    tools: list[Tool[TurnDeps]] = []
    for name in names:
        if name in BUILTIN_TOOLS:
            tools.append(BUILTIN_TOOLS[name])
        elif allow_python:
            tools.append(Tool(import_object(name.removeprefix("python:"))))
        else:
            raise InvalidRequest(f"tool {name!r}: python plugins are disabled on these workers")
    return tools


def _base_model(spec: ModelSpec, *, env: Mapping[str, str], allow_python: bool) -> Model:
    if spec.provider == "offline":
        return offline_model(spec.name, spec.options)
    if spec.provider == "python":
        if not allow_python:
            raise InvalidRequest("python model factories are disabled on these workers (TL_ALLOW_PYTHON_PLUGINS)")
        factory: Callable[[dict[str, Any]], Model] = import_object(spec.name)
        return factory(dict(spec.options))
    if spec.provider == "anthropic":
        return _anthropic(spec, env)
    return _openai_chat(spec, env)


def _anthropic(spec: ModelSpec, env: Mapping[str, str]) -> Model:
    try:
        from pydantic_ai.models.anthropic import AnthropicModel
        from pydantic_ai.providers.anthropic import AnthropicProvider
    except ImportError:
        raise ThreadlineError("the anthropic provider is not installed on these workers: "
                              "pip install 'threadline[anthropic]'", code="model_unavailable") from None
    name = spec.api_key_env or "ANTHROPIC_API_KEY"
    api_key = env.get(name, "")
    if not api_key:
        raise ThreadlineError(f"no API key in the worker's environment variable {name!r}", code="model_unavailable")
    return AnthropicModel(spec.name, provider=AnthropicProvider(api_key=api_key, base_url=spec.base_url))


def _openai_chat(spec: ModelSpec, env: Mapping[str, str]) -> Model:
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    api_key = env.get(spec.api_key_env, "") if spec.api_key_env else ""
    if spec.provider == "openai" and not api_key:
        raise ThreadlineError(f"no API key in the worker's environment variable {spec.api_key_env!r}",
                              code="model_unavailable")
    base_url = spec.base_url
    if spec.provider == "ollama" and base_url is None:
        base_url = "http://127.0.0.1:11434/v1"
    if spec.provider != "openai" and base_url is None:
        raise InvalidRequest(f"provider {spec.provider!r} needs a base_url")
    provider = OpenAIProvider(base_url=base_url, api_key=api_key or "not-needed")
    return OpenAIChatModel(spec.name, provider=provider)


def import_object(path: str) -> Any:
    """`module:attribute` → the attribute (python plugins: test models and tools)."""
    module_name, _, attr = path.partition(":")
    try:
        found = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as e:
        raise InvalidRequest(f"cannot load {path!r}: {e}") from None
    if not callable(found):
        raise InvalidRequest(f"{path!r} is not callable")
    return found


def offline_model(name: str, options: Mapping[str, Any]) -> Model:
    """Threadline's offline models: no key, deterministic answers (`pipeline/models.py`)."""
    if name == "echo":
        return FunctionModel(echo, stream_function=echo_stream, model_name="offline:echo")
    if name == "chat":
        delay = float(options.get("delay_ms", 0)) / 1000
        repeat = int(options.get("repeat", 1))

        async def chat_stream(messages: list[ModelMessage], info: AgentInfo) -> AsyncIterator[str]:
            for word in words(chat_answer(messages, repeat=repeat)):
                if delay:
                    await asyncio.sleep(delay)
                yield word

        def chat(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
            return ModelResponse(parts=[TextPart(chat_answer(messages, repeat=repeat))])

        return FunctionModel(chat, stream_function=chat_stream, model_name="offline:chat")
    if name == "summary":

        def summary(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
            return ModelResponse(parts=[TextPart(summary_answer(messages))])

        async def summary_stream(messages: list[ModelMessage], info: AgentInfo) -> AsyncIterator[str]:
            yield summary_answer(messages)

        return FunctionModel(summary, stream_function=summary_stream, model_name="offline:summary")
    raise InvalidRequest(f"unknown offline model {name!r}; available: echo, chat, summary")
