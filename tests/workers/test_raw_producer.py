"""The raw-Redis producer commands of docs/protocol.md, run as written with `redis-cli`, enqueue a turn
that completes: any program that speaks Redis can be a producer."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Callable

import pytest
from dramatiq.message import Message

from tests.conftest import ROOT, AgentFactory, WorkerPool
from threadline.pipeline import events as ev
from threadline.pipeline.config import AgentConfig
from threadline.workers.clients.client import Client
from threadline.workers.protocol.wire import build_message
from threadline.workers.storage.connect import cluster_url

pytestmark = pytest.mark.integration


PROTOCOL_DOC = ROOT / "docs" / "protocol.md"


def readme_block(name: str = "raw-producer") -> str:
    """A raw-producer block of docs/protocol.md (between its `<name>` markers)."""
    text = PROTOCOL_DOC.read_text()
    match = re.search(rf"<!-- {name}:start -->\s*```sh\n(.*?)```\s*<!-- {name}:end -->", text, re.S)
    assert match, f"docs/protocol.md has no {name} block"
    return match.group(1)


@pytest.mark.skipif(shutil.which("redis-cli") is None, reason="redis-cli is not installed")
@pytest.mark.one_server("the commands of one server's layout")
def test_readme_redis_cli_commands_enqueue_a_turn_that_succeeds(
    workers: WorkerPool, client: Client, make_agent: AgentFactory
) -> None:
    assert_block_runs_a_turn("raw-producer", workers, client, make_agent("offline:echo"))


def assert_block_runs_a_turn(block: str, pool: WorkerPool, client: Client, agent: str) -> None:
    """The commands of a block, run as written, enqueue a turn that succeeds."""
    script = readme_block(block) + 'echo "MID=$MID"\n'
    # redis-cli takes one node's URL (`-c` follows a cluster's redirections)
    env = {**os.environ, "REDIS_URL": cluster_url(pool.url) or pool.url, "TL_PREFIX": pool.prefix, "AGENT": agent}
    run = subprocess.run(["bash", "-eu", "-c", script], env=env, capture_output=True, text=True, timeout=30)
    assert run.returncode == 0, run.stderr
    turn_id = re.search(r"^MID=(\S+)$", run.stdout, re.M).group(1)  # type: ignore[union-attr]
    terminal = client.wait(turn_id, timeout_s=30)
    assert isinstance(terminal, ev.Succeeded), terminal
    assert '"Where is my order?"' in terminal.answer


@pytest.mark.skipif(shutil.which("redis-cli") is None or shutil.which("jq") is None, reason="needs redis-cli and jq")
def test_the_sharded_layouts_commands_enqueue_a_turn_that_succeeds(isolated: Callable[..., WorkerPool]) -> None:
    pool = isolated({"TL_SHARDS": "4"}).start(processes=1, threads=4)
    client = Client(pool.url, prefix=pool.prefix)
    client.put_agent(AgentConfig.model_validate({"id": "raw-agent", "model": "offline:echo"}))
    assert_block_runs_a_turn("raw-producer-sharded", pool, client, "raw-agent")
    client.close()


@pytest.mark.parametrize("delay_ms", [None, 250])
def test_the_producers_message_is_the_one_dramatiq_writes(delay_ms: int | None) -> None:
    """`workers/protocol/wire.py` builds messages without importing dramatiq (fast producer commands): the
    bytes must be exactly what dramatiq's broker would store."""
    queue, mid, data = build_message("resolve", "resolve", ({"query": "héllo", "n": [1, 2]},), message_id="m-1",
                                     now_ms=1_700_000_000_000, delay_ms=delay_ms)
    options: dict[str, object] = {"redis_message_id": "m-1"}
    if delay_ms:
        options["eta"] = 1_700_000_000_000 + delay_ms
    expected = Message(queue_name=queue, actor_name="resolve", args=({"query": "héllo", "n": [1, 2]},), kwargs={},
                       options=options, message_id="m-1", message_timestamp=1_700_000_000_000)
    assert (queue, mid) == ("resolve.DQ" if delay_ms else "resolve", "m-1")
    assert data == expected.encode()
