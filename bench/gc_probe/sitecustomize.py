"""The garbage collector's pauses in every Python process started with this directory on PYTHONPATH:
per generation, the collections, their total and their longest time, and at exit what a full
collection still scans (the unfrozen objects of the oldest generation, by type). Written every 2 s
and at exit to `$GC_PROBE_DIR/gc-<pid>.txt` (default: the working directory).

    PYTHONPATH=bench/gc_probe GC_PROBE_DIR=/tmp/gc .venv/bin/python -m bench.run --phases latency,ttft,throughput

bench.run's processes (its harness, the bare chain's workers, Threadline's workers) inherit it; a
Threadline worker is the file whose `frozen` count is not 0, or whose collections are the most.
"""

from __future__ import annotations

import atexit
import collections
import gc
import os
import threading
import time
from typing import Any

_PATH = os.path.join(os.environ.get("GC_PROBE_DIR", "."), f"gc-{os.getpid()}.txt")
_started: dict[int, float] = {}
#: generation → [collections, total ms, longest ms]
_stats: dict[int, list[float]] = {0: [0, 0.0, 0.0], 1: [0, 0.0, 0.0], 2: [0, 0.0, 0.0]}


def _callback(phase: str, info: dict[str, Any]) -> None:
    generation = info["generation"]
    if phase == "start":
        _started[generation] = time.perf_counter()
        return
    ms = (time.perf_counter() - _started.pop(generation, time.perf_counter())) * 1000
    s = _stats[generation]
    s[0], s[1], s[2] = s[0] + 1, s[1] + ms, max(s[2], ms)


def _summary() -> str:
    parts = [f"gen{g}: {int(n)} collections, {total:.1f} ms, longest {longest:.2f} ms"
             for g, (n, total, longest) in _stats.items()]
    return "; ".join(parts) + f"; frozen {gc.get_freeze_count()}\n"


def _write(extra: str = "") -> None:
    with open(_PATH, "w") as f:
        f.write(_summary() + extra)


def _every_2_s() -> None:
    while True:
        time.sleep(2)
        _write()


def _at_exit() -> None:
    oldest = gc.get_objects(2)
    kinds = collections.Counter(type(o).__name__ for o in oldest).most_common(10)
    _write(f"a full collection scans {len(oldest)} objects: {kinds}\n")


gc.callbacks.append(_callback)
atexit.register(_at_exit)
threading.Thread(target=_every_2_s, name="gc-probe", daemon=True).start()
