"""What one log line costs a worker's CPU: `python -m bench.log_lines`.

Every line of a worker (structlog's and dramatiq's) goes through the one handler `configure_logging`
installs: the stdlib record, the JSON renderer and the credential redaction of each value
(`redact_secrets`). A turn writes five at INFO (`stage_decided` twice, `resolved`, `invoked`,
`persisted`). Each row times `--lines` lines shaped like the history stage's `stage_decided` (its
decision record, four context fields) into a buffer, in this process, and gives the CPU time
(`time.process_time`) per line, the median of `--rounds` alternated rounds:

- `as configured`: `configure_logging`'s JSON path, as a worker runs it;
- `with the record lookups`: the same, with the logging module's lookups of the caller's file and
  line, thread, process and task switched back on (`record_lookups(True)`), which no line prints;
- each of those with two credentials configured (`add_secret`), which every string is scrubbed of.
"""

from __future__ import annotations

import argparse
import io
import logging
import statistics
import time
from pathlib import Path
from typing import Any

import structlog

from threadline.workers.settings import Settings
from threadline.workers.telemetry import logs

#: Two made-up credentials of the shapes a worker's environment holds (provider API keys).
SECRETS = ("sk-bench0123456789abcdefghijklmnopqrstu", "AIzaBench0123456789abcdefghijklmnopq")
DECISION: dict[str, Any] = {
    "tokenizer": "tiktoken:o200k_base",
    "budget": {"context_window": 32768, "max_output": 1024, "safety_margin": 256, "instructions": 8,
               "query": 12, "tools": 0, "history": 31468},
    "window": {"reason": "within_budget", "start": "m-3", "kept_turns": 3, "kept_tokens": 412, "dropped_turns": 0,
               "dropped_tokens": 0, "dropped": []},
    "read": {"turns": 3, "complete": True},
    "summary": None,
    "messages_out": 7,
    "files": [],
}


def cpu_us_per_line(lines: int, *, lookups: bool) -> float:
    logs.record_lookups(lookups)
    log = structlog.get_logger("threadline.workers.worker.runners.transform")
    started = time.process_time()
    for _ in range(lines):
        log.info("stage_decided", **DECISION)
    return 1e6 * (time.process_time() - started) / lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.log_lines", description=__doc__.split("\n\n")[0])
    parser.add_argument("--lines", type=int, default=20_000, help="lines per row and round (default 20000)")
    parser.add_argument("--rounds", type=int, default=5, help="alternated rounds (default 5)")
    a = parser.parse_args(argv)
    buffer = io.StringIO()
    logs.configure_logging(Settings(redis_url=None, data_dir=Path("."), log_format="json"), stream=buffer)
    structlog.contextvars.bind_contextvars(turn_id="0" * 32, conversation_id="c" * 32, stage="history",
                                           attempt=1)
    rows = {(secrets, lookups): list[float]() for secrets in (False, True) for lookups in (False, True)}
    cpu_us_per_line(2_000, lookups=False)  # warm-up: caches, the first lines' imports
    for secrets in (False, True):
        if secrets:
            for secret in SECRETS:
                logs.add_secret(secret)
        for _ in range(a.rounds):
            for lookups in (False, True):
                rows[secrets, lookups].append(cpu_us_per_line(a.lines, lookups=lookups))
                buffer.seek(0)
                buffer.truncate()
    logs.record_lookups(False)
    logging.getLogger().handlers.clear()
    print(f"command: `python -m bench.log_lines --lines {a.lines} --rounds {a.rounds}`\n")
    print("| line | credentials configured | CPU per line, median (us) |")
    print("|---|---|---|")
    for (secrets, lookups), figures in rows.items():
        name = "with the record lookups" if lookups else "as configured"
        print(f"| {name} | {len(SECRETS) if secrets else 0} | {statistics.median(figures):.1f} |")


if __name__ == "__main__":
    main()
