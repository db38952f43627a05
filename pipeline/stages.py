"""The stage graph, declared once: every stage's name (its actor and its queue), its kind, what it
needs loaded, and its pure function. The order of the table is the order of the turn.

Six kinds of stage, each run by one generic runner in `workers/` (none of which names a stage):

- `admit`: the first stage. It validates the producer's request, takes the turn's place in its
  conversation's line and pins what the turn runs with (its output is the `ResolvedTurn`).
- `transform`: a pure function from the previous stage's artifact (and data the shell loads for
  its `needs`) to a new artifact. Adding a stage is one `Stage` entry plus one such function.
- `model`: the model call (slow, cancellable, retried, streamed).
- `finish`: the one terminal write of the turn.
- `compaction`: after the turn ended, off the critical path (only for agents that configure
  `memory.compaction`): the turns that fell out of the window are summarised for the next turns.
- `memory`: after the turn ended, off its critical path too (only for agents that configure
  `memory.long_term`): the ended turns of a user's memory partition are extracted and consolidated
  into long-term memory, debounced (one extraction per partition at a time).

Artifacts are JSON text stored under turn-scoped keys named after the stage that wrote them; a
stage reads the admit stage's artifact and the previous stage's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from .config import LongTermSpec
    from .history import ThreadRead
    from .recall import Recall
    from .records import ResolvedTurn

StageKind = Literal["admit", "transform", "model", "finish", "compaction", "memory"]
#: Kinds that run after the turn ended, off its critical path: after the finish stage in the graph,
#: never handed over to.
AFTER_TURN: frozenset[StageKind] = frozenset({"compaction", "memory"})


@dataclass(frozen=True, slots=True)
class StageInput:
    turn: ResolvedTurn
    #: The previous stage's artifact (JSON text).
    artifact: str
    #: What the shell loaded for the stage's `needs`, by need.
    loaded: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class StageOutput:
    artifact: str
    #: The decision record: what the stage chose and why (logged, and carried by its `finished` event).
    decision: Mapping[str, Any] = field(default_factory=dict)


Transform = Callable[[StageInput], StageOutput]


@dataclass(frozen=True, slots=True)
class Stage:
    name: str
    kind: StageKind
    run: Transform | None = None
    #: Data the shell loads before `run` (loaders are keyed by need, never by stage).
    needs: tuple[str, ...] = ()

    @property
    def queue(self) -> str:
        return self.name


class StageGraph:
    """An ordered chain of stages: one `admit` first, one `finish` last."""

    def __init__(self, stages: Sequence[Stage]) -> None:
        turn = [s for s in stages if s.kind not in AFTER_TURN]
        if len(turn) < 2 or turn[0].kind != "admit" or turn[-1].kind != "finish" or stages[len(turn) - 1] != turn[-1]:
            raise ValueError("a stage graph starts with its admit stage and ends with its finish stage "
                             "(compaction and memory stages come after it)")
        names = [s.name for s in stages]
        if len(set(names)) != len(names):
            raise ValueError(f"stage names must be unique: {names}")
        for s in stages:
            if (s.kind == "transform") != (s.run is not None):
                raise ValueError(f"stage {s.name!r}: transform stages, and only they, have a function")
        self.stages: tuple[Stage, ...] = tuple(stages)
        self._by_name = {s.name: s for s in stages}

    def __iter__(self) -> Iterator[Stage]:
        return iter(self.stages)

    def __getitem__(self, name: str) -> Stage:
        return self._by_name[name]

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.stages)

    @property
    def first(self) -> Stage:
        return self.stages[0]

    def next(self, name: str) -> Stage | None:
        """The stage a turn hands over to (none after the finish stage)."""
        i = self.names.index(name)
        following = self.stages[i + 1] if i + 1 < len(self.stages) else None
        return None if following is None or following.kind in AFTER_TURN else following

    @property
    def turn_stages(self) -> tuple[Stage, ...]:
        """The stages a turn runs through, admit to finish (compaction and memory run after the turn)."""
        return tuple(s for s in self.stages if s.kind not in AFTER_TURN)

    def previous(self, name: str) -> Stage:
        i = self.names.index(name)
        if i == 0:
            raise ValueError(f"{name!r} is the first stage")
        return self.stages[i - 1]

    def of_kind(self, kind: StageKind) -> list[Stage]:
        return [s for s in self.stages if s.kind == kind]

    def with_stage(self, stage: Stage, *, after: str) -> StageGraph:
        """A copy with `stage` inserted after the stage named `after`."""
        i = self.names.index(after)
        return StageGraph([*self.stages[: i + 1], stage, *self.stages[i + 1 :]])


# --- the transform stages -------------------------------------------------------------------------


def history_stage(given: StageInput) -> StageOutput:
    """The newest whole turns of the thread that fit the token budget (the shell reads the thread)."""
    # imported when a worker runs the stage, not with the graph: producers and operators read the
    # graph (queue names) without loading pydantic-ai
    from .history import budgeted_history, encode_messages
    from .recall import recall_budget, recall_messages

    read: ThreadRead = given.loaded["thread"]
    turn = given.turn
    spec = turn.config.memory.long_term if turn.memory != "off" and read.recall is not None else None
    reserved = recall_budget(spec, history_budget=read.budget.history) if spec and spec.order == "recall_first" else 0
    messages, window, summary, files = budgeted_history(read, low_water=turn.config.memory.low_water,
                                                        reserved=reserved)
    budget = read.budget
    recalled = None
    if spec is not None and read.recall is not None:
        kept = window.tokens + (read.summaries[summary][1] if summary else 0)
        share = reserved if spec.order == "recall_first" else recall_budget(
            spec, history_budget=read.budget.history, kept_history_tokens=kept)
        recalled = _recall(given, spec, read, share)
        # right before the query, after the kept history: the newest thing the model reads
        messages = [*messages, *recall_messages(recalled)]
    record = {
        "tokenizer": read.tokenizer,
        **({"tokenizer_fallback": read.tokenizer_fallback} if read.tokenizer_fallback else {}),
        "budget": {**dataclasses.asdict(budget), "history": budget.history},
        "window": {"reason": window.reason, "start": window.start, "kept_turns": len(window.kept),
                   "kept_tokens": window.tokens, "dropped_turns": len(window.dropped),
                   "dropped_tokens": window.dropped_tokens,
                   "dropped": window.dropped[-20:]},
        "read": {"turns": len(read.rows), "complete": read.complete},
        "summary": {"watermark": summary, "tokens": read.summaries[summary][1]} if summary else None,
        "messages_out": len(messages),
        "files": files,
        **({"recall": recalled.decision()} if recalled is not None else {}),
    }
    return StageOutput(encode_messages(messages).decode(), record)


def _recall(given: StageInput, spec: LongTermSpec, read: ThreadRead, share: int) -> Recall:
    """The recalled block within its `share` of the history budget: the reserved one
    (`recall_first`), or what the kept turns left (`history_first`). The partition is the turn's own
    (`recall` refuses an index of another)."""
    from .memory import scope_for
    from .recall import recall

    assert read.recall is not None
    turn = given.turn
    scope = scope_for(spec.scope, tenant_id=turn.tenant_id, user_id=turn.user_id, app_id=turn.app_id,
                      agent_id=turn.agent_id)
    return recall(read.recall.index, turn.query, spec=spec, scope=scope, count=read.recall.count, budget=share)


def map_stage(given: StageInput) -> StageOutput:
    """The history normalised for strict chat templates (see `pipeline.mapping`)."""
    from .history import decode_messages, encode_messages
    from .mapping import normalise_messages

    history = decode_messages(given.artifact, where="the assembled history")
    # A resume answers the open calls of the paused response: leave that frontier to the run.
    mapped, decision = normalise_messages(history, repair_last_response=given.turn.deferred_answers is None)
    return StageOutput(encode_messages(mapped).decode(), dataclasses.asdict(decision))


DEFAULT_GRAPH = StageGraph([
    Stage("resolve", "admit"),
    Stage("history", "transform", history_stage, needs=("thread",)),
    Stage("map", "transform", map_stage),
    Stage("invoke", "model"),
    Stage("persist", "finish"),
    Stage("compact", "compaction"),
    Stage("remember", "memory"),
])
