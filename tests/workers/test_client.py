"""The clients' turn surface against the shared worker pool: `TurnHandle` (a str that follows, waits
for, cancels and resumes its turn), `Client.start`'s local check, events resumed from an entry id,
and `AsyncClient` doing the same on `redis.asyncio`, plus conversations: list, thread, delete."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import AgentFactory, WorkerPool, turn
from tests.support.wait import wait_until
from threadline.pipeline import events as ev
from threadline.pipeline.errors import InvalidRequest
from threadline.workers.clients.async_client import AsyncClient
from threadline.workers.clients.client import Client, TurnHandle, TurnIdTaken

pytestmark = pytest.mark.integration


def python_model(factory: str, **options: Any) -> dict[str, Any]:
    return {"provider": "python", "name": f"tests.support.models:{factory}", "options": options}


def test_submit_returns_a_handle_that_is_the_turn_id(workers: WorkerPool, client: Client,
                                                     make_agent: AgentFactory) -> None:
    agent = make_agent()
    handle = client.submit(turn(agent, "hello", turn_id="handle-1-" + uuid.uuid4().hex[:8]))
    assert isinstance(handle, TurnHandle) and isinstance(handle, str)
    assert handle == handle.turn_id and json.dumps({"t": handle}) == json.dumps({"t": str(handle)})
    result = handle.result(timeout=30)
    assert isinstance(result, ev.Succeeded) and "hello" in result.answer
    # events resume after any entry id, with nothing lost or repeated
    entries = list(handle.entries(follow=False))
    assert [e.seq for _, e in entries] == list(range(1, len(entries) + 1))
    middle = entries[2][0]
    assert [e.seq for e in handle.events(after=middle)] == [e.seq for _, e in entries[3:]]
    assert handle.state().status == "succeeded" and client.terminal(handle) == result
    assert handle.cancel() == "noop: succeeded"


def test_start_checks_the_request_before_enqueueing(workers: WorkerPool, client: Client,
                                                    make_agent: AgentFactory) -> None:
    agent = make_agent()
    turn_id = uuid.uuid4().hex
    with pytest.raises(InvalidRequest, match="query is empty"):
        client.start(turn(agent, "  ", turn_id=turn_id))
    with pytest.raises(InvalidRequest, match="qeury"):
        client.start({**turn(agent, "hi"), "qeury": "typo"})
    assert not client.turn_exists(turn_id)
    handle = client.start(turn(agent, "checked"))
    assert handle.request is not None and handle.request.query == "checked"
    assert isinstance(handle.result(timeout=30), ev.Succeeded)
    # with an owner the id is claimed once: the same tenant gets the same turn, another is refused
    owned = client.start(turn(agent, "mine"), owner="t1")
    assert owned.created and not client.start(turn(agent, "mine", turn_id=owned), owner="t1").created
    with pytest.raises(TurnIdTaken):
        client.start(turn(agent, "mine", turn_id=owned), owner="t2")
    assert client.owner(owned) == "t1"
    assert isinstance(owned.result(timeout=30), ev.Succeeded)
    assert [e.type for e in owned.events(follow=False)].count("accepted") == 1


def test_result_times_out_then_cancel_ends_the_turn(workers: WorkerPool, client: Client, make_agent: AgentFactory,
                                                    tmp_path: Path) -> None:
    agent = make_agent(python_model("streaming", words=1000, delay_ms=20, until=str(tmp_path / "never")))
    with Client(client.url, prefix=client.keys.prefix) as own:
        handle = own.start(turn(agent, "go on"))
        with pytest.raises(TimeoutError):
            handle.result(timeout=0.3)
        wait_until(lambda: any(e.type == "text_delta" for e in handle.events(follow=False)), timeout_s=20)
        assert handle.cancel("enough") == "enqueued"
        assert isinstance(handle.result(timeout=30), ev.Cancelled)


def test_resume_a_paused_turn(workers: WorkerPool, client: Client, make_agent: AgentFactory) -> None:
    agent = make_agent(python_model("ask_then_answer", question="Which colour?"), tools=["ask_human"])
    paused_turn = client.start(turn(agent, "paint my room"))
    paused = paused_turn.result(timeout=30)
    assert isinstance(paused, ev.Paused), paused
    (pending,) = paused.pending_tool_calls
    resumed = paused_turn.resume({pending["tool_call_id"]: "blue"})
    result = resumed.result(timeout=30)
    assert isinstance(result, ev.Succeeded) and result.answer == "You answered: blue", result
    assert result.conversation_id == paused.conversation_id
    with pytest.raises(InvalidRequest, match="not paused"):
        resumed.resume({"x": 1})


async def test_async_client_surface(workers: WorkerPool, client: Client, make_agent: AgentFactory,
                                    tmp_path: Path) -> None:
    echo = make_agent()
    asking = make_agent(python_model("ask_then_answer"), tools=["ask_human"])
    slow = make_agent(python_model("streaming", words=1000, delay_ms=20, until=str(tmp_path / "never")))
    tenant = f"ta{uuid.uuid4().hex[:8]}"
    async with AsyncClient(client.url, prefix=client.keys.prefix) as aclient:
        with pytest.raises(InvalidRequest):
            await aclient.start(turn(echo, ""))
        first = await aclient.start(turn(echo, "one", tenant_id=tenant))
        done = await first.result(timeout=30)
        assert isinstance(done, ev.Succeeded) and done.conversation_id
        entries = [pair async for pair in first.entries(follow=False)]
        after = [e.seq async for e in first.events(after=entries[1][0], follow=False)]
        assert after == [e.seq for _, e in entries[2:]]
        second = await aclient.start(turn(echo, "two", tenant_id=tenant, conversation_id=done.conversation_id))
        assert isinstance(await second.result(timeout=30), ev.Succeeded)
        assert [m.query for m in await aclient.thread(done.conversation_id)] == ["one", "two"]

        paused = await (await aclient.start(turn(asking, "ask", tenant_id=tenant))).result(timeout=30)
        assert isinstance(paused, ev.Paused) and paused.conversation_id
        handle = aclient.handle(paused.turn_id)  # no request: the scope comes from the conversation
        resumed = await handle.resume({paused.pending_tool_calls[0]["tool_call_id"]: "red"})
        assert isinstance(await resumed.result(timeout=30), ev.Succeeded)

        running = await aclient.start(turn(slow, "go", tenant_id=tenant))
        with pytest.raises(TimeoutError):
            await running.result(timeout=0.3)
        assert await running.cancel("stop") == "enqueued"
        assert isinstance(await running.result(timeout=30), ev.Cancelled)

        listed = [c.id for c in await aclient.conversations(tenant)]
        # the most recent activity first: a resumed turn counts for its conversation
        assert listed == [f"c-{running}", paused.conversation_id, done.conversation_id]
        assert (await aclient.delete_conversation(done.conversation_id, tenant_id="someone-else")).status == "not_found"
        deleted = await aclient.delete_conversation(done.conversation_id, tenant_id=tenant)
        assert deleted.status == "deleted" and deleted.turns == 2
        assert done.conversation_id not in [c.id for c in await aclient.conversations(tenant)]
    # the sync client lists the same index
    assert done.conversation_id not in [c.id for c in client.conversations(tenant)]
    assert paused.conversation_id in [c.id for c in client.conversations(tenant)]
