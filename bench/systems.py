"""The two systems under test, behind one small interface each: start worker processes and wait
until they are ready, run one timed turn into an idle system, and push a batch through as fast as
possible.

- `ThreadlineSystem`: real `python -m threadline.workers.worker` processes, turns submitted with
  `workers.client.Client` exactly as a producer would, timed to the turn's terminal event.
- `BareSystem`: `python -m bench.bare_chain` processes, chains sent with a stock dramatiq producer,
  timed to the chain's completion marker.

Besides the harness's own clock, every completion is also timed by its stream entry id (the
server's clock in ms), which splits a Threadline turn into queue hops and stage times.
"""

from __future__ import annotations

import json
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import redis

from threadline.pipeline.config import AgentConfig
from threadline.pipeline.events import TERMINAL_TYPES
from threadline.pipeline.stages import DEFAULT_GRAPH
from threadline.workers.clients.client import Client

from . import bare_chain
from .procs import Child, Processes, python_env
from .stats import percentile

Entry = tuple[str, dict[bytes, bytes]]

#: The burst harness's pause between its reads of every unfinished turn's stream.
POLL_S = 0.02


def xread(client: redis.Redis, key: str, after: str, deadline: float, count: int = 500) -> list[Entry]:
    """One XREAD of `key` after `after`, blocking at most 1 s and never past `deadline`
    (perf_counter); raises TimeoutError once the deadline has passed."""
    remaining = deadline - time.perf_counter()
    if remaining <= 0:
        raise TimeoutError(f"nothing new on {key} in time")
    block_ms = max(1, int(min(remaining, 1.0) * 1000))
    reply = cast(list[Any], client.xread({key: after}, block=block_ms, count=count))
    if not reply:
        return []
    return [(entry_id.decode(), fields) for entry_id, fields in reply[0][1]]


def ended(following: dict[str, str], reply: Any) -> list[tuple[str, str, dict[str, Any]]]:
    """The terminal events (events key, entry id, event) in an XREAD `reply` of the streams in `following`
    (events key → last entry id read): each key's position moves past what was read, and a turn
    that ended is no longer followed."""
    found = []
    for raw_key, entries in cast(list[Any], reply) or []:
        key = raw_key.decode()
        for raw_id, fields in entries:
            entry_id = following[key] = raw_id.decode()
            event = json.loads(fields[b"json"])
            if event["type"] in TERMINAL_TYPES:
                found.append((key, entry_id, event))
                del following[key]
                break
    return found


def entry_ms(entry_id: str) -> int:
    return int(entry_id.split("-", 1)[0])


@dataclass(frozen=True, slots=True)
class TurnTiming:
    """One turn, timed by the harness (perf_counter) and split up by the event stream's ids."""

    total_ms: float
    first_delta_ms: float | None
    status: str
    #: Segment name → ms, from stream entry ids (server clock, 1 ms resolution).
    segments: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Saturation:
    """A closed-loop run: `inflight` turns kept in flight for a while (a new one submitted as each
    one ends); completions counted after the warm-up. Its rate is `inflight` / latency under load
    (Little's law): capacity for Threadline, whose consumers never back off; for the bare chain,
    mostly its backoff (the chains move in convoys that each wait for sleeping consumers)."""

    inflight: int
    window_s: float
    completed: int
    statuses: dict[str, int]

    @property
    def rate(self) -> float:
        return self.completed / self.window_s if self.window_s > 0 else float("nan")

    @property
    def not_succeeded(self) -> int:
        return sum(v for k, v in self.statuses.items() if k not in ("succeeded", "done"))


@dataclass(frozen=True, slots=True)
class Batch:
    """A throughput run: `count` turns submitted at once."""

    count: int
    #: Wall clock (ms) of the first submission.
    submit_wall_ms: float
    #: Harness clock: first submission → last completion seen.
    wall_s: float
    #: Time the submissions took (harness clock).
    submit_s: float
    #: Completion times (server ms, from stream entry ids), sorted.
    completions_ms: list[int]
    statuses: dict[str, int]

    @property
    def burst_rate(self) -> float:
        """Turns/s from the first submission until the last one is done."""
        return self.count / self.wall_s

    @property
    def not_succeeded(self) -> int:
        return sum(v for k, v in self.statuses.items() if k not in ("succeeded", "done"))


