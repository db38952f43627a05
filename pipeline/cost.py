"""What a run used and cost: the tokens of its responses (cache reads and writes among them), its price
in USD from genai-prices, and, for the offline models, the tokens counted here with the agent's
tokenizer, since a `FunctionModel` only guesses (a constant 50 tokens in, whatever it received).

Pure: the tokenizer is loaded in the shell and passed in; prices come from the genai-prices data
installed with pydantic-ai (no network), looked up through `ModelResponse.cost()`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from decimal import Decimal

from pydantic_ai.messages import ModelMessage, ModelResponse
from pydantic_ai.tools import ToolDefinition

from .contracts import Usage
from .tokens import MESSAGE_OVERHEAD_TOKENS, Tokenizer, count_message, count_messages, count_tool_definitions

#: The provider shorthand of Threadline's own models (`offline:echo`), which is also their model name.
OFFLINE_PREFIX = "offline:"
#: A cost kept as an integer in Redis counters (HINCRBY): millionths of a dollar.
MICRO_USD = Decimal(1_000_000)


@dataclass(frozen=True, slots=True)
class LocalCount:
    """What an offline run's requests carry besides the messages: the agent's tokenizer, and the
    tokens of the run instructions and tool definitions, counted as the history stage counts them."""

    tokenizer: Tokenizer
    fixed_tokens: int = 0


def local_count(tokenizer: Tokenizer, *, instructions: str | None,
                tools: Sequence[ToolDefinition] = ()) -> LocalCount:
    """The local count of an offline run, its fixed parts counted as `LocalCounter` counts them."""
    fixed = tokenizer.count(instructions) + MESSAGE_OVERHEAD_TOKENS if instructions else 0
    return LocalCount(tokenizer, fixed + count_tool_definitions(tools, tokenizer))


def response_cost(response: ModelResponse) -> Decimal | None:
    """The price of one response in USD, or None: genai-prices does not know the model or provider,
    or the response has no usage to price. Pricing never fails a turn."""
    if not response.model_name or response.model_name.startswith(OFFLINE_PREFIX):
        return None
    try:
        return response.cost().total_price
    except (LookupError, ValueError):
        return None


def run_usage(new_messages: Sequence[ModelMessage], *, history: Sequence[ModelMessage] = (),
              local: LocalCount | None = None) -> Usage:
    """The usage of a run's responses; with `local`, the responses of the offline models are counted
    with its tokenizer: what each request carried (`history`, the run's messages before it, the fixed
    parts) and what it answered. The cost is None unless every response has a price."""
    responses = [m for m in new_messages if isinstance(m, ModelResponse)]
    costs = [response_cost(r) for r in responses]
    total = sum((c for c in costs if c is not None), Decimal(0)) if costs and None not in costs else None
    usage = Usage(
        input_tokens=sum(r.usage.input_tokens for r in responses),
        output_tokens=sum(r.usage.output_tokens for r in responses),
        requests=len(responses),
        cache_read_tokens=sum(r.usage.cache_read_tokens for r in responses),
        cache_write_tokens=sum(r.usage.cache_write_tokens for r in responses),
        cost_usd=float(round(total, 8)) if total is not None else None,
    )
    if local is None or not any(_offline(r) for r in responses):
        return usage
    return _counted_locally(usage, [*history, *new_messages], len(history), local)


def _offline(response: ModelResponse) -> bool:
    return (response.model_name or "").startswith(OFFLINE_PREFIX)


def _counted_locally(usage: Usage, messages: Sequence[ModelMessage], start: int, local: LocalCount) -> Usage:
    """`usage` with the offline responses' own guesses (from `messages[start]` on) replaced by local
    counts; the responses of other models (a fallback chain's) keep what their provider reported."""
    tokens_in = tokens_out = 0
    for i in range(start, len(messages)):
        if not isinstance(message := messages[i], ModelResponse):
            continue
        if _offline(message):
            tokens_in += count_messages(messages[:i], local.tokenizer) + local.fixed_tokens
            tokens_out += count_message(message, local.tokenizer) - MESSAGE_OVERHEAD_TOKENS
        else:
            tokens_in, tokens_out = tokens_in + message.usage.input_tokens, tokens_out + message.usage.output_tokens
    return usage.model_copy(update={"input_tokens": tokens_in, "output_tokens": tokens_out,
                                    "counted_by": local.tokenizer.name})


def usage_counters(usage: Usage) -> dict[str, int]:
    """The integer counters a turn's usage adds to its tenant's usage hash: tokens, requests, the cost
    in millionths of a dollar, and `unpriced_turns` for a turn whose cost is unknown (a sum that
    left it out would understate what was spent)."""
    counters = {"input_tokens": usage.input_tokens, "output_tokens": usage.output_tokens,
                "requests": usage.requests, "cache_read_tokens": usage.cache_read_tokens,
                "cache_write_tokens": usage.cache_write_tokens}
    if usage.cost_usd is not None:
        counters["cost_micro_usd"] = int((Decimal(str(usage.cost_usd)) * MICRO_USD).to_integral_value())
    elif usage.requests:
        counters["unpriced_turns"] = 1
    return counters


def cached_share(usage: Usage) -> float | None:
    """The share of the input tokens the provider served from its cache; None: no input."""
    return usage.cache_read_tokens / usage.input_tokens if usage.input_tokens else None
