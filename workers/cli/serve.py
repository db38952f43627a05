"""`threadline worker` and `threadline demo`: the two verbs that start the worker side (imported when
they run, so that the other verbs never load it)."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from typing import TYPE_CHECKING

from threadline.workers.settings import Settings

if TYPE_CHECKING:
    pass

from threadline.workers.cli.common import EXIT_BAD_INPUT, Exit, connect, display_url


def worker_start_line(processes: int, url: str) -> str:
    return f"threadline: {processes} worker processes on {display_url(url)}"


def cmd_worker(args: argparse.Namespace, settings: Settings) -> int:
    from threadline.pipeline.stages import DEFAULT_GRAPH
    from threadline.workers.protocol.names import queues
    from threadline.workers.telemetry.logs import configure_logging
    from threadline.workers.worker.process import Supervisor

    configure_logging(settings)  # only the commands that log set it up: the producer commands start faster

    known = queues(DEFAULT_GRAPH)
    unknown = [q for q in args.queues if q not in known]
    if unknown:
        raise Exit(EXIT_BAD_INPUT, f"unknown queue {', '.join(unknown)}; the queues are {', '.join(known)}")
    url, server = connect(settings)
    supervisor = Supervisor(url, processes=args.processes or settings.processes,
                            threads=args.threads or settings.threads, queues=args.queues)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    supervisor.start()
    print(worker_start_line(len(supervisor.children), url), file=sys.stderr)
    try:
        supervisor.watch(stop)
    finally:
        supervisor.stop()
        if server is not None:
            server.stop()
    return 0


def cmd_demo(args: argparse.Namespace, settings: Settings) -> int:
    from threadline.workers.cli.demo import run_demo
    from threadline.workers.telemetry.logs import configure_logging

    # the demo's own log lines (the embedded server's start, reconnects) go to a file beside the
    # workers' log: its stdout is the conversation, and its terminal shows nothing else
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    with open(settings.data_dir / "demo.log", "a") as log:
        configure_logging(settings, stream=log)
        return run_demo(settings, delay_ms=args.delay_ms)
