"""
The route families of svc-proxy's edge, one module each: a class that
takes what its routes read and offers their own steps and handlers, which
L{svcd.proxy.http.edge.ProxyEdge._routeTable} puts in order beside the
shared steps (L{svcd.proxy.http.steps}).

  - L{ops}: /health, /ready and /metrics;
  - L{probes}: the auth probes;
  - L{models}: GET /v1/models;
  - L{conversation}: the steps of the routes that forward a
    conversation to a provider, in their clients' dialect: L{chat}, POST
    /v1/chat/completions, and L{messages}, POST /v1/messages and
    /v1/messages/count_tokens (decisions D14);
  - L{embeddings}: POST /v1/embeddings, forwarded to a provider (decisions
    D13);
  - L{memories}: the memory routes, on svc-memory (decisions D13).

A new route family is a new module here and its lines in the route
table, opened as every route of a caller is
(L{svcd.proxy.http.edge.ProxyEdge._opening}), with what it reserves at the
per-minute limit; how it reserves, settles and records lives with the
limits (L{svcd.limits}) and the ledger (L{svcd.ledger}).
"""
