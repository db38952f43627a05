"""What a guard pattern costs per 100 KB of text: RE2 (what `pipeline/guards.py` runs) against the
`regex` engine (what it ran before, with a time budget), as a baseline in the same run.

    .venv/bin/python -m bench.guards                # ~15 s (the regex timeouts take a third of it)
    .venv/bin/python -m bench.guards --reps 9 --timeout-s 5

Every cell is one whole check as a turn runs it: `check_text` on the text, which cuts it into
sentences and searches each sentence alone, once per pattern. RE2 runs through the production code
as it is; the baseline runs the same checker with each pattern compiled by `regex` (Python `re`
syntax, version 0, case-insensitive, as before), its searches sharing `--timeout-s` per check. A
cell is the median of `--reps` checks after one untimed warm-up (which builds RE2's DFA states),
in ms per 100 KB of text.

The texts, 100 KB each: `prose` (benign English sentences, numbers and dates, ~60 characters a
sentence: how answers look), `aaaa!` (one sentence: 99,999 `a`s and a `!`, catastrophic for
`(a+)+$` on a backtracking engine) and `letters` (one sentence of random letters and spaces without
`y`: the text that makes RE2's DFA for `\\w[^x]{50}y` thrash, the slowest case of RE2 we know).

Two more columns time the engine alone: one search of the whole text as a single string (no
sentences cut, so no checker overhead), with the same options. Nothing here needs a server: it
runs in this process.
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib.metadata import version

from threadline.pipeline.config import GuardRules, compile_pattern
from threadline.pipeline.guards import CompiledRules, StreamGuard, check_text

from .procs import bench_session, progress
from .run import code_version

try:  # the baseline only: Threadline itself no longer imports it
    import regex
except ImportError:  # without it the baseline columns say so
    regex = None  # type: ignore[assignment]

TEXT_BYTES = 100_000

#: label -> pattern: the two card patterns of issue 25, typical moderation patterns, and the worst.
PATTERNS: dict[str, str] = {
    "card words": r"\bcredit\s+card\s+number\b",
    "card digits": r"\d{4}-\d{4}-\d{4}-\d{4}",
    "injection": r"ignore (all )?(previous|prior|above) instructions",
    "password": r"\b(?:password|passcode|pin)\s*(?:is|:)\s*\S+",
    "ssn": r"\b\d{3}-\d{2}-\d{4}\b",
    "e-mail": r"[\w.+-]+@[\w-]+\.[\w.-]+",
    "catastrophic": r"(a+)+$",
    "dfa-hostile": r"\w[^x]{50}y",
}
#: A config with every typical pattern at once (the first six).
TYPICAL = list(PATTERNS.values())[:6]

_SENTENCES = [
    "The order shipped today and the invoice is attached.",
    "Your parcel 48213 should arrive on 2026-03-14 by noon.",
    "We refunded 19.99 EUR to the card you paid with!",
    "Could you confirm the delivery address, please?",
    "The meeting moved to Thursday at 10:30 in room 4.",
    "Thanks for your patience while we looked into this.",
    "Tracking shows the package left the depot at 07:45.",
    "Reply to this message if anything else comes up.",
]


def texts(seed: int) -> dict[str, str]:
    rng = random.Random(seed)
    prose: list[str] = []
    size = 0
    while size < TEXT_BYTES:
        sentence = rng.choice(_SENTENCES) + rng.choice([" ", " ", "\n"])
        prose.append(sentence)
        size += len(sentence)
    letters = "".join(rng.choice("abcdefghijklmnopqrstuvwxz ") for _ in range(TEXT_BYTES))
    return {"prose": "".join(prose)[:TEXT_BYTES], "aaaa!": "a" * (TEXT_BYTES - 1) + "!", "letters": letters}


class _RegexPattern:
    """A pattern on the `regex` engine behind the interface the checker searches (UTF-8 bytes),
    its searches sharing one deadline per check, as the old budget did."""

    def __init__(self, pattern: str, deadline: list[float]) -> None:
        assert regex is not None
        self._compiled = regex.compile(pattern, regex.IGNORECASE | regex.V0)
        self._deadline = deadline

    def search(self, text: str | bytes) -> object | None:
        sentence = text.decode() if isinstance(text, bytes) else text
        return self._compiled.search(sentence, timeout=max(0.0, self._deadline[0] - time.perf_counter()))


def _regex_check(patterns: Sequence[str], timeout_s: float) -> Callable[[str], bool]:
    deadline = [0.0]
    rules = GuardRules()  # only its reply is read, on a hit
    compiled = CompiledRules(where="output", rules=rules, keywords=None, longest=0,
                             patterns=tuple(_RegexPattern(p, deadline) for p in patterns))

    def check(text: str) -> bool:
        deadline[0] = time.perf_counter() + timeout_s
        guard = StreamGuard(compiled)
        guard.feed(text)
        guard.finish()
        return guard.hit is not None

    return check


def _re2_check(patterns: Sequence[str]) -> Callable[[str], bool]:
    rules = GuardRules.model_validate({"patterns": list(patterns)})
    return lambda text: check_text(rules, text, where="output") is not None


def _re2_search(patterns: Sequence[str]) -> Callable[[str], bool]:
    compiled = [compile_pattern(p) for p in patterns]

    def search(text: str) -> bool:
        data = text.encode()
        return any(c.search(data) is not None for c in compiled)

    return search


def _regex_search(patterns: Sequence[str], timeout_s: float) -> Callable[[str], bool]:
    assert regex is not None
    compiled = [regex.compile(p, regex.IGNORECASE | regex.V0) for p in patterns]

    def search(text: str) -> bool:
        deadline = time.perf_counter() + timeout_s
        return any(c.search(text, timeout=max(0.0, deadline - time.perf_counter())) is not None for c in compiled)

    return search


@dataclass(frozen=True, slots=True)
class Cell:
    ms: float | None  # per 100 KB; None: timed out
    hit: bool | None

    def render(self, timeout_s: float) -> str:
        if self.ms is None:
            return f"> {timeout_s * 1000:,.0f} (timed out)"
        return f"{self.ms:,.2f}" if self.ms < 10 else f"{self.ms:,.1f}"


def measure(check: Callable[[str], bool], text: str, reps: int) -> Cell:
    scale = TEXT_BYTES / len(text.encode())
    try:
        hit = check(text)  # warm-up: RE2 builds its DFA states, both compile lazily
    except TimeoutError:
        return Cell(None, None)  # a timeout is a timeout every time: not repeated
    times: list[float] = []
    for _ in range(reps):
        t0 = time.perf_counter()
        try:
            check(text)
        except TimeoutError:
            return Cell(None, None)
        times.append((time.perf_counter() - t0) * 1000 * scale)
    return Cell(statistics.median(times), hit)


@dataclass(frozen=True, slots=True)
class Row:
    label: str
    pattern: str
    text: str
    re2_check: Cell
    regex_check: Cell | None
    re2_search: Cell
    regex_search: Cell | None

    def render(self, timeout_s: float) -> str:
        def baseline(cell: Cell | None) -> str:
            return "—" if cell is None else cell.render(timeout_s)

        ratio = ""
        if self.regex_check is not None and self.regex_check.ms is not None and self.re2_check.ms:
            ratio = f"{self.regex_check.ms / self.re2_check.ms:.2g}x"
        if self.regex_check is not None and self.regex_check.hit not in (None, self.re2_check.hit):
            ratio += " (verdicts differ)"
        shown = self.pattern.replace("|", "\\|")
        return (f"| {self.label} | `{shown}` | {self.text} | {'hit' if self.re2_check.hit else 'pass'} "
                f"| {self.re2_check.render(timeout_s)} | {baseline(self.regex_check)} | {ratio} "
                f"| {self.re2_search.render(timeout_s)} | {baseline(self.regex_search)} |")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.guards", description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=7, help="timed checks per cell, after a warm-up (7)")
    parser.add_argument("--timeout-s", type=float, default=2.0,
                        help="the regex baseline's time for one whole check before it counts as timed out (2)")
    parser.add_argument("--seed", type=int, default=25, help="seed of the prose and letters texts (25)")
    a = parser.parse_args(argv)
    rows: list[Row] = []
    with bench_session("bench.guards", argv, keep=False) as (command, _):
        corpus = texts(a.seed)
        cases: list[tuple[str, list[str]]] = [(label, [p]) for label, p in PATTERNS.items()]
        cases.append(("all six typical", TYPICAL))
        for label, patterns in cases:
            for text_name, text in corpus.items():
                rows.append(Row(
                    label, patterns[0] if len(patterns) == 1 else "the first six, one config", text_name,
                    measure(_re2_check(patterns), text, a.reps),
                    measure(_regex_check(patterns, a.timeout_s), text, a.reps) if regex else None,
                    measure(_re2_search(patterns), text, a.reps),
                    measure(_regex_search(patterns, a.timeout_s), text, a.reps) if regex else None,
                ))
                progress(rows[-1].render(a.timeout_s))
    versions = f"google-re2 {version('google-re2')}" + (f", regex {version('regex')}" if regex else
                                                        " (regex not installed: no baseline)")
    print(f"command: `{command}`\ncode: {code_version()}\npython {platform.python_version()} on "
          f"{platform.machine()}; {versions}; median of {a.reps} reps per cell, {TEXT_BYTES:,}-byte texts\n")
    print("| pattern | as written | text | verdict | RE2 check, ms per 100 KB | regex check (baseline) "
          "| regex ÷ RE2 | RE2 engine alone | regex engine alone |\n|---|---|---|---|---|---|---|---|---|")
    print("\n".join(row.render(a.timeout_s) for row in rows))
    print(f"\nA check is `check_text` as a turn runs it: sentences cut, each searched alone, once per pattern. "
          f"The engine alone: one search over the whole text. Timed out: the baseline took over {a.timeout_s:g} s "
          "(the old guard gave up, failing closed, after 0.25 s).")


if __name__ == "__main__":
    main()
