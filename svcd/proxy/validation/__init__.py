"""
Validating bearers and agents with svc-auth: the gRPC client, the shared
calls, the change feed, the known token ids and the cache built on them (D8).
"""
