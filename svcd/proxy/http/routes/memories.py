"""
The memory routes of svc-proxy (decisions D13), on svc-memory: the edge
establishes who calls (token, agent) and whose memories (the subject
header), embeds what must be embedded (L{svcd.providers.embedder}) and
asks svc-memory (L{svcd.memory.client}).

Being built: this module's first part answers C{POST /v1/memories} 501
MEMORY_NOT_CONFIGURED until the routes are.
"""

from __future__ import annotations

from svcd.common.clocks import Clock
from svcd.common.errors import ApiError, ErrorCode
from svcd.limits.admission import Admission
from svcd.memory.client import MemoryClient
from svcd.providers.embedder import Embedder
from svcd.providers.table import MemoryConfig
from svcd.proxy.http.context import Reply, RequestContext
from svcd.proxy.http.memorybody import parseAddBody
from svcd.proxy.http.steps import bodyBytes, memorySubject


class MemoryRoutes:
    """
    The memory routes' own step (their rate limit, which reserves what
    they embed) and their handlers.

    @param config: the providers file's C{[memory]} table, None when
        memory is off (then every route answers 501 MEMORY_NOT_CONFIGURED).
    @param client: svc-memory's client, None when memory is off.
    @param embedder: embeds contents and queries, None without a
        providers file.
    """

    def __init__(
        self,
        config: MemoryConfig | None,
        client: MemoryClient | None,
        embedder: Embedder | None,
        admission: Admission,
        clock: Clock,
    ) -> None:
        self._config = config
        self._client = client
        self._embedder = embedder
        self._admission = admission
        self._clock = clock

    async def rateLimit(self, ctx: RequestContext) -> None:
        """
        The per-minute limit of the organization and its agent.
        """
        assert ctx.orgID is not None
        reservation = await self._admission.admit(ctx.orgID, ctx.agentID, ctx.responseHeaders)
        if reservation is not None:
            ctx.reservation = reservation

    async def add(self, ctx: RequestContext) -> Reply:
        """
        C{POST /v1/memories}: the subject and the body are checked (400),
        then 501 until the routes are built.
        """
        memorySubject(ctx.request)
        parseAddBody(bodyBytes(ctx.request))
        raise ApiError(ErrorCode.MEMORY_NOT_CONFIGURED)
