"""`threadline submit | events | cancel | thread | turn show | conversations list | delete`: turns and
the conversations they write. What needs pydantic (the turn request's model) or redis is imported
when a command runs, not when the parser is built (`bench/cli.py`)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from threadline.pipeline.errors import ThreadlineError
from threadline.workers.settings import Settings

if TYPE_CHECKING:
    from threadline.pipeline.contracts import TurnRequest
    from threadline.pipeline.records import ConversationRecord, MessageRecord
    from threadline.workers.clients.client import Client
    from threadline.workers.storage.conversations import DeleteResult

from threadline.workers.cli.common import (
    EXIT_BAD_INPUT,
    EXIT_BUSY,
    EXIT_NOT_FOUND,
    Exit,
    follow,
    integer_at_least,
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
             "conversation_id": args.conversation, "query": args.query, "turn_id": args.turn_id,
             "parent_message_id": args.parent_message_id, "on_busy": args.on_busy, "webhook_url": args.webhook_url}
    request.update({k: v for k, v in flags.items() if v is not None})
    for name, default in (("tenant_id", "demo"), ("app_id", "demo"), ("user_id", "demo")):
        request.setdefault(name, default)
    return request


def check_request(request: dict[str, Any], settings: Settings) -> TurnRequest:
    """Refuse here what the workers would refuse (the same model, this process's limits), so a bad
    request is exit 2 now rather than a `failed` event later."""
    from threadline.pipeline.contracts import TURN_SCHEMA, parse_turn_request

    try:
        return parse_turn_request({"schema": TURN_SCHEMA, **request}, fallback_turn_id="cli",
                                  max_query_chars=settings.max_query_chars,
                                  max_context_chars=settings.max_context_chars)
    except ThreadlineError as e:
        raise Exit(EXIT_BAD_INPUT, e.message if e.message.startswith("invalid turn request")
                   else f"invalid turn request: {e.message}") from None


def cmd_submit(args: argparse.Namespace, settings: Settings) -> int:
    request = _request_from_args(args)
    checked = check_request(request, settings)
    client = producer(settings)
    client.check_agent(checked)  # an unknown agent or draft: exit 3 now, nothing enqueued
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
    from threadline.pipeline.ids import valid_turn_id

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
    """The path to the tip; with `--tree`, every branch. Plain `thread` says how many messages other
    branches hold, and how to see them."""
    from threadline.pipeline.history import extract_thread

    client = producer(settings)
    conversation = client.conversation(args.conversation_id)
    if conversation is None:
        raise Exit(EXIT_NOT_FOUND, f"conversation {args.conversation_id} not found (prefix {settings.prefix})")
    messages = client.messages(args.conversation_id)
    if args.tree:
        print("\n".join(render_tree(messages, tip=conversation.tip)))
        return 0
    thread, _ = extract_thread(messages, conversation.tip)
    for message in thread:
        # a turn another one interrupted (`on_busy`) kept its partial answer: say so
        by = message.interrupted_by
        status = f"{message.status}, interrupted by {by}" if by else message.status
        print(f"[{status}] user: {message.query}\n            assistant: {message.answer}")
    if hidden := len(messages) - len(thread):
        print(f"threadline: {hidden} message{'s' if hidden > 1 else ''} on other branches not shown (see them with "
              f"`threadline thread --tree {args.conversation_id}`)", file=sys.stderr)
    return 0


def render_tree(messages: Sequence[MessageRecord], *, tip: str | None) -> list[str]:
    """Every message under its parent, oldest first, with its id (for `submit --parent`); `*` marks
    the path to the tip, the thread a turn without `--parent` continues."""
    by_id = {m.id: m for m in messages}
    children: dict[str | None, list[MessageRecord]] = {}
    for m in sorted(messages, key=lambda m: m.created_at):
        children.setdefault(m.parent_id if m.parent_id in by_id else None, []).append(m)
    on_path: set[str] = set()
    at = by_id.get(tip) if tip else None
    while at is not None and at.id not in on_path:
        on_path.add(at.id)
        at = by_id.get(at.parent_id) if at.parent_id else None
    lines: list[str] = []

    def walk(parent: str | None, depth: int) -> None:
        for m in children.get(parent, []):
            mark = "*" if m.id in on_path else " "
            pad = "  " * depth
            lines.append(f"{mark} {pad}{m.id} [{m.status}] user: {m.query}")
            lines.append(f"  {pad}{' ' * len(m.id)}  assistant: {m.answer}")
            walk(m.id, depth + 1)

    walk(None, 0)
    return lines


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


def cmd_conversations_list(args: argparse.Namespace, settings: Settings) -> int:
    """A page of the tenant's conversations, the most recently active first (`Client.conversations`,
    the gateway's `GET /v1/conversations`); `--app` and `--user` keep that page's matches."""
    client = producer(settings)
    try:
        found = [c for c in client.conversations(args.tenant, limit=args.limit, offset=args.offset)
                 if args.app in (None, c.app_id) and args.user in (None, c.user_id)]
    finally:
        client.close()
    if args.json:
        print(json.dumps([c.model_dump(mode="json") for c in found]))
    else:
        print("\n".join(render_conversations(found)) or f"no conversations (tenant {args.tenant})")
    return 0


def render_conversations(found: Sequence[ConversationRecord]) -> list[str]:
    return [f"{c.id}  {_when(c.created_at)}  app {c.app_id}  user {c.user_id}  agent {c.agent_id} {c.config_ref}"
            f"  {c.revision} turns" for c in found]


def _when(epoch_s: float) -> str:
    return datetime.fromtimestamp(epoch_s, UTC).strftime("%Y-%m-%d %H:%M:%S")


def cmd_conversations_delete(args: argparse.Namespace, settings: Settings) -> int:
    """Exit 0 deleted, 2 not an id, 3 not found (or another tenant's), 5 busy."""
    client = producer(settings)
    cid = args.conversation_id
    try:
        result = delete_when_idle(client, cid, tenant_id=args.tenant, cancel=args.cancel, timeout_s=args.timeout)
    except ThreadlineError as e:
        print(f"threadline: [{e.code}] {e.message}", file=sys.stderr)
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
    """`threadline conversations list | delete ID`."""
    conversations = sub.add_parser("conversations", help="list and delete stored conversations").add_subparsers(
        dest="conversations", required=True)
    listing = conversations.add_parser("list", help="a tenant's conversations, the most recently active first")
    listing.add_argument("--tenant", default="demo", help="the tenant (default demo)")
    listing.add_argument("--app", help="only this app's (of the page read)")
    listing.add_argument("--user", help="only this user's (of the page read)")
    listing.add_argument("--limit", type=integer_at_least(1), default=50, help="conversations per page (default 50)")
    listing.add_argument("--offset", type=integer_at_least(0), default=0, help="skip this many first (default 0)")
    listing.add_argument("--json", action="store_true", help="print JSON")
    listing.set_defaults(func=cmd_conversations_list)
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
