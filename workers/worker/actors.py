"""The actors: one per stage of the stage graph, run by the runner of its kind, the control
actor and the completion webhooks' actor. Their names and queues are the public queue contract (`pipeline.stages`)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import dramatiq
from dramatiq.middleware import CurrentMessage

from threadline.pipeline.stages import Stage, StageGraph, StageKind
from threadline.workers.protocol.names import CANCEL_ACTOR, CONTROL_QUEUE, WEBHOOK_ACTOR, WEBHOOK_QUEUE
from threadline.workers.storage.base import in_shard, shard_in
from threadline.workers.worker.runners.admit import run_admit
from threadline.workers.worker.runners.cancel import run_cancel
from threadline.workers.worker.runners.common import Malformed
from threadline.workers.worker.runners.compaction import run_compaction
from threadline.workers.worker.runners.finish import run_finish
from threadline.workers.worker.runners.memory import run_memory
from threadline.workers.worker.runners.model import run_model
from threadline.workers.worker.runners.transform import run_transform
from threadline.workers.worker.runners.webhook import run_webhook
from threadline.workers.worker.runtime import Runtime, RuntimeRef

Runner = Callable[[Runtime, Stage, object], Awaitable[None]]
RUNNERS: dict[StageKind, Runner] = {
    "admit": run_admit,
    "transform": run_transform,
    "model": run_model,
    "finish": run_finish,
    "compaction": run_compaction,
    "memory": run_memory,
}


def declare_actors(broker: dramatiq.Broker, graph: StageGraph, ref: RuntimeRef, *,
                   max_retries: int) -> dict[str, dramatiq.Actor[Any, Any]]:
    """Register the actors of `graph` (and the control actor) on `broker`."""
    # a process holds hundreds of model messages at once (`calls.py`): the fast stages' messages
    # go to a free thread before them (dramatiq runs a lower number first)
    declared = {stage.name: _declare(broker, stage.name, stage.queue, _stage_actor(ref, stage),
                                     priority=15 if stage.kind == "model" else 10, max_retries=max_retries)
                for stage in graph}

    async def cancel(*args: object, **kwargs: object) -> None:
        # (turn_id) or (turn_id, reason); anything else is refused by the runner, not retried
        ok = 1 <= len(args) <= 2 and not kwargs
        with in_shard(_message_shard()):
            await run_cancel(ref.get(), args[0] if ok else Malformed(), args[1] if ok and len(args) == 2 else "")

    declared[CANCEL_ACTOR] = _declare(broker, CANCEL_ACTOR, CONTROL_QUEUE, cancel, priority=0,
                                      max_retries=max_retries)

    async def deliver(*args: object, **kwargs: object) -> None:
        # after the turn: the lowest priority (one argument, else refused by the runner)
        with in_shard(_message_shard()):
            await run_webhook(ref.get(), args[0] if len(args) == 1 and not kwargs else Malformed())

    declared[WEBHOOK_ACTOR] = _declare(broker, WEBHOOK_ACTOR, WEBHOOK_QUEUE, deliver, priority=20,
                                       max_retries=max_retries)
    return declared


def _stage_actor(ref: RuntimeRef, stage: Stage) -> Callable[..., Coroutine[Any, Any, None]]:
    runner = RUNNERS[stage.kind]

    async def run(*args: object, **kwargs: object) -> None:
        # a stage message carries exactly one argument; anything else is refused by the runner at
        # once (as malformed input), not retried as a crash
        arg = args[0] if len(args) == 1 and not kwargs else Malformed(args[0] if args else None)
        with in_shard(_message_shard()):
            await runner(ref.get(), stage, arg)

    return run


def _message_shard() -> int | None:
    """The shard of the message being run (sharded layout): the store's keys are bound to it."""
    message = CurrentMessage.get_current_message()
    return shard_in(message.options) if message is not None else None


def _declare(broker: dramatiq.Broker, name: str, queue: str, fn: Callable[..., Coroutine[Any, Any, None]],
             *, priority: int, max_retries: int) -> dramatiq.Actor[Any, Any]:
    return dramatiq.actor(actor_name=name, queue_name=queue, broker=broker, max_retries=max_retries,
                          priority=priority)(fn)
