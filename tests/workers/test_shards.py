"""The sharded key layout: a conversation's keys, its turns' keys, its shard's queues and indexes
hash to one Redis Cluster slot; one server's layout is unchanged; keys that need a shard refuse to
be built without one; the shard tags spread evenly over equal slot ranges."""

from __future__ import annotations

from collections import Counter

import pytest
from redis.crc import key_slot

from threadline.workers.protocol.keys import SLOTS, CrossShard, Keys, UnboundShard, shard_of, shard_tag, slot


def test_the_shard_function_is_the_servers_own_slot() -> None:
    for text in ("c-t1", "conv-123", "a", "x" * 128, "é"):
        assert slot(text) == key_slot(text.encode())
        assert shard_of(text, 16) == key_slot(text.encode()) % 16


def test_one_servers_layout_is_unchanged() -> None:
    k = Keys("tl")
    assert (k.conversation("c1"), k.messages("c1"), k.turn("t1"), k.events("t1"), k.queue("resolve"), k.running(),
            k.worker("w"), k.doorbell_channel(), k.on(3).turn("t1"), k.of_conversation("c1").turn("t")) == (
        "tl:conv:{c1}", "tl:conv:{c1}:msgs", "tl:turn:t1", "tl:turn:t1:events", "tl:q:resolve",
        "tl:running", "tl:worker:w", "tl:doorbell", "tl:turn:t1", "tl:turn:t")
    assert k.every_shard() == [k]


def test_a_conversation_its_turns_its_queues_and_indexes_share_one_slot() -> None:
    k = Keys("tl", shards=16)
    for cid in ("c-t1", "conv-123", "another"):
        bound = k.of_conversation(cid)
        keys = [*bound.conversation_keys(cid), *bound.turn_keys("t9", ["admit", "invoke"]), bound.running(),
                bound.activity(), bound.tenant_conversations("t1"), bound.usage("t1"), bound.webhook("t9"),
                bound.webhooks(), bound.dead_letters(), bound.queue("resolve"), bound.queue_messages("resolve.DQ"),
                bound.dead_queue("resolve"), bound.acks("b1", "resolve"), bound.turn_user("t9"),
                bound.conversation("-")]
        assert len({key_slot(key.encode()) for key in keys}) == 1, keys
        assert bound.shard == shard_of(cid, 16)
    fleet = [k.worker("w"), k.worker_turns("w"), k.workers(), k.heartbeats()]
    assert len({key_slot(key.encode()) for key in fleet}) == 1


def test_a_key_that_needs_a_shard_is_refused_without_one() -> None:
    k = Keys("tl", shards=8)
    for build in (lambda: k.turn("t1"), lambda: k.queue("resolve"), lambda: k.running(), k.doorbell_channel):
        with pytest.raises(UnboundShard):
            build()
    other = (k.shard_of("c1") or 0) + 1
    with pytest.raises(CrossShard):
        k.on(other % 8).conversation("c1")
    with pytest.raises(UnboundShard):
        k.on(8)
    # conversation keys need none: the conversation names its shard
    assert k.conversation("c1") == k.of_conversation("c1").conversation("c1")


@pytest.mark.parametrize(("count", "primaries"), [(3, 3), (16, 4), (48, 3), (1023, 3), (64, 3)])
def test_shard_tags_spread_evenly_over_equal_slot_ranges(count: int, primaries: int) -> None:
    per_primary = Counter(key_slot(shard_tag(i, count).encode()) * primaries // SLOTS for i in range(count))
    assert sum(per_primary.values()) == count and len(per_primary) == primaries
    if count % primaries == 0:  # an exact split
        assert set(per_primary.values()) == {count // primaries}
    else:  # the shards whose range a primary's boundary cuts fall to either side
        assert max(per_primary.values()) <= count // primaries + 2


def test_a_turns_pointer_names_its_shard_or_nothing() -> None:
    k = Keys("tl", shards=4)
    assert k.pointed(b"2") == k.on(2) and k.pointed("3") == k.on(3)
    assert [k.pointed(raw) for raw in (None, b"4", b"-1", b"x", "")] == [None] * 5
