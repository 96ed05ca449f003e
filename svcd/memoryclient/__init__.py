"""
The link to svc-memory that any daemon holds (svc-proxy, and svc-worker
of decisions D13): L{records} holds what the daemons and svc-memory share
(a scope, an embedding and a vector's rules, the bounds of a memory and an
observation, the details of refusals); L{channel} makes the one gRPC
channel (reconnection, keepalive, TLS); L{client} sends every
MemoryService method as a Deferred, under its deadline and in a bounded
number of calls at once; L{batches} coalesces a client's searches by
organization into SearchMany calls; L{errors} is how a call failed.

It imports nothing of svc-memory's daemon package (L{svcd.memory}), which
imports it for what both sides share (a test checks that svc-proxy and
svc-worker load none of svcd.memory).
"""
