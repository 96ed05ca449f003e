"""
The link to svc-auth that any daemon holds (svc-proxy, and svc-worker of
decisions D13): L{channel} makes the one gRPC channel (reconnection,
keepalive, the retry of a call a stopping svc-auth cancelled, TLS);
L{slots} bounds the calls in flight, later stages of a request first;
L{connection} owns the channel (made at start, never before twistd's fork)
and sends each unary call traced, slotted and under its deadline, through
grpcio's futures bridged to Deferreds (L{svcd.common.grpcdefer});
L{feed} follows svc-auth's change feed (token changes for svc-proxy's
validation cache, limits, budgets and memory settings for any daemon's
limit book; L{knowntokens} is its filter of token ids).

What is said over the link lives with who says it: validation in
L{svcd.proxy.validation.client}, the ledger's RecordUsage and GetSpend in
L{svcd.ledger.sender}. It imports nothing of svc-proxy (a test checks it).
"""
