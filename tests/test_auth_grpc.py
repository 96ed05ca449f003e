"""
svc-auth's gRPC contract (spec 4.3, decisions D4 and D6) against a real
grpcio server and a real PostgreSQL.
"""

from __future__ import annotations

import datetime
import uuid
from typing import cast

import grpc
import pytest
from authfixtures import Tenant, makeTenant, secretOf
from authservice import RunningAuthService, SettableClock
from waiting import waitUntil

from svcd.auth.authority import AGENT_NOT_ACTIVE, issueToken
from svcd.auth.store import Store
from svcd.common.pat import READINESS_SENTINEL, formatToken, newSecret
from svcd.common.permissions import Permission
from svcd.pb.auth.v1 import auth_pb2

ALL_PERMISSIONS = int(
    Permission.ProxyChatCompletion
    | Permission.TokenCreate
    | Permission.TokenRevoke
    | Permission.TokenList
)


def statusOf(call: object) -> tuple[grpc.StatusCode, str]:
    """
    Run a zero-argument callable expected to fail with an RPC error and
    return its status code and details.
    """
    with pytest.raises(grpc.RpcError) as raised:
        call()  # type: ignore[operator]
    return raised.value.code(), raised.value.details()


def validateToken(service: RunningAuthService, token: str) -> auth_pb2.ValidateTokenResponse:
    return cast(
        auth_pb2.ValidateTokenResponse,
        service.call("ValidateToken", auth_pb2.ValidateTokenRequest(access_token=token)),
    )


def validateAgent(
    service: RunningAuthService, bearer: str | None, agentID: object, orgID: object
) -> auth_pb2.ValidateAgentResponse:
    return cast(
        auth_pb2.ValidateAgentResponse,
        service.call(
            "ValidateAgent",
            auth_pb2.ValidateAgentRequest(agent_id=str(agentID), org_id=str(orgID)),
            bearer=bearer,
        ),
    )


# ValidateToken


def test_validTokenAnswersItsOrganizationAndPermissions(
    authService: RunningAuthService, owner: Store
) -> None:
    """
    A valid token yields its org_id, permission bitmap, token_id and, when
    bound, its agent_id.
    """
    tenant = makeTenant(owner, permissions=ALL_PERMISSIONS, bindAgent=True)
    answer = validateToken(authService, tenant.token)
    assert answer.org_id == str(tenant.orgID)
    assert answer.permissions == ALL_PERMISSIONS
    assert answer.token_id == str(tenant.tokenID)
    assert answer.agent_id == str(tenant.agentID)
    assert answer.expires_at == ""


@pytest.mark.parametrize(
    "bearer",
    [
        "",
        "svc_pat_",
        READINESS_SENTINEL,
        "Bearer svc_pat_x",
        "svc_pat_" + str(uuid.uuid4()) + "_short",
        "svc_pat_" + str(uuid.uuid4()).upper() + "_" + "a" * 43,
        "svc_pat_" + str(uuid.uuid4()) + "_" + "!" * 43,
        "svc_pat_" + str(uuid.uuid4()) + "_" + "a" * 44,
    ],
)
def test_missingOrMalformedTokenIsUnauthenticated(
    authService: RunningAuthService, bearer: str
) -> None:
    """
    A missing or malformed bearer is Unauthenticated.
    """
    code, _ = statusOf(lambda: validateToken(authService, bearer))
    assert code == grpc.StatusCode.UNAUTHENTICATED


def test_unknownTokenAndWrongSecretAreUnauthenticated(
    authService: RunningAuthService, owner: Store
) -> None:
    """
    A well-formed token whose id is unknown, or whose secret is wrong, is
    Unauthenticated, with a message that quotes no secret.
    """
    tenant = makeTenant(owner)
    unknown = formatToken(uuid.uuid4(), newSecret())
    wrongSecret = formatToken(tenant.tokenID, newSecret())
    for bearer in (unknown, wrongSecret):
        code, details = statusOf(lambda bearer=bearer: validateToken(authService, bearer))
        assert code == grpc.StatusCode.UNAUTHENTICATED
        assert secretOf(bearer) not in details


