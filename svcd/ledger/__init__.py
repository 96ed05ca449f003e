"""
Where the record of each provider call goes (decisions D12), for any daemon
that calls providers: the ledger's row of a call (L{svcd.ledger.rows}) and
the outbox that holds rows, journalled, until svc-auth has committed them
(L{svcd.ledger.outbox}), and the sender that carries them there and asks
svc-auth what a budget's period has cost (L{svcd.ledger.sender}, over the
daemon's connection to svc-auth, L{svcd.authclient}). What a row counts
and the price it is billed at are values of the floor it shares with the
limits and the providers (L{svcd.metering.charges},
L{svcd.metering.prices}); it imports neither of those packages, nor
anything of svc-proxy (tests check both).
"""
