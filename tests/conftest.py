"""Fixtures: a real Redis-protocol server (embedded Valkey, or REDIS_URL), a unique key prefix per
session (cleaned up afterwards), real worker processes, an in-process worker, and a client."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from hypothesis import settings as hypothesis_settings

from tests.support.cluster import Cluster
from tests.support.restartable import Restartable
from threadline.pipeline.config import AgentConfig
from threadline.pipeline.stages import DEFAULT_GRAPH, StageGraph
from threadline.workers.clients.client import Client
from threadline.workers.protocol.keys import Keys, layout_record
from threadline.workers.settings import Settings
from threadline.workers.storage.base import in_shard
from threadline.workers.storage.connect import async_plain_client, is_cluster, sync_client
from threadline.workers.storage.embedded import ensure_embedded
from threadline.workers.storage.store import Store
from threadline.workers.worker.broker import DoorbellBroker
from threadline.workers.worker.process import start_worker

# Hypothesis' per-example deadline is wall time: on a loaded machine it fails examples that are only
# slow. The properties are what the tests check; their speed is the benchmarks' business.
hypothesis_settings.register_profile("threadline", deadline=None)
hypothesis_settings.load_profile("threadline")

ROOT = Path(__file__).resolve().parents[1]


def sharded_run() -> bool:
    """The session runs in the sharded layout (on a cluster it starts, or with TL_SHARDS set)."""
    return bool(int(os.environ.get("TL_TEST_CLUSTER") or 0) or int(os.environ.get("TL_SHARDS") or 0))


def pytest_runtest_setup(item: pytest.Item) -> None:
    marker = item.get_closest_marker("one_server")
    if marker is not None and sharded_run():
        reason = marker.args[0] if marker.args else "one server's key layout"
        pytest.skip(f"one server's layout only: {reason}")


def liveness_key(key: str, prefix: str) -> bool:
    """The worker processes' own heartbeats (`Keys.worker`, `worker_turns`, `workers`): rewritten every
    few seconds whatever a test does, so never part of a before/after comparison."""
    return key.startswith(f"{prefix}:worker:") or key == f"{prefix}:workers"

def drop_prefix(r: redis.Redis, prefix: str) -> None:
    """Delete every key under `prefix` (what a test wrote on a prefix of its own)."""
    for key in r.scan_iter(f"{prefix}:*", count=1000):
        r.delete(key)


def close_broker(broker: DoorbellBroker, redis_url: str) -> None:
    """Stop a broker a test made (its consumers wake and fetch no more) and drop its prefix's keys."""
    broker.before_shutdown()
    broker.close()
    r = sync_client(redis_url)
    drop_prefix(r, broker.settings.prefix)
    r.close()


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The server the tests run on: `TL_TEST_CLUSTER=N` starts a Redis Cluster of N primaries for this
    session (`tests/support/cluster.py`; the sharded layout, `TL_SHARDS` or 2 shards per primary);
    else REDIS_URL; else the embedded Valkey."""
    primaries = int(os.environ.get("TL_TEST_CLUSTER") or 0)
    if primaries:
        with Cluster(tmp_path_factory.mktemp("cluster"), primaries=primaries, replicas=0) as cluster:
            os.environ.setdefault("TL_SHARDS", str(2 * primaries))  # read by the workers and clients started here
            yield cluster.every_node_url
        return
    url = os.environ.get("REDIS_URL")
    if url:
        sync_client(url).ping()  # a configured server that does not answer fails the run
        yield url
        return
    server = ensure_embedded(tmp_path_factory.mktemp("embedded"))
    yield server.url
    server.stop()


@pytest.fixture(scope="session")
def prefix(redis_url: str) -> Iterator[str]:
    name = f"tlt{uuid.uuid4().hex[:8]}"
    yield name
    client = sync_client(redis_url)
    drop_prefix(client, name)
    client.close()


@pytest.fixture
def own_prefix(redis_url: str) -> Iterator[str]:
    """A key prefix of the test's own, which no worker serves (the session's `prefix` is consumed by
    the shared `workers` pool once any test has started it): for tests that read what they enqueued
    or compare every key before and after. Every key under it removed afterwards."""
    name = f"tlo{uuid.uuid4().hex[:8]}"
    yield name
    client = sync_client(redis_url)
    drop_prefix(client, name)
    client.close()


class WorkerPool:
    """Real worker processes (`python -m threadline.workers.worker`) against the test server."""

    def __init__(self, url: str, prefix: str, log_dir: Path, env: dict[str, str] | None = None) -> None:
        self.url = url
        self.prefix = prefix
        self.log_path = log_dir / f"workers-{uuid.uuid4().hex[:6]}.log"
        self.env = {
            **os.environ,
            "REDIS_URL": url,
            "TL_PREFIX": prefix,
            "TL_ALLOW_PYTHON_PLUGINS": "1",
            # the file server of tests/workers/test_files.py is on 127.0.0.1, which `public` never asks
            "TL_FILE_CHECK": "all",
            "TL_MAX_QUERY_CHARS": "2000",
            "TL_LOG_FORMAT": "json",
            "TL_LOG_LEVEL": "INFO",
            "PYTHONPATH": str(ROOT),
            **(env or {}),
        }
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, processes: int = 2, threads: int = 8, queues: tuple[str, ...] = ()) -> WorkerPool:
        command = [sys.executable, "-m", "threadline.workers.worker", "--threads", str(threads)]
        if queues:
            command += ["--queues", *queues]
        with open(self.log_path, "ab") as log:
            for _ in range(processes):
                self.procs.append(subprocess.Popen(command, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                                   cwd=ROOT))
        self.wait_ready(len(self.procs))
        return self

    def wait_ready(self, processes: int, timeout_s: float = 30) -> None:
        """Ready when every process has subscribed to the cancel channel (on a cluster, whose nodes
        count their own subscribers only: when every process has registered its heartbeat)."""
        client = sync_client(self.url)
        deadline = time.monotonic() + timeout_s
        channel = f"{self.prefix}:cancel"
        registry = Keys(self.prefix, shards=1).workers()  # the fleet's keys: the same in every sharded layout
        while time.monotonic() < deadline:
            subscribers = client.hlen(registry) if is_cluster(self.url) else client.pubsub_numsub(channel)[0][1]
            if subscribers >= processes:
                client.close()
                return
            dead = [p for p in self.procs if p.poll() is not None]
            if dead:
                raise RuntimeError(f"worker exited during start-up; log: {self.log_tail()}")
            time.sleep(0.05)
        raise TimeoutError(f"workers not ready; log: {self.log_tail()}")

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.procs)

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text().splitlines()[-lines:])
        except FileNotFoundError:
            return ""

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.dump_stacks(p)
                p.kill()
                p.wait()

    def dump_stacks(self, p: subprocess.Popen[bytes]) -> None:
        """Have a process that would not stop write its threads' stacks to the log (SIGUSR1), so that
        the test that finds it killed can say where it hung."""
        with open(self.log_path, "rb") as log:
            log.seek(0, os.SEEK_END)  # read what the process writes from now on, not the whole log again
            p.send_signal(signal.SIGUSR1)
            deadline, written = time.monotonic() + 5, b""
            while time.monotonic() < deadline and p.poll() is None:
                written += log.read()
                if b"Current thread" in written:
                    time.sleep(0.2)  # the handler writes the whole dump at once: a moment for its last lines
                    return
                time.sleep(0.05)

    def discard(self) -> None:
        """Kill the processes at once: for fixtures whose key prefix is dropped right after (a graceful
        stop costs ~1 s per process, and the tests of graceful stops call `stop`)."""
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            p.wait()


@dataclasses.dataclass
class OwnPool:
    """A worker pool on a prefix of its own, a client and a raw connection to it, and an agent
    (`offline:echo`) registered there."""

    pool: WorkerPool
    client: Client
    redis: redis.Redis
    agent: str

    @property
    def ns(self) -> str:
        """The broker's key namespace (`<prefix>:q`)."""
        return f"{self.pool.prefix}:q"


