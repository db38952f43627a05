"""`threadline gateway` and `threadline keys create/list/revoke/rotate`: the HTTP front door and its API keys."""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path
from typing import Any

from threadline.workers.cli.common import (
    EXIT_BAD_INPUT,
    EXIT_NOT_FOUND,
    Exit,
    at_least_one,
    display_url,
    integer_at_least,
    join,
    producer,
)
from threadline.workers.settings import Settings


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

    from threadline.workers.storage.connect import sync_client

    sync_client(url).ping()  # unreachable: one line and exit 4, before the port is taken
    print(f"threadline: gateway on http://{args.host}:{args.port} for {display_url(url)}", file=sys.stderr)
    app = create_app(settings, url, console_dir=console)
    # What start-up loaded (~130,000 objects: FastAPI, pydantic, redis-py, the routes' models) out of
    # every full collection of the garbage collector, which stops every stream's task while it scans
    # (a worker's `settle_heap`; docs/capacity.md)
    gc.collect()
    gc.freeze()
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", loop=settings.loop())
    return 0


def _ring(settings: Settings) -> tuple[Any, Any]:
    from threadline.workers.storage.api_keys import KeyRing

    client = producer(settings)
    return client, KeyRing(client.redis, client.keys)


def _limits(args: argparse.Namespace) -> Any:
    from threadline.workers.storage.api_keys import Limits

    return Limits(rps=args.rps, turns_per_min=args.turns_per_minute, streams=args.max_streams)


def cmd_keys_create(args: argparse.Namespace, settings: Settings) -> int:
    """Print a new key once (only its sha256 is stored); its id and expiry go to stderr."""
    import time

    from threadline.workers.storage.api_keys import parse_expiry

    client, ring = _ring(settings)
    try:
        expires_at = None if args.expires is None else parse_expiry(args.expires, time.time())
        key, record = ring.create(args.tenant, admin=args.admin, name=args.name, user_id=args.user,
                                  expires_at=expires_at, limits=_limits(args), webhook_url=args.webhook_url)
        print(key)
        print(f"threadline: key {record.id} for tenant {record.tenant_id}{_until(record.expires_at)}", file=sys.stderr)
    finally:
        client.close()
    return 0


def _until(stamp: float | None) -> str:
    import datetime

    if stamp is None:
        return ""
    return f", expires {datetime.datetime.fromtimestamp(stamp, datetime.UTC):%Y-%m-%dT%H:%M:%SZ}"


def _when(stamp: float | None) -> str:
    import datetime

    return "-" if stamp is None else f"{datetime.datetime.fromtimestamp(stamp, datetime.UTC):%Y-%m-%d %H:%M:%S}"


def cmd_keys_list(args: argparse.Namespace, settings: Settings) -> int:
    """Every key's record (never a key): a table, or one JSON object per line with --json."""
    import json
    import time

    client, ring = _ring(settings)
    try:
        listed = ring.list(args.tenant)
    finally:
        client.close()
    now = time.time()
    if args.json:
        for key, used in listed:
            print(json.dumps({**key.record(), "status": key.status(now), "last_used_at": used}))
        return 0
    rows = [("ID", "NAME", "TENANT", "ROLE", "USER", "STATUS", "CREATED", "EXPIRES", "LAST USED")]
    rows += [(k.id, k.name or "-", k.tenant_id, k.role, k.user_id or "-", k.status(now), _when(k.created_at),
              _when(k.expires_at), _when(used)) for k, used in listed]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())
    return 0


def cmd_keys_revoke(args: argparse.Namespace, settings: Settings) -> int:
    client, ring = _ring(settings)
    try:
        record = ring.revoke(args.id)
    finally:
        client.close()
    if record is None:
        raise Exit(EXIT_NOT_FOUND, f"no API key {args.id} (`threadline keys list` shows them)")
    print(f"threadline: key {record.id} revoked (every gateway refuses it within a second)", file=sys.stderr)
    return 0


