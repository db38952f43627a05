"""The chaos test's figures, computed from what the run left in Redis (read by the test) as plain data
in, figures out: terminal events per turn, threads against submission order, message rows, usage
counters against the terminal events, and the recovery time of every kill and of the restart."""

from __future__ import annotations

import json
import statistics
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic_ai.messages import ModelRequest, UserPromptPart

from threadline.pipeline import events as ev
from threadline.pipeline.llm import chat_answer

#: Usage counters a terminal event carries and the tenant's usage hash adds up.
TOKEN_FIELDS = ("input_tokens", "output_tokens", "requests")


@dataclass(frozen=True)
class Stamped:
    """An event and its stream entry id as (milliseconds, sequence): when it was added."""

    entry: tuple[int, int]
    event: ev.Event

    @property
    def at(self) -> float:
        return self.entry[0] / 1000


@dataclass(frozen=True)
class Conversation:
    """One conversation as submitted: its id (the one its first turn starts), that turn's id, and its
    turns (id, query) in submission order."""

    id: str
    first_turn_id: str
    turns: list[tuple[str, str]] = field(default_factory=list)


@dataclass(frozen=True)
class Kill:
    """A SIGKILL: when, which process, and the turns whose model claim it held, with the id of each
    one's last event at the kill."""

    at: float
    pid: int
    held: dict[str, str]


@dataclass(frozen=True)
class Restart:
    """The server's restart: stopped and serving again at, and the turns running just before the stop."""

    stopped_at: float
    started_at: float
    running: list[str]


@dataclass(frozen=True)
class Stored:
    """What one conversation holds after the run: the turn ids of its thread (root → tip) and of its
    message rows (one per row)."""

    thread: list[str]
    rows: list[str]


def entry(entry_id: str) -> tuple[int, int]:
    """A stream entry id ("1700000000000-3", or "0") as a comparable pair."""
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def after(events: Sequence[Stamped], entry_id: str) -> list[Stamped]:
    """The events appended after `entry_id` ("0" when the turn had none yet)."""
    mark = entry(entry_id)
    return [s for s in events if s.entry > mark]


def expected_answer(queries: Sequence[str]) -> str:
    """What `offline:chat` answers to the last of `queries` after all the earlier ones, in order."""
    return chat_answer([ModelRequest(parts=[UserPromptPart(q)]) for q in queries])


def _terminals(events: Sequence[Stamped]) -> list[ev.Terminal]:
    return [s.event for s in events if isinstance(s.event, ev.Terminal)]


def _outcome(terminal: ev.Terminal) -> str:
    code = getattr(terminal, "code", None)
    return f"{terminal.type}:{code}" if code else terminal.type


def turn_figures(events: Mapping[str, Sequence[Stamped]]) -> dict[str, Any]:
    """Per turn: lost (no terminal event), duplicated (more than one), a `seq` that is not 1, 2, …,
    and the terminal outcomes."""
    terminals = {t: _terminals(e) for t, e in events.items()}
    return {
        "lost": sorted(t for t, found in terminals.items() if not found),
        "duplicated": sorted(t for t, found in terminals.items() if len(found) > 1),
        "seq_gaps": sorted(t for t, e in events.items() if [s.event.seq for s in e] != list(range(1, len(e) + 1))),
        "outcomes": dict(Counter(_outcome(found[0]) for found in terminals.values() if found)),
    }


def thread_figures(conversations: Sequence[Conversation], stored: Mapping[str, Stored],
                   answers: Mapping[str, str]) -> dict[str, Any]:
    """Threads in submission order, each turn once; message rows once per turn; and the answer of
    every turn that succeeded after earlier turns that all did shows that its model saw exactly the
    earlier queries, once each and in order (`answers`: the succeeded turns' answers)."""
    out_of_order, duplicate_rows, history = [], [], []
    for c in conversations:
        if stored[c.id].thread != [t for t, _ in c.turns]:
            out_of_order.append(c.id)
        duplicate_rows += [t for t, n in Counter(stored[c.id].rows).items() if n > 1]
        for k, (turn_id, _) in enumerate(c.turns):
            if turn_id not in answers:
                break  # what a failed turn leaves in the history is not this check's business
            if answers[turn_id].split() != expected_answer([q for _, q in c.turns[:k + 1]]).split():
                history.append(turn_id)
    return {"out_of_order": out_of_order, "duplicate_rows": duplicate_rows, "history_mismatches": history}


def usage_figures(counted: Mapping[str, int], events: Mapping[str, Sequence[Stamped]]) -> dict[str, Any]:
    """The tenant's usage counters against the turns accepted and the usage of their terminal events."""
    accepted = sum(1 for e in events.values() if any(isinstance(s.event, ev.Accepted) for s in e))
    summed = dict.fromkeys(TOKEN_FIELDS, 0)
    for e in events.values():
        for terminal in _terminals(e):
            if terminal.usage is not None:
                for name in TOKEN_FIELDS:
                    summed[name] += getattr(terminal.usage, name)
    return {"turns_counted": counted.get("turns", 0), "turns_accepted": accepted,
            "tokens_counted": {name: counted.get(name, 0) for name in TOKEN_FIELDS}, "tokens_in_events": summed}


def _seconds(later: Sequence[Stamped], t0: float) -> tuple[float | None, float | None]:
    """From `t0` to the first of `later`, and to the terminal event among them."""
    first = round(later[0].at - t0, 2) if later else None
    end = [s for s in later if isinstance(s.event, ev.Terminal)]
    return first, (round(end[0].at - t0, 2) if end else None)


def recovery_figures(kills: Sequence[Kill], restart: Restart | None,
                     events: Mapping[str, Sequence[Stamped]]) -> dict[str, Any]:
    """Per kill, the seconds from the kill to the next event of each turn it held (its `retrying`,
    once another worker took it over) and to its terminal event; for the restart, the seconds from the
    server's return to the next event (and to the terminal one) of each turn that was running when it
    stopped, among those that had not ended by then."""
    per_kill: list[dict[str, Any]] = []
    for k in kills:
        times = [_seconds(after(events[t], since), k.at) for t, since in k.held.items()]
        per_kill.append({"pid": k.pid, "held": len(k.held),
                         "next_event_s": [f for f, _ in times], "terminal_s": [e for _, e in times]})
    next_all = [x for k in per_kill for x in k["next_event_s"] if x is not None]
    end_all = [x for k in per_kill for x in k["terminal_s"] if x is not None]
    figures: dict[str, Any] = {"kills": per_kill, "kill_next_event_s": _spread(next_all),
                               "kill_terminal_s": _spread(end_all)}
    if restart is not None:
        times = [_seconds([s for s in events[t] if s.at >= restart.started_at], restart.started_at)
                 for t in restart.running]
        figures["restart"] = {"down_s": round(restart.started_at - restart.stopped_at, 2),
                              "running": len(restart.running),
                              "next_event_s": _spread([f for f, _ in times if f is not None]),
                              "terminal_s": _spread([e for _, e in times if e is not None])}
    return figures


def _spread(values: Sequence[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {"min": min(values), "median": round(statistics.median(values), 2), "max": max(values)}


def report(figures: Mapping[str, Any]) -> str:
    """The block the test prints: one line per figure, then the whole as one JSON line."""
    lines = ["== chaos figures"]
    for name, value in figures.items():
        shown = len(value) if isinstance(value, list) and name != "kills" else value
        lines.append(f"  {name}: {json.dumps(shown)}")
    lines.append("CHAOS_FIGURES " + json.dumps(figures, separators=(",", ":")))
    return "\n".join(lines)
