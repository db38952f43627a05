"""The user in control of long-term memory through the Python client and `threadline memory`: list,
show (provenance), set and correct (the old version closed, kept in the history), forget (every
version); partitions (tenant, user, app, agent) never cross; failures are one line and exit 3 or 2.

`cli.main` runs in this process on a key prefix of its own, against the real server (embedded Valkey);
extracted records are seeded through the memory store, as the memory stage writes them."""

from __future__ import annotations

import asyncio
import json
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import drop_prefix
from tests.support.cli import cli_env, cli_runner
from threadline.pipeline.consolidation import consolidate
from threadline.pipeline.errors import InvalidRequest
from threadline.pipeline.extraction import Proposal
from threadline.pipeline.memory import MemoryRecord, Provenance, Scope
from threadline.workers.clients.async_client import AsyncClient
from threadline.workers.clients.client import Client
from threadline.workers.clients.common import MemoryNotFound
from threadline.workers.storage.connect import sync_client


@pytest.fixture
def own(redis_url: str) -> Iterator[str]:
    name = f"tlmc{uuid.uuid4().hex[:8]}"
    yield name
    r = sync_client(redis_url)
    drop_prefix(r, name)
    r.close()


@pytest.fixture
def client(redis_url: str, own: str) -> Iterator[Client]:
    c = Client(redis_url, prefix=own)
    yield c
    c.close()


