"""The web console in a real headless browser (Debian's chromium, driven by Playwright) against a
real gateway and the shared worker pool, with offline and FunctionModel agents (no network).

First the conversation tree: two turns, the first regenerated, a branch from an old message, a
streaming turn stopped; the tree with its current path and the budget bar with the turns pruned.
Then the console as a chat, at a laptop's and a phone's size: a markdown answer rendered (bold, a
fenced code block with its copy button, a table), an HTML/XSS answer shown as text, Stop, an error
with its message in the bubble, a reload keeping the conversation, the `n / 3` switcher after two
regenerations, the stage timeline (one entry per stage), a tool call and its result, a retry with
its reason, a paused `ask_human` turn answered from the form, a conversation deleted — with the
composer on the screen and no sideways scrolling throughout. Screenshots go to
`TL_CONSOLE_SCREENSHOTS` when it names a directory (the docs' come from `TL_CONSOLE_SCREENSHOTS=docs`)."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from tests.conftest import WorkerPool
from tests.support.browser import CHROMIUM, DESKTOP, PHONE, assert_fits, screenshot
from tests.support.gateway import running_gateway
from tests.support.turns import all_events, python_model
from threadline.pipeline import events as ev
from threadline.pipeline.config import AgentConfig
from threadline.workers.clients.client import Client
from threadline.workers.settings import Settings
from threadline.workers.storage.api_keys import create_key

if TYPE_CHECKING:
    from playwright.sync_api import Page

pytestmark = pytest.mark.integration

if not Path(CHROMIUM).exists():
    pytest.skip("Debian's chromium is not installed: apt-get install chromium", allow_module_level=True)
playwright = pytest.importorskip("playwright.sync_api", reason="playwright is in the `test` extra")
expect = playwright.expect
expect.set_options(timeout=15_000)  # a loaded machine: turns take seconds, not milliseconds

#: Long enough that no later turn's history budget holds it: the next turns show it pruned.
FIRST = "Tell me about " + " ".join(f"place{i} river{i}" for i in range(45))

MARKDOWN = """**What** you asked, in *short*:

| part | tokens |
|---|---|
| query | 12 |
| answer | 30 |

```python
print("hello")
```

- first point
- second point