def _segments(submit_wall_ms: float, done_wall_ms: float, entries: Sequence[tuple[int, dict[str, Any]]]
              ) -> dict[str, float]:
    """Where a turn's time went: queue hops between stages, stage wall time, and the notification
    to the client. `resolve` writes its `started`/`finished` events at its end (with `ms`), the
    other stages write `started` when they begin."""
    started: dict[str, int] = {}
    finished: dict[str, tuple[int, float]] = {}
    terminal_ms: int | None = None
    first_delta_ms: int | None = None
    for at, event in entries:
        kind = event.get("type")
        if kind == "text_delta" and first_delta_ms is None:
            first_delta_ms = at
        elif kind == "stage" and event.get("status") == "started":
            started.setdefault(event["stage"], at)
        elif kind == "stage" and event.get("status") == "finished":
            finished.setdefault(event["stage"], (at, float(event.get("ms") or 0.0)))
        elif kind in TERMINAL_TYPES:
            terminal_ms = at
    segments: dict[str, float] = {}
    if "resolve" in finished:
        at, ms = finished["resolve"]
        segments["submit→resolve starts"] = at - ms - submit_wall_ms
        segments["resolve"] = ms
    previous = finished["resolve"][0] if "resolve" in finished else None
    for stage in DEFAULT_GRAPH.names[1:]:
        if stage in started and previous is not None:
            segments[f"hop→{stage}"] = started[stage] - previous
        if stage in started and stage in finished:
            segments[stage] = finished[stage][0] - started[stage]
        previous = finished[stage][0] if stage in finished else None
    if first_delta_ms is not None and "invoke" in started:
        segments["invoke start→first text_delta"] = first_delta_ms - started["invoke"]
    if terminal_ms is not None:
        segments["terminal→client"] = done_wall_ms - terminal_ms
    return segments


