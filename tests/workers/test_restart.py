"""Workers survive a restart of their Redis-protocol server: consumers reconnect, the doorbell
listener resubscribes, and turns after the restart complete (and still quickly)."""

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
from tests.support.restartable import Restartable
from threadline.pipeline import events as ev
from threadline.pipeline.config import AgentConfig
from threadline.pipeline.stages import DEFAULT_GRAPH
from threadline.workers.clients.client import Client
from threadline.workers.settings import Settings
from threadline.workers.worker.process import create_broker

pytestmark = [pytest.mark.integration, pytest.mark.slow]


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
    pool = WorkerPool(restartable.url, f"tlr{uuid.uuid4().hex[:6]}", tmp_path).start(processes=1)
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

        # once resubscribed, a hand-off is rung again: a turn takes milliseconds, not poll intervals
        time.sleep(3.0)
        started = time.monotonic()
        third = client.wait(client.submit(turn("restart-bot", "quick")), timeout_s=30)
        assert isinstance(third, ev.Succeeded), third
        assert time.monotonic() - started < 1.0
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
        time.sleep(1.5)
        assert enqueuing.is_alive() and not done  # waiting, not failed
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
