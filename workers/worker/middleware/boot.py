"""Sets up a worker's runtime when the worker boots (store, cancel registry and watcher, the
watchdog on the worker's event loop), and tears it down when it stops."""

from __future__ import annotations

import asyncio
import concurrent.futures

import dramatiq
from dramatiq.asyncio import get_event_loop_thread
from dramatiq.middleware import Middleware

from threadline.pipeline.stages import StageGraph
from threadline.workers.settings import Settings
from threadline.workers.storage.store import Store
from threadline.workers.worker.cancellation import CancelRegistry, CancelWatcher
from threadline.workers.worker.runtime import Runtime, RuntimeRef
from threadline.workers.worker.watchdog import Watchdog


class Boot(Middleware):
    def __init__(self, settings: Settings, url: str, graph: StageGraph, ref: RuntimeRef) -> None:
        self.settings = settings
        self.url = url
        self.graph = graph
        self.ref = ref
        self.watcher: CancelWatcher | None = None
        self._watchdog: concurrent.futures.Future[None] | None = None

    def before_worker_boot(self, broker: dramatiq.Broker, worker: dramatiq.Worker) -> None:
        from threadline.workers.worker.broker import DoorbellBroker

        assert isinstance(broker, DoorbellBroker)
        registry = CancelRegistry()
        runtime = Runtime(Store.connect(self.url, self.settings, self.graph), registry, broker.calls)
        runtime.on_calls = runtime.for_calls(Store.connect(self.url, self.settings, self.graph))
        self.ref.set(runtime)
        self.watcher = CancelWatcher(registry, broker.listener, self.url, broker.keys)
        loop = get_event_loop_thread()
        assert loop is not None, "the AsyncIO middleware comes before Boot"
        watchdog = Watchdog(runtime, reachability=broker.reachability)
        self._watchdog = asyncio.run_coroutine_threadsafe(watchdog.run(), loop.loop)

    def before_worker_shutdown(self, broker: dramatiq.Broker, worker: dramatiq.Worker) -> None:
        from threadline.workers.worker.broker import DoorbellBroker

        assert isinstance(broker, DoorbellBroker)
        broker.before_shutdown()
        if self._watchdog is not None:
            self._watchdog.cancel()

    def after_worker_shutdown(self, broker: dramatiq.Broker, worker: dramatiq.Worker) -> None:
        from threadline.workers.worker.broker import DoorbellBroker

        assert isinstance(broker, DoorbellBroker)
        if self.watcher is not None:
            self.watcher.stop()
        broker.calls.stop()
        self.ref.set(None)
