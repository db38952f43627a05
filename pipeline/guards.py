"""Input and output guards: which rule of an agent's `guards` a text breaks, and what is said instead.

Moderation rules (`GuardRules`) are keywords and regular expressions. Keywords match
case-insensitively, on word boundaries or as substrings; patterns match within one sentence (text
is cut after `.`, `!`, `?` followed by whitespace, after CJK full stops and at line breaks), which is what
lets a stream be released sentence by sentence. One checker, `StreamGuard`, serves both the
stream and whole texts, so a text refused whole is refused however it was streamed.

Decisions name their rule by its place in the config (`input.keywords[2]`), never by its text: the
decision record travels on events and rows, where a forbidden word must not appear.

Patterns run on RE2 (`pipeline.config.compile_pattern`), which never backtracks: a search takes time
linear in the sentence whatever the pattern, so `(a+)+$` on a long run of `a`s (which takes Python's
`re` longer than the universe has) costs what any pattern costs, and a check costs the same work on
a loaded machine as on an idle one. No search has a time budget, none can time out, and a verdict
never depends on the clock; the patterns RE2 cannot run (backreferences, lookarounds) are refused
when the config is validated. Unlike Python's, RE2's `\\d`, `\\w`, `\\s` and `\\b` are ASCII (`\\p{Nd}`,
`\\p{L}` name the Unicode classes); case-insensitivity folds every script.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from functools import lru_cache
from typing import Any, Literal

from pydantic_ai.messages import (
    ModelMessage,
    ModelRequest,
    ModelResponse,
    ModelResponsePart,
    TextPart,
    ThinkingPart,
    UserPromptPart,
)

from .config import CompiledPattern, GuardRules, GuardsSpec, compile_pattern

GuardKind = Literal["moderation", "annotation"]

#: Where a sentence ends: after `.`, `!` or `?` followed by whitespace, after CJK full stops, at a line break.
#: (That is `[.!?]\s|[\u3002\uff01\uff1f\n]`, spelt to start with one character class: `re` then skips to
#: the candidates, in a third of the time per text.)
SENTENCE_END = re.compile("[.!?\u3002\uff01\uff1f\n](?:(?<=[.!?])\\s|(?<![.!?]))")
_SURROGATE = re.compile("[\ud800-\udfff]")

#: What a later turn's history holds in place of a query the input guard refused.
WITHHELD_QUERY = "[this message was withheld by a moderation rule]"


@dataclass(frozen=True, slots=True)
class GuardDecision:
    """A guard's verdict: which rule (by its place in the config) and the answer given instead."""

    kind: GuardKind
    rule: str
    reply: str

    def record(self) -> dict[str, Any]:
        """The decision record stored with the turn (the reply is its answer already)."""
        return {"guard": {"kind": self.kind, "rule": self.rule}}


# --- compiled rules ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CompiledRules:
    where: str
    rules: GuardRules
    #: One alternation of every keyword, longest first; None without keywords.
    keywords: re.Pattern[str] | None
    #: The longest keyword: a match ending in unseen text starts at most this far back.
    longest: int
    patterns: tuple[CompiledPattern, ...]

    def keyword_rule(self, matched: str) -> str:
        for i, keyword in enumerate(self.rules.keywords):
            if re.fullmatch(re.escape(keyword), matched, re.IGNORECASE):
                return f"{self.where}.keywords[{i}]"
        return f"{self.where}.keywords"  # unreachable: the alternation is made of these keywords

    def sentence_rule(self, sentence: str) -> str | None:
        """The first pattern found in `sentence`, or None."""
        # RE2 searches UTF-8: encoded once here, not by every search
        try:
            data = sentence.encode()
        except UnicodeEncodeError:  # a lone surrogate (JSON allows them): U+FFFD, no letter, digit or space either
            data = _SURROGATE.sub("\ufffd", sentence).encode()
        for i, pattern in enumerate(self.patterns):
            if pattern.search(data) is not None:
                return f"{self.where}.patterns[{i}]"
        return None