@contextlib.contextmanager
def own_pool(redis_url: str, log_dir: Path, *, tag: str, processes: int = 1, threads: int = 4,
             queues: tuple[str, ...] = ()) -> Iterator[OwnPool]:
    """For a module's fixture: one pool for all its tests; every key under its prefix removed after."""
    prefix = f"{tag}{uuid.uuid4().hex[:8]}"
    pool = WorkerPool(redis_url, prefix, log_dir).start(processes=processes, threads=threads, queues=queues)
    client = Client(redis_url, prefix=prefix)
    agent = f"agent-{uuid.uuid4().hex[:10]}"
    client.put_agent(AgentConfig.model_validate({"id": agent, "model": "offline:echo"}))
    r = sync_client(redis_url)
    try:
        yield OwnPool(pool, client, r, agent)
    finally:
        pool.discard()
        client.close()
        drop_prefix(r, prefix)
        r.close()


@pytest.fixture(scope="session")
def workers(redis_url: str, prefix: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerPool]:
    pool = WorkerPool(redis_url, prefix, tmp_path_factory.mktemp("logs")).start(processes=1)
    yield pool
    pool.stop()


@pytest.fixture
def isolated(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., WorkerPool]]:
    """Worker pools on a prefix of their own, for tests that must control which queues are served
    or which settings the workers run with."""
    name = f"tli{uuid.uuid4().hex[:8]}"
    pools: list[WorkerPool] = []

    def pool(env: dict[str, str] | None = None) -> WorkerPool:
        pools.append(WorkerPool(redis_url, name, tmp_path_factory.mktemp("logs"), env=env))
        return pools[-1]

    yield pool
    for p in pools:
        p.discard()
    r = sync_client(redis_url)
    drop_prefix(r, name)


