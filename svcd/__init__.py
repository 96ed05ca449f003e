"""
svc: a tenant-aware LLM gateway: svc-proxy, svc-auth, svc-memory and
svc-worker, and svcctl.

Importing the package settles grpcio's transport for the process
(L{svcd.common.grpcruntime}): grpcio reads it once, when it is first
imported, and every daemon and svcctl import this package before any
module of theirs imports grpcio.
"""

from svcd.common.grpcruntime import settleGrpcTransport

settleGrpcTransport()
