"""
The routing core of decisions D15 (svcd.providers.routing and
svcd.providers.cooldowns), on a task.Clock with a seeded random source:
weights honoured, least_busy and latency steering away from a slow
deployment in a simulated run, the cooldown rules, max_attempts, and
Hypothesis properties of every plan.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from random import Random

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.internet.task import Clock

from svcd.metering.models import (
    LATENCY,
    LEAST_BUSY,
    ROUTINGS,
    WEIGHTED,
    Deployment,
    Model,
    Provider,
)
from svcd.providers.cooldowns import (
    FAILURES,
    RATE_LIMITED,
    Cooldown,
    Cooling,
    retryAfterSeconds,
)
from svcd.providers.routing import (
    LATENCY_WINDOW,
    DeploymentStatus,
    Flight,
    LatencyMean,
    Router,
    Try,
)


def provider(name: str, timeout: float = 60.0) -> Provider:
    return Provider(name, f"https://{name}.example/v1", timeout=timeout)


def model(
    name: str,
    weights: Sequence[float] = (1.0,),
    routing: str = WEIGHTED,
    fallbacks: tuple[str, ...] = (),
    maxAttempts: int | None = None,
    cooldown: float = 10.0,
    cooldownFailures: int = 3,
) -> Model:
    """
    A model of one deployment per weight, on providers C{<name>0},
    C{<name>1}...
    """
    deployments = tuple(
        Deployment(provider(f"{name}{number}"), name, float(weight))
        for number, weight in enumerate(weights)
    )
    return Model(
        name,
        deployments[0].provider,
        name,
        fallbacks=fallbacks,
        deployments=deployments,
        routing=routing,
        maxAttempts=maxAttempts,
        cooldown=cooldown,
        cooldownFailures=cooldownFailures,
    )


def tries(plan: Iterable[Try]) -> list[tuple[str, int]]:
    return [(attempt.model.name, attempt.index) for attempt in plan]


def firstPicks(router: Router, chain: Sequence[Model], count: int) -> Counter[int]:
    picks: Counter[int] = Counter()
    for _ in range(count):
        picks[next(router.plan(chain)).index] += 1
    return picks


def simulate(routing: str, latencies: Sequence[float], rate: float, requests: int) -> Counter[int]:
    """
    C{requests} requests at C{rate} a second, each sent to its plan's first
    deployment, whose first byte and end come after that deployment's
    latency: the deployments each request was sent to.
    """
    clock = Clock()
    router = Router(clock, Random(7))
    pool = model("pool", [1.0] * len(latencies), routing)
    picks: Counter[int] = Counter()

    def answer(flight: Flight) -> None:
        flight.firstByte()
        flight.finished()

    for _ in range(requests):
        clock.advance(1 / rate)
        attempt = next(router.plan([pool]))
        picks[attempt.index] += 1
        clock.callLater(latencies[attempt.index], answer, router.start(attempt))
    clock.advance(max(latencies))
    assert all(status.inFlight == 0 for status in router.status(pool))
    return picks


# Weighted routing.


def test_weightsHonoured() -> None:
    """
    Three deployments weighted 1:1:2: the first tries of 8,000 requests
    split 2,000/2,000/4,000 (smooth weighted round-robin: exact at a
    whole number of cycles, where a weighted random draw is off by 39 for
    a quarter's share), and the second tries after the heavy one split
    within 3 points of 50/50 among the other two (the rest of the order
    is drawn by weight).
    """
    router = Router(Clock(), Random(1))
    pool = model("pool", [1, 1, 2])
    first: Counter[int] = Counter()
    secondAfterHeavy: Counter[int] = Counter()
    for _ in range(8000):
        order = [attempt.index for attempt in router.plan([pool])]
        assert sorted(order) == [0, 1, 2]
        first[order[0]] += 1
        if order[0] == 2:
            secondAfterHeavy[order[1]] += 1
    assert [first[index] for index in range(3)] == [2000, 2000, 4000]
    total = sum(secondAfterHeavy.values())
    assert secondAfterHeavy[0] / total == pytest.approx(0.5, abs=0.03)


def test_smoothRoundRobin() -> None:
    """
    Weighted first tries interleave (1:1:2 goes c, a, b, c, again) and
    stay within about one try of their share over any run, whatever the
    weights; a deployment cooling down is passed over and gains nothing
    meanwhile, so that when it comes back the split goes on as before
    rather than making up for its absence.
    """
    router = Router(Clock(), Random(19))
    pool = model("pool", [1, 1, 2])
    picks = [next(router.plan([pool])).index for _ in range(8)]
    assert picks == [2, 0, 1, 2, 2, 0, 1, 2]

    weights = [0.7, 5.0, 1.5, 5.0, 0.3]
    uneven = model("uneven", weights)
    counts = [0] * len(weights)
    for request in range(1, 5001):
        counts[next(router.plan([uneven])).index] += 1
        for index, weight in enumerate(weights):
            assert abs(counts[index] - request * weight / sum(weights)) < 1.5

    clock = Clock()
    router = Router(clock, Random(20))
    router.start(Try(pool, 2)).rateLimited(10.0)
    assert Counter(next(router.plan([pool])).index for _ in range(100)) == {0: 50, 1: 50}
    clock.advance(10.0)
    assert Counter(next(router.plan([pool])).index for _ in range(100)) == {0: 25, 1: 25, 2: 50}


def test_fractionalWeights() -> None:
    """
    Weights need not be integers: 0.7 and 0.3 split 70/30.
    """
    picks = firstPicks(Router(Clock(), Random(2)), [model("pool", [0.7, 0.3])], 8000)
    assert picks[0] / 8000 == pytest.approx(0.7, abs=0.03)


def test_oneDeploymentDrawsNothing() -> None:
    """
    A model of one deployment (every model of a file without deployments)
    is tried without a draw, whatever its state: cooling down, it is
    still its own first try.
    """

    class NoDraws(Random):
        def random(self) -> float:
            raise AssertionError("no draw for one deployment")

    clock = Clock()
    router = Router(clock, NoDraws())
    fast = model("fast")
    router.start(next(router.plan([fast]))).rateLimited(30.0)
    assert router.status(fast)[0].coolingUntil == 30.0
    assert tries(router.plan([fast])) == [("fast", 0)]


# least_busy and latency: away from a slow deployment.


@pytest.mark.parametrize("routing", [LEAST_BUSY, LATENCY])
def test_steersAwayFromASlowDeployment(routing: str) -> None:
    """
    With one deployment of three ten times slower than the others (1 s to
    the first byte against 0.1 s), 10,000 requests at 200 a second: it gets
    under 10% of them; weighted routing, blind to it, gives it about a
    third.
    """
    latencies = [0.1, 1.0, 0.1]
    picks = simulate(routing, latencies, rate=200, requests=10_000)
    assert picks[1] / 10_000 < 0.10, picks
    blind = simulate(WEIGHTED, latencies, rate=200, requests=10_000)
    assert blind[1] / 10_000 == pytest.approx(1 / 3, abs=0.03)


def test_leastBusyCountsTriesInFlight() -> None:
    """
    least_busy tries the deployment with fewest tries in flight first,
    then the next fewest; a try in flight until its flight ends, however
    it ends, and ending it twice counts once.
    """
    router = Router(Clock(), Random(3))
    pool = model("pool", [1, 1, 1], LEAST_BUSY)
    flights = [router.start(Try(pool, 0)) for _ in range(3)] + [router.start(Try(pool, 2))]
    assert [attempt.index for attempt in router.plan([pool])] == [1, 2, 0]
    assert [status.inFlight for status in router.status(pool)] == [3, 0, 1]
    flights[0].finished()
    flights[0].finished()
    flights[1].failed()
    flights[2].rateLimited(None)
    assert [status.inFlight for status in router.status(pool)] == [0, 0, 1]


def test_leastBusyTiesByWeight() -> None:
    """
    At a light load (nothing in flight), least_busy splits by weight
    rather than sending everything to one deployment.
    """
    picks = firstPicks(Router(Clock(), Random(4)), [model("pool", [1, 3], LEAST_BUSY)], 8000)
    assert picks[1] / 8000 == pytest.approx(0.75, abs=0.03)


def test_latencyOrder() -> None:
    """
    latency: a deployment never measured first; then the lowest mean time
    to the first byte; a measure forgotten after a minute without sample
    makes it first again; a try waiting for its first byte makes its
    deployment at least as slow as the wait.
    """
    clock = Clock()
    router = Router(clock, Random(5))
    pool = model("pool", [1, 1, 1], LATENCY)
    for index, seconds in ((0, 0.3), (1, 0.1)):
        flight = router.start(Try(pool, index))
        clock.advance(seconds)
        assert flight.firstByte() == pytest.approx(seconds)
        flight.finished()
    assert [attempt.index for attempt in router.plan([pool])] == [2, 1, 0]
    waiting = router.start(Try(pool, 2))
    clock.advance(0.2)
    assert [attempt.index for attempt in router.plan([pool])] == [1, 2, 0]
    clock.advance(0.2)
    assert [attempt.index for attempt in router.plan([pool])] == [1, 0, 2]
    waiting.firstByte()
    waiting.finished()
    assert [attempt.index for attempt in router.plan([pool])] == [1, 0, 2]
    statuses = router.status(pool)
    assert [status.latency for status in statuses] == pytest.approx([0.3, 0.1, 0.4])
    clock.advance(LATENCY_WINDOW + 1)
    assert [status.latency for status in router.status(pool)] == [None, None, None]
    for _ in range(20):
        assert len(set(tries(router.plan([pool])))) == 3


def test_aFailureCountsAsItsDeadline() -> None:
    """
    A try that failed before its first byte is a sample as long as its
    deadline (first_byte_timeout, else the provider's timeout): a
    deployment refusing at once is not taken for a fast one.
    """
    clock = Clock()
    router = Router(clock, Random(6))
    pool = Model(
        "pool",
        provider("a"),
        deployments=(Deployment(provider("a"), "pool"), Deployment(provider("b", 20.0), "pool")),
        routing=LATENCY,
    )
    router.start(Try(pool, 1)).failed()
    assert router.status(pool)[1].latency == 20.0
    timed = Model(
        "t",
        provider("a"),
        deployments=(Deployment(provider("a"), "t"), Deployment(provider("b"), "t")),
        firstByteTimeout=2.0,
        routing=LATENCY,
    )
    flight = router.start(Try(timed, 1))
    clock.advance(3.0)
    flight.failed()
    assert router.status(timed)[1].latency == 3.0
    answered = router.start(Try(timed, 0))
    answered.firstByte()
    answered.failed()
    assert router.status(timed)[0].latency == 0.0


def test_latencyMeanSpansAboutAMinute() -> None:
    """
    The mean weighs samples by age: many fast samples after one slow one
    are not held by it; a sample a few minutes old hardly counts.
    """
    mean = LatencyMean()
    mean.add(0.0, 10.0)
    for tick in range(1, 1001):
        mean.add(tick / 1000, 1.0)
    assert mean.value(1.0) == pytest.approx(1.009, abs=0.001)
    assert mean.value(1.0 + LATENCY_WINDOW + 1) is None
    old = LatencyMean()
    old.add(0.0, 10.0)
    old.add(300.0, 1.0)
    assert old.value(300.0) == pytest.approx(1.0, abs=0.001)
    assert LatencyMean().value(0.0) is None


# Cooldowns.


def test_rateLimitedWithRetryAfter() -> None:
    """
    A 429 cools the deployment for its Retry-After: left out of plans
    until then, tried again after.
    """
    clock = Clock()
    router = Router(clock, Random(8))
    pool = model("pool", [1, 1])
    cooldown = router.start(Try(pool, 0)).rateLimited(12.0)
    assert cooldown == Cooldown(RATE_LIMITED, 12.0, 12.0)
    clock.advance(11.9)
    assert tries(router.plan([pool])) == [("pool", 1)]
    assert router.status(pool)[0] == DeploymentStatus("pool0", 0, 12.0, None)
    clock.advance(0.1)
    assert sorted(tries(router.plan([pool]))) == [("pool", 0), ("pool", 1)]


def test_rateLimitedWithoutRetryAfter() -> None:
    """
    A 429 without Retry-After cools for 5 s; one with a longer wait than
    60 s cools for 60 s; one of 0 s cools nothing; a shorter one does not
    cut a longer cooldown short.
    """
    clock = Clock()
    router = Router(clock, Random(9))
    pool = model("pool", [1, 1])
    assert router.start(Try(pool, 0)).rateLimited(None) == Cooldown(RATE_LIMITED, 5.0, 5.0)
    assert router.start(Try(pool, 1)).rateLimited(3600.0) == Cooldown(RATE_LIMITED, 60.0, 60.0)
    assert router.start(Try(pool, 1)).rateLimited(2.0) is None
    assert router.status(pool)[1].coolingUntil == 60.0
    clock.advance(5)
    assert router.start(Try(pool, 0)).rateLimited(0.0) is None
    assert router.status(pool)[0].coolingUntil is None


def test_threeFailuresInTenSeconds() -> None:
    """
    Three failures within 10 s cool a deployment for the model's cooldown
    (10 s by default); failures further apart do not; a failure while it
    cools starts nothing; the count starts again after.
    """
    clock = Clock()
    router = Router(clock, Random(10))
    pool = model("pool", [1, 1])
    for _ in range(2):
        assert router.start(Try(pool, 0)).failed() is None
        clock.advance(6)
    # The first of those is 12 s old now: two in the window, no cooldown.
    assert router.start(Try(pool, 0)).failed() is None
    clock.advance(1)
    assert router.start(Try(pool, 0)).failed() == Cooldown(FAILURES, 10.0, 23.0)
    assert router.start(Try(pool, 0)).failed() is None
    clock.advance(9.9)
    assert tries(router.plan([pool])) == [("pool", 1)]
    clock.advance(0.1)
    assert len(tries(router.plan([pool]))) == 2
    assert router.start(Try(pool, 0)).failed() is None
    assert router.start(Try(pool, 0)).failed() is None


def test_cooldownSettings() -> None:
    """
    cooldown_failures and cooldown are the model's.
    """
    router = Router(Clock(), Random(11))
    pool = model("pool", [1, 1], cooldown=30.0, cooldownFailures=1)
    assert router.start(Try(pool, 1)).failed() == Cooldown(FAILURES, 30.0, 30.0)


def test_aFailureIsCountedOnce() -> None:
    """
    A flight's failure is counted once, whatever is called after.
    """
    router = Router(Clock(), Random(12))
    pool = model("pool", [1, 1], cooldownFailures=2)
    flight = router.start(Try(pool, 0))
    assert flight.failed() is None
    assert flight.failed() is None
    assert flight.rateLimited(30.0) is None
    assert router.status(pool)[0].coolingUntil is None


def test_allCooling() -> None:
    """
    When every deployment cools down, the one whose cooldown ends first is
    tried rather than none, then the fallbacks.
    """
    clock = Clock()
    router = Router(clock, Random(13))
    pool = model("pool", [1, 1, 1], fallbacks=("spare",))
    spare = model("spare", [1, 1])
    for index, seconds in ((0, 30.0), (1, 10.0), (2, 20.0)):
        router.start(Try(pool, index)).rateLimited(seconds)
    plan = tries(router.plan([pool, spare]))
    assert plan[0] == ("pool", 1)
    assert sorted(plan[1:]) == [("spare", 0), ("spare", 1)]


def test_cooling() -> None:
    """
    Cooling alone: nothing cools before the first cooldown; counted
    failures are dropped after the window.
    """
    cooling = Cooling()
    assert not cooling.active(0.0) and cooling.reason is None
    cooling.failed(0.0, 3, 10.0)
    cooling.failed(1.0, 3, 10.0)
    assert cooling.recentFailures == 2
    cooling.failed(20.0, 3, 10.0)
    assert cooling.recentFailures == 1


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        (None, None),
        ("12", 12.0),
        (b"1.5", 1.5),
        (" 3 ", 3.0),
        ("Wed, 21 Oct 2015 07:28:10 GMT", 10.0),
        ("Wed, 21 Oct 2015 07:28:10 -0000", 10.0),
        ("Wed, 21 Oct 2015 07:27:00 GMT", 0.0),
        ("-1", None),
        ("soon", None),
        ("", None),
        (b"\xff", None),
        ("9" * 80, None),
        ("Wed, 99 Oct 2015 07:28:10 GMT", None),
    ],
)
def test_retryAfterSeconds(value: str | bytes | None, seconds: float | None) -> None:
    """
    Retry-After as delta-seconds or an HTTP date (less now); anything
    else is no Retry-After (5 s then).
    """
    assert retryAfterSeconds(value, 1_445_412_480.0) == seconds


# max_attempts and the plan.


def test_planOfDeploymentsThenFallbacks() -> None:
    """
    The plan: the model's deployments, then each fallback's, each once;
    by default one try of each.
    """
    router = Router(Clock(), Random(14))
    pool = model("pool", [1, 1], fallbacks=("spare",))
    spare = model("spare", [1, 1, 1])
    plan = tries(router.plan([pool, spare]))
    assert sorted(plan[:2]) == [("pool", 0), ("pool", 1)]
    assert sorted(plan[2:]) == [("spare", 0), ("spare", 1), ("spare", 2)]
    assert tries(router.plan([])) == []


def test_maxAttempts() -> None:
    """
    max_attempts (the model the client named) bounds the tries over the
    deployments and the fallbacks; a fallback's own does not count.
    """
    router = Router(Clock(), Random(15))
    pool = model("pool", [1, 1, 1], fallbacks=("spare",), maxAttempts=4)
    spare = model("spare", [1, 1], maxAttempts=1)
    plan = tries(router.plan([pool, spare]))
    assert len(plan) == 4 and plan[3][0] == "spare"
    assert len(tries(router.plan([attrs.evolve(pool, maxAttempts=2), spare]))) == 2
    assert len(tries(router.plan([attrs.evolve(pool, maxAttempts=100), spare]))) == 5
    assert [name for name, _ in tries(router.plan([spare, pool]))] == ["spare"]


def test_triesNotAcceptedAreNotCounted() -> None:
    """
    A try the caller cannot send (accepts says no) is passed over, and
    max_attempts counts only the tries the plan gives.
    """
    router = Router(Clock(), Random(18))
    pool = model("pool", [1, 1, 1], fallbacks=("spare",), maxAttempts=3)
    spare = model("spare", [1, 1])
    plan = tries(router.plan([pool, spare], accepts=lambda attempt: attempt.index != 1))
    assert sorted(plan[:2]) == [("pool", 0), ("pool", 2)]
    assert len(plan) == 3 and plan[2][0] == "spare"


def test_planIsLazy() -> None:
    """
    A fallback's order is drawn when the plan reaches it: a deployment
    that cooled meanwhile is left out.
    """
    router = Router(Clock(), Random(16))
    pool = model("pool", fallbacks=("spare",))
    spare = model("spare", [1, 1])
    plan = router.plan([pool, spare])
    first = next(plan)
    router.start(Try(spare, 0)).rateLimited(30.0)
    router.start(first).failed()
    assert [(attempt.model.name, attempt.index) for attempt in plan] == [("spare", 1)]


def test_tryTarget() -> None:
    """
    A try's target is the model as its deployment serves it.
    """
    pool = model("pool", [1, 2])
    attempt = Try(pool, 1)
    assert attempt.deployment is pool.deployments[1]
    assert attempt.target.provider is pool.deployments[1].provider
    assert Try(pool, 0).target is pool


def test_stateFollowsTheModelsName() -> None:
    """
    A model built again with the same deployments shares the state of its
    name; one with other deployments starts afresh.
    """
    router = Router(Clock(), Random(17))
    pool = model("pool", [1, 1])
    router.start(Try(pool, 0))
    assert router.status(model("pool", [1, 1]))[0].inFlight == 1
    assert router.status(model("pool", [1, 2]))[0].inFlight == 0


# Properties of every plan.


@st.composite
def _scenes(draw: st.DrawFn) -> tuple[list[Model], list[tuple[int, int, float, str]], int | None]:
    """
    A chain of 1 to 4 models of 1 to 5 deployments each (any routing,
    weights), and the events that came before: tries on deployments that
    failed, hit a 429 or answered after some time.
    """
    count = draw(st.integers(1, 4))
    limit = draw(st.none() | st.integers(1, 12))
    chain = []
    for number in range(count):
        weights = draw(st.lists(st.floats(0.01, 100), min_size=1, max_size=5))
        chain.append(
            model(
                f"m{number}",
                weights,
                draw(st.sampled_from(ROUTINGS)),
                maxAttempts=limit if number == 0 else draw(st.none() | st.integers(1, 3)),
                cooldownFailures=draw(st.integers(1, 3)),
            )
        )
    events = draw(
        st.lists(
            st.tuples(
                st.integers(0, count - 1),
                st.integers(0, 4),
                st.floats(0, 30),
                st.sampled_from(["failed", "429", "answered", "open"]),
            ),
            max_size=30,
        )
    )
    return chain, events, limit


@settings(max_examples=300, deadline=None)
@given(_scenes(), st.integers(0, 2**32))
def test_planProperties(
    scene: tuple[list[Model], list[tuple[int, int, float, str]], int | None], seed: int
) -> None:
    """
    Whatever came before: a plan never repeats a deployment, never
    exceeds max_attempts, keeps the chain's order (a model's tries
    together), tries every deployment not cooling down before the
    fallbacks (or, when all cool, the one whose cooldown ends first), and
    never one cooling down otherwise.
    """
    chain, events, limit = scene
    clock = Clock()
    router = Router(clock, Random(seed))
    for place, index, seconds, outcome in events:
        attempt = Try(chain[place], index % len(chain[place].deployments))
        flight = router.start(attempt)
        clock.advance(seconds)
        if outcome == "failed":
            flight.failed()
        elif outcome == "429":
            flight.rateLimited(seconds)
        elif outcome == "answered":
            flight.firstByte()
            flight.finished()
    plan = tries(router.plan(chain))
    assert len(plan) == len(set(plan))
    left = len(plan) + 1 if limit is None else limit
    assert len(plan) <= left
    rebuilt: list[tuple[str, int]] = []
    for entry in chain:
        statuses = router.status(entry)
        ready = [index for index, status in enumerate(statuses) if status.coolingUntil is None]
        if not ready:
            ready = [min(range(len(statuses)), key=lambda index: statuses[index].coolingUntil or 0)]
        take = plan[len(rebuilt) : len(rebuilt) + min(len(ready), left - len(rebuilt))]
        assert len(take) == min(len(ready), left - len(rebuilt))
        assert all(name == entry.name for name, _ in take)
        assert {index for _, index in take} <= set(ready)
        rebuilt += take
    assert rebuilt == plan
