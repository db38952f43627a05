"""The agent config lifecycle through real worker processes: versions, publish, rollback, drafts, and
which version a conversation runs (offline:echo answers with the system text it received)."""

from __future__ import annotations

import json
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import WorkerPool, turn
from threadline.pipeline import events as ev
from threadline.pipeline.errors import AgentNotFound, InvalidRequest
from threadline.workers.cli.main import main
from threadline.workers.clients.client import Client
from threadline.workers.storage.connect import sync_client

pytestmark = pytest.mark.integration


def config(agent_id: str, instructions: str, **fields: Any) -> dict[str, Any]:
    return {"id": agent_id, "model": "offline:echo", "instructions": instructions, **fields}


def document(agent_id: str, instructions: str, **fields: Any) -> str:
    return json.dumps(config(agent_id, instructions, **fields))


def new_agent_id() -> str:
    return f"agent-{uuid.uuid4().hex[:10]}"


def run(client: Client, agent_id: str, query: str, **fields: Any) -> tuple[ev.Accepted | None, ev.Terminal]:
    """One turn to its end: its `accepted` event (None when refused before it) and its terminal one."""
    turn_id = client.submit(turn(agent_id, query, **fields))
    events = list(client.events(turn_id, follow=True, timeout_s=30))
    accepted = next((e for e in events if isinstance(e, ev.Accepted)), None)
    terminal = events[-1]
    assert isinstance(terminal, ev.Terminal)
    return accepted, terminal


def system_seen(terminal: ev.Terminal) -> str:
    assert isinstance(terminal, ev.Succeeded), terminal
    seen: dict[str, Any] = json.loads(terminal.answer)
    return str(seen["system"])


class Conversation:
    """A conversation driven turn by turn; each turn says which instructions the model received."""

    def __init__(self, client: Client, agent_id: str, **fields: Any) -> None:
        self.client, self.agent_id, self.fields = client, agent_id, fields
        self.id: str | None = None
        self.version = ""

    def say(self, query: str) -> str:
        accepted, terminal = run(self.client, self.agent_id, query, conversation_id=self.id, **self.fields)
        assert accepted is not None, terminal
        self.id, self.version = accepted.conversation_id, accepted.config_version
        return system_seen(terminal)


def test_publish_and_rollback_move_new_conversations_only(workers: WorkerPool, client: Client) -> None:
    agent = new_agent_id()
    assert client.put_agent(document(agent, "You are v1"), author="ada") == "v1"
    on_v1 = Conversation(client, agent)
    assert on_v1.say("hello") == "You are v1" and on_v1.version == "v1"

    # publish v2 (from a draft) while a conversation runs on v1: it keeps v1
    client.put_agent(document(agent, "You are v2"), draft_id="next")
    published = client.publish_agent(agent, author="bob")
    assert (published.ref, published.created) == ("v2", True)
    assert on_v1.say("still there?") == "You are v1" and on_v1.version == "v1"
    on_v2 = Conversation(client, agent)
    assert on_v2.say("hello") == "You are v2" and on_v2.version == "v2"

    # rollback: v1 is active again for new conversations; the v2 conversation keeps v2
    assert client.rollback_agent(agent, "v1", author="cy") is True
    assert Conversation(client, agent).say("hello") == "You are v1"
    assert on_v2.say("and now?") == "You are v2" and on_v2.version == "v2"
    assert on_v1.say("and you?") == "You are v1"
    assert client.rollback_agent(agent, 1, author="cy") is False  # already active: nothing recorded

    history = client.agent_versions(agent)
    assert history.active == 1
    assert [(v.version, v.author, v.source, v.from_draft) for v in history.versions] == [
        (1, "ada", "put", None), (2, "bob", "publish", "next")]
    assert all(v.created_at is not None and abs(v.created_at - time.time()) < 60 for v in history.versions)
    assert [(a.version, a.action, a.author) for a in history.activations] == [
        (1, "rollback", "cy"), (2, "publish", "bob"), (1, "put", "ada")]
    # the draft is kept after publishing
    assert [(s.active, s.latest, s.drafts) for s in client.agents() if s.agent_id == agent] == [(1, 2, ("next",))]


