"""
A typing protocol for the time source of a component.

Twisted's C{IReactorTime} is a zope interface; without the mypy-zope
plugin mypy cannot call its methods (it takes them for functions without
C{self}). Components take a L{Clock} instead: the reactor and
L{twisted.internet.task.Clock} both fit it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from twisted.internet.interfaces import IDelayedCall, IReactorTime


class Clock(Protocol):
    """
    What components use of C{IReactorTime}.
    """

    def seconds(self) -> float: ...

    def callLater(
        self, delay: float, callable: Callable[..., object], *args: object, **kw: object
    ) -> IDelayedCall: ...


def asReactorTime(clock: Clock) -> IReactorTime:
    """
    C{clock} for the helpers typed with C{IReactorTime}, which a L{Clock}
    provides.
    """
    return clock  # type: ignore[return-value]
