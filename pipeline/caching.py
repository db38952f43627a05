"""Provider prompt caching: `model.cache` mapped onto pydantic-ai's unified `cache` setting, cache
breakpoints at the end of the stable history prefix, and OpenAI's `prompt_cache_key`.

pydantic-ai already places breakpoints on the tool definitions and the instructions, caches the
growing conversation (Anthropic's automatic caching), keeps a request within Anthropic's four
breakpoints (dropping the oldest message breakpoints first) and snaps a retention to the provider's
tiers. What Threadline adds is what only it knows: where its history stops changing. A `CachePoint`
goes at the end of the kept turns: the prefix the following turns start with as long as the window
holds, a read at a tenth of the input price where a write costs 1.25 times the input price. That is
before the running summary, which follows the kept turns (`history.summary_messages`) and changes
the turn after the window moved, or, without a summary, before the turn's query. None goes on a
prefix shorter than the model's minimum cacheable length, counted as Anthropic caches it (tools,
instructions, then messages, one prefix): it would only take one of the four slots.

Each model of a fallback chain is wrapped on its own (`PromptCacheModel`), with its own setting and
its provider's flags, so a chain of Claude and GPT models caches on both.
"""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from typing import Any, cast

from pydantic_ai.messages import CachePoint, ModelMessage, ModelRequest, UserPromptPart
from pydantic_ai.models import Model, ModelRequestParameters, StreamedResponse
from pydantic_ai.models.wrapper import WrapperModel
from pydantic_ai.settings import CacheConfig, CacheSetting, ModelSettings
from pydantic_ai.tools import RunContext

from .config import CacheOptions, ModelSpec
from .history import SUMMARY_HEADER
from .tokens import Tokenizer, count_messages, count_tool_definitions

#: Providers whose caches are read only at explicit breakpoints (`cache_control`, `cachePoint`).
BREAKPOINT_PROVIDERS: frozenset[str] = frozenset({"anthropic", "bedrock"})
#: Providers whose requests carry `prompt_cache_key` (OpenAI routes a prefix to a cache by it).
CACHE_KEY_PROVIDERS: frozenset[str] = frozenset({"openai"})
#: The shortest prompt Anthropic caches, by model family (its prompt-caching docs); any other model: 1,024.
MIN_CACHEABLE_TOKENS: tuple[tuple[str, int], ...] = (
    ("opus-4-5", 4096), ("haiku-4-5", 4096), ("haiku", 2048),
)
DEFAULT_MIN_CACHEABLE_TOKENS = 1024


def cache_setting(spec: ModelSpec) -> CacheSetting:
    """`model.cache` as pydantic-ai's `cache` setting (`False`: off, also for a cache a model's own
    defaults would turn on)."""
    cache = spec.cache
    if not isinstance(cache, CacheOptions):
        return cache
    config = CacheConfig(messages=cache.messages)
    if cache.retention is not None:
        config["retention"] = cache.retention
    return config


def caches_messages(spec: ModelSpec) -> bool:
    """Whether the conversation is cached, not only the tools and instructions."""
    return spec.cache is not False and not (isinstance(spec.cache, CacheOptions) and not spec.cache.messages)


def min_cacheable_tokens(model_name: str) -> int:
    name = model_name.lower()
    return next((tokens for family, tokens in MIN_CACHEABLE_TOKENS if family in name), DEFAULT_MIN_CACHEABLE_TOKENS)


def prompt_cache_key(conversation_id: str) -> str:
    """OpenAI's `prompt_cache_key` of a conversation: a hash of its id, never anything a tenant wrote;
    the same for every turn of the conversation, so that its requests reach the same cache."""
    return "tl-" + hashlib.sha256(f"threadline:{conversation_id}".encode()).hexdigest()[:32]


@dataclass(frozen=True, slots=True)
class CachePlan:
    """How one model of a chain caches: its `cache` setting, whether Threadline marks the stable
    prefix with breakpoints, whether requests carry `prompt_cache_key`, and the shortest prefix
    worth a breakpoint (counted with `tokenizer`)."""

    setting: CacheSetting
    breakpoints: bool
    cache_key: bool
    min_tokens: int
    tokenizer: Tokenizer


def cache_plan(spec: ModelSpec, tokenizer: Tokenizer) -> CachePlan | None:
    """The plan of one model (not its fallbacks); None: caching is off, nothing to add."""
    if spec.cache is False:
        return None
    return CachePlan(setting=cache_setting(spec),
                     breakpoints=spec.provider in BREAKPOINT_PROVIDERS and caches_messages(spec),
                     cache_key=spec.provider in CACHE_KEY_PROVIDERS,
                     min_tokens=min_cacheable_tokens(spec.name), tokenizer=tokenizer)


