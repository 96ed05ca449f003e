"""
Calling OpenAI-compatible providers (decisions D9), for any daemon that
needs to: svc-proxy forwards its clients' chat completions and embeddings
(decisions D13) through it, and a daemon of Phase 4 calls providers as an
organization with the same client. It imports nothing of svc-proxy (a test checks it).

  - L{svcd.providers.providersfile}: the providers file, read and
    checked at start (its entries by L{svcd.providers.entries}, its
    values by L{svcd.providers.fields}), a leaf;
  - L{svcd.providers.table}: what it yields: providers, models with
    their fallbacks and prices, the C{[memory]} settings, and the
    lookups of a request;
  - L{svcd.providers.prices}: a model's price and the cost of an answer,
    in nano-dollars (decisions D12);
  - L{svcd.providers.http1}: the HTTP/1.1 client and its connection pool;
  - L{svcd.providers.upstream}: the request sent upstream over each
    provider's persistent connections, faults and fallbacks, usage,
    metrics (through a Protocol the daemon's metrics fill) and the
    upstream span;
  - L{svcd.providers.relay}: reading the answer, a bounded body or a
    stream of events relayed with backpressure;
  - L{svcd.providers.records}: what an answer leaves behind (its usage,
    the access log's record), a leaf.
"""
