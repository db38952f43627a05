"""Thread extraction and history assembly: plain data in, plain data out."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic_ai.messages import (
    ImageUrl,
    ModelMessage,
    ModelRequest,
    ModelResponse,
    TextPart,
    UserContent,
    UserPromptPart,
)

from threadline.pipeline.budget import BudgetParts
from threadline.pipeline.contracts import FileRef
from threadline.pipeline.errors import InvalidRequest, SnapshotCorrupt
from threadline.pipeline.history import (
    MAX_NATIVE_FILE_BYTES,
    FileCheck,
    FileTally,
    ThreadRead,
    attachment_line,
    budgeted_history,
    decode_messages,
    encode_messages,
    extract_thread,
    replay_files,
    turn_messages,
)
from threadline.pipeline.records import MessageRecord
from threadline.pipeline.tokens import CharsTokenizer, count_messages


def msg(id: str, parent: str | None, *, query: str = "", answer: str = "", status: str = "succeeded",
        at: float = 0.0) -> MessageRecord:
    return MessageRecord(id=id, conversation_id="c", parent_id=parent, turn_id=id, query=query or f"q-{id}",
                         answer=answer or f"a-{id}", status=status, created_at=at)  # type: ignore[arg-type]


def newest_first(*records: MessageRecord) -> list[MessageRecord]:
    return sorted(records, key=lambda m: m.created_at, reverse=True)


def test_linear_thread_oldest_first() -> None:
    records = newest_first(msg("a", None, at=1), msg("b", "a", at=2), msg("c", "b", at=3))
    thread, truncated = extract_thread(records, "c")
    assert [m.id for m in thread] == ["a", "b", "c"] and not truncated


def test_branch_keeps_only_the_path_to_the_start() -> None:
    # b1 and b2 both answer a (b2 is an edit); c follows b1
    records = newest_first(msg("a", None, at=1), msg("b1", "a", at=2), msg("b2", "a", at=3), msg("c", "b1", at=4))
    assert [m.id for m in extract_thread(records, "c")[0]] == ["a", "b1", "c"]
    assert [m.id for m in extract_thread(records, "b2")[0]] == ["a", "b2"]


def test_unrelated_regeneration_root_between_a_message_and_its_parent_does_not_cut_the_thread() -> None:
    """Dify's walk stops at the first parentless message it meets in time order, even when that
    regenerated root belongs to another branch, silently dropping the real history."""
    records = newest_first(
        msg("root1", None, at=1),
        msg("m2", "root1", at=2),
        msg("root2", None, at=3),  # a regeneration of the first message: another branch
        msg("m4", "m2", at=4),  # continues the first branch
    )
    thread, truncated = extract_thread(records, "m4")
    assert [m.id for m in thread] == ["root1", "m2", "m4"] and not truncated


def test_read_bound_truncates_and_says_so() -> None:
    records = newest_first(msg("b", "a", at=2), msg("c", "b", at=3))  # "a" fell outside the bounded read
    thread, truncated = extract_thread(records, "c")
    assert [m.id for m in thread] == ["b", "c"] and truncated


def test_no_parent_means_no_history() -> None:
    assert extract_thread([msg("a", None)], None) == ([], False)


def test_unknown_parent_is_a_clear_error() -> None:
    with pytest.raises(InvalidRequest, match="not in this conversation"):
        extract_thread([msg("a", None)], "zzz")


def test_a_cycle_is_reported_not_looped() -> None:
    with pytest.raises(SnapshotCorrupt):
        extract_thread([msg("a", "b"), msg("b", "a")], "a")


@st.composite
def trees(draw: st.DrawFn) -> list[MessageRecord]:
    """Random message trees: each message's parent is any earlier message, or none (a new root)."""
    size = draw(st.integers(min_value=1, max_value=40))
    records = []
    for i in range(size):
        parent = draw(st.one_of(st.none(), st.integers(0, i - 1))) if i else None
        records.append(msg(f"m{i}", None if parent is None else f"m{parent}", at=float(i)))
    return records


@settings(max_examples=200, deadline=None)
@given(trees(), st.data())
def test_thread_is_exactly_the_parent_chain(records: list[MessageRecord], data: st.DataObject) -> None:
    start = data.draw(st.sampled_from(records))
    by_id = {m.id: m for m in records}
    expected: list[str] = []
    current: str | None = start.id
    while current is not None:
        expected.append(current)
        current = by_id[current].parent_id
    thread, truncated = extract_thread(newest_first(*records), start.id)
    assert [m.id for m in thread] == expected[::-1] and not truncated
    assert thread[0].parent_id is None
    assert all(child.parent_id == parent.id for parent, child in itertools.pairwise(thread))


def test_assembly_uses_stored_messages_and_falls_back_to_text() -> None:
    stored = [ModelRequest(parts=[UserPromptPart("q-a")]), ModelResponse(parts=[TextPart("stored answer")])]
    thread = [msg("a", None), msg("b", "a", query="imported", answer="old text"),
              msg("c", "b", status="failed", answer="")]
    snapshots = {"a": encode_messages(stored)}
    history = [m for record in thread for m in turn_messages(record, snapshots.get(record.id))]
    assert history[:2] == stored
    assert [type(m).__name__ for m in history[2:]] == ["ModelRequest", "ModelResponse"]
    assert history[2].parts[0].content == "imported"  # type: ignore[union-attr]
    assert turn_messages(thread[2], None) == []  # a failed turn with nothing stored adds nothing


