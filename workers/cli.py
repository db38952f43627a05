"""`threadline`: demo, worker, submit, events, cancel, agents (put, list, show, versions, publish, rollback, diff),
thread, conversations delete."""

from __future__ import annotations

import argparse
import dataclasses
import json
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from threadline.pipeline import events
from threadline.pipeline.errors import AgentNotFound, ThreadlineError
from threadline.pipeline.events import TERMINAL_TYPES, Event

from . import agents as agent_registry
from .client import Client
from .embedded import EmbeddedServer, ensure_embedded
from .logs import configure_logging
from .settings import Settings
from .store import DeleteResult
from .worker import Supervisor


def connect(settings: Settings) -> tuple[str, EmbeddedServer | None]:
    """REDIS_URL when set, else the embedded server of this data dir (joined, or started here)."""
    if settings.redis_url:
        return settings.redis_url, None
    server = ensure_embedded(settings.data_dir)
    return server.url, server


def render_event(event: Event, *, as_json: bool) -> str | None:
    """One event for the terminal: JSON lines, or text deltas inline and the rest as notes."""
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
    status = "unknown"
    for event in client.events(turn_id, follow=live, timeout_s=timeout_s):
        line = render_event(event, as_json=as_json)
        if line is not None:
            sys.stdout.write(line + ("\n" if as_json else ""))
            sys.stdout.flush()
        if event.type in TERMINAL_TYPES:
            status = event.type
    return 0 if status in ("succeeded", "paused", "unknown") else 1


def cmd_worker(args: argparse.Namespace, settings: Settings) -> int:
    url, server = connect(settings)
    supervisor = Supervisor(url, processes=args.processes or settings.processes,
                            threads=args.threads or settings.threads, queues=args.queues)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    supervisor.start()
    print(f"threadline: {len(supervisor.children)} worker processes on {url}", file=sys.stderr)
    try:
        supervisor.watch(stop)
    finally:
        supervisor.stop()
        if server is not None:
            server.stop()
    return 0


def _request_from_args(args: argparse.Namespace) -> dict[str, Any]:
    if args.file:
        text = sys.stdin.read() if args.file == "-" else Path(args.file).read_text()
        request: dict[str, Any] = json.loads(text)
    else:
        request = {}
    flags = {"tenant_id": args.tenant, "app_id": args.app, "user_id": args.user, "agent_id": args.agent,
             "conversation_id": args.conversation, "query": args.query, "turn_id": args.turn_id}
    request.update({k: v for k, v in flags.items() if v is not None})
    for name, default in (("tenant_id", "demo"), ("app_id", "demo"), ("user_id", "demo")):
        request.setdefault(name, default)
    return request


def cmd_submit(args: argparse.Namespace, settings: Settings) -> int:
    url, _ = connect(settings)
    client = Client(url, prefix=settings.prefix)
    turn_id = client.submit(_request_from_args(args))
    if not args.follow:
        print(json.dumps({"turn_id": turn_id}) if args.json else turn_id)
        return 0
    if not args.json:
        print(f"turn {turn_id}", file=sys.stderr)
    return follow(client, turn_id, as_json=args.json, live=True, timeout_s=args.timeout)


def cmd_events(args: argparse.Namespace, settings: Settings) -> int:
    url, _ = connect(settings)
    return follow(Client(url, prefix=settings.prefix), args.turn_id, as_json=args.json, live=args.follow,
                  timeout_s=args.timeout)


def cmd_cancel(args: argparse.Namespace, settings: Settings) -> int:
    url, _ = connect(settings)
    result = Client(url, prefix=settings.prefix).cancel(args.turn_id, args.reason or "")
    print(f"cancel {args.turn_id}: {result}")
    return 0


def agents_command(run: Callable[[argparse.Namespace, Client], int]) -> Callable[[argparse.Namespace, Settings], int]:
    """An `agents` subcommand: an unknown agent, version or draft is one line on stderr and exit 3,
    bad input one line and exit 2."""

    def command(args: argparse.Namespace, settings: Settings) -> int:
        url, _ = connect(settings)
        client = Client(url, prefix=settings.prefix)
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
    text = sys.stdin.read() if args.file == "-" else Path(args.file).read_text()
    result = client.put_agent_result(text, draft_id=args.draft, author=args.author)
    print(result.ref if result.created else f"{result.ref} (unchanged)")
    return 0


def agents_list(args: argparse.Namespace, client: Client) -> int:
    summaries = client.agents()
    if args.json:
        print(json.dumps([dataclasses.asdict(s) for s in summaries]))
    else:
        print("\n".join(agent_registry.render_agents(summaries)) or "no agents")
    return 0


