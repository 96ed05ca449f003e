"""
The validation cache of svc-auth (decisions D7): argon2 stays off the hot
path, yet revocations and agent status changes reach every replica within
one second, and bad tokens cannot be used to burn CPU.
"""

from __future__ import annotations

import datetime
import functools
import threading
import time
import uuid
from collections.abc import Callable, Hashable, Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import psycopg
import pytest
from authfixtures import Tenant, makeTenant
from authhelpers import CountingVerifier
from authservice import RunningAuthService
from waiting import waitUntil

import svcd.auth.authority
from svcd.auth.authority import AGENT_NOT_ACTIVE
from svcd.auth.cache import CachedToken, ValidationCache
from svcd.auth.feed import FeedStream, FeedUnavailable
from svcd.auth.hashing import verifySecret
from svcd.auth.store import Store
from svcd.auth.store.tokens import TokenRecord
from svcd.common.pat import formatToken, newSecret
from svcd.pb.auth.v1 import auth_pb2


@pytest.fixture
def verifier(monkeypatch: pytest.MonkeyPatch) -> Iterator[CountingVerifier]:
    counting = CountingVerifier(verifySecret)
    monkeypatch.setattr(svcd.auth.authority, "verifySecret", counting)
    yield counting


def validate(service: RunningAuthService, token: str) -> auth_pb2.ValidateTokenResponse:
    response: auth_pb2.ValidateTokenResponse = service.call(
        "ValidateToken", auth_pb2.ValidateTokenRequest(access_token=token)
    )
    return response


def codeOf(call: Callable[[], object]) -> grpc.StatusCode:
    try:
        call()
    except grpc.RpcError as error:
        return error.code()
    return grpc.StatusCode.OK


def heardTenant(service: RunningAuthService, owner: Store, name: str = "acme") -> Tenant:
    """
    A new tenant, once C{service}'s change listener has handled the
    notifications of its creation (its agent's INSERT, then its token's,
    committed last). Heard later, as on a loaded machine, they rightly
    leave untrusted an entry read before them or a read they overtake: a
    test whose premise is a trusted entry starts from here.
    """
    streams: list[FeedStream] = []

    def opened() -> bool:
        # The hub takes streams a moment after the cache hears that the
        # listener is up (RunningAuthService.start waits for the latter).
        try:
            streams.append(service.hub.open())
        except FeedUnavailable:
            return False
        return True

    waitUntil(opened, limit=10.0)
    [stream] = streams
    try:
        tenant = makeTenant(owner, name)

        def heard() -> bool:
            while (change := stream.next(0)) is not None:
                assert isinstance(change, auth_pb2.Change), "the change feed ended"
                if change.token_changed == tenant.tokenID.bytes:
                    return True
            return False

        waitUntil(heard, limit=10.0)
        return tenant
    finally:
        service.hub.close(stream)


def followersOfFlights(monkeypatch: pytest.MonkeyPatch) -> list[Hashable]:
    """
    The keys of the calls that found a cold read of their token or agent in
    progress and waited for it (single flight), in order.
    """
    followers: list[Hashable] = []
    flights = svcd.auth.authority._Flights
    join = flights.join

    def counted(self: svcd.auth.authority._Flights[Hashable], key: Hashable) -> object:
        event, leading = join(self, key)
        if not leading:
            followers.append(key)
        return event, leading

    monkeypatch.setattr(flights, "join", counted)
    return followers


def test_repeatedValidationsRunArgon2Once(
    authService: RunningAuthService, owner: Store, verifier: CountingVerifier
) -> None:
    """
    A hundred ValidateToken and ValidateAgent calls with the same valid
    token run one argon2 verification in all.
    """
    tenant = makeTenant(owner)
    for _ in range(50):
        validate(authService, tenant.token)
        authService.call(
            "ValidateAgent",
            auth_pb2.ValidateAgentRequest(agent_id=str(tenant.agentID), org_id=str(tenant.orgID)),
            bearer=tenant.token,
        )
    assert verifier.calls == 1


def test_repeatedWrongSecretRunsArgon2Once(
    authService: RunningAuthService, owner: Store, verifier: CountingVerifier
) -> None:
    """
    The same wrong secret sent again and again costs one argon2
    verification; a wrong secret for a token cached as valid costs none.
    """
    # Heard: the token's own INSERT, heard after its validation below,
    # would leave its entry to be read again, and the wrong secrets then
    # each to be verified.
    tenant = heardTenant(authService, owner)
    wrong = formatToken(tenant.tokenID, newSecret())
    for _ in range(20):
        assert codeOf(lambda: validate(authService, wrong)) == grpc.StatusCode.UNAUTHENTICATED
    assert verifier.calls == 1
    validate(authService, tenant.token)
    assert verifier.calls == 2
    for _ in range(20):
        other = formatToken(tenant.tokenID, newSecret())
        assert codeOf(functools.partial(validate, authService, other)) == (
            grpc.StatusCode.UNAUTHENTICATED
        )
    assert verifier.calls == 2