def test_revokedTokenIsUnauthenticated(authService: RunningAuthService, owner: Store) -> None:
    """
    A token revoked straight in PostgreSQL, as svcctl does, is
    Unauthenticated within one second (decisions D7: the replica hears of
    it by NOTIFY, a moment after the commit), also when it was valid and
    cached on this replica a moment before; and it stays refused.
    """
    tenant = makeTenant(owner)
    validateToken(authService, tenant.token)
    owner.revokeToken(tenant.tokenID)

    def refused() -> bool:
        try:
            validateToken(authService, tenant.token)
        except grpc.RpcError:
            return True
        return False

    waitUntil(refused, limit=1.0)
    for _ in range(3):
        code, details = statusOf(lambda: validateToken(authService, tenant.token))
        assert code == grpc.StatusCode.UNAUTHENTICATED
        assert "revoked" in details


def test_expiryTakesEffectExactlyAtExpiresAt(
    authService: RunningAuthService, owner: Store, clock: SettableClock
) -> None:
    """
    A token is valid until the instant before expires_at and invalid from
    expires_at on, also when it is cached.
    """
    tenant = makeTenant(owner)
    expiresAt = datetime.datetime(2031, 1, 2, 3, 4, 5, tzinfo=datetime.UTC)
    token, _ = issueToken(owner, orgID=tenant.orgID, permissions=1, expiresAt=expiresAt)
    clock.fixed = expiresAt.timestamp() - 0.001
    assert validateToken(authService, token).expires_at == "2031-01-02T03:04:05.000Z"
    clock.fixed = expiresAt.timestamp()
    code, details = statusOf(lambda: validateToken(authService, token))
    assert code == grpc.StatusCode.UNAUTHENTICATED
    assert "expired" in details


def test_databaseFailureIsInternalWithoutSecrets(privatePostgres: object, owner: Store) -> None:
    """
    When PostgreSQL is down, validating a token not yet cached answers
    Internal, and the message holds neither the token nor the DSN.
    """
    from svcd.common.migrations import migrate
    from svcd.devkit.postgres import PostgresServer

    assert isinstance(privatePostgres, PostgresServer)
    dsn = privatePostgres.createDatabase("auth")
    migrate(dsn)
    import contextlib

    import psycopg

    with psycopg.connect(dsn, autocommit=True) as connection:
        tenant = makeTenant(Store(lambda: contextlib.nullcontext(connection)))
    service = RunningAuthService(dsn).start()
    try:
        privatePostgres.stop()
        code, details = statusOf(lambda: validateToken(service, tenant.token))
        assert code == grpc.StatusCode.INTERNAL
        assert secretOf(tenant.token) not in details
        assert "postgres" not in details.lower() or "@" not in details
        assert str(privatePostgres.port) not in details
    finally:
        service.stop()


# ValidateAgent


def test_activeAgentIsValid(authService: RunningAuthService, owner: Store) -> None:
    """
    An active agent of the token's organization is OK, echoing the ids.
    """
    tenant = makeTenant(owner)
    answer = validateAgent(authService, tenant.token, tenant.agentID, tenant.orgID)
    assert (answer.agent_id, answer.org_id, answer.status) == (
        str(tenant.agentID),
        str(tenant.orgID),
        "active",
    )


def test_validateAgentNeedsTheCallersBearer(authService: RunningAuthService, owner: Store) -> None:
    """
    Without authorization metadata, or with a bad bearer in it,
    ValidateAgent is Unauthenticated.
    """
    tenant = makeTenant(owner)
    for bearer in (None, "", "svc_pat_nonsense"):
        code, _ = statusOf(
            lambda bearer=bearer: validateAgent(authService, bearer, tenant.agentID, tenant.orgID)
        )
        assert code == grpc.StatusCode.UNAUTHENTICATED
    request = auth_pb2.ValidateAgentRequest(agent_id=str(tenant.agentID), org_id=str(tenant.orgID))
    code, _ = statusOf(
        lambda: authService.stub.ValidateAgent(
            request, metadata=(("authorization", "Basic abc"),), timeout=5
        )
    )
    assert code == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.parametrize("status", ["paused", "suspended", "archived"])
