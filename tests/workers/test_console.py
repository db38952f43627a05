"""The web console in a real headless browser (Debian's chromium, driven by Playwright) against a
real gateway and the shared worker pool: two turns, the first regenerated, a branch from an old
message, a streaming turn stopped; the tree with its current path, and the budget bar with the turns
pruned. Screenshots of the tree and the budget bar go to `TL_CONSOLE_SCREENSHOTS` when it names a
directory (the README's come from `TL_CONSOLE_SCREENSHOTS=docs`)."""

from __future__ import annotations

import dataclasses
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from tests.conftest import WorkerPool
from tests.support.gateway import running_gateway
from threadline.pipeline.config import AgentConfig
from threadline.workers.clients.client import Client
from threadline.workers.settings import Settings
from threadline.workers.storage.api_keys import create_key

if TYPE_CHECKING:
    from playwright.sync_api import Locator, Page

pytestmark = pytest.mark.integration

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
if not Path(CHROMIUM).exists():
    pytest.skip("Debian's chromium is not installed: apt-get install chromium", allow_module_level=True)
playwright = pytest.importorskip("playwright.sync_api", reason="playwright is in the `test` extra")
expect = playwright.expect

#: Long enough that no later turn's history budget holds it: the next turns show it pruned.
FIRST = "Tell me about " + " ".join(f"place{i} river{i}" for i in range(45))


@dataclasses.dataclass
class Console:
    base: str
    key: str
    client: Client
    small: str  # offline:chat in a small context window: turns get pruned
    slow: str  # offline:chat speaking one word per 60 ms: time to press Stop


@pytest.fixture(scope="module")
def console(workers: WorkerPool, redis_url: str, prefix: str) -> Iterator[Console]:
    settings = dataclasses.replace(Settings.from_env({}), prefix=prefix, redis_url=redis_url)
    with running_gateway(settings, redis_url) as base:
        client = Client(redis_url, prefix=prefix)

        def agent(model: dict[str, Any], **fields: Any) -> str:
            agent_id = f"console-{uuid.uuid4().hex[:8]}"
            client.put_agent(AgentConfig.model_validate({"id": agent_id, "model": model, **fields}))
            return agent_id

        small = agent({"provider": "offline", "name": "chat", "context_window": 400, "max_output_tokens": 60},
                      instructions="You are the console's test agent.", memory={"safety_margin_tokens": 20})
        slow = agent({"provider": "offline", "name": "chat", "options": {"delay_ms": 60, "repeat": 20}})
        key = create_key(client.redis, client.keys, f"tcon{uuid.uuid4().hex[:6]}")
        yield Console(base, key, client, small, slow)
        client.close()


def screenshot(locator: Page | Locator, tmp_path: Path, name: str) -> None:
    locator.screenshot(path=str(tmp_path / name))
    target = os.environ.get("TL_CONSOLE_SCREENSHOTS")
    if target:
        shutil.copy(tmp_path / name, Path(target) / name)


def test_console_chats_regenerates_branches_and_stops(console: Console, tmp_path: Path) -> None:
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 860})
            page.set_default_timeout(10_000)
            walk_through(page, console, tmp_path)
        finally:
            browser.close()


def send(page: Page, query: str) -> None:
    page.fill("#query", query)
    page.click("#send")


