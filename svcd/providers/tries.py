"""
What the forwarder (L{svcd.providers.upstream}) keeps of each try of a
request on a deployment (decisions D15): which tries can be sent the
request at all and their bodies (L{prepare}), the wait for a try's first
byte (L{FirstByte}), and what it counts of them (L{DeploymentMetrics}).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import attrs
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall

from svcd.dialects.errors import Untranslatable
from svcd.metering.models import Model
from svcd.providers.operations import Leg, Operation
from svcd.providers.routing import Flight, bodyKey

__all__ = [
    "BROKEN",
    "CANCELLED",
    "FAILED",
    "FIRST_BYTE_TIMEOUT",
    "OK",
    "RATE_LIMITED",
    "REJECTED",
    "DeploymentMetrics",
    "FirstByte",
    "prepare",
]

# The status label of a try that had no first byte within its model's
# first_byte_timeout (decisions D15).
FIRST_BYTE_TIMEOUT = "first_byte_timeout"
# The outcome label of svc_proxy_deployment_requests_total.
OK = "ok"
FAILED = "failed"
RATE_LIMITED = "rate_limited"
REJECTED = "rejected"
BROKEN = "broken"
CANCELLED = "cancelled"


@runtime_checkable
class DeploymentMetrics(Protocol):
    """
    What the forwarder counts of the deployments of models (decisions
    D15), on the metrics of a daemon that exports them (svc-proxy's
    C{svc_proxy_deployment_*}); a daemon whose metrics lack these methods
    counts none.
    """

    def deploymentStarted(self, model: str, deployment: str) -> None:
        """
        A try began on the deployment: one more in flight.
        """

    def deploymentEnded(self, model: str, deployment: str, outcome: str) -> None:
        """
        A try on the deployment ended: one fewer in flight, and its outcome
        (L{OK}, L{FAILED}, L{RATE_LIMITED}, L{REJECTED}, L{BROKEN},
        L{CANCELLED}).
        """

    def deploymentCooled(self, model: str, deployment: str, reason: str) -> None:
        """
        The deployment began a cooldown (C{reason}: its
        L{svcd.providers.cooldowns} reason).
        """


@attrs.define(eq=False)
class FirstByte:
    """
    One try's wait for its first byte (decisions D15): told to the
    router's flight when it comes, and bounded by the model's
    C{first_byte_timeout} when it has one (L{expire}, on a timer that the
    first byte disarms).
    """

    flight: Flight
    timer: IDelayedCall | None = None
    expired: bool = False

    def arrived(self) -> None:
        self.disarm()
        self.flight.firstByte()

    def expire(self, work: Deferred[Any]) -> None:
        self.timer = None
        self.expired = True
        work.cancel()

    def disarm(self) -> None:
        if self.timer is not None and self.timer.active():
            self.timer.cancel()
        self.timer = None


def prepare(
    operation: Operation,
    document: Mapping[str, Any],
    attempts: Sequence[Model],
    outputCap: int | None,
    bodies: Mapping[str, bytes] | None,
) -> dict[str, tuple[Leg, bytes | None]]:
    """
    The tries that can be sent the request, by
    L{svcd.providers.routing.bodyKey} (each deployment of each model of
    C{attempts}), each with its leg and its body when it is made already
    (decisions D14): every translated body is made here, before anything
    is sent; a body sent as the client wrote it cannot fail, and is made
    when its try comes.

    @raise ApiError: 400 VALIDATION_ERROR naming the field when no
        deployment of the first attempt (the model the client named) can
        be sent the request.
    """
    prepared: dict[str, tuple[Leg, bytes | None]] = {}
    refused: Untranslatable | None = None
    for model in attempts:
        for index in range(len(model.deployments)):
            key = bodyKey(model, index)
            target = model.atDeployment(index)
            made = bodies.get(key) if bodies is not None else None
            leg = operation.leg(target.provider)
            try:
                if leg is None:
                    raise Untranslatable("model", f"is not served by {operation.name}")
                if made is None and leg.translated:
                    made = leg.body(document, target, outputCap)
            except Untranslatable as untranslatable:
                if model is attempts[0] and refused is None:
                    refused = untranslatable
                # A deployment or fallback that cannot take the request is
                # not tried.
                continue
            prepared[key] = (leg, made)
    if refused is not None and not any(
        bodyKey(attempts[0], index) in prepared for index in range(len(attempts[0].deployments))
    ):
        raise refused.apiError() from None
    return prepared
