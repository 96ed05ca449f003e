"""
Keeps the C{e2e} marker honest: a test that starts a real daemon or the
scripted upstream's process without being marked C{e2e} fails, saying so.

C{dev/test -m "not e2e"} is the quick run (pytest.ini, README's
Development section): it must start no twistd and no upstream process. A
new end-to-end module that forgets its C{pytestmark = pytest.mark.e2e}
would slowly turn the quick run into the whole suite; this plugin makes it
fail at once instead, in any run, naming the test and the fix.

What it watches is what the suite starts processes with:
L{svcd.devkit.daemons.Daemon.start} (every twistd of the gateway
harness), L{svcd.devkit.daemons.twistdCommand} (the tests that run twistd
themselves) and L{svcd.devkit.upstream.client.ScriptedUpstream.start}. A test
that builds its own command line (dev/gateway's tests, a daemonised
twistd) is marked by hand. PostgreSQL and Redis servers are not end to
end: the quick run has them too, one of each per worker.

Loaded for every test module by tests/conftest.py (pytest_plugins).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Generator
from typing import Any

import pytest

import svcd.devkit.daemons
import svcd.devkit.upstream.client

MARKER = "e2e"

# The test being run (its setup, call and teardown, module fixtures
# included), or None between tests.
_current: pytest.Item | None = None


class NotMarkedE2E(AssertionError):
    """
    A test not marked C{e2e} started a real daemon or process.
    """


def check(what: str) -> None:
    """
    Fail if the test being run is not marked C{e2e}.

    @param what: what it starts, for the message.
    """
    item = _current
    if item is None or item.get_closest_marker(MARKER) is not None:
        return
    raise NotMarkedE2E(
        f"{item.nodeid} starts {what} but is not marked e2e: add "
        f"'pytestmark = pytest.mark.e2e' to its module (or @pytest.mark.e2e to "
        f'the test), so that dev/test -m "not e2e" stays quick (tests/e2eguard.py)'
    )


def _guarded(function: Callable[..., Any], what: Callable[..., str]) -> Callable[..., Any]:
    if getattr(function, "_e2eGuarded", False):
        return function

    @functools.wraps(function)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        check(what(*args, **kwargs))
        return function(*args, **kwargs)

    guarded._e2eGuarded = True  # type: ignore[attr-defined]
    return guarded


def install() -> None:
    """
    Watch the functions that start daemons and the upstream process.
    """
    daemons = svcd.devkit.daemons
    daemons.Daemon.start = _guarded(  # type: ignore[method-assign]
        daemons.Daemon.start, lambda daemon: f"a real {daemon.plugin} (Daemon.start)"
    )
    daemons.twistdCommand = _guarded(
        daemons.twistdCommand, lambda plugin: f"a real {plugin} (twistdCommand)"
    )
    upstream = svcd.devkit.upstream.client.ScriptedUpstream
    upstream.start = _guarded(  # type: ignore[method-assign]
        upstream.start, lambda *args, **kwargs: "the scripted upstream's process"
    )


# At import, when conftest.py loads this plugin: before any test module
# imports twistdCommand by name.
install()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Generator[None, None, None]:
    global _current
    _current = item
    try:
        yield
    finally:
        _current = None