def walk_through(page: Page, console: Console, tmp_path: Path) -> None:
    page.goto(console.base)
    page.fill("#key", console.key)
    page.click("#connect")
    expect(page.locator("#status")).to_have_text("connected")
    page.select_option("#agent", console.small)
    chat, tree = page.locator("#chat .turn"), page.locator("#tree .node")
    on_path = page.locator("#tree .node.on-path")

    # two turns; the second's window could not hold the first, which it shows pruned
    send(page, FIRST)
    expect(tree).to_have_count(1)
    expect(chat.nth(0).locator(".answer")).to_contain_text('Hello! You said "Tell me about place0')
    send(page, "second")
    expect(tree).to_have_count(2)
    first_id, second_id = (chat.nth(i).get_attribute("data-message-id") for i in range(2))
    second = chat.nth(1)
    expect(second.locator(".answer")).to_have_text('Hello! You said "second". This is the start of our conversation.')
    expect(second.locator(".pruned .dropped")).to_have_attribute("data-message-id", first_id)
    expect(second.locator(".caption")).to_contain_text("dropped 1")
    expect(on_path).to_have_count(2)
    cid = page.locator("#conversation").input_value()
    stored = {m["id"]: m for m in conversation(console, cid)}
    assert stored[second_id]["parent_id"] == first_id and stored[first_id]["parent_id"] is None

    # regenerate the first turn: a new root, which becomes the current path
    chat.nth(0).locator(".regenerate").click()
    expect(tree).to_have_count(3)
    expect(chat).to_have_count(1)
    expect(on_path).to_have_count(1)
    regenerated = chat.nth(0).get_attribute("data-message-id")
    assert regenerated not in (first_id, second_id)
    assert {m["id"]: m for m in conversation(console, cid)}[regenerated]["parent_id"] is None
    assert on_path.get_attribute("data-message-id") == regenerated
    assert chat.nth(0).locator(".user").inner_text() == FIRST

    # back on the old branch (a click in the tree), branch from its second message
    page.locator(f'#tree .node[data-message-id="{second_id}"]').click()
    expect(on_path).to_have_count(2)
    expect(chat).to_have_count(2)
    chat.nth(1).locator(".branch").click()
    expect(page.locator("#branch-note")).to_be_visible()
    send(page, "third")
    expect(tree).to_have_count(4)
    expect(chat).to_have_count(3)
    third = chat.nth(2)
    third_id = third.get_attribute("data-message-id")
    assert {m["id"]: m for m in conversation(console, cid)}[third_id]["parent_id"] == second_id
    expect(third.locator(".answer")).to_have_text('You said "third". Earlier you told me "second". '
                                                  "That makes 2 messages from you so far.")
    # what the model saw: the second turn kept, the first pruned; the bar's parts fill the window
    parts = {seg.get_attribute("data-part"): int(seg.get_attribute("data-tokens") or 0)
             for seg in third.locator(".bar .seg").all()}
    assert {"instructions", "history", "unused", "query", "output", "margin"} <= parts.keys()
    assert (parts["output"], parts["margin"], sum(parts.values())) == (60, 20, 400)
    expect(third.locator(".pruned .dropped")).to_have_attribute("data-message-id", first_id)
    expect(third.locator(".caption")).to_contain_text("kept 1 turn (")
    screenshot(page, tmp_path, "console-tree.png")  # the whole page: the tree beside the path it highlights
    screenshot(third.locator(".budget"), tmp_path, "console-budget.png")

    # a new conversation with the slow agent: its answer shows while it streams, and Stop cancels it
    page.select_option("#conversation", "")
    expect(tree).to_have_count(0)
    page.select_option("#agent", console.slow)
    send(page, "tell me everything")
    live = page.locator("#chat .turn.live .answer")
    expect(live).to_contain_text("You said")
    expect(page.locator("#stop")).to_be_enabled()
    page.click("#stop")
    stopped = page.locator('#chat .turn[data-status="cancelled"]')
    expect(stopped).to_have_count(1)
    expect(page.locator("#status")).to_contain_text("cancelled")
    full = 20 * len('Hello! You said "tell me everything". This is the start of our conversation. ')
    assert len(stopped.locator(".answer").inner_text()) < full / 2
    new_cid = page.locator("#conversation").input_value()
    assert new_cid != cid and [m["status"] for m in conversation(console, new_cid)] == ["cancelled"]


def conversation(console: Console, cid: str) -> list[dict[str, Any]]:
    return [m.model_dump(mode="json") for m in console.client.messages(cid)]
