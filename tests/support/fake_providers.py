"""Test doubles of the hosted model providers' HTTP APIs, one wire format per server.

Each `FakeProvider` speaks one provider's format well enough for pydantic-ai's model class and the
provider's own SDK to complete a turn, streamed and not: OpenAI chat completions (server-sent
events), Anthropic Messages (named SSE events), Gemini `generateContent` / `streamGenerateContent`,
AWS Bedrock `Converse` / `ConverseStream` (the binary event-stream framing), Groq (OpenAI-like under
`/openai/v1`) and Mistral. It answers a fixed text ("hello from <provider>") with token usage, and
records every exchange — method, path, headers, JSON body — so a test can assert what went over the
wire, and which key went with it (pydantic-ai's Anthropic model streams even a request that is not
streamed; the others ask for a plain answer then). `always_status=429` answers every request with that status, a
`Retry-After` header and an error body in the provider's format.

Anthropic, Gemini and Bedrock also serve their token count endpoints (`count_tokens`, `countTokens`,
`CountTokens`), counting with `request_tokens`: a crude tokenizer (words and punctuation marks) over
every text of the request, plus 3 tokens per request and per message. A test counts the requests the
model was sent with the same function. `count_status` answers only the count endpoint with a status,
`count_delay_s` after a pause.

`caching=True` makes the Anthropic and OpenAI doubles cache prompts the way their providers document
(`PromptCache`), and report the reads and writes in their usage, with the request's real size (by
`text_tokens`) instead of the constant `INPUT_TOKENS`: Anthropic reads the longest prefix cached at a
breakpoint (`cache_control`, or the top-level automatic one on the last block), looking back up to 20
blocks from each breakpoint, writes at every breakpoint of at least 1,024 tokens, and keeps an entry
5 minutes (or `ttl: 1h`) from its last use; OpenAI caches any prompt of 1,024 tokens or more
automatically and reads the longest common prefix with an earlier request in 128-token steps.
`tool_call` (Anthropic) names the tool a request is answered with a call of, by its body: a
conversation with tool calls, as `bench.prompt_caching --workers` runs.

    with FakeProvider("anthropic") as server:
        ...  # point a model at server.base_url; then look at server.exchanges
"""

from __future__ import annotations

import binascii
import hashlib
import json
import re
import struct
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler
from typing import Any, Literal

from tests.support.local_http import LocalServer

ProviderName = Literal["openai", "anthropic", "google", "bedrock", "groq", "mistral"]

#: The usage every answer reports, in each format's own field names.
INPUT_TOKENS = 10
OUTPUT_TOKENS = 5


@dataclass(frozen=True, slots=True)
class Exchange:
    """One request and the status it was answered with; header names are lower-cased."""

    method: str
    path: str
    headers: dict[str, str]
    body: dict[str, Any]
    status: int
    #: Whether the request asked for a streamed answer (None: not a route this double serves).
    streamed: bool | None
    #: The operation served ("count" for a token count), None: not a route this double serves.
    route: str | None = None

    @property
    def credential(self) -> str | None:
        """The key the request carried, whichever way its provider sends it: a bearer token, an
        `x-api-key` / `x-goog-api-key` header, or the access key id of an AWS SigV4 signature."""
        authorization = self.headers.get("authorization", "")
        if authorization.startswith("Bearer "):
            return authorization.removeprefix("Bearer ")
        if match := _SIGV4_CREDENTIAL.search(authorization):
            return match.group(1)
        return self.headers.get("x-api-key") or self.headers.get("x-goog-api-key")


_SIGV4_CREDENTIAL = re.compile(r"^AWS4-HMAC-SHA256 Credential=([^/]+)/")


def answer_text(provider: ProviderName) -> str:
    return f"hello from {provider}"


