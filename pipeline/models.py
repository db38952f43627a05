"""Models by config: provider profiles (the strict single-system-message guard), real providers,
and Threadline's offline models, which need no key and answer deterministically."""

from __future__ import annotations

import asyncio
import importlib
import json
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from typing import Any

from pydantic_ai.messages import (
    ModelMessage,
    ModelRequest,
    ModelResponse,
    SystemPromptPart,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
    UserPromptPart,
)
from pydantic_ai.models import Model, ModelRequestParameters, StreamedResponse
from pydantic_ai.models.function import AgentInfo, FunctionModel
from pydantic_ai.models.wrapper import WrapperModel
from pydantic_ai.profiles import ModelProfile
from pydantic_ai.settings import ModelSettings
from pydantic_ai.tools import RunContext

from .config import ModelSpec
from .errors import InvalidRequest, ThreadlineError
from .mapping import normalise_messages, normalise_tool_definitions, system_text


@dataclass(frozen=True, slots=True)
class ProviderProfile:
    """Provider differences as flags, never `if provider == ...` elsewhere."""

    #: Exactly one leading system message on every request, instructions folded in.
    single_leading_system: bool
    #: Tool definitions must carry a string description.
    string_tool_descriptions: bool = True


def profile_for(spec: ModelSpec) -> ProviderProfile:
    return ProviderProfile(single_leading_system=spec.strict_system)


class StrictSystemModel(WrapperModel):
    """Applies `normalise_messages` to every request of a run, including the follow-up requests of
    the tool loop, and folds the run instructions into the single leading system message."""

    def __init__(self, wrapped: Model, profile: ProviderProfile) -> None:
        super().__init__(wrapped)
        self.threadline_profile = profile

    @property
    def profile(self) -> ModelProfile:
        # Mid-history system parts must reach `_normalise` as system parts, not rewritten into
        # `<system>` user text first, so that they can be merged into the leading message.
        if not self.threadline_profile.single_leading_system:
            return self.wrapped.profile
        return {**self.wrapped.profile, "supports_inline_system_prompts": True}

    def prepare_messages(
        self,
        messages: list[ModelMessage],
        model_request_parameters: ModelRequestParameters | None = None,
    ) -> list[ModelMessage]:
        # pydantic-ai rewrites mid-history system parts into `<system>` user text for some
        # profiles before `request` sees them: merge them into the leading message first.
        if self.threadline_profile.single_leading_system:
            messages, _ = normalise_messages(messages, repair_last_response=False)
        return self.wrapped.prepare_messages(messages, model_request_parameters)

    def _normalise(
        self, messages: list[ModelMessage], params: ModelRequestParameters
    ) -> tuple[list[ModelMessage], ModelRequestParameters]:
        if self.threadline_profile.string_tool_descriptions:
            params = replace(params, function_tools=normalise_tool_definitions(params.function_tools))
        if not self.threadline_profile.single_leading_system:
            return messages, params
        instructions = _instruction_texts(messages, params)
        normalised, _ = normalise_messages(messages, instructions=instructions, repair_last_response=False)
        return normalised, replace(params, instruction_parts=[])

    async def request(
        self,
        messages: list[ModelMessage],
        model_settings: ModelSettings | None,
        model_request_parameters: ModelRequestParameters,
    ) -> ModelResponse:
        messages, params = self._normalise(messages, model_request_parameters)
        return await self.wrapped.request(messages, model_settings, params)

    @asynccontextmanager
    async def request_stream(
        self,
        messages: list[ModelMessage],
        model_settings: ModelSettings | None,
        model_request_parameters: ModelRequestParameters,
        run_context: RunContext[Any] | None = None,
    ) -> AsyncIterator[StreamedResponse]:
        messages, params = self._normalise(messages, model_request_parameters)
        async with self.wrapped.request_stream(messages, model_settings, params, run_context) as stream:
            yield stream


def _instruction_texts(messages: Sequence[ModelMessage], params: ModelRequestParameters) -> list[str]:
    if params.instruction_parts is not None:
        return [part.content for part in params.instruction_parts]
    for message in reversed(messages):
        if isinstance(message, ModelRequest) and message.instructions is not None:
            return [message.instructions]
    return []


def build_model(spec: ModelSpec, *, env: Mapping[str, str], allow_python: bool = False) -> Model:
    """The pydantic-ai model a config names, wrapped in its provider profile. Keys come from `env`
    (the worker's environment) under the name the config gives, never from the config itself."""
    base = _base_model(spec, env=env, allow_python=allow_python)
    return StrictSystemModel(base, profile_for(spec))


