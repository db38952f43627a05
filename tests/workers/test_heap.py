"""A worker process's heap after start-up: what it loaded is out of the garbage collector's full
collections, which otherwise stop every thread for tens of milliseconds (`settle_heap`)."""

from __future__ import annotations

import json
import subprocess
import sys

from threadline.workers.worker import process

PROBE = """
import gc, json
from threadline.workers.worker import process
from pydantic_ai import Agent
from pydantic_ai.models.test import TestModel
if SETTLE:
    process.settle_heap()
else:
    gc.collect()
before = len(gc.get_objects(2))
for _ in range(3):
    Agent(TestModel()).run_sync("hello")  # a run's first response loads genai-prices' price table
gc.collect()
print(json.dumps({"before": before, "after": len(gc.get_objects(2)), "frozen": gc.get_freeze_count(),
                  "gen0": gc.get_threshold()[0]}))
"""


def heap(settle: bool) -> dict[str, int]:
    out = subprocess.run([sys.executable, "-c", f"SETTLE = {settle}\n{PROBE}"], capture_output=True, text=True,
                         check=True, timeout=120)
    return json.loads(out.stdout.splitlines()[-1])


def test_a_full_collection_after_start_up_scans_only_what_the_turns_left() -> None:
    settled, plain = heap(True), heap(False)
    assert plain["frozen"] == 0 and plain["after"] > 100_000  # every import's objects, scanned each time
    assert settled["frozen"] > 100_000
    # the young generation's budget is the worker's, not CPython's default (700 on 3.11 and 3.12)
    assert settled["gen0"] == process.GEN0_THRESHOLD != plain["gen0"], (settled, plain)
    # what the runs keep (pydantic-ai's caches, the agents' schemas) is all a full collection scans now
    assert settled["before"] < 1_000 and settled["after"] < 10_000, settled
