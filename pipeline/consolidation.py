"""Consolidation: an extractor's proposals, or a user's edit, applied to one partition's records.

Rules: one current record per fact key, and of several changes to one key in a batch only the last
is applied; a correction closes the old record (`invalid_at`, and `superseded_by` its successor) and
never deletes it, so the history stays readable (only forgetting deletes); the same fact said again,
or a note like one already kept, changes nothing — so the same proposals applied twice (a redelivered
memory stage) change nothing the second time; what a user or operator set is not overridden by an
extraction from a turn that ended before they set it (extraction is debounced and may carry older
turns), while a later turn may change it; limits refuse adds past `max_records` and values past
`max_value_chars`. Every operation is recorded with the ids it touched and why (`Applied`): the shell
logs `Consolidation.decision()`, writes `writes` and deletes `deletes`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from .errors import InvalidRequest
from .extraction import Proposal
from .memory import (
    Kind,
    MemoryLimits,
    MemoryRecord,
    Provenance,
    Scope,
    clean_value,
    current_in_scope,
    fact_key,
    in_scope,
    normalise_value,
    words,
)
from .recall import cosine

AppliedOp = Literal["add", "update", "invalidate", "noop", "forget"]
Reason = Literal[
    "new", "contradicts", "replaces", "confirmed", "invalidated", "forgotten", "duplicate",
    "same value", "similar", "older", "overridden", "unknown target", "limit", "too long", "empty", "bad key",
    "extractor",
]
#: Notes this alike are one note (word sets; embeddings when both notes have one).
SIMILAR_WORDS = 0.8
SIMILAR_VECTORS = 0.9


@dataclass(frozen=True, slots=True)
class Applied:
    """One operation as applied: `records` are the ids it touched (the new record first, then the one
    it closed, duplicates or found unchanged)."""

    op: AppliedOp
    kind: Kind
    key: str | None
    records: tuple[str, ...]
    reason: Reason


@dataclass(frozen=True, slots=True)
class Consolidation:
    #: New records, and the closed versions of the records they superseded (write each by id).
    writes: tuple[MemoryRecord, ...]
    #: Ids to delete with no trace (forgetting).
    deletes: tuple[str, ...]
    #: The partition's current records afterwards.
    current: tuple[MemoryRecord, ...]
    applied: tuple[Applied, ...]

    @property
    def changed(self) -> bool:
        return bool(self.writes or self.deletes)

    def decision(self) -> dict[str, Any]:
        """The decision record: operations, ids and reasons; never a key or value (they are the user's
        data, and decision records are logged)."""
        return {"applied": [{"op": a.op, "kind": a.kind, "records": list(a.records), "reason": a.reason}
                            for a in self.applied],
                "writes": len(self.writes), "deletes": len(self.deletes), "current": len(self.current)}


@dataclass(frozen=True, slots=True)
class _Claim:
    """Who changes the records, when the claim was made, and what new records are stamped with."""

    source: Provenance
    valid_at: float
    now: float
    new_id: Callable[[], str]
    partition: str
    limits: MemoryLimits

    def yields_to(self, record: MemoryRecord) -> bool:
        """An extraction from a turn that ended before `record` was claimed does not change it."""
        return self.source.origin == "extracted" and self.valid_at < record.valid_at


@dataclass
class _Ledger:
    claim: _Claim
    records: dict[str, MemoryRecord] = field(default_factory=dict)
    by_key: dict[str, str] = field(default_factory=dict)
    writes: dict[str, MemoryRecord] = field(default_factory=dict)
    applied: list[Applied] = field(default_factory=list)
    compared: dict[str, tuple[str, frozenset[str]]] = field(default_factory=dict)
    #: The ids current before the batch: the only ones a proposal can target (an extractor knows no other).
    targets: frozenset[str] = frozenset()
    #: The fact key of every record of the partition given, closed ones included: a proposal naming a
    #: record an earlier delivery of the same batch closed still changes that record's key.
    keys_of: dict[str, str] = field(default_factory=dict)

    def load(self, records: Iterable[MemoryRecord]) -> None:
        # oldest claim first: of two current records of one key (never written, but storage may hold
        # them), the newer stays and closes the other
        for r in sorted(records, key=lambda r: (r.valid_at, r.recorded_at, r.id)):
            if r.kind == "fact" and r.key is not None and (older := self.fact(r.key)) is not None:
                self.close(older, successor=r.id)
                self.applied.append(Applied("invalidate", "fact", r.key, (older.id, r.id), "duplicate"))
            self._put(r)
        self.targets = frozenset(self.records)

    def target(self, record_id: str | None) -> MemoryRecord | None:
        return self.records.get(record_id) if record_id in self.targets else None

    def fact(self, key: str) -> MemoryRecord | None:
        found = self.by_key.get(key)
        return self.records[found] if found is not None else None

    def _put(self, r: MemoryRecord) -> None:
        self.records[r.id] = r
        if r.kind == "fact" and r.key is not None:
            self.by_key[r.key] = r.id

    def add(self, kind: Kind, key: str | None, value: str, vector: tuple[float, ...] | None) -> Applied:
        if len(self.records) >= self.claim.limits.max_records:
            return Applied("noop", kind, key, (), "limit")
        return Applied("add", kind, key, (self._new(kind, key, value, vector).id,), "new")

    def _new(self, kind: Kind, key: str | None, value: str, vector: tuple[float, ...] | None) -> MemoryRecord:
        c = self.claim
        record = MemoryRecord(id=c.new_id(), partition=c.partition, kind=kind, key=key, value=value,
                              valid_at=c.valid_at, recorded_at=c.now, source=c.source,
                              vector=vector if kind == "note" else None)
        self._put(record)
        self.writes[record.id] = record
        return record

    def supersede(self, old: MemoryRecord, value: str, vector: tuple[float, ...] | None) -> MemoryRecord:
        new = self._new(old.kind, old.key, value, vector)
        self.close(old, successor=new.id)
        return new

    def close(self, record: MemoryRecord, *, successor: str | None) -> None:
        self.writes[record.id] = replace(record, invalid_at=self.claim.now, superseded_by=successor)
        del self.records[record.id]
        if record.key is not None and self.by_key.get(record.key) == record.id:
            del self.by_key[record.key]

    def similar_note(self, value: str, vector: tuple[float, ...] | None) -> tuple[MemoryRecord, Reason] | None:
        """A current note with the same text (`same value`) or one alike (`similar`), or None."""
        normal, mine = normalise_value(value), frozenset(words(value))
        for note in (r for r in self.records.values() if r.kind == "note"):
            their_normal, theirs = self._compared(note)
            if their_normal == normal:
                return note, "same value"
            if _alike(mine, theirs, vector, note.vector):
                return note, "similar"
        return None

    def _compared(self, note: MemoryRecord) -> tuple[str, frozenset[str]]:
        # once per note and consolidation: a partition may hold a thousand notes
        if (found := self.compared.get(note.id)) is None:
            found = self.compared[note.id] = (normalise_value(note.value), frozenset(words(note.value)))
        return found

    def result(self, deletes: Sequence[str] = ()) -> Consolidation:
        return Consolidation(writes=tuple(self.writes.values()), deletes=tuple(deletes),
                             current=tuple(self.records.values()), applied=tuple(self.applied))


def _alike(a: frozenset[str], b: frozenset[str], va: tuple[float, ...] | None, vb: tuple[float, ...] | None) -> bool:
    if va is not None and vb is not None and len(va) == len(vb) and cosine(va, vb) >= SIMILAR_VECTORS:
        return True
    return bool(a and b) and len(a & b) / len(a | b) >= SIMILAR_WORDS


def consolidate(current: Sequence[MemoryRecord], proposals: Sequence[Proposal], *, scope: Scope, now: float,
                new_id: Callable[[], str], source: Provenance, turn_ended_at: float,
                limits: MemoryLimits | None = None) -> Consolidation:
    """`proposals` applied in order to the current records of `scope` (records of other partitions,
    and closed ones, are ignored). New records are claimed at `turn_ended_at` when extracted, at `now`
    when set by a user or an operator; closed ones are closed at `now`."""
    claim_at = turn_ended_at if source.origin == "extracted" else now
    ledger = _Ledger(_Claim(source, claim_at, now, new_id, scope.partition, limits or MemoryLimits()))
    ledger.load(current_in_scope(current, scope))
    ledger.keys_of = {r.id: r.key for r in current if r.kind == "fact" and r.key is not None and in_scope(r, scope)}
    for proposal, last in _last_per_key(ledger, proposals):
        ledger.applied.append(_apply(ledger, proposal) if last else Applied("noop", "fact", proposal.key, (),
                                                                            "overridden"))
    return ledger.result()


def _last_per_key(ledger: _Ledger, proposals: Sequence[Proposal]) -> list[tuple[Proposal, bool]]:
    """Each proposal, and whether it is the last change to its fact key in the batch: only the last
    is applied (what the user said last stands), so that applying the same proposals again — a
    redelivered memory stage — changes nothing."""
    keys = [_changed_key(ledger, p) for p in proposals]
    last = {key: i for i, key in enumerate(keys) if key is not None}
    return [(p, key is None or last[key] == i) for i, (p, key) in enumerate(zip(proposals, keys, strict=True))]


def _changed_key(ledger: _Ledger, p: Proposal) -> str | None:
    if p.kind != "fact" or p.op == "noop":
        return None
    if p.key:
        return fact_key(p.key)
    return ledger.keys_of.get(p.target_id) if p.target_id is not None else None


def _apply(ledger: _Ledger, p: Proposal) -> Applied:
    target = ledger.target(p.target_id)
    if p.op == "noop":
        return Applied("noop", p.kind, p.key, (), "extractor")
    if p.target_id is not None and (target is None or target.kind != p.kind):
        return Applied("noop", p.kind, p.key, (), "unknown target")
    key = fact_key(p.key) if p.key else (target.key if target is not None else None)
    if p.op == "invalidate":
        return _invalidate(ledger, target or (ledger.fact(key) if p.kind == "fact" and key else None), p.kind)
    value = clean_value(p.value or "")
    if (refused := _refusal(ledger, p.kind, key, value)) is not None:
        return refused
    if p.kind == "fact" and key is not None:
        return _set_fact(ledger, key, value)
    return _set_note(ledger, target, value, p.vector)


def _refusal(ledger: _Ledger, kind: Kind, key: str | None, value: str) -> Applied | None:
    if not value:
        return Applied("noop", kind, key, (), "empty")
    if len(value) > ledger.claim.limits.max_value_chars:
        return Applied("noop", kind, key, (), "too long")
    if kind == "fact" and key is None:
        return Applied("noop", kind, key, (), "bad key")
    return None


def _set_fact(ledger: _Ledger, key: str, value: str) -> Applied:
    old = ledger.fact(key)
    if old is None:
        return ledger.add("fact", key, value, None)
    if normalise_value(old.value) == normalise_value(value):
        if ledger.claim.source.origin != "extracted" and old.source.origin == "extracted":
            # the user confirms an extracted value: it becomes theirs, which older turns do not override
            return Applied("update", "fact", key, (ledger.supersede(old, value, None).id, old.id), "confirmed")
        return Applied("noop", "fact", key, (old.id,), "same value")
    if ledger.claim.yields_to(old):
        return Applied("noop", "fact", key, (old.id,), "older")
    return Applied("update", "fact", key, (ledger.supersede(old, value, None).id, old.id), "contradicts")


def _set_note(ledger: _Ledger, target: MemoryRecord | None, value: str, vector: tuple[float, ...] | None) -> Applied:
    if (found := ledger.similar_note(value, vector)) is not None:
        return Applied("noop", "note", None, (found[0].id,), found[1])
    if target is None:
        return ledger.add("note", None, value, vector)
    if ledger.claim.yields_to(target):
        return Applied("noop", "note", None, (target.id,), "older")
    return Applied("update", "note", None, (ledger.supersede(target, value, vector).id, target.id), "replaces")


def _invalidate(ledger: _Ledger, target: MemoryRecord | None, kind: Kind) -> Applied:
    if target is None:
        return Applied("noop", kind, None, (), "unknown target")
    if ledger.claim.yields_to(target):
        return Applied("noop", target.kind, target.key, (target.id,), "older")
    ledger.close(target, successor=None)
    return Applied("invalidate", target.kind, target.key, (target.id,), "invalidated")


# --- the API's edits --------------------------------------------------------------------------------


def apply_user_edit(records: Sequence[MemoryRecord], *, scope: Scope, value: str | None, now: float,
                    new_id: Callable[[], str], origin: Literal["user", "operator"], key: str | None = None,
                    record_id: str | None = None, limits: MemoryLimits | None = None) -> Consolidation:
    """One record set or forgotten through the API: `key` names a fact, `record_id` any record,
    neither adds a note. A value sets it (the old version is closed, as a correction); None forgets
    it with all its earlier versions (`forget`: pass the partition's closed records too)."""
    if key is not None and record_id is not None:
        raise InvalidRequest("name a fact key or a record id, not both")
    if value is None:
        return forget(records, scope=scope, key=key, record_id=record_id)
    target = next((r for r in current_in_scope(records, scope) if r.id == record_id), None)
    if key is not None or (target is not None and target.kind == "fact"):
        proposal = Proposal("add", "fact", key=key if key is not None else target.key if target else None, value=value)
    else:
        proposal = Proposal("update" if record_id is not None else "add", "note", value=value, target_id=record_id)
    return consolidate(records, [proposal], scope=scope, now=now, new_id=new_id, source=Provenance(origin=origin),
                       turn_ended_at=now, limits=limits)


def forget(records: Sequence[MemoryRecord], *, scope: Scope, key: str | None = None,
           record_id: str | None = None) -> Consolidation:
    """Erase a fact (by key) or a record (by id) and every version of it — for a fact every record of
    its key, for a note its chain of `superseded_by` — so that nothing of it is left."""
    mine = [r for r in records if in_scope(r, scope)]
    target = next((r for r in mine if r.id == record_id), None)
    fact = fact_key(key) if key is not None else (target.key if target is not None and target.kind == "fact" else None)
    if fact is not None:
        gone = {r.id for r in mine if r.kind == "fact" and r.key == fact}
    else:
        gone = _chain(mine, target.id) if target is not None else set()
    ledger = _Ledger(_Claim(Provenance("user"), 0.0, 0.0, _no_ids, scope.partition, MemoryLimits()))
    ledger.records = {r.id: r for r in mine if r.current and r.id not in gone}
    kind: Kind = "fact" if fact is not None else (target.kind if target is not None else "note")
    ledger.applied.append(Applied("forget", kind, fact, tuple(sorted(gone)), "forgotten") if gone
                          else Applied("noop", kind, fact, (), "unknown target"))
    return ledger.result(deletes=sorted(gone))


def forget_conversation(records: Sequence[MemoryRecord], *, scope: Scope, conversation_id: str) -> Consolidation:
    """Erase every record extracted from one conversation (the conversation is being deleted). A record
    they had superseded stays closed, with no successor."""
    mine = [r for r in records if in_scope(r, scope)]
    gone = {r.id for r in mine if r.source.conversation_id == conversation_id}
    ledger = _Ledger(_Claim(Provenance("user"), 0.0, 0.0, _no_ids, scope.partition, MemoryLimits()))
    ledger.records = {r.id: r for r in mine if r.current and r.id not in gone}
    ledger.writes = {r.id: replace(r, superseded_by=None) for r in mine if r.id not in gone and r.superseded_by in gone}
    ledger.applied.extend(Applied("forget", r.kind, r.key, (r.id,), "forgotten") for r in mine if r.id in gone)
    return ledger.result(deletes=sorted(gone))


def _chain(records: Sequence[MemoryRecord], start: str) -> set[str]:
    """`start` and every record linked to it by `superseded_by`, either way."""
    links: dict[str, set[str]] = {}
    for r in records:
        if r.superseded_by is not None:
            links.setdefault(r.id, set()).add(r.superseded_by)
            links.setdefault(r.superseded_by, set()).add(r.id)
    seen, todo = {start}, [start]
    while todo:
        for other in links.get(todo.pop(), set()) - seen:
            seen.add(other)
            todo.append(other)
    return seen


def _no_ids() -> str:
    raise AssertionError("forgetting creates no record")