def agents_show(args: argparse.Namespace, client: Client) -> int:
    config = client.agent_config(args.agent, args.version)
    print(config.model_dump_json(indent=2) if args.json else agent_registry.config_yaml(config).rstrip("\n"))
    return 0


def agents_versions(args: argparse.Namespace, client: Client) -> int:
    history = client.agent_versions(args.agent)
    print(json.dumps(history.as_json()) if args.json else "\n".join(agent_registry.render_versions(history)))
    return 0


def agents_publish(args: argparse.Namespace, client: Client) -> int:
    result = client.publish_agent(args.agent, draft_id=args.draft, author=args.author)
    print(result.ref if result.created else f"{result.ref} (unchanged: the draft is the active version)")
    return 0


def agents_rollback(args: argparse.Namespace, client: Client) -> int:
    changed = client.rollback_agent(args.agent, args.version, author=args.author)
    print(f"{args.agent}: v{agent_registry.parse_version(args.version)} is active" + ("" if changed else " (already)"))
    return 0


def agents_diff(args: argparse.Namespace, client: Client) -> int:
    a, b = (client.registry.config(args.agent, agent_registry.parse_version(v)) for v in (args.v1, args.v2))
    print(agent_registry.diff_configs(args.agent, a, b).rstrip("\n") or "identical")
    return 0


def cmd_thread(args: argparse.Namespace, settings: Settings) -> int:
    url, _ = connect(settings)
    for message in Client(url, prefix=settings.prefix).thread(args.conversation_id):
        print(f"[{message.status}] user: {message.query}\n            assistant: {message.answer}")
    return 0


def cmd_turn_show(args: argparse.Namespace, settings: Settings) -> int:
    """What a turn decided at each stage: the budget, the turns kept and dropped, the tokenizer."""
    url, _ = connect(settings)
    client = Client(url, prefix=settings.prefix)
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
            f"{decision['tokenizer']}")


def cmd_demo(args: argparse.Namespace, settings: Settings) -> int:
    from .demo import run_demo

    return run_demo(settings, delay_ms=args.delay_ms)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="threadline", description="LLM agent turns as a pipeline of queue workers.")
    sub = p.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="start workers and run a three-turn conversation")
    demo.add_argument("--delay-ms", type=int, default=35, help="offline model's pause between words")
    demo.set_defaults(func=cmd_demo)

    worker = sub.add_parser("worker", help="run worker processes")
    worker.add_argument("--processes", type=int)
    worker.add_argument("--threads", type=int)
    worker.add_argument("--queues", nargs="*", default=[])
    worker.set_defaults(func=cmd_worker)

    submit = sub.add_parser("submit", help="enqueue a turn (JSON file, '-' for stdin, or flags)")
    submit.add_argument("file", nargs="?")
    for flag in ("tenant", "app", "user", "agent", "conversation", "query", "turn-id"):
        submit.add_argument(f"--{flag}")
    submit.add_argument("--follow", action="store_true")
    submit.add_argument("--json", action="store_true")
    submit.add_argument("--timeout", type=float, default=None)
    submit.set_defaults(func=cmd_submit)

    ev = sub.add_parser("events", help="print a turn's events")
    ev.add_argument("turn_id")
    ev.add_argument("--follow", action="store_true")
    ev.add_argument("--json", action="store_true")
    ev.add_argument("--timeout", type=float, default=None)
    ev.set_defaults(func=cmd_events)

    cancel = sub.add_parser("cancel", help="cancel a turn")
    cancel.add_argument("turn_id")
    cancel.add_argument("--reason")
    cancel.set_defaults(func=cmd_cancel)

    add_agents_parser(sub)

    thread = sub.add_parser("thread", help="print a conversation's thread")
    thread.add_argument("conversation_id")
    thread.set_defaults(func=cmd_thread)
    add_conversations_parser(sub)

    turn = sub.add_parser("turn", help="inspect a turn").add_subparsers(dest="turn", required=True)
    show = turn.add_parser("show", help="what a turn decided: budget, turns kept and dropped, tokenizer")
    show.add_argument("turn_id")
    show.add_argument("--conversation", help="the turn's conversation (needed once its record expired)")
    show.add_argument("--json", action="store_true")
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
    url, _ = connect(settings)
    client = Client(url, prefix=settings.prefix)
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


def main(argv: Sequence[str] | None = None) -> None:
    args = parser().parse_args(argv)
    settings = Settings.from_env()
    configure_logging(settings)
    raise SystemExit(args.func(args, settings))


if __name__ == "__main__":
    main()
