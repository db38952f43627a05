"""The HTTP + SSE gateway, served by a real uvicorn on a free port in front of the shared worker pool:
turns (202, idempotent), their events as SSE (live deltas, a `Last-Event-ID` resume with nothing lost
or repeated), cancel, turn and conversation reads, deletion, agents, and tenant isolation by API key."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from structlog.testing import capture_logs

from tests.conftest import WorkerPool
from tests.support.gateway import free_port, running_gateway
from tests.support.turns import keys_of
from tests.support.wait import wait_until
from threadline.pipeline.config import AgentConfig
from threadline.workers.cli.main import run
from threadline.workers.clients.client import Client
from threadline.workers.gateway.tenancy import inside
from threadline.workers.settings import Settings
from threadline.workers.storage.api_keys import create_key

pytestmark = pytest.mark.integration

#: A log line of the console format (`2026-12-07 12:01:48 [info     ] request ...`).
LOG_LINE = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \[")


def python_model(factory: str, **options: Any) -> dict[str, Any]:
    return {"provider": "python", "name": f"tests.support.models:{factory}", "options": options}


@dataclasses.dataclass
class Api:
    base: str
    client: Client
    key_a: str
    admin_a: str
    key_b: str
    echo: str
    tenant_a: str = ""
    tenant_b: str = ""

    def http(self, key: str | None) -> httpx.Client:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.Client(base_url=self.base, headers=headers, timeout=30)

    def agent(self, model: str | dict[str, Any]) -> str:
        agent_id = f"agent-{uuid.uuid4().hex[:10]}"
        self.client.put_agent(AgentConfig.model_validate({"id": agent_id, "model": model}))
        return agent_id


@pytest.fixture(scope="module")
def api(workers: WorkerPool, redis_url: str, prefix: str) -> Iterator[Api]:
    # no per-key request rate: these tests send faster than the default 20/s (tests/workers/test_gateway_keys.py
    # tests the limits)
    settings = dataclasses.replace(Settings.from_env({"TL_MAX_QUERY_CHARS": "2000", "TL_MAX_BODY_BYTES": "65536",
                                                      "TL_KEY_RPS": "0"}),
                                   prefix=prefix, redis_url=redis_url)
    with running_gateway(settings, redis_url) as base:
        client = Client(redis_url, prefix=prefix)
        tenant_a, tenant_b = f"ta{uuid.uuid4().hex[:6]}", f"tb{uuid.uuid4().hex[:6]}"

        def key(tenant: str, admin: bool = False) -> str:
            return create_key(client.redis, client.keys, tenant, admin=admin)

        api = Api(base, client, key(tenant_a), key(tenant_a, admin=True), key(tenant_b), echo="", tenant_a=tenant_a,
                  tenant_b=tenant_b)
        api.echo = api.agent("offline:echo")
        yield api
        client.close()


def body(agent: str, query: str, **fields: Any) -> dict[str, Any]:
    return {"app_id": "app", "user_id": "u1", "agent_id": agent, "query": query, **fields}


def sse(response: httpx.Response) -> Iterator[dict[str, str]]:
    """The events of an SSE response as they arrive: {"id", "event", "data"} (pings skipped)."""
    current: dict[str, str] = {}
    for line in response.iter_lines():
        if not line:
            if "data" in current:
                yield current
            current = {}
        elif not line.startswith(":"):
            name, _, value = line.partition(":")
            current[name] = value.removeprefix(" ")


def post_turn(http: httpx.Client, request: dict[str, Any]) -> dict[str, Any]:
    response = http.post("/v1/turns", json=request)
    assert response.status_code == 202, response.text
    return dict(response.json())


def finish(http: httpx.Client, turn_id: str) -> dict[str, Any]:
    """Follow the events to the end; the terminal event's data."""
    with http.stream("GET", f"/v1/turns/{turn_id}/events") as response:
        events = list(sse(response))
    return dict(json.loads(events[-1]["data"]))


