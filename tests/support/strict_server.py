"""A test double of a strict OpenAI-compatible chat-completions server (vLLM serving Qwen 3.5/3.6).

It refuses what strict chat templates refuse — a system message anywhere but first, a blank system
message, no user message, a tool result without its call — with HTTP 400 and an OpenAI-style error
body, and otherwise answers with a scripted model: offered tools and a user message last → a call
to a tool (the first offered, or `tool_name`, with `tool_arguments`); a tool result last → a text
answer quoting it. Every request body is recorded, so a test can assert on exactly what went over
the wire. Streamed (`"stream": true`, server-sent events) and plain requests are both served.

    with StrictChatServer() as server:
        ...  # point a model at server.base_url; then look at server.requests
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler
from typing import Any

from tests.support.local_http import LocalServer

SYSTEM_NOT_FIRST = "System message must be at the beginning."
BLANK_SYSTEM = "System message content must not be empty."
NO_USER = "No user query found in messages."
ORPHAN_TOOL = "Tool message has no matching assistant tool call."


@dataclass(frozen=True, slots=True)
class Exchange:
    """One request and how it was answered (`error` is the 400 message, or None)."""

    body: dict[str, Any]
    status: int
    error: str | None


def message_text(message: dict[str, Any]) -> str:
    """A message's text, whether `content` is a string or a list of content parts."""
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content if isinstance(part, dict))


def template_error(messages: list[dict[str, Any]]) -> str | None:
    """Why a strict chat template would refuse `messages`, or None when it renders them."""
    for index, message in enumerate(messages):
        if message.get("role") == "system":
            if index != 0:
                return SYSTEM_NOT_FIRST
            if not message_text(message).strip():
                return BLANK_SYSTEM
    if not any(m.get("role") == "user" for m in messages):
        return NO_USER
    called: set[str] = set()
    for message in messages:
        if message.get("role") == "assistant":
            called.update(call["id"] for call in message.get("tool_calls") or [])
        elif message.get("role") == "tool" and message.get("tool_call_id") not in called:
            return ORPHAN_TOOL
    return None


@dataclass(frozen=True, slots=True)
class Reply:
    """What the scripted model says: text, or one tool call."""

    text: str = ""
    tool_name: str | None = None
    tool_call_id: str = ""
    arguments: str = "{}"

    @property
    def finish_reason(self) -> str:
        return "tool_calls" if self.tool_name else "stop"


class StrictChatServer(LocalServer):
    """`POST /v1/chat/completions` on 127.0.0.1 and a free port, in a background thread."""

    def __init__(
        self, *, tool_name: str | None = None, tool_arguments: str = "{}", model: str = "qwen3.6",
        tool_when: Callable[[str], bool] | None = None, text_for: Callable[[str], str] | None = None,
    ) -> None:
        """`tool_when(last user text)` says whether to call a tool (None: whenever tools are offered);
        `text_for(last user text)` is the text answer (None: "You said: ..." or "The tool said: ...")."""
        self.tool_name = tool_name
        self.tool_arguments = tool_arguments
        self.model = model
        self.tool_when = tool_when
        self.text_for = text_for
        self.exchanges: list[Exchange] = []
        self._lock = threading.Lock()
        self._calls = 0
        super().__init__(_handler_for(self), name="strict-chat-server")

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    @property
    def requests(self) -> list[dict[str, Any]]:
        """Every request body received, in arrival order (refused ones included)."""
        with self._lock:
            return [e.body for e in self.exchanges]

    def model_config(self, *, strict_system: bool) -> dict[str, Any]:
        """The agent config `model` section that points at this server."""
        return {"provider": "openai-compatible", "name": self.model, "base_url": self.base_url,
                "strict_system": strict_system}

    # --- the scripted model -----------------------------------------------------------------------

    def answer(self, body: dict[str, Any]) -> tuple[Reply | None, str | None]:
        """The reply to a request body, or the template error that refuses it; records both."""
        messages = body.get("messages") or []
        error = template_error(messages)
        with self._lock:
            self.exchanges.append(Exchange(body, 400 if error else 200, error))
            self._calls += 1
            call_id = f"call_{self._calls}"
        if error:
            return None, error
        return self._script(body, messages, call_id), None

    def _script(self, body: dict[str, Any], messages: list[dict[str, Any]], call_id: str) -> Reply:
        last = messages[-1]
        offered = [t["function"]["name"] for t in body.get("tools") or [] if t.get("type") == "function"]
        users = [message_text(m) for m in messages if m.get("role") == "user"]
        if last.get("role") == "user" and offered and (self.tool_when is None or self.tool_when(users[-1])):
            return Reply(tool_name=self.tool_name or offered[0], tool_call_id=call_id,
                         arguments=self.tool_arguments)
        if self.text_for is not None:
            return Reply(text=self.text_for(users[-1]))
        if last.get("role") == "tool":
            return Reply(text=f"The tool said: {message_text(last)}")
        return Reply(text=f"You said: {users[-1]}")


