"""
The steps every route family of the edge shares (spec 4.1): the body's
size and type, who calls (the bearer token and the agent, validated by
svc-auth) and the per-minute limit of the organization and its agent,
which reserves what a route says (L{Reserve}).
L{svcd.proxy.http.edge.ProxyEdge._opening} puts them in their order for
every route of a caller; a route family's own steps and what it reserves
live in its module (L{svcd.proxy.http.routes}).
"""

from __future__ import annotations

from collections.abc import Callable
from io import BytesIO
from typing import IO

from twisted.web.server import Request

from svcd.common.errors import ApiError, ErrorCode
from svcd.common.ids import canonicalUUID, uuid7Text
from svcd.common.pat import isToken
from svcd.common.permissions import Permission
from svcd.limits.admission import Admission
from svcd.limits.book import Applicable
from svcd.proxy.http.context import RequestContext, Step
from svcd.proxy.validation.client import AGENT_HEADER, AuthClient, agentHeaderInvalid

_AGENT_HEADER = AGENT_HEADER.encode("ascii")

# What a route reserves at its rate limit step: the tokens and the cost
# (nano-dollars) of C{ctx} for organization C{orgID}.
Reserve = Callable[[RequestContext, str], tuple[int, int]]
_NOTHING = (0, 0)

# Where a route finds the caller's token in a request (L{bearerToken}, or
# L{apiKeyOrBearer} on the routes of Anthropic's dialect).
Credential = Callable[[Request], str]


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

    def tokenAuth(
        self,
        permission: Permission | None = None,
        matchPathOrg: bool = False,
        credential: Credential | None = None,
    ) -> Step:
        """
        The token auth step: the bearer token (or where C{credential}
        finds it), validated by svc-auth, with the route's permission bit
        and, for the org-scoped probe, the path org equal to the token's
        org (403 INSUFFICIENT_PERMISSIONS).
        """
        found = credential if credential is not None else bearerToken

        async def tokenAuth(ctx: RequestContext) -> None:
            accessToken = found(ctx.request)
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

    def rateLimit(self, reserve: Reserve | None = None) -> Step:
        """
        The step of the organization's per-minute limit (and its agent's,
        with limits rows): X-RateLimit-* on the answer whatever it is, 429
        RATE_LIMITED with Retry-After past the limit. A route that reserves
        tokens and cost says what with C{reserve} (the chat route's,
        L{svcd.proxy.http.routes.chat.ChatRoutes.reserve}), which also
        makes the request's ledger key when it has one (C{ctx.ledgerID}):
        the limit and the reservation are one call (decisions D11, D12).
        """
        admission = self._admission

        async def rateLimit(ctx: RequestContext) -> None:
            orgID = ctx.orgID
            assert orgID is not None
            tokens, cost = reserve(ctx, orgID) if reserve is not None else _NOTHING
            reservation = await admission.admit(
                orgID, ctx.agentID, ctx.responseHeaders, tokens, cost, ctx.ledgerID or None
            )
            if reservation is not None:
                ctx.reservation = reservation

        return rateLimit


def forwardedLimits(ctx: RequestContext, admission: Admission, orgID: str) -> Applicable:
    """
    The limits that apply to a request that will be forwarded, and its
    ledger key, made here, where it is admitted for forwarding (decisions
    D12, amended); whether a budget applies to it is noted on C{ctx}.
    """
    ctx.ledgerID = uuid7Text()
    applicable = admission.applicable(orgID, ctx.agentID)
    ctx.budgeted = applicable.budgeted
    return applicable


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


_API_KEY_HEADER = b"x-api-key"


def apiKeyOrBearer(request: Request) -> str:
    """
    The token of a route of Anthropic's dialect (decisions D14): in
    C{x-api-key}, which Anthropic's SDKs send, or in C{Authorization:
    Bearer}, as on every other route (their C{auth_token}); both may be
    sent, holding the same token.

    @raise ApiError: as L{bearerToken} without C{x-api-key}; 401
        INVALID_TOKEN when C{x-api-key} is not one token of our PAT
        format, or when both headers are sent and do not hold the same
        token.
    """
    keys = request.requestHeaders.getRawHeaders(_API_KEY_HEADER)
    if keys is None:
        return bearerToken(request)
    if len(keys) != 1:
        raise ApiError(ErrorCode.INVALID_TOKEN)
    token = keys[0].strip().decode("latin-1")
    if not isToken(token):
        raise ApiError(ErrorCode.INVALID_TOKEN)
    if request.requestHeaders.hasHeader(b"authorization") and bearerToken(request) != token:
        raise ApiError(
            ErrorCode.INVALID_TOKEN,
            "The x-api-key header and the Authorization bearer token differ.",
        )
    return token
