"""API keys with a lifecycle through two real gateway processes (`threadline gateway`) in front of the
shared worker pool: a revoked key is refused by both within a second, an expired one at its expiry,
rotation keeps two live keys per name until the old one goes, a user-scoped key acts only as its
user, per-key rate limits and failed authentications are 429 with `Retry-After`, and neither
`keys list` nor `/v1/admin/keys` ever shows a key."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.conftest import WorkerPool, drop_prefix
from tests.support.gateway import free_port, running_gateway
from tests.support.wait import wait_until
from threadline.pipeline.config import AgentConfig
from threadline.workers.cli.main import run
from threadline.workers.clients.client import Client
from threadline.workers.settings import Settings
from threadline.workers.storage.api_keys import KeyRing, Limits, key_digest

pytestmark = pytest.mark.integration

#: What the gateway promises for a revoked key: refused by every process this long after.
REVOKED_WITHIN_S = 1.0


@contextlib.contextmanager
def gateway_process(redis_url: str, prefix: str) -> Iterator[str]:
    """`threadline gateway` in a process of its own; its base URL once it answers."""
    port = free_port()
    env = {**os.environ, "REDIS_URL": redis_url, "TL_PREFIX": prefix}
    proc = subprocess.Popen([sys.executable, "-m", "threadline.workers.cli", "gateway", "--port", str(port),
                             "--no-console"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    base = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        try:
            return httpx.get(f"{base}/healthz", timeout=1).status_code == 200
        except httpx.TransportError:
            return False

    try:
        wait_until(healthy, timeout_s=30)
        yield base
    finally:
        proc.terminate()
        proc.communicate(timeout=10)


@dataclasses.dataclass
class Gateways:
    bases: tuple[str, str]
    client: Client
    ring: KeyRing
    agent: str

    def get(self, base: str, path: str, key: str) -> httpx.Response:
        return httpx.get(f"{base}{path}", headers={"Authorization": f"Bearer {key}"}, timeout=30)

    def post(self, path: str, key: str, body: dict[str, Any]) -> httpx.Response:
        return httpx.post(f"{self.bases[0]}{path}", headers={"Authorization": f"Bearer {key}"}, json=body, timeout=30)


@pytest.fixture(scope="module")
def gateways(workers: WorkerPool, redis_url: str, prefix: str) -> Iterator[Gateways]:
    client = Client(redis_url, prefix=prefix)
    agent = f"agent-{uuid.uuid4().hex[:10]}"
    client.put_agent(AgentConfig.model_validate({"id": agent, "model": "offline:echo"}))
    with gateway_process(redis_url, prefix) as one, gateway_process(redis_url, prefix) as two:
        yield Gateways((one, two), client, KeyRing(client.redis, client.keys), agent)
    client.close()


@pytest.fixture(autouse=True)
def cli_env(redis_url: str, prefix: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """`threadline keys ...` (run in this process) on the gateways' server and prefix."""
    monkeypatch.setenv("REDIS_URL", redis_url)
    monkeypatch.setenv("TL_PREFIX", prefix)


def tenant() -> str:
    return f"tk{uuid.uuid4().hex[:6]}"


def statuses(gw: Gateways, key: str) -> list[int]:
    return [gw.get(base, "/v1/conversations", key).status_code for base in gw.bases]


def test_a_revoked_key_is_refused_by_every_gateway_within_a_second(gateways: Gateways) -> None:
    key, record = gateways.ring.create(tenant(), name="ci")
    assert statuses(gateways, key) == [200, 200]  # both processes have it cached now
    assert run(["keys", "revoke", record.id]) == 0
    revoked = time.monotonic()
    while time.monotonic() < revoked + REVOKED_WITHIN_S:  # the promise's bound, measured on this clock
        time.sleep(0.05)
    assert statuses(gateways, key) == [401, 401]
    refused = gateways.get(gateways.bases[1], "/v1/conversations", key).json()
    assert refused == {"code": "unauthorized", "message": "the API key is revoked"}
    assert run(["keys", "revoke", record.id]) == 0  # again: nothing changes
    assert run(["keys", "revoke", "k000000000000"]) == 3


def test_an_expired_key_is_refused_from_its_expiry(gateways: Gateways) -> None:
    expires_at = time.time() + 3
    key, _ = gateways.ring.create(tenant(), expires_at=expires_at)
    answered = statuses(gateways, key)
    if time.time() < expires_at:  # answered before the expiry (a loaded machine may be slower)
        assert answered == [200, 200]
    while time.time() <= expires_at:
        time.sleep(0.05)
    assert statuses(gateways, key) == [401, 401]
    assert gateways.get(gateways.bases[0], "/v1/conversations", key).json()["message"] == "the API key is expired"


