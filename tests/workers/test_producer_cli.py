"""What a producer meets first (issue #23): refusals before anything is enqueued (an unknown agent or
draft: `AgentNotFound`, exit 3, 404 `agent_not_found`; a model the offline provider does not have; a
broken YAML file in one line), `conversations list`, `thread --tree`, `submit --parent`, the cancel
reason on the `cancelled` event, a timeout's message on its own line, and `Client()` finding the
embedded server as the CLI does. Through real workers, a real gateway and a real server."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import AgentFactory, WorkerPool, drop_prefix
from tests.support.cli import Result, cli_env, cli_runner
from tests.support.gateway import running_gateway
from tests.support.turns import python_model, wait_for_event
from threadline.pipeline import events as ev
from threadline.pipeline.errors import AgentNotFound
from threadline.workers.clients.async_client import AsyncClient
from threadline.workers.clients.client import Client
from threadline.workers.clients.common import ADMIT_QUEUE
from threadline.workers.clients.server import NoServer
from threadline.workers.settings import Settings
from threadline.workers.storage.api_keys import create_key
from threadline.workers.storage.embedded import ensure_embedded

SCOPE = {"tenant_id": "demo", "app_id": "demo", "user_id": "demo"}


@pytest.fixture
def run(workers: WorkerPool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> Any:
    """`run("submit", ...)` -> Result, in this process, on the workers' prefix."""
    cli_env(monkeypatch, redis_url=workers.url, prefix=workers.prefix, data_dir=tmp_path / "data")
    return cli_runner(capsys)


def test_an_unknown_agent_or_draft_is_refused_before_anything_is_enqueued(
        run: Any, client: Client, make_agent: AgentFactory, redis_url: str, prefix: str, tmp_path: Path) -> None:
    agent = make_agent("offline:echo")
    ids = [f"refused-{uuid.uuid4().hex[:8]}" for _ in range(5)]
    missing = run("submit", "--agent", "no-such-agent", "--query", "hi", "--turn-id", ids[0])
    assert missing.code == 3 and "agent_not_found" in missing.one_line() and missing.out == ""
    (tmp_path / "draft.json").write_text(json.dumps({"agent_id": agent, "query": "hi", "invoke_from": "draft",
                                                     "draft_id": "nope", "turn_id": ids[1]}))
    no_draft = run("submit", str(tmp_path / "draft.json"))
    assert no_draft.code == 3 and "no draft 'nope'" in no_draft.one_line()
    with pytest.raises(AgentNotFound):
        client.start({**SCOPE, "agent_id": "no-such-agent", "query": "hi", "turn_id": ids[2]})
    with pytest.raises(AgentNotFound, match="no draft"):
        client.start({**SCOPE, "agent_id": agent, "query": "hi", "invoke_from": "draft", "draft_id": "nope",
                      "turn_id": ids[3]})

    async def via_async() -> None:
        async with AsyncClient(redis_url, prefix=prefix) as aclient:
            with pytest.raises(AgentNotFound):
                await aclient.start({**SCOPE, "agent_id": "no-such-agent", "query": "hi", "turn_id": ids[4]})

    asyncio.run(via_async())
    # nothing enqueued by any of them: no message waits, and no worker wrote a record or an event
    assert [t for t in ids if client.turn_exists(t)] == []
    # the agent that exists runs as before
    ok = run("submit", "--agent", agent, "--query", "hi", "--follow", "--timeout", "30")
    assert ok.code == 0, ok


def test_the_gateway_answers_404_agent_not_found_and_enqueues_nothing(workers: WorkerPool, client: Client) -> None:
    settings = dataclasses.replace(Settings.from_env({"TL_KEY_RPS": "0"}), prefix=workers.prefix,
                                   redis_url=workers.url)
    key = create_key(client.redis, client.keys, f"t{uuid.uuid4().hex[:6]}")
    with running_gateway(settings, workers.url) as base:
        answer = httpx.post(f"{base}/v1/turns", headers={"Authorization": f"Bearer {key}"}, timeout=30,
                            json={"app_id": "a", "user_id": "u", "agent_id": "no-such-agent", "query": "hi",
                                  "turn_id": "gw-refused"})
    assert answer.status_code == 404, answer.text
    assert answer.json()["code"] == "agent_not_found"
    stored = [k for k in client.redis.scan_iter(f"{workers.prefix}:turn:*gw-refused*")]
    assert stored == [] and not any(b"gw-refused" in m for m in client.redis.hvals(
        client.keys.queue_messages(ADMIT_QUEUE)))


def test_agents_put_refuses_unknown_offline_models_and_every_error_is_one_line(run: Any, tmp_path: Path) -> None:
    (tmp_path / "nosuch.yaml").write_text("id: x1\nmodel: {provider: offline, name: nosuch}\n")
    refused = run("agents", "put", str(tmp_path / "nosuch.yaml"))
    assert refused.code == 2
    assert refused.one_line().startswith("threadline: [invalid_request] model offline:nosuch does not exist")
    (tmp_path / "broken.yaml").write_text("id: x2\nmodel: [offline:echo\ninstructions: hi\n")
    broken = run("agents", "put", str(tmp_path / "broken.yaml"))
    assert broken.code == 2 and "line " in broken.one_line() and "column " in broken.one_line()
    assert run("agents", "show", "x1").one_line().startswith("threadline: [agent_not_found]")


