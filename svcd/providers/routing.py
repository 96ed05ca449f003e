"""
Which deployment of a model a request tries, and in what order it tries
the others (decisions D15): the router's state on this proxy (requests
in flight, time to the first byte, cooldowns) and the plan of one
request's tries.

A request's plan (L{Router.plan}) is its model's deployments in routing
order, then each fallback's (D9, in L{svcd.providers.table}'s order),
each in its own routing order, at most the model's C{max_attempts} tries
in all (by default one of each). A deployment cooling down
(L{svcd.providers.cooldowns}) is left out, unless every deployment of
its model is: then the one whose cooldown ends first is tried rather
than none. The order of a model's deployments:

  - C{weighted}: first the deployment that smooth weighted round-robin
    picks (nginx's: each deployment not cooling down adds its weight to
    its credit, the one of most credit goes first and gives back the sum
    of those weights), then the rest in weighted random order (each next
    one drawn among the rest with the chance of its weight). The first
    tries of any run of requests on this proxy split as the weights do,
    each within about one try of its share (a weighted random draw is off
    by about the square root of its count: 39 tries, 1.9%, of a quarter's
    2,000 in 8,000), and they interleave (1:1:2 goes c, a, b, c, again)
    rather than coming in bursts; a deployment cooling down gains no
    credit, so it makes up nothing when it comes back;
  - C{least_busy}: fewest tries in flight on this proxy first; ties (the
    usual case at a light load, when none is busy) in weighted random
    order, so that a quiet model is spread by weight rather than sent
    whole to one deployment;
  - C{latency}: lowest mean time to the first byte on this proxy first
    (L{LatencyMean}: over about a minute); a deployment without a
    measure (none yet, or none for L{LATENCY_WINDOW} seconds) first of
    all, so that a new or forgotten one is measured; ties in weighted
    random order. A deployment with a try still waiting for its first
    byte counts as at least as slow as that wait (so that one try
    measures a new deployment while the others wait for its answer,
    rather than every request piling on it, and a deployment that stops
    answering is left at once, not when its tries time out). A try that
    failed counts as one that waited its whole deadline, so that a
    deployment that fails fast is not taken for a fast one.

A try is followed from start to end by a L{Flight} (L{Router.start}):
in flight until it ends, its first byte timed, its failure counted.

Pure: no reactor, no I/O; the clock and the random source are the
caller's, so that a test replays a run exactly. The forwarder
(L{svcd.providers.upstream}) asks for a plan per request and tells the
router how each try went; a model of one deployment (every model of a
file without C{deployments}) is tried as before, whatever its state.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from random import Random

import attrs

from svcd.common.clocks import Clock
from svcd.metering.models import LATENCY, LEAST_BUSY, Deployment, Model
from svcd.providers.cooldowns import Cooldown, Cooling

__all__ = [
    "LATENCY_TIME_CONSTANT",
    "LATENCY_WINDOW",
    "DeploymentStatus",
    "Flight",
    "LatencyMean",
    "Router",
    "Try",
    "bodyKey",
]

# The mean time to the first byte weighs a sample of t seconds ago by
# exp(-t / LATENCY_TIME_CONSTANT): most of its weight is the last minute.
LATENCY_TIME_CONSTANT = 30.0
# A mean whose last sample is older than this is no measure any more: the
# deployment is tried first again, and so measured again (a deployment
# left aside for being slow is looked at again about once a minute).
LATENCY_WINDOW = 60.0


def bodyKey(model: Model, index: int) -> str:
    """
    The key of the body a try of C{model} on its deployment C{index} is
    sent, among the bodies a budget's reservation measures
    (L{svcd.limits.reservation.worstCaseCost}) and the forwarder sends: the
    model's name for its first deployment (a model of one deployment as
    before), else the name and the index.
    """
    return model.name if index == 0 else f"{model.name}#{index}"


@attrs.frozen
class Try:
    """
    One try of a request's plan: a model of its chain (the one the client
    named, or a fallback) on one of its deployments.

    @ivar model: the model as the providers file has it.
    @ivar index: the deployment's place in C{model.deployments}.
    """

    model: Model
    index: int

    @property
    def deployment(self) -> Deployment:
        return self.model.deployments[self.index]

    @property
    def target(self) -> Model:
        """
        The model as this try sends it: the deployment's provider and
        upstream model (L{Model.atDeployment}).
        """
        return self.model.atDeployment(self.index)


@attrs.frozen
class DeploymentStatus:
    """
    What the router knows of one deployment of a model, now.

    @ivar coolingUntil: when its cooldown ends, or None when it is not
        cooling down.
    @ivar latency: its mean time to the first byte in seconds, or None
        without a measure.
    """

    name: str
    inFlight: int
    coolingUntil: float | None
    latency: float | None


class LatencyMean:
    """
    A mean of the times to the first byte, each sample weighed by its age
    (C{exp(-age / LATENCY_TIME_CONSTANT)}): at any rate of requests it
    spans about a minute, and unlike an EWMA of fixed weight it is not
    held by its first sample when samples come fast, nor swayed by one
    when they come seldom.
    """

    __slots__ = ("_at", "_sum", "_weight")

    def __init__(self) -> None:
        self._sum = 0.0
        self._weight = 0.0
        self._at = -math.inf

    def add(self, now: float, seconds: float) -> None:
        if self._weight:
            decay = math.exp(-max(now - self._at, 0.0) / LATENCY_TIME_CONSTANT)
            self._sum *= decay
            self._weight *= decay
        self._sum += seconds
        self._weight += 1.0
        self._at = max(now, self._at)

    def value(self, now: float) -> float | None:
        """
        The mean at C{now}, or None without a sample within
        L{LATENCY_WINDOW} seconds.
        """
        if not self._weight or now - self._at > LATENCY_WINDOW:
            return None
        return self._sum / self._weight

    def last(self) -> float:
        """
        The mean however old its samples, 0 without any.
        """
        return self._sum / self._weight if self._weight else 0.0


class _DeploymentState:
    __slots__ = ("cooling", "inFlight", "latency", "waiting")

    def __init__(self) -> None:
        self.inFlight = 0
        self.cooling = Cooling()
        self.latency = LatencyMean()
        # The tries waiting for their first byte, oldest first, each with
        # the time it started.
        self.waiting: dict[Flight, float] = {}

    def latencyKey(self, now: float) -> tuple[bool, float]:
        """
        Where C{latency} routing puts the deployment: those to measure
        (False) first, then by their measure.
        """
        if self.waiting:
            since = next(iter(self.waiting.values()))
            return True, max(now - since, self.latency.last())
        mean = self.latency.value(now)
        if mean is None:
            return False, 0.0
        return True, mean


class _ModelState:
    __slots__ = ("credits", "deployments", "model")

    def __init__(self, model: Model) -> None:
        self.model = model
        self.deployments = tuple(_DeploymentState() for _ in model.deployments)
        # Smooth weighted round-robin's credit of each deployment.
        self.credits = [0.0] * len(model.deployments)

    def smoothPick(self, ready: Sequence[int]) -> int:
        """
        The next of C{ready} by smooth weighted round-robin: each adds its
        weight to its credit, the first of most credit is picked and gives
        back the sum of the weights added.
        """
        deployments = self.model.deployments
        credits = self.credits
        total = 0.0
        picked = ready[0]
        for index in ready:
            weight = deployments[index].weight
            credits[index] += weight
            total += weight
            if credits[index] > credits[picked]:
                picked = index
        credits[picked] -= total
        return picked


class Flight:
    """
    One try from its start to its end: in flight on its deployment until
    it ends (L{finished}, or its failure), its first byte timed for
    C{latency} routing, its failure counted towards a cooldown. Ending it
    more than once is harmless, so that the forwarder may end it in a
    C{finally} whatever happened before.
    """

    __slots__ = ("_attempt", "_clock", "_counted", "_ended", "_firstByte", "_started", "_state")

    def __init__(self, clock: Clock, attempt: Try, state: _DeploymentState) -> None:
        self._clock = clock
        self._attempt = attempt
        self._state = state
        self._started = clock.seconds()
        self._ended = False
        self._firstByte = False
        self._counted = False
        state.inFlight += 1
        state.waiting[self] = self._started

    @property
    def attempt(self) -> Try:
        return self._attempt

    def firstByte(self) -> float:
        """
        The answer's first byte came: its time is a sample of the
        deployment's latency (the first call only). The seconds since the
        try started.
        """
        now = self._clock.seconds()
        elapsed = max(now - self._started, 0.0)
        if not self._firstByte:
            self._firstByte = True
            self._state.waiting.pop(self, None)
            self._state.latency.add(now, elapsed)
        return elapsed

    def rateLimited(self, retryAfter: float | None) -> Cooldown | None:
        """
        The deployment answered 429 (C{retryAfter}: its C{Retry-After} in
        seconds, L{svcd.providers.cooldowns.retryAfterSeconds}, or None):
        it cools down, and the try ends. The cooldown begun, or None.
        """
        self.finished()
        if self._counted:
            return None
        self._counted = True
        return self._state.cooling.rateLimited(self._clock.seconds(), retryAfter)

    def failed(self) -> Cooldown | None:
        """
        The try failed for the deployment's sake (refused, reset, a 5xx,
        a 401, 403 or 404, a broken answer, no first byte in time; not a
        refusal of the client's request, nor the client going away): it
        counts towards the model's C{cooldown_failures}, and the try ends.
        Before its first byte, it is a sample of the deployment's latency
        as long as the try's deadline. The cooldown begun, or None.
        """
        self.finished()
        if self._counted:
            return None
        self._counted = True
        now = self._clock.seconds()
        model = self._attempt.model
        if not self._firstByte:
            deadline = model.firstByteTimeout or self._attempt.deployment.provider.timeout
            self._state.latency.add(now, max(now - self._started, deadline))
        return self._state.cooling.failed(now, model.cooldownFailures, model.cooldown)

    def finished(self) -> None:
        """
        The try ended (answered, refused, or given up): no longer in
        flight.
        """
        if not self._ended:
            self._ended = True
            self._state.inFlight -= 1
            self._state.waiting.pop(self, None)


class Router:
    """
    The routing state of every model on this proxy, and the plans made of
    it.

    @param clock: the time of cooldowns and latencies (the reactor).
    @param random: the draws of the weighted orders; seeded in tests.
    """

    def __init__(self, clock: Clock, random: Random) -> None:
        self._clock = clock
        self._random = random
        self._states: dict[str, _ModelState] = {}

    def plan(
        self, chain: Sequence[Model], accepts: Callable[[Try], bool] | None = None
    ) -> Iterator[Try]:
        """
        The tries of a request, in order: each model of C{chain} (the model
        the client named, then its fallbacks, as
        L{svcd.providers.table.ProviderTable.attempts} gives them) on its
        deployments in routing order, at most the first model's
        C{maxAttempts} in all. Lazy: a fallback's order is drawn when it
        is reached, from the state of then (a deployment that cooled
        meanwhile is left out); take the next try only when the one
        before failed.

        @param accepts: whether a try can be sent the request at all (a
            deployment whose provider's dialect cannot carry it, decisions
            D14): one it refuses is passed over, and is not a try that
            C{maxAttempts} counts.
        """
        if not chain:
            return
        limit = chain[0].maxAttempts
        count = 0
        for model in chain:
            for index in self._order(model):
                attempt = Try(model, index)
                if accepts is not None and not accepts(attempt):
                    continue
                yield attempt
                count += 1
                if limit is not None and count >= limit:
                    return

    def start(self, attempt: Try) -> Flight:
        """
        A try begins: it is in flight until its L{Flight} ends.
        """
        state = self._state(attempt.model).deployments[attempt.index]
        return Flight(self._clock, attempt, state)

    def status(self, model: Model) -> tuple[DeploymentStatus, ...]:
        """
        What the router knows of each of C{model}'s deployments, in the
        file's order.
        """
        now = self._clock.seconds()
        return tuple(
            DeploymentStatus(
                deployment.name,
                state.inFlight,
                state.cooling.until if state.cooling.active(now) else None,
                state.latency.value(now),
            )
            for deployment, state in zip(
                model.deployments, self._state(model).deployments, strict=True
            )
        )

    def _state(self, model: Model) -> _ModelState:
        """
        C{model}'s state, by its name: the table's model, or one built
        elsewhere with the same deployments, shares it; a model of the
        same name with other deployments starts afresh.
        """
        state = self._states.get(model.name)
        if state is None or (
            state.model is not model and state.model.deployments != model.deployments
        ):
            state = self._states[model.name] = _ModelState(model)
        return state

    def _order(self, model: Model) -> list[int]:
        """
        The deployments of C{model} to try, by index, in its routing
        order; those cooling down left out, unless all are.
        """
        deployments = model.deployments
        if len(deployments) == 1:
            return [0]
        now = self._clock.seconds()
        modelState = self._state(model)
        states = modelState.deployments
        ready = [index for index, state in enumerate(states) if not state.cooling.active(now)]
        if not ready:
            return [min(range(len(states)), key=lambda index: states[index].cooling.until)]
        if len(ready) == 1:
            return ready
        draw = self._random.random
        # A weighted random order in one pass (Efraimidis and Spirakis):
        # each deployment draws an exponential time divided by its weight,
        # the earliest goes first; the first is deployment i with chance
        # w_i / sum(w), and so is each next one among the rest.
        if model.routing == LEAST_BUSY:
            busy = sorted(
                (states[index].inFlight, -math.log(1.0 - draw()) / deployments[index].weight, index)
                for index in ready
            )
            return [index for _, _, index in busy]
        if model.routing == LATENCY:
            fast = sorted(
                (
                    states[index].latencyKey(now),
                    -math.log(1.0 - draw()) / deployments[index].weight,
                    index,
                )
                for index in ready
            )
            return [index for _, _, index in fast]
        first = modelState.smoothPick(ready)
        weighted = sorted(
            (-math.log(1.0 - draw()) / deployments[index].weight, index)
            for index in ready
            if index != first
        )
        return [first, *(index for _, index in weighted)]
