"""
Which clients may call svc-memory (decisions D13, amended: "Internal
methods by caller"), checked by the daemons' interceptor
(L{svcd.common.internalcallers.InternalCallersInterceptor}) over every
method.

Every method of MemoryService takes the scope its caller names on trust,
and two kinds of caller need different ones. The worker's methods
(L{WORKER_METHODS}) claim any organization's queued conversations and
write memories into them: with mutual TLS only the certificates
C{SVC_GRPC_WORKER_SUBJECTS} names may call them. The others (the proxies'
memories, searches and queueing) answer only those of
C{SVC_GRPC_INTERNAL_SUBJECTS}. So a proxy's certificate, which a host
facing the Internet holds, can no longer read every organization's
conversations through ClaimObservations, and a worker's can no longer
search, change or delete memories beyond the observations it holds. A
name listed in both may call both.

Without mutual TLS there is no certificate to check: every method answers
whoever reaches the port, as before (the port stays on loopback or a
network only the proxies and workers reach).

Only the counting and the log line are svc-memory's own: its metric is
C{svc_memory_internal_calls_denied_total}.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from prometheus_client import Counter
from twisted.logger import Logger

from svcd.common.internalcallers import (
    Certificate,
    InternalCallersInterceptor,
    InternalSubjects,
    ThrottledDenialLog,
)

SERVICE = "svc.memory.v1.MemoryService"

# The methods that claim, renew, store or release observations: svc-worker's.
WORKER_METHODS = (
    "ClaimObservations",
    "RenewObservationLease",
    "StoreObservation",
    "ReleaseObservation",
    "CompleteObservation",
)

INTERNAL_VARIABLE = "SVC_GRPC_INTERNAL_SUBJECTS"
WORKER_VARIABLE = "SVC_GRPC_WORKER_SUBJECTS"


def deniedDetails(variable: str) -> str:
    """
    The details of a refusal: which of svc-memory's lists to change.
    """
    return (
        f"this method answers only the client certificates named in svc-memory's {variable};"
        " the client certificate's common name and DNS names are not among them"
    )


class MemoryDenialLog(ThrottledDenialLog):
    """
    Counts denied calls in C{svc_memory_internal_calls_denied_total{method}}
    and logs them at most once per C{interval}, with the latest one's
    certificate (public parts only; never metadata), naming the list
    (C{variable}) that would admit it.
    """

    log = Logger()

    def __init__(
        self,
        counter: Counter,
        methods: Iterable[str],
        clock: Callable[[], float] = time.monotonic,
        interval: float = 60.0,
        variable: str = INTERNAL_VARIABLE,
    ) -> None:
        super().__init__(counter, methods, clock, interval)
        self._variable = variable

    def logDenied(self, count: int, method: str, certificate: Certificate, peer: str) -> None:
        self.log.warn(
            "Denied {denied} MemoryService call(s) to client certificates not named in"
            " {variable}; the latest: {method} from {peer}, subject"
            " {subject!r}, DNS names {dns_names!r} (see svc_memory_internal_calls_denied_total)",
            denied=count,
            variable=self._variable,
            method=method,
            peer=peer,
            subject=certificate.subject,
            common_name=certificate.commonName,
            dns_names=",".join(certificate.dnsNames),
        )


def callerInterceptors(
    internalSubjects: frozenset[str],
    workerSubjects: frozenset[str],
    counter: Counter,
    methods: Iterable[str],
    answered: Callable[[str, str], None] | None = None,
) -> list[InternalCallersInterceptor]:
    """
    The two checks of mutual TLS: L{WORKER_METHODS} for the certificates
    C{workerSubjects} names, every other of C{methods} (MemoryService's)
    for those C{internalSubjects} names; each counts its denials in
    C{counter} and logs them naming its own variable.
    """
    others = tuple(method for method in methods if method not in WORKER_METHODS)
    return [
        InternalCallersInterceptor(
            InternalSubjects(internalSubjects),
            MemoryDenialLog(counter, others, variable=INTERNAL_VARIABLE),
            answered=answered,
            methods=others,
            service=SERVICE,
            details=deniedDetails(INTERNAL_VARIABLE),
        ),
        InternalCallersInterceptor(
            InternalSubjects(workerSubjects),
            MemoryDenialLog(counter, WORKER_METHODS, variable=WORKER_VARIABLE),
            answered=answered,
            methods=WORKER_METHODS,
            service=SERVICE,
            details=deniedDetails(WORKER_VARIABLE),
        ),
    ]
