"""
Waiting in tests for a promised condition, within a bounded time.

A test that checks a promise such as "within one second" must poll for the
promised state and fail only when the promise is broken; asserting the
state at once tests a stronger promise than the one the code makes, and
fails by chance on a busy machine (and sleeping a fixed time first makes a
test slow and still flaky).
"""

from __future__ import annotations

import time
from collections.abc import Callable


def waitUntil(condition: Callable[[], bool], limit: float, interval: float = 0.01) -> float:
    """
    Poll C{condition} until it holds; return how long that took in
    seconds, or fail with C{AssertionError} once C{limit} seconds have
    passed without it holding.
    """
    started = time.monotonic()
    while not condition():
        elapsed = time.monotonic() - started
        assert elapsed < limit, f"condition not met within {limit}s"
        time.sleep(interval)
    return time.monotonic() - started
