"""
The auth probes (spec 4.1): GET /v1/internal/auth-probe and GET
/v1/orgs/{org_id}/auth-probe, which answer what the validated token and
agent say, so that a client can check its credentials without calling a
provider.
"""

from __future__ import annotations

from svcd.common.errors import FieldError, FieldErrorCode, validationError
from svcd.common.ids import parseUUID
from svcd.proxy.http.context import Reply, RequestContext, jsonBody


class ProbeRoutes:
    """
    The org-scoped probe's own step and the probes' handler.
    """

    async def pathOrgID(self, ctx: RequestContext) -> None:
        """
        400 VALIDATION_ERROR (field org_id) for a path org id that is not a
        UUID, before any token check (decisions D4).
        """
        orgID = parseUUID(ctx.params.get("org_id", ""))
        if orgID is None:
            raise validationError(
                [FieldError("org_id", FieldErrorCode.INVALID_FORMAT, "must be a UUID")]
            )
        ctx.pathOrgID = str(orgID)

    async def authProbe(self, ctx: RequestContext) -> Reply:
        """
        200 with what the validated token and agent say.
        """
        assert ctx.token is not None
        return Reply(
            200,
            jsonBody(
                {
                    "org_id": ctx.orgID,
                    "permissions": ctx.token.permissions,
                    "agent_id": ctx.agentID,
                }
            ),
        )
