"""The chaos test's checks catch what they look for: a lost, duplicated or gapped turn, a thread out
of order, a duplicated row, a history that is not the earlier queries, usage counted twice, and the
recovery time of a kill. Plain data in, figures out (part of the default suite: no server)."""

from __future__ import annotations

from tests.chaos.figures import (
    Conversation,
    Kill,
    Stamped,
    Stored,
    after,
    entry,
    expected_answer,
    recovery_figures,
    thread_figures,
    turn_figures,
    usage_figures,
)
from threadline.pipeline import events as ev
from threadline.pipeline.contracts import Usage


def accepted(turn_id: str, seq: int) -> ev.Accepted:
    return ev.Accepted(turn_id=turn_id, seq=seq, conversation_id="c-1", message_id=f"m-{turn_id}",
                       parent_message_id=None, config_version="v1")


def succeeded(turn_id: str, seq: int, answer: str = "", tokens: int = 10) -> ev.Succeeded:
    return ev.Succeeded(turn_id=turn_id, seq=seq, answer=answer,
                        usage=Usage(input_tokens=tokens, output_tokens=tokens, requests=1))


def stamped(*events: ev.Event, at_ms: int = 1_000) -> list[Stamped]:
    return [Stamped((at_ms + i * 100, 0), e) for i, e in enumerate(events)]


def test_lost_duplicated_and_gapped_turns_are_counted() -> None:
    figures = turn_figures({
        "ok": stamped(accepted("ok", 1), succeeded("ok", 2)),
        "lost": stamped(accepted("lost", 1)),
        "twice": stamped(accepted("twice", 1), succeeded("twice", 2), succeeded("twice", 3)),
        "gap": stamped(accepted("gap", 1), succeeded("gap", 3)),
        "failed": stamped(accepted("failed", 1), ev.Failed(turn_id="failed", seq=2, code="internal_error", message="")),
    })
    assert (figures["lost"], figures["duplicated"], figures["seq_gaps"]) == (["lost"], ["twice"], ["gap"])
    assert figures["outcomes"] == {"succeeded": 3, "failed:internal_error": 1}


def test_threads_rows_and_histories_are_checked_against_submission_order() -> None:
    c = Conversation(id="c-1", first_turn_id="t1", turns=[("t1", "q1"), ("t2", "q2")])
    right = {"t1": expected_answer(["q1"]), "t2": expected_answer(["q1", "q2"])}
    assert thread_figures([c], {"c-1": Stored(thread=["t1", "t2"], rows=["t1", "t2"])}, right) == {
        "out_of_order": [], "duplicate_rows": [], "history_mismatches": []}

    swapped = thread_figures([c], {"c-1": Stored(thread=["t2", "t1"], rows=["t1", "t2", "t2"])},
                             {"t1": right["t1"], "t2": expected_answer(["q1", "q1", "q2"])})
    assert swapped == {"out_of_order": ["c-1"], "duplicate_rows": ["t2"], "history_mismatches": ["t2"]}


def test_usage_counted_twice_shows() -> None:
    events = {"a": stamped(accepted("a", 1), succeeded("a", 2, tokens=7))}
    once = usage_figures({"turns": 1, "input_tokens": 7, "output_tokens": 7, "requests": 1}, events)
    assert once["turns_counted"] == once["turns_accepted"] == 1
    assert once["tokens_counted"] == once["tokens_in_events"]
    twice = usage_figures({"turns": 2, "input_tokens": 14, "output_tokens": 14, "requests": 2}, events)
    assert twice["turns_counted"] != twice["turns_accepted"]
    assert twice["tokens_counted"] != twice["tokens_in_events"]


def test_a_kill_is_timed_to_the_next_event_of_the_turn_it_held() -> None:
    held = stamped(accepted("t", 1), ev.TextDelta(turn_id="t", seq=2, text="w0 "),
                   ev.Retrying(turn_id="t", seq=3, attempt=2, reason="redelivered"),
                   succeeded("t", 4), at_ms=100_000)
    last_before_kill = "100100-0"
    assert [s.event.seq for s in after(held, last_before_kill)] == [3, 4]
    assert entry("0") == (0, 0) and after(held, "0") == held
    figures = recovery_figures([Kill(at=100.15, pid=1, held={"t": last_before_kill})], None, {"t": held})
    assert figures["kills"] == [{"pid": 1, "held": 1, "next_event_s": [0.05], "terminal_s": [0.15]}]
    assert figures["kill_next_event_s"] == {"min": 0.05, "median": 0.05, "max": 0.05}