def test_unknownTokenIdsRunNoArgon2(
    authService: RunningAuthService, verifier: CountingVerifier
) -> None:
    """
    Tokens with unknown ids are refused after one indexed lookup, with no
    argon2 work.
    """
    for _ in range(20):
        bearer = formatToken(uuid.uuid4(), newSecret())
        assert codeOf(functools.partial(validate, authService, bearer)) == (
            grpc.StatusCode.UNAUTHENTICATED
        )
    assert verifier.calls == 0


@pytest.mark.parametrize("staleBy", ["age", "change"])
def test_aStaleEntryIsReadAgainWithoutAColdSlot(
    migratedDSN: str, owner: Store, monkeypatch: pytest.MonkeyPatch, staleBy: str
) -> None:
    """
    A valid token's entry goes stale after one second without a listener
    ("age"), or when a change of the token is heard ("change"; every new
    token's own INSERT is one, sometimes heard after its first
    validation). Its next call reads the row again, which needs no argon2
    and so no cold slot: with every slot held by wrong secrets, the token
    in use is still answered. It was refused RESOURCE_EXHAUSTED when the
    re-read queued for a slot, with both cores busy and the listener not
    yet connected; and when a change dropped the entry, digest and all.
    """
    gate = threading.Event()
    held = CountingVerifier(verifySecret, gate=gate)
    monkeypatch.setattr(svcd.auth.authority, "verifySecret", held)
    listening = staleBy == "change"
    service = RunningAuthService(
        migratedDSN, coldSlots=2, coldWait=0.05, workers=24, listen=listening
    ).start()
    try:
        if listening:
            # Its entry then stays fresh until the change below is heard.
            tenant = heardTenant(service, owner, "valid")
        else:
            tenant = makeTenant(owner, "valid")
        gate.set()
        validate(service, tenant.token)
        verified = held.calls
        gate.clear()
        victim = makeTenant(owner, "victim")
        wrongs = [formatToken(victim.tokenID, newSecret()) for _ in range(2)]
        with ThreadPoolExecutor(2) as pool:
            calls = [
                pool.submit(codeOf, functools.partial(validate, service, bearer))
                for bearer in wrongs
            ]
            waitUntil(lambda: held.running == 2, limit=5.0)
            if listening:
                with psycopg.connect(migratedDSN, autocommit=True) as connection:
                    connection.execute(
                        "UPDATE tokens SET name = 'renamed' WHERE token_id = %s",
                        (tenant.tokenID,),
                    )
            # The entry read a moment ago goes stale after a second, or
            # once the change is heard.
            waitUntil(lambda: not service.cache.token(tenant.tokenID)[1], limit=5.0)
            validate(service, tenant.token)
            assert held.running == 2
            gate.set()
            assert [call.result() for call in calls] == [grpc.StatusCode.UNAUTHENTICATED] * 2
        # Read again, not verified again.
        assert held.calls == verified + 2
    finally:
        service.stop()


def test_aChangedTokenKeepsItsVerifiedDigest() -> None:
    """
    A change heard for a token, or one heard while its row was being read,
    leaves its entry untrusted, listener or not, but cached with the
    digest of its verified secret: the next call reads the row again
    without argon2 (shown over gRPC above). An entry already cached is not
    replaced by one that a change overtook.
    """
    clock = [100.0]
    cache = ValidationCache(lambda: clock[0])
    cache.listening()
    record = TokenRecord(
        tokenID=uuid.uuid4(),
        orgID=uuid.uuid4(),
        agentID=None,
        userID=None,
        name=None,
        secretHash="$argon2id$stored",
        permissions=1,
        expiresAt=None,
        revokedAt=None,
        createdAt=datetime.datetime.now(datetime.UTC),
    )

    def cachedDigest() -> tuple[bytes | None, bool]:
        entry, fresh = cache.token(record.tokenID)
        return (None if entry is None else entry.secretDigest), fresh

    # Overtaken: another token changed while this one was read.
    epoch = cache.epoch()
    cache.forgetToken(uuid.uuid4())
    cache.rememberToken(CachedToken(record, b"first", clock[0]), epoch)
    assert cachedDigest() == (b"first", False)
    cache.rememberToken(CachedToken(record, b"second", clock[0]), cache.epoch())
    assert cachedDigest() == (b"second", True)
    epoch = cache.epoch()
    cache.forgetAgent(uuid.uuid4())
    cache.rememberToken(CachedToken(record, b"third", clock[0]), epoch)
    assert cachedDigest() == (b"second", True)
    # Changed: untrusted from now on, whatever the time and the listener.
    cache.forgetToken(record.tokenID)
    assert cachedDigest() == (b"second", False)
    clock[0] += 0.5
    cache.listening()
    assert cachedDigest() == (b"second", False)


