"""Which scripts would work on a Redis Cluster: the server's own record (MONITOR) of every script a
set of real turns runs, with the hash slots of the keys each call passed.

On a cluster every key a script touches must hash to one slot. The turn keys carry no hash tag (a
turn's record and its events stream hash apart) and the conversation keys are tagged
`{<conversation id>}`, so the scripts of the turn state machine cross slots today: `CROSSING_TODAY`
names them, and this test fails when a script starts crossing that did not (or stops: then it leaves
the list). Cluster mode (issue 24) empties it. dramatiq's own dispatch script passes only its
namespace and builds its key names inside Lua, which no check of KEYS can see: that is why it is to
be replaced, not audited.
"""

from __future__ import annotations

import hashlib
import re
import socket
import threading
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import get_args
from urllib.parse import urlparse

from redis.crc import key_slot

from tests.conftest import AgentFactory, WorkerPool, turn
from tests.support.turns import python_model
from tests.support.wait import wait_until
from tests.support.webhook_receiver import WebhookReceiver
from threadline.pipeline import events as ev
from threadline.pipeline.config import AgentConfig
from threadline.workers.clients.client import Client
from threadline.workers.storage import lua

#: The scripts whose calls pass keys of more than one slot today (turn keys with conversation keys,
#: or queue keys), as seen by the turns below.
CROSSING_TODAY = frozenset({"submit", "admit", "begin", "advance", "emit", "finish", "cancel", "delete_conversation",
                            "retry", "memory_note", "webhook_attempt"})
_QUOTED = re.compile(rb'"((?:[^"\\]|\\.)*)"')


def _unescape(raw: bytes) -> bytes:
    return raw.decode("unicode_escape").encode("latin-1")


@contextmanager
def monitored(url: str) -> Iterator[list[list[bytes]]]:
    """Every command the server runs while the block runs, as its words (MONITOR)."""
    address = urlparse(url)
    sock = socket.create_connection((address.hostname or "127.0.0.1", address.port or 6379))
    sock.sendall(b"MONITOR\r\n")
    commands: list[list[bytes]] = []
    stop = threading.Event()

    def read() -> None:
        buffer = b""
        while not stop.is_set():
            try:
                chunk = sock.recv(1 << 16)
            except OSError:
                return
            if not chunk:
                return
            buffer += chunk
            *lines, buffer = buffer.split(b"\r\n")
            commands.extend([_unescape(w) for w in _QUOTED.findall(line)] for line in lines if line.startswith(b"+1"))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        yield commands
    finally:
        stop.set()
        sock.shutdown(socket.SHUT_RDWR)
        sock.close()
        reader.join(timeout=5)


def script_slots(commands: list[list[bytes]], ids: set[str], *, prefix: str = "") -> dict[str, set[frozenset[int]]]:
    """Per script name, the sets of slots its calls' KEYS hashed to, for the calls whose keys name one
    of `ids` (a turn or a conversation of the test's own: other tests share the server), or, with
    `prefix`, every call whose keys are under it (a prefix of the test's own)."""
    names = {hashlib.sha1(lua.source(name).encode()).hexdigest(): name for name in get_args(lua.ScriptName)}
    seen: dict[str, set[frozenset[int]]] = defaultdict(set)
    for words in commands:
        if not words or words[0].upper() not in (b"EVALSHA", b"EVAL"):
            continue
        count = int(words[2])
        keys = words[3:3 + count]
        named = (all(k.decode(errors="replace").startswith(f"{prefix}:") for k in keys) if prefix
                 else any(i in k.decode(errors="replace") for k in keys for i in ids))
        if not keys or not named:
            continue
        name = names.get(words[1].decode(), words[1].decode()[:12])
        seen[name].add(frozenset(key_slot(k) for k in keys))
    return seen


def test_the_scripts_that_cross_slots_are_the_known_ones(
    workers: WorkerPool, client: Client, make_agent: AgentFactory
) -> None:
    agent = make_agent("offline:chat")
    with monitored(workers.url) as commands:
        first = client.submit(turn(agent, "hello"))
        assert isinstance(client.wait(first, timeout_s=60), ev.Succeeded)
        conversation = client.turn_state(first).conversation_id
        second = client.submit(turn(agent, "and again", conversation_id=conversation))
        client.cancel(second, "changed my mind")
        client.wait(second, timeout_s=60)
        client.delete_conversation(conversation, tenant_id="t1")
    slots = script_slots(commands, {first, second, conversation})
    assert {"submit", "admit", "begin", "advance", "finish", "emit"} <= set(slots), sorted(slots)
    crossing = {name for name, calls in slots.items() if any(len(s) > 1 for s in calls)}
    assert crossing == CROSSING_TODAY & set(slots), {name: sorted(map(sorted, calls)) for name, calls in slots.items()}