def mark_stable_prefix(messages: Sequence[ModelMessage], *, run_id: str | None, min_tokens: int,
                       tokenizer: Tokenizer, fixed_tokens: int = 0) -> list[ModelMessage]:
    """`messages` with a `CachePoint` at the end of the kept turns: at the head of the summary block
    when the history carries one after them, else at the head of the run's first request (pydantic-ai
    marks the block before it). A summary in front of the history (no kept turn before it) is a
    stable block of its own: marked at its end, and the history end after it as without a summary.
    Only where the prefix before the point, `fixed_tokens` (the tool definitions and instructions
    sent before the messages) included, holds at least `min_tokens`."""
    out = list(messages)
    start = next((i for i, m in enumerate(out) if run_id is not None and m.run_id == run_id), None)
    summary = next((i for i, m in enumerate(out[:start]) if _is_summary(m)), None)
    covered = -1  # the last message a point already ends (a point at the head of message i ends i - 1)
    if summary == 0:
        if fixed_tokens + count_messages(out[:1], tokenizer) >= min_tokens:
            out[0] = _with_cache_point(cast(ModelRequest, out[0]), at_end=True)
        summary, covered = None, 1  # the summary's acknowledgement
    point = summary if summary is not None else start
    if point is None or point - 1 <= covered or not isinstance(out[point], ModelRequest):
        return out
    if fixed_tokens + count_messages(out[:point], tokenizer) >= min_tokens:
        out[point] = _with_cache_point(cast(ModelRequest, out[point]), at_end=False)
    return out


def fixed_prefix_tokens(params: ModelRequestParameters, tokenizer: Tokenizer) -> int:
    """The tokens a request sends before its messages: the tool definitions and the instructions."""
    instructions = sum(tokenizer.count(p.content) for p in params.instruction_parts or [])
    return count_tool_definitions([*params.function_tools, *params.output_tools], tokenizer) + instructions


def _is_summary(message: ModelMessage) -> bool:
    return isinstance(message, ModelRequest) and any(
        isinstance(p, UserPromptPart) and isinstance(p.content, str) and p.content.startswith(SUMMARY_HEADER)
        for p in message.parts)


def _with_cache_point(request: ModelRequest, *, at_end: bool) -> ModelRequest:
    """`request` with a `CachePoint` in its first user prompt: after its content, or before it."""
    parts = list(request.parts)
    for i, part in enumerate(parts):
        if isinstance(part, UserPromptPart):
            content = [part.content] if isinstance(part.content, str) else list(part.content)
            parts[i] = replace(part, content=[*content, CachePoint()] if at_end else [CachePoint(), *content])
            return replace(request, parts=parts)
    return request


def count_breakpoints(messages: Sequence[ModelMessage]) -> int:
    """The `CachePoint` markers in `messages` (for decision records and tests)."""
    return sum(1 for m in messages if isinstance(m, ModelRequest) for p in m.parts
               if isinstance(p, UserPromptPart) and not isinstance(p.content, str)
               for item in p.content if isinstance(item, CachePoint))


class PromptCacheModel(WrapperModel):
    """One model of an agent with its `CachePlan` applied to every streamed request of a run: the
    `cache` setting (and `prompt_cache_key`) in its settings, breakpoints on its stable prefix."""

    def __init__(self, wrapped: Model, plan: CachePlan) -> None:
        super().__init__(wrapped)
        self.plan = plan

    def _with_settings(self, settings: ModelSettings | None, run_context: RunContext[Any] | None) -> ModelSettings:
        added: dict[str, Any] = {"cache": self.plan.setting}
        if self.plan.cache_key and run_context is not None and run_context.conversation_id:
            added["openai_prompt_cache_key"] = prompt_cache_key(run_context.conversation_id)
        return cast(ModelSettings, {**added, **(settings or {})})

    def _marked(self, messages: list[ModelMessage], run_context: RunContext[Any] | None,
                params: ModelRequestParameters) -> list[ModelMessage]:
        if not self.plan.breakpoints:
            return messages
        return mark_stable_prefix(messages, run_id=run_context.run_id if run_context else None,
                                  min_tokens=self.plan.min_tokens, tokenizer=self.plan.tokenizer,
                                  fixed_tokens=fixed_prefix_tokens(params, self.plan.tokenizer))

    async def request(self, messages: list[ModelMessage], model_settings: ModelSettings | None,
                      model_request_parameters: ModelRequestParameters) -> Any:
        return await self.wrapped.request(self._marked(messages, None, model_request_parameters),
                                          self._with_settings(model_settings, None), model_request_parameters)

    @asynccontextmanager
    async def request_stream(
        self,
        messages: list[ModelMessage],
        model_settings: ModelSettings | None,
        model_request_parameters: ModelRequestParameters,
        run_context: RunContext[Any] | None = None,
    ) -> AsyncIterator[StreamedResponse]:
        async with self.wrapped.request_stream(self._marked(messages, run_context, model_request_parameters),
                                               self._with_settings(model_settings, run_context),
                                               model_request_parameters, run_context) as stream:
            yield stream
