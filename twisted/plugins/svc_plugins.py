"""
twistd plugins of the svc gateway: C{twistd -n svc-auth},
C{twistd -n svc-proxy}, C{twistd -n svc-memory} and C{twistd -n svc-worker}.

Each plugin is one statement; options and makeService live in
svcd.<part>.tap and are imported only when the plugin is used, so
C{twistd --help} stays fast.
"""

from twisted.application.service import ServiceMaker

svcAuth = ServiceMaker(
    "svc-auth",
    "svcd.auth.tap",
    "svc auth service: gRPC svc.auth.v1.AuthService plus /health, /ready, /metrics",
    "svc-auth",
)

svcProxy = ServiceMaker(
    "svc-proxy",
    "svcd.proxy.tap",
    "svc proxy: the public HTTP edge of the gateway",
    "svc-proxy",
)

svcMemory = ServiceMaker(
    "svc-memory",
    "svcd.memory.tap",
    "svc memory service: gRPC svc.memory.v1.MemoryService plus /health, /ready, /metrics",
    "svc-memory",
)

svcWorker = ServiceMaker(
    "svc-worker",
    "svcd.worker.tap",
    "svc worker: observations become memories, paid for by the organization",
    "svc-worker",
)
