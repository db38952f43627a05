"""What every verb of the `threadline` command shares: the exit codes (defined once), the one-line
failure, finding the server (the embedded one when `REDIS_URL` is unset), rendering and following events."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from threadline.pipeline.redact import redact
from threadline.workers.settings import Settings

# Light at import (no redis, no pydantic): every verb module imports this one, and `threadline --help`
# must not pay for what only a command that talks to a server needs (`bench/cli.py`).
if TYPE_CHECKING:
    from threadline.pipeline.events import Event
    from threadline.workers.clients.client import Client
    from threadline.workers.storage.embedded import EmbeddedServer


#: Exit codes (also in `threadline --help` and docs/clients.md). 1: a followed turn ended failed,
#: cancelled or timed out (or an unexpected error); 5: `conversations delete` found the conversation busy.
EXIT_TURN_FAILED = 1

EXIT_BAD_INPUT = 2

EXIT_NOT_FOUND = 3

EXIT_UNREACHABLE = 4

EXIT_TIMEOUT = 124

EXIT_INTERRUPTED = 130

EXIT_BROKEN_PIPE = 141

#: `conversations delete` (and `submit --on-busy reject`) exit 5 while a turn of the conversation runs or waits.
EXIT_BUSY = 5

EXIT_CODES = (
    (0, "done"),
    (EXIT_TURN_FAILED, "the followed turn ended failed, cancelled or timed_out; or an unexpected error"),
    (EXIT_BAD_INPUT, "bad input: usage, a file, a turn request, a setting"),
    (EXIT_NOT_FOUND, "not found: turn, conversation, agent, version"),
    (EXIT_UNREACHABLE, "cannot reach the server (or none runs for TL_DATA_DIR)"),
    (EXIT_BUSY, "busy: `conversations delete` of a conversation with a running turn; `submit --on-busy reject` "
                "while a turn of the conversation runs or waits"),
    (EXIT_TIMEOUT, "--timeout ran out (the turn keeps running)"),
    (EXIT_INTERRUPTED, "interrupted (Ctrl-C; a followed turn keeps running)"),
    (EXIT_BROKEN_PIPE, "the reader of the output went away (`| head`)"),
)


class Exit(Exception):
    """A failure the user can act on: `message` is printed as one line on stderr, `code` is the exit code."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def display_url(url: str) -> str:
    """A server URL fit to print: its user and password masked."""
    return redact(url)


def join(settings: Settings) -> str:
    """The server of a command that only talks to one, found as `Client()` finds it
    (`workers/clients/server.py`): REDIS_URL, else the running embedded server. Never starts one."""
    from threadline.workers.clients.server import NoServer, server_url

    try:
        return server_url(settings)
    except NoServer as e:
        raise Exit(EXIT_UNREACHABLE, str(e)) from None


def producer(settings: Settings) -> Client:
    from threadline.workers.clients.client import Client

    return Client(join(settings), prefix=settings.prefix, policy=settings.policy, shards=settings.shards)


def connect(settings: Settings) -> tuple[str, EmbeddedServer | None]:
    """For `worker` and `demo`: REDIS_URL when set, else the embedded server of this data dir (joined,
    or started here)."""
    if settings.redis_url:
        return settings.redis_url, None
    from threadline.workers.storage.embedded import ensure_embedded

    server = ensure_embedded(settings.data_dir)
    return server.url, server


def render_event(event: Event, *, as_json: bool) -> str | None:
    """One event for the terminal: JSON lines, or text deltas inline and the rest as notes."""
    from threadline.pipeline import events

    if as_json:
        return event.model_dump_json()
    if isinstance(event, events.TextDelta):
        return event.text
    if isinstance(event, events.StageEvent):
        return None
    if isinstance(event, events.Failed | events.Cancelled | events.TimedOut):
        return f"\n[{event.type}] {event.code}" + (f": {event.message}" if event.message else "") + "\n"
    if isinstance(event, events.Succeeded | events.Paused):
        return f"\n[{event.type}] {event.usage.model_dump_json()}\n"
    fields = event.model_dump(mode="json", exclude={"type", "turn_id", "seq"})
    return f"\n[{event.type}] " + json.dumps(fields) + "\n"


def follow(client: Client, turn_id: str, *, as_json: bool, live: bool, timeout_s: float | None = None) -> int:
    """Print the turn's events; exit 0 when it succeeded or paused (or has not ended), 1 otherwise.
    Ctrl-C and a `--timeout` running out leave the turn running, and say how to cancel it."""
    status = "unknown"
    out = Output()
    try:
        from threadline.pipeline.events import TERMINAL_TYPES

        for event in client.events(turn_id, follow=live, timeout_s=timeout_s):
            line = render_event(event, as_json=as_json)
            if line is not None:
                out.write(line + ("\n" if as_json else ""))
            if event.type in TERMINAL_TYPES:
                status = event.type
    except KeyboardInterrupt:
        out.end_line(always=sys.stdout.isatty())  # a terminal echoed `^C` where the cursor stood
        raise still_running(turn_id) from None
    except TimeoutError:
        out.end_line()
        raise Exit(EXIT_TIMEOUT, f"turn {turn_id} did not finish within {timeout_s:g} s; it keeps running (cancel "
                                 f"it with `threadline cancel {turn_id}`)") from None
    return 0 if status in ("succeeded", "paused", "unknown") else EXIT_TURN_FAILED


class Output:
    """stdout as a followed turn writes it: streamed text runs on without newlines, so a message that
    interrupts it (a timeout, Ctrl-C, on stderr) first ends the line the text left open."""

    def __init__(self) -> None:
        self.open_line = False

    def write(self, text: str) -> None:
        if text:
            sys.stdout.write(text)
            sys.stdout.flush()
            self.open_line = not text.endswith("\n")

    def end_line(self, *, always: bool = False) -> None:
        if self.open_line or always:
            self.write("\n")


def still_running(turn_id: str) -> Exit:
    return Exit(EXIT_INTERRUPTED, f"interrupted; turn {turn_id} keeps running (cancel it with "
                                  f"`threadline cancel {turn_id}`)")


def read_input(name: str) -> str:
    """A file's text, or stdin's for "-"; one that cannot be read is bad input."""
    try:
        return sys.stdin.read() if name == "-" else Path(name).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise Exit(EXIT_BAD_INPUT, f"cannot read {name}: {getattr(e, 'strerror', None) or e}") from None


def integer_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: a whole number of at least `minimum`."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, not {value}")
        return value

    return parse


at_least_one = integer_at_least(1)


def seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be more than 0, not {text}")
    return value


def fail(code: int, message: str) -> int:
    print(f"threadline: {message}", file=sys.stderr)
    return code
