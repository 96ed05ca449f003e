"""
The private names of Twisted that svc relies on, reached only here, and
checked when this module is imported.

svc-proxy's edge answers refusals of Twisted's HTTP parser itself
(decisions D10), drops a stranger's body unread and closes idle keep-alive
connections with a lingering close. Twisted offers no public hook for any
of this, so L{svcd.proxy.http.site} reads and sets a few of
L{HTTPChannel}'s private attributes (one of them name-mangled) and
overrides two private methods. Both daemons end a stop by SIGTERM or
SIGINT with status 0 (L{svcd.common.lifecycle.exitZeroOnStopSignals}),
which only the reactor's private C{_exitSignal} allows: twistd re-raises
the signal recorded there once the reactor has stopped.

A Twisted release that renames one of them would not fail loudly: an
overriding method would silently never run (refusals mislabelled, bodies
held), a missing attribute would raise in the middle of a request, a
forgotten exit signal would go on killing the process with it.

So every such access goes through a function of this module, and
L{missingNames} is computed once, at import, on real Twisted objects;
both taps call L{requireTwistedInternals} before anything starts, and the
daemon then refuses to start with one line naming what is missing and the
Twisted versions it was tested with (also the bounds of C{twisted} in
setup.py). tests/test_hostile_http.py, tests/test_proxy_site.py and
tests/test_proxy_strangers.py exercise the HTTP names over real sockets;
tests/test_auth_daemon.py and tests/test_proxy_daemon.py the exit signal,
by stopping a real twistd with SIGTERM.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from twisted.web.http import HTTPChannel, Request

# The Twisted releases this module's names were checked against; the
# bounds of twisted in setup.py follow them.
TESTED_TWISTED = "25.5 to 26.10"

# HTTPChannel's name-mangled flag: the next line is the request line.
_FIRST_LINE = "_HTTPChannel__first_line"

# Read (and for some, set) on an HTTPChannel instance.
_CHANNEL_ATTRIBUTES = (
    _FIRST_LINE,
    "_receivedHeaderSize",
    "_receivedHeaderCount",
    "_handlingRequest",
    "_dataBuffer",
    "_transferDecoder",
    "length",
)
# Overridden by svc-proxy's subclasses: each must be a method of the base
# class, or the override is never called.
_OVERRIDDEN = (
    (HTTPChannel, "_respondToBadRequestAndDisconnect"),
    (Request, "_cleanup"),
)
# Read on a Request.
_REQUEST_ATTRIBUTES = ("_disconnected",)
# Of the chunked body decoder that HTTPChannel keeps in _transferDecoder.
_DECODER_ATTRIBUTES = ("_buffer", "dataCallback", "finishCallback")
# The signal that stopped the reactor, on every reactor (ReactorBase), and
# the interface by which twistd's runner recognises a reactor that records
# it before reading it (twisted.application.app).
_EXIT_SIGNAL = "_exitSignal"
_EXIT_SIGNAL_INTERFACE = "_ISupportsExitSignalCapturing"


class TwistedIncompatible(Exception):
    """
    The installed Twisted lacks a private name svc relies on.
    """


def _ignore(*args: object) -> None:
    pass


def missingNames() -> list[str]:
    """
    The private names of this module that the installed Twisted lacks.
    """
    missing: list[str] = []
    try:
        channel = HTTPChannel()
    except Exception:  # whatever the fault, this Twisted is not the one tested
        return ["HTTPChannel()"]
    missing += [f"HTTPChannel.{name}" for name in _CHANNEL_ATTRIBUTES if not hasattr(channel, name)]
    missing += [
        f"{cls.__name__}.{name}"
        for cls, name in _OVERRIDDEN
        if not callable(getattr(cls, name, None))
    ]
    missing += [f"Request.{name}" for name in _REQUEST_ATTRIBUTES if not hasattr(Request, name)]
    decoder = _chunkedDecoder()
    if decoder is None:
        missing.append("twisted.web.http._ChunkedTransferDecoder")
    else:
        missing += [
            f"_ChunkedTransferDecoder.{name}"
            for name in _DECODER_ATTRIBUTES
            if not hasattr(decoder, name)
        ]
    missing += _missingExitSignal()
    return missing


def _missingExitSignal() -> list[str]:
    from twisted.internet import base, interfaces

    missing: list[str] = []
    if not hasattr(base.ReactorBase, _EXIT_SIGNAL):
        missing.append(f"ReactorBase.{_EXIT_SIGNAL}")
    if getattr(interfaces, _EXIT_SIGNAL_INTERFACE, None) is None:
        missing.append(f"twisted.internet.interfaces.{_EXIT_SIGNAL_INTERFACE}")
    return missing


def _chunkedDecoder() -> object | None:
    from twisted.web import http

    decoderClass: Callable[..., object] | None = getattr(http, "_ChunkedTransferDecoder", None)
    if decoderClass is None:
        return None
    try:
        return decoderClass(_ignore, _ignore)
    except Exception:  # whatever the fault, this Twisted is not the one tested
        return None


MISSING = tuple(missingNames())


def requireTwistedInternals() -> None:
    """
    Refuse to run on a Twisted that lacks any of these names.

    @raise TwistedIncompatible: naming the missing names, the installed
        Twisted and the tested range.
    """
    if MISSING:
        import twisted

        raise TwistedIncompatible(
            f"Twisted {twisted.__version__} lacks {', '.join(MISSING)}, which svc relies "
            f"on (svcd/common/twistedprivate.py); install a Twisted svc was tested with "
            f"({TESTED_TWISTED})"
        )


# The accessors. Each takes Any: Twisted's classes are partly untyped, and
# these names are absent from its stubs by nature.


def readingRequestLine(channel: Any) -> bool:
    """
    Whether the channel's next line is a request line (not a header).
    """
    return bool(getattr(channel, _FIRST_LINE))


def headerBytesSoFar(channel: Any) -> int:
    """
    The bytes of the current request's header block received so far.
    """
    return int(channel._receivedHeaderSize)


def headerCountSoFar(channel: Any) -> int:
    """
    The headers of the current request received so far.
    """
    return int(channel._receivedHeaderCount)


def handlingRequest(channel: Any) -> bool:
    """
    Whether a request of the channel has been read whole and is being
    answered.
    """
    return bool(channel._handlingRequest)


def bytesAfterRequest(channel: Any) -> list[bytes]:
    """
    What arrived after the current request's body, held for the next one.
    """
    buffered: list[bytes] = channel._dataBuffer
    return buffered


def dropBytesAfterRequest(channel: Any) -> None:
    """
    Forget what arrived after the current request (it is never read).
    """
    channel._dataBuffer = []


def stopChunkedBody(channel: Any) -> None:
    """
    End the channel's chunked body decoder's loop over what it holds, so
    that the rest of a refused body is never handed to the request.
    """
    decoder = channel._transferDecoder
    if decoder is not None:
        decoder.dataCallback = decoder.finishCallback = _ignore
        del decoder._buffer[:]


def answerAfterHeaders(channel: Any) -> None:
    """
    Make the channel hand the current request to the resource as soon as
    its headers are read: called from C{Request.gotLength}, a length of 0
    makes the channel call C{allContentReceived} at once.
    """
    channel.length = 0


def clientGone(request: Any) -> bool:
    """
    Whether the request's connection was lost.
    """
    return bool(request._disconnected)


def exitSignal(reactor: Any) -> int | None:
    """
    The signal that stopped the reactor (which twistd raises again once
    the reactor has stopped), or None.
    """
    number: int | None = getattr(reactor, _EXIT_SIGNAL)
    return number


def forgetExitSignal(reactor: Any) -> None:
    """
    Make twistd end the process normally, whatever signal stopped the
    reactor.
    """
    setattr(reactor, _EXIT_SIGNAL, None)