def test_coldVerificationsAreBounded(
    migratedDSN: str, owner: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """
    However many distinct wrong secrets arrive at once, at most coldSlots
    verifications run together; the excess waits at most coldWait and is
    then refused (ResourceExhausted), while a cached valid token keeps
    being answered at once.
    """
    gate = threading.Event()
    held = CountingVerifier(verifySecret, gate=gate)
    monkeypatch.setattr(svcd.auth.authority, "verifySecret", held)
    service = RunningAuthService(migratedDSN, coldSlots=2, coldWait=0.05, workers=24).start()
    try:
        # Heard: the valid token's entry then stays fresh. (A stale one
        # would be answered too, by a read outside the cold slots: see
        # test_aStaleEntryIsReadAgainWithoutAColdSlot.)
        tenant = heardTenant(service, owner, "valid")
        gate.set()
        validate(service, tenant.token)
        gate.clear()
        # Wrong secrets for a token this replica never validated: each
        # needs argon2 to be refused. The verifications admitted are held
        # until the gate opens, so the order of events below is certain
        # whatever the machine's load.
        victim = makeTenant(owner, "victim")
        wrongs = [formatToken(victim.tokenID, newSecret()) for _ in range(16)]
        with ThreadPoolExecutor(16) as pool:
            calls = [
                pool.submit(codeOf, functools.partial(validate, service, bearer))
                for bearer in wrongs
            ]
            waitUntil(lambda: held.running == 2, limit=5.0)
            # Both cold slots are taken: the cached token is answered
            # without waiting for either.
            validate(service, tenant.token)
            assert held.running == 2
            # The excess waits at most coldWait, then is refused while the
            # slots are still taken.
            waitUntil(lambda: sum(call.done() for call in calls) == 14, limit=5.0)
            assert {call.result() for call in calls if call.done()} == {
                grpc.StatusCode.RESOURCE_EXHAUSTED
            }
            gate.set()
            results = [call.result() for call in calls]
        assert held.mostAtOnce <= 2
        assert results.count(grpc.StatusCode.UNAUTHENTICATED) == 2
        assert results.count(grpc.StatusCode.RESOURCE_EXHAUSTED) == 14
    finally:
        gate.set()
        service.stop()


def test_burstOnAColdTokenRunsArgon2Once(
    migratedDSN: str, owner: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """
    Sixteen concurrent first validations of one token (svc-auth just
    started under load) run argon2 once and all succeed: the others wait for
    the first instead of each queueing for a cold slot. A wrong secret in
    the same burst is still refused.
    """
    gate = threading.Event()
    held = CountingVerifier(verifySecret, gate=gate)
    monkeypatch.setattr(svcd.auth.authority, "verifySecret", held)
    followers = followersOfFlights(monkeypatch)
    # A wait for the first call (coldWait) that no load outlasts: the first
    # call is held until the others wait for it, and past coldWait they
    # would rightly verify for themselves, queueing for the cold slots.
    service = RunningAuthService(migratedDSN, coldSlots=2, coldWait=5.0, workers=24).start()
    try:
        # Heard: the token's own INSERT, heard while the first call reads
        # it, would leave its entry to be read again by every other one.
        tenant = heardTenant(service, owner)
        wrong = formatToken(tenant.tokenID, newSecret())

        def code(bearer: str) -> grpc.StatusCode:
            return codeOf(lambda: validate(service, bearer))

        with ThreadPoolExecutor(17) as pool:
            # The right secret first, held in its verification; then the
            # rest of the burst, all waiting for it before it goes on.
            first = pool.submit(code, tenant.token)
            waitUntil(lambda: held.running == 1, limit=5.0)
            others = [pool.submit(code, bearer) for bearer in [tenant.token] * 15 + [wrong]]
            waitUntil(lambda: len(followers) == 16, limit=5.0)
            gate.set()
            codes = [first.result()] + [call.result() for call in others]
        assert codes == [grpc.StatusCode.OK] * 16 + [grpc.StatusCode.UNAUTHENTICATED]
        # One verification of the right secret; the wrong one is refused
        # from the cached digest, or (its entry no longer fresh) by a
        # verification of its own.
        assert 1 <= held.calls <= 2
    finally:
        gate.set()
        service.stop()


def test_burstOnAColdAgentReadsItOnce(
    migratedDSN: str, owner: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """
    Sixteen concurrent first ValidateAgent calls for one agent read it from
    the database once, and all succeed.
    """
    reads = []
    gate = threading.Event()
    real = Store.agentInOrganization

    def heldRead(self: Store, orgID: uuid.UUID, agentID: uuid.UUID) -> object:
        reads.append(agentID)
        gate.wait(10)
        return real(self, orgID, agentID)

    monkeypatch.setattr(Store, "agentInOrganization", heldRead)
    followers = followersOfFlights(monkeypatch)
    # As for tokens: the others wait for the first read for longer than any
    # load makes it last (it is held until they all wait).
    service = RunningAuthService(migratedDSN, coldWait=5.0, workers=24).start()
    try:
        # Heard: the agent's own INSERT, heard during the first read, would
        # rightly keep that read out of the cache, and each other call
        # would read again.
        tenant = heardTenant(service, owner)
        validate(service, tenant.token)
        request = auth_pb2.ValidateAgentRequest(
            agent_id=str(tenant.agentID), org_id=str(tenant.orgID)
        )

        def code(_: object) -> grpc.StatusCode:
            return codeOf(lambda: service.call("ValidateAgent", request, bearer=tenant.token))

        with ThreadPoolExecutor(16) as pool:
            first = pool.submit(code, None)
            waitUntil(lambda: len(reads) == 1, limit=5.0)
            others = [pool.submit(code, None) for _ in range(15)]
            waitUntil(lambda: len(followers) == 15, limit=5.0)
            gate.set()
            codes = [first.result()] + [call.result() for call in others]
        assert codes == [grpc.StatusCode.OK] * 16
        assert reads == [tenant.agentID]
    finally:
        gate.set()
        service.stop()


def test_revocationReachesAnotherReplicaWithinOneSecond(migratedDSN: str, owner: Store) -> None:
    """
    Two AuthService instances on one database: a token cached as valid by
    the first is refused by it within one second of its revocation through
    the second.
    """
    first = RunningAuthService(migratedDSN).start()
    second = RunningAuthService(migratedDSN).start()
    try:
        from svcd.auth.authority import issueToken
        from svcd.common.permissions import Permission

        admin = makeTenant(owner, permissions=int(Permission.TokenRevoke | 1))
        token, record = issueToken(owner, orgID=admin.orgID, permissions=1)
        for _ in range(3):
            validate(first, token)
        second.call(
            "RevokeToken",
            auth_pb2.RevokeTokenRequest(token_id=str(record.tokenID)),
            bearer=admin.token,
        )
        took = waitUntil(
            lambda: codeOf(lambda: validate(first, token)) == grpc.StatusCode.UNAUTHENTICATED,
            limit=1.0,
        )
        assert took < 1.0
    finally:
        first.stop()
        second.stop()


def test_agentStatusChangeReachesAReplicaWithinOneSecond(
    authService: RunningAuthService, owner: Store
) -> None:
    """
    An agent cached as active is refused with "agent is not active" within
    one second of being paused by an operator (svcctl), and accepted again
    within one second of being reactivated.
    """
    tenant = makeTenant(owner)
    request = auth_pb2.ValidateAgentRequest(agent_id=str(tenant.agentID), org_id=str(tenant.orgID))

    def agentCode() -> grpc.StatusCode:
        return codeOf(lambda: authService.call("ValidateAgent", request, bearer=tenant.token))

    assert agentCode() == grpc.StatusCode.OK
    owner.setAgentStatus(tenant.agentID, "paused")
    waitUntil(lambda: agentCode() == grpc.StatusCode.PERMISSION_DENIED, limit=1.0)
    try:
        authService.call("ValidateAgent", request, bearer=tenant.token)
    except grpc.RpcError as error:
        assert error.details() == AGENT_NOT_ACTIVE
    owner.setAgentStatus(tenant.agentID, "active")
    waitUntil(lambda: agentCode() == grpc.StatusCode.OK, limit=1.0)


def test_revocationIsSeenWithinOneSecondWithoutTheListener(
    migratedDSN: str, owner: Store, verifier: CountingVerifier
) -> None:
    """
    With no change listener (its connection lost), cached validations live
    at most one second: a revocation still takes effect within a second,
    and re-reading a cached token costs a query but no argon2.
    """
    service = RunningAuthService(migratedDSN, listen=False).start()
    try:
        tenant = makeTenant(owner)
        validate(service, tenant.token)
        time.sleep(1.1)
        validate(service, tenant.token)
        assert verifier.calls == 1
        owner.revokeToken(tenant.tokenID)
        waitUntil(
            lambda: (
                codeOf(lambda: validate(service, tenant.token)) == grpc.StatusCode.UNAUTHENTICATED
            ),
            limit=1.2,
        )
    finally:
        service.stop()
