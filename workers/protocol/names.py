"""Wire names that are not stage names: the control queue and its cancel actor, the completion
webhooks' queue and its actor (the stage graph in `pipeline/stages.py` names every stage's actor
and queue), and the list of every queue a graph's workers consume. Raw producers use these names
(docs/protocol.md)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final, Protocol

#: The control queue and its actor: `cancel(turn_id, reason)`.
CONTROL_QUEUE: Final = "control"
CANCEL_ACTOR: Final = "cancel"
#: The completion webhooks' queue and its actor: `deliver_webhook({"delivery_id", "attempt"})`.
WEBHOOK_QUEUE: Final = "webhooks"
WEBHOOK_ACTOR: Final = "deliver_webhook"
#: The message option naming the shard whose queue a message came from (sharded layout): the
#: consumer stamps it, the stages bind their keys to it, and the broker re-enqueues by it.
SHARD_OPTION: Final = "tl_shard"


class _Queued(Protocol):
    @property
    def queue(self) -> str: ...


def queues(stages: Iterable[_Queued]) -> tuple[str, ...]:
    """Every queue the workers of a stage graph consume: each stage's, the control queue, the webhooks'."""
    return (*(s.queue for s in stages), CONTROL_QUEUE, WEBHOOK_QUEUE)
