"""
svcd.common.coalesce.Coalescer with plain Deferreds (no reactor): an item
goes at once, alone, while its key has fewer than maxInFlight calls in
flight; those that come meanwhile are held and go together (at most
maxBatch a call, in order) when one ends, however it ends; keys never wait
for one another; a held item can be withdrawn. And, as properties,
svcd.metered.embedder.apportioned: how a coalesced forward's usage is
shared among its items' rows (whole parts that add up exactly).
"""

from __future__ import annotations

import contextvars
from fractions import Fraction
from typing import cast

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.internet.defer import Deferred
from twisted.logger import ILogObserver, Logger
from twisted.python.failure import Failure

from svcd.common.coalesce import Coalescer
from svcd.metered.embedder import apportioned, usageShares
from svcd.metering.usage import Usage


@attrs.define
class Sends:
    """
    A send that records each call and returns a Deferred the test fires to
    end it; C{raising} makes the next call raise it instead (once).
    """

    calls: list[tuple[str, list[int]]] = attrs.Factory(list)
    ends: list[Deferred[None]] = attrs.Factory(list)
    raising: Exception | None = None

    def __call__(self, key: str, items: list[int]) -> Deferred[None]:
        self.calls.append((key, list(items)))
        if self.raising is not None:
            error, self.raising = self.raising, None
            raise error
        ended: Deferred[None] = Deferred()
        self.ends.append(ended)
        return ended


def coalescer(maxBatch: int = 32, maxInFlight: int = 1) -> tuple[Coalescer[str, int], Sends]:
    sends = Sends()
    return Coalescer(sends, maxBatch, maxInFlight), sends


def test_theFirstItemIsSentAtOnceAlone() -> None:
    """
    A key with no call in flight sends its item at once, in a call of its
    own, and holds nothing.
    """
    coalesced, sends = coalescer()
    coalesced.submit("a", 1)
    assert sends.calls == [("a", [1])]
    assert coalesced.held("a") == 0


def test_itemsDuringACallAreHeldThenSentTogether() -> None:
    """
    Items submitted while the key's call is in flight are held, and sent
    together, in order, as one call as soon as it ends; once that call
    ends too, the next item goes at once again.
    """
    coalesced, sends = coalescer()
    coalesced.submit("a", 1)
    coalesced.submit("a", 2)
    coalesced.submit("a", 3)
    assert sends.calls == [("a", [1])]
    assert coalesced.held("a") == 2
    sends.ends[0].callback(None)
    assert sends.calls == [("a", [1]), ("a", [2, 3])]
    assert coalesced.held("a") == 0
    sends.ends[1].callback(None)
    assert len(sends.calls) == 2
    coalesced.submit("a", 4)
    assert sends.calls[-1] == ("a", [4])


def test_maxBatchSplitsTheHeldItemsOverSuccessiveCalls() -> None:
    """
    At most maxBatch held items go in one call; the rest wait for that
    call's end, and go in the order they were submitted.
    """
    coalesced, sends = coalescer(maxBatch=2)
    for item in range(1, 7):
        coalesced.submit("a", item)
    assert sends.calls == [("a", [1])] and coalesced.held("a") == 5
    sends.ends[0].callback(None)
    assert sends.calls[-1] == ("a", [2, 3]) and coalesced.held("a") == 3
    sends.ends[1].callback(None)
    assert sends.calls[-1] == ("a", [4, 5]) and coalesced.held("a") == 1
    sends.ends[2].callback(None)
    assert sends.calls[-1] == ("a", [6]) and coalesced.held("a") == 0
    sends.ends[3].callback(None)
    assert len(sends.calls) == 4


def test_maxInFlightCallsGoAloneBeforeAnyIsHeld() -> None:
    """
    With maxInFlight 2, two items go at once, each alone; the third and
    fourth are held, and go together when either call ends; then one call
    ending with nothing held sends nothing, and frees a place for the next
    item to go at once.
    """
    coalesced, sends = coalescer(maxInFlight=2)
    coalesced.submit("a", 1)
    coalesced.submit("a", 2)
    assert sends.calls == [("a", [1]), ("a", [2])]
    coalesced.submit("a", 3)
    coalesced.submit("a", 4)
    assert len(sends.calls) == 2 and coalesced.held("a") == 2
    sends.ends[1].callback(None)
    assert sends.calls[-1] == ("a", [3, 4]) and coalesced.held("a") == 0
    coalesced.submit("a", 5)
    assert len(sends.calls) == 3 and coalesced.held("a") == 1
    sends.ends[0].callback(None)
    assert sends.calls[-1] == ("a", [5])
    sends.ends[2].callback(None)
    coalesced.submit("a", 6)
    assert sends.calls[-1] == ("a", [6]) and coalesced.held("a") == 0


