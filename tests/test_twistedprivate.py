"""
The fence around Twisted's private names (issue 24 item 2, issue 29 item
5): every name the edge and the daemons' lifecycle rely on exists on the
installed Twisted, and a missing one is named by the check.
"""

from __future__ import annotations

import signal

import pytest
from twisted.internet import base, interfaces
from twisted.internet.testing import MemoryReactor
from twisted.web import http
from twisted.web.http import HTTPChannel, Request

from svcd.common import twistedprivate
from svcd.common.lifecycle import exitZeroOnStopSignals
from svcd.common.twistedprivate import (
    TwistedIncompatible,
    exitSignal,
    forgetExitSignal,
    missingNames,
    requireTwistedInternals,
)


def test_installedTwistedHasEveryName() -> None:
    """
    The Twisted the suite runs on has every private name; the check
    passes.
    """
    assert twistedprivate.MISSING == ()
    assert missingNames() == []
    requireTwistedInternals()


@pytest.mark.parametrize(
    ("owner", "name", "reported"),
    [
        (
            HTTPChannel,
            "_respondToBadRequestAndDisconnect",
            "HTTPChannel._respondToBadRequestAndDisconnect",
        ),
        (HTTPChannel, "_HTTPChannel__first_line", "HTTPChannel._HTTPChannel__first_line"),
        (HTTPChannel, "_receivedHeaderSize", "HTTPChannel._receivedHeaderSize"),
        (Request, "_cleanup", "Request._cleanup"),
        (Request, "_disconnected", "Request._disconnected"),
        # twisted.web.http is a deprecation proxy of the module; delete the
        # name from the module itself.
        (
            object.__getattribute__(http, "_module"),
            "_ChunkedTransferDecoder",
            "twisted.web.http._ChunkedTransferDecoder",
        ),
        (base.ReactorBase, "_exitSignal", "ReactorBase._exitSignal"),
        (
            interfaces,
            "_ISupportsExitSignalCapturing",
            "twisted.internet.interfaces._ISupportsExitSignalCapturing",
        ),
    ],
)
def test_missingNameIsReported(
    monkeypatch: pytest.MonkeyPatch, owner: object, name: str, reported: str
) -> None:
    """
    A name removed from Twisted is reported by its owner and name, and
    L{requireTwistedInternals} refuses with it.
    """
    monkeypatch.delattr(owner, name)
    missing = missingNames()
    assert missing == [reported]
    monkeypatch.setattr(twistedprivate, "MISSING", tuple(missing))
    with pytest.raises(TwistedIncompatible, match=f"lacks {reported}, which"):
        requireTwistedInternals()


class _Reactor(base.ReactorBase):
    """
    Twisted's reactor base with no waker (nothing here runs it).
    """

    def installWaker(self) -> None:
        pass


def test_exitSignalOfARealReactor() -> None:
    """
    A reactor records the signal that stopped it, where L{exitSignal}
    reads it and L{forgetExitSignal} clears it.
    """
    reactor = _Reactor()
    assert exitSignal(reactor) is None
    reactor.sigTerm(signal.SIGTERM, None)
    assert exitSignal(reactor) == signal.SIGTERM
    forgetExitSignal(reactor)
    assert exitSignal(reactor) is None


@pytest.mark.parametrize(
    ("number", "kept"),
    [
        (signal.SIGTERM, None),
        (signal.SIGINT, None),
        (signal.SIGHUP, signal.SIGHUP),
        (None, None),
    ],
)
def test_stopSignalsAreForgottenAfterShutdown(number: int | None, kept: int | None) -> None:
    """
    After shutdown, a stop by SIGTERM or SIGINT is forgotten (twistd then
    exits with status 0); any other signal is kept, and twistd raises it
    again.
    """
    reactor = MemoryReactor()
    reactor._exitSignal = number  # type: ignore[attr-defined]
    exitZeroOnStopSignals(reactor)
    [(clear, args, kwargs)] = reactor.triggers["after"]["shutdown"]
    clear(*args, **kwargs)
    assert exitSignal(reactor) == kept
