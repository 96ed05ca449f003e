"""
Fixtures for tests that need an OpenAI-compatible provider: the scripted
upstream of L{svcd.devkit.upstream}, run as a process of its own on a
loopback port. Loaded for every test module by tests/conftest.py
(pytest_plugins).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from svcd.devkit.upstream.client import ScriptedUpstream


@pytest.fixture
def scriptedUpstream(tmp_path: Path) -> Iterator[ScriptedUpstream]:
    """
    A scripted upstream of this test's own, with no API key: point a
    provider's C{base_url} (or the C{openai} SDK) at C{.baseURL}, choose
    each answer with the model, read what arrived with C{.requests()}.
    """
    upstream = ScriptedUpstream(tmp_path / "upstream").start()
    yield upstream
    upstream.stop()


@pytest.fixture(scope="module")
def moduleUpstream(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ScriptedUpstream]:
    """
    One scripted upstream for a whole test module, for the modules whose
    tests need one only to answer (its scripts keep no state from one
    request to the next) and read nothing of it but their own requests:
    such a module defines its C{scriptedUpstream} as this one with its
    log of requests emptied (L{clearedUpstream}). Its tests then run on
    one worker (conftest.py), and the module starts one upstream process
    instead of one per test (each some 0.4 s of CPU).
    """
    upstream = ScriptedUpstream(tmp_path_factory.mktemp("upstream")).start()
    yield upstream
    upstream.stop()


def clearedUpstream(upstream: ScriptedUpstream) -> ScriptedUpstream:
    """
    C{upstream} with its log of requests emptied, for a test to read only
    its own.
    """
    upstream.clearRequests()
    return upstream


@pytest.fixture
def startScriptedUpstream(tmp_path: Path) -> Iterator[Callable[..., ScriptedUpstream]]:
    """
    A function that starts one more scripted upstream, taking
    L{ScriptedUpstream}'s keyword arguments (C{apiKey}), for tests that need
    a key or several servers; each is stopped after the test.
    """
    started: list[ScriptedUpstream] = []

    def start(apiKey: str | None = None) -> ScriptedUpstream:
        upstream = ScriptedUpstream(tmp_path / f"upstream-{len(started) + 1}", apiKey=apiKey)
        started.append(upstream)
        return upstream.start()

    yield start
    for upstream in started:
        upstream.stop()
