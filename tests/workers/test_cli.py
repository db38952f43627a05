"""The command line never traces back: every failure is one line on stderr and a documented exit code;
producer commands never start a server; unknown ids are "not found"; Ctrl-C and `--timeout` during
`--follow` leave the turn running and say how to cancel it; importing the CLI loads no pydantic-ai.

Most cases run `cli.main` in this process on a key prefix no worker serves (a submitted turn just
waits in the queue); Ctrl-C, a closed pipe and the import check need a real subprocess."""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT, AgentFactory, WorkerPool, drop_prefix
from tests.support.cli import cli_env, cli_runner
from threadline.pipeline import events as ev
from threadline.pipeline.stages import DEFAULT_GRAPH
from threadline.workers.cli import common, serve
from threadline.workers.cli import main as cli
from threadline.workers.clients.client import Client
from threadline.workers.protocol.names import CONTROL_QUEUE
from threadline.workers.settings import Settings
from threadline.workers.storage.connect import sync_client
from threadline.workers.storage.embedded import ensure_embedded

SETTINGS_SOURCE = ROOT / "workers" / "settings.py"


@pytest.fixture
def quiet(redis_url: str) -> Iterator[str]:
    """A key prefix no worker serves: turns submitted under it wait in the queue. Its agent `a` is
    registered (`submit` refuses an unknown agent before enqueueing)."""
    name = f"tlq{uuid.uuid4().hex[:8]}"
    with Client(redis_url, prefix=name) as registrar:
        registrar.put_agent("id: a\nmodel: offline:echo\n")
    yield name
    r = sync_client(redis_url)
    drop_prefix(r, name)
    r.close()


