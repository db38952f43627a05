"""The history budget and which whole turns fit in it.

The model's context window is shared: what is left for history is

    budget = context window - max output tokens - safety margin
             - instructions (and extra context) - the current query (and its files) - tool definitions

each counted with the model's tokenizer, plus 4 tokens per message. When the fixed parts alone do
not fit, the turn fails `context_too_large` before any model call.

History is kept by whole turns (a user message, the assistant's tool calls, their results and the
final answer leave together), newest first, never half a turn. Pruning is cache-aware: providers
discount a repeated prompt prefix, so once the history overflows it is cut down to a low-water
mark (a share of the budget), and the turns that follow keep that same start — a byte-identical
prefix — until it overflows again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from .config import ModelSpec
from .errors import ContextTooLarge


@dataclass(frozen=True, slots=True)
class BudgetParts:
    """The parts of the context window, in tokens."""

    context_window: int
    max_output: int
    safety_margin: int
    instructions: int
    query: int
    tools: int

    @property
    def fixed(self) -> int:
        return self.instructions + self.query + self.tools

    @property
    def history(self) -> int:
        """What is left for the history (may be 0, never negative)."""
        return max(0, self.context_window - self.max_output - self.safety_margin - self.fixed)


@dataclass(frozen=True, slots=True)
class ModelLimits:
    """The context window and the answer's reserve that every model that may answer can honour."""

    context_window: int
    max_output: int


def answering_limits(spec: ModelSpec) -> ModelLimits:
    """The limits of a model and its fallbacks together: any of them may answer, so the history must
    fit the smallest window, and the answer is asked for no more tokens than the smallest allows
    (the same `max_tokens` goes to every model of the chain)."""
    chain = spec.chain()
    return ModelLimits(min(m.context_window for m in chain), min(m.max_output_tokens for m in chain))


def history_budget(
    *, context_window: int, max_output: int, safety_margin: int, instructions: int, query: int, tools: int
) -> BudgetParts:
    """The budget, or `context_too_large` naming the part that does not fit when the fixed parts
    alone exceed what the window leaves after the output reserve."""
    parts = BudgetParts(context_window, max_output, safety_margin, instructions, query, tools)
    room = context_window - max_output
    if parts.fixed > room:
        biggest = max((("instructions and context", instructions), ("the query and its files", query),
                       ("the tool definitions", tools)), key=lambda p: p[1])
        raise ContextTooLarge(
            f"the request needs {parts.fixed} tokens before any history ({biggest[0]}: {biggest[1]}), but the "
            f"context window of {context_window} leaves {room} after {max_output} tokens reserved for the answer"
        )
    return parts


@dataclass(frozen=True, slots=True)
class TurnCost:
    """One stored turn of the thread and what it costs, in tokens."""

    message_id: str
    tokens: int


Reason = Literal["all_fit", "prefix_kept", "pruned_to_low_water", "nothing_fits", "no_history"]


@dataclass(frozen=True, slots=True)
class Window:
    """Which turns the model sees: a contiguous run of the newest whole turns."""

    kept: list[str]
    dropped: list[str]
    #: The oldest kept turn: the start the next turn of this branch tries to keep.
    start: str | None
    tokens: int
    reason: Reason
    dropped_tokens: int = 0
    notes: list[str] = field(default_factory=list)


def choose_window(turns: Sequence[TurnCost], *, budget: int, previous_start: str | None,
                  low_water: float) -> Window:
    """The newest whole turns that fit `budget` (`turns` oldest first).

    While the turns from `previous_start` (the start the parent turn used) still fit, they are kept
    as they are, so the prefix the provider cached stays the same; once they overflow, the newest
    turns that fit `low_water * budget` are kept, leaving room to grow again.
    """
    if not turns:
        return Window([], [], None, 0, "no_history")
    ids = [t.message_id for t in turns]
    total = sum(t.tokens for t in turns)
    if previous_start in ids:
        i = ids.index(previous_start)
        kept_tokens = sum(t.tokens for t in turns[i:])
        if kept_tokens <= budget:
            reason: Reason = "all_fit" if i == 0 else "prefix_kept"
            return Window(ids[i:], ids[:i], ids[i], kept_tokens, reason, total - kept_tokens)
    elif total <= budget:
        return Window(ids, [], ids[0], total, "all_fit")
    target = int(budget * low_water)
    start, used = len(turns), 0
    for i in range(len(turns) - 1, -1, -1):
        if used + turns[i].tokens > target:
            break
        start, used = i, used + turns[i].tokens
    if start == len(turns) and turns[-1].tokens <= budget:
        start, used = len(turns) - 1, turns[-1].tokens  # the newest turn alone fits the budget
    if start == len(turns):
        return Window([], ids, None, 0, "nothing_fits", total)
    return Window(ids[start:], ids[:start], ids[start], used, "pruned_to_low_water", total - used)
