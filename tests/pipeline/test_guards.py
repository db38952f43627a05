"""`pipeline.guards`: which rule a text breaks (keywords, sentence patterns, annotation replies), how
strictly configs are validated, and the stream's hold-back: no text that is part of a match is
ever released, however the text arrives."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from pydantic_ai import CancellationToken, models
from pydantic_ai.messages import (
    ModelMessage,
    ModelMessagesTypeAdapter,
    ModelRequest,
    ModelResponse,
    PartDeltaEvent,
    PartStartEvent,
    TextPart,
    TextPartDelta,
    UserPromptPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel

from threadline.pipeline import events
from threadline.pipeline.config import AgentConfig, GuardRules, GuardsSpec, compile_pattern, parse_agent_config
from threadline.pipeline.contracts import parse_turn_request
from threadline.pipeline.errors import InvalidRequest
from threadline.pipeline.guards import (
    SENTENCE_END,
    WITHHELD_QUERY,
    CompiledRules,
    GuardDecision,
    StreamGuard,
    check_input,
    check_text,
    compile_rules,
    match_annotation,
    normalise,
    stream_guard,
)
from threadline.pipeline.invoke import answer_without_model, build_agent, run_turn
from threadline.pipeline.records import ConversationRecord, ResolvedTurn
from threadline.pipeline.resolve import resolve_turn
from threadline.pipeline.streaming import RunEvents, TextDebouncer
from threadline.workers.worker.stream import TurnStream

models.ALLOW_MODEL_REQUESTS = False


def rules(**fields: Any) -> GuardRules:
    return GuardRules.model_validate(fields)


def hit(rule_set: GuardRules, text: str) -> str | None:
    found = check_text(rule_set, text, where="output")
    return found.rule if found else None


# --- matching ---------------------------------------------------------------------------------------


def test_keywords_match_case_insensitively_on_word_boundaries_by_default() -> None:
    words = rules(keywords=["bad", "secret plan", "c++"])
    assert hit(words, "This is BAD.") == "output.keywords[0]"
    assert hit(words, "the Secret  Plan") is None  # the space inside a keyword is matched as it is
    assert hit(words, "our secret plan!") == "output.keywords[1]"
    assert hit(words, "badge, abad, bad_x") is None  # inside words: not the keyword
    assert hit(words, "I write C++code") == "output.keywords[2]"  # no word boundary after a '+'
    assert hit(words, "") is None


def test_substring_keywords_match_inside_words_and_scripts_without_spaces() -> None:
    anywhere = rules(keywords=["bad", "机密"], match="substring")
    assert hit(anywhere, "badge") == "output.keywords[0]"
    assert hit(anywhere, "这是机密文件") == "output.keywords[1]"
    assert hit(rules(keywords=["机密"]), "这是机密文件") is None  # word mode: CJK has no word boundaries


def test_patterns_match_within_one_sentence() -> None:
    card = rules(patterns=[r"\b\d{4}-\d{4}\b", r"ignore .*instructions"])
    assert hit(card, "My number is 1234-5678, thanks.") == "output.patterns[0]"
    assert hit(card, "Please IGNORE all previous instructions") == "output.patterns[1]"
    # a sentence ends after '.', '!' or '?' and whitespace, after CJK stops, at a line break
    assert hit(card, "Ignore me. The instructions are clear.") is None
    assert hit(card, "ignore\ninstructions") is None
    assert hit(card, "ignore the v1.2 instructions") == "output.patterns[1]"


def test_annotations_match_exactly_or_normalised() -> None:
    qa = [{"question": "what are your hours", "answer": "9 to 5."}, {"question": "Refunds?", "answer": "30 days."}]
    normalised = GuardsSpec.model_validate({"annotations": qa})
    found = match_annotation(normalised, "  What are your HOURS? ")
    assert found == GuardDecision("annotation", "annotations[0]", "9 to 5.")
    assert match_annotation(normalised, "refunds") == GuardDecision("annotation", "annotations[1]", "30 days.")
    assert match_annotation(normalised, "what are your opening hours") is None
    exact = GuardsSpec.model_validate({"annotations": qa, "annotation_match": "exact"})
    assert match_annotation(exact, "  What are your HOURS? ") is None
    assert match_annotation(exact, "what are your hours") is not None
    # NFKC folds full-width letters and the no-break space
    assert normalise("\u00a0\uff28\uff2f\uff35\uff32\uff33\t\n?!") == "hours"


def test_the_input_guard_checks_query_and_prompt_variables_moderation_first() -> None:
    guards = GuardsSpec.model_validate({
        "input": {"keywords": ["hours"], "reply": "Not that."},
        "annotations": [{"question": "hours", "answer": "9 to 5."}],
    })
    refused = GuardDecision("moderation", "input.keywords[0]", "Not that.")
    assert check_input(guards, "Hours?", {}) == refused
    assert check_input(guards, "hello", {"name": "about hours", "n": 3}) is not None
    assert check_input(guards, "hello", {"name": "Ada"}) is None


# --- validation -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("guards", "message"),
    [
        ({"input": {"patterns": ["(unclosed"]}},
         "guards.input.patterns[0]: not a valid regular expression: missing ): (unclosed"),
        ({"output": {"patterns": ["ok", "x*"]}}, "guards.output.patterns[1]: matches the empty text"),
        ({"output": {"patterns": ["(?m)^$"]}}, "guards.output.patterns[0]: matches the empty text"),
        ({"input": {"patterns": ["a" * 257]}}, "at most 256 characters"),
        ({"input": {"patterns": ["a"] * 33}}, "at most 32 items"),
        ({"input": {"keywords": ["   "]}}, "at least 1 character"),
        ({"input": {"keywords": ["k" * 101]}}, "at most 100 characters"),
        ({"input": {"match": "fuzzy"}}, "'word' or 'substring'"),
        ({"input": {"reply": ""}}, "at least 1 character"),
        ({"input": {"block": ["x"]}}, "guards.input.block: Extra inputs are not permitted"),
        ({"annotation_match": "embedding"}, "'exact' or 'normalised'"),
        ({"annotations": [{"question": "q"}]}, "guards.annotations[0].answer: Field required"),
    ],
)
def test_invalid_guards_are_refused_with_a_clear_error(guards: dict[str, Any], message: str) -> None:
    document = {"id": "bot", "model": "offline:echo", "guards": guards}
    with pytest.raises(InvalidRequest) as refused:
        parse_agent_config(json.dumps(document))
    assert message in refused.value.message


NO_BACKTRACKING = "RE2 cannot run this pattern (it supports no backreferences or lookarounds)"


@pytest.mark.parametrize(
    ("pattern", "message"),
    [
        (r"(\w+) \1", f"{NO_BACKTRACKING}: invalid escape sequence: \\1"),  # a backreference
        (r"(?P<w>\w+) (?P=w)", f"{NO_BACKTRACKING}: invalid perl operator: (?P"),  # named
        (r"(?<=card )\d+", f"{NO_BACKTRACKING}: invalid perl operator: (?<="),  # lookbehind
        (r"(?<!no )card", f"{NO_BACKTRACKING}: invalid perl operator: (?<!"),
        (r"card(?= number)", f"{NO_BACKTRACKING}: invalid perl operator: (?="),  # lookahead
        (r"card(?! game)", f"{NO_BACKTRACKING}: invalid perl operator: (?!"),
        (r"\d++-", f"{NO_BACKTRACKING}: bad repetition operator: ++"),  # possessive
        (r"(?>\d+)-", f"{NO_BACKTRACKING}: invalid perl operator: (?>"),  # atomic group
        (r"secret\Z", "RE2 cannot run this pattern (it spells the end of the text \\z): invalid escape sequence: \\Z"),
        (r"x{1001}", "(it repeats at most 1000 times, nested counts multiplied): invalid repetition size: {1001}"),
        (r"(?:x{100}){11}", "invalid repetition size: {11}"),
        (r"\pL{500}", "(its compiled program is larger than RE2 allows): pattern too large - compile failed"),
        (r"(?<=a", "not a valid regular expression: "),  # broken for every engine: not an RE2 refusal
    ],
)
def test_a_pattern_re2_cannot_run_is_refused_at_validation_naming_its_place(pattern: str, message: str) -> None:
    document = {"id": "bot", "model": "offline:echo", "guards": {"output": {"patterns": [r"\bok\b", pattern]}}}
    with pytest.raises(InvalidRequest) as refused:
        parse_agent_config(json.dumps(document))
    line = refused.value.message
    assert "\n" not in line and line.startswith("invalid agent config: guards.output.patterns[1]: "), line
    assert message in line, line


@pytest.mark.parametrize("pattern", [r"(a+)+$", r"(a|aa)+$", r"(x+x+)+y", r"\p{L}+ \p{Nd}{3}", r"secret\z",
                                     r"(?P<card>\d{4})-\d{4}", r"[[:alpha:]]+!", r"(?s)begin.end"])
def test_patterns_re2_runs_are_accepted_catastrophic_ones_included(pattern: str) -> None:
    assert GuardRules.model_validate({"patterns": [pattern]}).patterns == (pattern,)


def test_guards_survive_the_stored_config_round_trip() -> None:
    config = AgentConfig.model_validate({"id": "bot", "model": "offline:echo", "guards": {
        "input": {"keywords": ["bad"], "reply": "No."}, "annotations": [{"question": "q", "answer": "a"}]}})
    again = AgentConfig.model_validate_json(config.model_dump_json())
    assert again.guards == config.guards and hash(again.guards.input) == hash(config.guards.input)
    with pytest.raises(ValidationError):
        GuardRules.model_validate({"keywords": ["x"] * 501})


# --- the stream's hold-back -------------------------------------------------------------------------

WORD_RULES = rules(keywords=["bad", "top secret"])
SUBSTRING_RULES = rules(keywords=["bad", "top secret"], match="substring")
PATTERN_RULES = rules(keywords=["bad"], patterns=[r"\d{3}-\d{3}"])
PIECES = ["bad", "Bad", "badge", "top", " secret", "top secret", " ", ".", ". ", "!", "\n", "x", "ok", "12", "3-4",
          "56", "é"]


def first_match_start(rule_set: GuardRules, text: str) -> int | None:
    """Where the first match of `rule_set` in the whole `text` starts (a pattern's: its sentence's start)."""
    compiled = compile_rules(rule_set, "output")
    starts = []
    if compiled.keywords is not None and (m := compiled.keywords.search(text)):
        starts.append(m.start())
    start = 0
    for boundary in [*SENTENCE_END.finditer(text), None]:
        end = boundary.end() if boundary else len(text)
        if compiled.sentence_rule(text[start:end]) is not None:
            starts.append(start)
            break
        start = end
    return min(starts, default=None)


def stream(rule_set: GuardRules, chunks: list[str]) -> tuple[list[str], StreamGuard]:
    guard = StreamGuard(compile_rules(rule_set, "output"))
    released = [guard.feed(c) for c in chunks]
    return [*released, guard.finish()], guard


def split(text: str, cuts: list[int]) -> list[str]:
    points = sorted({min(c, len(text)) for c in cuts})
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]


@settings(max_examples=400, deadline=None)
@given(st.sampled_from([WORD_RULES, SUBSTRING_RULES, PATTERN_RULES]),
       st.lists(st.sampled_from(PIECES), max_size=14), st.lists(st.integers(0, 80), max_size=10))
@example(WORD_RULES, ["x ", "bad"], [3])  # a keyword completed by the last chunk is only known at the end
@example(WORD_RULES, ["bad", "ge"], [2])  # "ba" + "dge": never the keyword
@example(PATTERN_RULES, ["12", "3-4", "56", ". ", "ok"], [1, 4, 6])  # a pattern across chunks
def test_no_released_text_is_part_of_a_match_whatever_the_chunks(
    rule_set: GuardRules, pieces: list[str], cuts: list[int]
) -> None:
    text = "".join(pieces)
    released, guard = stream(rule_set, split(text, cuts))
    emitted = "".join(released)
    whole = check_text(rule_set, text, where="output")
    assert text.startswith(emitted)
    assert (guard.hit is None) == (whole is None)  # a stream is refused exactly when the whole text is
    start = first_match_start(rule_set, text)
    if start is None:
        assert emitted == text
    else:
        assert len(emitted) <= start
        assert check_text(rule_set, emitted, where="output") is None or rule_set.match == "word"
    if rule_set.match == "substring":
        assert not any(k in emitted.lower() for k in rule_set.keywords)


def test_text_is_held_back_only_as_far_as_a_match_could_reach() -> None:
    released, _ = stream(WORD_RULES, ["Hello there, ", "how are you", " today?"])
    # "top secret" is 10 characters: the last 10 stay back until the end
    assert released == ["Hel", "lo there, h", "ow are ", "you today?"]
    sentences, _ = stream(PATTERN_RULES, ["One. Two", " three. Fo", "ur"])
    # patterns: nothing past the last finished sentence; the keyword "bad" keeps 3 more back
    assert sentences == ["One. ", "Two three.", " ", "Four"]


def test_run_events_stream_no_forbidden_text_and_stop_at_a_hit() -> None:
    guards = GuardsSpec.model_validate({"output": {"keywords": ["password"], "reply": "Withheld."}})
    run = RunEvents("t1", 1, TextDebouncer(window_s=0.0), tool_payload_chars=1000,
                    guard=stream_guard(guards))
    sent = run.observe(PartStartEvent(index=0, part=TextPart("Your pass")), now=0.0)
    for i, chunk in enumerate(["word is", " hunter2", " and more"]):
        sent += run.observe(PartDeltaEvent(index=0, delta=TextPartDelta(chunk)), now=0.01 * i)
    sent += run.end(now=1.0)
    text = "".join(e.text for e in sent if isinstance(e, events.TextDelta))
    assert text == "Your "[: len(text)] and "pass" not in text
    assert run.guard is not None and run.guard.hit is not None and run.guard.hit.rule == "output.keywords[0]"


# --- turns ------------------------------------------------------------------------------------------

GUARDS = {"input": {"keywords": ["forbidden"], "reply": "I can't discuss that."},
          "output": {"keywords": ["password"], "reply": "[answer withheld]"},
          "annotations": [{"question": "what are your hours", "answer": "9 to 5, Monday to Friday."}]}
CONFIG = AgentConfig.model_validate({"id": "bot", "model": "offline:echo", "guards": GUARDS})


def resolve(query: str, **fields: Any) -> ResolvedTurn:
    request = parse_turn_request({"schema": "threadline.turn/v1", "tenant_id": "t", "app_id": "a", "user_id": "u",
                                  "agent_id": "bot", "query": query, **fields},
                                 fallback_turn_id="t1", max_query_chars=1000)
    conversation = None
    if "deferred_tool_results" in fields:
        conversation = ConversationRecord(id="c1", tenant_id="t", app_id="a", user_id="u", agent_id="bot",
                                          config_ref="v1", layers=["history"], tip="m1",
                                          pending_tool_calls=[{"tool_call_id": "call1", "name": "ask_human",
                                                               "args": {}}])
    resolved, decision = resolve_turn(request, conversation=conversation, config=CONFIG, config_ref="v1",
                                      new_conversation_id="c1", now=1_700_000_000.0)
    assert decision.guard == resolved.guard
    return resolved


def test_resolve_records_the_input_guards_verdict_and_skips_a_resume() -> None:
    assert resolve("Tell me the FORBIDDEN thing").guard == GuardDecision("moderation", "input.keywords[0]",
                                                                         "I can't discuss that.")
    assert resolve("What are your hours?").guard == GuardDecision("annotation", "annotations[0]",
                                                                  "9 to 5, Monday to Friday.")
    assert resolve("hello").guard is None
    resumed = resolve("", conversation_id="c1", deferred_tool_results={"calls": {"call1": "the forbidden one"}})
    assert resumed.guard is None


def test_a_guarded_turn_is_answered_without_a_model_and_a_refused_query_stays_out_of_history() -> None:
    refused = answer_without_model(resolve("the forbidden word"))
    assert (refused.status, refused.answer) == ("succeeded", "I can't discuss that.")
    assert refused.guard == {"kind": "moderation", "rule": "input.keywords[0]"}
    assert refused.snapshot is not None and "forbidden" not in refused.snapshot
    request, response = ModelMessagesTypeAdapter.validate_json(refused.snapshot)
    assert isinstance(request, ModelRequest) and isinstance(response, ModelResponse)
    assert request.parts == [UserPromptPart(WITHHELD_QUERY, timestamp=request.parts[0].timestamp)]
    answered = answer_without_model(resolve("what are your hours"))
    assert answered.snapshot is not None and "what are your hours" in answered.snapshot
    assert answered.guard == {"kind": "annotation", "rule": "annotations[0]"}


def test_the_output_guard_replaces_the_answer_in_events_outcome_and_snapshot() -> None:
    async def speak(messages: list[ModelMessage], info: AgentInfo) -> AsyncIterator[str]:
        for chunk in ["Sure, the pass", "word is hun", "ter2. Keep it safe."]:
            yield chunk

    async def run() -> tuple[Any, list[events.Event]]:
        sink: list[events.Event] = []

        async def emit(event: events.Event) -> None:
            sink.append(event)

        turn = resolve("what is it?")
        translator = RunEvents("t1", 1, TextDebouncer(window_s=0.0), tool_payload_chars=10_000,
                               guard=stream_guard(turn.config.guards))
        async with TurnStream(translator, emit, time.monotonic) as stream_:
            outcome = await run_turn(turn, [], agent=build_agent(FunctionModel(stream_function=speak)), attempt=1,
                                     stream=stream_, token=CancellationToken(), clock=lambda: 0.0, timeout_s=10,
                                     max_chars=10_000)
        return outcome, sink

    outcome, sent = asyncio.run(run())
    assert (outcome.status, outcome.answer) == ("succeeded", "[answer withheld]")
    assert outcome.guard == {"kind": "moderation", "rule": "output.keywords[0]"}
    streamed = "".join(e.text for e in sent if isinstance(e, events.TextDelta))
    assert streamed == "Sure, "  # "password" is 8 characters: "the pass" was held back
    for forbidden in ("password", "hunter2"):
        assert not any(forbidden in e.model_dump_json() for e in sent)
        assert outcome.snapshot is not None and forbidden not in outcome.snapshot
    assert "[answer withheld]" in outcome.snapshot and re.search("what is it", outcome.snapshot)


# --- RE2: linear work, whatever the pattern -------------------------------------------------------


def test_a_catastrophic_pattern_gives_the_right_answer_on_a_long_text() -> None:
    # `(a+)+$` backtracks catastrophically: on Python's `re` the first search below would not end in
    # the lifetime of the worker (nor of the test's timeout); RE2 never backtracks
    rules = GuardRules.model_validate({"patterns": [r"(a+)+$"], "reply": "Refused."})
    assert check_text(rules, "a" * 100_000 + "b", where="input") is None
    hit = check_text(rules, "a" * 100_000, where="input")
    assert hit == GuardDecision("moderation", "input.patterns[0]", "Refused.")
    assert hit.record() == {"guard": {"kind": "moderation", "rule": "input.patterns[0]"}}  # nothing timed out
    nested = GuardRules.model_validate({"patterns": [r"(a|aa)+$", r"(x+x+)+y"]})
    assert check_text(nested, " ".join(["a" * 22 + "!"] * 2000) + " " + "x" * 50_000, where="output") is None


def test_the_two_card_patterns_pass_a_long_benign_answer_and_find_a_planted_one() -> None:
    rules = GuardRules.model_validate({"patterns": [r"\bcredit\s+card\s+number\b", r"\d{4}-\d{4}-\d{4}-\d{4}"]})
    text = "The order shipped today and the invoice is attached. " * 1500  # ~80,000 characters
    assert check_text(rules, text, where="output") is None
    assert hit(rules, text + "My credit  card NUMBER is here.") == "output.patterns[0]"
    assert hit(rules, text + "Pay with 4111-1111-1111-1111 now.") == "output.patterns[1]"


class CountingPattern:
    """A compiled pattern that counts the bytes it is asked to search: the guard's work."""

    def __init__(self, pattern: str) -> None:
        self.compiled = compile_pattern(pattern)
        self.searched = 0
        self.searches = 0

    def search(self, text: str | bytes) -> object | None:
        self.searched += len(text)
        self.searches += 1
        return self.compiled.search(text)