def test_events_stream_live_and_resume_after_last_event_id_exactly_once(api: Api, tmp_path: Path) -> None:
    until = tmp_path / "stop"
    agent = api.agent(python_model("streaming", words=400, delay_ms=20, until=str(until)))
    with api.http(api.key_a) as http:
        accepted = post_turn(http, body(agent, "talk"))
        turn_id = accepted["turn_id"]
        assert accepted["events_url"] == f"/v1/turns/{turn_id}/events" and accepted["created"] is True
        first: list[dict[str, str]] = []
        with http.stream("GET", accepted["events_url"]) as response:
            assert response.headers["content-type"].startswith("text/event-stream")
            for event in sse(response):
                first.append(event)
                if sum(e["event"] == "text_delta" for e in first) == 3:
                    break
        # the deltas arrived while the model was still speaking: it stops only when told to
        assert api.client.terminal(turn_id) is None
        wait_until(lambda: len(api.client.redis.xrange(keys_of(api.client, turn_id).events(turn_id))) > len(first) + 2)
        until.touch()
        with http.stream("GET", accepted["events_url"], headers={"Last-Event-ID": first[-1]["id"]}) as response:
            rest = list(sse(response))
    events_key = keys_of(api.client, turn_id).events(turn_id)
    stored = [entry_id.decode() for entry_id, _ in api.client.redis.xrange(events_key)]
    assert [e["id"] for e in first + rest] == stored
    assert [json.loads(e["data"])["seq"] for e in first + rest] == list(range(1, len(stored) + 1))
    assert rest[-1]["event"] == "succeeded"
    # `?after=` resumes the same way
    with api.http(api.key_a) as http, http.stream("GET", f"{accepted['events_url']}?after={stored[-2]}") as response:
        assert [e["id"] for e in sse(response)] == stored[-1:]


def test_post_is_idempotent_on_turn_id(api: Api) -> None:
    turn_id = uuid.uuid4().hex
    with api.http(api.key_a) as http:
        first = post_turn(http, body(api.echo, "once", turn_id=turn_id))
        second = post_turn(http, body(api.echo, "once", turn_id=turn_id))
        assert (first["turn_id"], first["created"]) == (turn_id, True)
        assert (second["turn_id"], second["created"]) == (turn_id, False)
        assert finish(http, turn_id)["type"] == "succeeded"
        assert post_turn(http, body(api.echo, "once", turn_id=turn_id))["created"] is False
    events = list(api.client.events(inside(api.tenant_a, turn_id)))
    assert [e.type for e in events].count("accepted") == 1 and [e.type for e in events].count("succeeded") == 1
    # the same id from another tenant is that tenant's own turn: no 409 that would tell it A's ids
    with api.http(api.key_b) as http:
        theirs = post_turn(http, body(api.echo, "mine?", turn_id=turn_id))
        assert (theirs["turn_id"], theirs["created"]) == (turn_id, True)
        assert finish(http, turn_id)["type"] == "succeeded"


