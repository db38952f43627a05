"""Model profiles (the strict single-system-message guard) and what Threadline's offline models
answer. Building a model from a config (keys from the environment, providers, plugins) is the
shell's job: `workers/worker/providers.py`."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
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
from pydantic_ai.models.function import AgentInfo
from pydantic_ai.models.wrapper import WrapperModel
from pydantic_ai.profiles import ModelProfile
from pydantic_ai.settings import ModelSettings
from pydantic_ai.tools import RunContext

from .config import ModelSpec
from .history import SUMMARY_HEADER
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


def echo(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    """`offline:echo`: a JSON description of exactly what the model received."""
    return ModelResponse(parts=[TextPart(json.dumps(describe_request(messages, info)))])


async def echo_stream(messages: list[ModelMessage], info: AgentInfo) -> AsyncIterator[str]:
    yield json.dumps(describe_request(messages, info))


def summary_answer(messages: Sequence[ModelMessage]) -> str:
    """`offline:summary`'s answer: the first sentence of every user message it was given, in order
    (a previous summary, given as the first user message, is kept whole)."""
    prompts = user_prompts(messages)
    kept: list[str] = []
    for text in prompts[:-1]:  # the last prompt is the request to summarise
        if text.startswith(SUMMARY_HEADER):
            kept.append(text.removeprefix(SUMMARY_HEADER).strip())
        elif text.strip():
            kept.append(first_sentence(text))
    return "\n".join(k for k in kept if k)


def first_sentence(text: str) -> str:
    text = text.strip()
    for i, ch in enumerate(text):
        if ch in ".!?" and (i + 1 == len(text) or text[i + 1].isspace()):
            return text[: i + 1]
    return text


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


def words(text: str) -> list[str]:
    """`text` in streamable pieces: each word with the space after it."""
    words = text.split(" ")
    return [w + " " for w in words[:-1]] + [words[-1]]


def _prompt_text(part: UserPromptPart) -> str:
    if isinstance(part.content, str):
        return part.content
    return " ".join(item for item in part.content if isinstance(item, str))


__all__ = ["ProviderProfile", "StrictSystemModel", "SystemPromptPart", "chat_answer", "describe_request"]
