"""
svc-proxy, the public HTTP edge. Its subpackages follow a request's way
through it, in the order of spec 4.1:

  - L{svcd.proxy.http}: the HTTP edge. C{site} guards the connection (body
    bounds, parser refusals); C{resource} routes each request and writes
    its answer; C{edge} holds the global layers and the route table,
    whose order reads off L{svcd.proxy.http.edge.ProxyEdge}; C{steps} the
    steps every route shares (the body, the caller, the per-minute limit,
    which reserves what a route says); C{routes} one module per route
    family (C{ops}, C{probes}, C{models}, C{chat}, C{embeddings},
    C{memories}); C{context} is the request's state along the steps and
    the shapes of layers and steps; C{paths}, C{chatbody},
    C{embeddingsbody} and C{memorybody} are the rules for the path and
    the bodies (D13).
  - Memory, below the edge (D13): C{memoryheaders} reads a request's
    memory headers (C{X-SVC-Memory}, C{X-SVC-Memory-Subject}) for the
    memory routes, recall and observation alike; C{recall} is a chat
    completion's context assembly and C{observe} its observation. None of
    them imports L{svcd.proxy.http}: the edge imports them, never the
    reverse (tests/test_proxy_imports.py: no module of svcd.proxy imports
    itself through others).
  - L{svcd.proxy.validation}: who calls. The validation client of
    svc-auth, the shared calls, the change feed, the known token ids and
    the cache that answers from memory while the feed is live (D8).

How much a caller may (the limit book, the admission script in Redis, the
breaker, the reservation), where the request goes (the providers file, the
HTTP/1.1 client of the providers, the relay of answers) and where its
record goes (the usage row, the outbox and its journal, the sender of
RecordUsage and GetSpend) are packages of their own, which any daemon
that calls providers imports without this one: L{svcd.limits} (D5, D10,
D11, D12), L{svcd.providers} (D9) and L{svcd.ledger} (D12); so is the
connection to svc-auth (L{svcd.authclient}), one per proxy, which the
validations, the ledger's sender and the change feed share.

Beside them: L{svcd.proxy.records}, who calls, in shapes every stage
shares (a leaf: it imports none of the above); C{config}, types and
parsing only (a leaf too), and C{metrics}, read by all; and the daemon:
C{assembly} (the wiring, called by the tap and by the tests alike), C{tap}
(options and what only a real process does) with C{service} and
C{listening} (start, listen, drain, stop).
"""
