"""
grpcio's channel thread kept running between calls (L{holdChannelThread}).

A call made with grpcio's future API (L{svcd.common.grpcdefer}) is served
by a thread of its channel that waits for the call's events; grpcio starts
that thread when a call is made with none in flight and lets it end when
the last one ends. A client whose calls come one at a time (a quiet
proxy's recalls: one Search per chat request) so starts a thread for every
call, and the thread that makes the call (the reactor) waits for it to
start: measured 175 against 435 µs a C{future()} on a quiet machine, 206
against 1,255 on a loaded one, where the new thread waits for a core.

Holding one call open on the channel keeps the thread. The call held here
never reaches the server: it is made with one operation alone, the wait
for its status, and without its initial metadata no stream is opened, so
no server thread, admission slot or HTTP/2 stream is taken by it. It ends
when the channel closes (or L{HeldCall.release}), and the thread with it.

This uses grpcio's private call management (C{grpc._channel}); a channel
or a grpcio without it (a test's fake, a later release) is left as it is:
calls then start the thread as they did, nothing fails.
"""

from __future__ import annotations

from typing import Any

from twisted.logger import Logger

log = Logger()

# The method name the held call carries: never sent.
_HELD_METHOD = b"/svc.internal/HeldForTheChannelThread"


class HeldCall:
    """
    The call that keeps a channel's thread running.
    """

    def __init__(self, call: Any, cancelled: Any) -> None:
        self._call = call
        self._cancelled = cancelled

    def release(self) -> None:
        """
        End the held call; the channel's thread ends with its last call.
        """
        call, self._call = self._call, None
        if call is not None:
            call.cancel(self._cancelled, "released")


def _ended(_event: object) -> bool:
    # The held call's only event (its status: cancelled) ends it, so that
    # grpcio's thread may end once no other call is in flight.
    return True


def holdChannelThread(channel: Any) -> HeldCall | None:
    """
    Hold a call on C{channel} (a channel of grpcio's, plaintext or secure)
    that keeps its thread for calls running; None when that cannot be done
    with this channel or grpcio (nothing is held then).
    """
    try:
        from grpc import _channel as grpcChannel
        from grpc._cython import cygrpc

        state = channel._call_state
        create = grpcChannel._channel_managed_call_management(state)
        operations = ((cygrpc.ReceiveStatusOnClientOperation(0),),)
        call = create(0, _HELD_METHOD, None, None, None, None, operations, _ended, None, None)
        cancelled = cygrpc.StatusCode.cancelled
    except Exception as error:
        log.info(
            "grpcio's channel thread is not held ({error_type}): each call made alone starts it",
            error_type=type(error).__name__,
        )
        return None
    return HeldCall(call, cancelled)
