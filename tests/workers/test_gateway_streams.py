"""Event streams at scale through a real uvicorn gateway: many open streams share one Redis
connection (`workers/gateway/streams.py`), so `/healthz` and another tenant's requests keep
answering (the old connection-per-stream gateway answered 503 from the 101st); a key's cap of open
streams is 429 with `Retry-After`; and streams multiplexed over one reader deliver every event of
real turns in order, resumed or not."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
import redis

from tests.conftest import WorkerPool, drop_prefix
from tests.support.gateway import gateway_connection_ids, gateway_connections, running_gateway
from tests.support.turns import keys_of
from tests.support.wait import wait_until
from threadline.pipeline.config import AgentConfig
from threadline.workers.clients.client import Client
from threadline.workers.settings import Settings
from threadline.workers.storage.api_keys import KeyRing, Limits
from threadline.workers.storage.connect import sync_client

pytestmark = pytest.mark.integration

#: More than the 100 connections of redis-py's default asyncio pool (the old gateway's limit).
STREAMS = 150


@dataclasses.dataclass
class Front:
    base: str
    client: Client
    ring: KeyRing
    prefix: str
    #: What earlier tests' gateways in this process still hold when this one starts.
    others: frozenset[str]

    def key(self, tenant: str, **limits: int) -> str:
        return self.ring.create(tenant, limits=Limits(**limits))[0]

    def open_turn(self, tenant: str) -> str:
        """A turn of `tenant` that stays open: on this prefix no worker ever admits it."""
        request = {"tenant_id": tenant, "app_id": "app", "user_id": "u1", "agent_id": "nobody", "query": "wait"}
        return str(self.client.start(request, owner=tenant))


@pytest.fixture
def front(redis_url: str) -> Iterator[Front]:
    """A gateway on a prefix of its own, with no worker behind it."""
    prefix = f"tls{uuid.uuid4().hex[:8]}"
    # a request waiting for a pooled connection is not what these tests are about: on a loaded machine
    # the pool's 5 s wait would turn slowness into 503s
    settings = dataclasses.replace(Settings.from_env({}), prefix=prefix, redis_url=redis_url,
                                   gateway_pool_timeout_s=60.0)
    client = Client(redis_url, prefix=prefix)
    client.put_agent(AgentConfig.model_validate({"id": "nobody", "model": "offline:echo"}))  # refused early otherwise
    others = gateway_connection_ids(client.redis, os.getpid())
    try:
        with running_gateway(settings, redis_url) as base:
            yield Front(base, client, KeyRing(client.redis, client.keys), prefix, others)
    finally:
        drop_prefix(client.redis, prefix)
        client.close()


async def open_streams(http: httpx.AsyncClient, key: str, turns: list[str],
                       stack: contextlib.AsyncExitStack) -> list[httpx.Response]:
    """Open every turn's event stream at once; the responses, headers received, bodies unread."""
    headers = {"Authorization": f"Bearer {key}"}

    async def one(turn_id: str) -> httpx.Response:
        return await stack.enter_async_context(http.stream("GET", f"/v1/turns/{turn_id}/events", headers=headers))

    return list(await asyncio.gather(*(one(t) for t in turns)))


@contextlib.asynccontextmanager
async def unlimited(base: str) -> AsyncIterator[httpx.AsyncClient]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=base, limits=limits, timeout=30) as http:
        yield http


async def test_healthz_and_other_tenants_answer_while_many_streams_are_open(front: Front, redis_url: str) -> None:
    crowd = f"tc{uuid.uuid4().hex[:6]}"
    crowd_key = front.key(crowd, rps=0, streams=STREAMS)
    other_key = front.key(f"to{uuid.uuid4().hex[:6]}")
    turns = [front.open_turn(crowd) for _ in range(STREAMS)]
    r = sync_client(redis_url)
    async with unlimited(front.base) as http, contextlib.AsyncExitStack() as stack:
        streams = await open_streams(http, crowd_key, turns, stack)
        assert [s.status_code for s in streams] == [200] * STREAMS
        assert all(s.headers["content-type"].startswith("text/event-stream") for s in streams)
        wait_until(lambda: front.client.redis.zcard(front.client.keys.stream_holders(
            front.ring.list(crowd)[0][0].id)) == STREAMS)
        for _ in range(20):
            health = await http.get("/healthz")
            listed = await http.get("/v1/conversations", headers={"Authorization": f"Bearer {other_key}"})
            assert (health.status_code, health.json()) == (200, {"status": "ok"})
            assert (listed.status_code, listed.json()) == (200, {"conversations": []})
        # one connection reads every stream (on a cluster: one per slot with open streams, on its
        # node); on one server the rest is the sized pools, not one per stream (polled: a health
        # connection replaced after a socket timeout lingers in CLIENT LIST a moment)
        lanes = 1
        if isinstance(r, redis.RedisCluster):
            lanes = len({r.keyslot(keys_of(front.client, t).events(t)) for t in turns})
        wait_until(lambda: gateway_connections(r, os.getpid(), besides=front.others).get("streams") == lanes)
        if not isinstance(r, redis.RedisCluster):  # a cluster client's request pool is per node, unnamed
            bound = Settings.from_env({}).gateway_pool + 3
            wait_until(lambda: sum(gateway_connections(r, os.getpid(), besides=front.others).values()) <= bound)
            kinds = gateway_connections(r, os.getpid(), besides=front.others)  # the gateway runs in this process
            assert sum(kinds.values()) <= bound, kinds
        assert not any(s.is_closed for s in streams)
    r.close()