def counting_rules(rule_set: GuardRules) -> tuple[CompiledRules, list[CountingPattern]]:
    counters = [CountingPattern(p) for p in rule_set.patterns]
    compiled = CompiledRules(where="output", rules=rule_set, keywords=None, longest=0, patterns=tuple(counters))
    return compiled, counters


@pytest.mark.parametrize("chunk", [None, 1, 7, 4096])
def test_every_sentence_is_searched_once_alone_so_the_work_is_linear_in_the_text(chunk: int | None) -> None:
    # a search per sentence per pattern, each over that sentence only: ~80,000 bytes searched per
    # pattern however the text streams (searching from the text's start to each sentence's end would
    # search ~60 million)
    rule_set = rules(patterns=[r"\bcredit\s+card\s+number\b", r"\d{4}-\d{4}-\d{4}-\d{4}"])
    text = "The order shipped today, the invoice is attached. Thanks!\n" * 1400
    compiled, counters = counting_rules(rule_set)
    guard = StreamGuard(compiled)
    pieces = [text] if chunk is None else [text[i : i + chunk] for i in range(0, len(text), chunk)]
    released = "".join([guard.feed(p) for p in pieces]) + guard.finish()
    assert guard.hit is None and released == text
    sentences = len(list(SENTENCE_END.finditer(text)))
    assert sentences == 2 * 1400
    for counter in counters:
        assert (counter.searches, counter.searched) == (sentences, len(text.encode()))


