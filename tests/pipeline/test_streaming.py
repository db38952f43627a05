"""`pipeline.streaming`: what a running model says becomes turn events — debounced text, tool
events — and no more text streams than the stored answer may hold."""

from __future__ import annotations

from pydantic_ai.messages import PartDeltaEvent, PartStartEvent, TextPart, TextPartDelta

from threadline.pipeline import events
from threadline.pipeline.streaming import TRUNCATED, RunEvents, TextDebouncer


def _text(sent: list[events.Event]) -> str:
    return "".join(e.text for e in sent if isinstance(e, events.TextDelta))


def test_the_first_text_goes_out_at_once_and_the_rest_waits_for_its_window() -> None:
    run = RunEvents("t1", 1, TextDebouncer(window_s=0.1), tool_payload_chars=1000)
    assert _text(run.observe(PartStartEvent(index=0, part=TextPart("Hello")), now=0.0)) == "Hello"
    assert run.observe(PartDeltaEvent(index=0, delta=TextPartDelta(" wor")), now=0.01) == []
    assert run.observe(PartDeltaEvent(index=0, delta=TextPartDelta("ld")), now=0.05) == []
    assert run.tick(now=0.06) == []
    assert _text(run.tick(now=0.2)) == " world"


def test_streamed_text_stops_at_the_size_limit_with_a_marker() -> None:
    run = RunEvents("t1", 1, TextDebouncer(window_s=0.0), tool_payload_chars=10)
    sent = run.observe(PartStartEvent(index=0, part=TextPart("x" * 25)), now=0.0)
    for i in range(5):
        sent += run.observe(PartDeltaEvent(index=0, delta=TextPartDelta("y" * 7)), now=0.01 * i)
    sent += run.flush()
    assert _text(sent) == "x" * 10 + TRUNCATED
