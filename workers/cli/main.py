"""`threadline`: demo, worker, submit, events, cancel, agents (put, list, show, versions, publish, rollback, diff),
thread [--tree], conversations (list, delete), gateway, keys create, and the operations and memory verbs.

Every failure is one line on stderr and an exit code from the table below (docs/clients.md's too); the
commands that only talk to a server (all but `worker` and `demo`) never start one and import no
pydantic-ai, so `submit` and `cancel` finish in a few hundred milliseconds (`bench/cli.py`)."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import traceback
from collections.abc import Sequence
from typing import Any, NoReturn

from threadline.pipeline.busy import ON_BUSY_POLICIES
from threadline.pipeline.errors import AgentNotFound, ConversationNotFound, ThreadlineError
from threadline.pipeline.redact import redact
from threadline.workers.cli.agents import add_agents_parser
from threadline.workers.cli.common import (
    EXIT_BAD_INPUT,
    EXIT_BROKEN_PIPE,
    EXIT_BUSY,
    EXIT_CODES,
    EXIT_INTERRUPTED,
    EXIT_NOT_FOUND,
    EXIT_TIMEOUT,
    EXIT_TURN_FAILED,
    EXIT_UNREACHABLE,
    Exit,
    at_least_one,
    fail,
    seconds,
)
from threadline.workers.cli.gateway import add_gateway_parsers
from threadline.workers.cli.memory import add_memory_parser
from threadline.workers.cli.operations import add_operations_parser
from threadline.workers.cli.serve import cmd_demo, cmd_worker
from threadline.workers.cli.turns import (
    add_conversations_parser,
    cmd_cancel,
    cmd_events,
    cmd_submit,
    cmd_thread,
    cmd_turn_show,
)
from threadline.workers.cli.webhooks import add_webhooks_parser
from threadline.workers.settings import ENVIRONMENT, Settings

# Every module above is light (no redis, no pydantic): the parser is built from them alone, and each
# command imports what it needs when it runs, so `--version` and `--help` import neither (`bench/cli.py`).


class Parser(argparse.ArgumentParser):
    """A usage error is one line on stderr and exit 2 (`--help` has the rest)."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: {message} (see `{self.prog} --help`)\n")


