"""A dramatiq message as producers write it (`RedisBroker.enqueue`'s layout and dramatiq's JSON
encoding), built without importing dramatiq: the producer commands start in a fraction of the time
(`bench/cli.py`); `tests/workers/test_raw_producer.py` checks the bytes equal dramatiq's own."""

from __future__ import annotations

import json
from typing import Any


def build_message(
    queue: str,
    actor: str,
    args: tuple[Any, ...],
    *,
    message_id: str,
    now_ms: int,
    delay_ms: int | None = None,
) -> tuple[str, str, bytes]:
    """A dramatiq message as `RedisBroker.enqueue` writes it: (queue to push to, id, data).

    `options.redis_message_id` must equal the hash field the message is stored under.
    """
    options: dict[str, Any] = {"redis_message_id": message_id}
    target = queue
    if delay_ms:
        target = f"{queue}.DQ"
        options["eta"] = now_ms + delay_ms
    # the fields of `dramatiq.Message.asdict()`, in its order, encoded as its JSONEncoder does
    message = {"queue_name": target, "actor_name": actor, "args": list(args), "kwargs": {}, "options": options,
               "message_id": message_id, "message_timestamp": now_ms}
    return target, message_id, json.dumps(message, separators=(",", ":")).encode("utf-8")
