"""The sharded layout (`TL_SHARDS`) end to end on one server, with real worker processes: turns of
many conversations run through every shard and keep all their keys in their conversation's shard,
nothing is written in one server's layout, a worker killed mid-turn is taken over with its turn
ending once, and a worker started with another shard count refuses to start."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
from redis.crc import key_slot

from tests.conftest import ROOT, WorkerPool, turn
from tests.support.turns import assert_gapless, holder_pid, python_model, wait_for_event
from threadline.pipeline import events as ev
from threadline.pipeline.config import AgentConfig
from threadline.workers.clients.client import Client
from threadline.workers.protocol.keys import Keys
from threadline.workers.storage.connect import sync_client

pytestmark = pytest.mark.integration

SHARDS = 4


def test_turns_of_many_conversations_keep_their_keys_in_their_shard(isolated: Callable[..., WorkerPool]) -> None:
    pool = isolated({"TL_SHARDS": str(SHARDS)}).start(processes=2, threads=4)
    client = Client(pool.url, prefix=pool.prefix)
    client.put_agent(AgentConfig.model_validate({"id": "echo", "model": "offline:echo"}))
    layout = Keys(pool.prefix, SHARDS)
    ids = [f"t-{uuid.uuid4().hex[:12]}" for _ in range(200)]
    # three first turns per shard (their conversations are `c-<turn id>`)
    chosen = [t for shard in range(SHARDS) for t in [t for t in ids if layout.shard_of(f"c-{t}") == shard][:3]]
    firsts = [client.submit(turn("echo", f"hello {t}", turn_id=t)) for t in chosen]
    for turn_id in firsts:
        assert isinstance(client.wait(turn_id, timeout_s=60), ev.Succeeded)
    conversations = [client.turn_state(t).conversation_id for t in firsts]
    seconds = [client.submit(turn("echo", "and again", conversation_id=c)) for c in conversations]
    for turn_id in seconds:
        assert isinstance(client.wait(turn_id, timeout_s=60), ev.Succeeded)
    assert [len(client.thread(c)) for c in conversations] == [2] * len(conversations)  # a row per turn

    r = sync_client(pool.url)
    assert Counter(layout.shard_of(c) for c in conversations) == dict.fromkeys(range(SHARDS), 3)
    for turn_id, cid in [*zip(firsts, conversations, strict=True), *zip(seconds, conversations, strict=True)]:
        k = layout.of_conversation(cid)
        assert r.hget(k.turn(turn_id), "status") == b"succeeded"
        assert r.exists(k.events(turn_id))
        assert r.get(layout.turn_shard(turn_id)) == str(k.shard).encode()
        assert key_slot(k.turn(turn_id).encode()) == key_slot(k.conversation(cid).encode())
    # nothing in one server's layout: no untagged turn, conversation or queue key
    flat = Keys(pool.prefix)
    for pattern in (flat.turn("*"), flat.conversation("*"), flat.queue("*"), flat.running()):
        assert list(r.scan_iter(pattern, count=1000)) == [], pattern
    r.close()
    client.close()


@pytest.mark.slow
def test_a_worker_killed_mid_turn_is_taken_over_and_the_turn_ends_once(
    isolated: Callable[..., WorkerPool], tmp_path: Path
) -> None:
    pool = isolated({"TL_SHARDS": str(SHARDS), "TL_STALL_S": "2", "TL_WATCHDOG_S": "0.5", "TL_INVOKE_LEASE_S": "1.5",
                     "TL_HEARTBEAT_S": "0.3", "TL_WORKER_TIMEOUT_S": "1.5"}).start(processes=2)
    client = Client(pool.url, prefix=pool.prefix)
    client.put_agent(AgentConfig.model_validate(
        {"id": "survivor", "model": python_model("streaming", words=60, delay_ms=20)}))
    turn_id = client.submit(turn("survivor", "keep going"))
    wait_for_event(client, turn_id, "text_delta")
    victim = next(p for p in pool.procs if p.pid == holder_pid(client, turn_id))
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    terminal = client.wait(turn_id, timeout_s=90)
    assert isinstance(terminal, ev.Succeeded), terminal
    seen = assert_gapless(client, turn_id)
    assert len([e for e in seen if isinstance(e, ev.Terminal)]) == 1
    client.close()


def test_a_worker_with_another_shard_count_refuses_to_start(isolated: Callable[..., WorkerPool]) -> None:
    pool = isolated({"TL_SHARDS": str(SHARDS)}).start(processes=1, threads=2)
    env = {**pool.env, "TL_SHARDS": "8"}
    started = time.monotonic()
    other = subprocess.run([sys.executable, "-m", "threadline.workers.worker", "--threads", "1"], env=env, cwd=ROOT,
                           capture_output=True, text=True, timeout=60)
    assert other.returncode != 0
    assert "TL_SHARDS is 8" in other.stderr and "laid out in 4 shards" in other.stderr, other.stderr[-2000:]
    assert time.monotonic() - started < 60
    assert pool.alive()
