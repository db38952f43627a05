"""The ids producers choose, and the one derived from a turn's: their rule, and checks of it that
load no pydantic (a regular expression), so a command that only names a turn (`threadline cancel`,
`events`) starts fast (`bench/cli.py`). The request models (`contracts.py`) build their `Id` and
`TurnId` fields from the same pattern and lengths."""

from __future__ import annotations

import re

#: Every id a producer chooses. No `:` (the key separator) and no braces (hash tags), so no id can
#: name another turn's, conversation's or agent's key: ids are isolated by construction.
ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.@-]*$"
MAX_ID_CHARS = 128
#: Shorter, so that the id of the conversation a turn starts (`c-<turn_id>`) is a valid id too.
MAX_TURN_ID_CHARS = 120
# the pattern as pydantic applies it: `$` is the end of the text (Python's would also match before
# a final newline), so the whole text must match
_WHOLE_ID = re.compile(ID_PATTERN.removeprefix("^").removesuffix("$"))


def new_conversation_id(turn_id: str) -> str:
    """The conversation a turn without `conversation_id` starts. Deterministic, so a redelivered
    first turn creates the same conversation and a producer can name it before it exists."""
    return f"c-{turn_id}"


def valid_id(value: object) -> str | None:
    """`value` when it is a valid id, else None."""
    return _checked(value, MAX_ID_CHARS)


def valid_turn_id(value: object) -> str | None:
    """`value` when it is a valid turn id, else None."""
    return _checked(value, MAX_TURN_ID_CHARS)


def _checked(value: object, max_chars: int) -> str | None:
    if isinstance(value, bytes | bytearray):  # as pydantic's lax `str`: UTF-8 bytes are text
        try:
            value = bytes(value).decode()
        except UnicodeDecodeError:
            return None
    if not isinstance(value, str) or not 1 <= len(value) <= max_chars or _WHOLE_ID.fullmatch(value) is None:
        return None
    return str(value)