def test_a_pattern_never_matches_across_a_sentence_end() -> None:
    spans = rules(patterns=[r"ignore.*instructions"])
    assert hit(spans, "Ignore me. The instructions are clear. Thanks.") is None
    assert hit(spans, "Ignore me.\nThe instructions are clear.\nThanks.") is None
    assert hit(spans, "First. Now ignore the instructions. Thanks.") == "output.patterns[0]"


# --- RE2's syntax and classes, as the docs state them ---------------------------------------------


def test_re2_classes_are_ascii_and_case_folding_covers_every_script() -> None:
    fullwidth = "\uff13\uff14\uff15"
    assert hit(rules(patterns=[r"\d{3}"]), f"call ٣٤٥ or {fullwidth}") is None  # `\d` is ASCII on RE2
    assert hit(rules(patterns=[r"\p{Nd}{3}"]), f"call {fullwidth}") == "output.patterns[0]"  # any script's digits
    assert hit(rules(patterns=[r"\w+ist"]), "éist") is None  # `\w` is ASCII: `é` is no word character
    assert hit(rules(patterns=[r"\p{L}+ist"]), "éist") == "output.patterns[0]"
    assert hit(rules(patterns=[r"\bcard\b"]), "écard") == "output.patterns[0]"  # so `\b` sees one before `c`
    assert hit(rules(patterns=[r"\s"]), "no\u00a0break") is None  # `\s` is ASCII whitespace
    # case-insensitive in every script, as Python's `re` is
    assert hit(rules(patterns=["straße"]), "STRAẞE") == "output.patterns[0]"
    assert hit(rules(patterns=["σοφία"]), "ΣΟΦΊΑ") == "output.patterns[0]"
    assert hit(rules(patterns=["äpfel"]), "ÄPFEL") == "output.patterns[0]"


