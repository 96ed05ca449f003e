"""
How many gRPC calls a daemon serves at once, per client connection and in
total (decisions D10), so that one greedy caller cannot starve the proxies:
written for svc-auth, whose figures these are, and serving svc-memory's
calls the same way.

Why here, and how it fits grpcio's synchronous server (grpc/_server.py):

  - grpcio's polling thread takes each new call, runs the interceptors'
    C{intercept_service} to find its handler, and submits the handler to
    the server's C{ThreadPoolExecutor}. That executor queues without bound
    once every thread is busy; a call queued there waits behind calls that
    may each wait 250 ms for a cold slot (L{svcd.auth.authority}), far past
    the proxy's 50 ms deadline. That queue is what must never fill.
  - C{intercept_service} sees the method and the metadata but not the
    peer: C{ServicerContext.peer()} exists only once the handler runs, on a
    pool thread. So calls are admitted there, at the start of the handler:
    past a bound the call is answered RESOURCE_EXHAUSTED at once, never
    queued.
  - The pool has a thread for every call that can be admitted plus
    C{spareThreads}, so a refusal, which also runs on a pool thread, never
    waits behind admitted calls; and grpcio's own C{maximum_concurrent_rpcs}
    is set to the pool size, so that the executor's queue stays empty even
    if refusals pile up: past it, grpcio itself answers RESOURCE_EXHAUSTED
    from the polling thread.
  - A refusal in Python is cheap but not free: the polling thread and a
    pool thread each take the interpreter lock for it, and a client that
    sends a new call the moment the last one is refused keeps doing so.
    Measured with 128 calls kept in flight on one connection and no other
    limit, those refusals alone held svc-auth at a full core and the
    proxy's calls missed their deadline all the same (every valid request
    a 503). So HTTP/2 bounds the calls one connection can have open at
    all (SETTINGS_MAX_CONCURRENT_STREAMS, L{Bounds.streamsPerConnection}):
    grpcio's C core refuses a stream past it (REFUSED_STREAM, which the
    client sees as UNAVAILABLE) without any Python. That limit is the sum
    of every lane's per-peer bound, so within it the per-peer count of one
    lane still answers RESOURCE_EXHAUSTED past that lane's own bound.

Calls are admitted into a L{Lane}: every method shares the C{calls} lane
unless L{Bounds.lanes} gives it one of its own, with its own totals and its
own threads. A long-lived stream (a change feed, one per proxy) belongs in
a lane of its own, so that streams and short calls never take each other's
slots.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import attrs
import grpc
from prometheus_client import Counter
from twisted.logger import Logger

from svcd.common.metrics import Children

# The reasons of svc_auth_grpc_refused_total (svc_memory_grpc_refused_total),
# a fixed set.
PEER = "peer"
TOTAL = "total"
DEADLINE = "deadline"
REASONS = (PEER, TOTAL, DEADLINE)


@attrs.frozen
class Lane:
    """
    A share of a daemon's gRPC threads: at most C{total} calls of its
    methods run at once, at most C{perPeer} of them for one client
    connection.
    """

    name: str
    total: int
    perPeer: int


# grpcio's health Watch and server reflection are streams that can stay
# open for as long as the client likes; they get a small lane of their own
# so that they can never take the threads of the short calls.
STANDARD_STREAMS = Lane("streams", total=4, perPeer=2)
_STANDARD_STREAM_METHODS = (
    "/grpc.health.v1.Health/Watch",
    "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
)


@attrs.frozen
class Bounds:
    """
    The admission policy of the gRPC server.

    @ivar calls: the lane of every method not named in C{lanes}.
    @ivar lanes: full method names (C{/package.Service/Method}) mapped to a
        lane of their own.
    @ivar spareThreads: threads beyond the admitted calls, for refusals.
    """

    calls: Lane
    lanes: Mapping[str, Lane] = attrs.field(factory=dict)
    spareThreads: int = 8

    @classmethod
    def standard(cls, total: int, perPeer: int) -> Bounds:
        """
        The daemons' policy: C{total} short calls at once, C{perPeer} of them
        per connection, and the standard streams in their own small lane.
        """
        return cls(
            calls=Lane("calls", total=total, perPeer=perPeer),
            lanes={method: STANDARD_STREAMS for method in _STANDARD_STREAM_METHODS},
        )

    def withLane(self, method: str, lane: Lane) -> Bounds:
        """
        These bounds with C{method} admitted into C{lane}, whose threads
        are added to the pool.
        """
        return attrs.evolve(self, lanes={**self.lanes, method: lane})

    def allLanes(self) -> list[Lane]:
        """
        Every lane once, the calls lane first.
        """
        distinct = {self.calls: None}
        distinct.update(dict.fromkeys(self.lanes.values()))
        return list(distinct)

    @property
    def streamsPerConnection(self) -> int:
        """
        HTTP/2's limit on the calls one connection has open at once,
        admitted or not (SETTINGS_MAX_CONCURRENT_STREAMS): the sum of the
        lanes' per-peer bounds, so that a client within them never meets
        it. See the module docstring.
        """
        return sum(lane.perPeer for lane in self.allLanes())

    @property
    def threads(self) -> int:
        """
        The size of the server's thread pool: every call that can be
        admitted, plus the spare threads.
        """
        return sum(lane.total for lane in self.allLanes()) + self.spareThreads


class Refused(Exception):
    """
    A call was not admitted; C{reason} is one of L{REASONS}.
    """

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class _LaneState:
    """
    The calls running in one lane, in total and per peer.
    """

    def __init__(self, lane: Lane) -> None:
        self.lane = lane
        self._lock = threading.Lock()
        self._running = 0
        self._byPeer: dict[str, int] = {}

    def enter(self, peer: str) -> None:
        """
        Admit one call of C{peer}, or raise L{Refused}.
        """
        with self._lock:
            mine = self._byPeer.get(peer, 0)
            if mine >= self.lane.perPeer:
                raise Refused(PEER, "too many calls at once on this connection")
            if self._running >= self.lane.total:
                raise Refused(TOTAL, "too many calls at once")
            self._running += 1
            self._byPeer[peer] = mine + 1

    def leave(self, peer: str) -> None:
        with self._lock:
            self._running -= 1
            remaining = self._byPeer[peer] - 1
            if remaining:
                self._byPeer[peer] = remaining
            else:
                # Peers come and go (a port per connection): keep none
                # that has nothing running.
                del self._byPeer[peer]

    def running(self) -> tuple[int, int]:
        """
        Calls running, and peers with calls running (for tests).
        """
        with self._lock:
            return self._running, len(self._byPeer)


class _Ticket:
    """
    One admitted call; L{release} frees its slot once, however often it is
    called (by the handler's end and by grpcio's end-of-call callback).
    """

    def __init__(self, state: _LaneState, peer: str) -> None:
        self._state = state
        self._peer = peer
        self._lock = threading.Lock()
        self._held = True

    def release(self) -> None:
        with self._lock:
            held, self._held = self._held, False
        if held:
            self._state.leave(self._peer)


class RefusalLog:
    """
    Counts refused calls in C{counter} (svc_auth_grpc_refused_total{reason},
    svc_memory_grpc_refused_total{reason}) and logs them at most once per
    C{interval} per reason, with the count since the last line. Refusals by
    bound are warnings (the daemon is being pushed);
    calls dropped past their deadline are info (the client has gone).

    Called from grpcio's threads: the bookkeeping holds a lock.

    @param clock: monotonic seconds.
    """

    log = Logger()

    def __init__(
        self, counter: Counter, clock: Callable[[], float] = time.monotonic, interval: float = 60.0
    ) -> None:
        self._counter = counter
        self._clock = clock
        self._interval = interval
        self._children = Children()
        self._lock = threading.Lock()
        self._lastLogged: dict[str, float] = {}
        self._unlogged: dict[str, int] = dict.fromkeys(REASONS, 0)
        for reason in REASONS:
            # Present from the start at 0, so that rate() sees the first one.
            self._children.of(counter, reason)

    def refused(self, reason: str, **fields: object) -> None:
        """
        Count one refusal for C{reason}; log it if no line for this reason
        was logged in the last interval.
        """
        self._children.of(self._counter, reason).inc()
        now = self._clock()
        with self._lock:
            self._unlogged[reason] += 1
            last = self._lastLogged.get(reason)
            if last is not None and now - last < self._interval:
                return
            self._lastLogged[reason] = now
            count, self._unlogged[reason] = self._unlogged[reason], 0
        if reason == DEADLINE:
            self.log.info(
                "Dropped {refused} gRPC call(s) whose deadline passed while they waited",
                reason=reason,
                refused=count,
                **fields,
            )
        else:
            self.log.warn(
                "Refused {refused} gRPC call(s) with RESOURCE_EXHAUSTED: too many calls at "
                "once ({reason}; see svc_auth_grpc_refused_total)",
                reason=reason,
                refused=count,
                **fields,
            )


Behaviour = Callable[[Any, grpc.ServicerContext], Any]


class AdmissionInterceptor(grpc.ServerInterceptor):  # type: ignore[misc]
    """
    Admits each call into its lane of L{Bounds} when its handler starts, or
    answers RESOURCE_EXHAUSTED at once; the slot is freed when the call
    ends, whether it answers, fails, is cancelled or runs out of time.

    Put it first among the server's interceptors, so that a refused call
    costs nothing more (no span, no parsing).

    @param answered: called with the short method name and the status code
        name of each refused call of C{countedService}, for the daemon's
        count of answers (svc_auth_grpc_requests_total,
        svc_memory_grpc_requests_total).
    @param countedService: the daemon's own service
        (C{svc.auth.v1.AuthService}), whose refusals C{answered} counts.
    """

    def __init__(
        self,
        bounds: Bounds,
        refusals: RefusalLog,
        answered: Callable[[str, str], None] | None = None,
        *,
        countedService: str,
    ) -> None:
        self._bounds = bounds
        self._refusals = refusals
        self._answered = answered
        self._countedPrefix = f"/{countedService}/"
        self._states = {lane: _LaneState(lane) for lane in bounds.allLanes()}
        # Only grpcio's polling thread calls intercept_service: no lock.
        self._wrapped: dict[str, tuple[Any, Any]] = {}

    def laneState(self, method: str) -> _LaneState:
        return self._states[self._bounds.lanes.get(method, self._bounds.calls)]

    def intercept_service(self, continuation: Callable[[Any], Any], details: Any) -> Any:
        handler = continuation(details)
        if handler is None:
            return None
        method: str = details.method
        cached = self._wrapped.get(method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        wrapped = self._wrap(method, handler)
        self._wrapped[method] = (handler, wrapped)
        return wrapped

    def _wrap(self, method: str, handler: Any) -> Any:
        state = self.laneState(method)
        codecs = {
            "request_deserializer": handler.request_deserializer,
            "response_serializer": handler.response_serializer,
        }
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                self._oneAnswer(method, state, handler.unary_unary), **codecs
            )
        if handler.stream_unary is not None:
            return grpc.stream_unary_rpc_method_handler(
                self._oneAnswer(method, state, handler.stream_unary), **codecs
            )
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                self._streamedAnswers(method, state, handler.unary_stream), **codecs
            )
        return grpc.stream_stream_rpc_method_handler(
            self._streamedAnswers(method, state, handler.stream_stream), **codecs
        )

    def _admit(self, method: str, state: _LaneState, context: grpc.ServicerContext) -> _Ticket:
        peer = context.peer()
        try:
            state.enter(peer)
        except Refused as refused:
            self._refusals.refused(
                refused.reason,
                lane=state.lane.name,
                limit=state.lane.perPeer if refused.reason == PEER else state.lane.total,
                **({"peer": peer} if refused.reason == PEER else {}),
            )
            if self._answered is not None and method.startswith(self._countedPrefix):
                self._answered(method[len(self._countedPrefix) :], "RESOURCE_EXHAUSTED")
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(refused))
            raise AssertionError("context.abort returned") from None
        return _Ticket(state, peer)

    def _oneAnswer(self, method: str, state: _LaneState, behaviour: Behaviour) -> Behaviour:
        def admitted(request: Any, context: grpc.ServicerContext) -> Any:
            ticket = self._admit(method, state, context)
            try:
                return behaviour(request, context)
            finally:
                ticket.release()

        return admitted

    def _streamedAnswers(self, method: str, state: _LaneState, behaviour: Behaviour) -> Behaviour:
        def admitted(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            ticket = self._admit(method, state, context)
            # A cancelled stream is not always closed by grpcio; its
            # end-of-call callback frees the slot then.
            context.add_callback(ticket.release)
            try:
                yield from behaviour(request, context)
            finally:
                ticket.release()

        return admitted
