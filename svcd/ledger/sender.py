"""
The ledger's calls to svc-auth (decisions D12), for any daemon that holds
an L{AuthConnection}: RecordUsage, which carries the outbox's batches of
rows, and GetSpend, which a budget's counter is seeded and reconciled from
(L{svcd.limits.limiter}).

In svc-proxy it rides on the same connection as the validations, so the
proxy keeps one channel and one set of slots: RecordUsage waits at the
first stage (no client waits for a batch of rows, so the validations of
requests under way go first), GetSpend at the later one (a request's
admission may wait for it).
"""

from __future__ import annotations

from collections.abc import Sequence

from twisted.internet.defer import Deferred

from svcd.authclient.connection import AuthConnection, AuthMethod
from svcd.authclient.slots import FIRST_STAGE, LATER_STAGE
from svcd.pb.auth.v1 import auth_pb2

RECORD_USAGE = AuthMethod("RecordUsage", auth_pb2.RecordUsageRequest, auth_pb2.RecordUsageResponse)
GET_SPEND = AuthMethod("GetSpend", auth_pb2.GetSpendRequest, auth_pb2.GetSpendResponse)

# A batch of up to 500 usage rows committed in one transaction (decisions
# D12); a call that misses it is sent again, and svc-auth records each row
# once.
RECORD_USAGE_TIMEOUT = 5.0
# A sum over a budget's period of the ledger: rarer and dearer than a
# validation (once per budget and period, or after Redis lost its counts).
SPEND_TIMEOUT = 2.0


class LedgerSender:
    """
    Sends usage rows to svc-auth and asks it what has been spent: the
    L{svcd.ledger.outbox.UsageSender} of the outbox and the
    L{svcd.limits.reconciliation.Spend} of the limiter (its L{getSpend}).

    Neither call is retried here (the outbox retries a batch with its own
    backoff, the limiter asks again at its next admission) nor counted in
    the validations' metrics; both are traced like every call on the
    connection.

    @param connection: the daemon's connection to svc-auth, started and
        closed by its owner.
    @param usageTimeout: the deadline of a RecordUsage call, in seconds.
    @param spendTimeout: the deadline of a GetSpend call, in seconds.
    """

    def __init__(
        self,
        connection: AuthConnection,
        usageTimeout: float = RECORD_USAGE_TIMEOUT,
        spendTimeout: float = SPEND_TIMEOUT,
    ) -> None:
        self._connection = connection
        self._usageTimeout = usageTimeout
        self._spendTimeout = spendTimeout

    def recordUsage(
        self, rows: Sequence[auth_pb2.UsageRow]
    ) -> Deferred[auth_pb2.RecordUsageResponse]:
        """
        Send a batch of usage rows to svc-auth, which answers once it has
        committed them all (decisions D12), listing the rows it refused
        for good in C{rejected}. Fails with the call's L{grpc.RpcError}
        (DEADLINE_EXCEEDED past the usage timeout) or
        L{svcd.authclient.slots.QueueTimeout}; cancelling the Deferred
        cancels the call.
        """
        return Deferred.fromCoroutine(self._recordUsage(rows))

    async def _recordUsage(self, rows: Sequence[auth_pb2.UsageRow]) -> auth_pb2.RecordUsageResponse:
        request = auth_pb2.RecordUsageRequest(rows=rows)
        return await self._connection.call(RECORD_USAGE, request, self._usageTimeout, FIRST_STAGE)

    def getSpend(self, orgID: str, agentID: str | None, since: int, until: int) -> Deferred[int]:
        """
        What C{orgID} (or its agent C{agentID}) has spent in [since,
        until), Unix seconds, in nano-dollars, from svc-auth's ledger
        (decisions D12).
        """
        return Deferred.fromCoroutine(self._getSpend(orgID, agentID, since, until))

    async def _getSpend(self, orgID: str, agentID: str | None, since: int, until: int) -> int:
        request = auth_pb2.GetSpendRequest(
            org_id=orgID, agent_id=agentID or "", since_unix=since, until_unix=until
        )
        response = await self._connection.call(GET_SPEND, request, self._spendTimeout, LATER_STAGE)
        return int(response.cost_nano_usd)
