"""Workers survive a restart of their Redis-protocol server: consumers reconnect, the doorbell
listener resubscribes, and turns after the restart complete (their hand-offs rung again, not polled)."""

from __future__ import annotations

import dataclasses
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import redis
from dramatiq.message import Message

from tests.conftest import WorkerPool, turn
from tests.support.clocks import hops_s
from tests.support.restartable import Restartable
from tests.support.wait import wait_until
from threadline.pipeline import events as ev
from threadline.pipeline.config import AgentConfig
from threadline.pipeline.stages import DEFAULT_GRAPH
from threadline.workers.clients.client import Client
from threadline.workers.settings import Settings
from threadline.workers.worker.process import create_broker
from threadline.workers.worker.reachability import RETRY_MIN_S

pytestmark = [pytest.mark.integration, pytest.mark.slow]

#: The workers' idle poll in the restart test: long, so that only the doorbell makes a hand-off quick.
IDLE_POLL_S = 20.0


def wait_terminal(client: Client, turn_id: str, timeout_s: float = 30) -> ev.Terminal:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            return client.wait(turn_id, timeout_s=max(0.1, deadline - time.monotonic()))
        except TimeoutError:
            break
        except OSError:  # the server is still coming back
            time.sleep(0.1)
        except Exception as e:  # redis.ConnectionError and friends
            if "connect" not in str(e).lower() and "closed" not in str(e).lower():
                raise
            time.sleep(0.1)
    raise TimeoutError(turn_id)


def test_turns_complete_after_the_server_restarts(restartable: Restartable, tmp_path: Path) -> None:
    # idle consumers poll only every IDLE_POLL_S here: a hand-off much quicker than that was rung
    pool = WorkerPool(restartable.url, f"tlr{uuid.uuid4().hex[:6]}", tmp_path,
                      env={"TL_IDLE_POLL_MS": str(int(IDLE_POLL_S * 1000))}).start(processes=1)
    try:
        client = Client(restartable.url, prefix=pool.prefix)
        client.put_agent(AgentConfig.model_validate({"id": "restart-bot", "model": "offline:echo"}))
        first = client.wait(client.submit(turn("restart-bot", "before")), timeout_s=30)
        assert isinstance(first, ev.Succeeded), first

        restartable.stop()
        time.sleep(1.0)
        restartable.start()
        client = Client(restartable.url, prefix=pool.prefix)
        second_id = client.submit(turn("restart-bot", "after", conversation_id=first.conversation_id))
        second = wait_terminal(client, second_id)
        assert isinstance(second, ev.Succeeded), second
        assert '"before"' in second.answer and '"after"' in second.answer

        # once resubscribed, a hand-off is rung again: every hop of a turn (on the server's clock, from
        # one stage's end to the next one's start) is a small part of a poll interval
        # (the sharded layout's doorbells are shard channels, one per shard, counted by SHARDNUMSUB)
        doorbells = [k.doorbell_channel() for k in client.keys.every_shard()]
        numsub = client.redis.pubsub_shardnumsub if client.keys.shards else client.redis.pubsub_numsub
        wait_until(lambda: all(n >= 1 for _, n in numsub(*doorbells)), timeout_s=30)
        third = client.wait(client.submit(turn("restart-bot", "quick")), timeout_s=IDLE_POLL_S * 3)
        assert isinstance(third, ev.Succeeded), third
        hops = hops_s(client, third.turn_id)
        assert len(hops) >= 3 and max(s for _, s in hops) < IDLE_POLL_S / 10, hops
        assert pool.alive()
    finally:
        pool.stop()


def test_a_retry_enqueued_while_the_server_is_down_waits_for_it(restartable: Restartable) -> None:
    """dramatiq's Retries enqueues the retry of a failed message, then the message is acked: an
    enqueue given up during an outage would lose the message (a turn's admit message was lost so
    in the chaos test once). The broker waits the outage out instead."""
    settings = dataclasses.replace(Settings.from_env({}), prefix=f"tlq{uuid.uuid4().hex[:6]}",
                                   redis_url=restartable.url)
    broker = create_broker(settings, restartable.url)
    queue = DEFAULT_GRAPH.first.queue
    actor = next(name for name, a in broker.actors.items() if a.queue_name == queue)
    message = Message(queue_name=queue, actor_name=actor, args=({"turn_id": "t"},), kwargs={}, options={})
    done: list[Message[Any]] = []
    try:
        restartable.stop()
        enqueuing = threading.Thread(target=lambda: done.append(broker.enqueue(message, delay=10)))
        enqueuing.start()
        # it failed, waited its backoff and failed again: waiting, not given up
        wait_until(lambda: broker.reachability.retry_in("enqueue") >= 2 * RETRY_MIN_S, timeout_s=30)
        assert enqueuing.is_alive() and not done
        restartable.start()
        enqueuing.join(timeout=30)
        assert not enqueuing.is_alive() and len(done) == 1
        r = redis.Redis.from_url(restartable.url)
        dq = f"{broker.namespace}:{queue}.DQ"
        assert r.hexists(f"{dq}.msgs", done[0].options["redis_message_id"])
        r.close()
    finally:
        broker.before_shutdown()
        broker.close()
