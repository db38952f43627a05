"""Model calls run on a worker's event loop, not one thread each (`workers/worker/calls.py`): one
process holds hundreds of streaming calls at once with a handful of threads, and cancels reach them."""

from __future__ import annotations

import asyncio
import importlib.util
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
import uvloop
from dramatiq.asyncio import get_event_loop_thread

from tests.conftest import InProcessWorker, WorkerPool, turn
from tests.support.turns import assert_one_terminal, records
from tests.support.wait import wait_until
from threadline.pipeline import events as ev
from threadline.pipeline.config import AgentConfig
from threadline.workers.clients.client import Client
from threadline.workers.settings import Settings
from threadline.workers.worker.calls import MAX_DEFAULT, MIB_PER_CALL, MIN_DEFAULT, default_model_calls

CALLS = 200
CANCELS = 20


def _threads(pid: int) -> int:
    with open(f"/proc/{pid}/status") as handle:
        return next(int(line.split()[1]) for line in handle if line.startswith("Threads:"))


@pytest.mark.slow  # 200 turns through every stage on a shared machine
def test_one_process_holds_200_streaming_calls_and_cancels_20_of_them(
    isolated: Callable[..., WorkerPool], tmp_path: Path
) -> None:
    """200 turns whose model streams until the test lets it end, in one worker process of 4 threads:
    all 200 calls are open at once (each has streamed its first word), the process has far fewer
    threads than calls, 20 cancels end their turns `cancelled` while the others still stream, and
    then the 180 others succeed — each turn with one terminal event and one model call."""
    pool = isolated().start(processes=1, threads=4)
    client = Client(pool.url, prefix=pool.prefix)
    release, record = tmp_path / "release", tmp_path / "calls.jsonl"
    agent = f"agent-{uuid.uuid4().hex[:8]}"
    client.put_agent(AgentConfig.model_validate({"id": agent, "model": {
        "provider": "python", "name": "tests.support.gated_models:held",
        "options": {"record": str(record), "until": str(release)}}}))
    ids = [client.submit(turn(agent, f"question {i}")) for i in range(CALLS)]

    def started() -> int:
        return sum(r["event"] == "start" for r in records(record))

    wait_until(lambda: started() == CALLS, timeout_s=240)
    assert not any(r["event"] != "start" for r in records(record)), "a call ended before the test let it"
    (pid,) = (p.pid for p in pool.procs)
    assert _threads(pid) < CALLS // 4, f"{_threads(pid)} threads for {CALLS} open calls"

    cancelled = ids[::CALLS // CANCELS]
    t0 = time.monotonic()
    for turn_id in cancelled:
        client.cancel(turn_id, "stop")
    for turn_id in cancelled:
        terminal = client.wait(turn_id, timeout_s=60)
        assert isinstance(terminal, ev.Cancelled), terminal
    cancel_s = time.monotonic() - t0
    closed = sum(r["event"] == "closed" for r in records(record))
    assert closed == CANCELS, f"{closed} streams closed by {CANCELS} cancels"
    assert all(client.turn_state(t).status == "running" for t in ids if t not in cancelled)

    release.touch()
    for turn_id in ids:
        terminal = client.wait(turn_id, timeout_s=120)
        assert isinstance(terminal, ev.Cancelled if turn_id in cancelled else ev.Succeeded), terminal
        assert_one_terminal(client, turn_id)
    assert started() == CALLS, "a model was called twice"
    print(f"{CANCELS} cancels of open calls ended their turns within {cancel_s:.2f} s")
    client.close()


def test_the_default_number_of_calls_follows_the_memory_available() -> None:
    assert default_model_calls(available_mib=24 * 1024) == MAX_DEFAULT
    assert default_model_calls(available_mib=100) == int(100 / 4 / MIB_PER_CALL) < MAX_DEFAULT
    assert default_model_calls(available_mib=1) == MIN_DEFAULT


def test_the_setting_and_its_older_name() -> None:
    assert Settings.from_env({"TL_MODEL_CALLS": "64"}).model_calls == 64
    assert Settings.from_env({"TL_INVOKE_PREFETCH": "12"}).model_calls == 12
    assert Settings.from_env({"TL_MODEL_CALLS": "64", "TL_INVOKE_PREFETCH": "12"}).model_calls == 64
    assert Settings.from_env({}).model_calls is None  # the worker sizes it (`default_model_calls`)


@pytest.mark.integration
@pytest.mark.parametrize(("setting", "kind"), [("auto", uvloop.Loop), ("asyncio", asyncio.BaseEventLoop)])
def test_the_stages_and_the_model_calls_run_on_the_loop_the_setting_names(
        inprocess: Callable[..., InProcessWorker], setting: str, kind: type) -> None:
    worker = inprocess(env={"TL_EVENT_LOOP": setting})
    client = worker.client
    client.put_agent(AgentConfig.model_validate({"id": "echo", "model": "offline:echo"}))
    terminal = client.wait(client.submit(turn("echo", "which loop?")), timeout_s=30)
    assert isinstance(terminal, ev.Succeeded), terminal
    stages, calls = get_event_loop_thread().loop, worker.broker.calls.loop  # type: ignore[union-attr]
    assert isinstance(stages, kind) and isinstance(calls, kind), (stages, calls)
    assert stages is not calls and stages.is_running() and calls.is_running()


def test_uvloop_where_it_is_not_installed_is_refused_and_auto_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "uvloop" else find_spec(name, *a))
    with pytest.raises(ValueError, match="TL_EVENT_LOOP is uvloop, but uvloop is not installed"):
        Settings.from_env({"TL_EVENT_LOOP": "uvloop"})
    assert Settings.from_env({}).loop() == "asyncio"
    monkeypatch.undo()
    assert Settings.from_env({}).loop() == "uvloop"
