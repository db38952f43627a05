"""Wire names that are not stage names: the control queue and its cancel actor (the stage graph in
`pipeline/stages.py` names every stage's actor and queue), and the list of every queue a graph's
workers consume. Raw producers use these names (docs/protocol.md)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final, Protocol

#: The control queue and its actor: `cancel(turn_id, reason)`.
CONTROL_QUEUE: Final = "control"
CANCEL_ACTOR: Final = "cancel"


class _Queued(Protocol):
    @property
    def queue(self) -> str: ...


def queues(stages: Iterable[_Queued]) -> tuple[str, ...]:
    """Every queue the workers of a stage graph consume: each stage's, then the control queue."""
    return (*(s.queue for s in stages), CONTROL_QUEUE)
