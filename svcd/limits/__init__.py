"""
Limits and budgets (decisions D5, D10, D11, D12, D16), for any daemon that
calls providers: the limit book of every limits and budget row
(L{svcd.limits.book}), the limiter over Redis (L{svcd.limits.limiter},
which composes its parts: the scripts and keys in Redis, the calls shared
on the request's path, the check of one request, settlements, budget
members and reconciliation, over one Redis server or a Redis
Cluster's masters: L{svcd.limits.clusterlink}), the circuit breaker that
keeps a failing Redis cheap (L{svcd.limits.breaker}), what a chat
completion or an embeddings request (D13) reserves at admission
(L{svcd.limits.reservation}) and the shapes they share
(L{svcd.limits.records}, a leaf). Of the providers and the ledger it
imports only the floor they share (L{svcd.metering}: the models, the
usage, the bodies a budget measures), and nothing of svc-proxy (tests
check both).
"""