def test_stored_messages_round_trip_and_corruption_is_a_stable_error() -> None:
    messages = [ModelRequest(parts=[UserPromptPart("hi")]), ModelResponse(parts=[TextPart("hello")])]
    assert decode_messages(encode_messages(messages), where="x") == messages
    with pytest.raises(SnapshotCorrupt, match="message m1"):
        decode_messages(b'[{"kind": "nonsense"}]', where="message m1")


# --- files of earlier turns -----------------------------------------------------------------------

CAT, GONE, SLOW = "https://files.test/u/cat.png", "https://files.test/u/gone.png", "https://files.test/u/report.pdf"
DATA = "data:image/png;base64," + "A" * 400
CHECKS = {CAT: FileCheck("available", 12_345), GONE: FileCheck("missing")}


def file_turn(id: str, parent: str | None, files: list[FileRef], *, vision: bool) -> tuple[MessageRecord, bytes]:
    """A stored turn whose query came with `files`, as `user_prompt` stored it for a (non-)vision model."""
    record = MessageRecord(id=id, conversation_id="c", parent_id=parent, turn_id=id, query=f"q-{id}", files=files,
                           answer=f"a-{id}", status="succeeded")
    content: list[UserContent] = [record.query]
    content += [ImageUrl(url=f.url) if vision and f.type == "image" else attachment_line(f) for f in files]
    return record, encode_messages([ModelRequest(parts=[UserPromptPart(content)]),
                                    ModelResponse(parts=[TextPart(record.answer)])])


def prompt(messages: list[ModelMessage]) -> list[object]:
    first = messages[0]
    assert isinstance(first, ModelRequest) and isinstance(first.parts[0], UserPromptPart)
    return list(first.parts[0].content)


IMAGES = [FileRef(type="image", url=CAT, mime="image/png"), FileRef(type="image", url=GONE, mime="image/png"),
          FileRef(type="document", url=SLOW, mime="application/pdf"), FileRef(type="image", url=DATA)]


def test_a_recent_turn_sends_images_natively_to_a_vision_model_and_skips_missing_files() -> None:
    record, snapshot = file_turn("t1", None, IMAGES, vision=True)
    messages, tally = replay_files(record, decode_messages(snapshot, where="t"), native=True, checks=CHECKS)
    assert prompt(messages) == [
        "q-t1", ImageUrl(url=CAT),
        "[file report.pdf: document, application/pdf]",  # not an image, and not checked: its reference
        "[file (inline data): image, 300 bytes]",  # a data URL never goes again as its bytes
    ]
    assert tally == FileTally(kept=1, replayed_as_reference=2, missing=1)


def test_an_older_turn_or_a_model_without_vision_gets_references_naming_the_files() -> None:
    for vision in (True, False):
        record, snapshot = file_turn("t1", None, IMAGES[:2], vision=vision)
        messages, tally = replay_files(record, decode_messages(snapshot, where="t"), native=False, checks=CHECKS)
        assert prompt(messages) == ["q-t1", "[file cat.png: image, image/png, 12,345 bytes]"]
        assert tally == FileTally(kept=0, replayed_as_reference=1, missing=1)
    big = {CAT: FileCheck("available", MAX_NATIVE_FILE_BYTES + 1)}
    record, snapshot = file_turn("t1", None, IMAGES[:1], vision=True)
    messages, _ = replay_files(record, decode_messages(snapshot, where="t"), native=True, checks=big)
    assert prompt(messages) == ["q-t1", f"[file cat.png: image, image/png, {MAX_NATIVE_FILE_BYTES + 1:,} bytes]"]


def test_the_budget_counts_turns_as_their_files_are_replayed_and_only_the_newest_turn_sends_images() -> None:
    first, first_snapshot = file_turn("t1", None, IMAGES[:2], vision=True)
    second, second_snapshot = file_turn("t2", "t1", IMAGES[:1], vision=True)
    budget = BudgetParts(context_window=11_000, max_output=1000, safety_margin=0, instructions=0, query=0, tools=0)
    read = ThreadRead(rows=[first, second], snapshots={"t1": first_snapshot, "t2": second_snapshot},
                      counts={"t1": 5, "t2": 5}, complete=True, previous_start=None, budget=budget,
                      tokenizer="chars/4", files=CHECKS, vision=True, counter=CharsTokenizer())
    messages, window, _, files = budgeted_history(read, low_water=0.7)
    assert prompt(messages[:1]) == ["q-t1", "[file cat.png: image, image/png, 12,345 bytes]"]
    assert prompt(messages[2:3]) == ["q-t2", ImageUrl(url=CAT)]
    assert files == {"kept": 1, "replayed_as_reference": 1, "missing": 1}
    # t1 is counted with its reference text (more than its stored count), t2 as stored (an image counts nothing)
    tokenizer = CharsTokenizer()
    assert window.tokens == count_messages(messages, tokenizer) and window.tokens > 10