@pytest.fixture
def run(redis_url: str, own: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> Any:
    cli_env(monkeypatch, redis_url=redis_url, prefix=own, data_dir=tmp_path / "data")
    return cli_runner(capsys, verb=("memory",))


def extracted(client: Client, scope: Scope, key: str, value: str, *, at: float = 1000.0) -> MemoryRecord:
    """A fact as the memory stage writes it: extracted from turn `t-1` of conversation `c-1`."""
    records, revision = client.memory_store.read(scope)
    edit = consolidate(records, [Proposal("add", "fact", key=key, value=value)], scope=scope, now=at,
                       new_id=lambda: uuid.uuid4().hex, turn_ended_at=at,
                       source=Provenance("extracted", "c-1", "m-1", "t-1", "offline:facts", "1"))
    assert client.memory_store.apply(scope, edit, revision=revision, now=at)
    return edit.current[-1]


U1 = ("--tenant", "t1", "--user", "u1")


# --- the client ---------------------------------------------------------------------------------------


def test_set_correct_and_forget_through_the_client_keep_history_until_forgotten(client: Client) -> None:
    first = client.set_memory("t1", "u1", key="Name", value="Ada")
    assert (first.key, first.value, first.source.origin) == ("name", "Ada", "user")
    fixed = client.set_memory("t1", "u1", record_id=first.id, value="Grace", origin="operator")
    assert fixed.id != first.id and fixed.source.origin == "operator"
    assert [(r.key, r.value) for r in client.memory("t1", "u1")] == [("name", "Grace")]
    history = client.memory("t1", "u1", history=True)
    closed = next(r for r in history if r.id == first.id)
    assert not closed.current and closed.superseded_by == fixed.id and closed.invalid_at is not None
    # the same value again changes nothing and answers the current record
    assert client.set_memory("t1", "u1", key="name", value="grace.").id == fixed.id
    note = client.set_memory("t1", "u1", note=True, value="Prefers short answers")
    assert note.kind == "note" and note.key is None
    assert client.forget_memory("t1", "u1", key="name") == 2
    assert [r.id for r in client.memory("t1", "u1", history=True)] == [note.id]
    assert client.forget_memory("t1", "u1", record_id=first.id) == 0


def test_a_record_of_another_partition_user_or_tenant_is_not_found(client: Client) -> None:
    mine = client.set_memory("t1", "u1", key="name", value="Ada")
    app = client.set_memory("t1", "u1", key="name", value="Ada at work", app_id="work")
    assert [r.id for r in client.memory("t1", "u1", app_id="work")] == [app.id]
    assert [r.id for r in client.memory("t1", "u1")] == [mine.id]
    for tenant, user, options in (("t2", "u1", {}), ("t1", "u2", {}), ("t1", "u1", {"app_id": "work"}),
                                  ("t1", "u1", {"agent_id": "a1"})):
        assert mine.id not in [r.id for r in client.memory(tenant, user, history=True, **options)]
        with pytest.raises(MemoryNotFound):
            client.memory_record(tenant, user, mine.id, **options)
        with pytest.raises(MemoryNotFound):
            client.set_memory(tenant, user, record_id=mine.id, value="Eve", **options)
        assert client.forget_memory(tenant, user, record_id=mine.id, **options) == 0
    assert client.memory_record("t1", "u1", mine.id).value == "Ada"
    assert client.forget_memory("t1", "u1", all=True) > 0
    assert client.memory("t1", "u1") == [] and client.memory("t1", "u1", app_id="work") == []


def test_bad_edits_are_refused(client: Client) -> None:
    for options in ({}, {"key": "name", "record_id": "x"}, {"key": "name", "note": True}, {"key": "!!!"},
                    {"key": "name", "origin": "extracted"}):
        with pytest.raises(InvalidRequest):
            client.set_memory("t1", "u1", value="Ada", **options)
    with pytest.raises(InvalidRequest):
        client.set_memory("t1", "u1", key="name", value="  ")
    with pytest.raises(InvalidRequest):
        client.forget_memory("t1", "u1", all=True, app_id="work")
    with pytest.raises(InvalidRequest):
        client.forget_memory("t1", "u1")
    with pytest.raises(InvalidRequest):
        client.memory("t1", "no/slash")
    assert client.memory("t1", "u1") == []


def test_concurrent_edits_of_one_partition_all_land(client: Client) -> None:
    """Each edit re-reads and retries when another moved the partition's revision."""
    start = threading.Barrier(6)

    def edit(i: int) -> None:
        start.wait()
        client.set_memory("t1", "u1", key=f"fact_{i}", value=f"value {i}")

    threads = [threading.Thread(target=edit, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(r.key or "" for r in client.memory("t1", "u1")) == [f"fact_{i}" for i in range(6)]


def test_the_async_client_gives_what_the_sync_one_gives(client: Client, redis_url: str, own: str) -> None:
    async def scenario() -> tuple[list[MemoryRecord], MemoryRecord, int]:
        aclient = AsyncClient(redis_url, prefix=own)
        try:
            first = await aclient.set_memory("t1", "u1", key="city", value="Lyon")
            await aclient.set_memory("t1", "u1", record_id=first.id, value="Paris")
            listed = await aclient.memory("t1", "u1", history=True)
            shown = await aclient.memory_record("t1", "u1", first.id)
            with pytest.raises(MemoryNotFound):
                await aclient.memory_record("t2", "u1", first.id)
            return listed, shown, await aclient.forget_memory("t1", "u1", record_id=first.id)
        finally:
            await aclient.close()

    listed, shown, forgotten = asyncio.run(scenario())
    assert [(r.key, r.value, r.current) for r in listed] == [("location", "Paris", True), ("location", "Lyon", False)]
    assert [r.id for r in client.memory("t1", "u1", history=True)] == [] and forgotten == 2
    assert shown.superseded_by == listed[0].id


# --- the command line ------------------------------------------------------------------------------------


def test_list_set_correct_show_and_forget_on_the_command_line(run: Any, client: Client) -> None:
    assert run("list", *U1).out.strip() == "no memory"
    made = run("set", *U1, "--key", "name", "Ada", "--json")
    assert made.code == 0
    first = json.loads(made.out)
    assert first["key"] == "name" and first["source"]["origin"] == "user"
    fixed = run("set", *U1, "--id", first["id"], "Grace", "--operator")
    assert fixed.code == 0 and "name = Grace" in fixed.out and "(operator)" in fixed.out
    note = run("set", *U1, "--note", "Likes tea")
    assert note.code == 0 and "note: Likes tea" in note.out
    listed = run("list", *U1)
    assert "name = Grace" in listed.out and "Ada" not in listed.out and "note: Likes tea" in listed.out
    history = run("list", *U1, "--history", "--json")
    rows = {r["value"]: r for r in json.loads(history.out)}
    assert set(rows) == {"Grace", "Ada", "Likes tea"} and not rows["Ada"]["current"]
    shown = run("show", first["id"], *U1)
    assert shown.code == 0
    assert f"superseded_by: {rows['Grace']['id']}" in shown.out and "current: no" in shown.out
    assert "origin: user" in shown.out and "invalid_at: 20" in shown.out
    gone = run("forget", *U1, "--key", "name")
    assert gone.code == 0 and gone.out.strip() == "forgot 2 records"
    assert [r.value for r in client.memory("t1", "u1", history=True)] == ["Likes tea"]
    everything = run("forget", *U1, "--all")
    assert everything.code == 0 and client.memory("t1", "u1") == []


def test_show_prints_an_extracted_records_provenance(run: Any, client: Client) -> None:
    record = extracted(client, Scope("t1", "u1"), "diet", "vegetarian")
    shown = run("show", record.id, *U1)
    assert shown.code == 0
    for line in ("origin: extracted", "conversation: c-1", "message: m-1", "turn: t-1", "extractor: offline:facts 1",
                 "valid_at: 1970-01-01T00:16:40+00:00", "invalid_at: -", "superseded_by: -", "value: vegetarian"):
        assert line in shown.out.splitlines(), line
    # the user corrects what was extracted: theirs now, the extracted one closed
    run("set", *U1, "--id", record.id, "vegan")
    assert [(r.value, r.source.origin) for r in client.memory("t1", "u1")] == [("vegan", "user")]


def test_unknown_records_exit_3_and_bad_input_exits_2_on_one_line(run: Any, client: Client) -> None:
    mine = client.set_memory("t1", "u1", key="name", value="Ada", app_id="work")
    for argv in (("show", "nope", *U1), ("show", mine.id, *U1), ("show", mine.id, "--tenant", "t2", "--user", "u1",
                                                                 "--app", "work"),
                 ("set", *U1, "--id", mine.id, "Eve"), ("forget", *U1, "--id", mine.id),
                 ("forget", *U1, "--key", "name")):
        result = run(*argv)
        assert result.code == 3 and "not found" in result.one_line() and result.one_line().startswith("threadline: ")
    assert run("show", mine.id, *U1, "--app", "work").code == 0
    for argv in (("set", *U1, "--key", "name"), ("set", *U1, "Ada"), ("set", *U1, "--key", "name", "--id", "x", "A"),
                 ("set", *U1, "--note", "a", "b"), ("forget", *U1), ("forget", *U1, "--key", "k", "--all"),
                 ("forget", *U1, "--all", "--app", "work"), ("list", "--tenant", "t1", "--user", "u/1"),
                 ("list", *U1, "--app", "a", "--agent", "b"), ("set", *U1, "--key", "name", " ")):
        result = run(*argv)
        assert result.code == 2, (argv, result)
        assert result.one_line()
    assert client.memory("t1", "u1", app_id="work")[0].value == "Ada"
