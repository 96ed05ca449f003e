"""
Where the proxy sends the usage row of each forwarded request (decisions
D12), and how the row is made.

The proxy holds no database: the ledger's writer is svc-auth (RecordUsage),
which commits rows before acknowledging them. Here is what the edge needs
of the proxy's side of that journey (L{UsageLedger}): whether there is
room to record one more request (when there is none, the request is
refused 503 before it is forwarded: never an answer without its record),
and a place to put the row once the answer has ended.
"""

from __future__ import annotations

from typing import Protocol

from svcd.metering.charges import Charge
from svcd.pb.auth.v1 import auth_pb2

# What a row's call was (decisions D13): the column C{kind}.
CHAT = "chat"
EMBEDDING = "embedding"
EXTRACTION = "extraction"
KINDS = (CHAT, EMBEDDING, EXTRACTION)


class UsageLedger(Protocol):
    """
    The proxy's side of the ledger.
    """

    def hasRoom(self) -> bool:
        """
        Whether one more row can be held until svc-auth has committed it.
        """

    def record(self, row: auth_pb2.UsageRow) -> None:
        """
        Keep C{row} until svc-auth has committed it (journalled first, when
        a journal is configured).
        """


def usageRow(
    *,
    ledgerID: str,
    requestID: str,
    orgID: str,
    agentID: str | None,
    tokenID: str | None,
    modelRequested: str,
    model: str | None,
    provider: str | None,
    upstreamModel: str | None,
    stream: bool,
    outcome: str,
    charge: Charge,
    startedAt: float,
    endedAt: float,
    kind: str = CHAT,
    parentRequestID: str | None = None,
    memories: int | None = None,
) -> auth_pb2.UsageRow:
    """
    The ledger row of one forwarded request, keyed by C{ledgerID} (the
    gateway's own id of the request, decisions D12, amended), with the
    client-visible C{requestID} kept beside it. Its tokens, their cost and
    the price's version are the call's C{charge}
    (L{svcd.metering.charges.chargeOf}: the provider's usage, none after a
    fault before the first byte, else the reservation's estimate).

    C{kind} says what the call was (one of L{KINDS}, decisions D13), and
    C{parentRequestID} the request it was made for, when another request
    caused it (a recall's embedding, a worker's extraction).
    C{memories} is how many memories a recall put in a chat's prompt (0
    when it found none or failed), None when recall was off for it.
    """
    row = auth_pb2.UsageRow(
        ledger_id=ledgerID,
        request_id=requestID,
        org_id=orgID,
        agent_id=agentID or "",
        token_id=tokenID or "",
        model_requested=modelRequested,
        model=model or "",
        provider=provider or "",
        upstream_model=upstreamModel or "",
        stream=stream,
        outcome=outcome,
        prompt_tokens=charge.promptTokens,
        cached_tokens=charge.cachedTokens,
        completion_tokens=charge.completionTokens,
        reasoning_tokens=charge.reasoningTokens,
        cache_write_tokens=charge.cacheWriteTokens,
        tokens_from=charge.tokensFrom,
        cost_nano_usd=charge.cost,
        price_version=charge.priceVersion,
        started_at_us=round(startedAt * 1_000_000),
        duration_us=max(0, round((endedAt - startedAt) * 1_000_000)),
        kind=kind,
        parent_request_id=parentRequestID or "",
    )
    if memories is not None:
        row.memories = memories
    return row
