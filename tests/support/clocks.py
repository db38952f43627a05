"""The times the system records itself, for tests that check how long something took: a stream
entry id is a millisecond of the server's clock, the turn hash's `*_at` fields are the times its
scripts were told (`now`). Measured there, a figure does not include how late the test process got
to look, which on a loaded machine can be seconds."""

from __future__ import annotations

from tests.support.turns import keys_of
from threadline.pipeline import events as ev
from threadline.workers.clients.client import Client


def entry_s(entry_id: str) -> float:
    """When the server appended a stream entry ("1700000000000-3"), in seconds since the epoch."""
    return int(entry_id.partition("-")[0]) / 1000


def stamped(client: Client, turn_id: str) -> list[tuple[float, ev.Event]]:
    """The turn's events, each with the time the server appended it."""
    return [(entry_s(entry_id), event) for entry_id, event in client.entries(turn_id)]


def turn_times(client: Client, turn_id: str) -> dict[str, float]:
    """The turn hash's recorded times (`admitted_at`, `cancel_requested_at`, `finished_at`, ...)."""
    fields = client.redis.hgetall(keys_of(client, turn_id).turn(turn_id))
    return {k.decode(): float(v) for k, v in fields.items() if k.decode().endswith("_at") and v}


def hops_s(client: Client, turn_id: str) -> list[tuple[str, float]]:
    """Every hand-off of the turn: (the stage that started, seconds since the stage before it
    finished), on the server's clock."""
    hops: list[tuple[str, float]] = []
    finished: float | None = None
    for at, event in stamped(client, turn_id):
        if isinstance(event, ev.StageEvent) and event.status == "started" and finished is not None:
            hops.append((event.stage, at - finished))
        if isinstance(event, ev.StageEvent) and event.status == "finished":
            finished = at
    return hops
