"""
Where the record of each provider call goes (decisions D12), for any daemon
that calls providers: the ledger's row of a call (L{svcd.ledger.rows}) and
the outbox that holds rows, journalled, until svc-auth has committed them
(L{svcd.ledger.outbox}). The prices rows are billed at live with the
providers (L{svcd.providers.prices}). It imports nothing of svc-proxy (a
test checks it).
"""
