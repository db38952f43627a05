"""Running `threadline` in the test's own process: the environment a command reads (a key prefix of
its own, no inherited `TL_*`), and `cli.main` called with its exit code, stdout and stderr captured."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from threadline.workers.cli import main as cli


@dataclass(frozen=True)
class Result:
    code: int
    out: str
    err: str

    def one_line(self) -> str:
        """The single stderr line of a failure (and no traceback)."""
        lines = self.err.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in self.err, self.err
        return lines[0]


def cli_env(monkeypatch: pytest.MonkeyPatch, *, redis_url: str, prefix: str, data_dir: Path) -> pytest.MonkeyPatch:
    """The command's environment: the test server, a prefix of its own, quiet logs, no other `TL_*`."""
    for name in [n for n in os.environ if n.startswith("TL_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("REDIS_URL", redis_url)
    monkeypatch.setenv("TL_PREFIX", prefix)
    monkeypatch.setenv("TL_LOG_FORMAT", "json")
    monkeypatch.setenv("TL_LOG_LEVEL", "WARNING")
    monkeypatch.setenv("TL_DATA_DIR", str(data_dir))
    return monkeypatch


def cli_runner(capsys: pytest.CaptureFixture[str], *, verb: tuple[str, ...] = ()) -> Callable[..., Result]:
    """`run("cancel", "x")` -> Result, through `cli.main` in this process (`verb` goes in front)."""

    def invoke(*argv: str) -> Result:
        capsys.readouterr()
        with pytest.raises(SystemExit) as stop:
            cli.main([*verb, *argv])
        out, err = capsys.readouterr()
        return Result(int(stop.value.code or 0), out, err)

    return invoke
