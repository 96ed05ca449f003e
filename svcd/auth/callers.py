"""
Which clients may call svc-auth's internal methods (decisions D12,
amended).

Three methods of AuthService trust their caller rather than a token:
RecordUsage writes ledger rows for any organization, GetSpend reads any
organization's spend, and WatchChanges streams every token id, limit and
budget. The proxies need them; nobody else does. With mutual TLS every
client holds a certificate of the client CA, and that CA may sign more
than the proxies' certificates (an operator's tool, a future worker that
only validates tokens): a certificate of the CA proves membership of the
internal network, not that its holder is a proxy. So these methods answer
only the certificates that C{SVC_GRPC_INTERNAL_SUBJECTS} names, by their
subject's common name or one of their DNS subjectAltNames; any other is
answered PERMISSION_DENIED before the method runs.

Without mutual TLS there is no client identity to check: the methods answer
whoever reaches the port, as before, and the port must stay on an internal
network (or loopback). L{svcd.auth.config} refuses a list without a client
CA and a client CA without a list, so that neither silently does nothing.

The check itself is every daemon's (L{svcd.common.internalcallers}); what
is svc-auth's here is which methods it guards, what a denial answers, and
its metric and log line.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter
from twisted.logger import Logger

from svcd.common.internalcallers import Certificate, ThrottledDenialLog

SERVICE = "svc.auth.v1.AuthService"

# The methods that write usage or read every organization's rows.
INTERNAL_METHODS = ("RecordUsage", "GetSpend", "WatchChanges")

DENIED_DETAILS = (
    "this method answers only the internal services named in svc-auth's "
    "SVC_GRPC_INTERNAL_SUBJECTS; the client certificate's common name and DNS names "
    "are not among them"
)


class DenialLog(ThrottledDenialLog):
    """
    Counts denied calls in C{svc_auth_internal_calls_denied_total{method}}
    and logs them at most once per C{interval}, with the count since the
    last line and the certificate of the latest one (its subject and DNS
    names, public parts of a certificate; never metadata, which may carry
    a token).

    Called from grpcio's threads: the bookkeeping holds a lock.

    @param clock: monotonic seconds.
    """

    log = Logger()

    def __init__(
        self,
        registry: CollectorRegistry,
        methods: Iterable[str] = INTERNAL_METHODS,
        clock: Callable[[], float] = time.monotonic,
        interval: float = 60.0,
    ) -> None:
        super().__init__(
            Counter(
                "svc_auth_internal_calls_denied_total",
                "Calls of an internal method (RecordUsage, GetSpend, WatchChanges) answered "
                "PERMISSION_DENIED: the client certificate is not named in "
                "SVC_GRPC_INTERNAL_SUBJECTS",
                ["method"],
                registry=registry,
            ),
            methods,
            clock,
            interval,
        )

    def logDenied(self, count: int, method: str, certificate: Certificate, peer: str) -> None:
        self.log.warn(
            "Denied {denied} call(s) of internal methods to client certificates not named in "
            "SVC_GRPC_INTERNAL_SUBJECTS; the latest: {method} from {peer}, subject "
            "{subject!r}, DNS names {dns_names!r} (see svc_auth_internal_calls_denied_total)",
            denied=count,
            method=method,
            peer=peer,
            subject=certificate.subject,
            common_name=certificate.commonName,
            # One text, as every field of a JSON log line is a scalar.
            dns_names=",".join(certificate.dnsNames),
        )