def test_anchors_mark_the_sentence_and_dollar_matches_before_its_line_break() -> None:
    anchored = rules(patterns=[r"^ok\b", r"secret$"])
    assert hit(anchored, "Fine. OK then.") == "output.patterns[0]"  # each sentence starts a text
    assert hit(anchored, "Fine. not ok") is None
    assert hit(anchored, "it is a secret\nnext line") == "output.patterns[1]"  # as Python's `$` before a final \n
    assert hit(anchored, "it is a secret") == "output.patterns[1]"
    assert hit(anchored, "a secret. Next") is None  # the sentence is "a secret. ": `$` is after the space


def test_a_lone_surrogate_is_searched_as_a_character() -> None:
    card = rules(patterns=[r"\d{4}-\d{4}", r"a.b"])
    assert hit(card, "x \ud800 1234-5678") == "output.patterns[0]"
    assert hit(card, "a\udfffb") == "output.patterns[1]"
    assert hit(card, "\ud800" * 10) is None


# --- properties: the verdict is each sentence's alone, and nothing of a match is released ---------

#: Patterns that can reach across a sentence end (`.*`) or rely on its edges (`^`, `$`, `\b`).
SENTENCE_RULES = rules(patterns=[r"top.*secret", r"^ok\b", r"\bbad$", r"\d{3}-\d{3}"])
SENTENCE_PIECES = ["top", " secret", "ok", "OK", "bad", " ", ". ", "! ", "? ", ".", "\n", "x", "12", "3-4", "56",
                   "é", "\u3002"]


