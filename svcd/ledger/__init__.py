"""
Where the record of each provider call goes (decisions D12), for any daemon
that calls providers: the ledger's row of a call (L{svcd.ledger.rows}) and
the outbox that holds rows, journalled, until svc-auth has committed them
(L{svcd.ledger.outbox}), and the sender that carries them there and asks
svc-auth what a budget's period has cost (L{svcd.ledger.sender}, over the
daemon's connection to svc-auth, L{svcd.authclient}). The prices rows are
billed at live with the providers (L{svcd.providers.prices}). It imports
nothing of svc-proxy (a test checks it).
"""