def test_turn_ids_are_each_tenants_own_and_every_answer_speaks_the_tenants_spelling(api: Api) -> None:
    """A turn id chosen by A can neither be seen nor claimed by B, nor block B's own; A is only ever
    shown its own ids (answers, events, the conversation tree)."""
    turn_id = f"order-{uuid.uuid4().hex[:8]}"
    with api.http(api.key_b) as http:  # B claims the id first
        b_first = post_turn(http, body(api.echo, "from b", turn_id=turn_id))
        assert finish(http, turn_id)["type"] == "succeeded"
    with api.http(api.key_a) as http:
        accepted = post_turn(http, body(api.echo, "from a", turn_id=turn_id))
        assert accepted == {"turn_id": turn_id, "conversation_id": f"c-{turn_id}",
                            "events_url": f"/v1/turns/{turn_id}/events", "turn_url": f"/v1/turns/{turn_id}",
                            "created": True}
        with http.stream("GET", accepted["events_url"]) as response:
            seen = [json.loads(e["data"]) for e in sse(response)]
        assert {e["turn_id"] for e in seen} == {turn_id}
        assert seen[0]["type"] == "accepted" and (seen[0]["conversation_id"], seen[0]["message_id"]) == (
            f"c-{turn_id}", turn_id)
        follow = post_turn(http, body(api.echo, "again", conversation_id=f"c-{turn_id}",
                                      parent_message_id=turn_id, turn_id=f"{turn_id}-2"))
        assert finish(http, follow["turn_id"])["type"] == "succeeded"
        shown = http.get(f"/v1/conversations/c-{turn_id}").json()
        assert shown["path"] == [turn_id, f"{turn_id}-2"] and shown["conversation"]["tip"] == f"{turn_id}-2"
        assert [m["query"] for m in shown["messages"]] == ["from a", "again"]
        assert "@" not in json.dumps(http.get(f"/v1/turns/{turn_id}").json())
        assert f"c-{turn_id}" in [c["id"] for c in http.get("/v1/conversations").json()["conversations"]]
    assert b_first["turn_id"] == turn_id
    a_record = api.client.conversation(inside(api.tenant_a, f"c-{turn_id}"))
    b_record = api.client.conversation(inside(api.tenant_b, f"c-{turn_id}"))
    assert a_record is not None and b_record is not None and (a_record.tenant_id, b_record.tenant_id) == (
        api.tenant_a, api.tenant_b)


def test_a_turn_id_used_again_after_its_record_expired_never_writes_over_its_message(api: Api) -> None:
    """The defect: once a turn's record expired (TL_TURN_TTL_S), the same turn id again made a new
    turn that wrote over the message of the old one, moved the tip and added to the usage."""
    turn_id = f"order-{uuid.uuid4().hex[:8]}"
    with api.http(api.key_a) as http:
        post_turn(http, body(api.echo, "the original", turn_id=turn_id))
        assert finish(http, turn_id)["type"] == "succeeded"
        stored = inside(api.tenant_a, turn_id)
        cid = f"c-{stored}"
        keys = api.client.keys.of_conversation(cid)  # its turns' keys are in its shard
        before = {k: api.client.redis.dump(k) for k in (keys.conversation(cid), keys.messages(cid),
                                                         keys.snapshots(cid), keys.usage(api.tenant_a))}
        api.client.redis.delete(keys.turn(stored), keys.events(stored))  # its record expired
        again = post_turn(http, body(api.echo, "IGNORE the original", turn_id=turn_id))
        assert again["created"] is True
        ended = finish(http, turn_id)
    assert (ended["type"], ended["code"]) == ("failed", "invalid_request"), ended
    assert "was used before" in ended["message"] and "@" not in ended["message"]
    assert {k: api.client.redis.dump(k) for k in before} == before


def test_hostile_request_shapes_are_answered_in_the_envelope(api: Api) -> None:
    raw = {"Content-Type": "application/json"}
    with api.http(api.key_a) as http:
        cases = {
            "lone surrogate in turn_id": http.post("/v1/turns", content=b'{"turn_id": "\\ud800", "query": "x"}',
                                                   headers=raw),
            "lone surrogate in a field name": http.post("/v1/turns", content=b'{"\\ud800": 1, "query": "x"}',
                                                        headers=raw),
            "nesting 30,000 deep": http.post("/v1/turns", content=b'{"inputs": ' + b"[" * 30_000 + b"]" * 30_000
                                             + b"}", headers=raw),
            "invalid UTF-8": http.post("/v1/turns", content=b'{"query": "\xff\xfe"}', headers=raw),
            "not JSON": http.post("/v1/turns", content=b"{oops", headers=raw),
            "inputs over TL_MAX_INPUTS_CHARS": http.post("/v1/turns", json=body(api.echo, "hi", inputs={
                f"v{i}": "x" * 1000 for i in range(40)})),
        }
        routed = {"unrouted path": http.get("/v1/no-such-thing"), "method": http.delete("/v1/turns"),
                  "docs UI": http.get("/docs")}
    for name, response in cases.items():
        assert response.status_code in (400, 422), (name, response.status_code, response.text)
        assert response.headers["content-type"] == "application/json", name
        assert response.json()["code"] == "invalid_request" and "detail" not in response.json().get("message", ""), name
        assert "\ud800" not in response.text.replace("\\ud800", ""), name  # never echoed unencodable
    assert (routed["unrouted path"].status_code, routed["unrouted path"].json()["code"]) == (404, "not_found")
    assert (routed["method"].status_code, routed["method"].json()["code"]) == (405, "method_not_allowed")
    assert routed["docs UI"].status_code == 404  # no Swagger UI from a CDN; /openapi.json stays


