"""
Which clients may call svc-memory (decisions D13): every method of
MemoryService takes the scope its caller names on trust, so with mutual
TLS only the certificates C{SVC_GRPC_INTERNAL_SUBJECTS} names (the proxies'
and the workers') may call any of them, checked by svc-auth's interceptor
(L{svcd.auth.callers.InternalCallersInterceptor}) over every method.

Only the counting and the log line are svc-memory's own: its metric is
C{svc_memory_internal_calls_denied_total}.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable

from prometheus_client import Counter
from twisted.logger import Logger

from svcd.auth.callers import Certificate, DenialLog
from svcd.common.metrics import Children


class MemoryDenialLog(DenialLog):
    """
    Counts denied calls in C{svc_memory_internal_calls_denied_total{method}}
    and logs them at most once per C{interval}, with the latest one's
    certificate (public parts only; never metadata).

    A L{DenialLog} for svc-auth's interceptor, with every part of its own:
    DenialLog's constructor registers svc-auth's metric.
    """

    log = Logger()

    # DenialLog.__init__ is not called: see the class docstring.
    def __init__(
        self,
        counter: Counter,
        methods: Iterable[str],
        clock: Callable[[], float] = time.monotonic,
        interval: float = 60.0,
    ) -> None:
        self.counter = counter
        self._memoryChildren = Children()
        for method in methods:
            self._memoryChildren.of(counter, method)
        self._memoryClock = clock
        self._memoryInterval = interval
        self._memoryLock = threading.Lock()
        self._memoryLastLogged: float | None = None
        self._memoryUnlogged = 0

    def denied(self, method: str, certificate: Certificate, peer: str) -> None:
        self._memoryChildren.of(self.counter, method).inc()
        now = self._memoryClock()
        with self._memoryLock:
            self._memoryUnlogged += 1
            last = self._memoryLastLogged
            if last is not None and now - last < self._memoryInterval:
                return
            self._memoryLastLogged = now
            count, self._memoryUnlogged = self._memoryUnlogged, 0
        self.log.warn(
            "Denied {denied} MemoryService call(s) to client certificates not named in"
            " SVC_GRPC_INTERNAL_SUBJECTS; the latest: {method} from {peer}, subject"
            " {subject!r}, DNS names {dns_names!r} (see svc_memory_internal_calls_denied_total)",
            denied=count,
            method=method,
            peer=peer,
            subject=certificate.subject,
            common_name=certificate.commonName,
            dns_names=",".join(certificate.dnsNames),
        )