class ThreadlineSystem:
    def __init__(self, processes: Processes, url: str, *, prefix: str, threads: int,
                 env: dict[str, str] | None = None) -> None:
        self.processes = processes
        self.url = url
        self.prefix = prefix
        self.threads = threads
        self.env = python_env({"REDIS_URL": url, "TL_PREFIX": prefix, "TL_LOG_FORMAT": "json", **(env or {})})
        self.client = Client(url, prefix=prefix)
        self.workers: list[Child] = []
        self._spawned = 0

    # --- processes -------------------------------------------------------------------------------

    def start(self, count: int = 1) -> list[Child]:
        new = []
        for _ in range(count):
            self._spawned += 1
            new.append(self.processes.spawn(
                f"threadline-worker-{self._spawned}",
                [sys.executable, "-m", "threadline.workers.worker", "--threads", str(self.threads)], self.env,
            ))
        self.workers.extend(new)
        self._wait_ready(len(self.workers), new)
        return new

    def _wait_ready(self, expected: int, new: Sequence[Child], timeout_s: float = 60.0) -> None:
        """Ready when every process has subscribed to the cancel channel (as in tests/conftest.py)."""
        channel = self.client.keys.cancel_channel()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.client.redis.pubsub_numsub(channel)[0][1] >= expected:
                return
            for child in new:
                if not child.alive():
                    raise RuntimeError(f"{child.name} exited during start-up:\n{child.log_tail()}")
            time.sleep(0.05)
        raise TimeoutError(f"threadline workers not ready:\n{new[-1].log_tail()}")

    def stop(self, children: Sequence[Child] | None = None) -> None:
        targets = list(self.workers if children is None else children)
        self.processes.stop_many(targets)
        self.workers = [w for w in self.workers if w not in targets]

    def close(self) -> None:
        self.client.close()

    # --- turns -----------------------------------------------------------------------------------

    def put_agent(self, model: str | dict[str, Any]) -> str:
        agent_id = f"bench-{uuid.uuid4().hex[:8]}"
        self.client.put_agent(AgentConfig.model_validate({"id": agent_id, "model": model}))
        return agent_id

    @staticmethod
    def request(agent_id: str, turn_id: str) -> dict[str, Any]:
        """A turn on a new conversation."""
        return {"tenant_id": "bench", "app_id": "bench", "user_id": "u1", "agent_id": agent_id,
                "query": "Where is my order?", "turn_id": turn_id}

    def _follow(self, turn_id: str, deadline: float) -> list[tuple[int, dict[str, Any], float]]:
        """The turn's events up to its terminal one: (entry ms, event, harness time seen)."""
        key = self.client.keys.events(turn_id)
        seen: list[tuple[int, dict[str, Any], float]] = []
        after = "0"
        while True:
            entries = xread(self.client.redis, key, after, deadline)
            now = time.perf_counter()
            for entry_id, fields in entries:
                after = entry_id
                event = json.loads(fields[b"json"])
                seen.append((entry_ms(entry_id), event, now))
                if event["type"] in TERMINAL_TYPES:
                    return seen

    def turn(self, agent_id: str, timeout_s: float = 60.0) -> TurnTiming:
        """Submit one turn on a new conversation and follow its events to the terminal one."""
        turn_id = uuid.uuid4().hex
        submit_wall_ms = time.time() * 1000
        t0 = time.perf_counter()
        self.client.submit(self.request(agent_id, turn_id))
        seen = self._follow(turn_id, t0 + timeout_s)
        done_wall_ms = time.time() * 1000
        first_delta = next(((at - t0) * 1000 for _, e, at in seen if e["type"] == "text_delta"), None)
        return TurnTiming((seen[-1][2] - t0) * 1000, first_delta, seen[-1][1]["type"],
                          _segments(submit_wall_ms, done_wall_ms, [(ms, e) for ms, e, _ in seen]))

    def throughput(self, agent_id: str, count: int, timeout_s: float = 300.0) -> Batch:
        """Submit `count` turns on new conversations at once; wait for every terminal event."""
        ids = [uuid.uuid4().hex for _ in range(count)]
        wall_ms = time.time() * 1000
        t0 = time.perf_counter()
        for turn_id in ids:
            self.client.submit(self.request(agent_id, turn_id))
        submit_s = time.perf_counter() - t0
        statuses: dict[str, int] = {}
        done: list[int] = []
        for last in self._terminals(ids, t0 + timeout_s):
            statuses[last[1]["type"]] = statuses.get(last[1]["type"], 0) + 1
            done.append(last[0])
        return Batch(count, wall_ms, time.perf_counter() - t0, submit_s, sorted(done), statuses)

    def _terminals(self, turn_ids: Sequence[str], deadline: float) -> list[tuple[int, dict[str, Any]]]:
        """The terminal event of every turn (entry ms, event), read as the bare chain's harness reads
        its completion stream: one XREAD for all the turns not ended yet, at most every
        `POLL_S` (what a turn ends by comes from its entry id, the server's clock, so the pause
        moves no completion time; the last one is seen at most that much later). Following each
        turn's stream on its own cost 1.1-1.6 XREADs per turn (bench.run at 8bffc1c), this 0.6-1.2:
        the harness's requests, not Threadline's, though the server's CPU counts them."""
        following = {self.client.keys.events(t): "0" for t in turn_ids}
        found: list[tuple[int, dict[str, Any]]] = []
        while following:
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                raise TimeoutError(f"{len(following)} turns did not end in time")
            time.sleep(POLL_S)
            block_ms = max(1, int(min(remaining, 1.0) * 1000))
            reply = self.client.redis.xread(dict[Any, Any](following), block=block_ms, count=100)
            found += [(entry_ms(entry_id), event) for _, entry_id, event in ended(following, reply)]
        return found


    def saturate(self, agent_id: str, inflight: int, duration_s: float, warmup_s: float,
                 drain_s: float = 60.0) -> Saturation:
        """Keep `inflight` turns (new conversations) running for `duration_s`; count the ones that
        end after `warmup_s`. Then wait for the rest, so the next phase starts on a quiet system."""
        following: dict[str, str] = {}  # events key → last entry id read

        def submit() -> None:
            turn_id = uuid.uuid4().hex
            following[self.client.keys.events(turn_id)] = "0"
            self.client.submit(self.request(agent_id, turn_id))

        t0 = time.perf_counter()
        start, end = t0 + warmup_s, t0 + duration_s
        for _ in range(inflight):
            submit()
        completed, statuses = 0, dict[str, int]()
        while following and time.perf_counter() < end + drain_s:
            reply = self.client.redis.xread(dict[Any, Any](following), block=100, count=100)
            now = time.perf_counter()
            for _, _, event in ended(following, reply):
                if start <= now <= end:
                    completed += 1
                    statuses[event["type"]] = statuses.get(event["type"], 0) + 1
                if now < end:
                    submit()
        if following:
            raise TimeoutError(f"{len(following)} turns did not finish after the saturation run")
        return Saturation(inflight, duration_s - warmup_s, completed, statuses)