def test_a_body_over_the_limit_is_refused_while_it_arrives(api: Api) -> None:
    """413 `payload_too_large` for a declared length over TL_MAX_BODY_BYTES (65536 here) before a byte
    of the body is read, and for a chunked body as soon as it passes the limit, long before it ends."""
    host, port = api.base.removeprefix("http://").split(":")
    with api.http(api.key_a) as http:
        declared = http.post("/v1/turns", content=b"x" * 70_000, headers={"Content-Type": "application/json"})
    assert (declared.status_code, declared.json()["code"]) == (413, "payload_too_large")
    with socket.create_connection((host, int(port)), timeout=10) as conn:
        conn.sendall(f"POST /v1/turns HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {api.key_a}\r\n"
                     "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n".encode())
        chunk = b"x" * 16_384
        sent = 0
        try:
            while sent < 48_000_000:  # the body never ends: only the limit stops it
                conn.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                sent += len(chunk)
        except OSError:
            pass  # the gateway answered and closed the connection
        answer = conn.recv(65_536).decode(errors="replace")
    assert answer.startswith("HTTP/1.1 413") and "payload_too_large" in answer, answer[:300]
    assert sent < 10_000_000


def test_every_answer_carries_the_browser_hardening_headers(api: Api) -> None:
    with api.http(api.key_a) as http:
        for path in ("/v1/conversations", "/", "/console.js", "/v1/nope", "/openapi.json"):
            headers = http.get(path).headers
            assert headers["content-security-policy"].startswith("default-src 'self'"), path
            assert "frame-ancestors 'none'" in headers["content-security-policy"], path
            assert (headers["x-content-type-options"], headers["x-frame-options"], headers["referrer-policy"]) == (
                "nosniff", "DENY", "no-referrer"), path
        assert http.get("/v1/conversations").headers["cache-control"] == "no-store"
    # the console loads under that policy: no inline script or style in its page
    page = (Path(__file__).parents[2] / "workers" / "gateway" / "console" / "index.html").read_text()
    assert re.findall(r"<script(?![^>]*\bsrc=)[^>]*>", page) == [] and "<style" not in page
    assert " style=" not in page and not re.search(r"\son[a-z]+=", page)


