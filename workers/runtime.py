"""What a worker process holds while it runs: settings, the store, the cancel registry, a model
cache, and the one helper that ends a turn early (bad input, cancel, deadline, give-up)."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid

import structlog
from threadline.pipeline import events
from threadline.pipeline.config import ModelSpec
from threadline.pipeline.contracts import TerminalType
from threadline.pipeline.errors import ErrorCode
from threadline.pipeline.invoke import TurnAgent, build_agent, build_tools
from threadline.pipeline.models import build_model
from threadline.pipeline.persist import final_row
from threadline.pipeline.records import ResolvedTurn

from .control import CancelRegistry
from .store import Finish, Store

log = structlog.get_logger(__name__)


class Runtime:
    def __init__(self, store: Store, registry: CancelRegistry) -> None:
        self.store = store
        self.settings = store.settings
        self.registry = registry
        self.worker_id = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._agents: dict[str, TurnAgent] = {}
        self._agents_lock = threading.Lock()

    def agent(self, spec: ModelSpec, tools: list[str]) -> TurnAgent:
        """Agents (their models and HTTP clients too) are built from config on first use and reused."""
        key = json.dumps([spec.model_dump(mode="json"), tools])
        with self._agents_lock:
            agent = self._agents.get(key)
            if agent is None:
                allow = self.settings.allow_python_models
                model = build_model(spec, env=self.settings.secrets, allow_python=allow)
                agent = build_agent(model, build_tools(tools, allow_python=allow))
                self._agents[key] = agent
            return agent

    @staticmethod
    def now() -> float:
        return time.time()

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
    ) -> str:
        """End a turn that will not reach `persist`: its terminal event, its message row if it was
        accepted, the conversation released. Stored history stays as it was."""
        state = await self.store.turn_state(turn_id)
        if resolved is None and state.get("message_id"):
            raw = await self.store.artifact(turn_id, "resolved")
            resolved = ResolvedTurn.model_validate_json(raw) if raw else None
        attempt = int(state.get("attempt", "1"))
        accepted = resolved is not None and bool(state.get("message_id"))
        row = final_row(resolved, status=status, now=self.now(), code=code) if accepted and resolved else None
        event = events.terminal(
            turn_id, attempt, status, code=code, message=message,
            conversation_id=resolved.conversation_id if accepted and resolved else None,
            message_id=resolved.message_id if accepted and resolved else None,
        )
        result = await self.store.finish(
            Finish(
                turn_id=turn_id,
                status=status,
                event=event,
                conversation_id=state.get("conversation_id") or conversation_id or "",
                message=row,
                fence=state.get("fence", ""),
                tenant_id=resolved.tenant_id if resolved else "",
            ),
            now=self.now(),
        )
        log.info("turn_ended", status=status, code=code, reason=message, write=result)
        return result


_runtime: Runtime | None = None


def set_runtime(runtime: Runtime | None) -> None:
    global _runtime
    _runtime = runtime


def runtime() -> Runtime:
    if _runtime is None:
        raise RuntimeError("the worker runtime is not set up (threadline.workers.worker)")
    return _runtime

