"""The console's memory panel in a real headless browser (Debian's chromium, driven by Playwright)
against a real gateway and the shared worker pool: a user's facts and notes listed with their
provenance (a link to the conversation and message a fact was taken from), one corrected (the old
version closed, kept in the history), one forgotten (no version left); values render as text."""

from __future__ import annotations

import dataclasses
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.conftest import WorkerPool
from tests.support.gateway import running_gateway
from threadline.pipeline.config import AgentConfig
from threadline.pipeline.consolidation import consolidate
from threadline.pipeline.extraction import Proposal
from threadline.pipeline.memory import Provenance, Scope
from threadline.workers.clients.client import Client
from threadline.workers.settings import Settings
from threadline.workers.storage.api_keys import create_key

if TYPE_CHECKING:
    from playwright.sync_api import Page

pytestmark = pytest.mark.integration

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
if not Path(CHROMIUM).exists():
    pytest.skip("Debian's chromium is not installed: apt-get install chromium", allow_module_level=True)
playwright = pytest.importorskip("playwright.sync_api", reason="playwright is in the `test` extra")
expect = playwright.expect

#: A note that would run script if it were ever parsed as HTML.
HOSTILE = '<img src=x onerror="document.title=\'owned\'"> likes <b>bold</b> tea'


@dataclasses.dataclass
class Console:
    base: str
    key: str
    tenant: str
    client: Client
    agent: str


@pytest.fixture(scope="module")
def console(workers: WorkerPool, redis_url: str, prefix: str) -> Iterator[Console]:
    settings = dataclasses.replace(Settings.from_env({}), prefix=prefix, redis_url=redis_url)
    with running_gateway(settings, redis_url) as base:
        client = Client(redis_url, prefix=prefix)
        agent = f"console-mem-{uuid.uuid4().hex[:8]}"
        client.put_agent(AgentConfig.model_validate({"id": agent, "model": "offline:chat"}))
        tenant = f"tcm{uuid.uuid4().hex[:6]}"
        yield Console(base, create_key(client.redis, client.keys, tenant), tenant, client, agent)
        client.close()


def extracted_fact(console: Console, user: str, conversation_id: str, message_id: str) -> str:
    """A fact as the memory stage writes it, taken from that conversation's message; its id."""
    scope = Scope(console.tenant, user)
    store = console.client.memory_store
    records, revision = store.read(scope)
    edit = consolidate(records, [Proposal("add", "fact", key="name", value="Ada")], scope=scope, now=1_000.0,
                       new_id=lambda: uuid.uuid4().hex, turn_ended_at=1_000.0,
                       source=Provenance("extracted", conversation_id, message_id, message_id, "offline:facts", "1"))
    assert store.apply(scope, edit, revision=revision, now=1_000.0)
    return edit.current[-1].id


def test_the_memory_panel_lists_corrects_and_forgets(console: Console) -> None:
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 860})
            page.set_default_timeout(10_000)
            walk_through(page, console)
        finally:
            browser.close()


def walk_through(page: Page, console: Console) -> None:
    user = f"u{uuid.uuid4().hex[:8]}"
    page.goto(console.base)
    page.fill("#key", console.key)
    page.click("#connect")
    expect(page.locator("#status")).to_have_text("connected")
    page.select_option("#agent", console.agent)
    # a first turn, then a second in the same conversation: the fact is taken from the first
    for query in ("My name is Ada", "second"):
        page.fill("#query", query)
        page.click("#send")
        expect(page.locator("#chat .turn:not(.live)")).to_have_count(1 if query != "second" else 2)
    cid = page.locator("#conversation").input_value()
    first_message = page.locator("#chat .turn").nth(0).get_attribute("data-message-id") or ""
    fact_id = extracted_fact(console, user, cid, first_message)
    note = console.client.set_memory(console.tenant, user, note=True, value=HOSTILE)

    records = page.locator("#memory .memory-record")
    page.fill("#memory-user-id", user)
    page.click("#memory-load")
    expect(records).to_have_count(2)
    fact = page.locator(f'#memory .memory-record[data-record-id="{fact_id}"]')
    expect(fact.locator(".memory-what")).to_have_text("name: Ada")
    expect(fact.locator(".memory-origin")).to_have_text("from a turn (offline:facts)")
    link = fact.locator("a.memory-source")
    expect(link).to_have_attribute("data-conversation-id", cid)
    expect(link).to_have_attribute("data-message-id", first_message)
    shown_note = page.locator(f'#memory .memory-record[data-record-id="{note.id}"]')
    expect(shown_note.locator(".memory-value")).to_have_text(" ".join(HOSTILE.split()))
    expect(shown_note.locator(".memory-origin")).to_have_text("set by the user")
    assert page.locator("#memory img, #memory b").count() == 0 and page.title() != "owned"

    # the provenance link opens the conversation on the message the fact was taken from
    page.select_option("#conversation", "")
    expect(page.locator("#chat .turn")).to_have_count(0)
    link.click()
    expect(page.locator("#conversation")).to_have_value(cid)
    expect(page.locator("#branch-note")).to_be_visible()
    expect(page.locator("#chat .turn")).to_have_count(1)
    expect(page.locator("#chat .turn").nth(0)).to_have_attribute("data-message-id", first_message)

    # correct the fact: a new current record, the extracted one closed and kept in the history
    fact.locator(".memory-edit").click()
    page.fill("#memory .memory-input", "Grace")
    page.click("#memory .memory-save")
    expect(page.locator("#status")).to_have_text("corrected")
    expect(records).to_have_count(2)
    expect(page.locator("#memory .memory-record", has_text="name: Grace")).to_have_count(1)
    facts = [r for r in console.client.memory(console.tenant, user, history=True) if r.kind == "fact"]
    assert [(r.value, r.current, r.source.origin) for r in facts] == [("Grace", True, "user"),
                                                                       ("Ada", False, "extracted")]
    assert facts[1].id == fact_id and facts[1].superseded_by == facts[0].id

    # forget the note: gone from the panel and from storage, every version of it
    shown_note.locator(".memory-forget").click()
    expect(page.locator("#status")).to_have_text("forgotten")
    expect(records).to_have_count(1)
    assert note.id not in [r.id for r in console.client.memory(console.tenant, user, history=True)]

    # add a note from the panel; another user's panel does not show it
    page.fill("#memory-value", "Prefers short answers")
    page.click("#memory-add-button")
    expect(page.locator("#status")).to_have_text("remembered")
    expect(records).to_have_count(2)
    page.fill("#memory-user-id", f"other-{user}")
    page.click("#memory-load")
    expect(page.locator("#memory .hint")).to_have_text("Nothing remembered.")
    assert [r.value for r in console.client.memory(console.tenant, user) if r.kind == "note"] == \
        ["Prefers short answers"]