class FakeProvider(LocalServer):
    """One provider's API on 127.0.0.1 and a free port, in a background thread."""

    def __init__(
        self, provider: ProviderName, *, always_status: int | None = None, retry_after: str = "0",
        model: str = "fake-model", count_status: int | None = None, count_delay_s: float = 0.0,
        caching: bool = False, tool_call: Callable[[dict[str, Any]], str | None] | None = None,
    ) -> None:
        self.provider = provider
        #: Anthropic: the tool a request is answered with a call of (no arguments), instead of the
        #: text; None (or a None answer): the text.
        self.tool_call = tool_call
        self.always_status = always_status
        self.count_status = count_status
        self.count_delay_s = count_delay_s
        self.retry_after = retry_after
        self.model = model
        self.text = answer_text(provider)
        self.cache = PromptCache() if caching else None
        #: The usage of each answered request, in arrival order (what the cache made of it).
        self.usages: list[dict[str, int]] = []
        self._exchanges: list[Exchange] = []
        self._lock = threading.Lock()
        super().__init__(_handler_for(self), name=f"fake-{provider}")

    @property
    def base_url(self) -> str:
        """What a config's `model.base_url` says: the SDKs other than OpenAI's add their own path."""
        return f"{self.url}/v1" if self.provider == "openai" else self.url

    @property
    def exchanges(self) -> list[Exchange]:
        """Every request received, in arrival order."""
        with self._lock:
            return list(self._exchanges)

    def record(self, exchange: Exchange) -> None:
        with self._lock:
            self._exchanges.append(exchange)

    def note_usage(self, usage: dict[str, int]) -> None:
        with self._lock:
            self.usages.append(usage)


# --- which request is which -----------------------------------------------------------------------

Operation = Literal["chat", "anthropic", "gemini", "converse", "count"]


@dataclass(frozen=True, slots=True)
class Route:
    operation: Operation
    stream: bool


_GEMINI = re.compile(r"^/v1(beta|alpha)?/models/[^/:]+:(generateContent|streamGenerateContent|countTokens)$")
_CONVERSE = re.compile(r"^/model/[^/]+/(converse|converse-stream|count-tokens)$")
_COUNT_OPERATIONS = {"countTokens", "count-tokens"}
_CHAT_PATHS: dict[ProviderName, str] = {
    "openai": "/v1/chat/completions", "groq": "/openai/v1/chat/completions", "mistral": "/v1/chat/completions",
}


def route(provider: ProviderName, path: str, body: dict[str, Any]) -> Route | None:
    """The operation a request asks for in `provider`'s API, or None: not one this double serves."""
    path, _, _query = path.partition("?")
    if provider in _CHAT_PATHS:
        return Route("chat", bool(body.get("stream"))) if path == _CHAT_PATHS[provider] else None
    if provider == "anthropic":
        if path == "/v1/messages/count_tokens":
            return Route("count", False)
        return Route("anthropic", bool(body.get("stream"))) if path == "/v1/messages" else None
    if provider == "google":
        match = _GEMINI.match(path)
        if match and match.group(2) in _COUNT_OPERATIONS:
            return Route("count", False)
        return Route("gemini", match.group(2) == "streamGenerateContent") if match else None
    match = _CONVERSE.match(path)
    if match and match.group(1) in _COUNT_OPERATIONS:
        return Route("count", False)
    return Route("converse", match.group(1) == "converse-stream") if match else None


# --- token counts ---------------------------------------------------------------------------------

_TOKEN = re.compile(r"\w+|[^\w\s]")
#: Keys whose values are structure, not text the model reads.
_STRUCTURAL = frozenset({"role", "type", "model", "modelId", "id", "tool_use_id", "toolUseId", "stream",
                         "cache_control", "max_tokens", "anthropic_version"})


def text_tokens(text: str) -> int:
    """The fake tokenizer: one token per word and per punctuation mark."""
    return len(_TOKEN.findall(text))


def request_tokens(body: Any) -> int:
    """What a request costs by the fake's count: 3, plus 3 per message, plus every text's tokens (the
    same function counts a count request and the request a model was sent, in each wire format)."""
    return 3 + _tokens(body)


def _tokens(value: Any, key: str = "") -> int:
    if isinstance(value, str):
        return 0 if key in _STRUCTURAL else text_tokens(value)
    if isinstance(value, dict):
        return sum(_tokens(v, k) for k, v in value.items())
    if isinstance(value, list):
        per_message = 3 if key in ("messages", "contents") else 0
        return sum(per_message + _tokens(v, key) for v in value)
    return 0


def count_answer(provider: ProviderName, body: dict[str, Any]) -> dict[str, Any]:
    """A count endpoint's answer, in `provider`'s format."""
    n = request_tokens(body)
    if provider == "anthropic":
        return {"input_tokens": n}
    if provider == "google":
        return {"totalTokens": n}
    return {"inputTokens": n}


# --- prompt caching ---------------------------------------------------------------------------------