class InProcessWorker:
    """A real dramatiq worker whose threads run in the test process, on a prefix of its own: for
    tests that hand it something a subprocess cannot get (a stage graph of their own). dramatiq's
    event loop thread is process-global, so at most one runs at a time."""

    def __init__(self, url: str, graph: StageGraph, env: dict[str, str] | None = None, threads: int = 4) -> None:
        self.url = url
        self.prefix = f"tlp{uuid.uuid4().hex[:8]}"
        # the session's key layout (TL_SHARDS: set on a cluster) unless `env` names one
        layout = {"TL_SHARDS": os.environ.get("TL_SHARDS") or "0"}
        base = Settings.from_env({"TL_ALLOW_PYTHON_PLUGINS": "1", "TL_LOG_FORMAT": "json", **layout, **(env or {})})
        self.settings = dataclasses.replace(base, redis_url=url, prefix=self.prefix)
        self.broker, self.worker = start_worker(self.settings, url, graph=graph, threads=threads)
        self.client = Client(url, prefix=self.prefix)

    def stop(self) -> None:
        self.worker.stop(timeout=5_000)
        self.broker.close()
        drop_prefix(self.client.redis, self.prefix)
        self.client.close()


@pytest.fixture
def inprocess(redis_url: str) -> Iterator[Callable[..., InProcessWorker]]:
    """`inprocess(graph=..., env=...)`: start an in-process worker, stopped after the test."""
    started: list[InProcessWorker] = []

    def start(graph: StageGraph = DEFAULT_GRAPH, env: dict[str, str] | None = None) -> InProcessWorker:
        assert not started, "one in-process worker at a time"
        started.append(InProcessWorker(redis_url, graph, env))
        return started[-1]

    yield start
    for w in started:
        w.stop()


@pytest.fixture
def client(redis_url: str, prefix: str) -> Iterator[Client]:
    c = Client(redis_url, prefix=prefix)
    yield c
    c.close()


@pytest.fixture(params=[0, 1], ids=["one-server", "sharded"])
def store_shards(request: pytest.FixtureRequest) -> Iterator[int]:
    """The key layout of the `store` fixture: one server's (0), and the sharded one with one shard,
    which the test runs bound to (as a stage runs bound to its message's shard): the same scripts
    and checks on both layouts' keys. A test of one layout's keys alone is marked `one_server`
    (skipped in the sharded variant) or asks for `store_shards` itself."""
    shards = request.param
    if sharded_run():  # its one server (or cluster) holds the session's layout, not this fixture's
        pytest.skip("the store fixture lays out its own keys on one server: not in a sharded session")
    if shards and request.node.get_closest_marker("one_server") is not None:
        pytest.skip("one server's layout only")
    with in_shard(0 if shards else None):
        yield shards


@pytest.fixture
async def store(redis_url: str, store_shards: int) -> AsyncIterator[Store]:
    """A worker-side store on a key prefix of its own, every key under it removed afterwards."""
    prefix = f"tls{uuid.uuid4().hex[:8]}"
    settings = dataclasses.replace(Settings.from_env({}), prefix=prefix, redis_url=redis_url, shards=store_shards)
    s = Store(async_plain_client(redis_url), settings, DEFAULT_GRAPH)
    if store_shards:  # as the first worker claims it: clients read the layout from here
        await s.redis.set(Keys(prefix).layout(), json.dumps(layout_record(store_shards)))
    yield s
    async for key in s.redis.scan_iter(f"{prefix}:*", count=1000):
        await s.redis.delete(key)
    await s.close()


AgentFactory = Callable[..., str]


@pytest.fixture
def make_agent(client: Client) -> AgentFactory:
    """Register an agent with a unique id: `make_agent("offline:echo", instructions=...)`."""

    def make(model: str | dict[str, Any] = "offline:echo", **fields: Any) -> str:
        agent_id = f"agent-{uuid.uuid4().hex[:10]}"
        client.put_agent(AgentConfig.model_validate({"id": agent_id, "model": model, **fields}))
        return agent_id

    return make


def turn(agent_id: str, query: str, **fields: Any) -> dict[str, Any]:
    """A turn request for the test tenant."""
    return {"tenant_id": "t1", "app_id": "app", "user_id": "u1", "agent_id": agent_id, "query": query, **fields}


@pytest.fixture
def restartable(tmp_path: Path) -> Iterator[Restartable]:
    """The test's own persisted Valkey, started; the test may stop and start it again."""
    server = Restartable(tmp_path / "valkey")
    server.start()
    yield server
    server.stop()