def test_keysAreIndependent() -> None:
    """
    Another key's item goes at once while a key's call is in flight, and
    a key's call ending sends its own held items only: keys never share a
    call.
    """
    coalesced, sends = coalescer()
    coalesced.submit("a", 1)
    coalesced.submit("b", 10)
    assert sends.calls == [("a", [1]), ("b", [10])]
    coalesced.submit("a", 2)
    coalesced.submit("b", 20)
    assert (coalesced.held("a"), coalesced.held("b")) == (1, 1)
    sends.ends[0].callback(None)
    assert sends.calls[-1] == ("a", [2])
    assert (coalesced.held("a"), coalesced.held("b")) == (0, 1)
    sends.ends[1].callback(None)
    assert sends.calls[-1] == ("b", [20])


def test_aHeldItemCanBeWithdrawn() -> None:
    """
    withdraw takes back a held item (True), which is then never sent;
    withdrawing it again, or an item already sent, or one of a key that
    holds nothing, says False.
    """
    coalesced, sends = coalescer()
    for item in (1, 2, 3):
        coalesced.submit("a", item)
    assert coalesced.withdraw("a", 2) is True
    assert coalesced.held("a") == 1
    assert coalesced.withdraw("a", 2) is False
    assert coalesced.withdraw("a", 1) is False
    assert coalesced.withdraw("b", 1) is False
    sends.ends[0].callback(None)
    assert sends.calls == [("a", [1]), ("a", [3])]
    assert coalesced.withdraw("a", 3) is False


def test_withdrawingEveryHeldItemSendsNothingMore() -> None:
    """
    When every held item was withdrawn, the call's end sends nothing, and
    the key's next item goes at once.
    """
    coalesced, sends = coalescer()
    coalesced.submit("a", 1)
    coalesced.submit("a", 2)
    assert coalesced.withdraw("a", 2) is True
    assert coalesced.held("a") == 0
    sends.ends[0].callback(None)
    assert sends.calls == [("a", [1])]
    coalesced.submit("a", 3)
    assert sends.calls[-1] == ("a", [3])


def test_aFailedCallReleasesTheKey() -> None:
    """
    A call whose Deferred fails ends like any other: the held items are
    sent, and the failure is handled (the Deferred's result after the
    coalescer's callback is None, not a Failure left to be logged as an
    unhandled error).
    """
    coalesced, sends = coalescer()
    coalesced.submit("a", 1)
    coalesced.submit("a", 2)
    sends.ends[0].errback(Failure(RuntimeError("the call failed")))
    assert sends.calls == [("a", [1]), ("a", [2])]
    after: list[object] = []
    sends.ends[0].addBoth(after.append)
    assert after == [None]
    sends.ends[1].callback(None)
    coalesced.submit("a", 3)
    assert sends.calls[-1] == ("a", [3])


def test_aSendThatRaisesReleasesTheKey() -> None:
    """
    A send that raises at once raises out of submit, and leaves no call in
    flight: the key's next item is sent at once, not held forever.
    """
    coalesced, sends = coalescer()
    sends.raising = RuntimeError("could not send")
    with pytest.raises(RuntimeError, match="could not send"):
        coalesced.submit("a", 1)
    coalesced.submit("a", 2)
    assert sends.calls == [("a", [1]), ("a", [2])]
    assert coalesced.held("a") == 0


def test_heldCountsEachKeysWaitingItems() -> None:
    """
    held counts the items of a key that wait, none for a key never seen,
    and goes down as they are sent.
    """
    coalesced, sends = coalescer(maxBatch=3)
    assert coalesced.held("a") == 0
    for item in range(5):
        coalesced.submit("a", item)
    coalesced.submit("b", 9)
    assert (coalesced.held("a"), coalesced.held("b"), coalesced.held("c")) == (4, 0, 0)
    sends.ends[0].callback(None)
    assert coalesced.held("a") == 1


@pytest.mark.parametrize(("maxBatch", "maxInFlight"), [(0, 1), (1, 0), (-1, 1), (1, -3)])
def test_nothingToSendIsRefused(maxBatch: int, maxInFlight: int) -> None:
    """
    A batch of no item, or no call in flight, makes no coalescer.
    """
    with pytest.raises(ValueError):
        Coalescer(Sends(), maxBatch, maxInFlight)


_WEIGHTS = st.lists(st.integers(min_value=0, max_value=10_000), min_size=1, max_size=40)
_TOTALS = st.integers(min_value=0, max_value=10**9)


@settings(max_examples=300, deadline=None)
@given(total=_TOTALS, weights=_WEIGHTS)
def test_apportionedPartsAddUpAndFollowTheWeights(total: int, weights: list[int]) -> None:
    """
    Each part is a whole number of at least 0, less than 1 from its exact
    share (total times its weight over all the weights; an equal share
    each when every weight is 0), and the parts add up to the total
    exactly.
    """
    parts = apportioned(total, weights)
    assert len(parts) == len(weights)
    assert all(type(part) is int and part >= 0 for part in parts)
    assert sum(parts) == total
    weight = sum(weights)
    for part, each in zip(parts, weights, strict=True):
        exact = Fraction(total * each, weight) if weight else Fraction(total, len(weights))
        assert abs(part - exact) < 1