class ShowVersion(argparse.Action):
    """`--version`: the installed package's version, looked up only when asked."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS,
                         help="print the version and exit")

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: str | Sequence[Any] | None, option_string: str | None = None) -> None:
        from importlib.metadata import version

        print(f"threadline {version('threadline')}")
        parser.exit()


def epilog() -> str:
    width = max(len(name) for name, _ in ENVIRONMENT)
    env = "\n".join(f"  {name.ljust(width)}  {meaning}" for name, meaning in ENVIRONMENT)
    codes = "\n".join(f"  {code:>3}  {meaning}" for code, meaning in EXIT_CODES)
    return f"environment variables:\n{env}\n\nexit codes:\n{codes}"


def parser() -> argparse.ArgumentParser:
    p = Parser(prog="threadline", description="LLM agent turns as a pipeline of queue workers.", epilog=epilog(),
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action=ShowVersion)
    sub = p.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="start workers and run a three-turn conversation")
    demo.add_argument("--delay-ms", type=int, default=35, help="offline model's pause between words")
    demo.set_defaults(func=cmd_demo)

    worker = sub.add_parser("worker", help="run worker processes (and the embedded server when REDIS_URL is unset)")
    worker.add_argument("--processes", type=at_least_one, help="worker processes (default: $TL_PROCESSES, 2)")
    worker.add_argument("--threads", type=at_least_one, help="threads per process (default: $TL_THREADS, 8)")
    worker.add_argument("--queues", nargs="*", default=[], metavar="QUEUE",
                        help="serve only these queues (default: all; an unknown name is refused)")
    worker.set_defaults(func=cmd_worker)

    submit = sub.add_parser("submit", help="enqueue a turn (JSON file, '-' for stdin, or flags)")
    submit.add_argument("file", nargs="?", help="the turn request (threadline.turn/v1 JSON); '-' reads stdin")
    for flag, meaning in (("tenant", "tenant_id (default demo)"), ("app", "app_id (default demo)"),
                          ("user", "user_id (default demo)"), ("agent", "agent_id"),
                          ("conversation", "conversation_id (default: a new conversation)"), ("query", "query"),
                          ("turn-id", "turn_id, the idempotency key (default: a new one)")):
        submit.add_argument(f"--{flag}", help=f"the request's {meaning}; overrides the file's")
    submit.add_argument("--parent", dest="parent_message_id", metavar="MESSAGE_ID",
                        help="answer after this message of the conversation instead of its tip: a branch "
                             "(`threadline thread --tree` shows the message ids)")
    submit.add_argument("--on-busy", dest="on_busy", choices=ON_BUSY_POLICIES,
                        help="when a turn of the conversation runs or waits: wait in line, refuse this one "
                             f"(exit {EXIT_BUSY}), or cancel the running one and answer this instead (rollback: "
                             "and drop its message); default: the agent's on_busy")
    submit.add_argument("--webhook-url", dest="webhook_url", metavar="URL",
                        help="POST the turn's terminal event here, signed, once it ends (docs/webhooks.md)")
    submit.add_argument("--follow", action="store_true", help="print the turn's events until it ends")
    submit.add_argument("--json", action="store_true", help="print JSON (with --follow: one event per line)")
    submit.add_argument("--timeout", type=seconds, default=None,
                        help=f"with --follow: stop following after this many seconds (exit {EXIT_TIMEOUT})")
    submit.set_defaults(func=cmd_submit)

    ev = sub.add_parser("events", help="print a turn's events")
    ev.add_argument("turn_id", help="the turn id")
    ev.add_argument("--follow", action="store_true", help="wait for new events until the turn ends")
    ev.add_argument("--json", action="store_true", help="one JSON event per line")
    ev.add_argument("--timeout", type=seconds, default=None,
                    help=f"with --follow: stop following after this many seconds (exit {EXIT_TIMEOUT})")
    ev.set_defaults(func=cmd_events)

    cancel = sub.add_parser("cancel", help="cancel a turn")
    cancel.add_argument("turn_id", help="the turn id")
    cancel.add_argument("--reason", help="recorded with the cancellation")
    cancel.set_defaults(func=cmd_cancel)

    add_agents_parser(sub)

    thread = sub.add_parser("thread", help="print a conversation's thread")
    thread.add_argument("conversation_id", help="the conversation id")
    thread.add_argument("--tree", action="store_true", help="every branch, not only the path to the tip")
    thread.set_defaults(func=cmd_thread)
    add_conversations_parser(sub)
    add_operations_parser(sub)
    add_gateway_parsers(sub)
    add_memory_parser(sub)
    add_webhooks_parser(sub)

    turn = sub.add_parser("turn", help="inspect a turn").add_subparsers(dest="turn", required=True)
    show = turn.add_parser("show", help="what a turn decided: budget, turns kept and dropped, tokenizer")
    show.add_argument("turn_id", help="the turn id")
    show.add_argument("--conversation", help="the turn's conversation (needed once its record expired)")
    show.add_argument("--json", action="store_true", help="print JSON")
    show.set_defaults(func=cmd_turn_show)
    return p


def main(argv: Sequence[str] | None = None) -> NoReturn:
    """The `threadline` program (a process of its own: `run` is what tests call in-process)."""
    args = sys.argv[1:] if argv is None else list(argv)
    if next((a for a in args if not a.startswith("-")), None) not in SERVING:
        skip_redis_metrics()
    raise SystemExit(run(argv))


def run(argv: Sequence[str] | None = None) -> int:
    """The command's exit code; every failure is one line on stderr, never a traceback (but with
    TL_LOG_LEVEL=DEBUG for an unexpected error)."""
    try:
        return _run(argv)
    except Exit as e:
        return fail(e.code, e.message)
    except KeyboardInterrupt:
        return fail(EXIT_INTERRUPTED, "interrupted")
    except BrokenPipeError:
        _discard_stdout()
        return EXIT_BROKEN_PIPE
    except ThreadlineError as e:
        if e.code == "conversation_busy":
            return fail(EXIT_BUSY, f"[{e.code}] {e.message}")
        return fail(EXIT_NOT_FOUND if isinstance(e, AgentNotFound | ConversationNotFound) else EXIT_BAD_INPUT,
                    f"[{e.code}] {e.message}")
    except Exception as e:
        if unreachable(e):
            return fail(EXIT_UNREACHABLE, f"cannot reach the server: {redact(str(e))}")
        if os.environ.get("TL_LOG_LEVEL", "").upper() == "DEBUG":
            traceback.print_exc()
        return fail(EXIT_TURN_FAILED, f"unexpected error: {type(e).__name__}: {redact(str(e))}")


def unreachable(error: Exception) -> bool:
    """A redis-py connection error or timeout, told without importing redis: a command that never
    imported it cannot have raised one."""
    redis = sys.modules.get("redis")
    return redis is not None and isinstance(error, redis.ConnectionError | redis.TimeoutError)


def _run(argv: Sequence[str] | None) -> int:
    args = parser().parse_args(argv)
    try:
        settings = Settings.from_env()
    except ValueError as e:
        raise Exit(EXIT_BAD_INPUT, str(e)) from None
    return int(args.func(args, settings))


#: The verbs that serve (start workers or the gateway): they import everything as usual.
SERVING = frozenset({"worker", "demo", "gateway"})


def skip_redis_metrics() -> None:
    """redis-py 8 imports the OpenTelemetry metrics SDK when it is installed (~140 ms of a command's
    start), for metrics only an application that sets them up records. A command that only talks to a
    server records none: it lets redis-py find the SDK missing, redis-py's own fallback, so the
    command's process never loads it."""
    if "redis" not in sys.modules:
        sys.modules.setdefault("opentelemetry.sdk.metrics", None)  # type: ignore[arg-type]


def _discard_stdout() -> None:
    """The reader of our output went away (`threadline events ID | head`): point stdout at devnull so
    the interpreter's last flush has nowhere to fail (the Python docs' recipe for SIGPIPE)."""
    with contextlib.suppress(OSError, ValueError):  # a stdout with no file descriptor (tests)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