#: A request's size and what the cache made of it: {"input": all its tokens, "read", "write"}; None:
#: the double does not cache (its usage is the constant `INPUT_TOKENS`).
Usage = dict[str, int] | None
#: Anthropic: the shortest prefix cached, how far back from a breakpoint a hit is looked for, the TTLs.
ANTHROPIC_MIN_TOKENS, ANTHROPIC_LOOKBACK_BLOCKS = 1024, 20
ANTHROPIC_TTL_S = {"5m": 300.0, "1h": 3600.0}
#: OpenAI: cached from this many prompt tokens, in steps of this many; entries live 5 to 10 minutes.
OPENAI_MIN_TOKENS, OPENAI_STEP, OPENAI_TTL_S = 1024, 128, 300.0


def _token_list(value: Any, key: str = "") -> list[str]:
    """The fake tokenizer's tokens of every text in `value`, in order (as `_tokens` counts them)."""
    if isinstance(value, str):
        return [] if key in _STRUCTURAL else _TOKEN.findall(value)
    if isinstance(value, dict):  # a breakpoint is no text: a block reads the same with or without one
        return [t for k, v in value.items() if k != "cache_control" for t in _token_list(v, k)]
    if isinstance(value, list):
        return [t for v in value for t in _token_list(v, key)]
    return []


def _anthropic_blocks(body: dict[str, Any]) -> list[tuple[list[str], str | None]]:
    """A Messages request as Anthropic caches it, tools, then system, then messages: each block's
    tokens and its breakpoint's TTL (None: no `cache_control`); the top-level `cache_control`
    (automatic caching) is a breakpoint on the last block."""
    def ttl(block: Any) -> str | None:
        control = block.get("cache_control") if isinstance(block, dict) else None
        return str(control.get("ttl") or "5m") if isinstance(control, dict) else None

    blocks: list[tuple[list[str], str | None]] = [(_token_list(t), ttl(t)) for t in body.get("tools") or []]
    system = body.get("system") or []
    for block in [{"type": "text", "text": system}] if isinstance(system, str) else system:
        blocks.append((_token_list(block), ttl(block)))
    for message in body.get("messages") or []:
        content = message.get("content")
        for i, block in enumerate([{"type": "text", "text": content}] if isinstance(content, str) else content):
            blocks.append((["<msg>"] * 3 * (i == 0) + _token_list(block), ttl(block)))
    if blocks and (top := ttl(body)) is not None:
        blocks[-1] = (blocks[-1][0], top)
    return blocks


class PromptCache:
    """A provider's prompt cache: entries by the hash of a prefix, with their expiry."""

    def __init__(self, clock: Any = time.monotonic) -> None:
        self.clock = clock
        self._entries: dict[bytes, float] = {}
        self._openai: list[tuple[str, list[str], float]] = []
        self._lock = threading.Lock()

    def anthropic(self, body: dict[str, Any]) -> dict[str, int]:
        blocks = _anthropic_blocks(body)
        ends, hashes, digest, total = [], [], hashlib.sha256(), 0
        for tokens, _ in blocks:
            digest.update("\x00".join(tokens).encode() + b"\x01")
            total += len(tokens)
            ends.append(total)
            hashes.append(digest.copy().digest())
        now, read, write_end = self.clock(), 0, 0
        with self._lock:
            breakpoints = [i for i, (_, ttl) in enumerate(blocks) if ttl is not None]
            for b in breakpoints:
                for i in range(b, max(-1, b - ANTHROPIC_LOOKBACK_BLOCKS - 1), -1):
                    if self._entries.get(hashes[i], 0.0) > now:
                        read = max(read, ends[i])
                        self._entries[hashes[i]] = now + ANTHROPIC_TTL_S.get(blocks[b][1] or "5m", 300.0)
                        break
            for b in breakpoints:
                if ends[b] >= ANTHROPIC_MIN_TOKENS and ends[b] > read:
                    self._entries[hashes[b]] = now + ANTHROPIC_TTL_S.get(blocks[b][1] or "5m", 300.0)
                    write_end = max(write_end, ends[b])
        # the fake's whole count of the request (`request_tokens`), of which the cache took its share
        size = max(request_tokens(body), total)
        return {"input": size, "read": read, "write": max(0, write_end - read)}

    def openai(self, body: dict[str, Any]) -> dict[str, int]:
        tokens = _token_list(body.get("tools") or []) + _token_list(body.get("messages") or [])
        key = str(body.get("prompt_cache_key") or "")
        now, best = self.clock(), 0
        with self._lock:
            self._openai = [e for e in self._openai if e[2] > now]
            # the key routes a request to the machine that holds its prefix: others are not looked at
            for _, earlier, _ in (e for e in self._openai if e[0] == key):
                common = next((i for i, (a, b) in enumerate(zip(tokens, earlier, strict=False)) if a != b),
                              min(len(tokens), len(earlier)))
                best = max(best, common)
            if len(tokens) >= OPENAI_MIN_TOKENS:
                self._openai.append((key, tokens, now + OPENAI_TTL_S))
        steps = (best - OPENAI_MIN_TOKENS) // OPENAI_STEP
        read = OPENAI_MIN_TOKENS + steps * OPENAI_STEP if best >= OPENAI_MIN_TOKENS else 0
        return {"input": max(request_tokens(body), len(tokens)), "read": read, "write": 0}


