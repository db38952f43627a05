"""`/v1/users/{user_id}/memory` through a real gateway (uvicorn on a free port, a key prefix of its
own): two tenants each with a user `u1` never see or change each other's memory; a correction keeps
the old version in the history and a delete erases every version; a user-scoped key acts on its own
user only, another user reading as missing; every failure is the `{"code", "message"}` envelope."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.support.gateway import running_gateway
from threadline.pipeline.consolidation import consolidate
from threadline.pipeline.extraction import Proposal
from threadline.pipeline.memory import Provenance, Scope
from threadline.workers.clients.client import Client
from threadline.workers.gateway.tenancy import inside
from threadline.workers.settings import Settings
from threadline.workers.storage.api_keys import KeyRing

pytestmark = pytest.mark.integration


@dataclasses.dataclass
class Api:
    base: str
    client: Client
    ring: KeyRing
    tenant_a: str
    tenant_b: str
    key_a: str
    key_b: str

    def http(self, key: str | None) -> httpx.Client:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.Client(base_url=self.base, headers=headers, timeout=30)


@pytest.fixture(scope="module")
def api(redis_url: str, prefix: str) -> Iterator[Api]:
    own = f"{prefix}m"  # under the session prefix (dropped with it), apart from the other gateway tests' keys
    # many requests a second, by design: no rate limit in the way
    settings = dataclasses.replace(Settings.from_env({"TL_KEY_RPS": "100000"}), prefix=own, redis_url=redis_url)
    with running_gateway(settings, redis_url) as base:
        client = Client(redis_url, prefix=own)
        ring = KeyRing(client.redis, client.keys)
        tenant_a, tenant_b = f"ta{uuid.uuid4().hex[:6]}", f"tb{uuid.uuid4().hex[:6]}"
        yield Api(base, client, ring, tenant_a, tenant_b, ring.create(tenant_a)[0], ring.create(tenant_b)[0])
        client.close()


def user() -> str:
    return f"u{uuid.uuid4().hex[:8]}"


def test_two_tenants_each_with_user_u1_never_cross(api: Api) -> None:
    u1 = f"u1x{uuid.uuid4().hex[:6]}"  # one user id, in both tenants
    with api.http(api.key_a) as a, api.http(api.key_b) as b:
        ada = a.put(f"/v1/users/{u1}/memory", json={"key": "name", "value": "Ada"})
        assert ada.status_code == 200, ada.text
        bea = b.put(f"/v1/users/{u1}/memory", json={"key": "name", "value": "Bea"}).json()["record"]
        ada_id = ada.json()["record"]["id"]
        assert [r["value"] for r in a.get(f"/v1/users/{u1}/memory").json()["records"]] == ["Ada"]
        assert [r["value"] for r in b.get(f"/v1/users/{u1}/memory").json()["records"]] == ["Bea"]
        missing = b.get(f"/v1/users/{u1}/memory/{uuid.uuid4().hex}")
        # tenant B reaching tenant A's record by its id: exactly a missing one, whatever the verb
        for response in (b.get(f"/v1/users/{u1}/memory/{ada_id}"),
                         b.put(f"/v1/users/{u1}/memory/{ada_id}", json={"value": "Eve"}),
                         b.delete(f"/v1/users/{u1}/memory/{ada_id}")):
            assert response.status_code == 404
            assert response.json() == {"code": "not_found", "message": f"memory record {ada_id} not found"}
        assert missing.status_code == 404 and missing.json()["code"] == "not_found"
        assert b.delete(f"/v1/users/{u1}/memory").status_code == 200  # B forgets its u1 ...
        assert b.get(f"/v1/users/{u1}/memory").json()["records"] == []
        assert [r["id"] for r in a.get(f"/v1/users/{u1}/memory").json()["records"]] == [ada_id]  # ... not A's
        assert a.get(f"/v1/users/{u1}/memory/{bea['id']}").status_code == 404


def test_correct_and_delete_round_trip(api: Api) -> None:
    u = user()
    with api.http(api.key_a) as a:
        first = a.put(f"/v1/users/{u}/memory", json={"key": "preferred_language", "value": "French"}).json()["record"]
        assert first["source"]["origin"] == "user" and first["current"] is True
        fixed = a.put(f"/v1/users/{u}/memory/{first['id']}", json={"value": "German"})
        assert fixed.status_code == 200, fixed.text
        new = fixed.json()["record"]
        assert new["key"] == "preferred_language" and new["value"] == "German" and new["id"] != first["id"]
        assert [r["value"] for r in a.get(f"/v1/users/{u}/memory").json()["records"]] == ["German"]
        history = a.get(f"/v1/users/{u}/memory", params={"history": "true"}).json()["records"]
        assert [(r["value"], r["current"]) for r in history] == [("German", True), ("French", False)]
        old = a.get(f"/v1/users/{u}/memory/{first['id']}").json()["record"]
        assert old["superseded_by"] == new["id"] and old["invalid_at"] is not None
        # a closed record cannot be corrected (only the current one)
        assert a.put(f"/v1/users/{u}/memory/{first['id']}", json={"value": "Dutch"}).status_code == 404
        note = a.put(f"/v1/users/{u}/memory", json={"note": "Writes in short sentences"}).json()["record"]
        assert note["kind"] == "note"
        gone = a.delete(f"/v1/users/{u}/memory/{new['id']}")
        assert gone.status_code == 200 and gone.json()["forgotten"] == 2
        left = a.get(f"/v1/users/{u}/memory", params={"history": "true"}).json()["records"]
        assert [r["id"] for r in left] == [note["id"]]
        assert a.get(f"/v1/users/{u}/memory/{first['id']}").status_code == 404
        assert a.delete(f"/v1/users/{u}/memory/{new['id']}").status_code == 404
        assert a.delete(f"/v1/users/{u}/memory").json() == {"user_id": u, "forgotten": "all"}
        assert a.get(f"/v1/users/{u}/memory").json()["records"] == []


def test_partitions_and_provenance_shown_as_the_tenant_spells_it(api: Api) -> None:
    u = user()
    scope = Scope(api.tenant_a, u, app_id="shop")
    conversation = inside(api.tenant_a, "c-order-1")  # a gateway conversation, as stored
    records, revision = api.client.memory_store.read(scope)
    edit = consolidate(records, [Proposal("add", "fact", key="diet", value="vegan")], scope=scope, now=5.0,
                       new_id=lambda: uuid.uuid4().hex, turn_ended_at=5.0,
                       source=Provenance("extracted", conversation, "m-1", "order-1", "offline:facts", "1"))
    assert api.client.memory_store.apply(scope, edit, revision=revision, now=5.0)
    with api.http(api.key_a) as a:
        assert a.get(f"/v1/users/{u}/memory").json()["records"] == []  # the user partition is another one
        listed = a.get(f"/v1/users/{u}/memory", params={"app_id": "shop"}).json()["records"]
        assert len(listed) == 1
        assert listed[0]["source"] == {"origin": "extracted", "conversation_id": "c-order-1", "message_id": "m-1",
                                       "turn_id": "order-1", "extractor": "offline:facts", "extractor_version": "1"}
        assert a.get(f"/v1/users/{u}/memory/{listed[0]['id']}").status_code == 404
        assert a.get(f"/v1/users/{u}/memory/{listed[0]['id']}", params={"app_id": "shop"}).status_code == 200
        assert a.get(f"/v1/users/{u}/memory", params={"app_id": "shop", "agent_id": "x"}).status_code == 422
        a.delete(f"/v1/users/{u}/memory")  # every partition of the user
        after = a.get(f"/v1/users/{u}/memory", params={"app_id": "shop"})
        assert after.json()["records"] == [], after.text


def test_a_user_scoped_key_acts_on_its_own_user_only(api: Api) -> None:
    me, other = user(), user()
    scoped = api.ring.create(api.tenant_a, user_id=me)[0]
    with api.http(api.key_a) as tenant, api.http(scoped) as mine:
        theirs = tenant.put(f"/v1/users/{other}/memory", json={"key": "name", "value": "Zoe"}).json()["record"]
        made = mine.put(f"/v1/users/{me}/memory", json={"key": "name", "value": "Ada"})
        assert made.status_code == 200 and [r["value"] for r in mine.get(f"/v1/users/{me}/memory").json()["records"]] \
            == ["Ada"]
        for response in (mine.get(f"/v1/users/{other}/memory/{theirs['id']}"),
                         mine.put(f"/v1/users/{other}/memory/{theirs['id']}", json={"value": "Eve"}),
                         mine.delete(f"/v1/users/{other}/memory/{theirs['id']}")):
            assert response.status_code == 404
            assert response.json() == {"code": "not_found", "message": f"memory record {theirs['id']} not found"}
        for response in (mine.get(f"/v1/users/{other}/memory"), mine.delete(f"/v1/users/{other}/memory"),
                         mine.put(f"/v1/users/{other}/memory", json={"note": "x"})):
            assert response.status_code == 404 and response.json()["code"] == "not_found"
        assert [r["value"] for r in tenant.get(f"/v1/users/{other}/memory").json()["records"]] == ["Zoe"]


@pytest.mark.parametrize("body", [
    {}, {"key": "name"}, {"value": "Ada"}, {"key": "name", "value": "A", "note": "n"}, {"note": "n", "value": "v"},
    {"key": "name", "value": "   "}, {"key": "?!", "value": "A"}, {"key": "name", "value": "A", "extra": 1},
    {"key": "name", "value": 3}, {"key": "name", "value": "x" * 600}, {"note": "y" * 600}])
def test_bad_bodies_are_422_in_the_envelope(api: Api, body: dict[str, Any]) -> None:
    with api.http(api.key_a) as a:
        response = a.put(f"/v1/users/{user()}/memory", json=body)
    assert response.status_code == 422, response.text
    assert response.json()["code"] == "invalid_request" and response.json()["message"]


def test_no_key_is_401_and_an_invalid_user_id_is_refused(api: Api) -> None:
    with api.http(None) as anonymous, api.http(api.key_a) as a:
        assert anonymous.get(f"/v1/users/{user()}/memory").json()["code"] == "unauthorized"
        bad = a.get("/v1/users/no:colons/memory")
        assert bad.status_code == 422 and bad.json()["code"] == "invalid_request"
