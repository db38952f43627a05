"""Waiting on a condition in a test: poll, never sleep blindly."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def poll(check: Callable[[], T], timeout_s: float = 5.0, interval_s: float = 0.02) -> T:
    """`check()` until it returns something truthy or `timeout_s` passed; its last result."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = check()
        if result or time.monotonic() > deadline:
            return result
        time.sleep(interval_s)


def wait_until(predicate: Callable[[], object], timeout_s: float = 10.0) -> None:
    """Return once `predicate()` holds; TimeoutError if it does not within `timeout_s`."""
    if not poll(predicate, timeout_s):
        raise TimeoutError("condition not met")
