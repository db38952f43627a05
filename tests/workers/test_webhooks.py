"""Completion webhooks (docs/webhooks.md): the URL rules, signature and backoff (pure); one delivery per
turn created by the terminal write however often it runs (scripts); and through real worker processes
a receiver that fails the first two attempts of every delivery, gets the third, verifies the
signature with the documented snippet and sees each turn's idempotency id once after de-duplication;
attempts recorded and retried by the CLI; private hosts refused by default; a bad URL refused at submit."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import AgentFactory, WorkerPool, turn
from tests.support.cli import cli_env, cli_runner
from tests.support.gateway import running_gateway
from tests.support.script_driver import LAST, make_turn
from tests.support.turns import keys_of, python_model
from tests.support.wait import poll, wait_until
from tests.support.webhook_receiver import WebhookReceiver
from threadline.pipeline import webhooks
from threadline.pipeline.config import AgentConfig
from threadline.pipeline.contracts import parse_turn_request
from threadline.pipeline.errors import InvalidRequest
from threadline.pipeline.stages import DEFAULT_GRAPH
from threadline.workers.clients.async_client import AsyncClient
from threadline.workers.clients.client import Client
from threadline.workers.gateway.tenancy import inside
from threadline.workers.protocol.names import WEBHOOK_ACTOR, WEBHOOK_QUEUE
from threadline.workers.settings import Settings
from threadline.workers.storage.api_keys import KeyRing
from threadline.workers.storage.store import Store

ROOT = Path(__file__).resolve().parents[2]
Verify = Callable[[str, str, bytes], bool]


def documented_verify() -> Verify:
    """The receiver's check exactly as docs/webhooks.md prints it."""
    page = (ROOT / "docs" / "webhooks.md").read_text()
    block = page.split("<!-- webhook-verify:start -->")[1].split("<!-- webhook-verify:end -->")[0]
    code = block.split("```python")[1].split("```")[0]
    namespace: dict[str, Any] = {}
    exec(compile(code, "docs/webhooks.md", "exec"), namespace)  # the documented snippet, as printed
    verify: Verify = namespace["verify"]
    return verify


# --- pure: signature, backoff, URL rules ------------------------------------------------------------


def test_the_documented_snippet_verifies_threadline_signatures_and_nothing_else() -> None:
    verify = documented_verify()
    body = webhooks.delivery_body(delivery_id="t-1", turn_id="t-1", tenant_id="acme",
                                  event_json='{"seq":3,"type":"succeeded","turn_id":"t-1"}')
    now = int(time.time())
    header = webhooks.signature("whsec_abc", now, body)
    assert header.startswith(f"t={now},v1=")
    assert verify("whsec_abc", header, body)
    assert not verify("whsec_other", header, body)
    assert not verify("whsec_abc", header, body.replace(b"succeeded", b"failed"))
    assert not verify("whsec_abc", webhooks.signature("whsec_abc", now - 3600, body), body)  # replayed late
    assert not verify("whsec_abc", "v1=deadbeef", body)


def test_attempts_back_off_doubling_up_to_the_cap_until_the_last_one() -> None:
    failed = webhooks.AttemptResult(status_code=503)
    verdicts = [webhooks.after_attempt(failed, attempt=n, max_attempts=5, base_s=2, max_s=10) for n in range(1, 6)]
    assert [v.retry_in_s for v in verdicts] == [2, 4, 8, 10, None]
    assert [v.status for v in verdicts] == ["retrying"] * 4 + ["failed"]
    ok = webhooks.after_attempt(webhooks.AttemptResult(status_code=204), attempt=1, max_attempts=5, base_s=2, max_s=10)
    assert ok == webhooks.Verdict("delivered")
    refused = webhooks.AttemptResult(error="host_refused", refused=True)
    assert webhooks.after_attempt(refused, attempt=1, max_attempts=5, base_s=2, max_s=10).status == "failed"


BAD_URLS = ["ftp://example.com/hook", "example.com/hook", "https://", "https://u:p@example.com/",
            "https://example.com/a b", "https://example.com:99999/", "https://x.com/" + "a" * 2048]


@pytest.mark.parametrize("url", BAD_URLS)
def test_a_bad_webhook_url_is_refused_with_invalid_request(url: str) -> None:
    request = {"schema": "threadline.turn/v1", "tenant_id": "t1", "app_id": "a", "user_id": "u", "agent_id": "ag",
               "query": "hi", "webhook_url": url}
    with pytest.raises(InvalidRequest) as refused:
        parse_turn_request(request, fallback_turn_id="t-1", max_query_chars=100)
    assert refused.value.code == "invalid_request" and "webhook_url" in refused.value.message
    with pytest.raises(ValueError, match="webhook_url"):
        AgentConfig.model_validate({"id": "a", "model": "offline:echo", "webhook_url": url})


