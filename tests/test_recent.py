"""
L{svcd.common.recent.RecentResult} on a fake clock: one call at a time,
shared by every caller that arrives while it runs, and its outcome reused
for C{maxAge} seconds from the call's start, never longer (decisions D10,
the proxy's /ready).
"""

from __future__ import annotations

from typing import Any

from twisted.internet.defer import CancelledError, Deferred, succeed
from twisted.internet.task import Clock
from twisted.python.failure import Failure

from svcd.common.recent import RecentResult


class Calls:
    """
    A fake dependency: each call is left pending until the test ends it.
    """

    def __init__(self) -> None:
        self.pending: list[Deferred[str]] = []

    def __call__(self) -> Deferred[str]:
        call: Deferred[str] = Deferred()
        self.pending.append(call)
        return call


def outcome(pending: Deferred[Any]) -> list[Any]:
    results: list[Any] = []
    pending.addBoth(results.append)
    return results


def test_concurrentCallersShareOneCall() -> None:
    """
    Callers arriving while a call is in flight share it: a thousand
    callers, one call, every one of them answered.
    """
    clock, calls = Clock(), Calls()
    recent = RecentResult(calls, clock, 0.25)
    answers = [outcome(recent.get()) for _ in range(1000)]
    assert len(calls.pending) == 1 and recent.calls == 1
    assert not any(answers)
    clock.advance(0.4)
    calls.pending[0].callback("ok")
    assert answers == [["ok"]] * 1000


def test_outcomeReusedUntilMaxAgeFromTheStart() -> None:
    """
    After the call, callers get its outcome without a call until C{maxAge}
    has passed since the call began; then the next caller starts a new
    call.
    """
    clock, calls = Clock(), Calls()
    recent = RecentResult(calls, clock, 0.25)
    first = outcome(recent.get())
    clock.advance(0.1)
    calls.pending[0].callback("one")
    assert first == ["one"]
    clock.advance(0.149)
    assert outcome(recent.get()) == ["one"]
    assert len(calls.pending) == 1
    clock.advance(0.001)
    later = outcome(recent.get())
    assert later == [] and len(calls.pending) == 2
    calls.pending[1].callback("two")
    assert later == ["two"]


def test_slowCallIsNotReused() -> None:
    """
    A call that took longer than C{maxAge} answers the callers that waited
    for it, but not the next one, which starts a new call.
    """
    clock, calls = Clock(), Calls()
    recent = RecentResult(calls, clock, 0.25)
    waited = outcome(recent.get())
    clock.advance(0.75)
    calls.pending[0].callback("slow")
    assert waited == ["slow"]
    assert outcome(recent.get()) == []
    assert len(calls.pending) == 2


def test_failureIsSharedAndReused() -> None:
    """
    A failed call's failure goes to every caller that shared it and to
    callers within C{maxAge}, as a result would.
    """
    clock, calls = Clock(), Calls()
    recent = RecentResult(calls, clock, 0.25)
    sharers = [outcome(recent.get()) for _ in range(3)]
    calls.pending[0].errback(RuntimeError("down"))
    for answer in [*sharers, outcome(recent.get())]:
        [failure] = answer
        assert isinstance(failure, Failure) and failure.check(RuntimeError)
    assert len(calls.pending) == 1


def test_synchronousCall() -> None:
    """
    A call that answers at once answers its caller, and the next callers
    within C{maxAge}, at once.
    """
    clock = Clock()
    made: list[int] = []

    def call() -> Deferred[int]:
        made.append(1)
        return succeed(len(made))

    recent = RecentResult(call, clock, 0.25)
    assert outcome(recent.get()) == [1]
    assert outcome(recent.get()) == [1]
    clock.advance(0.25)
    assert outcome(recent.get()) == [2]


def test_callRaisingIsAFailure() -> None:
    """
    A call that raises instead of returning a Deferred fails its callers
    instead of breaking the next ones.
    """
    clock = Clock()

    def call() -> Deferred[str]:
        raise ValueError("broken")

    recent = RecentResult(call, clock, 0.25)
    [failure] = outcome(recent.get())
    assert failure.check(ValueError)
    clock.advance(0.25)
    [again] = outcome(recent.get())
    assert again.check(ValueError)
    assert recent.calls == 2


def test_cancellingOneCallerLeavesTheCall() -> None:
    """
    A caller that gives up (its client went away) is withdrawn; the call
    goes on and answers the others.
    """
    clock, calls = Clock(), Calls()
    recent = RecentResult(calls, clock, 0.25)
    leaving = recent.get()
    staying = outcome(recent.get())
    leaving.cancel()
    assert outcome(leaving)[0].check(CancelledError)
    assert not calls.pending[0].called
    calls.pending[0].callback("ok")
    assert staying == ["ok"]
