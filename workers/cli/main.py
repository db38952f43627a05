"""`threadline`: demo, worker, submit, events, cancel, agents (put, list, show, versions, publish, rollback, diff),
thread, conversations delete, gateway, keys create.

Every failure is one line on stderr and an exit code from the table below (the README's too); the
commands that only talk to a server (all but `worker` and `demo`) never start one and import no
pydantic-ai, so `submit` and `cancel` finish in a few hundred milliseconds (`bench/cli.py`)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import redis

from threadline.pipeline.contracts import TURN_SCHEMA, parse_turn_request, valid_turn_id
from threadline.pipeline.errors import AgentNotFound, ConversationNotFound, ThreadlineError
from threadline.pipeline.redact import redact
from threadline.workers.cli.operations import add_operations_parser
from threadline.workers.clients.client import Client
from threadline.workers.settings import ENVIRONMENT, Settings
from threadline.workers.storage.embedded import EmbeddedServer, ensure_embedded, join_embedded

if TYPE_CHECKING:
    from threadline.pipeline.events import Event
    from threadline.workers.storage.store import DeleteResult

#: Exit codes (also in `threadline --help` and the README). 1: a followed turn ended failed,
#: cancelled or timed out (or an unexpected error); 5: `conversations delete` found the conversation busy.
EXIT_TURN_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_NOT_FOUND = 3
EXIT_UNREACHABLE = 4
EXIT_TIMEOUT = 124
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141

EXIT_CODES = (
    (0, "done"),
    (EXIT_TURN_FAILED, "the followed turn ended failed, cancelled or timed_out; or an unexpected error"),
    (EXIT_BAD_INPUT, "bad input: usage, a file, a turn request, a setting"),
    (EXIT_NOT_FOUND, "not found: turn, conversation, agent, version"),
    (EXIT_UNREACHABLE, "cannot reach the server (or none runs for TL_DATA_DIR)"),
    (5, "busy: `conversations delete` of a conversation with a running turn"),
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
    """The server of a command that only talks to one: REDIS_URL, else the embedded server a running
    `threadline worker` or `demo` started for this data dir. Never starts one."""
    if settings.redis_url:
        return settings.redis_url
    server = join_embedded(settings.data_dir)
    if server is None:
        raise Exit(EXIT_UNREACHABLE, f"no server: REDIS_URL is not set and no `threadline worker` (or `demo`) runs "
                                     f"for {settings.data_dir}; start one there with `threadline worker`, or set "
                                     "REDIS_URL")
    return server.url


def producer(settings: Settings) -> Client:
    return Client(join(settings), prefix=settings.prefix, policy=settings.policy)


def connect(settings: Settings) -> tuple[str, EmbeddedServer | None]:
    """For `worker` and `demo`: REDIS_URL when set, else the embedded server of this data dir (joined,
    or started here)."""
    if settings.redis_url:
        return settings.redis_url, None
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
    try:
        from threadline.pipeline.events import TERMINAL_TYPES

        for event in client.events(turn_id, follow=live, timeout_s=timeout_s):
            line = render_event(event, as_json=as_json)
            if line is not None:
                sys.stdout.write(line + ("\n" if as_json else ""))
                sys.stdout.flush()
            if event.type in TERMINAL_TYPES:
                status = event.type
    except KeyboardInterrupt:
        if sys.stdout.isatty():
            print()
        raise still_running(turn_id) from None
    except TimeoutError:
        raise Exit(EXIT_TIMEOUT, f"turn {turn_id} did not finish within {timeout_s:g} s; it keeps running (cancel "
                                 f"it with `threadline cancel {turn_id}`)") from None
    return 0 if status in ("succeeded", "paused", "unknown") else EXIT_TURN_FAILED


def still_running(turn_id: str) -> Exit:
    return Exit(EXIT_INTERRUPTED, f"interrupted; turn {turn_id} keeps running (cancel it with "
                                  f"`threadline cancel {turn_id}`)")


def worker_start_line(processes: int, url: str) -> str:
    return f"threadline: {processes} worker processes on {display_url(url)}"


def cmd_worker(args: argparse.Namespace, settings: Settings) -> int:
    from threadline.pipeline.stages import DEFAULT_GRAPH
    from threadline.workers.telemetry.logs import configure_logging
    from threadline.workers.worker.actors import queues
    from threadline.workers.worker.process import Supervisor

    configure_logging(settings)  # only the commands that log set it up: the producer commands start faster

    known = queues(DEFAULT_GRAPH)
    unknown = [q for q in args.queues if q not in known]
    if unknown:
        raise Exit(EXIT_BAD_INPUT, f"unknown queue {', '.join(unknown)}; the queues are {', '.join(known)}")
    url, server = connect(settings)
    supervisor = Supervisor(url, processes=args.processes or settings.processes,
                            threads=args.threads or settings.threads, queues=args.queues)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    supervisor.start()
    print(worker_start_line(len(supervisor.children), url), file=sys.stderr)
    try:
        supervisor.watch(stop)
    finally:
        supervisor.stop()
        if server is not None:
            server.stop()
    return 0


def read_input(name: str) -> str:
    """A file's text, or stdin's for "-"; one that cannot be read is bad input."""
    try:
        return sys.stdin.read() if name == "-" else Path(name).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise Exit(EXIT_BAD_INPUT, f"cannot read {name}: {getattr(e, 'strerror', None) or e}") from None


def _request_from_args(args: argparse.Namespace) -> dict[str, Any]:
    request: dict[str, Any] = {}
    if args.file:
        try:
            request = json.loads(read_input(args.file))
        except ValueError as e:
            raise Exit(EXIT_BAD_INPUT, f"{args.file} is not valid JSON: {e}") from None
        if not isinstance(request, dict):
            raise Exit(EXIT_BAD_INPUT, f"{args.file}: a turn request is a JSON object")
    flags = {"tenant_id": args.tenant, "app_id": args.app, "user_id": args.user, "agent_id": args.agent,
             "conversation_id": args.conversation, "query": args.query, "turn_id": args.turn_id}
    request.update({k: v for k, v in flags.items() if v is not None})
    for name, default in (("tenant_id", "demo"), ("app_id", "demo"), ("user_id", "demo")):
        request.setdefault(name, default)
    return request


def check_request(request: dict[str, Any], settings: Settings) -> None:
    """Refuse here what the workers would refuse (the same model, this process's limits), so a bad
    request is exit 2 now rather than a `failed` event later."""
    try:
        parse_turn_request({"schema": TURN_SCHEMA, **request}, fallback_turn_id="cli",
                           max_query_chars=settings.max_query_chars, max_context_chars=settings.max_context_chars)
    except ThreadlineError as e:
        raise Exit(EXIT_BAD_INPUT, e.message if e.message.startswith("invalid turn request")
                   else f"invalid turn request: {e.message}") from None


def cmd_submit(args: argparse.Namespace, settings: Settings) -> int:
    request = _request_from_args(args)
    check_request(request, settings)
    client = producer(settings)
    turn_id = client.submit(request)
    if not args.follow:
        print(json.dumps({"turn_id": turn_id}) if args.json else turn_id)
        return 0
    try:
        if not args.json:
            print(f"turn {turn_id}", file=sys.stderr)
        return follow(client, turn_id, as_json=args.json, live=True, timeout_s=args.timeout)
    except KeyboardInterrupt:  # between the line above and `follow`'s own handler
        raise still_running(turn_id) from None


def existing_turn(client: Client, turn_id: str, settings: Settings) -> str:
    if valid_turn_id(turn_id) is None:
        raise Exit(EXIT_BAD_INPUT, f"{turn_id!r} is not a turn id")
    if not client.turn_exists(turn_id):
        raise Exit(EXIT_NOT_FOUND, f"turn {turn_id} not found (ended turns are kept {settings.turn_ttl_s} s; "
                                   f"prefix {settings.prefix})")
    return turn_id


def cmd_events(args: argparse.Namespace, settings: Settings) -> int:
    client = producer(settings)
    turn_id = existing_turn(client, args.turn_id, settings)
    return follow(client, turn_id, as_json=args.json, live=args.follow, timeout_s=args.timeout)


def cmd_cancel(args: argparse.Namespace, settings: Settings) -> int:
    client = producer(settings)
    # an unknown id is refused rather than enqueued: its cancel flag would wait 24 h for a turn that never comes
    turn_id = existing_turn(client, args.turn_id, settings)
    result = client.cancel(turn_id, args.reason or "")
    print(f"cancel {turn_id}: {result}")
    return 0


def agents_command(run: Callable[[argparse.Namespace, Client], int]) -> Callable[[argparse.Namespace, Settings], int]:
    """An `agents` subcommand: an unknown agent, version or draft is one line on stderr and exit 3,
    bad input one line and exit 2."""

    def command(args: argparse.Namespace, settings: Settings) -> int:
        client = producer(settings)
        try:
            return run(args, client)
        except ThreadlineError as e:
            print(f"error [{e.code}]: {e.message}", file=sys.stderr)
            return 3 if isinstance(e, AgentNotFound) else 2
        except OSError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        finally:
            client.close()

    return command


def agents_put(args: argparse.Namespace, client: Client) -> int:
    text = read_input(args.file)
    result = client.put_agent_result(text, draft_id=args.draft, author=args.author)
    print(result.ref if result.created else f"{result.ref} (unchanged)")
    return 0


def agents_list(args: argparse.Namespace, client: Client) -> int:
    from threadline.workers.storage import agents as agent_registry

    summaries = client.agents()
    if args.json:
        print(json.dumps([dataclasses.asdict(s) for s in summaries]))
    else:
        print("\n".join(agent_registry.render_agents(summaries)) or "no agents")
    return 0


def agents_show(args: argparse.Namespace, client: Client) -> int:
    from threadline.workers.storage import agents as agent_registry

    config = client.agent_config(args.agent, args.version)
    print(config.model_dump_json(indent=2) if args.json else agent_registry.config_yaml(config).rstrip("\n"))
    return 0


def agents_versions(args: argparse.Namespace, client: Client) -> int:
    from threadline.workers.storage import agents as agent_registry

    history = client.agent_versions(args.agent)
    print(json.dumps(history.as_json()) if args.json else "\n".join(agent_registry.render_versions(history)))
    return 0


def agents_publish(args: argparse.Namespace, client: Client) -> int:
    result = client.publish_agent(args.agent, draft_id=args.draft, author=args.author)
    print(result.ref if result.created else f"{result.ref} (unchanged: the draft is the active version)")
    return 0


def agents_rollback(args: argparse.Namespace, client: Client) -> int:
    from threadline.workers.storage import agents as agent_registry

    changed = client.rollback_agent(args.agent, args.version, author=args.author)
    print(f"{args.agent}: v{agent_registry.parse_version(args.version)} is active" + ("" if changed else " (already)"))
    return 0


def agents_diff(args: argparse.Namespace, client: Client) -> int:
    from threadline.workers.storage import agents as agent_registry

    a, b = (client.registry.config(args.agent, agent_registry.parse_version(v)) for v in (args.v1, args.v2))
    print(agent_registry.diff_configs(args.agent, a, b).rstrip("\n") or "identical")
    return 0


def cmd_thread(args: argparse.Namespace, settings: Settings) -> int:
    client = producer(settings)
    if client.conversation(args.conversation_id) is None:
        raise Exit(EXIT_NOT_FOUND, f"conversation {args.conversation_id} not found (prefix {settings.prefix})")
    for message in client.thread(args.conversation_id):
        print(f"[{message.status}] user: {message.query}\n            assistant: {message.answer}")
    return 0


def cmd_turn_show(args: argparse.Namespace, settings: Settings) -> int:
    """What a turn decided at each stage: the budget, the turns kept and dropped, the tokenizer."""
    client = producer(settings)
    state = client.turn_state(args.turn_id)
    decisions = client.decisions(args.turn_id, conversation_id=args.conversation)
    if not state.status and not decisions:
        print(f"threadline: turn {args.turn_id} not found (ended turns are kept {settings.turn_ttl_s} s; "
              "pass --conversation for an older one)", file=sys.stderr)
        return 3
    if args.json:
        print(json.dumps({"turn_id": args.turn_id, "status": state.status or None, "decisions": decisions}))
        return 0
    print(f"turn {args.turn_id}: {state.status or 'expired'}"
          + (f", conversation {state.conversation_id}" if state.conversation_id else ""))
    for stage, decision in decisions.items():
        print(f"\n[{stage}]")
        if "budget" in decision and "window" in decision:
            print(describe_budget(decision))
        print(json.dumps(decision, indent=2))
    return 0


def describe_budget(decision: dict[str, Any]) -> str:
    """One paragraph on why the model saw the history it saw."""
    b, w = decision["budget"], decision["window"]
    return (f"history budget {b['history']} tokens of a {b['context_window']}-token window (instructions "
            f"{b['instructions']}, query {b['query']}, tools {b['tools']}, output {b['max_output']}, margin "
            f"{b['safety_margin']}); kept {w['kept_turns']} turns ({w['kept_tokens']} tokens), dropped "
            f"{w['dropped_turns']} ({w['dropped_tokens']} tokens): {w['reason']}; counted with "
            f"{decision['tokenizer']}"
            + (f" (instead of {decision['tokenizer_fallback']})" if decision.get("tokenizer_fallback") else ""))


def cmd_gateway(args: argparse.Namespace, settings: Settings) -> int:
    """Serve the HTTP + SSE gateway (FastAPI, uvicorn: the `gateway` extra) on the server workers use."""
    try:
        import uvicorn

        from threadline.workers.gateway.app import CONSOLE_DIR, create_app
    except ImportError as e:
        raise Exit(EXIT_BAD_INPUT, f"the gateway needs its extra: pip install 'threadline[gateway]' ({e.name} "
                                   "is missing)") from None
    from threadline.workers.telemetry.logs import configure_logging

    console = None if args.no_console else args.console or CONSOLE_DIR
    if console is not None and not console.is_dir():
        raise Exit(EXIT_BAD_INPUT, f"--console {console}: not a directory")
    configure_logging(settings)
    url = join(settings)
    redis.Redis.from_url(url).ping()  # unreachable: one line and exit 4, before the port is taken
    print(f"threadline: gateway on http://{args.host}:{args.port} for {display_url(url)}", file=sys.stderr)
    uvicorn.run(create_app(settings, url, console_dir=console), host=args.host, port=args.port, log_level="warning")
    return 0


def cmd_keys_create(args: argparse.Namespace, settings: Settings) -> int:
    from threadline.workers.storage.api_keys import create_key

    client = producer(settings)
    try:
        print(create_key(client.redis, client.keys, args.tenant, admin=args.admin))
    finally:
        client.close()
    return 0


def add_gateway_parsers(sub: Any) -> None:
    """`threadline gateway` and `threadline keys create TENANT`."""
    gateway = sub.add_parser("gateway", help="serve the HTTP + SSE API (needs the `gateway` extra)")
    gateway.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    gateway.add_argument("--port", type=at_least_one, default=8080, help="port to listen on (default 8080)")
    console = gateway.add_mutually_exclusive_group()
    console.add_argument("--console", type=Path, default=None, metavar="DIR",
                         help="a directory of static files served at / (default: the built-in web console)")
    console.add_argument("--no-console", action="store_true", help="serve the API only, nothing at /")
    gateway.set_defaults(func=cmd_gateway)
    keys = sub.add_parser("keys", help="the gateway's API keys").add_subparsers(dest="keys", required=True)
    create = keys.add_parser("create", help="make an API key for a tenant; it is printed once (only its hash "
                                            "is stored)")
    create.add_argument("tenant", help="the tenant id every call with the key acts as")
    create.add_argument("--admin", action="store_true", help="the key may also put, show and publish agents")
    create.set_defaults(func=cmd_keys_create)


def cmd_demo(args: argparse.Namespace, settings: Settings) -> int:
    from threadline.workers.cli.demo import run_demo
    from threadline.workers.telemetry.logs import configure_logging

    configure_logging(settings)
    return run_demo(settings, delay_ms=args.delay_ms)


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


def at_least_one(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be more than 0, not {text}")
    return value


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
    thread.set_defaults(func=cmd_thread)
    add_conversations_parser(sub)
    add_operations_parser(sub)
    add_gateway_parsers(sub)

    turn = sub.add_parser("turn", help="inspect a turn").add_subparsers(dest="turn", required=True)
    show = turn.add_parser("show", help="what a turn decided: budget, turns kept and dropped, tokenizer")
    show.add_argument("turn_id", help="the turn id")
    show.add_argument("--conversation", help="the turn's conversation (needed once its record expired)")
    show.add_argument("--json", action="store_true", help="print JSON")
    show.set_defaults(func=cmd_turn_show)
    return p


def add_agents_parser(sub: Any) -> None:
    """`threadline agents ...`: versions, drafts, publish, rollback (`workers/agents.py`)."""
    agents = sub.add_parser("agents", help="manage agent configs and their versions").add_subparsers(
        dest="agents", required=True)
    author = {"help": "who makes the change (default: $TL_AUTHOR, else the OS user name)"}
    put = agents.add_parser("put", help="register a config (YAML or JSON): a new version unless it is the active one")
    put.add_argument("file", help="the config document ('-' for stdin)")
    put.add_argument("--draft", help="store as this draft (updated in place) instead of a new version")
    put.add_argument("--author", **author)
    put.set_defaults(func=agents_command(agents_put))
    listing = agents.add_parser("list", help="every agent with its active and latest version")
    listing.add_argument("--json", action="store_true", help="print JSON")
    listing.set_defaults(func=agents_command(agents_list))
    show = agents.add_parser("show", help="print a version's config (default: the active one) as YAML")
    show.add_argument("agent", help="the agent id")
    show.add_argument("--version", help="the version, e.g. 3 or v3 (default: the active one)")
    show.add_argument("--json", action="store_true", help="print JSON instead of YAML")
    show.set_defaults(func=agents_command(agents_show))
    versions = agents.add_parser("versions", help="every version: when, by whom, how; which one is active")
    versions.add_argument("agent", help="the agent id")
    versions.add_argument("--json", action="store_true", help="print JSON, with every activation")
    versions.set_defaults(func=agents_command(agents_versions))
    publish = agents.add_parser("publish", help="the draft becomes the next immutable version, made active")
    publish.add_argument("agent", help="the agent id")
    publish.add_argument("--draft", help="the draft to publish (default: the agent's only draft); it is kept")
    publish.add_argument("--author", **author)
    publish.set_defaults(func=agents_command(agents_publish))
    rollback = agents.add_parser("rollback", help="make an existing version active again for new conversations")
    rollback.add_argument("agent", help="the agent id")
    rollback.add_argument("version", help="the version, e.g. 3 or v3")
    rollback.add_argument("--author", **author)
    rollback.set_defaults(func=agents_command(agents_rollback))
    diff = agents.add_parser("diff", help="a unified diff of two versions as YAML")
    diff.add_argument("agent", help="the agent id")
    diff.add_argument("v1", help="the old version, e.g. 1 or v1")
    diff.add_argument("v2", help="the new version")
    diff.set_defaults(func=agents_command(agents_diff))


#: `conversations delete` exits 5 while a turn of the conversation runs or waits.
EXIT_BUSY = 5


def delete_when_idle(client: Client, conversation_id: str, *, tenant_id: str | None, cancel: bool,
                     timeout_s: float) -> DeleteResult:
    """Delete a conversation; with `cancel`, cancel the turns that keep it busy and try again until
    it is idle (or `timeout_s` passed)."""
    deadline = time.monotonic() + timeout_s
    cancelled: set[str] = set()
    while True:
        result = client.delete_conversation(conversation_id, tenant_id=tenant_id)
        if result.status != "busy" or not cancel or time.monotonic() > deadline:
            return result
        for turn_id in set(result.blocking) - cancelled:
            client.cancel(turn_id, "the conversation is being deleted")
            cancelled.add(turn_id)
        time.sleep(0.1)


def cmd_conversations_delete(args: argparse.Namespace, settings: Settings) -> int:
    """Exit 0 deleted, 2 not an id, 3 not found (or another tenant's), 5 busy."""
    client = producer(settings)
    cid = args.conversation_id
    try:
        result = delete_when_idle(client, cid, tenant_id=args.tenant, cancel=args.cancel, timeout_s=args.timeout)
    except ThreadlineError as e:
        print(f"error [{e.code}]: {e.message}", file=sys.stderr)
        return 2
    finally:
        client.close()
    if result.status == "deleted":
        print(f"deleted conversation {cid}: {result.messages} messages, {result.turns} turns")
        return 0
    if result.status == "not_found":
        print(f"threadline: conversation {cid} not found", file=sys.stderr)
        return 3
    running = f" (turn {result.blocking[0]} runs or waits)" if result.blocking else ""
    print(f"threadline: conversation {cid} is busy{running}: cancel its turns first, or pass --cancel",
          file=sys.stderr)
    return EXIT_BUSY


def add_conversations_parser(sub: Any) -> None:
    """`threadline conversations delete ID`."""
    conversations = sub.add_parser("conversations", help="manage stored conversations").add_subparsers(
        dest="conversations", required=True)
    delete = conversations.add_parser(
        "delete", help="delete a conversation: its messages, snapshots, summaries and its turns' records and events "
                       "(usage counters stay); exit 3 not found, 5 busy")
    delete.add_argument("conversation_id", help="the conversation id")
    delete.add_argument("--tenant", help="only if the conversation is this tenant's (otherwise: not found)")
    delete.add_argument("--cancel", action="store_true",
                        help="cancel the turns that run or wait in it, then delete once it is idle")
    delete.add_argument("--timeout", type=float, default=30.0,
                        help="with --cancel: seconds to wait for the conversation to become idle (default 30)")
    delete.set_defaults(func=cmd_conversations_delete)


def main(argv: Sequence[str] | None = None) -> NoReturn:
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
    except (redis.ConnectionError, redis.TimeoutError) as e:
        return fail(EXIT_UNREACHABLE, f"cannot reach the server: {redact(str(e))}")
    except ThreadlineError as e:
        return fail(EXIT_NOT_FOUND if isinstance(e, AgentNotFound | ConversationNotFound) else EXIT_BAD_INPUT,
                    f"[{e.code}] {e.message}")
    except Exception as e:
        if os.environ.get("TL_LOG_LEVEL", "").upper() == "DEBUG":
            traceback.print_exc()
        return fail(EXIT_TURN_FAILED, f"unexpected error: {type(e).__name__}: {redact(str(e))}")


def _run(argv: Sequence[str] | None) -> int:
    args = parser().parse_args(argv)
    try:
        settings = Settings.from_env()
    except ValueError as e:
        raise Exit(EXIT_BAD_INPUT, str(e)) from None
    return int(args.func(args, settings))


def fail(code: int, message: str) -> int:
    print(f"threadline: {message}", file=sys.stderr)
    return code


def _discard_stdout() -> None:
    """The reader of our output went away (`threadline events ID | head`): point stdout at devnull so
    the interpreter's last flush has nowhere to fail (the Python docs' recipe for SIGPIPE)."""
    with contextlib.suppress(OSError, ValueError):  # a stdout with no file descriptor (tests)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())