def _usage(server: FakeProvider, operation: Operation, body: dict[str, Any]) -> Usage:
    if server.cache is None or operation not in ("anthropic", "chat"):
        return None
    usage = server.cache.anthropic(body) if operation == "anthropic" else server.cache.openai(body)
    server.note_usage(usage)
    return usage


# --- the HTTP handler -----------------------------------------------------------------------------


def _handler_for(server: FakeProvider) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        # headers and body go out in two writes: without TCP_NODELAY the body waits for the client's
        # delayed ACK of the headers (~40 ms a request)
        disable_nagle_algorithm = True

        def do_POST(self) -> None:
            # every method is recorded (a test asserting that nothing was sent must see a stray GET
            # too); only POST routes are served
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length)
            try:
                body = json.loads(raw or b"{}")
            except json.JSONDecodeError:
                body = {"_raw": raw.decode(errors="replace")}
            found = route(server.provider, self.path, body) if self.command == "POST" else None
            status = _status(server, found)
            headers = {k.lower(): v for k, v in self.headers.items()}
            streamed = found.stream if found else None
            server.record(Exchange(self.command, self.path, headers, body, int(status), streamed,
                                   found.operation if found else None))
            if status != HTTPStatus.OK or found is None:
                self._error(int(status))
            elif found.operation == "count":
                time.sleep(server.count_delay_s)
                self._json(HTTPStatus.OK, count_answer(server.provider, body))
            elif found.stream:
                self._stream(found.operation, _usage(server, found.operation, body), _tool(server, found, body))
            else:
                self._json(HTTPStatus.OK, _complete(found.operation, server, _usage(server, found.operation, body),
                                                    _tool(server, found, body)))

        do_GET = do_PUT = do_DELETE = do_POST

        def _error(self, status: int) -> None:
            extra = {"Retry-After": server.retry_after} if status == 429 else {}
            if server.provider == "bedrock":
                # botocore reads the error code from this header on REST-JSON services
                extra["x-amzn-ErrorType"] = _BEDROCK_ERRORS.get(status, "ValidationException")
            self._json(status, _error_body(server.provider, status, f"fake {server.provider}: HTTP {status}"),
                       extra)

        def _json(self, status: int, payload: dict[str, Any], extra: dict[str, str] | None = None) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for name, value in (extra or {}).items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(data)

        def _stream(self, operation: Operation, usage: Usage, tool: str | None) -> None:
            # No Content-Length: the stream ends when the connection closes.
            binary = operation == "converse"
            self.send_response(HTTPStatus.OK)
            self.send_header("Content-Type", "application/vnd.amazon.eventstream" if binary else "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Connection", "close")
            self.end_headers()
            for frame in _stream_frames(operation, server, usage, tool):
                self.wfile.write(frame)
            self.wfile.flush()
            self.close_connection = True

        def log_message(self, format: str, *args: Any) -> None:
            pass  # pytest output stays readable; `server.exchanges` is the log

    return Handler


def _status(server: FakeProvider, found: Route | None) -> int:
    if found is not None and found.operation == "count" and server.count_status:
        return server.count_status
    return server.always_status or (HTTPStatus.OK if found else HTTPStatus.NOT_FOUND)


def _tool(server: FakeProvider, found: Route, body: dict[str, Any]) -> str | None:
    return server.tool_call(body) if server.tool_call is not None and found.operation == "anthropic" else None


def _complete(operation: Operation, server: FakeProvider, usage: Usage, tool: str | None) -> dict[str, Any]:
    if operation == "chat":
        return _chat_completion(server, usage)
    if operation == "anthropic":
        return _anthropic_message(server, usage, tool)
    if operation == "gemini":
        return _gemini_chunk(server, server.text, finish=True)
    return _converse(server)


