"""
The steps every route family of the edge shares (spec 4.1): the body's
size and type, who calls (the bearer token and the agent, validated by
svc-auth) and the per-minute limit of the organization and its agent.
L{svcd.proxy.http.edge.ProxyEdge._routeTable} puts them in each route's
order; a route family's own steps live in its module
(L{svcd.proxy.http.routes}).
"""

from __future__ import annotations

import re
from io import BytesIO
from typing import IO

from twisted.web.server import Request

from svcd.common.errors import ApiError, ErrorCode, FieldError, FieldErrorCode, validationError
from svcd.common.ids import canonicalUUID
from svcd.common.pat import isToken
from svcd.common.permissions import Permission
from svcd.limits.admission import Admission
from svcd.limits.book import MEMORY_OFF, LimitBook
from svcd.proxy.http.context import RequestContext, Step
from svcd.proxy.validation.client import AGENT_HEADER, AuthClient, agentHeaderInvalid

_AGENT_HEADER = AGENT_HEADER.encode("ascii")

# Decisions D13: a request's own say over memory; "off" is its one value.
MEMORY_HEADER = "X-SVC-Memory"
_MEMORY_HEADER = MEMORY_HEADER.encode("ascii")

# Decisions D13: whose memories within the agent (an end user the agent
# serves); absent, the agent's own ("").
MEMORY_SUBJECT_HEADER = "X-SVC-Memory-Subject"
_MEMORY_SUBJECT_HEADER = MEMORY_SUBJECT_HEADER.encode("ascii")
_SUBJECT = re.compile(rb"[A-Za-z0-9._:@-]{1,128}")


