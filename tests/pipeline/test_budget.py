"""`pipeline.budget`: the history budget and which whole turns fit it — properties over any thread."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from threadline.pipeline.budget import TurnCost, choose_window, history_budget
from threadline.pipeline.errors import ContextTooLarge

costs = st.lists(st.integers(min_value=1, max_value=500), max_size=40)
budgets = st.integers(min_value=0, max_value=3000)
low_waters = st.floats(min_value=0.1, max_value=1.0)


def turns(tokens: list[int]) -> list[TurnCost]:
    return [TurnCost(f"t{i}", n) for i, n in enumerate(tokens)]


@given(costs, budgets, low_waters, st.integers(min_value=-1, max_value=40))
def test_the_window_is_the_newest_contiguous_whole_turns_within_the_budget(
        tokens: list[int], budget: int, low_water: float, previous: int) -> None:
    thread = turns(tokens)
    start = thread[previous].message_id if 0 <= previous < len(thread) else None
    window = choose_window(thread, budget=budget, previous_start=start, low_water=low_water)
    ids = [t.message_id for t in thread]
    # never over the budget; a contiguous run ending at the newest turn; dropped + kept = the thread
    assert window.tokens <= budget
    assert window.kept == ids[len(ids) - len(window.kept):]
    assert window.dropped + window.kept == ids
    assert window.tokens == sum(t.tokens for t in thread if t.message_id in window.kept)
    assert window.start == (window.kept[0] if window.kept else None)
    # no history only when even the newest turn alone does not fit
    if thread and not window.kept:
        assert thread[-1].tokens > budget


@given(costs, budgets, low_waters)
def test_without_a_previous_start_everything_is_kept_when_it_fits(tokens: list[int], budget: int,
                                                                  low_water: float) -> None:
    window = choose_window(turns(tokens), budget=budget, previous_start=None, low_water=low_water)
    if sum(tokens) <= budget and tokens:
        assert window.reason == "all_fit" and not window.dropped
    elif tokens and window.reason == "pruned_to_low_water" and len(window.kept) > 1:
        # cut down to the low-water mark, leaving room for the turns that follow
        assert window.tokens <= budget * low_water


def test_the_prefix_stays_while_it_fits_then_is_cut_to_the_low_water_mark() -> None:
    thread = turns([100] * 10)  # 1,000 tokens of history; the budget holds 700
    first = choose_window(thread, budget=700, previous_start=None, low_water=0.5)
    assert (first.reason, first.start, len(first.kept)) == ("pruned_to_low_water", "t7", 3)  # 300 <= 350
    grown = [*thread, *(TurnCost(f"t{i}", 100) for i in range(10, 14))]
    kept = choose_window(grown, budget=700, previous_start=first.start, low_water=0.5)
    assert (kept.reason, kept.start, kept.tokens) == ("prefix_kept", "t7", 700)  # the same prefix, now full
    overflow = choose_window([*grown, TurnCost("t14", 100)], budget=700, previous_start=kept.start, low_water=0.5)
    assert (overflow.reason, overflow.start) == ("pruned_to_low_water", "t12")


def test_a_prefix_from_another_branch_is_ignored() -> None:
    window = choose_window(turns([100, 100]), budget=1000, previous_start="elsewhere", low_water=0.7)
    assert (window.reason, window.start) == ("all_fit", "t0")


def test_the_budget_is_what_the_window_leaves_after_the_fixed_parts() -> None:
    parts = history_budget(context_window=2000, max_output=200, safety_margin=100, instructions=300, query=50,
                           tools=40)
    assert parts.history == 2000 - 200 - 100 - 300 - 50 - 40
    assert history_budget(context_window=2000, max_output=200, safety_margin=500, instructions=1300, query=0,
                          tools=0).history == 0  # the margin may leave nothing for history: no history, no error


def test_fixed_parts_over_the_window_fail_context_too_large_naming_the_part() -> None:
    with pytest.raises(ContextTooLarge, match="instructions and context: 2500") as caught:
        history_budget(context_window=2000, max_output=200, safety_margin=0, instructions=2500, query=10, tools=10)
    assert caught.value.code == "context_too_large"
