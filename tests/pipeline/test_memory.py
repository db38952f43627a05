"""Long-term memory: its config, records and scope (`pipeline.memory`) and consolidation
(`pipeline.consolidation`) — plain data in and out, and properties over any sequence of proposals
and user edits."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterable, Sequence

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from threadline.pipeline.config import AgentConfig, config_from_json, config_to_json, parse_agent_config
from threadline.pipeline.consolidation import (
    Consolidation,
    apply_user_edit,
    consolidate,
    forget,
    forget_conversation,
)
from threadline.pipeline.errors import InvalidRequest, SnapshotCorrupt
from threadline.pipeline.extraction import Proposal, offline_facts
from threadline.pipeline.memory import (
    LongTermSpec,
    MemoryLimits,
    MemoryRecord,
    Provenance,
    Scope,
    clean_value,
    fact_key,
    in_scope,
    normalise_value,
    record_from_json,
    record_to_json,
    scope_for,
)

SCOPE = Scope("acme", "u1")
OTHER = Scope("acme", "u2")
TURN = Provenance("extracted", conversation_id="c1", message_id="m1", turn_id="t1", extractor="offline:facts",
                  extractor_version="1")


def ids(prefix: str = "r") -> Callable[[], str]:
    counter = itertools.count(1)
    return lambda: f"{prefix}{next(counter)}"


class Store:
    """What the shell does with a consolidation: write records by id, delete the forgotten."""

    def __init__(self, records: Iterable[MemoryRecord] = ()) -> None:
        self.records = {r.id: r for r in records}
        self.new_id = ids()

    def apply(self, result: Consolidation) -> Consolidation:
        self.records.update({r.id: r for r in result.writes})
        for gone in result.deletes:
            del self.records[gone]
        return result

    @property
    def current(self) -> list[MemoryRecord]:
        return [r for r in self.records.values() if r.current]

    def turn(self, proposals: Sequence[Proposal], *, at: float, limits: MemoryLimits | None = None,
             source: Provenance = TURN) -> Consolidation:
        return self.apply(consolidate(list(self.records.values()), proposals, scope=SCOPE, now=at + 1,
                                      new_id=self.new_id, source=source, turn_ended_at=at, limits=limits))

    def edit(self, *, at: float, value: str | None, key: str | None = None, record_id: str | None = None,
             limits: MemoryLimits | None = None) -> Consolidation:
        return self.apply(apply_user_edit(list(self.records.values()), scope=SCOPE, value=value, now=at,
                                          new_id=self.new_id, origin="user", key=key, record_id=record_id,
                                          limits=limits))


def fact(key: str, value: str) -> Proposal:
    return Proposal("add", "fact", key=key, value=value)


def note(text: str, vector: tuple[float, ...] | None = None) -> Proposal:
    return Proposal("add", "note", value=text, vector=vector)


# --- config ------------------------------------------------------------------------------------------


def test_long_term_memory_is_off_unless_configured_and_round_trips_through_the_stored_config() -> None:
    assert AgentConfig.model_validate({"id": "a", "model": "offline:echo"}).memory.long_term is None
    config = parse_agent_config("id: a\nmodel: offline:echo\nmemory:\n  long_term:\n"
                                "    extractor: openai:gpt-4o-mini\n    scope: app\n    order: history_first\n")
    spec = config.memory.long_term
    assert spec is not None and spec.extractor_name == "openai:gpt-4o-mini" and spec.scope == "app"
    assert config_from_json(config_to_json(config)) == config
    default = LongTermSpec()
    assert (default.extractor_name, default.scope, default.order, default.embedder) == \
        ("offline:facts", "user", "recall_first", None)
    assert default.limits == MemoryLimits(max_records=1000, max_value_chars=500)


@pytest.mark.parametrize("long_term", [
    "{unknown: 1}", "{scope: tenant}", "{extractor: nope}", "{embedder: no-colon}", "{recall_tokens: -1}",
    "{extractor: {provider: openai, name: x, api_key: sk-abcdefghijklmnopqrstuvwxyz0123}}",
])
def test_a_bad_long_term_spec_is_refused_when_the_config_is_registered(long_term: str) -> None:
    with pytest.raises(InvalidRequest):
        parse_agent_config(f"id: a\nmodel: offline:echo\nmemory:\n  long_term: {long_term}\n")


# --- records and scope -------------------------------------------------------------------------------


def test_scope_partitions_come_from_the_turn_ids_and_never_collide() -> None:
    turn = {"tenant_id": "acme", "user_id": "u1", "app_id": "web", "agent_id": "bot"}
    assert scope_for("user", **turn).partition == "acme/u1"
    assert scope_for("app", **turn).partition == "acme/u1/app/web"
    assert scope_for("agent", **turn).partition == "acme/u1/agent/bot"
    assert {scope_for(k, **turn).user_tag for k in ("user", "app", "agent")} == {"acme/u1"}
    with pytest.raises(InvalidRequest):
        Scope("acme", "u1/app/web")  # no id holds a separator
    with pytest.raises(InvalidRequest):
        Scope("acme", "u1", app_id="web", agent_id="bot")


ident = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_.@-]{0,6}", fullmatch=True)
scopes = st.builds(Scope, ident, ident, st.none() | ident)


@given(scopes, scopes)
def test_a_record_is_in_one_scope_only(a: Scope, b: Scope) -> None:
    record = Store().turn([fact("name", "Ada")], at=1).writes[0]
    mine = dataclasses.replace(record, partition=a.partition)
    assert in_scope(mine, a)
    assert in_scope(mine, b) == (a == b)
    # consolidation in another scope neither sees nor touches it
    result = consolidate([mine], [fact("name", "Bob")], scope=b, now=5, new_id=ids("x"), source=TURN,
                         turn_ended_at=4)
    if a != b:
        assert [r.partition for r in result.writes] == [b.partition] and result.applied[0].reason == "new"


finite = st.floats(allow_nan=False, allow_infinity=False, width=32)
records = st.builds(
    MemoryRecord, id=ident, partition=st.just("acme/u1"), kind=st.sampled_from(["fact", "note"]),
    key=st.none() | st.text(max_size=10), value=st.text(max_size=40), valid_at=finite, recorded_at=finite,
    source=st.builds(Provenance, st.sampled_from(["extracted", "user", "operator"]), st.none() | ident),
    invalid_at=st.none() | finite, superseded_by=st.none() | ident,
    vector=st.none() | st.tuples(finite, finite, finite))


@given(records)
def test_records_round_trip_through_json(record: MemoryRecord) -> None:
    assert record_from_json(record_to_json(record)) == record


def test_a_corrupt_record_is_refused_without_quoting_it() -> None:
    with pytest.raises(SnapshotCorrupt) as e:
        record_from_json(b'{"id": "r1", "kind": "secret-kind", "value": "my secret"}')
    assert "secret" not in str(e.value)


def test_values_are_cleaned_and_compared_normalised() -> None:
    assert clean_value("  Ada\n\u200bLovelace\u202e ") == "Ada Lovelace"
    assert normalise_value("\uff21\uff24\uff21  lovelace!!") == normalise_value("ada lovelace") == "ada lovelace"
    assert fact_key("Preferred Language") == "preferred_language" and fact_key("language") == "preferred_language"
    assert fact_key("  --  ") is None and fact_key("Lieblings-Farbe") == "lieblings_farbe"


# --- consolidation -----------------------------------------------------------------------------------


def test_the_first_example_turn_adds_three_facts_and_a_correction_supersedes_the_name() -> None:
    store = Store()
    first = store.turn(offline_facts("I'm Ada, I'm vegetarian, answer in Portuguese"), at=100)
    assert [(a.op, a.key, a.reason) for a in first.applied] == [
        ("add", "name", "new"), ("add", "diet", "new"), ("add", "preferred_language", "new")]
    ada = next(r for r in store.current if r.key == "name")
    second = store.turn(offline_facts("actually, call me Ana"), at=200)
    [applied] = second.applied
    assert applied.op == "update" and applied.reason == "contradicts" and applied.records[1] == ada.id
    names = sorted((r for r in store.records.values() if r.key == "name"), key=lambda r: r.valid_at)
    assert [(r.value, r.current) for r in names] == [("Ada", False), ("Ana", True)]
    assert names[0].superseded_by == names[1].id and names[0].invalid_at == 201
    assert names[1].valid_at == 200 and names[1].source == TURN
    assert second.decision()["applied"] == [{"op": "update", "kind": "fact", "records": list(applied.records),
                                             "reason": "contradicts"}]


FULLWIDTH_VEGETARIAN = "".join(chr(ord(c) + 0xFEE0) for c in "vegetarian")


@given(st.lists(st.sampled_from(["Vegetarian", "vegetarian.", "  VEGETARIAN ", "vegetarian!", FULLWIDTH_VEGETARIAN]),
                min_size=5, max_size=5))
def test_a_fact_said_in_five_turns_is_one_record(spellings: list[str]) -> None:
    store = Store()
    for i, value in enumerate(spellings):
        result = store.turn([fact("diet", value)], at=10 * i)
        assert [a.reason for a in result.applied] == (["new"] if i == 0 else ["same value"])
    assert len(store.records) == 1


def test_notes_are_deduplicated_by_text_words_and_vectors() -> None:
    store = Store()
    store.turn([note("I prefer tea over coffee in the morning", vector=(1.0, 0.0))], at=1)
    again = store.turn([note("i prefer tea over coffee in the morning!"),  # same text
                        note("In the morning I prefer tea over coffee"),  # same words
                        note("Mornings: tea, not coffee", vector=(0.99, 0.05)),  # same meaning by embedding
                        note("My sister is called Eve")], at=2)
    assert [a.reason for a in again.applied] == ["same value", "similar", "similar", "new"]
    assert len(store.current) == 2


def test_what_the_user_set_wins_over_an_older_turn_but_not_over_a_later_one() -> None:
    store = Store()
    store.turn([fact("diet", "vegetarian")], at=100)
    store.edit(key="diet", value="vegan", at=200)
    stale = store.turn([fact("diet", "pescatarian")], at=150)  # a debounced turn that ended before the edit
    assert [a.reason for a in stale.applied] == ["older"] and not stale.changed
    assert store.turn([Proposal("invalidate", "fact", key="diet")], at=150).applied[0].reason == "older"
    later = store.turn([fact("diet", "pescatarian")], at=250)
    assert [a.reason for a in later.applied] == ["contradicts"]
    assert [r.value for r in store.current] == ["pescatarian"]


def test_the_user_confirming_an_extracted_value_makes_it_theirs() -> None:
    store = Store()
    store.turn([fact("name", "Ada")], at=100)
    confirmed = store.edit(key="name", value="ada", at=200)
    assert confirmed.applied[0].reason == "confirmed"
    assert store.turn([fact("name", "Bob")], at=150).applied[0].reason == "older"
    assert store.edit(key="name", value="Ada.", at=300).applied[0].reason == "same value"


def test_invalidate_closes_a_record_without_a_successor() -> None:
    store = Store()
    store.turn([fact("diet", "vegetarian"), note("I like long walks")], at=1)
    walk = next(r for r in store.current if r.kind == "note")
    result = store.turn([*offline_facts("I'm not vegetarian anymore"),
                         Proposal("invalidate", "note", target_id=walk.id),
                         Proposal("invalidate", "note", target_id="nope")], at=2)
    assert [(a.op, a.reason) for a in result.applied] == [
        ("invalidate", "invalidated"), ("invalidate", "invalidated"), ("noop", "unknown target")]
    assert store.current == [] and all(r.superseded_by is None and r.invalid_at == 3 for r in store.records.values())


def test_limits_refuse_adds_past_max_records_and_values_past_max_value_chars() -> None:
    store = Store()
    limits = MemoryLimits(max_records=2, max_value_chars=10)
    first = store.turn([fact("name", "Ada"), note("x" * 11), fact("diet", "vegan"), fact("location", "Lisbon")],
                       at=1, limits=limits)
    assert [(a.op, a.reason) for a in first.applied] == [
        ("add", "new"), ("noop", "too long"), ("add", "new"), ("noop", "limit")]
    second = store.turn([fact("name", "Ana"), Proposal("add", "fact", key="!!", value="v"),
                         Proposal("add", "note", value="  ")], at=2, limits=limits)
    assert [(a.op, a.reason) for a in second.applied] == [  # a correction is no add: the limit allows it
        ("update", "contradicts"), ("noop", "bad key"), ("noop", "empty")]
    assert sorted(r.value for r in store.current) == ["Ana", "vegan"]
    assert store.edit(key="location", value="Lisbon", at=5, limits=limits).applied[0].reason == "limit"


def test_two_current_records_of_one_key_in_storage_are_repaired() -> None:
    a, b = (Store().turn([fact("name", n)], at=t).writes[0] for n, t in (("Ada", 1), ("Ana", 2)))
    b = dataclasses.replace(b, id="r2")
    result = consolidate([a, b], [], scope=SCOPE, now=9, new_id=ids("x"), source=TURN, turn_ended_at=8)
    assert [(x.reason, x.records) for x in result.applied] == [("duplicate", (a.id, "r2"))]
    assert [r.id for r in result.current] == ["r2"] and result.writes[0].superseded_by == "r2"


def test_user_edits_set_correct_and_forget_one_record_with_its_history() -> None:
    store = Store()
    store.edit(key="Name", value="Ada", at=1)
    store.edit(key="name", value="Ana", at=2)
    added = store.edit(value="I like tea", at=3)
    tea = added.applied[0].records[0]
    replaced = store.edit(record_id=tea, value="I like green tea", at=4)
    assert replaced.applied[0].reason == "replaces" and len(store.records) == 4
    assert store.current[0].source == Provenance("user")
    gone = store.edit(key="name", value=None, at=5)
    assert gone.applied[0].op == "forget" and len(gone.deletes) == 2
    green = replaced.applied[0].records[0]
    assert len(store.edit(record_id=green, value=None, at=6).deletes) == 2 and store.records == {}
    assert store.edit(key="name", value=None, at=7).applied[0].reason == "unknown target"
    assert store.edit(record_id="nope", value="x", at=8).applied[0].reason == "unknown target"
    with pytest.raises(InvalidRequest):
        store.edit(key="name", record_id="r1", value="x", at=9)


def test_forgetting_a_conversation_erases_what_was_extracted_from_it() -> None:
    store = Store()
    store.turn([fact("name", "Ada"), note("I like tea")], at=1,
               source=Provenance("extracted", conversation_id="c0"))
    store.turn([fact("name", "Ana")], at=2)  # from c1 (TURN)
    result = store.apply(forget_conversation(list(store.records.values()), scope=SCOPE, conversation_id="c1"))
    assert [a.op for a in result.applied] == ["forget"]
    ada = next(r for r in store.records.values() if r.key == "name")
    assert (ada.value, ada.current, ada.superseded_by) == ("Ada", False, None)
    assert [r.value for r in store.current] == ["I like tea"]
    assert forget(list(store.records.values()), scope=OTHER, key="name").deletes == ()


# --- properties over any sequence --------------------------------------------------------------------

keys = st.sampled_from(["name", "diet", "Diet", "location", "allergy_peanuts"])
values = st.sampled_from(["Ada", "ada.", "Ana", "vegan", "vegetarian", "Lisbon", "", "x" * 30])
texts = st.sampled_from(["I like tea", "i like tea!", "I like green tea", "My sister is Eve", "remember the milk"])
proposals = st.one_of(
    st.builds(fact, keys, values),
    st.builds(note, texts),
    st.builds(Proposal, st.sampled_from(["add", "update", "invalidate", "noop"]), st.sampled_from(["fact", "note"]),
              key=st.none() | keys, value=st.none() | values | texts,
              target_id=st.none() | st.sampled_from([f"r{i}" for i in range(1, 12)])),
)
@dataclasses.dataclass(frozen=True)
class Turn:
    proposals: list[Proposal]
    at: int

    def run(self, store: Store, limits: MemoryLimits) -> Consolidation:
        return store.turn(self.proposals, at=self.at, limits=limits)


@dataclasses.dataclass(frozen=True)
class Edit:
    key: str | None
    record_id: str | None
    value: str | None
    at: int

    def run(self, store: Store, limits: MemoryLimits) -> Consolidation:
        return store.edit(key=self.key, record_id=self.record_id, value=self.value, at=self.at, limits=limits)


steps = st.one_of(
    st.builds(Turn, st.lists(proposals, max_size=4), st.integers(0, 100)),
    st.builds(Edit, st.none() | keys, st.none(), st.none() | values, st.integers(0, 100)),
    st.builds(Edit, st.none(), st.sampled_from(["r1", "r2", "r5"]), st.none() | values, st.integers(0, 100)),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(steps, max_size=12), st.integers(1, 6))
def test_one_current_record_per_key_whatever_happens(sequence: list[Turn | Edit], max_records: int) -> None:
    store, limits = Store(), MemoryLimits(max_records=max_records, max_value_chars=20)
    for step in sequence:
        result = step.run(store, limits)
        current = store.current
        fact_keys = [r.key for r in current if r.kind == "fact"]
        assert len(fact_keys) == len(set(fact_keys)), "two current records for one key"
        assert {r.id for r in current} == {r.id for r in result.current}
        assert len(current) <= max_records
        notes = [normalise_value(r.value) for r in current if r.kind == "note"]
        assert len(notes) == len(set(notes))
        assert all(0 < len(r.value) <= 20 for r in current)
        # a closed record names a successor that exists, or none
        assert all(r.superseded_by in store.records for r in store.records.values() if r.superseded_by)


@settings(max_examples=300, deadline=None)
@given(st.lists(steps, max_size=6), st.lists(proposals, max_size=8), st.integers(0, 100))
def test_the_same_proposals_applied_again_change_nothing(history: list[Turn | Edit], batch: list[Proposal],
                                                        at: int) -> None:
    # With the record limit binding, a batch that closes a record and then adds one may find room only
    # the second time: a redelivered stage is kept out by the store instead (memory_apply.lua refuses
    # turns no longer pending), so this property is about consolidation itself, with room to spare.
    # A batch that both keeps a note and rewrites that same note by its id (or sets a fact by key and
    # rewrites it by id) says two things at once: applied again, it finds the state its own second
    # proposal made. Such a batch is not re-applied either (memory_apply.lua, as above), so a batch
    # with a targeted proposal is here alone.
    assume(len(batch) <= 1 or not any(p.target_id for p in batch))
    store, limits = Store(), MemoryLimits(max_records=1000, max_value_chars=20)
    for step in history:
        step.run(store, limits)
    store.new_id = ids("b")  # the batch targets records stored before it (r1, r2, ...), as an extractor does
    store.turn(batch, at=at, limits=limits)
    again = store.turn(batch, at=at, limits=limits)  # a redelivered memory stage
    assert again.writes == () and again.deletes == ()
    assert all(a.op == "noop" for a in again.applied)


def test_of_several_changes_to_one_key_in_a_batch_the_last_stands() -> None:
    store = Store()
    result = store.turn([fact("name", "Ada"), Proposal("invalidate", "fact", key="name"), fact("Name", "Ana"),
                         Proposal("noop", "fact", key="name")], at=1)
    assert [(a.op, a.reason) for a in result.applied] == [
        ("noop", "overridden"), ("noop", "overridden"), ("add", "new"), ("noop", "extractor")]
    assert [r.value for r in store.records.values()] == ["Ana"]
