"""What a worker process holds while it runs — settings, the stage graph, the store, the cancel
registry, a cache of agents, one of the turns its stages read — and the one function that ends a
turn before its finish stage (bad input, cancel, deadline, a message that exhausted its retries, a
turn recovered too often).

Actors reach their runtime through the `RuntimeRef` they were declared with (set when the worker
boots), never through a process global: two workers can live in one process, as in tests.
"""

from __future__ import annotations

import functools
import json
import os
import socket
import threading
import time
import uuid
from collections import Counter

import structlog

from threadline.pipeline import events
from threadline.pipeline.config import TRUSTED, ModelSpec
from threadline.pipeline.errors import ErrorCode
from threadline.pipeline.events import TerminalType
from threadline.pipeline.invoke import TurnAgent, build_agent
from threadline.pipeline.persist import final_row
from threadline.pipeline.records import ResolvedTurn
from threadline.pipeline.stages import StageGraph
from threadline.workers.settings import Settings
from threadline.workers.storage.store import Store
from threadline.workers.storage.turns import Finish
from threadline.workers.telemetry import metrics, tracing
from threadline.workers.telemetry.logs import add_secret
from threadline.workers.worker.calls import ModelCalls, default_model_calls
from threadline.workers.worker.cancellation import CancelRegistry
from threadline.workers.worker.providers import build_counting_model, build_model, build_tools, model_secrets
from threadline.workers.worker.token_counting import LocalCounter, ProviderCounter, TokenCounter
from threadline.workers.worker.tokenizers import load_tokenizer

log = structlog.get_logger(__name__)

#: Turns of which a process keeps the parsed `admitted` artifact (and its text): more than pass
#: through it between two of a turn's stages, as a rule; a turn that fell out is parsed again.
ADMITTED_CACHE_SIZE = 256
#: Artifacts longer than this (a long query or context) are parsed each time, not kept: the cache
#: stays under ADMITTED_CACHE_SIZE times 64 KiB.
ADMITTED_CACHE_MAX_BYTES = 64 * 1024


def admitted_turn(raw: str | bytes) -> ResolvedTurn:
    """The resolved turn of an `admitted` artifact (the JSON `resolve` stored). Every later stage of a
    turn reads it, often in a process that read it for an earlier one: the record is frozen and
    depends on the text alone, so one parse serves them all instead of one each."""
    return _parse_admitted(raw) if len(raw) <= ADMITTED_CACHE_MAX_BYTES else _parse_admitted.__wrapped__(raw)


@functools.lru_cache(maxsize=ADMITTED_CACHE_SIZE)
def _parse_admitted(raw: str | bytes) -> ResolvedTurn:
    return ResolvedTurn.model_validate_json(raw, context=TRUSTED)


