"""`threadline status`, `threadline dead-letters list|show|replay|purge` and `threadline usage TENANT`:
the argparse wiring and the text tables over `workers/operations/status.py`. An unknown dead letter is one
line on stderr and exit 3; a purge without `--yes` changes nothing and exits 2."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from threadline.workers.protocol.keys import Keys
from threadline.workers.settings import Settings

if TYPE_CHECKING:  # imported when a command runs: the CLI's start-up stays fast (bench/cli.py)
    from threadline.workers.operations.status import DeadLetter, DeadLetterBody, Operations, Status, TenantUsage

#: Exit codes: no such dead letter; a replay that found the id busy or changed under it.
EXIT_NOT_FOUND = 3
EXIT_BUSY = 5

Command = Callable[[argparse.Namespace, "Operations", Settings], int]


@contextmanager
def operations(settings: Settings) -> Iterator[Operations]:
    # the CLI's rule for commands that talk to a server: REDIS_URL, else the running embedded one

    from threadline.workers.cli.common import join
    from threadline.workers.operations.status import Operations
    from threadline.workers.storage.connect import sync_client

    client = sync_client(join(settings))
    try:
        yield Operations(client, Keys(settings.prefix), stored_layout=True)
    finally:
        client.close()


def command(run: Command) -> Callable[[argparse.Namespace, Settings], int]:
    def wrapped(args: argparse.Namespace, settings: Settings) -> int:
        _known_queue(getattr(args, "queue", None))
        with operations(settings) as ops:
            return run(args, ops, settings)

    return wrapped


def _known_queue(queue: str | None) -> None:
    """An unknown `--queue` is bad input (checked here, not by argparse `choices`, whose list would
    import the stage graph on every start of the CLI)."""
    if queue is None:
        return
    from threadline.pipeline.stages import DEFAULT_GRAPH
    from threadline.workers.cli.common import EXIT_BAD_INPUT, Exit
    from threadline.workers.protocol.names import queues

    if queue not in (known := queues(DEFAULT_GRAPH)):
        raise Exit(EXIT_BAD_INPUT, f"unknown queue {queue}; the queues are {', '.join(known)}")


def _print(value: Any, lines: Callable[[], list[str]], *, as_json: bool) -> None:
    """`value` as JSON (a dataclass, or a list of them), or the text lines."""
    if not as_json:
        print("\n".join(lines()))
    elif isinstance(value, list):
        print(json.dumps([dataclasses.asdict(v) for v in value]))
    else:
        print(json.dumps(dataclasses.asdict(value)))


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}s"


def _when(epoch_s: float) -> str:
    return datetime.fromtimestamp(epoch_s, UTC).strftime("%Y-%m-%d %H:%M:%S")


def render_status(status: Status) -> list[str]:
    lines = [f"{'queue':<12} {'waiting':>8} {'delayed':>8} {'running':>8} {'dead':>6} {'oldest':>9} {'consumers':>9}"]
    lines += [f"{q.name:<12} {q.depth:>8} {q.delayed:>8} {q.in_progress:>8} {q.dead:>6} {_seconds(q.oldest_age_s):>9}"
              f" {q.consumers:>9}" for q in status.queues]
    unserved = [q.name for q in status.queues if not q.consumers]
    if unserved and status.workers_alive:
        lines.append(f"no worker consumes: {', '.join(unserved)}")
    lines.append(f"workers alive: {status.workers_alive} (known {status.workers_known})")
    turns = status.turns
    oldest = (f" (oldest {turns.oldest_turn_id}: {_seconds(turns.oldest_age_s)}, "
              f"last progress {_seconds(turns.oldest_idle_s)} ago)") if turns.oldest_turn_id else ""
    lines.append(f"turns in flight: {turns.count}{oldest}")
    return lines


def render_dead_letters(letters: list[DeadLetter]) -> list[str]:
    if not letters:
        return ["no dead letters"]
    return [f"{_when(d.dead_at)}  {d.queue:<10} {d.message_id}  {d.actor or '?'}  {d.reason or '(no reason kept)'}"
            for d in letters]


def render_dead_letter(found: DeadLetterBody) -> list[str]:
    d = found.letter
    lines = [f"message {d.message_id} on {d.queue}, dead-lettered {_when(d.dead_at)}",
             f"reason: {d.reason or '(no reason kept)'}"]
    if found.message is None:
        return [*lines, "body (not a message):", found.raw or ""]
    m = found.message
    lines.append(f"actor: {m.get('actor_name')}")
    lines.append("args: " + json.dumps(m.get("args"), ensure_ascii=False, indent=2))
    if m.get("kwargs"):
        lines.append("kwargs: " + json.dumps(m.get("kwargs"), ensure_ascii=False))
    lines.append("options: " + json.dumps(m.get("options"), ensure_ascii=False))
    return lines


def render_usage(usage: TenantUsage) -> list[str]:
    scope = f"conversation {usage.conversation_id} (tenant {usage.tenant_id})" if usage.conversation_id \
        else f"tenant {usage.tenant_id}"
    lines = [f"{scope}: {usage.turns} turns, {usage.requests} model requests, "
             f"{usage.input_tokens} input tokens ({usage.cache_read_tokens} read from cache, "
             f"{usage.cache_write_tokens} written to it), {usage.output_tokens} output tokens",
             f"  cost: {render_cost(usage.cost_usd, usage.unpriced_turns)}"]
    lines += [f"  {name}: {count}" for name, count in sorted(usage.other.items())]
    return lines


def render_cost(cost_usd: float, unpriced_turns: int) -> str:
    """The summed cost, and how many turns it leaves out (their price is unknown, never 0)."""
    if not unpriced_turns:
        return f"${cost_usd:.6f}"
    return f"${cost_usd:.6f} + unknown ({unpriced_turns} turns of models without a known price)"


def cmd_status(args: argparse.Namespace, ops: Operations, settings: Settings) -> int:
    status = ops.status()
    _print(status, lambda: render_status(status), as_json=args.json)
    return 0


def cmd_list(args: argparse.Namespace, ops: Operations, settings: Settings) -> int:
    letters = ops.dead_letters(queue=args.queue)
    _print(letters, lambda: render_dead_letters(letters), as_json=args.json)
    return 0


def cmd_show(args: argparse.Namespace, ops: Operations, settings: Settings) -> int:
    found = ops.dead_letter(args.message_id, queue=args.queue, secrets=settings.model_env.values())
    if found is None:
        print(f"threadline: no dead letter {args.message_id}", file=sys.stderr)
        return EXIT_NOT_FOUND
    _print(found, lambda: render_dead_letter(found), as_json=args.json)
    return 0


def cmd_replay(args: argparse.Namespace, ops: Operations, settings: Settings) -> int:
    if args.all:
        counts = ops.replay_all(queue=args.queue)
        print(", ".join(f"{n} {outcome}" for outcome, n in sorted(counts.items())) or "no dead letters")
        return 0
    if args.message_id is None:
        print("threadline: name a dead letter, or pass --all", file=sys.stderr)
        return 2
    outcome = ops.replay(args.message_id, queue=args.queue)
    if outcome == "replayed":
        print(f"replayed {args.message_id}")
        return 0
    if outcome == "missing":
        print(f"threadline: no dead letter {args.message_id}", file=sys.stderr)
        return EXIT_NOT_FOUND
    why = "a message with this id waits on the queue" if outcome == "queued" else "it changed while read: try again"
    print(f"threadline: {args.message_id} not replayed: {why}", file=sys.stderr)
    return EXIT_BUSY


def cmd_purge(args: argparse.Namespace, ops: Operations, settings: Settings) -> int:
    scope = f" older than {args.older_than:g} s" if args.older_than is not None else ""
    if not args.yes:
        cutoff = time.time() - (args.older_than or 0)
        count = sum(1 for d in ops.dead_letters(queue=args.queue) if args.older_than is None or d.dead_at <= cutoff)
        print(f"threadline: would delete {count} dead letters{scope}; pass --yes", file=sys.stderr)
        return 2
    print(f"purged {ops.purge(queue=args.queue, older_than_s=args.older_than)} dead letters{scope}")
    return 0


def cmd_usage(args: argparse.Namespace, ops: Operations, settings: Settings) -> int:
    from threadline.workers.cli.common import EXIT_BAD_INPUT, EXIT_NOT_FOUND, Exit, producer

    if (args.tenant is None) == (args.conversation is None):
        raise Exit(EXIT_BAD_INPUT, "usage: name a tenant, or --conversation ID (not both)")
    if args.tenant is not None:
        usage = ops.usage(args.tenant)
    else:
        from threadline.workers.operations.status import usage_of

        with producer(settings) as client:
            record = client.conversation(args.conversation)
            if record is None:
                raise Exit(EXIT_NOT_FOUND, f"no conversation {args.conversation}")
            usage = usage_of(record.tenant_id, client.conversation_usage(args.conversation),
                             conversation_id=args.conversation)
    _print(usage, lambda: render_usage(usage), as_json=args.json)
    return 0


def add_operations_parser(sub: Any) -> None:
    """`threadline status`, `threadline dead-letters ...`, `threadline usage TENANT`."""
    as_json = {"action": "store_true", "help": "print JSON"}
    queue = {"metavar": "QUEUE", "help": "only this queue (a stage's queue or control)"}
    status = sub.add_parser("status", help="queues (waiting, delayed, running, dead, oldest, consumers), workers "
                                           "alive, turns in flight")
    status.add_argument("--json", **as_json)
    status.set_defaults(func=command(cmd_status))

    dead = sub.add_parser("dead-letters", help="messages the workers refused or gave up on").add_subparsers(
        dest="dead_letters", required=True)
    listing = dead.add_parser("list", help="every dead letter whose body is kept, oldest first")
    listing.add_argument("--queue", **queue)
    listing.add_argument("--json", **as_json)
    listing.set_defaults(func=command(cmd_list))
    show = dead.add_parser("show", help="a dead letter's reason and message (credentials redacted); exit 3 unknown")
    show.add_argument("message_id", help="the dead letter's message id (from `dead-letters list`)")
    show.add_argument("--queue", **queue)
    show.add_argument("--json", **as_json)
    show.set_defaults(func=command(cmd_show))
    replay = dead.add_parser("replay", help="enqueue a dead letter again on its queue, retries reset; exit 3 unknown")
    replay.add_argument("message_id", nargs="?", help="the dead letter's message id (or --all)")
    replay.add_argument("--all", action="store_true", help="every dead letter (of --queue)")
    replay.add_argument("--queue", **queue)
    replay.set_defaults(func=command(cmd_replay))
    purge = dead.add_parser("purge", help="delete dead letters (entries and bodies); needs --yes")
    purge.add_argument("--queue", **queue)
    purge.add_argument("--older-than", type=float, metavar="S", help="only those dead-lettered more than S s ago")
    purge.add_argument("--yes", action="store_true", help="really delete")
    purge.set_defaults(func=command(cmd_purge))

    usage = sub.add_parser("usage", help="a tenant's (or a conversation's) usage: turns, requests, tokens, cost")
    usage.add_argument("tenant", nargs="?", help="the tenant id")
    usage.add_argument("--conversation", metavar="ID", help="instead: one conversation's turns, all its branches")
    usage.add_argument("--json", **as_json)
    usage.set_defaults(func=command(cmd_usage))