def requests_logged(logs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The access-log lines, but for event streams: an earlier test's stream may end (and be logged)
    while this test runs."""
    return [e for e in logs if e.get("event") == "request" and not str(e.get("route", "")).endswith("/events")]


def own_lines(logs: list[dict[str, Any]], tenant: str, key: str) -> list[dict[str, Any]]:
    """The access-log lines of `key` — by its id once it is known (`tenant`'s requests), by its
    digest before authentication: another test's gateway in this process (a console still polling)
    may log its own requests meanwhile."""
    lines = requests_logged(logs)
    ids = {e.get("key") for e in lines if e.get("tenant") == tenant} | {hashlib.sha256(key.encode()).hexdigest()[:8]}
    return [e for e in lines if e.get("key") in ids]


def test_each_request_is_one_access_log_line_without_key_or_body(api: Api) -> None:
    with capture_logs() as logs, api.http(api.key_a) as http:
        turn_id = f"logged-{uuid.uuid4().hex[:8]}"
        post_turn(http, body(api.echo, "a secret query", turn_id=turn_id))
        http.get(f"/v1/turns/{turn_id}")
        http.post("/v1/turns", content=b"x" * 70_000)
        wait_until(lambda: len(own_lines(logs, api.tenant_a, api.key_a)) >= 3)
    lines = own_lines(logs, api.tenant_a, api.key_a)
    # from this test's first request on: the line of the previous test's last request (the same key)
    # may be written after its response, inside this test's capture
    lines = lines[next(i for i, e in enumerate(lines) if e["route"] == "/v1/turns"):]
    assert [(e["method"], e["route"], e["status"]) for e in lines[:3]] == [
        ("POST", "/v1/turns", 202), ("GET", "/v1/turns/{turn_id}", 200), ("POST", "-", 413)]
    digest = hashlib.sha256(api.key_a.encode()).hexdigest()[:8]
    for line in lines[:3]:
        assert line["log_level"] == "info" and line["bytes"] > 0 and line["duration_ms"] >= 0
        assert line["key"] and line["key"] != api.key_a and (line["key"] == digest or len(line["key"]) <= 32)
        assert api.key_a not in json.dumps(line) and "secret" not in json.dumps(line)
    assert [line["tenant"] for line in lines[:2]] == [api.tenant_a, api.tenant_a]


@pytest.mark.parametrize("after", ["1-0\n", "\u0661-0", "\uff11-0", "1-0 ", " 1-0", "1-"])
def test_after_takes_ascii_stream_ids_only(api: Api, after: str) -> None:
    with api.http(api.key_a) as http:
        mine = post_turn(http, body(api.echo, "hi"))
        response = http.get(mine["events_url"], params={"after": after})
    assert (response.status_code, response.json()["code"]) == (422, "invalid_request")


def test_cancel_and_get_turn(api: Api, tmp_path: Path) -> None:
    agent = api.agent(python_model("streaming", words=1000, delay_ms=20, until=str(tmp_path / "never")))
    with api.http(api.key_a) as http:
        turn_id = post_turn(http, body(agent, "go on"))["turn_id"]
        wait_until(lambda: any(e.type == "text_delta" for e in api.client.events(turn_id)), timeout_s=20)
        assert http.get(f"/v1/turns/{turn_id}").json()["status"] == "running"
        response = http.post(f"/v1/turns/{turn_id}/cancel", json={"reason": "user pressed stop"})
        assert response.status_code == 202 and response.json()["result"] == "enqueued"
        assert finish(http, turn_id)["type"] == "cancelled"
        state = http.get(f"/v1/turns/{turn_id}").json()
        assert state["status"] == "cancelled" and state["result"]["type"] == "cancelled"
        assert http.post(f"/v1/turns/{turn_id}/cancel").json()["result"] == "noop: cancelled"

        done = post_turn(http, body(api.echo, "hello"))
        assert finish(http, done["turn_id"])["type"] == "succeeded"
        state = http.get(done["turn_url"]).json()
    assert state["status"] == "succeeded" and state["conversation_id"] == done["conversation_id"]
    assert state["result"]["usage"]["requests"] == 1 and "hello" in state["result"]["answer"]
    assert "history" in state["decisions"]


def test_conversations_list_show_delete(api: Api) -> None:
    with api.http(api.key_a) as http:
        first = post_turn(http, body(api.echo, "one"))
        assert finish(http, first["turn_id"])["type"] == "succeeded"
        cid = first["conversation_id"]
        second = post_turn(http, body(api.echo, "two", conversation_id=cid))
        assert finish(http, second["turn_id"])["type"] == "succeeded"
        other = post_turn(http, body(api.echo, "elsewhere"))
        assert finish(http, other["turn_id"])["type"] == "succeeded"

        listed = [c["id"] for c in http.get("/v1/conversations").json()["conversations"]]
        assert listed[:2] == [other["conversation_id"], cid]
        shown = http.get(f"/v1/conversations/{cid}").json()
        assert shown["conversation"]["id"] == cid and len(shown["path"]) == 2
        assert [m["query"] for m in shown["messages"]] == ["one", "two"]
        assert [m["id"] for m in shown["messages"]] == shown["path"]
        assert shown["messages"][1]["parent_id"] == shown["path"][0]
        assert all(m["status"] == "succeeded" and m["usage"]["requests"] == 1 for m in shown["messages"])
        assert all("history" in m["decisions"] for m in shown["messages"])

        deleted = http.delete(f"/v1/conversations/{cid}")
        assert deleted.status_code == 200 and deleted.json()["turns"] == 2
        assert http.get(f"/v1/conversations/{cid}").status_code == 404
        assert http.delete(f"/v1/conversations/{cid}").status_code == 404
        assert cid not in [c["id"] for c in http.get("/v1/conversations").json()["conversations"]]
        assert http.get(f"/v1/turns/{first['turn_id']}").status_code == 404


def test_agents_put_show_versions_publish(api: Api) -> None:
    agent_id = f"agent-{uuid.uuid4().hex[:10]}"
    config = {"model": "offline:echo", "instructions": "v1"}
    with api.http(api.admin_a) as http:
        put = http.put(f"/v1/agents/{agent_id}", json=config).json()
        assert put == {"agent_id": agent_id, "ref": "v1", "created": True, "version": 1}
        assert http.put(f"/v1/agents/{agent_id}", json=config).json()["created"] is False
        draft = http.put(f"/v1/agents/{agent_id}?draft=next", json={**config, "instructions": "v2"}).json()
        assert draft["ref"] == "draft:next"
        published = http.post(f"/v1/agents/{agent_id}/publish").json()
        assert published["ref"] == "v2" and published["created"] is True
        shown = http.get(f"/v1/agents/{agent_id}").json()
        assert shown["version"] == 2 and shown["config"]["instructions"] == "v2"
        assert http.get(f"/v1/agents/{agent_id}?version=1").json()["config"]["instructions"] == "v1"
        versions = http.get(f"/v1/agents/{agent_id}/versions").json()
        assert versions["active"] == 2 and [v["version"] for v in versions["versions"]] == [1, 2]
        assert http.get(f"/v1/agents/{agent_id}?version=9").status_code == 404
        assert http.get("/v1/agents/nope-nope/versions").status_code == 404
        bad = http.put(f"/v1/agents/{agent_id}", json={"model": "offline:echo", "id": "other"})
        assert bad.status_code == 422 and bad.json()["code"] == "invalid_request"
    with api.http(api.key_a) as http:
        assert agent_id in [a["agent_id"] for a in http.get("/v1/agents").json()["agents"]]
        refused = http.put(f"/v1/agents/{agent_id}", json=config)
        assert refused.status_code == 403 and refused.json()["code"] == "forbidden"
        assert http.get(f"/v1/agents/{agent_id}").status_code == 403


def test_another_tenants_turn_and_conversation_are_404_like_missing_ones(api: Api) -> None:
    with api.http(api.key_a) as http:
        mine = post_turn(http, body(api.echo, "private"))
        assert finish(http, mine["turn_id"])["type"] == "succeeded"
    turn_id, cid = mine["turn_id"], mine["conversation_id"]
    with api.http(api.key_b) as http:
        for method, path in (("GET", "/v1/turns/{}"), ("GET", "/v1/turns/{}/events"),
                             ("POST", "/v1/turns/{}/cancel")):
            foreign = http.request(method, path.format(turn_id))
            missing = http.request(method, path.format("no-such-turn"))
            assert foreign.status_code == missing.status_code == 404
            assert foreign.json()["code"] == missing.json()["code"] == "not_found"
        for method in ("GET", "DELETE"):
            assert http.request(method, f"/v1/conversations/{cid}").status_code == 404
        assert cid not in [c["id"] for c in http.get("/v1/conversations").json()["conversations"]]
        # a turn naming A's conversation names B's own (missing) one: the same answer as any missing id
        foreign = post_turn(http, body(api.echo, "let me in", conversation_id=cid))
        missing = post_turn(http, body(api.echo, "let me in", conversation_id="c-no-such-conversation"))
        assert [finish(http, t["turn_id"])["code"] for t in (foreign, missing)] == ["conversation_not_found"] * 2
        # the tenant is the key's: naming another one is refused
        tenant_a = api.client.owner(turn_id)  # a generated turn id is stored as it is
        assert tenant_a == api.tenant_a
        wrong = http.post("/v1/turns", json={**body(api.echo, "as A"), "tenant_id": tenant_a})
        assert wrong.status_code == 403 and wrong.json()["code"] == "forbidden"
    assert api.client.conversation(cid) is not None  # untouched


def test_keys_and_validation(api: Api) -> None:
    with api.http(None) as http:
        assert http.get("/v1/conversations").status_code == 401
        assert http.post("/v1/turns", json=body(api.echo, "hi")).json()["code"] == "unauthorized"
        assert http.get("/healthz").json() == {"status": "ok"}
        assert "/v1/turns" in http.get("/openapi.json").json()["paths"]
        page = http.get("/")  # the web console (tests/workers/test_console.py drives it in a browser)
        assert page.status_code == 200 and "<title>Threadline console</title>" in page.text
        assert http.get("/console.js").headers["content-type"].startswith("text/javascript")
    with api.http("tlk_not-a-key") as http:
        assert http.get("/v1/conversations").status_code == 401
    with api.http(api.key_a) as http:
        empty = http.post("/v1/turns", json=body(api.echo, "   "))
        assert empty.status_code == 422 and empty.json()["code"] == "invalid_request"
        assert "query is empty" in empty.json()["message"]
        assert http.post("/v1/turns", json=[1, 2]).status_code == 422
        assert http.get("/v1/turns/x/events?after=not-an-id").status_code == 404  # unknown turn first
        mine = post_turn(http, body(api.echo, "hi"))
        assert http.get(f"{mine['events_url']}?after=1-2-3").status_code == 422


def test_keys_create_and_gateway_commands(api: Api, redis_url: str, prefix: str, monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("REDIS_URL", redis_url)
    monkeypatch.setenv("TL_PREFIX", prefix)
    assert run(["keys", "create", "tc-cli"]) == 0
    printed = capsys.readouterr()
    # the fixture's in-process gateway may log an earlier test's request late, into this capture (seen
    # on a loaded machine): the command's own output is what is not such a log line
    (key,) = [line for line in printed.out.splitlines() if not LOG_LINE.match(line)]
    assert key.startswith("tlk_"), printed
    assert key.encode() not in b"".join(api.client.redis.hvals(api.client.keys.api_keys()))
    with api.http(key) as http:
        assert http.get("/v1/conversations").json() == {"conversations": []}
    assert run(["keys", "create", "not:a:tenant"]) == 2
    assert run(["gateway", "--console", str(Path("no-such-dir"))]) == 2
    assert "--console no-such-dir: not a directory" in capsys.readouterr().err
    # `threadline gateway` serves the same API from its own process (here without the console)
    port = free_port()
    env = {**os.environ, "REDIS_URL": redis_url, "TL_PREFIX": prefix}
    proc = subprocess.Popen([sys.executable, "-m", "threadline.workers.cli", "gateway", "--port", str(port),
                             "--no-console"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        def healthy() -> bool:
            try:
                return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200
            except httpx.TransportError:
                return False

        wait_until(healthy, timeout_s=20)
        listed = httpx.get(f"http://127.0.0.1:{port}/v1/conversations", headers={"Authorization": f"Bearer {key}"})
        assert listed.json() == {"conversations": []}
        assert httpx.get(f"http://127.0.0.1:{port}/").status_code == 404
    finally:
        proc.terminate()
        _, stderr = proc.communicate(timeout=10)
    assert b"gateway on http://127.0.0.1:" in stderr
