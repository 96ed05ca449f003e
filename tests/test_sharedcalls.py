"""
Tests of L{svcd.proxy.validation.sharedcalls}: one call per key at a time, and no
caller ever answered by a call sent before it asked.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from typing import Any

import pytest
from twisted.internet.defer import CancelledError, Deferred

from svcd.proxy.validation.sharedcalls import SharedCalls

caller: contextvars.ContextVar[str] = contextvars.ContextVar("caller", default="none")


class Calls:
    """
    A fake remote: records each call sent, with the context it was sent in,
    and leaves it pending until the test ends it.
    """

    def __init__(self) -> None:
        self.sent: list[tuple[str, str, Deferred[str]]] = []
        self.cancelled: list[str] = []

    def sender(self, key: str) -> Callable[[], Deferred[str]]:
        def send() -> Deferred[str]:
            def cancel(_: Deferred[str]) -> None:
                self.cancelled.append(key)

            call: Deferred[str] = Deferred(cancel)
            self.sent.append((key, caller.get(), call))
            return call

        return send


def ask(shared: SharedCalls[str, str], calls: Calls, key: str, who: str) -> Deferred[str]:
    token = caller.set(who)
    try:
        return shared.call(key, calls.sender(key))
    finally:
        caller.reset(token)


def outcome(d: Deferred[str]) -> list[Any]:
    results: list[Any] = []
    d.addBoth(results.append)
    return results


def test_idleKeySendsAtOnce() -> None:
    shared: SharedCalls[str, str] = SharedCalls()
    calls = Calls()
    answer = outcome(ask(shared, calls, "t", "a"))
    assert [(key, who) for key, who, _ in calls.sent] == [("t", "a")]
    calls.sent[0][2].callback("ok")
    assert answer == ["ok"]
    assert shared.inFlight() == 0


def test_latecomersShareTheNextCallNotTheCurrentOne() -> None:
    """
    Callers arriving while a call is in flight get nothing from it; they
    share one call sent when it ends, made in the first latecomer's context.
    """
    shared: SharedCalls[str, str] = SharedCalls()
    calls = Calls()
    first = outcome(ask(shared, calls, "t", "a"))
    second = outcome(ask(shared, calls, "t", "b"))
    third = outcome(ask(shared, calls, "t", "c"))
    assert len(calls.sent) == 1

    calls.sent[0][2].callback("before")
    assert first == ["before"]
    assert second == third == []
    assert [(key, who) for key, who, _ in calls.sent] == [("t", "a"), ("t", "b")]

    calls.sent[1][2].callback("after")
    assert second == third == ["after"]
    assert len(calls.sent) == 2
    assert shared.inFlight() == 0


def test_keysAreIndependent() -> None:
    shared: SharedCalls[str, str] = SharedCalls()
    calls = Calls()
    one = outcome(ask(shared, calls, "t1", "a"))
    two = outcome(ask(shared, calls, "t2", "b"))
    assert [key for key, _, _ in calls.sent] == ["t1", "t2"]
    calls.sent[1][2].callback("2")
    calls.sent[0][2].callback("1")
    assert (one, two) == (["1"], ["2"])


def test_failureReachesEverySharer() -> None:
    shared: SharedCalls[str, str] = SharedCalls()
    calls = Calls()
    ask(shared, calls, "t", "a").addErrback(lambda f: None)
    later = [outcome(ask(shared, calls, "t", who)) for who in "bc"]
    calls.sent[0][2].callback("ok")
    error = ValueError("refused")
    calls.sent[1][2].errback(error)
    for each in later:
        assert len(each) == 1
        assert each[0].value is error


def test_aFailedCallDoesNotFailTheLatecomers() -> None:
    """
    The latecomers' own call is sent even when the current one fails.
    """
    shared: SharedCalls[str, str] = SharedCalls()
    calls = Calls()
    first = outcome(ask(shared, calls, "t", "a"))
    second = outcome(ask(shared, calls, "t", "b"))
    calls.sent[0][2].errback(ValueError("timeout"))
    assert first[0].check(ValueError)
    assert second == []
    calls.sent[1][2].callback("ok")
    assert second == ["ok"]


def test_withdrawingOneSharerKeepsTheCallForTheOthers() -> None:
    shared: SharedCalls[str, str] = SharedCalls()
    calls = Calls()
    ask(shared, calls, "t", "a")
    leaving = ask(shared, calls, "t", "b")
    staying = outcome(ask(shared, calls, "t", "c"))
    calls.sent[0][2].callback("first")
    leaving.addErrback(lambda f: f.trap(CancelledError))
    leaving.cancel()
    assert calls.cancelled == []
    calls.sent[1][2].callback("second")
    assert staying == ["second"]


def test_aCallEveryoneWithdrewFromIsCancelled() -> None:
    shared: SharedCalls[str, str] = SharedCalls()
    calls = Calls()
    only = ask(shared, calls, "t", "a")
    gone = outcome(only)
    only.cancel()
    assert calls.cancelled == ["t"]
    assert gone[0].check(CancelledError)
    assert shared.inFlight() == 0


def test_aBatchEveryoneWithdrewFromIsNeverSent() -> None:
    shared: SharedCalls[str, str] = SharedCalls()
    calls = Calls()
    first = outcome(ask(shared, calls, "t", "a"))
    waiting = ask(shared, calls, "t", "b")
    waiting.addErrback(lambda f: f.trap(CancelledError))
    waiting.cancel()
    calls.sent[0][2].callback("ok")
    assert first == ["ok"]
    assert len(calls.sent) == 1
    assert shared.inFlight() == 0


def test_aSenderThatRaisesFailsItsCallers() -> None:
    shared: SharedCalls[str, str] = SharedCalls()

    def broken() -> Deferred[str]:
        raise RuntimeError("closed")

    answer = outcome(shared.call("t", broken))
    assert answer[0].check(RuntimeError)
    assert shared.inFlight() == 0


@pytest.mark.parametrize("sharers", [1, 5, 50])
def test_oneCallPerBatch(sharers: int) -> None:
    """
    However many callers arrive during a call, they cost one more call.
    """
    shared: SharedCalls[str, str] = SharedCalls()
    calls = Calls()
    ask(shared, calls, "t", "first")
    answers = [outcome(ask(shared, calls, "t", str(n))) for n in range(sharers)]
    calls.sent[0][2].callback("old")
    calls.sent[1][2].callback("new")
    assert len(calls.sent) == 2
    assert all(answer == ["new"] for answer in answers)


def test_joinCurrentSharesTheCallInFlight() -> None:
    """
    A caller asking again after a call it shared failed may share the call
    in flight (sent after it first asked); without a call in flight it
    sends as usual.
    """
    shared: SharedCalls[str, str] = SharedCalls()
    calls = Calls()
    ask(shared, calls, "t", "a")
    again = outcome(shared.call("t", calls.sender("t"), joinCurrent=True))
    assert len(calls.sent) == 1
    calls.sent[0][2].callback("current")
    assert again == ["current"]
    alone = outcome(shared.call("t", calls.sender("t"), joinCurrent=True))
    assert len(calls.sent) == 2
    calls.sent[1][2].callback("own")
    assert alone == ["own"]
    assert shared.inFlight() == 0