class Runtime:
    def __init__(self, store: Store, registry: CancelRegistry, calls: ModelCalls | None = None) -> None:
        self.store = store
        self.settings: Settings = store.settings
        self.graph: StageGraph = store.graph
        self.registry = registry
        #: The model calls running on the event loop (the broker's, in a worker).
        self.calls = calls or ModelCalls(self.settings.model_calls or default_model_calls())
        #: The runtime the model calls run with on their own loop (`for_calls`; set by `Boot`).
        self.on_calls: Runtime | None = None
        self.worker_id = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._agents: dict[str, TurnAgent] = {}
        self._agents_lock = threading.Lock()
        self._counters: dict[str, ProviderCounter] = {}
        #: Turns this process runs a stage of now (its heartbeat lists them), and those whose model
        #: run it cancelled to hand them to another worker (it is stopping).
        self._held: Counter[str] = Counter()
        self._handing_over: set[str] = set()
        self._held_lock = threading.Lock()

    def for_calls(self, store: Store) -> Runtime:
        """The runtime of the model calls' event loop (`calls.py`): the same process — worker id,
        cancel registry, the turns it holds and hands over — with `store`'s connections and models
        of its own, since neither may cross event loops."""
        sibling = Runtime(store, self.registry, self.calls)
        sibling.worker_id = self.worker_id
        sibling._held, sibling._handing_over, sibling._held_lock = self._held, self._handing_over, self._held_lock
        return sibling

    def hold(self, turn_id: str) -> None:
        with self._held_lock:
            self._held[turn_id] += 1

    def let_go(self, turn_id: str) -> None:
        with self._held_lock:
            self._held[turn_id] -= 1
            if self._held[turn_id] <= 0:
                del self._held[turn_id]

    def held(self) -> list[str]:
        with self._held_lock:
            return list(self._held)

    def hand_over_all(self) -> list[str]:
        """Stop every model run of this process, so that each hands its turn to another worker (the
        runner sees `handing_over` and re-enqueues the stage instead of ending the turn)."""
        turns = self.registry.running()
        with self._held_lock:
            self._handing_over.update(turns)
        for turn_id in turns:
            self.registry.cancel(turn_id)
        return turns

    def handing_over(self, turn_id: str) -> bool:
        with self._held_lock:
            return turn_id in self._handing_over

    def agent(self, spec: ModelSpec, tools: list[str]) -> TurnAgent:
        """Agents (their models and HTTP clients too) are built from config on first use and reused."""
        key = json.dumps([spec.model_dump(mode="json"), tools])
        with self._agents_lock:
            agent = self._agents.get(key)
            if agent is None:
                allow = self.settings.allow_python_models
                # a config stored by an older client (or raw Redis) must not leak a key either
                self.settings.policy.check(spec)
                model = build_model(spec, env=self.settings.model_env, allow_python=allow)
                agent = build_agent(model, build_tools(tools, allow_python=allow))
                self._agents[key] = agent
            return agent

    def counter(self, spec: ModelSpec) -> TokenCounter:
        """What the history budget counts with: the configured tokenizer, or the provider's count
        endpoint (one client per model, built on first use and reused, like an agent's)."""
        if not spec.counts_with_provider():
            return LocalCounter(load_tokenizer(spec.tokenizer, spec.provider))
        key = json.dumps([spec.provider, spec.name, spec.base_url, spec.api_key_env, spec.options], sort_keys=True)
        with self._agents_lock:
            counter = self._counters.get(key)
            if counter is None:
                alone = spec.model_copy(update={"fallback": []})
                self.settings.policy.check(alone)
                model = build_counting_model(alone, env=self.settings.model_env,
                                             allow_python=self.settings.allow_python_models)
                fallback = LocalCounter(load_tokenizer(None, spec.provider))
                counter = self._counters[key] = ProviderCounter(f"provider:{spec.provider}:{spec.name}", model,
                                                                fallback, provider=spec.provider)
            return counter

    def secrets(self, spec: ModelSpec) -> list[str]:
        """The key values a model uses: scrubbed from its error messages and from every log line."""
        values = model_secrets(spec, self.settings.model_env)
        for value in values:
            add_secret(value)
        return values

    @staticmethod
    def now() -> float:
        return time.time()

    @staticmethod
    def now_ms() -> int:
        return int(time.time() * 1000)

    @staticmethod
    def new_id() -> str:
        return uuid.uuid4().hex

    async def end_turn(
        self,
        turn_id: str,
        status: TerminalType,
        *,
        code: ErrorCode,
        message: str,
        resolved: ResolvedTurn | None = None,
        conversation_id: str | None = None,
        webhook_url: str | None = None,
        tenant_id: str = "",
    ) -> str:
        """End a turn that will not reach its finish stage: its terminal event, its message row if
        it was accepted, the conversation released. Stored history stays as it was. The terminal
        event goes to the accepted turn's webhook; to `webhook_url` (a URL of `tenant_id`'s) for a
        turn that was not accepted, when the caller knows one."""
        state = await self.store.turn_state(turn_id)
        if resolved is None and state.message_id:
            raw = await self.store.artifact(turn_id, self.graph.first.name)
            resolved = admitted_turn(raw) if raw else None
        accepted = resolved if resolved is not None and state.message_id else None
        event = events.terminal(
            turn_id, state.attempt, status, code=code, message=message,
            conversation_id=accepted.conversation_id if accepted else None,
            message_id=accepted.message_id if accepted else None,
        )
        result = await self.store.finish(
            Finish(
                turn_id=turn_id,
                event=event,
                conversation_id=state.conversation_id or conversation_id or "",
                message=final_row(accepted, status=status, now=self.now(), code=code) if accepted else None,
                fence=state.fence,
                tenant_id=accepted.tenant_id if accepted else tenant_id,
                webhook_url=(accepted.webhook_url or "") if accepted else (webhook_url or "") if tenant_id else "",
            ),
            now=self.now(),
        )
        log.info("turn_ended", status=status, code=code, reason=message, write=result)
        metrics.turn_ended(event, write=result, turn=accepted)
        tracing.turn_ended(event, write=result, turn=accepted, now=self.now())
        return result


class RuntimeRef:
    """The runtime of the worker an actor belongs to, set when that worker boots."""

    def __init__(self) -> None:
        self._runtime: Runtime | None = None

    def set(self, runtime: Runtime | None) -> None:
        self._runtime = runtime

    def get(self) -> Runtime:
        if self._runtime is None:
            raise RuntimeError("the worker runtime is not set up (the Boot middleware runs at worker start)")
        return self._runtime
