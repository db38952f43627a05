"""Helpers of the integration tests that follow turns through real workers: a `python:` model spec,
a model's request log, waiting for an event, the one terminal event, who holds a turn, and a dramatiq
message as a raw producer writes it."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from threadline.pipeline import events as ev
from threadline.pipeline.events import TERMINAL_TYPES
from threadline.workers.clients.client import Client
from threadline.workers.protocol.keys import Keys


def python_model(factory: str, **options: Any) -> dict[str, Any]:
    return {"provider": "python", "name": f"tests.support.models:{factory}", "options": options}


def records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def all_events(client: Client, turn_id: str) -> list[ev.Event]:
    return list(client.events(turn_id))


def wait_for_event(client: Client, turn_id: str, kind: str, timeout_s: float = 20) -> ev.Event:
    for event in client.events(turn_id, follow=True, timeout_s=timeout_s):
        if event.type == kind:
            return event
        if event.type in TERMINAL_TYPES:
            raise AssertionError(f"turn ended before {kind}: {event}")
    raise AssertionError(kind)


def assert_one_terminal(client: Client, turn_id: str) -> ev.Terminal:
    events = all_events(client, turn_id)
    terminals = [e for e in events if isinstance(e, ev.Terminal)]
    assert len(terminals) == 1, [e.type for e in events]
    assert events[-1] is terminals[0]
    return terminals[0]


def keys_of(client: Client, turn_id: str) -> Keys:
    """The keys of the turn's shard (the sharded layout's need it; one server's are `client.keys`)."""
    keys = client.turn_keys(turn_id)
    assert keys is not None, f"no turn {turn_id}"
    return keys


def holder_pid(client: Client, turn_id: str) -> int:
    """The pid of the worker process running the turn's stage now (its worker id is host:pid:tag)."""
    holder = client.redis.hget(keys_of(client, turn_id).turn(turn_id), "holder")
    assert holder, "nobody holds the turn"  # absent, or "" (handed over)
    return int(holder.decode().split(":")[-2])


def assert_gapless(client: Client, turn_id: str) -> list[ev.Event]:
    seen = list(client.events(turn_id))
    assert [e.seq for e in seen] == list(range(1, len(seen) + 1))
    return seen


def raw_message(queue: str, mid: str, actor: str, args: list[Any], **fields: Any) -> bytes:
    """A dramatiq message as the README's raw producer writes it."""
    return json.dumps({"queue_name": queue, "actor_name": actor, "args": args, "kwargs": {},
                       "options": {"redis_message_id": mid}, "message_id": mid,
                       "message_timestamp": int(time.time() * 1000), **fields}).encode()