@settings(max_examples=200, deadline=None)
@given(total=_TOTALS, weight=st.integers(min_value=0, max_value=10_000), count=st.integers(1, 40))
def test_equalWeightsGiveEqualParts(total: int, weight: int, count: int) -> None:
    """
    Equal weights (0 included) give parts that differ by 1 at most, the
    larger ones first (ties go to the first).
    """
    parts = apportioned(total, [weight] * count)
    assert max(parts) - min(parts) <= 1
    assert parts == sorted(parts, reverse=True)


@settings(max_examples=200, deadline=None)
@given(total=_TOTALS, weights=_WEIGHTS)
def test_aZeroWeightGetsNothingBesideAPositiveOne(total: int, weights: list[int]) -> None:
    """
    Where some weight is positive, a weight of 0 gets a part of 0: a text
    that weighs nothing is counted nothing of the provider's usage.
    """
    weights = [*weights, 1]
    parts = apportioned(total, weights)
    assert all(part == 0 for part, each in zip(parts, weights, strict=True) if each == 0)


def test_apportionedExamples() -> None:
    """
    Worked examples: rounding down, then the largest remainders (the
    first on a tie) get what is left.
    """
    assert apportioned(10, [4, 10]) == [3, 7]
    assert apportioned(10, [1, 1, 1]) == [4, 3, 3]
    assert apportioned(7, [0, 0]) == [4, 3]
    assert apportioned(0, [3, 5]) == [0, 0]
    assert apportioned(5, [0, 2]) == [0, 5]


LABEL: contextvars.ContextVar[str] = contextvars.ContextVar("LABEL", default="none")


def test_aCallIsSentInItsOwnRequestsContext() -> None:
    """
    An item sent at once is sent in its submitter's context; one held and
    then sent alone, in the context it was submitted in (not that of the
    call whose end sent it); a call shared by several items, in an empty
    context: a call reads its trace context from the current span, and a
    shared call belongs to no one request's trace.
    """
    seen: list[tuple[list[int], str]] = []
    ends: list[Deferred[None]] = []

    def send(key: str, items: list[int]) -> Deferred[None]:
        seen.append((items, LABEL.get()))
        ended: Deferred[None] = Deferred()
        ends.append(ended)
        return ended

    made = Coalescer(send, 32)

    def submitAs(label: str, item: int) -> None:
        LABEL.set(label)
        made.submit("k", item)

    for label, item in (("first", 1), ("second", 2)):
        contextvars.copy_context().run(submitAs, label, item)
    contextvars.copy_context().run(LABEL.set, "ending")
    ends[0].callback(None)
    for label, item in (("third", 3), ("fourth", 4)):
        contextvars.copy_context().run(submitAs, label, item)
    ends[1].callback(None)
    assert seen == [([1], "first"), ([2], "second"), ([3, 4], "none")]


def test_aHeldBatchWhoseSendRaisesIsLogged() -> None:
    """
    A send that raises for a held batch (a sender's bug: it should answer
    its items) is logged with its traceback, not raised into the call that
    just ended, and frees the key: the next item goes at once.
    """
    events: list[dict[str, object]] = []
    made, sends = coalescer()
    made.log = Logger(observer=cast(ILogObserver, events.append))
    made.submit("k", 1)
    made.submit("k", 2)
    sends.raising = RuntimeError("broken sender")
    ended = sends.ends[0]
    ended.callback(None)
    outcome: list[object] = []
    ended.addBoth(outcome.append)
    assert outcome == [None]
    [event] = events
    failure = event["log_failure"]
    assert isinstance(failure, Failure) and failure.check(RuntimeError)
    made.submit("k", 3)
    assert sends.calls[-1] == ("k", [3])


def test_apportionedNeedsSomethingToShareAmong() -> None:
    with pytest.raises(ValueError):
        apportioned(5, [])


@settings(max_examples=300, deadline=None)
@given(
    prompt=st.integers(0, 10_000),
    cachedPart=st.integers(0, 10_000),
    estimates=st.lists(st.integers(1, 3_000), min_size=1, max_size=32),
)
def test_usageSharesAddUpAndKeepCachedWithinPrompt(
    prompt: int, cachedPart: int, estimates: list[int]
) -> None:
    """
    A shared forward's usage split among its texts: the prompt and cached
    tokens each add up exactly to the provider's (cached at most the
    prompt), and no text's cached part exceeds its prompt part (a cached
    part clamped per text would have made the rows add up to less).
    """
    cached = min(cachedPart, prompt)
    shares = usageShares(Usage(prompt, 0, cached), estimates)
    assert all(share is not None for share in shares)
    parts = [share for share in shares if share is not None]
    assert sum(part.promptTokens for part in parts) == prompt
    assert sum(part.cachedTokens for part in parts) == cached
    assert all(0 <= part.cachedTokens <= part.promptTokens for part in parts)
    assert usageShares(None, estimates) == [None] * len(estimates)
