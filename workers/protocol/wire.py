"""A dramatiq message as producers write it (`RedisBroker.enqueue`'s layout and dramatiq's JSON
encoding), built without importing dramatiq, so the producer commands start in a fraction of the time
(`bench/cli.py`); `tests/workers/test_raw_producer.py` checks the bytes equal dramatiq's own. Also the
bounds every reader of message bytes checks before parsing them (depth, the dead-letter stream's length)."""

from __future__ import annotations

import json
import re
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


#: JSON nested deeper than this is refused before it is parsed: the parser recurses, and a body
#: nested 100,000 deep raises RecursionError. Turn requests and stage envelopes are far shallower.
MAX_JSON_DEPTH = 64
#: The dead-letter stream keeps about this many entries (XADD MAXLEN ~).
DEAD_LETTERS_MAXLEN = 10_000

# A JSON string; an unterminated one runs to the end of the data, so the scan never restarts inside
# it (possessive quantifiers, no backtracking: linear on any input).
_JSON_STRING = re.compile(rb'"[^"\\]*+(?:\\.[^"\\]*+)*+(?:"|\\?\Z)', re.S)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")

def json_too_deep(data: bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether `data` nests arrays/objects deeper than `limit`, counting brackets outside strings;
    in C for the common case (few brackets), a Python loop over the brackets otherwise."""
    if data.count(b"[") + data.count(b"{") <= limit:
        return False
    brackets = _JSON_STRING.sub(b"", data).translate(None, _NOT_BRACKETS)
    depth = 0
    for byte in brackets:
        if byte in b"[{":
            depth += 1
            if depth > limit:
                return True
        else:
            depth -= 1
    return False