def test_inactiveAgentIsDeniedAsNotActive(
    authService: RunningAuthService, owner: Store, status: str
) -> None:
    """
    A paused, suspended or archived agent is PermissionDenied with exactly
    the message "agent is not active".
    """
    tenant = makeTenant(owner, agentStatus=status)
    code, details = statusOf(
        lambda: validateAgent(authService, tenant.token, tenant.agentID, tenant.orgID)
    )
    assert code == grpc.StatusCode.PERMISSION_DENIED
    assert details == AGENT_NOT_ACTIVE


def test_unknownOtherOrganizationAndForeignAgentsAreDeniedNeverNotFound(
    authService: RunningAuthService, owner: Store
) -> None:
    """
    An unknown agent, an agent of another organization, a request naming
    another organization, and an agent other than the one the token is
    bound to are all PermissionDenied with a message other than "agent is
    not active", never NotFound.
    """
    tenantA = makeTenant(owner, "a")
    tenantB = makeTenant(owner, "b")
    bound = makeTenant(owner, "bound", bindAgent=True)
    otherAgentOfBound = owner.createAgent(bound.orgID, "second", "active")
    cases = [
        (tenantA.token, uuid.uuid4(), tenantA.orgID),
        (tenantA.token, tenantB.agentID, tenantA.orgID),
        (tenantA.token, tenantB.agentID, tenantB.orgID),
        (tenantA.token, tenantA.agentID, tenantB.orgID),
        (bound.token, otherAgentOfBound.agentID, bound.orgID),
    ]
    for bearer, agentID, orgID in cases:
        code, details = statusOf(
            lambda bearer=bearer, agentID=agentID, orgID=orgID: validateAgent(
                authService, bearer, agentID, orgID
            )
        )
        assert code == grpc.StatusCode.PERMISSION_DENIED, (agentID, orgID)
        assert details != AGENT_NOT_ACTIVE


