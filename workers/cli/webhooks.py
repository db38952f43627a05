"""`threadline webhooks list | retry | secret`: completion webhooks as an operator sees them — every
delivery and its attempts, one more attempt of a delivery now, and a tenant's signing secret
(docs/webhooks.md). An unknown delivery is one line on stderr and exit 3."""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, TypeVar

from threadline.workers.cli.common import EXIT_BUSY, EXIT_NOT_FOUND, Exit, at_least_one, join
from threadline.workers.settings import Settings

if TYPE_CHECKING:  # imported when a command runs: the CLI's start-up stays fast (bench/cli.py)
    from threadline.workers.storage.webhooks import Delivery, WebhookStore

T = TypeVar("T")


def _with_store(settings: Settings, run: Callable[[WebhookStore], Awaitable[T]]) -> T:
    """`run` on a webhook store of the stored key layout (this process's TL_SHARDS may be unset)."""
    import asyncio

    from threadline.pipeline.stages import DEFAULT_GRAPH
    from threadline.workers.clients.layout import async_layout_keys
    from threadline.workers.storage.webhooks import WebhookStore

    async def go() -> T:
        store = WebhookStore.connect(join(settings), settings, DEFAULT_GRAPH)
        try:
            store.layout = await async_layout_keys(store.redis, settings.prefix, 0)
            return await run(store)
        finally:
            await store.close()

    return asyncio.run(go())


def _when(at: float | None) -> str:
    return "-" if at is None else datetime.fromtimestamp(at, UTC).isoformat(timespec="seconds")


def delivery_view(d: Delivery, attempts: list[dict[str, Any]]) -> dict[str, Any]:
    """A delivery as `--json` prints it: its record (the event parsed) and its attempts' records."""
    return {**dataclasses.asdict(d), "event": json.loads(d.event), "attempt_log": attempts}


def delivery_lines(d: Delivery, attempts: list[dict[str, Any]]) -> list[str]:
    """One line per delivery, then one per attempt."""
    head = (f"{d.id}  {d.status}  {d.attempts}/{d.max_attempts}  tenant {d.tenant_id}  {d.url}  "
            f"created {_when(d.created_at)}")
    rows = [f"  #{a['attempt']} {_when(a['at'])}  {a['outcome']}  "
            f"{a['status_code'] if a['status_code'] is not None else a['error']}  {a['ms']} ms" for a in attempts]
    return [head, *rows]


def cmd_list(args: argparse.Namespace, settings: Settings) -> int:
    async def run(store: WebhookStore) -> list[tuple[Delivery, list[dict[str, Any]]]]:
        found = await store.deliveries(turn_id=args.turn, tenant_id=args.tenant, limit=args.limit)
        return [(d, await store.delivery_attempts(d.id)) for d in found]

    listed = _with_store(settings, run)
    if args.turn is not None and not listed:
        raise Exit(EXIT_NOT_FOUND, f"no webhook delivery for turn {args.turn}")
    if args.json:
        print(json.dumps([delivery_view(d, a) for d, a in listed]))
    else:
        print("\n".join(line for d, a in listed for line in delivery_lines(d, a)) or "no webhook deliveries")
    return 0


def cmd_retry(args: argparse.Namespace, settings: Settings) -> int:
    async def run(store: WebhookStore) -> str:
        return await store.retry_delivery(args.delivery_id, now=time.time())

    outcome = _with_store(settings, run)
    if outcome == "not_found":
        raise Exit(EXIT_NOT_FOUND, f"no webhook delivery {args.delivery_id}")
    if outcome == "stale":
        raise Exit(EXIT_BUSY, f"webhook delivery {args.delivery_id} recorded an attempt meanwhile; retry again")
    print(f"queued another attempt of {args.delivery_id}")
    return 0


def cmd_secret(args: argparse.Namespace, settings: Settings) -> int:
    async def run(store: WebhookStore) -> str:
        return await store.webhook_secret(args.tenant, rotate=args.rotate)

    print(_with_store(settings, run))
    return 0


def add_webhooks_parser(sub: Any) -> None:
    """`threadline webhooks list | retry | secret`."""
    hooks = sub.add_parser("webhooks", help="completion webhooks: deliveries, retries, signing secrets")
    verbs = hooks.add_subparsers(dest="webhooks", required=True)
    ls = verbs.add_parser("list", help="webhook deliveries, newest first, with every attempt")
    ls.add_argument("--turn", help="only the delivery of this turn (its id is the turn id)")
    ls.add_argument("--tenant", help="only this tenant's deliveries")
    ls.add_argument("--limit", type=at_least_one, default=50, help="at most this many (default 50)")
    ls.add_argument("--json", action="store_true", help="print JSON")
    ls.set_defaults(func=cmd_list)
    retry = verbs.add_parser("retry", help="one more attempt of a delivery, now")
    retry.add_argument("delivery_id", help="the delivery id (the turn id)")
    retry.set_defaults(func=cmd_retry)
    secret = verbs.add_parser("secret", help="print a tenant's signing secret (created on first use)")
    secret.add_argument("tenant", help="the tenant id")
    secret.add_argument("--rotate", action="store_true", help="replace it with a new one first")
    secret.set_defaults(func=cmd_secret)
