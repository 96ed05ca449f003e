"""
A call whose deadline passes while it waits its turn (for a cold slot, or
for another call's read of the same token) is dropped before it reaches
PostgreSQL or argon2 (decisions D10): answered DEADLINE_EXCEEDED, counted
in svc_auth_grpc_refused_total{reason="deadline"}, logged at info at most.

Against a real grpcio server and PostgreSQL first, then L{Authority} alone
with a fake clock for the checks between the read and argon2.
"""

from __future__ import annotations

import datetime
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any, cast

import grpc
import pytest
from authfixtures import makeTenant
from authhelpers import CountingVerifier
from authservice import RunningAuthService
from twisted.logger import ILogObserver, LogLevel, globalLogPublisher
from waiting import waitUntil

import svcd.auth.authority
from svcd.auth.authority import Authority, DeadlinePassed
from svcd.auth.cache import ValidationCache
from svcd.auth.hashing import hashSecret, verifySecret
from svcd.auth.store import Store
from svcd.auth.store.organizations import AgentRecord
from svcd.auth.store.tokens import TokenRecord
from svcd.common.pat import formatToken, newSecret
from svcd.pb.auth.v1 import auth_pb2


class CountingLookups:
    """
    Counts the token rows svc-auth reads from PostgreSQL.
    """

    def __init__(self, store: Store) -> None:
        self._real = store.tokenForAuthentication
        self.calls = 0
        store.tokenForAuthentication = self  # type: ignore[method-assign]

    def __call__(self, tokenID: uuid.UUID) -> TokenRecord | None:
        self.calls += 1
        return self._real(tokenID)


@pytest.fixture
def loud() -> Iterator[list[dict[str, Any]]]:
    """
    Every twisted.logger event above info while the test runs.
    """
    events: list[dict[str, Any]] = []

    def observe(event: dict[str, Any]) -> None:
        if event.get("log_level", LogLevel.info) > LogLevel.info:
            events.append(event)

    globalLogPublisher.addObserver(cast(ILogObserver, observe))
    yield events
    globalLogPublisher.removeObserver(cast(ILogObserver, observe))


def sample(service: RunningAuthService, name: str, **labels: str) -> float:
    return service.registry.get_sample_value(name, labels) or 0.0


def expire(service: RunningAuthService, token: str, seconds: float) -> grpc.StatusCode:
    """
    ValidateToken with a deadline C{seconds} away; the client's status.
    """
    try:
        service.stub.ValidateToken(
            auth_pb2.ValidateTokenRequest(access_token=token), timeout=seconds
        )
    except grpc.RpcError as error:
        return error.code()
    return grpc.StatusCode.OK


def inBackground(call: Callable[[], object]) -> threading.Thread:
    thread = threading.Thread(target=call)
    thread.start()
    return thread


def test_aCallPastItsDeadlineInTheColdQueueNeverReadsTheDatabase(
    migratedDSN: str, owner: Store, monkeypatch: pytest.MonkeyPatch, loud: list[Any]
) -> None:
    """
    While the only cold slot is busy with a slow verification, a call for
    an unknown token with a 100 ms deadline waits for the slot only until
    its deadline (not the 3 s of coldWait, nor until the slot is free),
    then is dropped without reading its token: DEADLINE_EXCEEDED, counted,
    logged at info.
    """
    slow = CountingVerifier(verifySecret, delay=1.5)
    monkeypatch.setattr(svcd.auth.authority, "verifySecret", slow)
    service = RunningAuthService(migratedDSN, coldSlots=1, coldWait=3.0).start()
    lookups = CountingLookups(service.store)
    try:
        tenant = makeTenant(owner)
        busy = inBackground(lambda: expire(service, tenant.token, 10))
        waitUntil(lambda: slow.running == 1, 5)

        started = time.monotonic()
        assert expire(service, formatToken(uuid.uuid4(), newSecret()), 0.1) == (
            grpc.StatusCode.DEADLINE_EXCEEDED
        )
        waitUntil(lambda: sample(service, "svc_auth_grpc_refused_total", reason="deadline") == 1, 5)
        assert time.monotonic() - started < 1.2  # dropped before the slot came free
        busy.join(10)
        assert lookups.calls == 1  # the slow call's own
        assert (
            sample(
                service,
                "svc_auth_grpc_requests_total",
                method="ValidateToken",
                code="DEADLINE_EXCEEDED",
            )
            == 1
        )
        assert (
            sample(
                service,
                "svc_auth_validate_token_duration_seconds_count",
                result="deadline_exceeded",
            )
            == 1
        )
        assert loud == []
    finally:
        service.stop()


