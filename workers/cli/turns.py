"""`threadline submit | events | cancel | thread | turn show | conversations delete`: turns and the
conversations they write."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import TYPE_CHECKING, Any

from threadline.pipeline.contracts import TURN_SCHEMA, parse_turn_request, valid_turn_id
from threadline.pipeline.errors import ThreadlineError
from threadline.workers.clients.client import Client
from threadline.workers.settings import Settings

if TYPE_CHECKING:
    from threadline.workers.storage.conversations import DeleteResult

from threadline.workers.cli.common import (
    EXIT_BAD_INPUT,
    EXIT_BUSY,
    EXIT_NOT_FOUND,
    Exit,
    follow,
    producer,
    read_input,
    still_running,
)


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