def branching_agent(client: Client, tmp_path: Path) -> str:
    """An agent whose turns take the other branches: a model call that fails once with a 503 (and
    is retried), `max_concurrency` model slots, long-term memory."""
    agent = f"agent-{uuid.uuid4().hex[:8]}"
    client.put_agent(AgentConfig.model_validate({
        "id": agent, "memory": {"long_term": {}},
        "model": {**python_model("failing", status=503, times=1, record=str(tmp_path / "calls.jsonl")),
                  "max_concurrency": 2}}))
    return agent


def test_retries_model_slots_webhooks_and_memory_cross_only_where_known(
    isolated: Callable[..., WorkerPool], tmp_path: Path
) -> None:
    """The other branches a turn takes: a model call that fails transiently and is retried (retry),
    a model with `max_concurrency` (slot_*), a completion webhook (webhook_*) and long-term memory
    (memory_*)."""
    pool = isolated({"TL_WEBHOOK_HOSTS": "all", "TL_DELAY_POLL_MS": "100"}).start(processes=1, threads=4)
    client = Client(pool.url, prefix=pool.prefix)
    agent = branching_agent(client, tmp_path)
    with WebhookReceiver() as receiver, monitored(pool.url) as commands:
        first = client.submit(turn(agent, "my name is Ada", webhook_url=receiver.url))
        assert isinstance(client.wait(first, timeout_s=60), ev.Succeeded)
        wait_until(lambda: receiver.delivered() == [first], timeout_s=30)
        conversation = client.turn_state(first).conversation_id
        ids = {first, conversation, agent, "t1/u1"}  # the model slots are the agent's, the memory the user's
        # the attempt is recorded after the receiver answered, and memory is applied after the turn:
        # both after what the waits above saw
        wait_until(lambda: {"memory_apply", "webhook_attempt"} <= set(script_slots(list(commands), ids)),
                   timeout_s=30)
    slots = script_slots(commands, ids)
    assert {"retry", "slot_acquire", "slot_release", "webhook_attempt", "memory_apply"} <= set(slots), sorted(slots)
    crossing = {name for name, calls in slots.items() if any(len(s) > 1 for s in calls)}
    assert crossing == CROSSING_TODAY & set(slots), {name: sorted(map(sorted, calls)) for name, calls in slots.items()}
    client.close()


def test_in_the_sharded_layout_no_script_crosses_slots(isolated: Callable[..., WorkerPool], tmp_path: Path) -> None:
    """TL_SHARDS: every script call of every path above — turns, a cancel, a delete, a retried model
    call, model slots, a webhook, long-term memory, and the broker's own fetches, acks and the
    heartbeat — passes keys of one slot (all of the test's prefix audited, not only named ids)."""
    pool = isolated({"TL_SHARDS": "4", "TL_WEBHOOK_HOSTS": "all", "TL_DELAY_POLL_MS": "100"})
    with monitored(pool.url) as commands:
        pool.start(processes=1, threads=4)
        client = Client(pool.url, prefix=pool.prefix)
        agent = branching_agent(client, tmp_path)
        with WebhookReceiver() as receiver:
            first = client.submit(turn(agent, "my name is Ada", webhook_url=receiver.url))
            assert isinstance(client.wait(first, timeout_s=60), ev.Succeeded)
            wait_until(lambda: receiver.delivered() == [first], timeout_s=30)
            conversation = client.turn_state(first).conversation_id
            second = client.submit(turn(agent, "and again", conversation_id=conversation))
            client.cancel(second, "changed my mind")
            client.wait(second, timeout_s=60)
            wait_until(lambda: {"memory_apply", "webhook_attempt"} <= set(script_slots(list(commands), set(),
                                                                                      prefix=pool.prefix)),
                       timeout_s=30)
            assert client.delete_conversation(conversation, tenant_id="t1").status == "deleted"
        client.close()
    slots = script_slots(commands, set(), prefix=pool.prefix)
    assert {"submit", "admit", "begin", "advance", "finish", "retry", "slot_acquire", "webhook_attempt",
            "memory_note", "memory_apply", "delete_conversation", "heartbeat"} <= set(slots), sorted(slots)
    crossing = {name: sorted(map(sorted, calls)) for name, calls in slots.items() if any(len(s) > 1 for s in calls)}
    assert crossing == {}
