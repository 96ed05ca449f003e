"""
The gateway's embeddings for recalls, coalesced by organization
(L{EmbeddingBatches}, decisions D13, "Context assembly"): each text
forwarded, settled and recorded by the L{Embedder}, alone or sharing one
forward with its organization's other texts of the moment
(L{Embedder.embedEach}), each with its own row.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
from twisted.internet.defer import Deferred, DeferredList
from twisted.python.failure import Failure

from svcd.common.coalesce import Coalescer
from svcd.common.deferreds import fireUnlessCalled
from svcd.common.ids import uuid7Text
from svcd.metered.embedder import (
    Embedded,
    Embedder,
    EmbeddingCall,
    RejectedTogether,
    RowsDue,
    SharedText,
)
from svcd.metering.models import Model
from svcd.providers.records import UpstreamRecord
from svcd.providers.table import ProviderTable


@attrs.define(eq=False)
class _Queued:
    """
    A text of L{EmbeddingBatches}: its model and budget (its key, with its
    organization), its caller's Deferred, when it was asked for (its row's
    start when given up unsent), and once sent, its forward and the texts
    that share it.
    """

    model: Model
    budgeted: bool
    shared: SharedText
    rowsDue: RowsDue | None = None
    result: Deferred[Embedded] = attrs.field(init=False)
    startedAt: float = 0.0
    forward: Deferred[Any] | None = None
    batch: Sequence[_Queued] = ()


class EmbeddingBatches:
    """
    Recalls' embeddings coalesced by organization (L{svcd.common.coalesce};
    decisions D13, "Context assembly"): a text whose organization has fewer
    than C{maxInFlight} embeddings in flight with its model is forwarded at
    once, alone, as L{Embedder.embed} forwards it; those that come while it
    has that many are forwarded together when one ends, one organization's
    texts in one request (L{Embedder.embedEach}), each with its own row. A
    busy proxy's recalls share an exchange with the provider, whose cost in
    the proxy (a connection's request, its answer parsed) is a forward's.

    Cancelling an embedding's Deferred (the recall's deadline, the client
    gone) records its row at once (C{client_gone}) and fails it with
    L{twisted.internet.defer.CancelledError}; its forward goes on for the
    texts that share it, and is cancelled when none is left.

    @param embedder: forwards and records.
    @param maxInFlight: an organization's forwards in flight (by model)
        before its texts wait to share one (C{SVC_MEMORY_RECALL_CALLS}).
    @param maxBatch: the most texts of one forward.
    """

    def __init__(self, embedder: Embedder, maxInFlight: int = 1, maxBatch: int = 32) -> None:
        self._embedder = embedder
        self._coalescer: Coalescer[tuple[str, str, bool], _Queued] = Coalescer(
            self._send, maxBatch, maxInFlight
        )

    @property
    def providers(self) -> ProviderTable:
        """
        The embedder's providers file (what a recall prices its charge by).
        """
        return self._embedder.providers

    def embed(
        self,
        model: Model,
        texts: Sequence[str],
        call: EmbeddingCall,
        *,
        budgeted: bool = False,
        record: UpstreamRecord | None = None,
        rowsDue: RowsDue | None = None,
    ) -> Deferred[Embedded]:
        """
        As L{Embedder.embed}, for one text and no reservation. C{rowsDue}
        holds the row of a text forwarded alone; a shared forward's rows
        are recorded at once (L{Embedder.embedEach}).
        """
        if len(texts) != 1:
            raise ValueError("a batch's caller embeds one text")
        if not call.ledgerID:
            call = attrs.evolve(call, ledgerID=uuid7Text())
        queued = _Queued(
            model, budgeted, SharedText(texts[0], call, record or UpstreamRecord()), rowsDue
        )
        queued.result = Deferred(lambda _: self._cancelled(queued))
        queued.startedAt = self._embedder.now()
        self._coalescer.submit(_key(queued), queued)
        return queued.result

    def _cancelled(self, queued: _Queued) -> None:
        # Deferred.cancel fails it with CancelledError after this.
        if queued.forward is None:
            self._coalescer.withdraw(_key(queued), queued)
            self._embedder.giveUp(queued.model, queued.shared, queued.startedAt)
        elif len(queued.batch) == 1:
            # Alone: Embedder.embed's cancellation records its row.
            queued.forward.cancel()
        else:
            self._embedder.giveUp(queued.model, queued.shared, queued.startedAt)
            if all(each.shared.recorded for each in queued.batch):
                queued.forward.cancel()

    def _send(self, key: tuple[str, str, bool], batch: list[_Queued]) -> Deferred[Any]:
        return self._forward(batch).addBoth(_forget, batch)

    def _forward(self, batch: list[_Queued]) -> Deferred[Any]:
        first = batch[0]
        if len(batch) == 1:
            forward = self._embedder.embed(
                first.model,
                (first.shared.text,),
                first.shared.call,
                budgeted=first.budgeted,
                record=first.shared.record,
                rowsDue=first.rowsDue,
            )
            first.forward, first.batch = forward, batch
            return forward.addBoth(fireUnlessCalled, first.result)
        shared = Deferred.fromCoroutine(
            self._embedder.embedEach(first.model, [each.shared for each in batch], first.budgeted)
        )
        for queued in batch:
            queued.forward, queued.batch = shared, batch

        def answered(embedded: list[Embedded]) -> None:
            for queued, each in zip(batch, embedded, strict=True):
                fireUnlessCalled(each, queued.result)

        def failed(failure: Failure) -> Deferred[Any] | None:
            if failure.check(RejectedTogether):
                # Each again alone: one text's refusal is its own. The
                # organization's next forward waits for these.
                return DeferredList(
                    [
                        self._forward([queued]).addBoth(_forget, [queued])
                        for queued in batch
                        if not queued.result.called
                    ]
                )
            for queued in batch:
                fireUnlessCalled(failure, queued.result)
            return None

        return shared.addCallbacks(answered, failed)


def _forget(result: object, batch: Sequence[_Queued]) -> object:
    """
    Cut the references between a forward's texts and the forward once it
    has ended (each refers to its batch, which holds it): no cycle left
    for the collector per recall.
    """
    for queued in batch:
        queued.forward, queued.batch = None, ()
    return result


def _key(queued: _Queued) -> tuple[str, str, bool]:
    """
    What texts must share to share a forward: the model, the organization,
    and whether a budget applies (which decides whether an unpriced model
    is tried).
    """
    return (queued.model.name, queued.shared.call.orgID, queued.budgeted)