@pytest.mark.parametrize(
    "agentID, orgID",
    [("not-a-uuid", None), ("", None), (None, "zzz"), (None, "")],
)
def test_malformedUUIDIsInvalidArgument(
    authService: RunningAuthService, owner: Store, agentID: str | None, orgID: str | None
) -> None:
    """
    A malformed agent_id or org_id is InvalidArgument.
    """
    tenant = makeTenant(owner)
    code, _ = statusOf(
        lambda: validateAgent(
            authService,
            tenant.token,
            tenant.agentID if agentID is None else agentID,
            tenant.orgID if orgID is None else orgID,
        )
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT


# Management methods (D6)


def test_createTokenIssuesAUsableTokenInTheCallersOrganization(
    authService: RunningAuthService, owner: Store
) -> None:
    """
    CreateToken with TokenCreate issues a token of the caller's
    organization that validates, whatever the request might claim.
    """
    admin = makeTenant(owner, permissions=ALL_PERMISSIONS)
    created = authService.call(
        "CreateToken",
        auth_pb2.CreateTokenRequest(
            name="ci",
            permissions=int(Permission.ProxyChatCompletion),
            agent_id=str(admin.agentID),
            expires_in_seconds=3600,
        ),
        bearer=admin.token,
    )
    assert created.token.startswith("svc_pat_")
    assert created.info.org_id == str(admin.orgID)
    assert created.info.agent_id == str(admin.agentID)
    assert created.info.expires_at != ""
    answer = validateToken(authService, created.token)
    assert answer.org_id == str(admin.orgID)
    assert answer.permissions == int(Permission.ProxyChatCompletion)


def test_createTokenNeedsTokenCreateAndCannotEscalate(
    authService: RunningAuthService, owner: Store
) -> None:
    """
    Without TokenCreate, CreateToken is PermissionDenied; with it, asking
    for a bit the caller lacks is PermissionDenied too.
    """
    chatOnly = makeTenant(owner, "chat", permissions=int(Permission.ProxyChatCompletion))
    creator = makeTenant(
        owner, "creator", permissions=int(Permission.TokenCreate | Permission.ProxyChatCompletion)
    )
    code, _ = statusOf(
        lambda: authService.call(
            "CreateToken", auth_pb2.CreateTokenRequest(permissions=1), bearer=chatOnly.token
        )
    )
    assert code == grpc.StatusCode.PERMISSION_DENIED
    code, details = statusOf(
        lambda: authService.call(
            "CreateToken",
            auth_pb2.CreateTokenRequest(permissions=int(Permission.TokenList)),
            bearer=creator.token,
        )
    )
    assert code == grpc.StatusCode.PERMISSION_DENIED
    assert "grant" in details


def test_createTokenForAnotherOrganizationsAgentIsDenied(
    authService: RunningAuthService, owner: Store
) -> None:
    """
    Binding a new token to an agent of another organization is
    PermissionDenied; a malformed agent id is InvalidArgument.
    """
    admin = makeTenant(owner, "a", permissions=ALL_PERMISSIONS)
    other = makeTenant(owner, "b")
    code, _ = statusOf(
        lambda: authService.call(
            "CreateToken",
            auth_pb2.CreateTokenRequest(permissions=1, agent_id=str(other.agentID)),
            bearer=admin.token,
        )
    )
    assert code == grpc.StatusCode.PERMISSION_DENIED
    code, _ = statusOf(
        lambda: authService.call(
            "CreateToken",
            auth_pb2.CreateTokenRequest(permissions=1, agent_id="nope"),
            bearer=admin.token,
        )
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT


def test_revokeTokenNeedsTokenRevokeAndStaysInTheOrganization(
    authService: RunningAuthService, owner: Store
) -> None:
    """
    RevokeToken needs TokenRevoke; another organization's token id is
    PermissionDenied (never NotFound) and stays valid; an own token is
    revoked and stops validating.
    """
    admin = makeTenant(owner, "a", permissions=ALL_PERMISSIONS)
    chatOnly = makeTenant(owner, "c", permissions=1)
    victim = makeTenant(owner, "b")
    ownToken, ownRecord = issueToken(owner, orgID=admin.orgID, permissions=1)

    code, _ = statusOf(
        lambda: authService.call(
            "RevokeToken",
            auth_pb2.RevokeTokenRequest(token_id=str(chatOnly.tokenID)),
            bearer=chatOnly.token,
        )
    )
    assert code == grpc.StatusCode.PERMISSION_DENIED
    for foreign in (victim.tokenID, uuid.uuid4()):
        code, _ = statusOf(
            lambda foreign=foreign: authService.call(
                "RevokeToken",
                auth_pb2.RevokeTokenRequest(token_id=str(foreign)),
                bearer=admin.token,
            )
        )
        assert code == grpc.StatusCode.PERMISSION_DENIED
    assert validateToken(authService, victim.token).org_id == str(victim.orgID)
    code, _ = statusOf(
        lambda: authService.call(
            "RevokeToken", auth_pb2.RevokeTokenRequest(token_id="x"), bearer=admin.token
        )
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT

    validateToken(authService, ownToken)
    answer = authService.call(
        "RevokeToken",
        auth_pb2.RevokeTokenRequest(token_id=str(ownRecord.tokenID)),
        bearer=admin.token,
    )
    assert answer.revoked is True
    code, _ = statusOf(lambda: validateToken(authService, ownToken))
    assert code == grpc.StatusCode.UNAUTHENTICATED


def test_listTokensNeedsTokenListAndShowsOnlyTheOrganizationsTokens(
    authService: RunningAuthService, owner: Store
) -> None:
    """
    ListTokens needs TokenList and lists the caller's organization's
    tokens only, with no secret or hash.
    """
    admin = makeTenant(owner, "a", permissions=ALL_PERMISSIONS)
    second, secondRecord = issueToken(owner, orgID=admin.orgID, permissions=1, name="second")
    makeTenant(owner, "b")
    chatOnly = makeTenant(owner, "c", permissions=1)
    code, _ = statusOf(
        lambda: authService.call("ListTokens", auth_pb2.ListTokensRequest(), bearer=chatOnly.token)
    )
    assert code == grpc.StatusCode.PERMISSION_DENIED
    listing = authService.call("ListTokens", auth_pb2.ListTokensRequest(), bearer=admin.token)
    assert {info.token_id for info in listing.tokens} == {
        str(admin.tokenID),
        str(secondRecord.tokenID),
    }
    assert {info.org_id for info in listing.tokens} == {str(admin.orgID)}
    serialized = listing.SerializeToString()
    for token in (admin.token, second):
        assert secretOf(token).encode() not in serialized
    assert b"argon2" not in serialized


def test_managementMethodsNeedABearer(authService: RunningAuthService) -> None:
    """
    Management methods without authorization metadata are Unauthenticated.
    """
    for method, request in [
        ("CreateToken", auth_pb2.CreateTokenRequest()),
        ("RevokeToken", auth_pb2.RevokeTokenRequest(token_id=str(uuid.uuid4()))),
        ("ListTokens", auth_pb2.ListTokensRequest()),
    ]:
        code, _ = statusOf(lambda method=method, request=request: authService.call(method, request))
        assert code == grpc.StatusCode.UNAUTHENTICATED


def test_tenantFixtureKeepsTenantsApart(owner: Store) -> None:
    """
    Sanity check of the fixture the other tests rely on: two tenants get
    distinct organizations, agents and tokens.
    """
    first: Tenant = makeTenant(owner, "one")
    second: Tenant = makeTenant(owner, "two")
    assert len({first.orgID, second.orgID}) == 2
    assert first.token != second.token


# Standard services


def test_reflectionListsTheServices(authService: RunningAuthService) -> None:
    """
    A server reflection client (what grpcurl uses) lists AuthService, the
    health service and reflection itself, and resolves AuthService's file.
    """
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    stub = reflection_pb2_grpc.ServerReflectionStub(authService.channel)
    answers = list(
        stub.ServerReflectionInfo(
            iter(
                [
                    reflection_pb2.ServerReflectionRequest(list_services=""),
                    reflection_pb2.ServerReflectionRequest(
                        file_containing_symbol="svc.auth.v1.AuthService"
                    ),
                ]
            ),
            timeout=5,
        )
    )
    names = {service.name for service in answers[0].list_services_response.service}
    assert {
        "svc.auth.v1.AuthService",
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
    } <= names
    assert answers[1].file_descriptor_response.file_descriptor_proto


def test_healthServiceReportsServing(authService: RunningAuthService) -> None:
    """
    grpc.health.v1.Health answers SERVING for the server and for
    AuthService (what a load balancer's gRPC health check asks).
    """
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    stub = health_pb2_grpc.HealthStub(authService.channel)
    for service in ("", "svc.auth.v1.AuthService"):
        answer = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        assert answer.status == health_pb2.HealthCheckResponse.SERVING


def test_callsAreCountedByMethodCodeAndResult(
    authService: RunningAuthService, owner: Store
) -> None:
    """
    svc_auth_grpc_requests_total counts each answered call under its method
    and status code, and the ValidateToken histogram each call under its
    result, however often the same series is hit.
    """
    tenant = makeTenant(owner)
    wrong = formatToken(tenant.tokenID, newSecret())
    for _ in range(3):
        authService.call("ValidateToken", auth_pb2.ValidateTokenRequest(access_token=tenant.token))
    for _ in range(2):
        with pytest.raises(grpc.RpcError):
            authService.call("ValidateToken", auth_pb2.ValidateTokenRequest(access_token=wrong))
    registry = authService.registry

    def count(code: str) -> float | None:
        return registry.get_sample_value(
            "svc_auth_grpc_requests_total", {"method": "ValidateToken", "code": code}
        )

    assert (count("OK"), count("UNAUTHENTICATED")) == (3, 2)
    histogram = "svc_auth_validate_token_duration_seconds_count"
    assert registry.get_sample_value(histogram, {"result": "ok"}) == 3
    assert registry.get_sample_value(histogram, {"result": "unauthenticated"}) == 2