def test_conversations_list_thread_tree_and_submit_parent(run: Any, client: Client, make_agent: AgentFactory) -> None:
    agent = make_agent("offline:echo")
    tenant, user = f"t{uuid.uuid4().hex[:6]}", f"u{uuid.uuid4().hex[:6]}"
    scope = {**SCOPE, "tenant_id": tenant, "user_id": user, "agent_id": agent}
    first = client.start({**scope, "query": "one"}).result(timeout=30)
    cid = first.conversation_id
    assert cid is not None and first.message_id is not None
    client.start({**scope, "conversation_id": cid, "query": "two"}).result(timeout=30)
    # a branch from the first message, through the CLI
    branch = run("submit", "--tenant", tenant, "--user", user, "--agent", agent, "--conversation", cid,
                 "--parent", first.message_id, "--query", "other", "--follow", "--timeout", "30")
    assert branch.code == 0, branch
    client.start({**scope, "user_id": "someone-else", "query": "theirs"}).result(timeout=30)

    listed = run("conversations", "list", "--tenant", tenant, "--user", user, "--json")
    assert [c["id"] for c in json.loads(listed.out)] == [cid]
    assert len(json.loads(run("conversations", "list", "--tenant", tenant, "--json").out)) == 2
    assert cid in run("conversations", "list", "--tenant", tenant, "--user", user).out
    assert run("conversations", "list", "--tenant", tenant, "--user", "nobody").out.startswith("no conversations")

    plain = run("thread", cid)
    assert plain.code == 0 and "other" in plain.out and "two" not in plain.out  # the tip is the branch
    assert "other branches" in plain.one_line() and "--tree" in plain.one_line()
    tree = run("thread", cid, "--tree")
    assert all(q in tree.out for q in ("one", "two", "other")) and first.message_id in tree.out
    marked = [line for line in tree.out.splitlines() if line.startswith("*")]
    assert len(marked) == 2 and "two" not in "".join(marked)  # the path to the tip: one, other


def test_the_cancel_reason_ends_on_the_cancelled_event(run: Any, client: Client, make_agent: AgentFactory) -> None:
    slow = make_agent(python_model("streaming", words=3000, delay_ms=10))
    turn = client.start({**SCOPE, "agent_id": slow, "query": "talk"})
    wait_for_event(client, turn, "text_delta")
    assert run("cancel", turn, "--reason", "user pressed stop").code == 0
    ended = turn.result(timeout=30)
    assert isinstance(ended, ev.Cancelled) and ended.message == "user pressed stop", ended
    # without a reason: the default message, as before
    other = client.start({**SCOPE, "agent_id": slow, "query": "talk"})
    wait_for_event(client, other, "text_delta")
    other.cancel()
    plain = other.result(timeout=30)
    assert isinstance(plain, ev.Cancelled) and plain.message == "the turn was cancelled"


def test_a_timeout_message_starts_on_its_own_line(run: Any, client: Client, make_agent: AgentFactory) -> None:
    slow = make_agent(python_model("streaming", words=3000, delay_ms=20))
    followed: Result = run("submit", "--agent", slow, "--query", "talk", "--follow", "--timeout", "3")
    assert followed.code == 124, followed
    assert followed.out.endswith("\n")  # the streamed text's line ended before the message
    assert "did not finish within 3 s" in followed.err.strip().splitlines()[-1]
    client.cancel(followed.err.split()[1])


def test_client_without_a_url_finds_the_embedded_server_like_the_cli(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("REDIS_URL", raising=False)
    monkeypatch.setenv("TL_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("TL_PREFIX", "tlfind")
    with pytest.raises(NoServer, match="threadline worker"):
        Client()
    server = ensure_embedded(tmp_path / "data")  # what a running `threadline worker` started
    try:
        with Client() as found:
            assert found.url == server.url and found.keys.prefix == "tlfind"
            assert found.redis.ping()
    finally:
        server.stop()


def test_the_demo_keeps_logs_out_of_its_stdout_and_ends_with_three_next_steps(redis_url: str,
                                                                              tmp_path: Path) -> None:
    prefix = f"tldemo{uuid.uuid4().hex[:6]}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TL_")}
    env |= {"REDIS_URL": redis_url, "TL_PREFIX": prefix, "TL_DATA_DIR": str(tmp_path / "data"),
            "TL_PROCESSES": "1", "TL_THREADS": "2"}
    done = subprocess.run([str(Path(sys.executable).with_name("threadline")), "demo", "--delay-ms", "0"], env=env,
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert not [line for line in lines if line.lstrip().startswith("{")]  # no JSON log line
    steps = lines[-4:]
    assert steps[0].startswith("Next steps")
    assert "http://127.0.0.1:8080/" in steps[1] and "curl -sS" in steps[2] and "Client()" in steps[3]
    assert (tmp_path / "data" / "demo.log").exists()
    with Client(redis_url, prefix=prefix) as c:
        drop_prefix(c.redis, prefix)


def test_the_parser_imports_neither_redis_nor_pydantic_and_the_client_no_pydantic() -> None:
    """What keeps `--version`/`--help` and `cancel`/`status` quick (`bench/cli.py`): each verb imports
    what it needs when it runs; the client loads the turn request's model only to check a request."""
    probe = ("import sys; from threadline.workers.cli import main; main.parser(); "
             "print(sorted(m for m in ('redis', 'pydantic') if m in sys.modules)); "
             "from threadline.workers.clients import client; from threadline.workers.operations import status; "
             "print('pydantic' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.split("\n")[:2] == ["[]", "False"], done.stdout