def test_aCallPastItsDeadlineBehindASingleFlightIsDropped(
    migratedDSN: str, owner: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """
    A second first call for a token whose first verification is slow waits
    for it (single flight) only until its own deadline, and is then dropped
    without a read or an argon2 run of its own.
    """
    slow = CountingVerifier(verifySecret, delay=0.6)
    monkeypatch.setattr(svcd.auth.authority, "verifySecret", slow)
    service = RunningAuthService(migratedDSN, coldSlots=4, coldWait=1.0).start()
    lookups = CountingLookups(service.store)
    try:
        tenant = makeTenant(owner)
        leader = inBackground(lambda: expire(service, tenant.token, 10))
        waitUntil(lambda: slow.running == 1, 5)
        assert expire(service, tenant.token, 0.1) == grpc.StatusCode.DEADLINE_EXCEEDED
        waitUntil(lambda: sample(service, "svc_auth_grpc_refused_total", reason="deadline") == 1, 5)
        leader.join(10)
        assert (lookups.calls, slow.calls) == (1, 1)
    finally:
        service.stop()


class FakeStore:
    """
    One token and one agent, read with a cost in fake time: each read moves
    the clock on by C{readTime}.
    """

    def __init__(self, clock: list[float], record: TokenRecord, readTime: float) -> None:
        self._clock = clock
        self._record = record
        self._readTime = readTime
        self.tokenReads = 0
        self.agentReads = 0

    def tokenForAuthentication(self, tokenID: uuid.UUID) -> TokenRecord | None:
        self.tokenReads += 1
        self._clock[0] += self._readTime
        return self._record if tokenID == self._record.tokenID else None

    def agentInOrganization(self, orgID: uuid.UUID, agentID: uuid.UUID) -> AgentRecord | None:
        self.agentReads += 1
        self._clock[0] += self._readTime
        return AgentRecord(agentID, orgID, "active", None)


def fakeAuthority(readTime: float) -> tuple[Authority, FakeStore, list[float], str]:
    """
    An Authority over a L{FakeStore} holding one valid token, with a fake
    monotonic clock; returns it, its store, the clock and the token.
    """
    clock = [100.0]
    tokenID, secret = uuid.uuid4(), newSecret()
    record = TokenRecord(
        tokenID=tokenID,
        orgID=uuid.uuid4(),
        agentID=None,
        userID=None,
        name=None,
        secretHash=hashSecret(secret),
        permissions=1,
        expiresAt=None,
        revokedAt=None,
        createdAt=datetime.datetime.now(datetime.UTC),
    )
    store = FakeStore(clock, record, readTime)
    authority = Authority(
        store,  # type: ignore[arg-type]
        ValidationCache(lambda: clock[0]),
        time.time,
        monotonic=lambda: clock[0],
    )
    return authority, store, clock, formatToken(tokenID, secret)


def test_aDeadlinePassedDuringTheReadSparesArgon2(verifier: CountingVerifier) -> None:
    """
    When the token's row arrives after the call's deadline, the secret is
    not verified: argon2 is the dearer half of a cold validation.
    """
    authority, store, clock, token = fakeAuthority(readTime=0.2)
    with pytest.raises(DeadlinePassed):
        authority.validateToken(token, deadline=clock[0] + 0.1)
    assert (store.tokenReads, verifier.calls) == (1, 0)
    authority.validateToken(token, deadline=clock[0] + 1.0)
    assert (store.tokenReads, verifier.calls) == (2, 1)


def test_aDeadlineAlreadyPassedReadsNothing(verifier: CountingVerifier) -> None:
    """
    A call whose deadline has passed reads neither its token nor its agent;
    a cached token still answers it (no work is saved by refusing then),
    but the agent's read is not made.
    """
    authority, store, clock, token = fakeAuthority(readTime=0.0)
    with pytest.raises(DeadlinePassed):
        authority.validateToken(token, deadline=clock[0])
    assert store.tokenReads == 0
    caller = authority.validateToken(token, deadline=None)
    with pytest.raises(DeadlinePassed):
        authority.validateAgent(token, str(uuid.uuid4()), str(caller.orgID), deadline=clock[0])
    assert (store.tokenReads, store.agentReads, verifier.calls) == (1, 0, 1)


@pytest.fixture
def verifier(monkeypatch: pytest.MonkeyPatch) -> Iterator[CountingVerifier]:
    counting = CountingVerifier(verifySecret)
    monkeypatch.setattr(svcd.auth.authority, "verifySecret", counting)
    yield counting