@lru_cache(maxsize=256)
def compile_rules(rules: GuardRules, where: str) -> CompiledRules:
    """`rules` ready to check (cached: a config's rules are compiled once per process)."""
    return CompiledRules(
        where=where,
        rules=rules,
        keywords=_keyword_regex(rules.keywords, whole_words=rules.match == "word") if rules.keywords else None,
        longest=max((len(k) for k in rules.keywords), default=0),
        patterns=tuple(compile_pattern(p) for p in rules.patterns),
    )


def _keyword_regex(keywords: Sequence[str], *, whole_words: bool) -> re.Pattern[str]:
    alternatives = []
    for keyword in sorted(set(keywords), key=len, reverse=True):
        body = re.escape(keyword)
        if whole_words:
            # a boundary only where the keyword has a word character at that end ("c++" ends in none)
            body = (r"(?<!\w)" if _is_word(keyword[0]) else "") + body + (r"(?!\w)" if _is_word(keyword[-1]) else "")
        alternatives.append(body)
    return re.compile("|".join(alternatives), re.IGNORECASE)


def _is_word(char: str) -> bool:
    return re.match(r"\w", char) is not None


# --- the checker ------------------------------------------------------------------------------------


class StreamGuard:
    """Releases streamed text only up to the point that can no longer be part of a match: without
    patterns, all but the last `longest` characters (a keyword match that ends in text not seen yet
    starts there at the earliest; a word-boundary match at the very end waits for the next
    character); with patterns, nothing past the last finished sentence. After a hit it releases
    nothing more, and `hit` says which rule."""

    def __init__(self, rules: CompiledRules) -> None:
        self._rules = rules
        self._text = ""  # the text from absolute position `_base` on
        self._base = 0
        self._released = 0  # absolute: text before this was released
        self._scan = 0  # absolute: no keyword match starts before this
        self._checked = 0  # absolute: the sentences before this passed the patterns
        self.hit: GuardDecision | None = None

    def feed(self, text: str) -> str:
        """Take the next chunk; return the text that is safe to send now."""
        if self.hit is not None or not text:
            return ""
        self._text += text
        return self._advance(final=False)

    def finish(self) -> str:
        """The end of the text: the rest, unless it completes a match."""
        return "" if self.hit is not None else self._advance(final=True)

    def _advance(self, *, final: bool) -> str:
        end = self._base + len(self._text)
        safe = end
        rules = self._rules
        if rules.keywords is not None:
            found = rules.keywords.search(self._text, self._scan - self._base)
            # a match that reaches the end of the text so far may still be undone by the next character
            if found is not None and (final or found.end() < len(self._text)):
                return self._stop(rules.keyword_rule(found.group()))
            self._scan = self._base + found.start() if found else max(self._released, end - rules.longest)
            safe = self._scan
        if rules.patterns:
            if (broken := self._check_sentences(final=final)) is not None:
                return self._stop(broken)
            safe = min(safe, self._checked)
        return self._release(end if final else max(safe, self._released))

    def _check_sentences(self, *, final: bool) -> str | None:
        start = self._checked - self._base
        ends = [b.end() for b in SENTENCE_END.finditer(self._text, start)]
        if final and (ends[-1] if ends else start) < len(self._text):
            ends.append(len(self._text))
        for end in ends:  # each sentence alone, from the end of the one before
            if (found := self._rules.sentence_rule(self._text[start:end])) is not None:
                return found
            start = end
        self._checked = self._base + start
        return None

    def _release(self, upto: int) -> str:
        out = self._text[self._released - self._base : upto - self._base]
        self._released = upto
        # one released character stays: a word boundary at the next match's start looks back at it
        keep = max(self._base, upto - 1)
        self._text = self._text[keep - self._base :]
        self._base = keep
        return out

    def _stop(self, rule: str) -> str:
        self.hit = GuardDecision("moderation", rule, self._rules.rules.reply)
        self._text = ""
        return ""




