"""
The metered call (decisions D11, D12, D13): a provider call admitted
against the limits and budgets, forwarded, settled and billed in the
ledger, for any daemon that calls providers as an organization.

  - L{svcd.metered.embedder}: the gateway's own embeddings (the memory
    routes', a recall's, the worker's), and the one rule that bills an
    embedding (L{svcd.metered.embedder.embeddingCharge}), which a client's
    C{POST /v1/embeddings} and a recall's chat share;
  - L{svcd.metered.batches}: recalls' embeddings coalesced by
    organization;
  - L{svcd.metered.metrics}: the series of the calls, their admission and
    their rows, one class that meets the Protocols of all three packages.

Above the packages it joins (L{svcd.providers}, L{svcd.limits},
L{svcd.ledger}), which import only their shared floor, L{svcd.metering},
and never this package. It imports nothing of svc-proxy (a test checks
it), so that svc-worker can use it.
"""