class CallerSteps:
    """
    The shared steps, bound to what they read.

    @param auth: svc-auth's client, which validates tokens and agents.
    @param admission: the limits' admission (the per-minute limit).
    @param maxBody: C{SVC_MAX_REQUEST_BODY_BYTES}.
    """

    def __init__(self, auth: AuthClient, admission: Admission, maxBody: int) -> None:
        self._auth = auth
        self._admission = admission
        self._maxBody = maxBody

    async def bodySizeLimit(self, ctx: RequestContext) -> None:
        """
        413 PAYLOAD_TOO_LARGE past SVC_MAX_REQUEST_BODY_BYTES.

        L{svcd.proxy.http.site.BodyLimitedRequest} has already refused to
        buffer such a body and marked the request; the other checks cover
        a plain L{Request} (as in tests).
        """
        request = ctx.request
        if getattr(request, "bodyTooLarge", False):
            raise self._tooLarge()
        declared = request.getHeader(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self._maxBody:
            raise self._tooLarge()
        content = requestBody(request)
        size = content.seek(0, 2)
        content.seek(0)
        if size > self._maxBody:
            raise self._tooLarge()

    def _tooLarge(self) -> ApiError:
        return ApiError(ErrorCode.PAYLOAD_TOO_LARGE, detail=f"The limit is {self._maxBody} bytes.")

    async def contentType(self, ctx: RequestContext) -> None:
        """
        415 UNSUPPORTED_MEDIA_TYPE unless the body is application/json (a
        charset or other parameter is allowed).
        """
        value = ctx.request.getHeader(b"content-type")
        if value is None or value.split(b";", 1)[0].strip().lower() != b"application/json":
            raise ApiError(ErrorCode.UNSUPPORTED_MEDIA_TYPE)

    def tokenAuth(self, permission: Permission | None = None, matchPathOrg: bool = False) -> Step:
        """
        The token auth step: the bearer token, validated by svc-auth, with
        the route's permission bit and, for the org-scoped probe, the path
        org equal to the token's org (403 INSUFFICIENT_PERMISSIONS).
        """

        async def tokenAuth(ctx: RequestContext) -> None:
            accessToken = bearerToken(ctx.request)
            token = await self._auth.validateToken(accessToken)
            if permission is not None and not token.permissions & permission:
                raise ApiError(ErrorCode.INSUFFICIENT_PERMISSIONS)
            if matchPathOrg and ctx.pathOrgID != token.orgID:
                raise ApiError(ErrorCode.INSUFFICIENT_PERMISSIONS)
            ctx.accessToken = accessToken
            ctx.token = token
            ctx.orgID = token.orgID

        return tokenAuth

    async def agentVerify(self, ctx: RequestContext) -> None:
        """
        The X-SVC-Agent-ID header (400 when missing or not a UUID), the
        token's own agent if it has one (403 AGENT_NOT_AUTHORIZED), then
        ValidateAgent with the caller's bearer.
        """
        values = ctx.request.requestHeaders.getRawHeaders(_AGENT_HEADER)
        if not values or not values[0]:
            raise ApiError(ErrorCode.MISSING_AGENT_ID)
        agentID = canonicalUUID(values[0].decode("latin-1")) if len(values) == 1 else None
        if agentID is None:
            raise agentHeaderInvalid()
        token = ctx.token
        assert token is not None and ctx.accessToken is not None
        if token.agentID is not None and token.agentID != agentID:
            raise ApiError(ErrorCode.AGENT_NOT_AUTHORIZED)
        ctx.agent = await self._auth.validateAgent(ctx.accessToken, agentID, token.orgID)
        ctx.agentID = agentID

    async def rateLimit(self, ctx: RequestContext) -> None:
        """
        The step of the organization's per-minute limit (and its agent's,
        with limits rows): X-RateLimit-* on the answer whatever it is, 429
        RATE_LIMITED with Retry-After past the limit. A route that reserves
        tokens and cost has a step of its own (the chat route's,
        L{svcd.proxy.http.routes.chat.ChatRoutes.rateLimit}).
        """
        assert ctx.orgID is not None
        reservation = await self._admission.admit(ctx.orgID, ctx.agentID, ctx.responseHeaders)
        if reservation is not None:
            ctx.reservation = reservation


def memorySubject(request: Request) -> str:
    """
    The memory subject of a request (decisions D13): the header
    C{X-SVC-Memory-Subject}, 1 to 128 characters of C{A-Za-z0-9._:@-}, or
    "" without it. The memory routes and a chat completion's recall read
    it alike.

    @raise ApiError: 400 VALIDATION_ERROR naming the header for any other
        value (empty, too long, another character, the header twice).
    """
    values = request.requestHeaders.getRawHeaders(_MEMORY_SUBJECT_HEADER)
    if values is None:
        return ""
    if len(values) != 1 or _SUBJECT.fullmatch(values[0]) is None:
        raise validationError(
            [
                FieldError(
                    MEMORY_SUBJECT_HEADER,
                    FieldErrorCode.INVALID_FORMAT,
                    "must be 1 to 128 characters of A-Z, a-z, 0-9 and . _ : @ -",
                )
            ]
        )
    return values[0].decode("ascii")


def requestBody(request: Request) -> IO[bytes]:
    """
    The request's body as Twisted Web holds it.
    """
    content: IO[bytes] | None = request.content
    if content is None:
        # Set by the channel before the request is processed; an empty body
        # is the only sensible reading of its absence.
        return BytesIO()
    return content


def bodyBytes(request: Request) -> bytes:
    """
    The request's whole body.
    """
    content = requestBody(request)
    content.seek(0)
    return content.read()


def bearerToken(request: Request) -> str:
    """
    The token of an C{Authorization: Bearer <token>} header.

    @raise ApiError: 401 MISSING_TOKEN without the header, 401
        INVALID_TOKEN when it is not a bearer of our PAT format (checked
        here, so a malformed token costs no call to svc-auth).
    """
    values = request.requestHeaders.getRawHeaders(b"authorization")
    if values is None:
        raise ApiError(ErrorCode.MISSING_TOKEN)
    if len(values) != 1:
        raise ApiError(ErrorCode.INVALID_TOKEN)
    scheme, _, credential = values[0].partition(b" ")
    credential = credential.strip()
    if scheme.lower() != b"bearer" or not credential:
        raise ApiError(ErrorCode.INVALID_TOKEN)
    token = credential.decode("latin-1")
    if not isToken(token):
        raise ApiError(ErrorCode.INVALID_TOKEN)
    return token


def memoryOff(request: Request) -> bool:
    """
    Whether the request turned memory off for itself with C{X-SVC-Memory:
    off} (decisions D13). C{off} (in any case, with surrounding spaces)
    is the header's one value: a request cannot turn on what its
    organization and agent have off.

    @raise ApiError: 400 VALIDATION_ERROR naming the header for any other
        value, an empty one, or the header given twice.
    """
    values = request.requestHeaders.getRawHeaders(_MEMORY_HEADER)
    if values is None:
        return False
    if len(values) == 1 and values[0].strip().lower() == b"off":
        return True
    raise validationError(
        [FieldError(MEMORY_HEADER, FieldErrorCode.INVALID_ENUM, "must be off when given")]
    )


def requestMemory(
    request: Request, book: LimitBook, orgID: str, agentID: str | None
) -> tuple[bool, str]:
    """
    Whether memory is recalled for this request and how it is observed,
    as C{(recall, observe mode)}: both off when the request says
    C{X-SVC-Memory: off}, else its agent's and organization's settings
    (L{LimitBook.memoryFor}).

    @raise ApiError: 400 VALIDATION_ERROR for a bad C{X-SVC-Memory}
        (L{memoryOff}), checked first, so that a request with a bad header
        is refused whatever the settings.
    """
    if memoryOff(request):
        return MEMORY_OFF
    return book.memoryFor(orgID, agentID)
