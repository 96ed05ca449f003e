"""
The fence around Twisted Web's private names (issue 24 item 2): every name
the edge relies on exists on the installed Twisted, and a missing one is
named by the check.
"""

from __future__ import annotations

import pytest
from twisted.web import http
from twisted.web.http import HTTPChannel, Request

from svcd.proxy.http import twistedprivate
from svcd.proxy.http.twistedprivate import (
    TwistedIncompatible,
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