# --- scripts: one delivery per turn ---------------------------------------------------------------


async def test_the_terminal_write_creates_one_delivery_however_often_the_finish_stage_runs(store: Store) -> None:
    t = await make_turn(store)
    await t.run_to(LAST)
    assert (await t.begin(LAST)).status == "go"
    assert await t.finish(webhook_url="https://hooks.example.com/a") == "ok"
    assert await t.finish(webhook_url="https://hooks.example.com/a") == "already"  # a redelivered finish
    d = await store.delivery(t.id)
    assert d is not None and (d.status, d.attempts, d.tenant_id, d.url) == ("pending", 0, "t1",
                                                                             "https://hooks.example.com/a")
    last = (await store.redis.xrevrange(store.keys.events(t.id), count=1))[0][1][b"json"].decode()
    assert d.event == last and json.loads(d.event)["type"] == "succeeded"
    assert await store.redis.llen(store.keys.queue(WEBHOOK_QUEUE)) == 1
    assert [d.id for d in await store.deliveries()] == [t.id]


async def test_a_turn_without_a_webhook_enqueues_nothing(store: Store) -> None:
    t = await make_turn(store)
    await t.run_to(LAST)
    assert (await t.begin(LAST)).status == "go"
    assert await t.finish() == "ok"
    assert await store.delivery(t.id) is None
    assert not await store.redis.exists(store.keys.queue(WEBHOOK_QUEUE), store.keys.queue_messages(WEBHOOK_QUEUE),
                                        store.keys.webhooks())


# --- through real worker processes ------------------------------------------------------------------


@pytest.fixture
def receiver() -> Iterator[WebhookReceiver]:
    with WebhookReceiver(fail_first=2) as r:
        yield r


