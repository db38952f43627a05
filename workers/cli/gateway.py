"""`threadline gateway` and `threadline keys create`: the HTTP front door and its API keys."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import redis

from threadline.workers.settings import Settings

if TYPE_CHECKING:
    pass

from threadline.workers.cli.common import EXIT_BAD_INPUT, Exit, at_least_one, display_url, join, producer


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
