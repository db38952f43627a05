"""`threadline agents put | list | show | versions | publish | rollback | diff`: agent configs and their
versions (`workers/storage/agents.py`)."""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from threadline.pipeline.errors import AgentNotFound, ThreadlineError
from threadline.workers.cli.common import EXIT_BAD_INPUT, EXIT_NOT_FOUND, fail, producer, read_input
from threadline.workers.settings import Settings

if TYPE_CHECKING:  # imported when a command runs: the CLI's start-up stays fast (bench/cli.py)
    from threadline.workers.clients.client import Client


def agents_command(run: Callable[[argparse.Namespace, Client], int]) -> Callable[[argparse.Namespace, Settings], int]:
    """An `agents` subcommand: an unknown agent, version or draft is one line on stderr and exit 3,
    bad input one line and exit 2 (the one format of every CLI error: `threadline: ...`)."""

    def command(args: argparse.Namespace, settings: Settings) -> int:
        client = producer(settings)
        try:
            return run(args, client)
        except ThreadlineError as e:
            return fail(EXIT_NOT_FOUND if isinstance(e, AgentNotFound) else EXIT_BAD_INPUT, f"[{e.code}] {e.message}")
        except OSError as e:
            return fail(EXIT_BAD_INPUT, str(e))
        finally:
            client.close()

    return command


def agents_put(args: argparse.Namespace, client: Client) -> int:
    text = read_input(args.file)
    result = client.put_agent_result(text, draft_id=args.draft, author=args.author)
    print(result.ref if result.created else f"{result.ref} (unchanged)")
    return 0


def agents_list(args: argparse.Namespace, client: Client) -> int:
    from threadline.workers.storage.agent_index import render_agents

    summaries = client.agents()
    if args.json:
        print(json.dumps([dataclasses.asdict(s) for s in summaries]))
    else:
        print("\n".join(render_agents(summaries)) or "no agents")
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


def add_agents_parser(sub: Any) -> None:
    """`threadline agents ...`: versions, drafts, publish, rollback (`workers/storage/agents.py`)."""
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
