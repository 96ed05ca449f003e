"""
Which client certificates may call a daemon's internal methods (decisions
D12, amended; D13, amended): the check svc-auth and svc-memory both run
under mutual TLS, each over methods and lists of its own
(L{svcd.auth.callers}, L{svcd.memory.callers}).

A certificate of the client CA proves membership of the internal network,
not which service holds it; so a daemon answers its internal methods only
to the certificates a list names (C{SVC_GRPC_INTERNAL_SUBJECTS} and the
like, read by L{svcd.common.serversettings}), by their subject's common
name or one of their DNS subjectAltNames; any other is answered
PERMISSION_DENIED before the method runs.

The check runs in the handler, not in C{intercept_service}: grpcio gives the
peer's certificate (C{ServicerContext.auth_context}) only to the handler.
It comes after L{svcd.common.grpcadmission}'s interceptor, so a caller
denied here is still bounded like any other.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from typing import Any, Protocol

import attrs
import grpc
from prometheus_client import Counter

from svcd.common.metrics import Children

# The grpcio auth context's properties (grpc/src/core/tsi/ssl_transport_security
# as exposed by grpcio): the subject's common name (b"" when it has none)
# and the DNS names among the subjectAltNames (IP, URI and email names are
# other properties, never matched).
_COMMON_NAME = "x509_common_name"
_DNS_NAMES = "peer_dns"
_SUBJECT = "x509_subject"


class BadSubjects(ValueError):
    """
    A value of C{SVC_GRPC_INTERNAL_SUBJECTS} that names nothing usable (the
    message says why).
    """


def parseSubjects(text: str) -> frozenset[str]:
    """
    The names of a comma-separated C{SVC_GRPC_INTERNAL_SUBJECTS}, each
    trimmed; empty entries are skipped.

    @raise BadSubjects: when no name is left, or one holds a control
        character (never part of a name, likely a mangled file).
    """
    names = [each.strip() for each in text.split(",")]
    names = [each for each in names if each]
    if not names:
        raise BadSubjects("names no certificate subject (a comma-separated list of names)")
    for name in names:
        if any(ord(character) < 0x20 or ord(character) == 0x7F for character in name):
            raise BadSubjects(f"the name {name!r} holds a control character")
    return frozenset(names)


@attrs.frozen
class Certificate:
    """
    What the check reads of a client certificate.

    @ivar subject: the whole subject, for the log only.
    """

    commonName: str
    dnsNames: tuple[str, ...]
    subject: str

    @classmethod
    def fromAuthContext(cls, properties: Mapping[str, Sequence[bytes]]) -> Certificate:
        def texts(key: str) -> list[str]:
            return [value.decode("utf-8", "replace") for value in properties.get(key, ()) if value]

        commonNames = texts(_COMMON_NAME)
        subjects = texts(_SUBJECT)
        return cls(
            commonName=commonNames[0] if commonNames else "",
            dnsNames=tuple(texts(_DNS_NAMES)),
            subject=subjects[0] if subjects else "",
        )


@attrs.frozen
class InternalSubjects:
    """
    The certificates allowed to call the internal methods: a name matches
    a certificate whose common name is exactly that name, or one of whose
    DNS subjectAltNames is that name regardless of ASCII case (DNS names
    are case-insensitive). Names are compared literally: a listed
    C{*.internal} matches only a certificate that says C{*.internal}.
    """

    names: frozenset[str]
    _dnsNames: frozenset[str] = attrs.field(init=False)

    @_dnsNames.default
    def _lowered(self) -> frozenset[str]:
        return frozenset(_asciiLower(name) for name in self.names)

    def admits(self, certificate: Certificate) -> bool:
        if certificate.commonName and certificate.commonName in self.names:
            return True
        return any(_asciiLower(name) in self._dnsNames for name in certificate.dnsNames)


def _asciiLower(text: str) -> str:
    return text.translate(_ASCII_LOWER)


_ASCII_LOWER = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")


class Denials(Protocol):
    """
    Where L{InternalCallersInterceptor} reports each call it denies.
    """

    def denied(self, method: str, certificate: Certificate, peer: str) -> None: ...


class ThrottledDenialLog:
    """
    Counts denied calls in C{counter}, by method (each method's series
    present from the start at 0, so that rate() sees the first one), and
    has them logged at most once per C{interval}, with the count since the
    last line and the certificate of the latest one: each daemon words its
    line in L{logDenied} (its subject and DNS names, public parts of a
    certificate; never metadata, which may carry a token).

    Called from grpcio's threads: the bookkeeping holds a lock.

    @param clock: monotonic seconds.
    """

    def __init__(
        self,
        counter: Counter,
        methods: Iterable[str],
        clock: Callable[[], float] = time.monotonic,
        interval: float = 60.0,
    ) -> None:
        self.counter = counter
        self._children = Children()
        for method in methods:
            self._children.of(counter, method)
        self._clock = clock
        self._interval = interval
        self._lock = threading.Lock()
        self._lastLogged: float | None = None
        self._unlogged = 0

    def denied(self, method: str, certificate: Certificate, peer: str) -> None:
        self._children.of(self.counter, method).inc()
        now = self._clock()
        with self._lock:
            self._unlogged += 1
            if self._lastLogged is not None and now - self._lastLogged < self._interval:
                return
            self._lastLogged = now
            count, self._unlogged = self._unlogged, 0
        self.logDenied(count, method, certificate, peer)

    def logDenied(self, count: int, method: str, certificate: Certificate, peer: str) -> None:
        """
        Log C{count} denials, the latest of C{method} from C{peer}.
        """
        raise NotImplementedError


Behaviour = Callable[[Any, grpc.ServicerContext], Any]


class InternalCallersInterceptor(grpc.ServerInterceptor):  # type: ignore[misc]
    """
    Answers PERMISSION_DENIED to a call of one of C{methods} (short names of
    C{service}) whose client certificate L{InternalSubjects} does not
    admit; every other call passes untouched.

    @param answered: called with the short method name and
        C{"PERMISSION_DENIED"} for each denial, for the daemon's count of
        answers.
    @param details: the refusal's details (naming the list to change).
    """

    def __init__(
        self,
        subjects: InternalSubjects,
        denials: Denials,
        answered: Callable[[str, str], None] | None = None,
        *,
        methods: Collection[str],
        service: str,
        details: str,
    ) -> None:
        self._subjects = subjects
        self._details = details
        self._denials = denials
        self._answered = answered
        self._methods = {f"/{service}/{name}": name for name in methods}
        # Only grpcio's polling thread calls intercept_service: no lock.
        self._wrapped: dict[str, tuple[Any, Any]] = {}

    def intercept_service(self, continuation: Callable[[Any], Any], details: Any) -> Any:
        handler = continuation(details)
        name = self._methods.get(details.method)
        if handler is None or name is None:
            return handler
        cached = self._wrapped.get(details.method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        wrapped = self._wrap(name, handler)
        self._wrapped[details.method] = (handler, wrapped)
        return wrapped

    def _wrap(self, name: str, handler: Any) -> Any:
        codecs = {
            "request_deserializer": handler.request_deserializer,
            "response_serializer": handler.response_serializer,
        }
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                self._oneAnswer(name, handler.unary_unary), **codecs
            )
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                self._streamedAnswers(name, handler.unary_stream), **codecs
            )
        raise NotImplementedError(f"{name}: a stream of requests")

    def _check(self, name: str, context: grpc.ServicerContext) -> None:
        certificate = Certificate.fromAuthContext(context.auth_context())
        if self._subjects.admits(certificate):
            return
        self._denials.denied(name, certificate, context.peer())
        if self._answered is not None:
            self._answered(name, "PERMISSION_DENIED")
        context.abort(grpc.StatusCode.PERMISSION_DENIED, self._details)
        raise AssertionError("context.abort returned")

    def _oneAnswer(self, name: str, behaviour: Behaviour) -> Behaviour:
        def checked(request: Any, context: grpc.ServicerContext) -> Any:
            self._check(name, context)
            return behaviour(request, context)

        return checked

    def _streamedAnswers(self, name: str, behaviour: Behaviour) -> Behaviour:
        def checked(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            self._check(name, context)
            yield from behaviour(request, context)

        return checked