def test_the_agents_hash_keeps_the_active_document_and_an_agent_stored_without_it_still_runs(
        workers: WorkerPool, client: Client) -> None:
    """A turn reads the active version and its document in one command: a put and a rollback keep the
    document in the agent's hash (`active_config`). An agent made active before the hash kept it runs
    its active version read by number, and the next identical put writes the field."""
    agent = new_agent_id()
    key = client.keys.agent(agent)
    client.put_agent(document(agent, "You are v1"))
    client.put_agent(document(agent, "You are v2"))
    assert json.loads(client.redis.hget(key, "active_config"))["instructions"] == "You are v2"
    client.rollback_agent(agent, 1)
    assert json.loads(client.redis.hget(key, "active_config"))["instructions"] == "You are v1"

    client.redis.hdel(key, "active_config")
    assert Conversation(client, agent).say("hello") == "You are v1"
    assert client.put_agent(document(agent, "You are v1")) == "v1"
    assert json.loads(client.redis.hget(key, "active_config"))["instructions"] == "You are v1"


def test_identical_put_returns_the_active_version_and_writes_nothing(client: Client) -> None:
    agent = new_agent_id()
    first = client.put_agent_result(document(agent, "Same", settings={"temperature": 0.1, "top_p": 0.9}))
    assert (first.ref, first.created) == ("v1", True)
    before = {k: client.redis.dump(k) for k in client.redis.scan_iter(f"{client.keys.agent(agent)}*")}
    # the same document with its mappings in another order, as YAML: the same version
    again = client.put_agent_result(f"id: {agent}\nmodel: offline:echo\ninstructions: Same\n"
                                    "settings: {top_p: 0.9, temperature: 0.1}\n")
    assert (again.ref, again.created) == ("v1", False)
    assert client.put_agent(document(agent, "Same", settings={"temperature": 0.1, "top_p": 0.9})) == "v1"
    after = {k: client.redis.dump(k) for k in client.redis.scan_iter(f"{client.keys.agent(agent)}*")}
    assert after == before  # no new version key, no metadata, no activation
    assert not client.redis.exists(client.keys.agent_version(agent, 2))

    # a change is a new version; the old document again is a new version too (only the active one
    # is compared), with the same digest as v1
    assert client.put_agent(document(agent, "Changed")) == "v2"
    assert client.put_agent(document(agent, "Same", settings={"temperature": 0.1, "top_p": 0.9})) == "v3"
    versions = client.agent_versions(agent).versions
    assert versions[0].digest == versions[2].digest != versions[1].digest