async def test_a_keys_streams_are_capped_with_retry_after_and_a_closed_one_frees_its_place(front: Front) -> None:
    tenant = f"tk{uuid.uuid4().hex[:6]}"
    key = front.key(tenant, rps=0, streams=3)
    key_id = front.ring.list(tenant)[0][0].id
    turns = [front.open_turn(tenant) for _ in range(4)]
    holders = front.client.keys.stream_holders(key_id)
    async with unlimited(front.base) as http, contextlib.AsyncExitStack() as stack:
        await open_streams(http, key, turns[:2], stack)
        async with contextlib.AsyncExitStack() as third:
            assert [s.status_code for s in await open_streams(http, key, turns[2:3], third)] == [200]
            refused = await http.get(f"/v1/turns/{turns[3]}/events", headers={"Authorization": f"Bearer {key}"})
            assert refused.status_code == 429 and int(refused.headers["Retry-After"]) >= 1
            assert refused.json()["code"] == "rate_limited" and "3 event streams" in refused.json()["message"]
        # the third stream closed: its hold is given back, and a new stream opens
        wait_until(lambda: front.client.redis.zcard(holders) == 2)
        assert [s.status_code for s in await open_streams(http, key, turns[3:], stack)] == [200]


def python_model(factory: str, **options: Any) -> dict[str, Any]:
    return {"provider": "python", "name": f"tests.support.models:{factory}", "options": options}


async def events_of(http: httpx.AsyncClient, url: str, headers: dict[str, str]) -> list[dict[str, str]]:
    """Every event of a stream until it ends (pings skipped)."""
    found: list[dict[str, str]] = []
    current: dict[str, str] = {}
    async with http.stream("GET", url, headers=headers) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line:
                if "data" in current:
                    found.append(current)
                current = {}
            elif not line.startswith(":"):
                name, _, value = line.partition(":")
                current[name] = value.removeprefix(" ")
    return found


async def test_multiplexed_streams_deliver_every_event_of_live_turns_in_order(workers: WorkerPool, redis_url: str,
                                                                               prefix: str) -> None:
    settings = dataclasses.replace(Settings.from_env({}), prefix=prefix, redis_url=redis_url)
    client = Client(redis_url, prefix=prefix)
    tenant = f"tm{uuid.uuid4().hex[:6]}"
    key = KeyRing(client.redis, client.keys).create(tenant, limits=Limits(rps=0))[0]
    agent = f"agent-{uuid.uuid4().hex[:10]}"
    client.put_agent(AgentConfig.model_validate(
        {"id": agent, "model": python_model("streaming", words=60, delay_ms=15)}))
    headers = {"Authorization": f"Bearer {key}"}
    try:
        with running_gateway(settings, redis_url) as base:
            async with unlimited(base) as http:
                turns = []
                for i in range(4):
                    accepted = await http.post("/v1/turns", headers=headers, json={
                        "app_id": "app", "user_id": "u1", "agent_id": agent, "query": f"talk {i}"})
                    assert accepted.status_code == 202, accepted.text
                    turns.append(accepted.json()["turn_id"])
                # two readers per turn, all on the one reader task, while the turns speak
                readers = [asyncio.ensure_future(events_of(http, f"/v1/turns/{t}/events", headers))
                           for t in turns for _ in range(2)]
                seen = await asyncio.gather(*readers)
                for index, turn_id in enumerate(turns):
                    stored = [e.decode() for e, _ in client.redis.xrange(keys_of(client, turn_id).events(turn_id))]
                    for events in seen[2 * index: 2 * index + 2]:
                        assert [e["id"] for e in events] == stored
                        assert json.loads(events[-1]["data"])["type"] == "succeeded", events[-1]
                    # a resume after any entry reads the rest from the backlog, then ends
                    middle = stored[len(stored) // 2]
                    rest = await events_of(http, f"/v1/turns/{turn_id}/events?after={middle}", headers)
                    assert [e["id"] for e in rest] == stored[len(stored) // 2 + 1:]
    finally:
        client.close()
