"""The README's tour, followed as a newcomer follows it: every shell block of "A tour: four ways in"
(the command line, `curl` against a real `threadline gateway`, `redis-cli`) run with bash, and its
Python block exec'd, against real worker processes; each is checked on what it prints.

The blocks are read from README.md by their fences and run as written. Only what must vary is set,
through the variables the README's blocks read themselves: `REDIS_URL` and `TL_PREFIX` (this test's
server and key prefix), `TL_URL` (the gateway this test starts) and `TL_KEY` (an API key it creates).
The blocks depend on each other as they do for a reader: the command-line block registers the agent
(`support-bot`) the others talk to, so every other test asks for its run first."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import ROOT, OwnPool, own_pool
from tests.support.local_http import free_port
from tests.support.wait import poll
from threadline.pipeline import events as ev
from threadline.workers.storage.api_keys import create_key

pytestmark = pytest.mark.integration

TOUR = "## A tour: four ways in"
AGENT = "support-bot"
QUERY = "Where is my order?"
#: What `offline:chat` answers to the first turn of a conversation.
FIRST_ANSWER = f'Hello! You said "{QUERY}". This is the start of our conversation.'


def tour_blocks() -> list[tuple[str, str]]:
    """(fence language, body) of every fenced block of the README's tour section, in order."""
    text = (ROOT / "README.md").read_text()
    assert TOUR in text, f"README has no {TOUR!r} section"
    section = text.split(TOUR, 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^```(\S*)\n(.*?)^```$", section, re.S | re.M)


def kind_of(language: str, body: str) -> str:
    """Which way in a tour block shows: `cli`, `curl`, `redis-cli` (shell) or `python`."""
    if language == "python":
        return "python"
    assert language == "sh", f"a tour block fenced {language!r} would not be run: fence it sh or python"
    if "curl " in body:
        return "curl"
    if "redis-cli" in body:
        return "redis-cli"
    if "threadline submit" in body:
        return "cli"
    raise AssertionError(f"a tour block this test does not run:\n{body}")


def block(kind: str) -> str:
    (body,) = [body for language, body in tour_blocks() if kind_of(language, body) == kind]
    return body


def test_the_tour_shows_each_way_in_once_and_every_block_is_run_here() -> None:
    assert sorted(kind_of(language, body) for language, body in tour_blocks()) == ["cli", "curl", "python",
                                                                                  "redis-cli"]


# --- the reader's machine: workers, the `threadline` command, a gateway ----------------------------------------


def threadline_bin(tmp: Path) -> Path:
    """A directory holding the `threadline` command of this interpreter's install (a shim running this
    interpreter when its entry point script is not next to it)."""
    installed = Path(sys.executable).parent / "threadline"
    if installed.exists():
        return installed.parent
    shim = tmp / "bin" / "threadline"
    shim.parent.mkdir(parents=True, exist_ok=True)
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m threadline.workers.cli "$@"\n')
    shim.chmod(0o755)
    return shim.parent


@dataclasses.dataclass
class Reader:
    """A terminal of someone following the tour: the workers' server and prefix in its environment."""

    env: OwnPool
    home: Path
    shell_env: dict[str, str]
    gateway_url: str

    def bash(self, script: str, **variables: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["bash", "-eu", "-o", "pipefail", "-c", script], env={**self.shell_env, **variables},
                              cwd=self.home, capture_output=True, text=True, timeout=60)

    def succeeded(self, turn_id: str) -> ev.Succeeded:
        terminal = self.env.client.wait(turn_id, timeout_s=30)
        assert isinstance(terminal, ev.Succeeded), terminal
        return terminal


@pytest.fixture(scope="module")
def reader(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Reader]:
    home = tmp_path_factory.mktemp("reader")
    with own_pool(redis_url, tmp_path_factory.mktemp("logs"), tag="tlqs", processes=2) as env:
        base = {k: v for k, v in os.environ.items() if not k.startswith("TL_") and k != "REDIS_URL"}
        shell_env = {**base, "REDIS_URL": redis_url, "TL_PREFIX": env.pool.prefix, "TL_DATA_DIR": str(home / "data"),
                     "TL_LOG_FORMAT": "json", "PATH": f"{threadline_bin(home)}{os.pathsep}{base.get('PATH', '')}"}
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        with open(home / "gateway.log", "wb") as log:
            gateway = subprocess.Popen(["threadline", "gateway", "--port", str(port)], env=shell_env, cwd=home,
                                       stdout=log, stderr=subprocess.STDOUT)
        try:
            if not poll(lambda: gateway.poll() is not None or healthy(url), timeout_s=30) or gateway.poll() is not None:
                raise RuntimeError(f"threadline gateway did not start: {(home / 'gateway.log').read_text()}")
            yield Reader(env, home, shell_env, url)
        finally:
            gateway.terminate()
            try:
                gateway.wait(timeout=10)
            except subprocess.TimeoutExpired:
                gateway.kill()
                gateway.wait()


def healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/healthz", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture(scope="module")
def cli_run(reader: Reader) -> subprocess.CompletedProcess[str]:
    """The command-line block, run once: it registers the agent every other block talks to."""
    return reader.bash(block("cli"))


# --- the four ways in --------------------------------------------------------------------------------------------


def test_cli_block_registers_the_agent_and_follows_a_turn_to_its_end(
        reader: Reader, cli_run: subprocess.CompletedProcess[str]) -> None:
    assert cli_run.returncode == 0, cli_run.stderr
    assert re.match(r"v\d+( \(unchanged\))?\n", cli_run.stdout), cli_run.stdout
    found = re.search(r"^turn (\S+)$", cli_run.stderr, re.M)
    assert found, cli_run.stderr
    assert FIRST_ANSWER in cli_run.stdout
    assert re.search(r"^\[succeeded\] \{.*\"requests\":\s*1", cli_run.stdout, re.M), cli_run.stdout
    assert reader.succeeded(found.group(1)).answer == FIRST_ANSWER
    assert reader.env.client.agent_config(AGENT).model.name == "chat"


def sse(text: str) -> list[dict[str, str]]:
    """The events of a Server-Sent Events body: {"id", "event", "data"} each (comments skipped)."""
    events = []
    for chunk in re.split(r"\r?\n\r?\n", text.strip()):
        fields = dict(line.split(": ", 1) for line in chunk.splitlines() if line and not line.startswith(":"))
        if "data" in fields:
            events.append(fields)
    return events


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
@pytest.mark.parametrize("key_from", ["test", "block"])
def test_curl_block_gets_a_202_and_streams_the_turn_to_its_terminal_event(
        reader: Reader, cli_run: subprocess.CompletedProcess[str], key_from: str) -> None:
    """With the test's own key (`TL_KEY`), and with the key the block makes itself (`threadline keys
    create acme`) when none is given."""
    variables = {"TL_URL": reader.gateway_url}
    if key_from == "test":
        tenant = f"acme{uuid.uuid4().hex[:8]}"
        variables["TL_KEY"] = create_key(reader.env.client.redis, reader.env.client.keys, tenant)
    run = reader.bash(block("curl"), **variables)
    assert run.returncode == 0, run.stderr
    # the POST's body, then the status line the block asks curl for: a form-encoded body is a 422
    posted = re.match(r"(\{.*\})\nHTTP (\d{3})\n", run.stdout)
    assert posted, run.stdout
    assert posted.group(2) == "202", run.stdout
    accepted: dict[str, Any] = json.loads(posted.group(1))
    turn_id = accepted["turn_id"]
    assert accepted["created"] is True and accepted["events_url"] == f"/v1/turns/{turn_id}/events"
    events = sse(run.stdout[posted.end():])
    assert [e["event"] for e in events][:1] == ["accepted"], run.stdout
    assert events[-1]["event"] == "succeeded", run.stdout
    data = [json.loads(e["data"]) for e in events]
    assert [d["seq"] for d in data] == list(range(1, len(data) + 1))
    assert data[-1]["answer"] == FIRST_ANSWER
    # the turn is the key's tenant's: that tenant's key reads it back through the gateway
    owner_key = variables.get("TL_KEY") or create_key(reader.env.client.redis, reader.env.client.keys, "acme")
    with httpx.Client(base_url=reader.gateway_url, headers={"Authorization": f"Bearer {owner_key}"},
                      timeout=10) as http:
        shown = http.get(f"/v1/turns/{turn_id}")
        assert shown.status_code == 200, shown.text
        assert shown.json()["status"] == "succeeded" and shown.json()["result"]["answer"] == FIRST_ANSWER
        assert shown.json()["conversation_id"] == accepted["conversation_id"]


@pytest.mark.skipif(shutil.which("redis-cli") is None, reason="redis-cli is not installed")
@pytest.mark.one_server("the tour's redis-cli block writes one server's layout (the sharded one: test_raw_producer)")
def test_redis_cli_block_enqueues_a_turn_whose_first_events_it_reads(
        reader: Reader, cli_run: subprocess.CompletedProcess[str]) -> None:
    run = reader.bash(block("redis-cli"))
    assert run.returncode == 0, run.stderr
    read = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert read and read[0]["type"] == "accepted", run.stdout
    turn_id = read[0]["turn_id"]
    assert turn_id.startswith("raw-") and [e["seq"] for e in read] == list(range(1, len(read) + 1))
    assert reader.succeeded(turn_id).answer == FIRST_ANSWER


def test_python_block_streams_a_turn_and_continues_its_conversation(
        reader: Reader, cli_run: subprocess.CompletedProcess[str], monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    for name, value in reader.shell_env.items():
        if name.startswith("TL_") or name == "REDIS_URL":
            monkeypatch.setenv(name, value)
    capsys.readouterr()
    exec(compile(block("python"), "README.md, the tour's Python block", "exec"), {"__name__": "__readme__"})
    out = capsys.readouterr().out
    found = re.search(r"^turn (\S+)$", out, re.M)
    assert found, out
    assert f"{FIRST_ANSWER}\n[succeeded]\n" in out
    follow_up = f'You said "When will it arrive?". Earlier you told me "{QUERY}". That makes 2 messages'
    assert out.rstrip().splitlines()[-1].startswith(follow_up), out
    first = reader.succeeded(found.group(1))
    assert first.conversation_id is not None
    thread = reader.env.client.thread(first.conversation_id)
    assert [m.query for m in thread] == [QUERY, "When will it arrive?"]