Read [the docs](https://example.com/docs)."""

#: Every line would run script or make markup if it were ever parsed as HTML.
HOSTILE = """<img src=x onerror="window.owned=1"> and <script>window.owned=2</script>
[click me](javascript:window.owned=3) **<b>bold</b>** `<i>code</i>`
<a href="https://example.com" onclick="window.owned=4">link</a>"""


@dataclasses.dataclass
class Console:
    base: str
    key: str
    client: Client
    agent: Callable[..., str]  # a new agent for a model (and other fields): its id


@pytest.fixture(scope="module")
def console(workers: WorkerPool, redis_url: str, prefix: str) -> Iterator[Console]:
    settings = dataclasses.replace(Settings.from_env({}), prefix=prefix, redis_url=redis_url)
    with running_gateway(settings, redis_url) as base:
        client = Client(redis_url, prefix=prefix)

        def agent(model: dict[str, Any] | str, **fields: Any) -> str:
            agent_id = f"console-{uuid.uuid4().hex[:8]}"
            client.put_agent(AgentConfig.model_validate({"id": agent_id, "model": model, **fields}))
            return agent_id

        key = create_key(client.redis, client.keys, f"tcon{uuid.uuid4().hex[:6]}")
        yield Console(base, key, client, agent)
        client.close()


@pytest.fixture
def browser() -> Iterator[Any]:
    with playwright.sync_playwright() as p:
        launched = p.chromium.launch(executable_path=CHROMIUM, headless=True)
        try:
            yield launched
        finally:
            launched.close()


def open_console(browser: Any, console: Console, viewport: dict[str, int], link: str = "/") -> Page:
    """A new browser context (its own sessionStorage: no key yet) on the console at `link`, connected."""
    context = browser.new_context(viewport=viewport)
    context.grant_permissions(["clipboard-read", "clipboard-write"], origin=console.base)
    page: Page = context.new_page()
    page.set_default_timeout(15_000)
    page.on("pageerror", lambda error: print("the console's script failed:", error))
    page.goto(console.base + link)
    expect(page.locator("#chat .welcome")).to_contain_text("Paste an API key")
    page.fill("#key", console.key)
    page.click("#connect")
    expect(page.locator("#status")).to_contain_text("connected")
    if link == "/":
        expect(page.locator("#chat .welcome")).to_contain_text("Type a message below")
    return page


def send(page: Page, query: str) -> None:
    page.fill("#query", query)
    page.click("#send")


def new_conversation(page: Page, agent: str) -> None:
    page.select_option("#conversation", "")
    expect(page.locator("#chat .turn")).to_have_count(0)
    page.select_option("#agent", agent)


def ended(page: Page, count: int) -> None:
    """`count` turns shown, none of them streaming."""
    expect(page.locator("#chat .turn:not(.live)")).to_have_count(count)
    expect(page.locator("#chat .turn.live")).to_have_count(0)


def conversation(console: Console, cid: str) -> list[dict[str, Any]]:
    return [m.model_dump(mode="json") for m in console.client.messages(cid)]


# --- the tree, the branches, the budget (the desktop screen) --------------------------------------


@pytest.mark.slow  # ~15 s of chromium: the slow tier (`.ci/run`) runs it
def test_console_chats_regenerates_branches_and_stops(console: Console, browser: Any, tmp_path: Path) -> None:
    small = console.agent({"provider": "offline", "name": "chat", "context_window": 400, "max_output_tokens": 60},
                          instructions="You are the console's test agent.", memory={"safety_margin_tokens": 20})
    slow = console.agent({"provider": "offline", "name": "chat", "options": {"delay_ms": 60, "repeat": 20}})
    page = open_console(browser, console, DESKTOP)
    page.select_option("#agent", small)
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
    ended(page, 3)
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
    assert_fits(page)
    screenshot(page, tmp_path, "console-tree.png")  # the whole page: the tree beside the path it highlights
    screenshot(third.locator(".budget"), tmp_path, "console-budget.png")

    # a new conversation with the slow agent: its answer shows while it streams, and Stop cancels it
    new_conversation(page, slow)
    expect(tree).to_have_count(0)
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
    assert_fits(page)


# --- the console as a chat, on a laptop and on a phone --------------------------------------------


@pytest.mark.parametrize("viewport", [DESKTOP, pytest.param(PHONE, marks=pytest.mark.slow)],
                         ids=["1280x800", "390x844"])
def test_console_is_a_chat_that_shows_what_each_turn_did(console: Console, browser: Any, tmp_path: Path,
                                                          viewport: dict[str, int]) -> None:
    phone = viewport == PHONE
    agents = {  # made before the console lists them
        "markdown": console.agent(python_model("says", text=MARKDOWN, chunk=7)),
        "hostile": console.agent(python_model("says", text=HOSTILE)),
        "tool": console.agent(python_model("tool_then_answer", tool="clock"), tools=["clock"]),
        "flaky": console.agent(python_model("failing", status=503, times=1, record=str(tmp_path / "flaky.jsonl"))),
        "failing": console.agent(python_model("failing", status=400)),
        "asking": console.agent(python_model("ask_then_answer", question="Which colour?"), tools=["ask_human"]),
        "slow": console.agent({"provider": "offline", "name": "chat", "options": {"delay_ms": 60, "repeat": 20}}),
    }
    page = open_console(browser, console, viewport)
    assert_fits(page)
    chat = page.locator("#chat .turn")

    # markdown: bold, a table, a fenced code block with its copy button, a list, a safe link
    page.select_option("#agent", agents["markdown"])
    send(page, "explain it with markdown")
    ended(page, 1)
    answer = chat.nth(0).locator(".answer")
    expect(answer.locator("strong")).to_have_text("What")
    expect(answer.locator("em")).to_have_text("short")
    expect(answer.locator("table th")).to_have_text(["part", "tokens"])
    expect(answer.locator("table td")).to_have_text(["query", "12", "answer", "30"])
    expect(answer.locator(".codeblock pre code")).to_have_text('print("hello")')
    expect(answer.locator("li")).to_have_text(["first point", "second point"])
    link = answer.locator("a")
    expect(link).to_have_attribute("href", "https://example.com/docs")
    expect(link).to_have_attribute("rel", "noopener noreferrer")
    expect(link).to_have_attribute("target", "_blank")
    copy = answer.locator(".codeblock .copy")
    copy.click()
    expect(copy).to_have_text("Copied")
    assert page.evaluate("navigator.clipboard.readText()") == 'print("hello")'
    expect(chat.nth(0).locator(".bubble.you time")).not_to_be_empty()
    assert_fits(page)

    # the stage timeline: one entry per stage the turn's events name, with its wait and run time
    cid = page.locator("#conversation").input_value()
    first = conversation(console, cid)[0]
    stage_names = [e.stage for e in all_events(console.client, first["turn_id"]) if isinstance(e, ev.StageEvent)]
    timeline = chat.nth(0).locator(".activity .timeline .stage")
    expect(timeline).to_have_count(len(set(stage_names)))
    assert [s.get_attribute("data-stage") for s in timeline.all()] == list(dict.fromkeys(stage_names))
    for entry in timeline.all():
        assert float(entry.get_attribute("data-run-ms") or "nan") >= 0
        assert float(entry.get_attribute("data-wait-ms") or "nan") >= 0
    if not phone:
        screenshot(page, tmp_path, "console-chat.png")

    # reload: the URL names the conversation, which opens again (the key is in the tab's session)
    assert f"c={cid}" in page.url and console.key not in page.url
    page.reload()
    expect(page.locator("#conversation")).to_have_value(cid)
    expect(chat.nth(0).locator(".answer strong")).to_have_text("What")
    # and the link, shared: another tab (no key in its session yet) opens it once connected
    shared = open_console(browser, console, viewport, link=f"/#c={cid}")
    expect(shared.locator("#conversation")).to_have_value(cid)
    expect(shared.locator("#chat .turn .answer strong")).to_have_text("What")
    shared.context.close()

    # regenerate twice: three siblings, and the switcher moves between them
    for n in (2, 3):
        chat.nth(0).locator(".regenerate").click()
        ended(page, 1)
        expect(chat.nth(0).locator(".siblings .position")).to_have_text(f"{n} / {n}")
    chat.nth(0).locator(".siblings .prev").click()
    expect(chat.nth(0).locator(".siblings .position")).to_have_text("2 / 3")
    ids = [m["id"] for m in sorted(conversation(console, cid), key=lambda m: m["created_at"])]
    expect(chat.nth(0)).to_have_attribute("data-message-id", ids[1])
    chat.nth(0).locator(".siblings .next").click()
    expect(chat.nth(0).locator(".siblings .position")).to_have_text("3 / 3")
    assert_fits(page)
    if phone:  # the tree, folded under the chat, unfolds without pushing the composer off the screen
        expect(page.locator("#tree")).to_be_hidden()
        page.click("#tree-pane > summary")
        expect(page.locator("#tree .node")).to_have_count(3)
        assert_fits(page)
        page.click("#tree-pane > summary")

    # delete the conversation (confirmed): gone from the list and from storage
    page.once("dialog", lambda dialog: dialog.accept())
    page.click("#delete")
    expect(page.locator("#status")).to_contain_text("deleted the conversation")
    expect(page.locator(f'#conversation option[value="{cid}"]')).to_have_count(0)
    assert console.client.conversation(cid) is None and "c=" not in page.url

    # hostile text stays text: no element it spells is made, no script it carries runs
    new_conversation(page, agents["hostile"])
    send(page, "be hostile")
    ended(page, 1)
    answer = chat.nth(0).locator(".answer")
    expect(answer).to_contain_text('<img src=x onerror="window.owned=1">')
    expect(answer).to_contain_text("<script>window.owned=2</script>")
    expect(answer.locator("strong")).to_have_text("<b>bold</b>")
    expect(answer.locator("code")).to_have_text("<i>code</i>")
    assert answer.locator("img, script, b, i, a").count() == 0 and page.locator("#chat img, #chat script").count() == 0
    assert page.evaluate("window.owned") is None

    # a tool call with its arguments and its result
    new_conversation(page, agents["tool"])
    send(page, "what time is it?")
    ended(page, 1)
    tool = chat.nth(0).locator('.activity .tool[data-tool="clock"]')
    expect(tool).to_contain_text("clock")
    expect(tool.locator(".tool-result")).not_to_be_empty()
    stored_tool = conversation(console, page.locator("#conversation").input_value())[0]["tools"][0]
    expect(tool.locator(".tool-result")).to_contain_text(str(stored_tool["content"])[:10])
    expect(chat.nth(0).locator(".answer")).to_contain_text("The tool said:")

    # a retry with its reason (the model is unavailable once)
    new_conversation(page, agents["flaky"])
    send(page, "try again")
    ended(page, 1)
    expect(chat.nth(0).locator(".activity .retry")).to_contain_text("model_unavailable")
    expect(chat.nth(0).locator(".answer")).to_have_text("recovered after failures")

    # an error says what went wrong inside its bubble
    new_conversation(page, agents["failing"])
    send(page, "this fails")
    ended(page, 1)
    failed_id = chat.nth(0).get_attribute("data-message-id") or ""
    terminal = console.client.terminal(failed_id)
    assert isinstance(terminal, ev.Failed) and terminal.message
    expect(chat.nth(0).locator(".bubble.agent .error-text")).to_have_text(f"model_bad_request: {terminal.message}")
    assert_fits(page)

    # a turn paused on ask_human, answered from the form
    new_conversation(page, agents["asking"])
    send(page, "pick a colour for me")
    ended(page, 1)
    form = chat.nth(0).locator("form.ask")
    expect(form).to_contain_text("Which colour?")
    assert_fits(page)
    if not phone:
        screenshot(page, tmp_path, "console-ask.png")
    form.locator(".ask-answer").fill("blue")
    form.locator(".ask-send").click()
    ended(page, 2)
    expect(chat.nth(1).locator(".answer")).to_have_text("You answered: blue")
    expect(page.locator("#chat form.ask")).to_have_count(0)

    # Stop: the streaming answer ends cancelled, its bubble says so
    new_conversation(page, agents["slow"])
    send(page, "tell me everything")
    expect(page.locator("#chat .turn.live .answer")).to_contain_text("You said")
    assert_fits(page)
    page.click("#stop")
    ended(page, 1)
    expect(chat.nth(0)).to_have_attribute("data-status", "cancelled")
    expect(chat.nth(0).locator(".error-text")).to_contain_text("stopped in the console")
    assert_fits(page)
    if phone:
        screenshot(page, tmp_path, "console-phone.png")


# --- the markdown renderer, case by case (in the page: the code the console runs) -----------------

RENDERED = [
    ("plain *and* **strong**", '<p>plain <em>and</em> <strong>strong</strong></p>'),
    ("a_b_c stays", "<p>a_b_c stays</p>"),
    ("1. one\n2. two", "<ol><li>one</li><li>two</li></ol>"),
    ("[x](http://a.example/?q=<b>)", '<p><a href="http://a.example/?q=%3Cb%3E" target="_blank" '
                                     'rel="noopener noreferrer">x</a></p>'),
    ("[x](data:text/html,<script>)", "<p>[x](data:text/html,&lt;script&gt;)</p>"),
    ("[x](/relative)", "<p>[x](/relative)</p>"),
    ("<b onclick=alert(1)>", "<p>&lt;b onclick=alert(1)&gt;</p>"),
    ("```\n<script>", '<div class="codeblock"><button type="button" class="copy" title="Copy the code">'
                        "Copy</button><pre><code>&lt;script&gt;</code></pre></div>"),
    ("# Title", "<h3>Title</h3>"),
    ("> quoted **bit**", "<blockquote><p>quoted <strong>bit</strong></p></blockquote>"),
]


def test_the_markdown_renderer_builds_only_its_whitelist(console: Console, browser: Any) -> None:
    page = open_console(browser, console, DESKTOP)
    rendered = page.evaluate("""(cases) => cases.map((text) => {
        const box = document.createElement("div");
        box.append(...renderMarkdown(text));
        return box.innerHTML;
    })""", [text for text, _ in RENDERED])
    assert rendered == [html for _, html in RENDERED]