def cmd_keys_rotate(args: argparse.Namespace, settings: Settings) -> int:
    """Print the new key once; the old one stays live for --grace."""
    import time

    from threadline.workers.storage.api_keys import parse_duration, parse_expiry

    client, ring = _ring(settings)
    try:
        grace_s = parse_duration(args.grace)
        expires_at = None if args.expires is None else parse_expiry(args.expires, time.time())
        rotated = ring.rotate(args.id, grace_s=grace_s, expires_at=expires_at)
        found = ring.find(args.id) if rotated is None else None
    finally:
        client.close()
    if rotated is None:
        if found is None:
            raise Exit(EXIT_NOT_FOUND, f"no API key {args.id} (`threadline keys list` shows them)")
        raise Exit(EXIT_BAD_INPUT, f"key {args.id} is {found[1].status(time.time())}: nothing to rotate")
    key, record, old = rotated
    print(key)
    print(f"threadline: key {record.id} replaces {old.id}{_until(record.expires_at)}; {old.id} stays live until "
          f"{_when(old.expires_at)} UTC (or `keys revoke {old.id}`)", file=sys.stderr)
    return 0


def _add_limit_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rps", type=_count, default=None, metavar="N",
                        help="requests per second the key may make (default TL_KEY_RPS; 0: no limit)")
    parser.add_argument("--turns-per-minute", type=_count, default=None, metavar="N",
                        help="turns per minute the key may start (default TL_KEY_TURNS_PER_MIN; 0: no limit)")
    parser.add_argument("--max-streams", type=_count, default=None, metavar="N",
                        help="event streams the key may hold open at once (default TL_KEY_MAX_STREAMS; 0: no limit)")


_count = integer_at_least(0)


def _add_keys_parsers(sub: Any) -> None:
    keys = sub.add_parser("keys", help="the gateway's API keys").add_subparsers(dest="keys", required=True)
    create = keys.add_parser("create", help="make an API key for a tenant; it is printed once (only its hash "
                                            "is stored)")
    create.add_argument("tenant", help="the tenant id every call with the key acts as")
    create.add_argument("--name", default="", help="what the key is for (kept by rotation; shown by `keys list`)")
    create.add_argument("--expires", default=None, metavar="WHEN",
                        help="a duration from now (90m, 24h, 30d) or an ISO 8601 time (UTC unless it says); "
                             "default: never")
    create.add_argument("--admin", action="store_true", help="the key may also manage agents and API keys")
    create.add_argument("--user", default=None, metavar="USER",
                        help="the key acts only as this user: turns of other users are refused, theirs unseen")
    create.add_argument("--webhook-url", default=None, metavar="URL",
                        help="POST the terminal event of the key's turns that name no webhook here (webhooks.md)")
    _add_limit_options(create)
    create.set_defaults(func=cmd_keys_create)
    listing = keys.add_parser("list", help="every key's id, name, tenant, role, user, times (never the key)")
    listing.add_argument("--tenant", default=None, help="only this tenant's keys")
    listing.add_argument("--json", action="store_true", help="one JSON object per key and line")
    listing.set_defaults(func=cmd_keys_list)
    revoke = keys.add_parser("revoke", help="revoke a key: every gateway refuses it within a second")
    revoke.add_argument("id", help="the key's id (`keys list`)")
    revoke.set_defaults(func=cmd_keys_revoke)
    rotate = keys.add_parser("rotate", help="a new key like this one (printed once); the old one stays live "
                                            "for --grace")
    rotate.add_argument("id", help="the key's id (`keys list`)")
    rotate.add_argument("--grace", default="24h", metavar="DURATION",
                        help="how long the old key stays live (default 24h; 0s: not at all)")
    rotate.add_argument("--expires", default=None, metavar="WHEN",
                        help="the new key's expiry (default: the old key's lifetime, from now)")
    rotate.set_defaults(func=cmd_keys_rotate)


def add_gateway_parsers(sub: Any) -> None:
    """`threadline gateway` and `threadline keys ...`."""
    gateway = sub.add_parser("gateway", help="serve the HTTP + SSE API (needs the `gateway` extra)")
    gateway.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    gateway.add_argument("--port", type=at_least_one, default=8080, help="port to listen on (default 8080)")
    console = gateway.add_mutually_exclusive_group()
    console.add_argument("--console", type=Path, default=None, metavar="DIR",
                         help="a directory of static files served at / (default: the built-in web console)")
    console.add_argument("--no-console", action="store_true", help="serve the API only, nothing at /")
    gateway.set_defaults(func=cmd_gateway)
    _add_keys_parsers(sub)