class BareSystem:
    def __init__(self, processes: Processes, url: str, *, namespace: str, threads: int) -> None:
        self.processes = processes
        self.url = url
        self.namespace = namespace
        self.threads = threads
        self.env = python_env({})
        self.broker = bare_chain.make_broker(url, namespace)
        self.first = bare_chain.declare_chain(self.broker, namespace)[0]
        self.redis = redis.Redis.from_url(url)
        self.done_key = bare_chain.done_key(namespace)
        self.workers: list[Child] = []
        self._spawned = 0
        self._last = "0-0"

    def start(self, count: int = 1) -> list[Child]:
        new = []
        for _ in range(count):
            self._spawned += 1
            new.append(self.processes.spawn(
                f"bare-worker-{self._spawned}",
                [sys.executable, "-m", "bench.bare_chain", "--url", self.url, "--namespace", self.namespace,
                 "--threads", str(self.threads)],
                self.env,
            ))
        self.workers.extend(new)
        deadline = time.monotonic() + 60
        ready = bare_chain.ready_key(self.namespace)
        while self.redis.llen(ready) < self._spawned:
            for child in new:
                if not child.alive():
                    raise RuntimeError(f"{child.name} exited during start-up:\n{child.log_tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"bare chain workers not ready:\n{new[-1].log_tail()}")
            time.sleep(0.05)
        return new

    def stop(self, children: Sequence[Child] | None = None) -> None:
        targets = list(self.workers if children is None else children)
        self.processes.stop_many(targets)
        self.workers = [w for w in self.workers if w not in targets]

    def close(self) -> None:
        self.broker.close()
        self.redis.close()

    def _await(self, pending: set[str], deadline: float) -> list[int]:
        """Read the completion stream until every id in `pending` was seen; their entry ms."""
        done: list[int] = []
        while pending:
            for entry_id, fields in xread(self.redis, self.done_key, self._last, deadline, count=1000):
                self._last = entry_id
                chain_id = fields[b"id"].decode()
                if chain_id in pending:
                    pending.discard(chain_id)
                    done.append(entry_ms(entry_id))
        return done

    def turn(self, timeout_s: float = 60.0) -> TurnTiming:
        chain_id = uuid.uuid4().hex
        t0 = time.perf_counter()
        self.first.send(chain_id)
        self._await({chain_id}, t0 + timeout_s)
        return TurnTiming((time.perf_counter() - t0) * 1000, None, "done")

    def throughput(self, count: int, timeout_s: float = 300.0) -> Batch:
        ids = [uuid.uuid4().hex for _ in range(count)]
        wall_ms = time.time() * 1000
        t0 = time.perf_counter()
        for chain_id in ids:
            self.first.send(chain_id)
        submit_s = time.perf_counter() - t0
        done = self._await(set(ids), t0 + timeout_s)
        return Batch(count, wall_ms, time.perf_counter() - t0, submit_s, sorted(done), {"done": count})

    def saturate(self, inflight: int, duration_s: float, warmup_s: float, drain_s: float = 60.0) -> Saturation:
        """As `ThreadlineSystem.saturate`: `inflight` chains kept in flight."""
        pending: set[str] = set()

        def send() -> None:
            chain_id = uuid.uuid4().hex
            pending.add(chain_id)
            self.first.send(chain_id)

        t0 = time.perf_counter()
        start, end = t0 + warmup_s, t0 + duration_s
        for _ in range(inflight):
            send()
        completed = 0
        while pending:
            entries = xread(self.redis, self.done_key, self._last, end + drain_s, count=1000)
            now = time.perf_counter()
            for entry_id, fields in entries:
                self._last = entry_id
                chain_id = fields[b"id"].decode()
                if chain_id not in pending:
                    continue
                pending.discard(chain_id)
                if start <= now <= end:
                    completed += 1
                if now < end:
                    send()
        return Saturation(inflight, duration_s - warmup_s, completed, {"done": completed})


def summary_line(batch: Batch) -> str:
    first_s = (batch.completions_ms[0] - batch.submit_wall_ms) / 1000
    p50 = percentile([float(d - batch.completions_ms[0]) for d in batch.completions_ms], 50)
    return (f"{batch.burst_rate:.1f}/s (submitting took {batch.submit_s * 1000:.0f} ms, first done after "
            f"{first_s:.2f} s, median +{p50:.0f} ms after the first)")
