"""The five endings of a turn, defined once and light (no pydantic): the events (`events.py`), the
clients, the CLI and the Lua prelude (generated at load, `workers/storage/lua.py`) take them from here,
so a command that only reads a status never loads the event models (`bench/cli.py`)."""

from __future__ import annotations

from typing import Literal, get_args

TerminalType = Literal["succeeded", "paused", "failed", "cancelled", "timed_out"]
TERMINAL_TYPES: frozenset[str] = frozenset(get_args(TerminalType))
