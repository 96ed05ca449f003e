"""
GET /v1/models (decisions D9): the models the caller's organization may
use, in OpenAI's list shape. Routed only with a providers file.
"""

from __future__ import annotations

from svcd.providers.table import ProviderTable, modelsDocument
from svcd.proxy.http.context import Reply, RequestContext, jsonBody


class ModelRoutes:
    """
    The handler of GET /v1/models, over the providers file.
    """

    def __init__(self, providers: ProviderTable) -> None:
        self._providers = providers

    async def modelsList(self, ctx: RequestContext) -> Reply:
        """
        The caller's organization's models.
        """
        assert ctx.orgID is not None
        return Reply(200, jsonBody(modelsDocument(self._providers, ctx.orgID)))
