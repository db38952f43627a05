"""Files of earlier turns: checked in one batch of HEAD requests (`workers/worker/files.py`), missing ones left
out of the history and recorded, images of the newest turn sent natively to a vision model and older
ones replayed as references — against a local file server and the strict OpenAI-compatible double."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from typing import Any

import pytest

from tests.conftest import AgentFactory, WorkerPool, turn
from tests.support.local_http import LocalServer
from tests.support.strict_server import StrictChatServer
from threadline.pipeline import events as ev
from threadline.pipeline.history import FileCheck
from threadline.workers.clients.client import Client
from threadline.workers.worker.files import check_files

IMAGE = b"\x89PNG\r\n\x1a\n" + b"\x00" * 1000


class FileServer(LocalServer):
    """Serves `/cat.png` (an image of 1,008 bytes); 404 for every other path. Counts HEAD requests."""

    def __init__(self) -> None:
        self.heads: list[str] = []
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_HEAD(self) -> None:
                with server._lock:
                    server.heads.append(self.path)
                if self.path == "/cat.png":
                    self.send_response(200)
                    self.send_header("Content-Type", "image/png")
                    self.send_header("Content-Length", str(len(IMAGE)))
                else:
                    self.send_response(404)
                    self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        super().__init__(Handler, name="file-server")


@pytest.fixture
def files() -> Iterator[FileServer]:
    with FileServer() as server:
        yield server


async def test_one_batch_says_which_files_are_there_and_remembers_the_answers(files: FileServer) -> None:
    cat, gone, refused = f"{files.url}/cat.png", f"{files.url}/gone.png", "http://127.0.0.1:9/x.png"
    found = await check_files([cat, gone, refused, cat, "data:image/png;base64,AAAA", "s3://bucket/x.png"],
                              mode="all", timeout_s=1.0)
    assert found == {cat: FileCheck("available", len(IMAGE)), gone: FileCheck("missing"),
                     refused: FileCheck("unknown")}
    assert sorted(files.heads) == ["/cat.png", "/gone.png"]  # once each: the duplicate was asked once
    again = await check_files([cat, gone], mode="all", timeout_s=1.0)
    assert again == {cat: FileCheck("available", len(IMAGE)), gone: FileCheck("missing")}
    assert len(files.heads) == 2  # remembered: not asked again


async def test_by_default_no_file_check_reaches_the_workers_own_network(files: FileServer) -> None:
    """User URLs naming loopback, private or link-local hosts (the cloud metadata service) are never
    asked (server-side request forgery): their files stay unknown and are replayed as references."""
    urls = [f"{files.url}/cat.png", "http://169.254.169.254/latest/meta-data/", "http://10.0.0.1/x.png",
            "http://localhost:9/x.png"]
    assert await check_files(urls, timeout_s=1.0) == dict.fromkeys(urls, FileCheck("unknown"))
    assert await check_files(urls, mode="off") == {}
    assert files.heads == []


def test_history_replays_files_by_rule_and_records_the_missing_ones(
        workers: WorkerPool, client: Client, make_agent: AgentFactory, files: FileServer) -> None:
    cat, gone = f"{files.url}/cat.png", f"{files.url}/gone.png"
    with StrictChatServer() as server:
        agent = make_agent({**server.model_config(strict_system=True), "vision": True})
        attached = [{"type": "image", "url": cat, "mime": "image/png"}, {"type": "image", "url": gone}]
        conversation, decisions = None, []
        for query in ("Look at these.", "And now?", "Once more?"):
            fields: dict[str, Any] = {"files": attached} if query.startswith("Look") else {}
            terminal = client.wait(client.submit(turn(agent, query, conversation_id=conversation, **fields)),
                                   timeout_s=30)
            assert isinstance(terminal, ev.Succeeded), terminal
            conversation = terminal.conversation_id
            decisions.append(client.decisions(terminal.turn_id)["history"]["files"])
        first, second, third = (body["messages"] for body in server.requests)
    # turn 1 sends both images with its query (the current turn's files are not checked)
    assert [p.get("image_url", {}).get("url") for p in first[-1]["content"] if p["type"] == "image_url"] == [cat, gone]
    # turn 2: turn 1 is the newest history turn, its image goes natively; the missing one is left out
    history_prompt = second[-3]["content"]
    assert [p.get("image_url", {}).get("url") for p in history_prompt if p["type"] == "image_url"] == [cat]
    assert gone not in str(second)
    assert decisions[1] == {"kept": 1, "replayed_as_reference": 0, "missing": 1}
    # turn 3: turn 1 is older, its image is replayed as its reference (name, type, size), not sent again
    older_prompt = next(m for m in third if m["role"] == "user")["content"]
    assert "[file cat.png: image, image/png, 1,008 bytes]" in str(older_prompt) and "image_url" not in str(third)
    assert decisions[2] == {"kept": 0, "replayed_as_reference": 1, "missing": 1}