@pytest.fixture
def env(redis_url: str, quiet: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    return cli_env(monkeypatch, redis_url=redis_url, prefix=quiet, data_dir=tmp_path / "data")


@pytest.fixture
def run(env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> Any:
    """`run("cancel", "x")` -> Result, through `cli.main` in this process."""
    return cli_runner(capsys)


def subprocess_env(redis_url: str, prefix: str, **extra: str) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("TL_")}
    return {**base, "REDIS_URL": redis_url, "TL_PREFIX": prefix, "TL_LOG_FORMAT": "json",
            "TL_LOG_LEVEL": "WARNING", **extra}


CLI = [sys.executable, "-m", "threadline.workers.cli"]


# --- bad input: exit 2 ------------------------------------------------------------------------------


def test_a_missing_file_bad_json_and_an_invalid_turn_are_one_line_and_exit_2(run: Any, tmp_path: Path) -> None:
    missing = run("submit", str(tmp_path / "nope.json"))
    assert missing.code == 2 and "cannot read" in missing.one_line() and "No such file" in missing.one_line()
    (tmp_path / "bad.json").write_text("{not json")
    bad = run("submit", str(tmp_path / "bad.json"))
    assert bad.code == 2 and "not valid JSON" in bad.one_line()
    (tmp_path / "list.json").write_text("[1, 2]")
    assert run("submit", str(tmp_path / "list.json")).code == 2
    (tmp_path / "invalid.json").write_text(json.dumps({"agent_id": "a", "query": "hi", "turn_id": "no spaces"}))
    invalid = run("submit", str(tmp_path / "invalid.json"))
    assert invalid.code == 2 and "invalid turn request" in invalid.one_line() and "turn_id" in invalid.one_line()
    empty = run("submit", "--agent", "a")
    assert empty.code == 2 and "query is empty" in empty.one_line()
    assert run("agents", "put", str(tmp_path / "nope.yaml")).code == 2
    usage = run("events")
    assert usage.code == 2 and "threadline events" in usage.one_line()


def test_worker_refuses_an_unknown_queue_and_zero_processes_before_starting_anything(
        run: Any, env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    env.delenv("REDIS_URL")  # so a worker that went ahead would start the embedded server under TL_DATA_DIR
    typo = run("worker", "--queues", "invokes")
    assert typo.code == 2
    line = typo.one_line()
    assert "invokes" in line and all(q in line for q in (*DEFAULT_GRAPH.names, CONTROL_QUEUE))
    for flag in ("--processes", "--threads"):
        zero = run("worker", flag, "0")
        assert zero.code == 2 and "at least 1" in zero.one_line()
    assert not (tmp_path / "data").exists()


def test_an_invalid_setting_is_one_line_naming_the_variable(run: Any, env: pytest.MonkeyPatch) -> None:
    env.setenv("TL_PROCESSES", "abc")
    bad = run("cancel", "some-turn")
    assert bad.code == 2 and "TL_PROCESSES" in bad.one_line() and "'abc'" in bad.one_line()
    for name, value in (("TL_THREADS", "0"), ("TL_WATCHDOG_S", "-1"), ("TL_STALL_S", "nan"), ("TL_LOG_LEVEL", "LOUD"),
                        ("TL_EVENT_LOOP", "trio")):
        with pytest.raises(ValueError, match=name):
            Settings.from_env({name: value})
    assert Settings.from_env({"TL_PROCESSES": "3", "TL_INVOKE_PREFETCH": "0"}).processes == 3


# --- not found: exit 3 ------------------------------------------------------------------------------


def test_unknown_turns_and_conversations_exit_3_and_cancel_enqueues_nothing(run: Any, quiet: str,
                                                                           redis_url: str) -> None:
    for argv in (["events", "nope"], ["events", "nope", "--follow"], ["cancel", "nope"], ["turn", "show", "nope"],
                 ["thread", "c-nope"]):
        result = run(*argv)
        assert result.code == 3, (argv, result)
        assert "not found" in result.one_line()
    assert run("cancel", "not a turn id").code == 2
    r = sync_client(redis_url)
    # no cancel message, no cancel flag: nothing but the agent the fixture registered
    assert [k for k in r.scan_iter(f"{quiet}:*") if not k.startswith(f"{quiet}:agent".encode())] == []
    r.close()


def test_a_waiting_turn_exists_for_events_and_cancel(run: Any, quiet: str, redis_url: str) -> None:
    submitted = run("submit", "--agent", "a", "--query", "hi", "--json")
    assert submitted.code == 0, submitted
    turn_id = json.loads(submitted.out)["turn_id"]
    events = run("events", turn_id)
    assert events.code == 0 and events.out == ""
    cancelled = run("cancel", turn_id, "--reason", "changed my mind")
    assert cancelled.code == 0 and cancelled.out.strip() == f"cancel {turn_id}: enqueued"
    # a turn submitted by a raw producer without a turn id is named by its message id
    raw = Client(redis_url, prefix=quiet)
    message_id = raw.submit_raw({"schema": "threadline.turn/v1", "agent_id": "a", "query": "q"})
    assert raw.turn_exists(message_id) and not raw.turn_exists(f"{message_id}x")
    raw.close()


# --- the server: exit 4, and producers never start one ---------------------------------------------


def test_an_unreachable_server_is_exit_4(run: Any, env: pytest.MonkeyPatch) -> None:
    env.setenv("REDIS_URL", "redis://:hunter22@127.0.0.1:1/0")
    for argv in (["cancel", "some-turn"], ["submit", "--agent", "a", "--query", "hi"], ["thread", "c-x"]):
        result = run(*argv)
        assert result.code == 4 and "cannot reach the server" in result.one_line(), result
        assert "hunter22" not in result.err


def _processes_mentioning(text: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and text.encode() in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def test_producer_commands_never_start_a_server_and_join_a_running_one(run: Any, env: pytest.MonkeyPatch,
                                                                         tmp_path: Path) -> None:
    env.delenv("REDIS_URL")
    data = tmp_path / "data"
    for argv in (["submit", "--agent", "a", "--query", "hi"], ["cancel", "some-turn"], ["events", "some-turn"],
                 ["thread", "c-x"]):
        result = run(*argv)
        assert result.code == 4, result
        assert "threadline worker" in result.one_line() and str(data) in result.one_line()
    assert not data.exists() and _processes_mentioning(str(data)) == []

    server = ensure_embedded(data)  # what a running `threadline worker` started for this data dir
    try:
        with Client(server.url, prefix=os.environ["TL_PREFIX"]) as registrar:
            registrar.put_agent("id: a\nmodel: offline:echo\n")
        submitted = run("submit", "--agent", "a", "--query", "hi")
        assert submitted.code == 0, submitted
        turn_id = submitted.out.strip()
        assert run("cancel", turn_id).code == 0
        joined = Client(server.url, prefix=os.environ["TL_PREFIX"])
        assert joined.turn_exists(turn_id)
        joined.close()
    finally:
        server.stop()


# --- following: --timeout, Ctrl-C, a closed pipe ----------------------------------------------------


def test_timeout_while_following_is_one_line_and_exit_124(run: Any) -> None:
    turn_id = run("submit", "--agent", "a", "--query", "hi").out.strip()
    result = run("events", turn_id, "--follow", "--timeout", "0.3")
    assert result.code == common.EXIT_TIMEOUT == 124
    line = result.one_line()
    assert "did not finish within 0.3 s" in line and f"threadline cancel {turn_id}" in line
    assert run("events", turn_id, "--follow", "--timeout", "0").code == 2


def test_ctrl_c_while_following_leaves_the_turn_running_and_says_how_to_cancel_it(redis_url: str,
                                                                                   quiet: str) -> None:
    # PYTHONFAULTHANDLER: a process still running 15 s after its Ctrl-C (once in a fresh-check, on a
    # loaded machine; not in 8 runs here beside six busy loops) is sent SIGABRT, and writes where it was to stderr
    proc = subprocess.Popen([*CLI, "submit", "--agent", "a", "--query", "hi", "--follow"],
                            env=subprocess_env(redis_url, quiet, PYTHONFAULTHANDLER="1"), cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        first = proc.stderr.readline()  # printed once the turn is enqueued, just before following
        turn_id = first.strip().removeprefix("turn ")
        proc.send_signal(signal.SIGINT)
        try:
            _, err = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGABRT)
            _, err = proc.communicate(timeout=15)
            pytest.fail(f"still running 15 s after its SIGINT (its first line: {first!r}); its stacks:\n{err}")
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert "Traceback" not in err and err.strip().count("\n") == 0, err
    assert "keeps running" in err and f"threadline cancel {turn_id}" in err
    assert Client(redis_url, prefix=quiet).turn_exists(turn_id)


def test_output_piped_to_a_reader_that_stops_exits_quietly(redis_url: str, quiet: str) -> None:
    r = sync_client(redis_url)
    turn_id = f"pipe-{uuid.uuid4().hex[:8]}"
    pipe = r.pipeline(transaction=False)
    for seq in range(1, 3001):  # ~300 KB of JSON lines: more than a pipe holds
        pipe.xadd(f"{quiet}:turn:{turn_id}:events",
                  {"json": ev.TextDelta(turn_id=turn_id, seq=seq, text="word " * 10).model_dump_json()})
    pipe.execute()
    r.close()
    proc = subprocess.Popen([*CLI, "events", turn_id, "--json"], env=subprocess_env(redis_url, quiet), cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    assert json.loads(proc.stdout.readline())["type"] == "text_delta"
    proc.stdout.close()  # what `| head -1` does
    err = proc.stderr.read()
    proc.wait(timeout=15)
    assert proc.returncode == common.EXIT_BROKEN_PIPE == 141 and err == b""


# --- a real turn through the CLI -----------------------------------------------------------------------


def test_submit_follow_then_events_cancel_and_thread_of_a_finished_turn(
        run: Any, env: pytest.MonkeyPatch, workers: WorkerPool, make_agent: AgentFactory) -> None:
    env.setenv("TL_PREFIX", workers.prefix)
    agent = make_agent("offline:echo")
    followed = run("submit", "--agent", agent, "--query", "Where is my order?", "--follow", "--timeout", "30")
    assert followed.code == 0, followed
    assert "Where is my order?" in followed.out and "[succeeded]" in followed.out
    turn_id = followed.err.strip().removeprefix("turn ")
    assert json.loads(run("events", turn_id, "--json").out.strip().splitlines()[-1])["type"] == "succeeded"
    noop = run("cancel", turn_id)
    assert noop.code == 0 and noop.out.strip() == f"cancel {turn_id}: noop: succeeded"
    thread = run("thread", f"c-{turn_id}")
    assert thread.code == 0 and "Where is my order?" in thread.out


# --- help, version, masking, imports -------------------------------------------------------------------


def test_version_and_help(run: Any) -> None:
    shown = run("--version")
    assert shown.code == 0 and shown.out.strip() == f"threadline {version('threadline')}"
    helped = run("--help")
    assert helped.code == 0
    # every variable settings.py reads (and TL_AUTHOR, read by workers/storage/agents.py)
    names = set(re.findall(r'"((?:TL|REDIS)_[A-Z_]+)"', SETTINGS_SOURCE.read_text())) | {"TL_AUTHOR"}
    assert len(names) > 20 and [name for name in names if name not in helped.out] == []
    for code in (2, 3, 4, 124, 130, 141):
        assert re.search(rf"^\s+{code}\s", helped.out, re.M), code


def _options(parser: argparse.ArgumentParser, path: str = "threadline") -> Iterator[tuple[str, argparse.Action]]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from _options(child, f"{path} {name}")
        elif not isinstance(action, argparse._HelpAction):
            yield path, action


def test_every_option_has_help_text() -> None:
    missing = [f"{path} {action.dest}" for path, action in _options(cli.parser())
               if not action.help]
    assert missing == []


def test_urls_are_printed_with_the_password_masked() -> None:
    assert common.display_url("redis://:hunter22@cache:6379/0") == "redis://***@cache:6379/0"
    assert common.display_url("rediss://app:hunter22@cache:6380/1") == "rediss://***@cache:6380/1"
    assert common.display_url("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"
    line = serve.worker_start_line(2, "redis://:hunter22@cache:6379/0")
    assert "hunter22" not in line and line == "threadline: 2 worker processes on redis://***@cache:6379/0"


@pytest.mark.parametrize("module", ["threadline.workers.clients.client", "threadline.workers.cli"])
def test_importing_the_client_and_the_cli_loads_no_pydantic_ai(module: str) -> None:
    code = f"import sys, {module}; print(sorted(m for m in sys.modules if m.split('.')[0] == 'pydantic_ai')[:3])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True).stdout
    assert out.strip() == "[]"
