"""
When a deployment of a model is left aside for a while (decisions D15):
its cooldown, and what starts one.

  - A 429 cools the deployment for its C{Retry-After} (delta-seconds or
    an HTTP date, L{retryAfterSeconds}), at most
    L{MAX_RATE_LIMIT_COOLDOWN} seconds, L{RATE_LIMIT_COOLDOWN} without
    one: the provider said when it will take requests again, and asking
    before then only earns another 429.
  - The model's C{cooldown_failures} failures (refused, reset, a 5xx, no
    first byte in time) within L{FAILURE_WINDOW} seconds cool it for the
    model's C{cooldown}: a deployment that is down is not tried by every
    request first, each paying its failure before the next deployment.
    Failures counted while it cools (tries that began before, or the one
    tried because every deployment cools) start nothing new: the bout
    that cooled it is the same.

What the router does with a cooling deployment (skip it, unless every
deployment of the model cools) is L{svcd.providers.routing}'s. Pure and
clocked by its caller: nothing here reads the time.
"""

from __future__ import annotations

import math
import re
from collections import deque
from datetime import UTC
from email.utils import parsedate_to_datetime

import attrs

__all__ = [
    "FAILURES",
    "FAILURE_WINDOW",
    "MAX_RATE_LIMIT_COOLDOWN",
    "RATE_LIMITED",
    "RATE_LIMIT_COOLDOWN",
    "Cooldown",
    "Cooling",
    "retryAfterSeconds",
]

# The reasons of a cooldown (the reason label of
# svc_proxy_deployment_cooldowns_total).
RATE_LIMITED = "rate_limited"
FAILURES = "failures"
# Seconds within which the model's cooldown_failures failures cool a
# deployment.
FAILURE_WINDOW = 10.0
# A 429's cooldown without a Retry-After, and the longest one with it.
RATE_LIMIT_COOLDOWN = 5.0
MAX_RATE_LIMIT_COOLDOWN = 60.0

_DELTA_SECONDS = re.compile(r"[0-9]{1,12}(?:\.[0-9]{1,9})?")


@attrs.frozen
class Cooldown:
    """
    A cooldown that began (or was made longer).

    @ivar reason: L{RATE_LIMITED} or L{FAILURES}.
    @ivar seconds: how long, from when it began.
    @ivar until: when it ends, on the clock of the caller.
    """

    reason: str
    seconds: float
    until: float


class Cooling:
    """
    One deployment's cooldown and the failures that may start one.

    @ivar until: when the current (or last) cooldown ends; minus infinity
        before the first.
    @ivar reason: the last cooldown's reason, or None before the first.
    """

    __slots__ = ("_failures", "reason", "until")

    def __init__(self) -> None:
        self.until = -math.inf
        self.reason: str | None = None
        # When the failures of the last FAILURE_WINDOW seconds were, at
        # most cooldown_failures of them.
        self._failures: deque[float] = deque()

    def active(self, now: float) -> bool:
        """
        Is the deployment cooling down at C{now}?
        """
        return now < self.until

    def rateLimited(self, now: float, retryAfter: float | None) -> Cooldown | None:
        """
        A 429: cool for C{retryAfter} seconds (L{retryAfterSeconds}), at
        most L{MAX_RATE_LIMIT_COOLDOWN}, or L{RATE_LIMIT_COOLDOWN} when
        None. A cooldown that already lasts longer is kept. The cooldown
        begun, or None when none did.
        """
        if retryAfter is None:
            seconds = RATE_LIMIT_COOLDOWN
        else:
            seconds = min(max(retryAfter, 0.0), MAX_RATE_LIMIT_COOLDOWN)
        until = now + seconds
        if seconds <= 0 or until <= self.until:
            return None
        self.until = until
        self.reason = RATE_LIMITED
        return Cooldown(RATE_LIMITED, seconds, until)

    def failed(self, now: float, limit: int, cooldown: float) -> Cooldown | None:
        """
        A failure at C{now}: the C{limit}th within L{FAILURE_WINDOW}
        seconds cools the deployment for C{cooldown} seconds, and the count
        starts again. The cooldown begun, or None when none did.
        """
        if self.active(now):
            return None
        failures = self._failures
        while failures and failures[0] <= now - FAILURE_WINDOW:
            failures.popleft()
        failures.append(now)
        if len(failures) < limit:
            return None
        failures.clear()
        self.until = now + cooldown
        self.reason = FAILURES
        return Cooldown(FAILURES, cooldown, self.until)

    @property
    def recentFailures(self) -> int:
        """
        The failures counted towards the next cooldown (some may be older
        than L{FAILURE_WINDOW}: they are dropped at the next failure).
        """
        return len(self._failures)


def retryAfterSeconds(value: str | bytes | None, now: float) -> float | None:
    """
    The seconds a C{Retry-After} header asks to wait (RFC 9110, 10.2.3):
    delta-seconds (a fraction is taken too, as some providers send one),
    or an HTTP date less C{now} (Unix seconds), never below zero. None for
    no header or one that is neither.
    """
    if value is None:
        return None
    if isinstance(value, bytes):
        try:
            value = value.decode("ascii")
        except UnicodeDecodeError:
            return None
    value = value.strip()
    if _DELTA_SECONDS.fullmatch(value):
        return float(value)
    if not 0 < len(value) <= 64:
        return None
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    if when.tzinfo is None:
        # "-0000" (no zone said): an HTTP date is always UTC.
        when = when.replace(tzinfo=UTC)
    try:
        return max(when.timestamp() - now, 0.0)
    except (ValueError, OverflowError, OSError):
        return None