def _stream_frames(operation: Operation, server: FakeProvider, usage: Usage, tool: str | None) -> Iterator[bytes]:
    if operation == "chat":
        for chunk in _chat_chunks(server, usage):
            yield f"data: {json.dumps(chunk)}\n\n".encode()
        yield b"data: [DONE]\n\n"
    elif operation == "anthropic":
        for event in _anthropic_events(server, usage, tool):
            yield f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode()
    elif operation == "gemini":
        pieces = _words(server.text)
        for i, piece in enumerate(pieces):
            yield f"data: {json.dumps(_gemini_chunk(server, piece, finish=i == len(pieces) - 1))}\r\n\r\n".encode()
    else:
        for event_type, payload in _converse_events(server):
            yield event_message(event_type, payload)


def _words(text: str) -> list[str]:
    """`text` in word-sized pieces, as a real server streams it."""
    words = text.split(" ")
    return [w if i == len(words) - 1 else w + " " for i, w in enumerate(words)]


# --- error bodies ---------------------------------------------------------------------------------

_BEDROCK_ERRORS = {400: "ValidationException", 403: "AccessDeniedException", 429: "ThrottlingException",
                   500: "InternalServerException", 503: "ServiceUnavailableException"}
_GOOGLE_STATUS = {400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 403: "PERMISSION_DENIED", 404: "NOT_FOUND",
                  429: "RESOURCE_EXHAUSTED", 500: "INTERNAL", 503: "UNAVAILABLE"}


def _error_body(provider: ProviderName, status: int, message: str) -> dict[str, Any]:
    if provider == "anthropic":
        kind = "rate_limit_error" if status == 429 else "api_error"
        return {"type": "error", "error": {"type": kind, "message": message}}
    if provider == "google":
        return {"error": {"code": status, "message": message, "status": _GOOGLE_STATUS.get(status, "UNKNOWN")}}
    if provider == "bedrock":
        return {"message": message}
    if provider == "mistral":
        return {"object": "error", "message": message, "type": "rate_limited" if status == 429 else "error",
                "param": None, "code": str(status)}
    kind = "rate_limit_exceeded" if status == 429 else "server_error"
    return {"error": {"message": message, "type": kind, "param": None, "code": kind}}


# --- OpenAI chat completions (OpenAI, Groq, Mistral) -----------------------------------------------

_CHAT_USAGE = {"prompt_tokens": INPUT_TOKENS, "completion_tokens": OUTPUT_TOKENS,
               "total_tokens": INPUT_TOKENS + OUTPUT_TOKENS}


def _chat_usage(usage: Usage) -> dict[str, Any]:
    if usage is None:
        return _CHAT_USAGE
    return {"prompt_tokens": usage["input"], "completion_tokens": OUTPUT_TOKENS,
            "total_tokens": usage["input"] + OUTPUT_TOKENS, "prompt_tokens_details": {"cached_tokens": usage["read"]}}


def _chat_completion(server: FakeProvider, usage: Usage = None) -> dict[str, Any]:
    choice = {"index": 0, "message": {"role": "assistant", "content": server.text}, "finish_reason": "stop"}
    return {"id": "chatcmpl-fake", "object": "chat.completion", "created": 0, "model": server.model,
            "choices": [choice], "usage": _chat_usage(usage)}


def _chat_chunks(server: FakeProvider, usage: Usage = None) -> Iterator[dict[str, Any]]:
    def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": 0, "model": server.model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}

    yield chunk({"role": "assistant", "content": ""})
    for word in _words(server.text):
        yield chunk({"content": word})
    last = chunk({}, "stop")
    if server.provider == "groq":
        last["x_groq"] = {"id": "req-fake", "usage": _CHAT_USAGE}  # where Groq reports a stream's usage
    else:
        last["usage"] = _chat_usage(usage)
    yield last


# --- Anthropic Messages ---------------------------------------------------------------------------


def _anthropic_usage(usage: Usage, output_tokens: int) -> dict[str, int]:
    if usage is None:
        return {"input_tokens": INPUT_TOKENS, "output_tokens": output_tokens}
    # Anthropic's `input_tokens` are those after the last breakpoint: neither read nor written
    return {"input_tokens": usage["input"] - usage["read"] - usage["write"], "output_tokens": output_tokens,
            "cache_read_input_tokens": usage["read"], "cache_creation_input_tokens": usage["write"]}


