"""The baseline: a bare chain of five no-op `async def` dramatiq actors, one queue each, on a stock
`dramatiq.brokers.redis.RedisBroker` with its default middleware plus `AsyncIO`, and default worker
settings (`worker_timeout` 1000 ms). Each actor sends the next; the last one XADDs the chain id to
a completion stream, so the harness can time submit → done.

Run as a worker process: `python -m bench.bare_chain --url URL --namespace NS --threads 8`.
When its consumers are running it RPUSHes its pid to `<NS>:bench:ready` (before the harness
resets INFO commandstats, so this one write is never counted).
"""

from __future__ import annotations

import argparse
import os
import signal
import threading
from collections.abc import Sequence
from typing import Any

import dramatiq
from dramatiq.brokers.redis import RedisBroker
from dramatiq.middleware import AsyncIO

HOPS = 5


def done_key(namespace: str) -> str:
    """Stream: one entry (`id` = chain id) per finished chain."""
    return f"{namespace}:bench:done"


def ready_key(namespace: str) -> str:
    return f"{namespace}:bench:ready"


def make_broker(url: str, namespace: str) -> RedisBroker:
    """A stock RedisBroker (default middleware) with the AsyncIO middleware added."""
    broker = RedisBroker(url=url, namespace=namespace)  # type: ignore[no-untyped-call]
    broker.add_middleware(AsyncIO())
    return broker


def declare_chain(broker: RedisBroker, namespace: str) -> list[dramatiq.Actor[Any, Any]]:
    """The five actors `hop1` … `hop5` on queues of the same names; returns them in order."""
    actors: list[dramatiq.Actor[Any, Any]] = []
    stream = done_key(namespace)

    def make_hop(index: int) -> dramatiq.Actor[Any, Any]:
        async def hop(chain_id: str) -> None:
            if index + 1 < HOPS:
                actors[index + 1].send(chain_id)
            else:
                broker.client.xadd(stream, {"id": chain_id})

        name = f"hop{index + 1}"
        declare = dramatiq.actor(actor_name=name, queue_name=name, broker=broker)
        return declare(hop)

    actors.extend(make_hop(i) for i in range(HOPS))
    return actors


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.bare_chain")
    parser.add_argument("--url", required=True)
    parser.add_argument("--namespace", required=True)
    parser.add_argument("--threads", type=int, default=8)
    args = parser.parse_args(argv)

    broker = make_broker(args.url, args.namespace)
    dramatiq.set_broker(broker)
    declare_chain(broker, args.namespace)
    worker = dramatiq.Worker(broker, worker_threads=args.threads)  # default worker_timeout
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    worker.start()
    broker.client.rpush(ready_key(args.namespace), os.getpid())
    stop.wait()
    worker.stop(timeout=10_000)
    broker.close()


if __name__ == "__main__":
    main()