def check_text(rules: GuardRules, text: str, *, where: Literal["input", "output"]) -> GuardDecision | None:
    """The moderation rule `text` breaks, or None (exactly what a stream of it would find)."""
    if not rules.active or not text:
        return None
    guard = StreamGuard(compile_rules(rules, where))
    guard.feed(text)
    guard.finish()
    return guard.hit


def stream_guard(guards: GuardsSpec) -> StreamGuard | None:
    """The hold-back for an agent's streamed answers, or None when it has no output rules."""
    return StreamGuard(compile_rules(guards.output, "output")) if guards.output.active else None


# --- input ------------------------------------------------------------------------------------------


def normalise(text: str) -> str:
    """For `normalised` annotation matching: NFKC, casefold, whitespace collapsed, punctuation
    stripped at both ends."""
    folded = " ".join(unicodedata.normalize("NFKC", text).casefold().split())
    start, end = 0, len(folded)
    while start < end and _strippable(folded[start]):
        start += 1
    while end > start and _strippable(folded[end - 1]):
        end -= 1
    return folded[start:end]


def _strippable(char: str) -> bool:
    return char.isspace() or unicodedata.category(char).startswith("P")


@lru_cache(maxsize=256)
def _annotation_index(guards: GuardsSpec) -> Mapping[str, int]:
    normalised = guards.annotation_match == "normalised"
    index: dict[str, int] = {}
    for i, annotation in enumerate(guards.annotations):
        # the first of equal questions answers
        index.setdefault(normalise(annotation.question) if normalised else annotation.question, i)
    return index


def match_annotation(guards: GuardsSpec, query: str) -> GuardDecision | None:
    if not guards.annotations:
        return None
    key = normalise(query) if guards.annotation_match == "normalised" else query
    i = _annotation_index(guards).get(key)
    if i is None:
        return None
    return GuardDecision("annotation", f"annotations[{i}]", guards.annotations[i].answer)


def check_input(guards: GuardsSpec, query: str, inputs: Mapping[str, object]) -> GuardDecision | None:
    """The input guards' verdict on a turn: moderation of the query and of the prompt variables
    (they reach the model in the instructions), then annotation replies; None: ask the model."""
    for text in [query, *(v for v in inputs.values() if isinstance(v, str))]:
        if (hit := check_text(guards.input, text, where="input")) is not None:
            return hit
    return match_annotation(guards, query)


def guarded_exchange(query: str, decision: GuardDecision, *, at: float) -> list[ModelMessage]:
    """The history a guarded turn leaves: its query (withheld when moderation refused it: replaying
    it to the model on the next turn would defeat the guard) and the reply."""
    when = datetime.fromtimestamp(at, UTC)
    prompt = WITHHELD_QUERY if decision.kind == "moderation" else query
    return [ModelRequest(parts=[UserPromptPart(prompt, timestamp=when)], timestamp=when),
            ModelResponse(parts=[TextPart(decision.reply)], timestamp=when)]


# --- output -----------------------------------------------------------------------------------------


def spoken_text(messages: Sequence[ModelMessage]) -> str:
    """All the text a run's responses said, in order: what its stream carried."""
    return "".join(p.content for m in messages if isinstance(m, ModelResponse) for p in m.parts
                   if isinstance(p, TextPart))


def scrub_responses(messages: Sequence[ModelMessage], reply: str) -> list[ModelMessage]:
    """A run's messages with the text and thinking of every response removed and `reply` as the
    last response's text: the forbidden words never come back in a later turn's history."""
    last = max((i for i, m in enumerate(messages) if isinstance(m, ModelResponse)), default=None)
    out: list[ModelMessage] = []
    for i, message in enumerate(messages):
        if isinstance(message, ModelResponse):
            kept: list[ModelResponsePart] = [p for p in message.parts if not isinstance(p, TextPart | ThinkingPart)]
            if i == last:
                kept.insert(0, TextPart(reply))
            message = replace(message, parts=kept)
        out.append(message)
    return out