def _tool_use(tool: str) -> dict[str, Any]:
    return {"type": "tool_use", "id": f"toolu_fake_{uuid.uuid4().hex[:12]}", "name": tool, "input": {}}


def _anthropic_message(server: FakeProvider, usage: Usage = None, tool: str | None = None) -> dict[str, Any]:
    content = [_tool_use(tool)] if tool else [{"type": "text", "text": server.text}]
    return {"id": "msg_fake", "type": "message", "role": "assistant", "model": server.model, "content": content,
            "stop_reason": "tool_use" if tool else "end_turn", "stop_sequence": None,
            "usage": _anthropic_usage(usage, OUTPUT_TOKENS)}


def _anthropic_events(server: FakeProvider, usage: Usage = None, tool: str | None = None) -> Iterator[dict[str, Any]]:
    start = {**_anthropic_message(server), "content": [], "stop_reason": None,
             "usage": _anthropic_usage(usage, 1)}
    yield {"type": "message_start", "message": start}
    if tool:
        yield {"type": "content_block_start", "index": 0, "content_block": _tool_use(tool)}
        yield {"type": "content_block_delta", "index": 0, "delta": {"type": "input_json_delta", "partial_json": "{}"}}
    else:
        yield {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
        for word in _words(server.text):
            yield {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": word}}
    yield {"type": "content_block_stop", "index": 0}
    yield {"type": "message_delta", "delta": {"stop_reason": "tool_use" if tool else "end_turn", "stop_sequence": None},
           "usage": {"output_tokens": OUTPUT_TOKENS}}
    yield {"type": "message_stop"}


# --- Gemini generateContent -----------------------------------------------------------------------


def _gemini_chunk(server: FakeProvider, text: str, *, finish: bool) -> dict[str, Any]:
    candidate: dict[str, Any] = {"content": {"role": "model", "parts": [{"text": text}]}, "index": 0}
    if finish:
        candidate["finishReason"] = "STOP"
    return {"candidates": [candidate], "modelVersion": server.model, "responseId": "fake-response",
            "usageMetadata": {"promptTokenCount": INPUT_TOKENS, "candidatesTokenCount": OUTPUT_TOKENS,
                              "totalTokenCount": INPUT_TOKENS + OUTPUT_TOKENS}}


# --- Bedrock Converse -----------------------------------------------------------------------------

_CONVERSE_USAGE = {"inputTokens": INPUT_TOKENS, "outputTokens": OUTPUT_TOKENS,
                   "totalTokens": INPUT_TOKENS + OUTPUT_TOKENS}


def _converse(server: FakeProvider) -> dict[str, Any]:
    return {"output": {"message": {"role": "assistant", "content": [{"text": server.text}]}},
            "stopReason": "end_turn", "usage": _CONVERSE_USAGE, "metrics": {"latencyMs": 1}}


def _converse_events(server: FakeProvider) -> Iterator[tuple[str, dict[str, Any]]]:
    yield "messageStart", {"role": "assistant"}
    for word in _words(server.text):
        yield "contentBlockDelta", {"contentBlockIndex": 0, "delta": {"text": word}}
    yield "contentBlockStop", {"contentBlockIndex": 0}
    yield "messageStop", {"stopReason": "end_turn"}
    yield "metadata", {"usage": _CONVERSE_USAGE, "metrics": {"latencyMs": 1}}


def event_message(event_type: str, payload: dict[str, Any]) -> bytes:
    """One message of the AWS event-stream framing: a prelude (total length, headers length, CRC32 of
    the two), the headers (string-valued here), the JSON payload, and a CRC32 of everything before it."""
    headers = b"".join(_string_header(name, value) for name, value in (
        (":event-type", event_type), (":content-type", "application/json"), (":message-type", "event")))
    data = json.dumps(payload).encode()
    total = 4 + 4 + 4 + len(headers) + len(data) + 4
    prelude = struct.pack(">II", total, len(headers))
    prelude += struct.pack(">I", binascii.crc32(prelude))
    message = prelude + headers + data
    return message + struct.pack(">I", binascii.crc32(message))


_STRING_HEADER = 7  # the event-stream header value type for a UTF-8 string


def _string_header(name: str, value: str) -> bytes:
    encoded_name, encoded_value = name.encode(), value.encode()
    return (struct.pack(">B", len(encoded_name)) + encoded_name + struct.pack(">BH", _STRING_HEADER, len(encoded_value))
            + encoded_value)
