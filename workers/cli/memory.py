"""`threadline memory list | show | set | forget`: a user's long-term memory, as the user (or an
operator) sees and changes it — list it, read a record's provenance, correct it, forget it
(`Client.memory`, `set_memory`, `forget_memory`)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from threadline.workers.cli.common import EXIT_BAD_INPUT, EXIT_NOT_FOUND, Exit, producer
from threadline.workers.settings import Settings

if TYPE_CHECKING:  # imported when a command runs: the CLI's start-up stays fast (bench/cli.py)
    from threadline.pipeline.memory import MemoryRecord
    from threadline.workers.clients.client import Client


def memory_command(run: Callable[[argparse.Namespace, Client], int]) -> Callable[[argparse.Namespace, Settings], int]:
    """A `memory` subcommand: an unknown record is one line and exit 3 (bad input: exit 2, `main.run`)."""

    def command(args: argparse.Namespace, settings: Settings) -> int:
        from threadline.workers.clients.common import MemoryNotFound

        client = producer(settings)
        try:
            return run(args, client)
        except MemoryNotFound as e:
            raise Exit(EXIT_NOT_FOUND, str(e)) from None
        finally:
            client.close()

    return command


def _scope(args: argparse.Namespace) -> dict[str, Any]:
    return {"app_id": args.app, "agent_id": args.agent}


def _when(at: float | None) -> str:
    return "-" if at is None else datetime.fromtimestamp(at, UTC).isoformat(timespec="seconds")


def record_line(record: MemoryRecord) -> str:
    """One record in a listing: id, what it says, who set it, and whether it was closed."""
    said = f"{record.key} = {record.value}" if record.kind == "fact" else f"note: {record.value}"
    closed = "" if record.current else f"  [closed {_when(record.invalid_at)}]"
    return f"{record.id}  {said}  ({record.source.origin}){closed}"


def record_details(record: MemoryRecord) -> list[str]:
    """`memory show`: the record and its provenance, one field a line."""
    source = record.source
    extractor = source.extractor and f"{source.extractor} {source.extractor_version or ''}".rstrip()
    fields = (("id", record.id), ("kind", record.kind), ("key", record.key), ("value", record.value),
              ("partition", record.partition), ("current", "yes" if record.current else "no"),
              ("origin", source.origin), ("conversation", source.conversation_id), ("message", source.message_id),
              ("turn", source.turn_id), ("extractor", extractor), ("valid_at", _when(record.valid_at)),
              ("recorded_at", _when(record.recorded_at)), ("invalid_at", _when(record.invalid_at)),
              ("superseded_by", record.superseded_by))
    return [f"{name}: {'-' if value is None else value}" for name, value in fields]


@memory_command
def memory_list(args: argparse.Namespace, client: Client) -> int:
    from threadline.workers.clients.common import memory_view

    records = client.memory(args.tenant, args.user, history=args.history, **_scope(args))
    if args.json:
        print(json.dumps([memory_view(r) for r in records]))
    else:
        print("\n".join(record_line(r) for r in records) or "no memory")
    return 0


@memory_command
def memory_show(args: argparse.Namespace, client: Client) -> int:
    from threadline.workers.clients.common import memory_view

    record = client.memory_record(args.tenant, args.user, args.record_id, **_scope(args))
    print(json.dumps(memory_view(record)) if args.json else "\n".join(record_details(record)))
    return 0


@memory_command
def memory_set(args: argparse.Namespace, client: Client) -> int:
    from threadline.workers.clients.common import memory_view

    value = args.note if args.note is not None else args.value
    if value is None or (args.note is not None and args.value is not None):
        raise Exit(EXIT_BAD_INPUT, "give the value: --key K VALUE, --id ID VALUE, or --note TEXT")
    if args.key is not None and args.id is not None:
        raise Exit(EXIT_BAD_INPUT, "--key names a fact, --id a record: one of them")
    record = client.set_memory(args.tenant, args.user, value=value, key=args.key, record_id=args.id,
                               note=args.note is not None and args.id is None,
                               origin="operator" if args.operator else "user", **_scope(args))
    print(json.dumps(memory_view(record)) if args.json else record_line(record))
    return 0


@memory_command
def memory_forget(args: argparse.Namespace, client: Client) -> int:
    forgotten = client.forget_memory(args.tenant, args.user, key=args.key, record_id=args.id, all=args.all,
                                     **_scope(args))
    if args.all:
        print(f"forgot everything stored about user {args.user} of tenant {args.tenant}")
        return 0
    if forgotten == 0:
        what = f"fact {args.key}" if args.key is not None else f"memory record {args.id}"
        raise Exit(EXIT_NOT_FOUND, f"{what} not found")
    print(f"forgot {forgotten} record{'s' if forgotten != 1 else ''}")
    return 0


def _scoped(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--tenant", required=True, help="the tenant id")
    parser.add_argument("--user", required=True, help="the user id")
    narrow = parser.add_mutually_exclusive_group()
    narrow.add_argument("--app", help="the app's partition of the user's memory (default: the user's own)")
    narrow.add_argument("--agent", help="the agent's partition of the user's memory (default: the user's own)")
    return parser


def add_memory_parser(sub: Any) -> None:
    """`threadline memory list | show | set | forget`."""
    memory = sub.add_parser("memory", help="a user's long-term memory: list, show, correct, forget").add_subparsers(
        dest="memory", required=True)
    listing = _scoped(memory.add_parser("list", help="the user's current records (--history: closed ones too)"))
    listing.add_argument("--history", action="store_true", help="also the closed (corrected or invalidated) versions")
    listing.add_argument("--json", action="store_true", help="print JSON")
    listing.set_defaults(func=memory_list)

    show = _scoped(memory.add_parser("show", help="one record and its provenance; exit 3 not found"))
    show.add_argument("record_id", help="the record id (from `memory list`)")
    show.add_argument("--json", action="store_true", help="print JSON")
    show.set_defaults(func=memory_show)

    put = _scoped(memory.add_parser("set", help="set a fact, correct a record, or add a note"))
    put.add_argument("value", nargs="?", help="the value (with --key or --id)")
    put.add_argument("--key", help="the fact to set (e.g. name, preferred_language)")
    put.add_argument("--note", metavar="TEXT", help="a note to add (with --id: the note's corrected text)")
    put.add_argument("--id", help="the current record to correct (exit 3 when there is none)")
    put.add_argument("--operator", action="store_true", help="record the change as an operator's, not the user's")
    put.add_argument("--json", action="store_true", help="print JSON")
    put.set_defaults(func=memory_set)

    forget = _scoped(memory.add_parser("forget", help="erase a fact, a record or everything; every version of it"))
    what = forget.add_mutually_exclusive_group(required=True)
    what.add_argument("--key", help="the fact to forget, with every version of it")
    what.add_argument("--id", help="the record to forget, with every version of it")
    what.add_argument("--all", action="store_true", help="everything stored about the user, in every partition")
    forget.set_defaults(func=memory_forget)
