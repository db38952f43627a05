"""The README's raw-Redis producer commands, run as written with `redis-cli`, enqueue a turn that
completes: any program that speaks Redis can be a producer."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest

from tests.conftest import ROOT, AgentFactory, WorkerPool
from threadline.pipeline import events as ev
from threadline.workers.client import Client

pytestmark = pytest.mark.integration


def readme_block() -> str:
    text = (ROOT / "README.md").read_text()
    match = re.search(r"<!-- raw-producer:start -->\s*```sh\n(.*?)```\s*<!-- raw-producer:end -->", text, re.S)
    assert match, "README has no raw-producer block"
    return match.group(1)


@pytest.mark.skipif(shutil.which("redis-cli") is None, reason="redis-cli is not installed")
def test_readme_redis_cli_commands_enqueue_a_turn_that_succeeds(
    workers: WorkerPool, client: Client, make_agent: AgentFactory
) -> None:
    agent = make_agent("offline:echo")
    script = readme_block() + 'echo "MID=$MID"\n'
    env = {**os.environ, "REDIS_URL": workers.url, "TL_PREFIX": workers.prefix, "AGENT": agent}
    run = subprocess.run(["bash", "-eu", "-c", script], env=env, capture_output=True, text=True, timeout=30)
    assert run.returncode == 0, run.stderr
    turn_id = re.search(r"^MID=(\S+)$", run.stdout, re.M).group(1)  # type: ignore[union-attr]
    terminal = client.wait(turn_id, timeout_s=30)
    assert isinstance(terminal, ev.Succeeded), terminal
    assert '"Where is my order?"' in terminal.answer