def reference_rule(rule_set: GuardRules, text: str) -> str | None:
    """The first sentence's first matching pattern, by Python's `re` on each sentence alone
    (case-insensitive; multi-line: a sentence's only line break is its last character; ASCII
    classes, as RE2's)."""
    start = 0
    for end in [*(b.end() for b in SENTENCE_END.finditer(text)), len(text)]:
        sentence = text[start:end]
        for i, pattern in enumerate(rule_set.patterns):
            if sentence and re.search(pattern, sentence, re.IGNORECASE | re.MULTILINE | re.ASCII):
                return f"output.patterns[{i}]"
        start = end
    return None


@settings(max_examples=400, deadline=None)
@given(st.lists(st.sampled_from(SENTENCE_PIECES), max_size=16), st.lists(st.integers(0, 80), max_size=10))
@example(["top", ". ", " secret"], [])  # across a sentence end: no match
@example(["ok", ". ", "ok"], [4])  # the second sentence starts a text too
@example(["x", ". ", "bad", "\n", "x"], [1, 5])
def test_the_verdict_is_the_first_sentence_alone_that_matches_whatever_the_chunks(
    pieces: list[str], cuts: list[int]
) -> None:
    text = "".join(pieces)
    expected = reference_rule(SENTENCE_RULES, text)
    assert hit(SENTENCE_RULES, text) == expected
    released, guard = stream(SENTENCE_RULES, split(text, cuts))
    assert (guard.hit.rule if guard.hit else None) == expected
    emitted = "".join(released)
    if expected is None:
        assert emitted == text
    else:  # nothing of the matching sentence went out
        start = first_match_start(SENTENCE_RULES, text)
        assert start is not None and len(emitted) <= start


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=".!?\n\t \u00a0\u3002\uff01\uff1f\u2028ab", max_size=30), st.integers(0, 30))
def test_sentence_ends_are_exactly_the_documented_ones(text: str, pos: int) -> None:
    documented = re.compile("[.!?]\\s|[\u3002\uff01\uff1f\n]")
    assert [m.end() for m in SENTENCE_END.finditer(text, pos)] == [m.end() for m in documented.finditer(text, pos)]
