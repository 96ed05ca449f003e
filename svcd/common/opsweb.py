"""
The operations routes of a daemon's HTTP port: C{/health}, C{/ready} and
C{/metrics} (spec 4.2), as a Klein app, and the site that serves them.

Every daemon but the proxy serves these from here (svc-auth today, the
daemons of decisions D13 next), each with its own checks and registry. The
proxy serves the same three routes from its own route table, beside its
hot path, which Klein would slow (measured: reference cycles per request);
both answer C{/ready} from L{svcd.common.readiness.SharedReadiness}.

Klein fits here: three routes polled every few seconds by load balancers
and Prometheus, off any hot path.
"""

from __future__ import annotations

import datetime
import json
import time
from collections.abc import Sequence
from typing import Any

from klein import Klein
from prometheus_client import CollectorRegistry
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.iweb import IRequest
from twisted.web.resource import IResource
from twisted.web.server import Request, Site
from werkzeug.exceptions import MethodNotAllowed, NotFound

from svcd.common.clocks import Clock, asReactorTime
from svcd.common.errors import ApiError, ErrorCode, envelope
from svcd.common.ids import uuid7
from svcd.common.metrics import CONTENT_TYPE, exposition
from svcd.common.readiness import READY_MAX_AGE, Check, SharedReadiness

HEALTH_BODY = {"status": "ok", "checks": {}}


def _json(request: IRequest, status: int, body: dict[str, Any]) -> bytes:
    request.setResponseCode(status)
    request.setHeader(b"Content-Type", b"application/json")
    return json.dumps(body, separators=(",", ":")).encode("utf-8")


class OperationsWeb:
    """
    The Klein app of a daemon's operations port.

    C{/ready} runs C{checks} at most once per C{maxAge} seconds, however
    many probes ask (decisions D10): anyone may probe it (spec 4.2: no
    authentication), and each run costs every dependency a call.

    Errors (an unknown path, a wrong method) use the same envelope as the
    proxy, so one client-side parser reads both.

    @param clock: the checks' timeouts and the age of a shared report.
    @param registry: what C{/metrics} exposes.
    @param docsBase: where the envelope's C{doc_url} points (SVC_ERROR_DOCS_BASE).
    """

    app = Klein()

    def __init__(
        self,
        clock: Clock,
        checks: Sequence[Check],
        registry: CollectorRegistry,
        docsBase: str | None = None,
        maxAge: float = READY_MAX_AGE,
    ) -> None:
        self._registry = registry
        self._docsBase = docsBase
        self.readiness = SharedReadiness(checks, clock, maxAge)

    def resource(self) -> IResource:
        """
        The app as a resource, for a L{OperationsSite}.
        """
        resource: IResource = self.app.resource()
        return resource

    def _error(self, request: IRequest, error: ApiError) -> bytes:
        requestID = str(uuid7())
        request.setHeader(b"X-Request-ID", requestID.encode("ascii"))
        return _json(
            request,
            error.status,
            envelope(
                error,
                requestID=requestID,
                now=datetime.datetime.now(datetime.UTC),
                docsBase=self._docsBase,
            ),
        )

    @app.route("/health", methods=["GET"])
    def health(self, request: IRequest) -> bytes:
        return _json(request, 200, HEALTH_BODY)

    @app.route("/ready", methods=["GET"])
    async def ready(self, request: IRequest) -> bytes:
        status, body = await self.readiness.get()
        request.setResponseCode(status)
        request.setHeader(b"Content-Type", b"application/json")
        return body

    @app.route("/metrics", methods=["GET"])
    def metrics(self, request: IRequest) -> bytes:
        request.setHeader(b"Content-Type", CONTENT_TYPE.encode("ascii"))
        return exposition(self._registry)

    @app.handle_errors(NotFound)
    def notFound(self, request: IRequest, failure: Failure) -> bytes:
        return self._error(request, ApiError(ErrorCode.NOT_FOUND))

    @app.handle_errors(MethodNotAllowed)
    def methodNotAllowed(self, request: IRequest, failure: Failure) -> bytes:
        return self._error(request, ApiError(ErrorCode.METHOD_NOT_ALLOWED))


_ROUTES = {b"/health": "/health", b"/ready": "/ready", b"/metrics": "/metrics"}


class _TimedRequest(Request):
    """
    A request that knows when it arrived, for the duration in its log line.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.arrived = time.monotonic()


class OperationsSite(Site):
    """
    The site of an operations port: one structured DEBUG line per request
    (method, route, status, duration) instead of Twisted's combined-log
    text line. Load balancers and Prometheus poll these routes every few
    seconds; at INFO they leave no trace in the log.

    A daemon subclasses it (with nothing but a docstring) so that its lines
    carry its own namespace (C{svcd.auth.web.OperationsSite}).
    """

    requestFactory = _TimedRequest
    _logger = Logger()

    def __init__(self, resource: IResource, reactor: Clock | None = None) -> None:
        super().__init__(  # type: ignore[no-untyped-call, unused-ignore]
            resource, reactor=None if reactor is None else asReactorTime(reactor)
        )
        self.noisy = False

    def log(self, request: Any) -> None:
        arrived = getattr(request, "arrived", None)
        self._logger.debug(
            "{method} {route} {status}",
            method=request.method.decode("latin-1"),
            # A fixed word for other paths: the line never echoes what a
            # client typed.
            route=_ROUTES.get(request.path, "unmatched"),
            status=request.code,
            duration_ms=(
                None if arrived is None else round((time.monotonic() - arrived) * 1000, 3)
            ),
        )