def _handler_for(server: StrictChatServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:
            if self.path.rstrip("/") != "/v1/chat/completions":
                self._json(HTTPStatus.NOT_FOUND, _error(f"no route {self.path}", "NotFoundError", 404))
                return
            length = int(self.headers.get("Content-Length") or 0)
            try:
                body = json.loads(self.rfile.read(length) or b"{}")
            except json.JSONDecodeError as e:
                self._json(HTTPStatus.BAD_REQUEST, _error(f"invalid JSON: {e}", "BadRequestError", 400))
                return
            reply, error = server.answer(body)
            if reply is None:
                self._json(HTTPStatus.BAD_REQUEST, _error(error or "", "BadRequestError", 400))
            elif body.get("stream"):
                self._stream(_chunks(reply, server.model))
            else:
                self._json(HTTPStatus.OK, _completion(reply, server.model))

        def _json(self, status: HTTPStatus, payload: dict[str, Any]) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _stream(self, chunks: Iterator[dict[str, Any]]) -> None:
            # No Content-Length: the stream ends when the connection closes after `[DONE]`.
            self.send_response(HTTPStatus.OK)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Connection", "close")
            self.end_headers()
            for chunk in chunks:
                self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
            self.close_connection = True

        def log_message(self, format: str, *args: Any) -> None:
            pass  # pytest output stays readable; `server.exchanges` is the log

    return Handler


def _error(message: str, kind: str, code: int) -> dict[str, Any]:
    # vLLM's shape, which the openai client also reads: the message under "error".
    return {"object": "error", "error": {"message": message, "type": kind, "param": None, "code": code},
            "message": message, "type": kind, "param": None, "code": code}


_USAGE = {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}


def _completion(reply: Reply, model: str) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": reply.text or None}
    if reply.tool_name:
        message["tool_calls"] = [{"id": reply.tool_call_id, "type": "function",
                                  "function": {"name": reply.tool_name, "arguments": reply.arguments}}]
    choice = {"index": 0, "message": message, "finish_reason": reply.finish_reason}
    return {"id": f"chatcmpl-{reply.tool_call_id or 'text'}", "object": "chat.completion", "created": 0,
            "model": model, "choices": [choice], "usage": _USAGE}


def _chunks(reply: Reply, model: str) -> Iterator[dict[str, Any]]:
    def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {"id": "chatcmpl-stream", "object": "chat.completion.chunk", "created": 0, "model": model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}

    yield chunk({"role": "assistant", "content": ""})
    if reply.tool_name:
        yield chunk({"tool_calls": [{"index": 0, "id": reply.tool_call_id, "type": "function",
                                     "function": {"name": reply.tool_name, "arguments": ""}}]})
        yield chunk({"tool_calls": [{"index": 0, "function": {"arguments": reply.arguments}}]})
    else:
        # word by word, as a real server streams
        words = reply.text.split(" ")
        for i, word in enumerate(words):
            yield chunk({"content": word if i == len(words) - 1 else word + " "})
    yield chunk({}, reply.finish_reason)
    yield {"id": "chatcmpl-stream", "object": "chat.completion.chunk", "created": 0, "model": model,
           "choices": [], "usage": _USAGE}
