"""
MemoryService's methods of the observation queue (memory.proto):
svc-proxy's conversations queued, and svc-worker's claims, completions,
hand-backs, renewals and stored memories. They are a part of
L{svcd.memory.grpcservice.MemoryServicer}, which sets what they use.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence

from twisted.logger import Logger

from svcd.common.errors import rfc3339
from svcd.memory.extracted import RECENT_WINDOW, OtherScope, Plan, Stored
from svcd.memory.grpcrequests import (
    bounded,
    embeddingOf,
    leaseTokenOf,
    observationOf,
    ownerOf,
    scopeOf,
)
from svcd.memory.records import (
    MAX_REASON_CHARACTERS,
    OTHER_LENGTH,
    NewObservation,
    checkContent,
    checkEndedAt,
    checkObservedMessages,
    checkRequestID,
)
from svcd.memory.search import Searcher
from svcd.memory.store import MemoryStore
from svcd.memory.store.base import StoreUnavailable
from svcd.memory.store.cacheloads import CachedRow
from svcd.memory.store.leases import ObservationRelease
from svcd.memoryclient.records import Embedding, InvalidMemory, Scope
from svcd.pb.memory.v1 import memory_pb2

MAX_OBSERVATIONS_PER_CALL = 500
MAX_CLAIM = 100
MAX_LEASE_SECONDS = 3600.0
MAX_RETRY_AFTER_SECONDS = 86_400.0
# svc-worker stores at most this many memories of one observation
# (decisions D13: an extraction answers at most 20).
MAX_STORED_PER_OBSERVATION = 20


class ObservationMethods:
    """
    The methods of the observation queue: each answers its request or
    raises, and L{svcd.memory.grpcrequests.statusOf} says what status a
    failure is answered with.
    """

    log = Logger()
    # Set by MemoryServicer.
    _store: MemoryStore
    _searcher: Searcher
    _maxPerScope: int
    _maxWaitingPerOrg: int | None

    def QueueObservations(
        self, request: memory_pb2.QueueObservationsRequest
    ) -> memory_pb2.QueueObservationsResponse:
        if not 1 <= len(request.observations) <= MAX_OBSERVATIONS_PER_CALL:
            raise InvalidMemory(
                "observations", f"must hold 1 to {MAX_OBSERVATIONS_PER_CALL} observations"
            )
        batch = []
        for index, observation in enumerate(request.observations):
            try:
                requestID = checkRequestID("request_id", observation.request_id, True)
                assert requestID is not None
                # A proxy of an earlier release sends no key: its request
                # id is the key, as it was then.
                key = checkRequestID("key", observation.key, False) or requestID
                batch.append(
                    NewObservation(
                        scopeOf(observation.scope),
                        requestID,
                        checkObservedMessages(
                            [(each.role, each.content) for each in observation.messages]
                        ),
                        key,
                        checkEndedAt(observation.ended_at),
                    )
                )
            except InvalidMemory as invalid:
                raise InvalidMemory(
                    f"observations[{index}].{invalid.field}", invalid.problem
                ) from None
        queued = self._store.queueObservations(batch, self._maxWaitingPerOrg)
        return memory_pb2.QueueObservationsResponse(
            queued=[
                memory_pb2.QueuedObservation(
                    request_id=each.requestID,
                    org_id=str(asked.scope.orgID),
                    id=str(each.observationID) if each.observationID is not None else "",
                    queued_now=each.queuedNow,
                    key=each.key,
                    refused=each.refused,
                )
                for asked, each in zip(batch, queued, strict=True)
            ]
        )

    def ClaimObservations(
        self, request: memory_pb2.ClaimObservationsRequest
    ) -> memory_pb2.ClaimObservationsResponse:
        owner = ownerOf(request.owner)
        limit = int(bounded("limit", request.limit, 1, MAX_CLAIM))
        lease = bounded("lease_seconds", request.lease_seconds, 1.0, MAX_LEASE_SECONDS)
        claimed = self._store.claimObservations(owner, lease, limit)
        return memory_pb2.ClaimObservationsResponse(
            observations=[
                memory_pb2.ClaimedObservation(
                    id=str(each.observationID),
                    scope=memory_pb2.Scope(
                        org_id=str(each.scope.orgID),
                        agent_id=str(each.scope.agentID),
                        subject=each.scope.subject,
                    ),
                    request_id=each.requestID,
                    messages=[
                        memory_pb2.ObservedMessage(role=message.role, content=message.content)
                        for message in each.messages
                    ],
                    attempts=each.attempts,
                    lease_expires_at=rfc3339(each.leaseExpiresAt),
                    lease_token=str(each.leaseToken) if each.leaseToken else "",
                )
                for each in claimed
            ]
        )

    def CompleteObservation(
        self, request: memory_pb2.CompleteObservationRequest
    ) -> memory_pb2.CompleteObservationResponse:
        orgID, observationID = observationOf(request.org_id, request.id)
        completed = self._store.completeObservation(
            orgID, observationID, ownerOf(request.owner), leaseTokenOf(request.lease_token, False)
        )
        return memory_pb2.CompleteObservationResponse(completed=completed)

    def ReleaseObservation(
        self, request: memory_pb2.ReleaseObservationRequest
    ) -> memory_pb2.ReleaseObservationResponse:
        orgID, observationID = observationOf(request.org_id, request.id)
        if len(request.reason) > MAX_REASON_CHARACTERS:
            raise InvalidMemory("reason", f"must be at most {MAX_REASON_CHARACTERS} characters")
        release = ObservationRelease(
            retryAfter=bounded(
                "retry_after_seconds", request.retry_after_seconds, 0.0, MAX_RETRY_AFTER_SECONDS
            ),
            countAttempt=request.count_attempt,
            failed=request.failed,
            reason=request.reason,
        )
        released = self._store.releaseObservation(
            orgID,
            observationID,
            ownerOf(request.owner),
            release,
            leaseTokenOf(request.lease_token, False),
        )
        return memory_pb2.ReleaseObservationResponse(released=released)

    def RenewObservationLease(
        self, request: memory_pb2.RenewObservationLeaseRequest
    ) -> memory_pb2.RenewObservationLeaseResponse:
        orgID, observationID = observationOf(request.org_id, request.id)
        owner = ownerOf(request.owner)
        token = leaseTokenOf(request.lease_token, True)
        assert token is not None
        lease = bounded("lease_seconds", request.lease_seconds, 1.0, MAX_LEASE_SECONDS)
        expiresAt = self._store.renewObservationLease(orgID, observationID, owner, token, lease)
        if expiresAt is None:
            return memory_pb2.RenewObservationLeaseResponse(renewed=False)
        return memory_pb2.RenewObservationLeaseResponse(
            renewed=True, lease_expires_at=rfc3339(expiresAt)
        )

    def StoreObservation(
        self, request: memory_pb2.StoreObservationRequest
    ) -> memory_pb2.StoreObservationResponse:
        """
        svc-worker's last step for one observation (memory.proto): one call
        where it made one or two per memory and one more, each a gRPC round
        trip on both sides (bench/worker_drain.py measured the drain's
        rate bounded by them).

        The memories are written into the observation's own scope, whatever
        the call names (decisions D13, amended): a call naming another
        agent or subject is planned again for the observation's, and
        logged (ids only). The cache's nearest memories are asked first;
        the plan is finished, and its updates, additions and the
        observation's completion made, in one transaction under the scope's
        lock (L{MemoryStore.storeExtracted}, L{svcd.memory.extracted}): the
        same fact in two observations stored at once is one memory, and a
        memory deleted meanwhile is not written back. The cache is settled
        once, after.

        C{lease_seconds} is checked but no longer renews the lease: the
        transaction holds the observation's row, and nothing is written
        for a claim that lost it.
        """
        orgID, observationID = observationOf(request.org_id, request.id)
        owner = ownerOf(request.owner)
        token = leaseTokenOf(request.lease_token, True)
        assert token is not None
        bounded("lease_seconds", request.lease_seconds, 1.0, MAX_LEASE_SECONDS)
        scope = scopeOf(request.scope)
        if scope.orgID != orgID:
            raise InvalidMemory("scope.org_id", "must be org_id")
        requestID = checkRequestID("request_id", request.request_id, True)
        assert requestID is not None
        if len(request.memories) > MAX_STORED_PER_OBSERVATION:
            raise InvalidMemory(
                "memories", f"must hold at most {MAX_STORED_PER_OBSERVATION} memories"
            )
        dedupeScore = bounded("dedupe_score", request.dedupe_score, -1.0, 1.0)
        memories = []
        for index, each in enumerate(request.memories):
            try:
                memories.append((checkContent(each.content), embeddingOf(each, "embedding")))
            except InvalidMemory as invalid:
                raise InvalidMemory(f"memories[{index}].{invalid.field}", invalid.problem) from None
            if memories[index][1].dimensions != memories[0][1].dimensions:
                # One provider's answer: one length (its planning compares them).
                raise InvalidMemory(f"memories[{index}].embedding", OTHER_LENGTH)
        # The sync marker goes in the storing transaction (one transaction
        # fewer than a marker sent after it).
        pending = self._searcher.expectWrite()
        stored: Stored | None = None
        # The rows added, told to the cache before the commit, so that its
        # listener need not read them back (forgotten if it fails).
        written: list[CachedRow] = []

        def tell(rows: Sequence[CachedRow]) -> None:
            written.extend(rows)
            self._searcher.expectWritten(rows)

        try:
            # The observation's scope never changes: a second round always
            # finds it.
            for _ in range(2):
                plan = self._plan(scope, memories, dedupeScore)
                try:
                    stored = self._store.storeExtracted(
                        orgID,
                        observationID,
                        owner,
                        token,
                        scope,
                        requestID,
                        plan,
                        self._maxPerScope,
                        None if pending is None else pending.nonce,
                        tell,
                    )
                    break
                except OtherScope as other:
                    self.log.warn(
                        "StoreObservation for observation {observation_id} of organization"
                        " {org_id} named another agent or subject than the observation's;"
                        " its memories go to the observation's agent {agent_id}",
                        observation_id=str(observationID),
                        org_id=str(orgID),
                        agent_id=str(other.scope.agentID),
                    )
                    scope = other.scope
            else:
                raise StoreUnavailable("the observation's scope changed twice")
        except BaseException:
            self._searcher.forgetWritten([row.memoryID for row in written])
            raise
        finally:
            self._searcher.settleWrite(
                scope, pending, stored is not None and bool(stored.added or stored.updated)
            )
        if stored is None:
            return memory_pb2.StoreObservationResponse(stored=False)
        return memory_pb2.StoreObservationResponse(
            stored=True,
            added_ids=[str(each.memoryID) for each in stored.added],
            updated=stored.updated,
        )

    def _plan(
        self, scope: Scope, memories: Sequence[tuple[str, Embedding]], dedupeScore: float
    ) -> Plan:
        """
        The memories with this replica's nearest of each in C{scope}
        (L{Searcher.nearest}), asked now, before any lock; the scope's
        writes since L{RECENT_WINDOW} before now are read under it.
        """
        since = datetime.datetime.now(datetime.UTC) - RECENT_WINDOW
        return Plan(
            memories,
            dedupeScore,
            lambda embedding: self._searcher.nearest(scope, embedding, dedupeScore),
            since,
        )
