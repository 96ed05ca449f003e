"""
Validating bearers and agents with svc-auth: the validation client (on
the proxy's connection to svc-auth, L{svcd.authclient}), the shared calls,
the change feed, the known token ids and the cache built on them (D8).
"""
