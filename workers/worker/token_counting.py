"""Token counters for the memory budget: a local tokenizer (`workers/worker/tokenizers.py`), or the
provider's own count endpoint (`model.tokenizer: provider`) with a labelled local fallback.

A provider counts over HTTP: Anthropic `count_tokens`, Gemini `countTokens`, Bedrock `CountTokens`,
through pydantic-ai's `Model.count_tokens`. What it counts is the text form of each part
(`pipeline.tokens.as_text_exchange`): the same texts a local tokenizer counts, with the provider's
own per-message overhead instead of 4 tokens. Each stored turn is counted once and its count cached
with the conversation under the counter's name (`workers/storage/store.py`), like a local count; the texts
of the fixed parts (instructions, tool definitions) are kept in a small per-process cache, so a turn
usually asks for two counts, its query and the turn before it, at the same time.

When the endpoint fails or is slow, the turn is counted with the provider's default local tokenizer
instead, and its decision record names both (`CountUnavailable`); the endpoint is then left alone for
`COUNT_RETRY_S`, so that a provider outage does not cost every turn a timeout.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from pydantic_ai.exceptions import ModelHTTPError
from pydantic_ai.messages import ModelMessage, ModelRequest, UserPromptPart
from pydantic_ai.models import Model, ModelRequestParameters
from pydantic_ai.tools import ToolDefinition

from threadline.pipeline.tokens import (
    MESSAGE_OVERHEAD_TOKENS,
    Tokenizer,
    as_text_exchange,
    count_messages,
    count_tool_definitions,
    tool_definitions_json,
)
from threadline.workers.telemetry import metrics

#: The longest wait for one count; past it the turn counts with the fallback.
COUNT_TIMEOUT_S = 5.0
#: After a failed count the endpoint is not asked again for this long.
COUNT_RETRY_S = 60.0
#: Counts of one turn's read asked for at once.
COUNT_CONCURRENCY = 8
#: Texts (instructions, tool definitions, summaries) whose counts a process remembers.
TEXT_CACHE_SIZE = 1024


class TokenCounter(Protocol):
    """Counts what the history budget needs: a text as one message, tool definitions, whole turns."""

    @property
    def name(self) -> str: ...

    @property
    def tokenizer(self) -> Tokenizer | None:
        """The local tokenizer behind this counter (None: the provider counts)."""

    async def text(self, text: str | None) -> int: ...

    async def tools(self, definitions: Sequence[ToolDefinition]) -> int: ...

    async def turns(self, turns: Mapping[str, Sequence[ModelMessage]]) -> dict[str, int]: ...


@dataclass(frozen=True, slots=True)
class LocalCounter:
    """A tokenizer on this machine: 4 tokens per message (`pipeline/tokens.py`)."""

    tokenizer: Tokenizer

    @property
    def name(self) -> str:
        return self.tokenizer.name

    async def text(self, text: str | None) -> int:
        return self.tokenizer.count(text) + MESSAGE_OVERHEAD_TOKENS if text else 0

    async def tools(self, definitions: Sequence[ToolDefinition]) -> int:
        return count_tool_definitions(definitions, self.tokenizer)

    async def turns(self, turns: Mapping[str, Sequence[ModelMessage]]) -> dict[str, int]:
        # counting is CPU work: off the event loop, so the process's other turns keep streaming
        return await asyncio.to_thread(lambda: {mid: count_messages(m, self.tokenizer) for mid, m in turns.items()})


class CountUnavailable(Exception):
    """The provider could not count: count with `fallback`, and say so."""

    def __init__(self, reason: str, fallback: LocalCounter) -> None:
        super().__init__(reason)
        self.reason = reason
        self.fallback = fallback


class ProviderCounter:
    """The provider's count endpoint, through `model.count_tokens` (raises `CountUnavailable`)."""

    tokenizer: Tokenizer | None = None

    def __init__(self, name: str, model: Model, fallback: LocalCounter, *, provider: str = "",
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.name = name
        self.model = model
        self.provider = provider or name
        self.fallback = fallback
        self._clock = clock
        self._texts: OrderedDict[bytes, int] = OrderedDict()
        self._down_until = 0.0
        self._reason = ""

    async def text(self, text: str | None) -> int:
        if not text:
            return 0
        key = hashlib.blake2b(text.encode(), digest_size=16).digest()
        if (found := self._texts.get(key)) is not None:
            self._texts.move_to_end(key)
            return found
        count = await self._count([ModelRequest(parts=[UserPromptPart(text)])])
        self._texts[key] = count
        if len(self._texts) > TEXT_CACHE_SIZE:
            self._texts.popitem(last=False)
        return count

    async def tools(self, definitions: Sequence[ToolDefinition]) -> int:
        return await self.text(tool_definitions_json(definitions)) if definitions else 0

    async def turns(self, turns: Mapping[str, Sequence[ModelMessage]]) -> dict[str, int]:
        gate = asyncio.Semaphore(COUNT_CONCURRENCY)

        async def one(messages: Sequence[ModelMessage]) -> int:
            exchange = as_text_exchange(messages)
            if not exchange:
                return 0
            async with gate:
                return await self._count(exchange)

        counted = await asyncio.gather(*(one(m) for m in turns.values()))
        return dict(zip(turns, counted, strict=True))

    async def _count(self, messages: list[ModelMessage]) -> int:
        if self._clock() < self._down_until:
            metrics.TOKEN_COUNTS.labels(self.provider, "skipped").inc()
            raise CountUnavailable(self._reason, self.fallback)
        try:
            async with asyncio.timeout(COUNT_TIMEOUT_S):
                usage = await self.model.count_tokens(messages, None, ModelRequestParameters())
        except Exception as e:
            metrics.TOKEN_COUNTS.labels(self.provider, "failed").inc()
            self._reason = f"the count endpoint failed ({_describe(e)}); counted with {self.fallback.name}"
            self._down_until = self._clock() + COUNT_RETRY_S
            raise CountUnavailable(self._reason, self.fallback) from None
        metrics.TOKEN_COUNTS.labels(self.provider, "ok").inc()
        return usage.input_tokens


def _describe(e: Exception) -> str:
    """What went wrong, without the error's message (it may quote a request or a key)."""
    if isinstance(e, ModelHTTPError):
        return f"HTTP {e.status_code}"
    if isinstance(e, TimeoutError):
        return f"no answer within {COUNT_TIMEOUT_S:g} s"
    if isinstance(e, NotImplementedError):
        return "the model has no count endpoint"
    return type(e).__name__
