"""Whether the files of a thread's earlier turns are still there: one batch of HEAD requests, in
parallel, with a short timeout, remembered per URL for a while (`pipeline.history.replay_files`
decides what the model gets from the answers).

A 2xx answer means the file is there (its Content-Length is its size); a 4xx one that it is
missing or expired, and the history leaves it out; anything else (a timeout, a refused connection,
a 5xx, a server that does not allow HEAD) leaves it unknown, and it is replayed as its reference.
Only `http` and `https` URLs are asked; `data:` URLs need no request.

The URLs come from users, so asking them is a request the workers make on a user's behalf
(server-side request forgery): `TL_FILE_CHECK=public` (the default) asks only hosts whose every
address is a global one — never loopback, private, link-local (cloud metadata) or reserved ones —
and follows no redirect; `all` asks any host (tests, trusted deployments); `off` asks nothing (every
earlier file is then replayed as its reference). A host that resolves differently between this check
and the connection (DNS rebinding) is a residual risk of `public`.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from typing import Literal
from urllib.parse import urlsplit

import httpx

from threadline.pipeline.history import FileCheck

#: The whole batch's time budget: the check is on the turn's critical path.
CHECK_TIMEOUT_S = 2.0
#: How long an answer (there or missing) is remembered per URL, per worker process.
CHECK_TTL_S = 300.0
#: At most this many URLs are asked per batch (the rest stay unknown), this many at once.
MAX_CHECKS = 64
CONCURRENCY = 16
_CACHE_SIZE = 4096

FileCheckMode = Literal["public", "all", "off"]

_cache: OrderedDict[str, tuple[float, FileCheck]] = OrderedDict()
_lock = threading.Lock()  # worker threads each run an event loop of their own


def checkable(url: str) -> bool:
    return url.startswith(("http://", "https://"))


async def check_files(urls: Iterable[str], *, mode: FileCheckMode = "public", timeout_s: float = CHECK_TIMEOUT_S,
                      ttl_s: float = CHECK_TTL_S) -> dict[str, FileCheck]:
    """What is at each `http(s)` URL of `urls`: remembered answers, and one parallel batch for the rest."""
    if mode == "off":
        return {}
    now = time.monotonic()
    found: dict[str, FileCheck] = {}
    ask: list[str] = []
    with _lock:
        for url in dict.fromkeys(u for u in urls if checkable(u)):
            cached = _cache.get(url)
            if cached is not None and cached[0] > now:
                found[url] = cached[1]
            else:
                ask.append(url)
    if ask:
        asked = await _head_all(ask[:MAX_CHECKS], timeout_s=timeout_s, public_only=mode == "public")
        found.update(asked)
        _remember(asked, expires=now + ttl_s)
    return found


async def _head_all(urls: list[str], *, timeout_s: float, public_only: bool) -> dict[str, FileCheck]:
    gate = asyncio.Semaphore(CONCURRENCY)
    # no redirect is followed: a public URL could send the check on to an internal one
    async with httpx.AsyncClient(timeout=timeout_s, follow_redirects=False) as http:

        async def one(url: str) -> FileCheck:
            async with gate:
                if public_only and not await public_host(url):
                    return FileCheck("unknown")  # not asked: replayed as its reference
                return await _head(http, url)

        try:
            async with asyncio.timeout(timeout_s):
                checks = await asyncio.gather(*(one(u) for u in urls))
        except TimeoutError:
            return {}  # nothing known: the files are replayed as references, and asked again next turn
    return dict(zip(urls, checks, strict=True))


async def _head(http: httpx.AsyncClient, url: str) -> FileCheck:
    try:
        response = await http.head(url)
    except httpx.HTTPError:
        return FileCheck("unknown")
    status = response.status_code
    if 200 <= status < 300:
        length = response.headers.get("content-length", "")
        return FileCheck("available", int(length) if length.isdigit() else None)
    if 400 <= status < 500 and status not in (405, 429):  # not allowed, rate limited: nothing about the file
        return FileCheck("missing")
    return FileCheck("unknown")


async def public_host(url: str) -> bool:
    """Whether every address the URL's host resolves to is a global one (also the rule of completion
    webhooks under `TL_WEBHOOK_HOSTS=public`: `runners/webhook.py`)."""
    try:
        parts = urlsplit(url)
        host = parts.hostname
        if not host:
            return False
        infos = await asyncio.get_running_loop().getaddrinfo(host, parts.port or 443, type=socket.SOCK_STREAM)
    except (OSError, ValueError):
        return False
    addresses = {str(info[4][0]) for info in infos}
    return bool(addresses) and all(ipaddress.ip_address(a.split("%")[0]).is_global for a in addresses)


def _remember(checks: dict[str, FileCheck], *, expires: float) -> None:
    """Only answers: an unknown state (a timeout, a 5xx) is asked again on the next turn."""
    with _lock:
        for url, check in checks.items():
            if check.state == "unknown":
                continue
            _cache[url] = (expires, check)
            _cache.move_to_end(url)
        while len(_cache) > _CACHE_SIZE:
            _cache.popitem(last=False)
