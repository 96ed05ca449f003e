"""
svc-auth's HTTP operational routes: /health, /ready, /metrics (spec 4.2),
and the site serving them.
"""

from __future__ import annotations

import datetime
import json
import time
from collections.abc import Sequence
from typing import Any

from klein import Klein
from prometheus_client import CollectorRegistry
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.iweb import IRequest
from twisted.web.resource import IResource
from twisted.web.server import Request, Site
from werkzeug.exceptions import MethodNotAllowed, NotFound

from svcd.common.errors import ApiError, ErrorCode, envelope
from svcd.common.ids import uuid7
from svcd.common.metrics import CONTENT_TYPE, exposition
from svcd.common.readiness import Check, readinessReport


def _json(request: IRequest, status: int, body: dict[str, Any]) -> bytes:
    request.setResponseCode(status)
    request.setHeader(b"Content-Type", b"application/json")
    return json.dumps(body, separators=(",", ":")).encode("utf-8")


class AuthOperationsWeb:
    """
    The Klein app of svc-auth's HTTP port.

    Errors (an unknown path, a wrong method) use the same envelope as the
    proxy, so one client-side parser reads both.
    """

    app = Klein()

    def __init__(
        self,
        clock: IReactorTime,
        checks: Sequence[Check],
        registry: CollectorRegistry,
        docsBase: str | None = None,
    ) -> None:
        self._clock = clock
        self._checks = tuple(checks)
        self._registry = registry
        self._docsBase = docsBase

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
        return _json(request, 200, {"status": "ok", "checks": {}})

    @app.route("/ready", methods=["GET"])
    async def ready(self, request: IRequest) -> bytes:
        status, body = await readinessReport(self._checks, self._clock)
        return _json(request, status, body)

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
    The site of svc-auth's HTTP port: one structured DEBUG line per request
    (method, route, status, duration) instead of Twisted's combined-log
    text line. Load balancers and Prometheus poll these routes every few
    seconds; at INFO they leave no trace in the log.
    """

    requestFactory = _TimedRequest
    _logger = Logger()

    def __init__(self, resource: IResource, reactor: IReactorTime | None = None) -> None:
        super().__init__(resource, reactor=reactor)  # type: ignore[no-untyped-call, unused-ignore]
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
