"""
svc-proxy, the public HTTP edge. Its subpackages follow a request's way
through it, in the order of spec 4.1:

  - L{svcd.proxy.http}: the HTTP edge. C{site} guards the connection (body
    bounds, parser refusals); C{edge} holds the routes and the middleware,
    whose order reads off L{svcd.proxy.http.edge.ProxyEdge}; C{context} is
    the request's state along the steps; C{paths} and C{chatbody} are the
    rules for the path and the chat body.
  - L{svcd.proxy.validation}: who calls. The gRPC client of svc-auth, the
    shared calls, the change feed, the known token ids and the cache that
    answers from memory while the feed is live (D8).
  - L{svcd.proxy.limits}: how much they may. The limiter in Redis and the
    circuit breaker that keeps a failing Redis cheap (D5, D10).
  - L{svcd.proxy.forwarding}: where the request goes. The providers file,
    the HTTP/1.1 client of the providers, the relay of answers (D9).

Beside them: L{svcd.proxy.records}, the shapes every stage shares (a leaf:
it imports none of the above); C{config} and C{metrics}, read by all; and
the daemon: C{assembly} (the wiring, called by the tap and by the tests
alike), C{tap} (options and what only a real process does) with
C{service} and C{listening} (start, listen, drain, stop).
"""