def test_rotation_keeps_both_keys_live_until_the_old_one_is_revoked(gateways: Gateways,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    owner = tenant()
    old_key, old = gateways.ring.create(owner, name="billing", user_id="u7", limits=Limits(rps=50))
    assert run(["keys", "rotate", old.id, "--grace", "1h"]) == 0
    new_key = capsys.readouterr().out.strip()
    assert new_key.startswith("tlk_") and new_key != old_key
    listed = {k.id: k for k, _ in gateways.ring.list(owner)}
    assert len(listed) == 2
    new = next(k for k in listed.values() if k.id != old.id)
    assert (new.name, new.tenant_id, new.role, new.user_id, new.limits) == ("billing", owner, "tenant", "u7",
                                                                             Limits(rps=50))
    assert listed[old.id].expires_at is not None and listed[old.id].live(time.time())
    assert statuses(gateways, old_key) == statuses(gateways, new_key) == [200, 200]
    # the same over HTTP, with an admin key: a rotation with no grace ends the old key at once
    admin_key, _ = gateways.ring.create(owner, admin=True)
    rotated = gateways.post(f"/v1/admin/keys/{new.id}/rotate", admin_key, {"grace": "0s"})
    assert rotated.status_code == 201, rotated.text
    newest = rotated.json()["key"]
    assert rotated.json()["previous"]["id"] == new.id and rotated.json()["record"]["name"] == "billing"
    revoked = httpx.delete(f"{gateways.bases[1]}/v1/admin/keys/{old.id}",
                           headers={"Authorization": f"Bearer {admin_key}"}).json()["record"]
    assert revoked["status"] == "revoked"
    start = time.monotonic()
    while time.monotonic() < start + REVOKED_WITHIN_S:
        time.sleep(0.05)
    assert statuses(gateways, old_key) == statuses(gateways, new_key) == [401, 401]
    assert statuses(gateways, newest) == [200, 200]
    assert gateways.post(f"/v1/admin/keys/{old.id}/rotate", admin_key, {}).json()["code"] == "key_not_live"
    assert gateways.post("/v1/admin/keys/k000000000000/rotate", admin_key, {}).status_code == 404


def test_keys_list_and_the_admin_listing_never_show_a_key(gateways: Gateways,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    owner = tenant()
    assert run(["keys", "create", owner, "--name", "web", "--expires", "30d", "--user", "u1"]) == 0
    key = capsys.readouterr().out.strip()
    admin_key, _ = gateways.ring.create(owner, admin=True, name="ops")
    assert statuses(gateways, key) == [200, 200]
    secrets = (key, key_digest(key), admin_key, key_digest(admin_key))
    assert run(["keys", "list", "--tenant", owner, "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["name"], r["role"], r["user_id"], r["status"]) for r in rows] == [
        ("web", "tenant", "u1", "live"), ("ops", "admin", None, "live")]
    assert rows[0]["expires_at"] - rows[0]["created_at"] == pytest.approx(30 * 86_400, abs=5)
    assert rows[0]["last_used_at"] is not None  # written by the requests above
    assert run(["keys", "list", "--tenant", owner]) == 0
    table = capsys.readouterr().out
    assert table.splitlines()[0].split() == ["ID", "NAME", "TENANT", "ROLE", "USER", "STATUS", "CREATED", "EXPIRES",
                                             "LAST", "USED"]
    listing = gateways.get(gateways.bases[0], f"/v1/admin/keys?tenant={owner}", admin_key)
    assert [k["name"] for k in listing.json()["keys"]] == ["web", "ops"]
    for shown in (json.dumps(rows), table, listing.text):
        assert not any(secret in shown for secret in secrets)
    refused = gateways.get(gateways.bases[0], "/v1/admin/keys", key)
    assert refused.status_code == 403 and refused.json()["code"] == "forbidden"
    made = gateways.post("/v1/admin/keys", admin_key, {"tenant_id": owner, "name": "api", "expires": "2h",
                                                       "limits": {"turns_per_min": 5}})
    assert made.status_code == 201 and made.json()["key"].startswith("tlk_")
    assert made.json()["record"]["limits"] == {"rps": None, "turns_per_min": 5, "streams": None}
    assert statuses(gateways, made.json()["key"]) == [200, 200]
    bad = gateways.post("/v1/admin/keys", admin_key, {"tenant_id": owner, "expires": "yesterday"})
    assert bad.status_code == 422 and bad.json()["code"] == "invalid_request"


def follow(gw: Gateways, key: str, turn_id: str) -> str:
    """The terminal event's type, read from the events stream."""
    with httpx.stream("GET", f"{gw.bases[0]}/v1/turns/{turn_id}/events", headers={"Authorization": f"Bearer {key}"},
                      timeout=60) as response:
        types = [line.removeprefix("event: ") for line in response.iter_lines() if line.startswith("event: ")]
    return types[-1]


def test_a_user_scoped_key_acts_only_as_its_user(gateways: Gateways) -> None:
    owner = tenant()
    wide, _ = gateways.ring.create(owner)
    scoped, _ = gateways.ring.create(owner, user_id="alice")
    body = {"app_id": "app", "agent_id": gateways.agent, "query": "hi"}
    mine = gateways.post("/v1/turns", scoped, {**body, "user_id": "alice"})
    assert mine.status_code == 202, mine.text
    # the key reads its own turn at once, before any worker admitted it
    assert gateways.get(gateways.bases[1], mine.json()["turn_url"], scoped).status_code == 200
    assert follow(gateways, scoped, mine.json()["turn_id"]) == "succeeded"
    as_bob = gateways.post("/v1/turns", scoped, {**body, "user_id": "bob"})
    assert as_bob.status_code == 403 and as_bob.json()["code"] == "forbidden"
    bobs = gateways.post("/v1/turns", wide, {**body, "user_id": "bob"}).json()
    assert follow(gateways, wide, bobs["turn_id"]) == "succeeded"
    missing = gateways.get(gateways.bases[0], "/v1/turns/no-such-turn", scoped)
    for path in (bobs["turn_url"], bobs["events_url"], f"/v1/conversations/{bobs['conversation_id']}"):
        foreign = gateways.get(gateways.bases[0], path, scoped)
        assert (foreign.status_code, foreign.json()["code"]) == (404, "not_found") == (missing.status_code,
                                                                                      missing.json()["code"])
        assert gateways.get(gateways.bases[0], path, wide).status_code == 200
    # a turn in bob's conversation is refused like one in a missing conversation
    into_bobs = gateways.post("/v1/turns", scoped, {**body, "user_id": "alice",
                                                    "conversation_id": bobs["conversation_id"]})
    assert into_bobs.status_code == 404
    listed = [c["id"] for c in gateways.get(gateways.bases[1], "/v1/conversations", scoped).json()["conversations"]]
    assert listed == [mine.json()["conversation_id"]]
    everyone = [c["id"] for c in gateways.get(gateways.bases[1], "/v1/conversations", wide).json()["conversations"]]
    assert set(everyone) == {mine.json()["conversation_id"], bobs["conversation_id"]}


async def burst(base: str, key: str, path: str, n: int) -> list[httpx.Response]:
    """`n` requests at once (they all arrive within the bucket's refill time)."""
    async with httpx.AsyncClient(base_url=base, headers={"Authorization": f"Bearer {key}"}, timeout=30) as http:
        return list(await asyncio.gather(*(http.get(path) for _ in range(n))))


def test_a_keys_rate_limits_are_429_with_retry_after_across_processes(gateways: Gateways) -> None:
    owner = tenant()
    key, _ = gateways.ring.create(owner, limits=Limits(rps=2, turns_per_min=2))
    answers = [r for base in gateways.bases for r in asyncio.run(burst(base, key, "/v1/conversations", 10))]
    limited = [r for r in answers if r.status_code == 429]
    # the bucket is shared: 2 per second for both processes together, so most of the 20 are refused
    assert len(limited) >= 10 and {r.status_code for r in answers} == {200, 429}
    assert all(r.json()["code"] == "rate_limited" and int(r.headers["Retry-After"]) >= 1 for r in limited)
    assert "requests per second" in limited[0].json()["message"]
    # turns per minute: the third turn within a minute waits (rps no longer in the way)
    turns = KeyRing(gateways.client.redis, gateways.client.keys)
    key, _ = turns.create(owner, limits=Limits(rps=0, turns_per_min=2))
    body = {"app_id": "app", "user_id": "u1", "agent_id": gateways.agent, "query": "hi"}
    codes = [gateways.post("/v1/turns", key, body) for _ in range(3)]
    assert [c.status_code for c in codes] == [202, 202, 429]
    assert "turns per minute" in codes[2].json()["message"] and int(codes[2].headers["Retry-After"]) >= 20
    assert gateways.get(gateways.bases[1], "/v1/conversations", key).status_code == 200  # reads still go


def test_failed_authentications_are_throttled_per_address(redis_url: str) -> None:
    prefix = f"tla{uuid.uuid4().hex[:8]}"
    settings = dataclasses.replace(Settings.from_env({"TL_AUTH_FAILURES_PER_MIN": "5"}), prefix=prefix,
                                   redis_url=redis_url)
    client = Client(redis_url, prefix=prefix)
    key, _ = KeyRing(client.redis, client.keys).create("tenant-a")
    try:
        with running_gateway(settings, redis_url) as base:
            with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {key}"}) as good:
                assert good.get("/v1/conversations").status_code == 200
            with httpx.Client(base_url=base, headers={"Authorization": "Bearer tlk_guess"}) as guessing:
                codes = [guessing.get("/v1/conversations").status_code for _ in range(8)]
                throttled = guessing.get("/v1/conversations")
            assert codes[:5] == [401] * 5 and set(codes[5:]) == {429}
            assert throttled.json()["code"] == "rate_limited" and int(throttled.headers["Retry-After"]) >= 1
            # a throttled address gets no verdict on any key it has not used a moment ago, until it refills
            fresh, _ = KeyRing(client.redis, client.keys).create("tenant-a")
            with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {fresh}"}) as unknown:
                assert unknown.get("/v1/conversations").status_code == 429
            assert httpx.get(f"{base}/healthz").status_code == 200
    finally:
        drop_prefix(client.redis, prefix)
        client.close()
