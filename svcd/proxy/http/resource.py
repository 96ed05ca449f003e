"""
The Twisted Web resource of svc-proxy's edge: it routes every request,
runs it through the edge's chain of layers (L{svcd.proxy.http.edge}) and
writes the answer, and it counts the requests being answered, for a
graceful stop.

Routing is a table lookup on the canonical path (L{svcd.proxy.http.paths}):
every route takes every method, and every other path is the C{unmatched}
route, so 404 and 405 are answered by our own chain (with the envelope,
the headers, metrics and the access log).

Why the edge does not route with Klein, as svc-auth still does (it once
did): a request rendered by Klein sits in a reference cycle until the
cycle collector finds it. C{KleinResource.render} makes a closure that
refers to itself (C{processing_failed}, which holds the request;
twisted/klein pull request 101, open since 2016) and
werkzeug's matcher another (C{StateMachineMatcher.match._match}), so every
request left some 50 objects for the collector, whose pauses then landed
on the requests in flight (bench/README.rst, sixth round). Klein only
matched paths for the edge, which answered everything through its own
layers already; the canonical path leaves matching a dictionary lookup,
and the edge writes its answers itself (L{EdgeResource.serve}). A finished
request is freed by reference counting (tests/test_gc_cycles.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from twisted.internet.defer import CancelledError, Deferred
from twisted.python.failure import Failure
from twisted.web.iweb import IRequest
from twisted.web.resource import IResource
from twisted.web.server import NOT_DONE_YET
from zope.interface import implementer

from svcd.common.twistedprivate import clientGone
from svcd.proxy.http.context import Handler, RequestContext, Route
from svcd.proxy.http.paths import RouteTable, isCanonicalPath

_NO_PARAMS: Mapping[str, str] = {}


@implementer(IResource)
class EdgeResource:
    """
    The resource of every path: the edge routes it and answers.

    Whatever is not the canonical spelling of a route (decisions D10,
    L{svcd.proxy.http.paths}), or not UTF-8 in its path segments or Host
    once percent-decoded, is an unknown path: our 404.

    @param chain: the edge's global layers around its router
        (L{svcd.proxy.http.edge.ProxyEdge.router}).
    @param routes: the edge's route table.
    @param unmatched: the route of every other path.
    """

    isLeaf = True

    def __init__(self, chain: Handler, routes: Sequence[Route], unmatched: Route) -> None:
        self._chain = chain
        self._table = RouteTable((route.template, route) for route in routes)
        self.unmatched = unmatched
        self._inFlight = 0
        self._idle: list[Deferred[None]] = []

    def getChildWithDefault(self, name: bytes, request: IRequest) -> IResource:
        return self

    def putChild(self, path: bytes, child: IResource) -> None:
        raise NotImplementedError("the proxy's routes are fixed")

    def render(self, request: IRequest) -> Any:
        webRequest: Any = request
        route, params = self.unmatched, _NO_PARAMS
        path = webRequest.path
        if isCanonicalPath(path):
            try:
                webRequest.getRequestHostname().decode("utf-8")
                route, params = self.routeOf(path)
            except UnicodeDecodeError:
                pass
        return self.serve(request, route, params)

    def routeOf(self, path: bytes) -> tuple[Route, Mapping[str, str]]:
        """
        The route of a canonical path (L{isCanonicalPath}) whose segments
        are UTF-8 once percent-decoded, and its parameters, decoded;
        L{unmatched} for every other path.
        """
        return self._table.routeOf(path) or (self.unmatched, _NO_PARAMS)

    def serve(self, request: IRequest, route: Route, params: Mapping[str, str]) -> int:
        """
        Answer C{request} for C{route}, through every layer and step, and
        write the answer; C{NOT_DONE_YET} for Twisted Web.
        """
        # Twisted's Request is untyped; these few calls go through Any.
        webRequest: Any = request
        answer = Deferred.fromCoroutine(self._respond(webRequest, route, params))
        if not answer.called:
            # The client went away: the request's work stops.
            webRequest.notifyFinish().addErrback(lambda _: answer.cancel())
        return NOT_DONE_YET

    async def _respond(self, webRequest: Any, route: Route, params: Mapping[str, str]) -> None:
        ctx = RequestContext(webRequest, route, webRequest.method.decode("latin-1"), params)
        try:
            body = await self._answer(ctx)
        except CancelledError:
            return
        except Exception:
            # The layers answer every fault of a step; this is a fault of
            # the edge itself. Twisted's own 500, as for any resource.
            if not webRequest.finished and not clientGone(webRequest):
                webRequest.processingFailed(Failure())
            return
        if not webRequest.finished and not clientGone(webRequest):
            webRequest.write(body)
            webRequest.finish()

    async def _answer(self, ctx: RequestContext) -> bytes:
        self._inFlight += 1
        try:
            reply = await self._chain(ctx)
            if reply.streamed:
                # Its status line, headers and body are written already.
                return b""
            request = ctx.request
            request.setResponseCode(reply.status)
            headers = request.responseHeaders
            headers.setRawHeaders(b"Content-Type", [reply.contentType])
            # A known length spares the chunked framing Twisted's
            # Request.write would otherwise use.
            headers.setRawHeaders(b"Content-Length", [b"%d" % len(reply.body)])
            # Twisted's "Server: TwistedWeb/<version>" tells attackers too much.
            headers.removeHeader(b"Server")
            for name, value in reply.headers:
                headers.addRawHeader(name, value)
            return reply.body
        finally:
            self._inFlight -= 1
            if not self._inFlight and self._idle:
                waiting, self._idle = self._idle, []
                for idle in waiting:
                    idle.callback(None)

    @property
    def requestsInFlight(self) -> int:
        """
        How many requests are being answered now.
        """
        return self._inFlight

    def whenIdle(self) -> Deferred[None]:
        """
        A Deferred that fires once no request is being answered; cancelling
        it (a stop's timeout) withdraws it.
        """

        def withdraw(waiter: Deferred[None]) -> None:
            if waiter in self._idle:
                self._idle.remove(waiter)

        idle: Deferred[None] = Deferred(withdraw)
        if not self._inFlight:
            idle.callback(None)
        else:
            self._idle.append(idle)
        return idle