@pytest.mark.integration
def test_a_receiver_failing_twice_gets_the_third_attempt_signed_once_per_turn(
        isolated: Callable[..., WorkerPool], receiver: WebhookReceiver, redis_url: str,
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    pool = isolated({"TL_WEBHOOK_HOSTS": "all", "TL_WEBHOOK_BACKOFF_S": "0.2", "TL_WEBHOOK_BACKOFF_MAX_S": "0.5",
                     "TL_DELAY_POLL_MS": "100"}).start(processes=2, threads=4)
    client = Client(redis_url, prefix=pool.prefix)
    secret = client.webhook_secret("t1")
    receiver.secret, receiver.verify = (lambda: secret), documented_verify()
    plain = f"plain-{uuid.uuid4().hex[:8]}"
    hooked = f"hooked-{uuid.uuid4().hex[:8]}"
    client.put_agent(AgentConfig.model_validate({"id": plain, "model": "offline:echo"}))
    client.put_agent(AgentConfig.model_validate({"id": hooked, "model": "offline:echo",
                                                 "webhook_url": receiver.url + "?from=agent"}))
    own = [client.start(turn(plain, f"q{i}", webhook_url=receiver.url)) for i in range(3)]
    by_agent = client.start(turn(hooked, "from the agent's config"))
    none = client.start(turn(plain, "no webhook"))
    by_key, named = gateway_turns(pool.prefix, redis_url, client, plain, key_webhook=receiver.url + "?from=key")
    turns = [*own, by_agent, by_key, named]  # as the tenant spells them
    for t in [*own, by_agent, none]:
        assert t.result(timeout=60).type == "succeeded"  # a failing receiver never holds up a turn
    for t in (by_key, inside("t1", named)):  # the gateway's own id is stored as it is, the tenant's tagged
        assert client.wait(t, timeout_s=60).type == "succeeded"

    wait_until(lambda: len(receiver.delivered()) == len(turns), timeout_s=60)
    assert sorted(receiver.delivered()) == sorted(turns)  # each turn's idempotency id once, after de-duplication
    for t in turns:
        seen = receiver.attempts(t)
        assert [r.answered for r in seen] == [500, 500, 200]
        assert [r.headers["threadline-attempt"] for r in seen] == ["1", "2", "3"]
        assert len({r.body for r in seen}) == 1  # the same body on every attempt; only `t` changes
        body = json.loads(seen[-1].body)
        assert (body["delivery_id"], body["turn_id"], body["tenant_id"]) == (t, t, "t1")
        assert body["event"]["type"] == "succeeded" and body["event"]["turn_id"] == t
    assert receiver.attempts(by_agent)[0].path.endswith("?from=agent")
    assert receiver.attempts(by_key)[0].path.endswith("?from=key")
    assert "@" not in receiver.attempts(named)[-1].body.decode()  # no stored spelling leaks to the tenant
    assert not receiver.attempts(none)

    cli_env(monkeypatch, redis_url=redis_url, prefix=pool.prefix, data_dir=tmp_path)
    run = cli_runner(capsys, verb=("webhooks",))
    listed = run("list", "--turn", own[0], "--json")
    assert listed.code == 0, listed.err
    (record,) = json.loads(listed.out)
    assert (record["status"], record["attempts"]) == ("delivered", 3)
    assert [a["outcome"] for a in record["attempt_log"]] == ["retrying", "retrying", "delivered"]
    assert [a["status_code"] for a in record["attempt_log"]] == [500, 500, 200]
    assert all(len(a["excerpt"]) <= webhooks.EXCERPT_CHARS for a in record["attempt_log"])
    assert run("list", "--turn", none).code == 3  # no delivery: nothing was created for it
    heads = {line.split()[0]: line.split()[1] for line in run("list").out.splitlines() if not line.startswith(" ")}
    assert heads == dict.fromkeys([*own, by_agent, by_key, inside("t1", named)], "delivered")  # stored ids
    assert run("secret", "t1").out.strip() == secret

    assert run("retry", own[0]).code == 0
    wait_until(lambda: len(receiver.attempts(own[0])) == 4, timeout_s=30)
    assert sorted(receiver.delivered()) == sorted(turns)  # the extra delivery de-duplicates away
    unknown = run("retry", "no-such-delivery")
    assert unknown.code == 3 and "no webhook delivery" in unknown.one_line()

    # a malformed job names no delivery: dead-lettered at once, nothing POSTed
    k = keys_of(client, own[1])
    client.enqueue(WEBHOOK_QUEUE, WEBHOOK_ACTOR, ({"delivery_id": own[1]},), shard=k.shard)
    wait_until(lambda: any(e[b"reason"] == b"invalid_webhook_job"
                           for _, e in client.redis.xrange(k.dead_letters())), timeout_s=30)
    assert len(receiver.attempts(own[1])) == 3
    client.close()


def gateway_turns(prefix: str, redis_url: str, client: Client, agent: str, *, key_webhook: str) -> tuple[str, str]:
    """Two turns through the gateway with an API key that names a webhook (the turns name none), after
    the gateway refused one naming a bad URL: one with the id the gateway made, one named by the tenant."""
    settings = dataclasses.replace(Settings.from_env({}), prefix=prefix, redis_url=redis_url)
    key, _ = KeyRing(client.redis, client.keys).create("t1", webhook_url=key_webhook)
    with running_gateway(settings, redis_url) as base, httpx.Client(
            base_url=base, headers={"Authorization": f"Bearer {key}"}, timeout=30) as http:
        body = {"app_id": "app", "user_id": "u1", "agent_id": agent, "query": "through the gateway"}
        refused = http.post("/v1/turns", json={**body, "webhook_url": "gopher://example.com/"})
        assert refused.status_code == 422 and refused.json()["code"] == "invalid_request", refused.text
        assert "webhook_url" in refused.text
        made = http.post("/v1/turns", json=body)
        named = http.post("/v1/turns", json={**body, "turn_id": f"order-{uuid.uuid4().hex[:8]}"})
        assert made.status_code == named.status_code == 202, (made.text, named.text)
        return str(made.json()["turn_id"]), str(named.json()["turn_id"])


@pytest.mark.integration
def test_private_hosts_are_refused_by_default_and_the_turn_still_succeeds(
        workers: WorkerPool, client: Client, make_agent: AgentFactory, receiver: WebhookReceiver) -> None:
    # the shared pool runs with the default TL_WEBHOOK_HOSTS=public: 127.0.0.1 is not a public host
    handle = client.start(turn(make_agent(), "hello", webhook_url=receiver.url))
    assert handle.result(timeout=30).type == "succeeded"
    keys = keys_of(client, handle)
    failed = poll(lambda: client.redis.hget(keys.webhook(handle), "status") == b"failed", timeout_s=30)
    assert failed, client.redis.hgetall(keys.webhook(handle))
    (attempt,) = [json.loads(a) for a in client.redis.lrange(keys.webhook_attempts(handle), 0, -1)]
    assert attempt["error"].startswith("host_refused") and attempt["status_code"] is None
    assert not receiver.received


@pytest.mark.integration
def test_an_invalid_webhook_url_is_refused_at_submit_and_nothing_is_written(
        own_prefix: str, redis_url: str) -> None:
    with Client(redis_url, prefix=own_prefix) as client:
        agent = f"agent-{uuid.uuid4().hex[:8]}"
        client.put_agent(AgentConfig.model_validate({"id": agent, "model": "offline:echo"}))
        r = client.redis
        before = sorted(r.scan_iter(f"{own_prefix}:*", count=1000))
        with pytest.raises(InvalidRequest) as refused:
            client.start(turn(agent, "hello", turn_id=f"bad-hook-{uuid.uuid4().hex[:8]}",
                              webhook_url="file:///etc/passwd"))
        assert refused.value.code == "invalid_request" and "webhook_url" in refused.value.message
        assert sorted(r.scan_iter(f"{own_prefix}:*", count=1000)) == before


def test_the_cli_refuses_a_key_with_a_bad_webhook_url_and_rotates_a_secret(
        redis_url: str, prefix: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        tmp_path: Path) -> None:
    cli_env(monkeypatch, redis_url=redis_url, prefix=prefix, data_dir=tmp_path)
    run = cli_runner(capsys)
    tenant = f"t{uuid.uuid4().hex[:8]}"
    refused = run("keys", "create", tenant, "--webhook-url", "ftp://example.com/")
    assert refused.code == 2 and "webhook_url" in refused.one_line() and not refused.out
    first = run("webhooks", "secret", tenant).out.strip()
    assert first.startswith("whsec_") and run("webhooks", "secret", tenant).out.strip() == first
    rotated = run("webhooks", "secret", tenant, "--rotate").out.strip()
    assert rotated.startswith("whsec_") and rotated != first
    with Client(redis_url, prefix=prefix) as client:
        assert client.webhook_secret(tenant) == rotated

    async def from_async() -> str:
        async with AsyncClient(redis_url, prefix=prefix) as client:
            return await client.webhook_secret(tenant)

    assert asyncio.run(from_async()) == rotated


def test_submit_takes_a_webhook_url_and_refuses_a_bad_one_writing_nothing(
        redis_url: str, own_prefix: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        tmp_path: Path) -> None:
    """On a prefix no worker serves: the submitted turn's message is read where it waits."""
    prefix = own_prefix
    cli_env(monkeypatch, redis_url=redis_url, prefix=prefix, data_dir=tmp_path)
    run = cli_runner(capsys, verb=("submit",))
    with Client(redis_url, prefix=prefix) as client:
        client.put_agent(AgentConfig.model_validate({"id": "hooked", "model": "offline:echo"}))
        r = client.redis
        before = sorted(r.scan_iter(f"{prefix}:*", count=1000))
        refused = run("--agent", "hooked", "--query", "hi", "--webhook-url", "ftp://example.com/")
        assert refused.code == 2 and "webhook_url" in refused.one_line() and not refused.out
        assert sorted(r.scan_iter(f"{prefix}:*", count=1000)) == before
        taken = run("--agent", "hooked", "--query", "hi", "--webhook-url", "https://hooks.example.com/t")
        assert taken.code == 0, taken.err
        turn_id = taken.out.split()[0]
        (queued,) = [m for k in client.keys.every_shard() for m in r.hvals(k.queue_messages(DEFAULT_GRAPH.first.queue))
                     if turn_id.encode() in m]
        assert json.loads(queued)["args"][0]["webhook_url"] == "https://hooks.example.com/t"


@pytest.mark.integration
def test_a_turn_ended_before_it_was_accepted_reaches_its_webhook(
        isolated: Callable[..., WorkerPool], redis_url: str, tmp_path: Path) -> None:
    """Cancelled while waiting in its conversation's line, a turn never accepted still has its
    terminal event POSTed to the URL its request named."""
    pool = isolated({"TL_WEBHOOK_HOSTS": "all", "TL_DELAY_POLL_MS": "100"}).start(processes=1, threads=4)
    client = Client(redis_url, prefix=pool.prefix)
    release = tmp_path / "release"
    agent = f"slow-{uuid.uuid4().hex[:8]}"
    client.put_agent(AgentConfig.model_validate({"id": agent, "model": python_model(
        "streaming", words=100_000, delay_ms=20, until=str(release))}))
    with WebhookReceiver() as receiver:
        running = client.start(turn(agent, "hold the conversation"))
        wait_until(lambda: client.turn_state(str(running)).status == "running")
        cid = client.turn_state(str(running)).conversation_id
        waiting = client.start(turn(agent, "wait", conversation_id=cid, webhook_url=receiver.url))
        wait_until(lambda: client.turn_state(str(waiting)).status == "waiting")
        client.cancel(str(waiting), "not needed")
        assert client.wait(str(waiting), timeout_s=30).type == "cancelled"
        wait_until(lambda: receiver.delivered() == [str(waiting)], timeout_s=30)
        body = json.loads(receiver.attempts(str(waiting))[-1].body)
        assert body["event"]["type"] == "cancelled" and body["event"]["message"] == "not needed"
        release.touch()
        assert client.wait(str(running), timeout_s=30).type == "succeeded"
    client.close()