def _base_model(spec: ModelSpec, *, env: Mapping[str, str], allow_python: bool) -> Model:
    if spec.provider == "offline":
        return offline_model(spec.name, spec.options)
    if spec.provider == "python":
        if not allow_python:
            raise InvalidRequest("python model factories are disabled on these workers (TL_ALLOW_PYTHON_PLUGINS)")
        factory: Callable[[dict[str, Any]], Model] = import_object(spec.name)
        return factory(dict(spec.options))
    if spec.provider == "anthropic":
        raise ThreadlineError("the anthropic provider is not installed on these workers", code="model_unavailable")
    return _openai_chat(spec, env)


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


# --- offline models -------------------------------------------------------------------------------


def offline_model(name: str, options: Mapping[str, Any]) -> Model:
    if name == "echo":
        return FunctionModel(_echo, stream_function=_echo_stream, model_name="offline:echo")
    if name == "chat":
        delay = float(options.get("delay_ms", 0)) / 1000
        repeat = int(options.get("repeat", 1))

        async def chat_stream(messages: list[ModelMessage], info: AgentInfo) -> AsyncIterator[str]:
            for word in _words(chat_answer(messages, repeat=repeat)):
                if delay:
                    await asyncio.sleep(delay)
                yield word

        def chat(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
            return ModelResponse(parts=[TextPart(chat_answer(messages, repeat=repeat))])

        return FunctionModel(chat, stream_function=chat_stream, model_name="offline:chat")
    raise InvalidRequest(f"unknown offline model {name!r}; available: echo, chat")


def describe_request(messages: Sequence[ModelMessage], info: AgentInfo) -> dict[str, Any]:
    """`offline:echo`'s answer: exactly what the model received."""
    system = system_text(messages)
    if info.instructions:
        system = f"{system}\n\n{info.instructions}" if system else info.instructions
    seen: list[dict[str, str]] = []
    for message in messages:
        if isinstance(message, ModelResponse):
            seen.extend(_response_items(message))
            continue
        for part in message.parts:
            if isinstance(part, UserPromptPart):
                seen.append({"role": "user", "text": _prompt_text(part)})
            elif isinstance(part, ToolReturnPart):
                seen.append({"role": "tool", "text": part.model_response_str()})
    return {"system": system, "messages": seen, "tools": [t.name for t in info.function_tools]}


def _response_items(message: ModelResponse) -> list[dict[str, str]]:
    items = []
    for part in message.parts:
        if isinstance(part, TextPart):
            items.append({"role": "assistant", "text": part.content})
        elif isinstance(part, ToolCallPart):
            items.append({"role": "assistant", "text": f"[call {part.tool_name} {part.args_as_json_str()}]"})
    return items


def _echo(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    return ModelResponse(parts=[TextPart(json.dumps(describe_request(messages, info)))])


async def _echo_stream(messages: list[ModelMessage], info: AgentInfo) -> AsyncIterator[str]:
    yield json.dumps(describe_request(messages, info))


def user_prompts(messages: Sequence[ModelMessage]) -> list[str]:
    return [
        _prompt_text(part)
        for message in messages
        if isinstance(message, ModelRequest)
        for part in message.parts
        if isinstance(part, UserPromptPart)
    ]


def chat_answer(messages: Sequence[ModelMessage], *, repeat: int = 1) -> str:
    """`offline:chat`'s answer: friendly, deterministic, and it refers to the earlier turns."""
    prompts = user_prompts(messages)
    if not prompts:
        return "Hello! What would you like to talk about?"
    current, earlier = prompts[-1], prompts[:-1]
    if not earlier:
        answer = f'Hello! You said "{current}". This is the start of our conversation.'
    else:
        recalled = ", ".join(f'"{p}"' for p in earlier)
        answer = (
            f'You said "{current}". Earlier you told me {recalled}. '
            f"That makes {len(prompts)} messages from you so far."
        )
    return " ".join([answer] * max(1, repeat))


def _words(text: str) -> list[str]:
    words = text.split(" ")
    return [w + " " for w in words[:-1]] + [words[-1]]


def _prompt_text(part: UserPromptPart) -> str:
    if isinstance(part.content, str):
        return part.content
    return " ".join(item for item in part.content if isinstance(item, str))


__all__ = ["ProviderProfile", "StrictSystemModel", "SystemPromptPart", "build_model", "offline_model"]