def test_concurrent_puts_make_one_version_per_document(redis_url: str, prefix: str, client: Client) -> None:
    agent = new_agent_id()
    clients = [Client(redis_url, prefix=prefix) for _ in range(8)]
    start = threading.Barrier(len(clients))
    refs: list[str] = []

    def put(c: Client, instructions: str) -> None:
        start.wait()
        refs.append(c.put_agent(document(agent, instructions)))

    def race(instructions: list[str]) -> None:
        threads = [threading.Thread(target=put, args=(c, i)) for c, i in zip(clients, instructions, strict=True)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    try:
        race(["Same"] * 8)
        assert refs == ["v1"] * 8
        assert client.agent_versions(agent).versions[-1].version == 1
        # eight different documents at once: eight versions, none lost, none written twice
        refs.clear()
        race([f"Doc {n}" for n in range(8)])
        assert sorted(refs, key=lambda r: int(r[1:])) == [f"v{n}" for n in range(2, 10)]
        seen = {client.agent_config(agent, n).instructions for n in range(2, 10)}
        assert seen == {f"Doc {n}" for n in range(8)}
        assert len(client.agent_versions(agent).activations) == 9
    finally:
        for c in clients:
            c.close()


def test_a_draft_conversation_ends_on_a_layer_change_a_published_one_never_moves(
        workers: WorkerPool, client: Client) -> None:
    """Conversations compare their layers with the config they run. A published conversation runs its
    pinned, immutable version, so a new version with other layers leaves it running; a draft is
    updated in place, so a draft conversation runs the new content and ends on a layer change."""
    agent = new_agent_id()
    client.put_agent(document(agent, "Published v1", layers=["history"]))
    published = Conversation(client, agent)
    assert published.say("hi") == "Published v1"

    client.put_agent(document(agent, "Draft A", layers=["history"]), draft_id="d1")
    drafting = Conversation(client, agent, invoke_from="draft", draft_id="d1")
    assert drafting.say("hi") == "Draft A" and drafting.version == "draft:d1"
    client.put_agent(document(agent, "Draft B", layers=["history"]), draft_id="d1")
    assert drafting.say("again") == "Draft B"  # same layers: the draft's new instructions apply

    client.put_agent(document(agent, "Draft C", layers=["history", "tools"]), draft_id="d1")
    accepted, terminal = run(client, agent, "and now?", conversation_id=drafting.id, invoke_from="draft",
                             draft_id="d1")
    assert accepted is None and isinstance(terminal, ev.Failed)
    assert terminal.code == "agent_session_configuration_changed"

    # the same layer change published: the v1 conversation keeps running v1, a new one gets v2
    assert client.publish_agent(agent, draft_id="d1").ref == "v2"
    assert published.say("still here?") == "Published v1" and published.version == "v1"
    assert Conversation(client, agent).say("hi") == "Draft C"


def test_unknown_agents_versions_and_drafts_are_refused(client: Client) -> None:
    agent = new_agent_id()
    with pytest.raises(AgentNotFound, match="not registered"):
        client.agent_config(agent)
    with pytest.raises(AgentNotFound):
        client.agent_versions(agent)
    client.put_agent(document(agent, "One"))
    with pytest.raises(AgentNotFound, match="no version v7"):
        client.rollback_agent(agent, 7)
    with pytest.raises(AgentNotFound, match="no draft"):
        client.publish_agent(agent)
    with pytest.raises(InvalidRequest, match="a version is a number"):
        client.rollback_agent(agent, "latest")
    for draft in ("a", "b"):
        client.put_agent(document(agent, draft), draft_id=draft)
    with pytest.raises(InvalidRequest, match="2 drafts"):
        client.publish_agent(agent)
    assert client.agent_config(agent).instructions == "One"


# --- the command line ------------------------------------------------------------------------------


@pytest.fixture
def cli(redis_url: str, prefix: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> Any:
    """`cli("agents", "list")` -> (exit code, stdout, stderr), in this process, on the test server."""
    monkeypatch.setenv("REDIS_URL", redis_url)
    monkeypatch.setenv("TL_PREFIX", prefix)
    monkeypatch.setenv("TL_AUTHOR", "terminal-tess")
    monkeypatch.setenv("TL_LOG_FORMAT", "json")

    def invoke(*argv: str) -> tuple[int, str, str]:
        capsys.readouterr()
        with pytest.raises(SystemExit) as stop:
            main(list(argv))
        out, err = capsys.readouterr()
        return int(stop.value.code or 0), out, err

    return invoke


def test_the_agents_commands(cli: Any, client: Client, tmp_path: Path) -> None:
    agent = new_agent_id()
    v1, v2 = tmp_path / "v1.yaml", tmp_path / "v2.yaml"
    v1.write_text(f"id: {agent}\nmodel: offline:echo\ninstructions: You are v1\n")
    v2.write_text(f"id: {agent}\nmodel: offline:echo\ninstructions: You are v2\n")

    assert cli("agents", "put", str(v1)) == (0, "v1\n", "")
    assert cli("agents", "put", str(v1)) == (0, "v1 (unchanged)\n", "")
    assert cli("agents", "put", str(v2), "--draft", "main") == (0, "draft:main\n", "")
    assert cli("agents", "publish", agent, "--author", "pat") == (0, "v2\n", "")

    code, out, _ = cli("agents", "versions", agent)
    assert code == 0
    lines = out.splitlines()
    assert lines[0].startswith("v1  ") and "  terminal-tess  put  " in lines[0] and not lines[0].endswith("active")
    assert lines[1].startswith("v2  ") and "  pat  publish (draft main)  " in lines[1] and lines[1].endswith("active")
    code, out, _ = cli("agents", "list")
    assert code == 0 and f"{agent}  active v2  latest v2  drafts main" in out.splitlines()

    code, out, _ = cli("agents", "show", agent)
    assert code == 0 and "instructions: You are v2" in out.splitlines() and f"id: {agent}" in out
    code, out, _ = cli("agents", "show", agent, "--version", "v1", "--json")
    assert code == 0 and json.loads(out)["instructions"] == "You are v1"

    code, out, _ = cli("agents", "diff", agent, "1", "v2")
    assert code == 0
    assert out.splitlines()[:2] == [f"--- {agent} v1", f"+++ {agent} v2"]
    assert "-instructions: You are v1" in out.splitlines() and "+instructions: You are v2" in out.splitlines()
    assert cli("agents", "diff", agent, "v2", "v2") == (0, "identical\n", "")

    assert cli("agents", "rollback", agent, "v1") == (0, f"{agent}: v1 is active\n", "")
    code, out, _ = cli("agents", "versions", agent, "--json")
    listed = json.loads(out)
    assert listed["active"] == 1 and listed["activations"][0]["author"] == "terminal-tess"
    assert [v["author"] for v in listed["versions"]] == ["terminal-tess", "pat"]


@pytest.mark.parametrize(("argv", "code", "says"), [
    (("agents", "show", "no-such-agent"), 3, "not registered"),
    (("agents", "show", "@AGENT", "--version", "9"), 3, "no version v9"),
    (("agents", "rollback", "@AGENT", "v9"), 3, "no version v9"),
    (("agents", "diff", "@AGENT", "v1", "v9"), 3, "no version v9"),
    (("agents", "versions", "no-such-agent"), 3, "no published version"),
    (("agents", "publish", "@AGENT"), 3, "no draft"),
    (("agents", "rollback", "@AGENT", "latest"), 2, "a version is a number"),
    (("agents", "put", "@BAD"), 2, "invalid_request"),
    (("agents", "put", "/no/such/file.yaml"), 2, "No such file"),
], ids=["agent", "show-version", "rollback-version", "diff-version", "versions", "draft", "bad-version",
        "bad-config", "no-file"])
def test_agents_commands_fail_with_one_line_and_their_exit_code(cli: Any, tmp_path: Path, argv: tuple[str, ...],
                                                                code: int, says: str) -> None:
    agent = new_agent_id()
    bad = tmp_path / "bad.yaml"
    bad.write_text(f"id: {agent}\nmodel: offline:echo\nsettings: {{seed: 1}}\n")
    good = tmp_path / "good.yaml"
    good.write_text(f"id: {agent}\nmodel: offline:echo\n")
    assert cli("agents", "put", str(good))[0] == 0
    argv = tuple(agent if a == "@AGENT" else str(bad) if a == "@BAD" else a for a in argv)
    exit_code, out, err = cli(*argv)
    assert (exit_code, out) == (code, "")
    assert len(err.strip().splitlines()) == 1 and says in err


def test_usage_errors_exit_2(cli: Any) -> None:
    with pytest.raises(SystemExit) as stop:
        main(["agents", "rollback", "only-an-agent"])
    assert stop.value.code == 2


def test_agents_keys_are_the_ones_keys_py_names(client: Client) -> None:
    """Every key a put, a draft, a publish and a rollback write is one `Keys` builds."""
    agent = new_agent_id()
    client.put_agent(document(agent, "One"))
    client.put_agent(document(agent, "Two"), draft_id="d")
    client.publish_agent(agent)
    client.rollback_agent(agent, 1)
    k = client.keys
    expected = {k.agent(agent), k.agent_version(agent, 1), k.agent_version(agent, 2), k.agent_versions(agent),
                k.agent_activations(agent), k.agent_drafts(agent), k.agent_draft(agent, "d")}
    found = {key.decode() for key in client.redis.scan_iter(f"{k.agent(agent)}*")}
    assert found == expected
    assert sync_client(client.url).sismember(k.agents(), agent)
