"""
Tenant isolation end to end, against the real daemons: every proxy route
and every gRPC method is called with organization A's credentials against
organization B's ids (agents, tokens, the path org), and every answer is
403 or PermissionDenied, never 404, NotFound or anything of B's. An
unknown id gets the very same answer as B's, so A cannot even learn which
of B's ids exist. A token bound to an agent cannot act as another.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import cast

import grpc
import pytest
from authfixtures import Tenant, makeTenant, secretOf
from gatewayfixtures import (
    PATIENT_AUTH,
    Answer,
    Gateway,
    assertEnvelope,
    chat,
    request,
    unlimitedGateway,
)
from waiting import waitUntil

from svcd.devkit.postgres import PostgresServer
from svcd.pb.auth.v1 import auth_pb2, auth_pb2_grpc

# Starts real daemons or processes (conftest.py, pytest.ini): left out of a
# quick run, dev/test -m "not e2e".
pytestmark = pytest.mark.e2e

ALL_PERMISSIONS = 1 | 2 | 4 | 8


@pytest.fixture(scope="module")
def gateway(
    postgresServer: PostgresServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Gateway]:
    with unlimitedGateway(
        postgresServer, tmp_path_factory.mktemp("tenants"), **PATIENT_AUTH
    ) as running:
        running.tenants["A"] = makeTenant(running.owner, "org-a", permissions=ALL_PERMISSIONS)
        running.tenants["B"] = makeTenant(running.owner, "org-b", permissions=ALL_PERMISSIONS)
        yield running


@pytest.fixture(scope="module")
def stub(gateway: Gateway) -> Iterator[auth_pb2_grpc.AuthServiceStub]:
    channel = grpc.insecure_channel(f"127.0.0.1:{gateway.auth.environment['SVC_GRPC_PORT']}")
    with channel:
        yield auth_pb2_grpc.AuthServiceStub(channel)


def idsOf(tenant: Tenant) -> list[str]:
    return [str(tenant.orgID), str(tenant.agentID), str(tenant.tokenID), tenant.token]


def assertNothingOf(tenant: Tenant, text: str) -> None:
    for identifier in idsOf(tenant):
        assert identifier not in text


def withoutIDs(answer: Answer) -> tuple[int, str, str]:
    error = answer.json()["error"]
    return answer.status, error["code"], error["message"]


def test_proxyRoutesRefuseAnotherOrganizationsIDs(gateway: Gateway) -> None:
    """
    With A's token: B's agent on every protected route, B's org in the
    org-scoped probe path, both at once: always 403 with the envelope,
    never 404, never a byte of B; a made-up id gets the same answer.
    """
    a, b = gateway.tenants["A"], gateway.tenants["B"]
    bearer = {"Authorization": f"Bearer {a.token}"}
    randomOrg, randomAgent = str(uuid.uuid4()), str(uuid.uuid4())
    cases = []
    for orgInPath in (str(b.orgID), randomOrg):
        for agent in (str(a.agentID), str(b.agentID), randomAgent):
            cases.append(
                ("GET", f"/v1/orgs/{orgInPath}/auth-probe", agent, "INSUFFICIENT_PERMISSIONS")
            )
    for agent in (str(b.agentID), randomAgent):
        cases.append(("GET", "/v1/internal/auth-probe", agent, "AGENT_NOT_AUTHORIZED"))
        cases.append(("GET", f"/v1/orgs/{a.orgID}/auth-probe", agent, "AGENT_NOT_AUTHORIZED"))
        for path in ("/v1/chat/completions", "/proxy/v1/chat/completions"):
            cases.append(("POST", path, agent, "AGENT_NOT_AUTHORIZED"))

    answers: dict[tuple[str, str, str], tuple[int, str, str]] = {}
    for method, path, agent, code in cases:
        if method == "POST":
            answer = chat(gateway.port, a, path=path, headers={"X-SVC-Agent-ID": agent})
        else:
            answer = request(gateway.port, method, path, {**bearer, "X-SVC-Agent-ID": agent})
        assertEnvelope(answer, 403, code)
        assertNothingOf(b, answer.body.decode() + str(answer.headers))
        shape = path.replace(str(b.orgID), "{org}").replace(randomOrg, "{org}")
        who = {str(b.agentID): "b", randomAgent: "?"}.get(agent, "a")
        key = (method, shape, who)
        answers[key] = withoutIDs(answer)
    # B's ids and made-up ids are indistinguishable.
    for (method, shape, who), seen in answers.items():
        if who == "b":
            assert answers[(method, shape, "?")] == seen


def test_unauthenticatedRoutesShowNoTenant(gateway: Gateway) -> None:
    """
    /health, /ready and /metrics, after traffic of both organizations,
    name neither of them.
    """
    chat(gateway.port, gateway.tenants["A"])
    chat(gateway.port, gateway.tenants["B"])
    for path in ("/health", "/ready", "/metrics"):
        answer = request(gateway.port, "GET", path)
        assert answer.status == 200
        for tenant in (gateway.tenants["A"], gateway.tenants["B"]):
            assertNothingOf(tenant, answer.body.decode())


def grpcCode(call: object, request_: object, token: str) -> tuple[grpc.StatusCode, str]:
    try:
        call(request_, metadata=(("authorization", f"Bearer {token}"),), timeout=5)  # type: ignore[operator]
    except grpc.RpcError as error:
        return error.code(), error.details()
    return grpc.StatusCode.OK, ""


def test_grpcMethodsRefuseAnotherOrganizationsIDs(
    gateway: Gateway, stub: auth_pb2_grpc.AuthServiceStub
) -> None:
    """
    ValidateAgent, CreateToken and RevokeToken called with A's token on
    B's agent, org and token ids are PermissionDenied (never NotFound),
    with the same message as for made-up ids; B's token still works after
    A's attempt to revoke it.
    """
    a, b = gateway.tenants["A"], gateway.tenants["B"]
    randomID = str(uuid.uuid4())
    agentCalls = [
        auth_pb2.ValidateAgentRequest(agent_id=str(b.agentID), org_id=str(b.orgID)),
        auth_pb2.ValidateAgentRequest(agent_id=str(b.agentID), org_id=str(a.orgID)),
        auth_pb2.ValidateAgentRequest(agent_id=str(a.agentID), org_id=str(b.orgID)),
    ]
    for agentCall in agentCalls:
        code, details = grpcCode(stub.ValidateAgent, agentCall, a.token)
        assert code == grpc.StatusCode.PERMISSION_DENIED, (agentCall, code)
        assertNothingOf(b, details)
    assert grpcCode(
        stub.ValidateAgent,
        auth_pb2.ValidateAgentRequest(agent_id=str(b.agentID), org_id=str(a.orgID)),
        a.token,
    ) == grpcCode(
        stub.ValidateAgent,
        auth_pb2.ValidateAgentRequest(agent_id=randomID, org_id=str(a.orgID)),
        a.token,
    )

    create = grpcCode(
        stub.CreateToken,
        auth_pb2.CreateTokenRequest(name="x", permissions=1, agent_id=str(b.agentID)),
        a.token,
    )
    assert create[0] == grpc.StatusCode.PERMISSION_DENIED
    assert create == grpcCode(
        stub.CreateToken,
        auth_pb2.CreateTokenRequest(name="x", permissions=1, agent_id=randomID),
        a.token,
    )

    revoke = grpcCode(
        stub.RevokeToken, auth_pb2.RevokeTokenRequest(token_id=str(b.tokenID)), a.token
    )
    assert revoke[0] == grpc.StatusCode.PERMISSION_DENIED
    assert revoke == grpcCode(
        stub.RevokeToken, auth_pb2.RevokeTokenRequest(token_id=randomID), a.token
    )
    assertNothingOf(b, revoke[1] + create[1])
    assertEnvelope(chat(gateway.port, b), 501, "PROVIDER_NOT_CONFIGURED")
    assert stub.ValidateToken(auth_pb2.ValidateTokenRequest(access_token=b.token)).org_id == str(
        b.orgID
    )


def test_listTokensShowsOnlyTheCallersOrganization(
    gateway: Gateway, stub: auth_pb2_grpc.AuthServiceStub
) -> None:
    """
    ListTokens with A's token lists A's tokens only: none of B's ids,
    every entry of A's organization, and never a secret.
    """
    a, b = gateway.tenants["A"], gateway.tenants["B"]
    listing = stub.ListTokens(
        auth_pb2.ListTokensRequest(), metadata=(("authorization", f"Bearer {a.token}"),), timeout=5
    )
    assert {token.token_id for token in listing.tokens} >= {str(a.tokenID)}
    assert {token.org_id for token in listing.tokens} == {str(a.orgID)}
    text = str(listing)
    assertNothingOf(b, text)
    assert secretOf(a.token) not in text


def test_boundTokenCannotActAsAnotherAgent(
    gateway: Gateway, stub: auth_pb2_grpc.AuthServiceStub
) -> None:
    """
    A token bound to one agent, even with every permission, cannot act as
    another agent of its own organization: proxy 403 AGENT_NOT_AUTHORIZED,
    ValidateAgent PermissionDenied, CreateToken for the other agent
    PermissionDenied; a token it creates is bound to its own agent.
    """
    bound = makeTenant(gateway.owner, "bound-all", permissions=ALL_PERMISSIONS, bindAgent=True)
    other = gateway.owner.createAgent(bound.orgID, "other", "active")
    assertEnvelope(chat(gateway.port, bound), 501, "PROVIDER_NOT_CONFIGURED")
    answer = chat(gateway.port, bound, headers={"X-SVC-Agent-ID": str(other.agentID)})
    assertEnvelope(answer, 403, "AGENT_NOT_AUTHORIZED")
    answer = request(
        gateway.port,
        "GET",
        f"/v1/orgs/{bound.orgID}/auth-probe",
        {"Authorization": f"Bearer {bound.token}", "X-SVC-Agent-ID": str(other.agentID)},
    )
    assertEnvelope(answer, 403, "AGENT_NOT_AUTHORIZED")
    code, _ = grpcCode(
        stub.ValidateAgent,
        auth_pb2.ValidateAgentRequest(agent_id=str(other.agentID), org_id=str(bound.orgID)),
        bound.token,
    )
    assert code == grpc.StatusCode.PERMISSION_DENIED
    code, _ = grpcCode(
        stub.CreateToken,
        auth_pb2.CreateTokenRequest(name="y", permissions=1, agent_id=str(other.agentID)),
        bound.token,
    )
    assert code == grpc.StatusCode.PERMISSION_DENIED
    created = stub.CreateToken(
        auth_pb2.CreateTokenRequest(name="z", permissions=1),
        metadata=(("authorization", f"Bearer {bound.token}"),),
        timeout=5,
    )
    assert created.info.agent_id == str(bound.agentID)
    child = Tenant(bound.orgID, bound.agentID, created.token, uuid.UUID(created.info.token_id))
    assertEnvelope(chat(gateway.port, child), 501, "PROVIDER_NOT_CONFIGURED")
    answer = chat(gateway.port, child, headers={"X-SVC-Agent-ID": str(other.agentID)})
    assertEnvelope(answer, 403, "AGENT_NOT_AUTHORIZED")


def test_tokenOfAnotherOrganizationCannotBeUsedWithItsOwnPathOrg(gateway: Gateway) -> None:
    """
    B's own org id in the path with A's token and B's agent (everything
    pointing at B but the token): 403, the org comes from the token only.
    """
    a, b = gateway.tenants["A"], gateway.tenants["B"]
    answer = request(
        gateway.port,
        "GET",
        f"/v1/orgs/{b.orgID}/auth-probe",
        {"Authorization": f"Bearer {a.token}", "X-SVC-Agent-ID": str(b.agentID)},
    )
    assert answer.status == 403
    assertNothingOf(b, answer.body.decode())


def test_validationAnswersCarryOnlyTheCallersOwnLimits(
    gateway: Gateway, stub: auth_pb2_grpc.AuthServiceStub
) -> None:
    """
    With limits rows for B's organization and agent, A's ValidateToken
    answer carries A's own row and nothing of B's, A's ValidateAgent on
    its own agent (which has no row) carries none, and on B's agent is
    refused as before.
    """
    a, b = gateway.tenants["A"], gateway.tenants["B"]
    owner = gateway.owner
    metadata = (("authorization", f"Bearer {a.token}"),)
    owner.setLimits(b.orgID, None, {"rpm": 424242})
    owner.setLimits(b.orgID, b.agentID, {"tpm": 434343})
    mine = owner.setLimits(a.orgID, None, {"rpm": 11})
    try:

        def tokenAnswer() -> auth_pb2.ValidateTokenResponse:
            return cast(
                auth_pb2.ValidateTokenResponse,
                stub.ValidateToken(auth_pb2.ValidateTokenRequest(access_token=a.token), timeout=5),
            )

        # svc-auth hears changes in commit order: once A's row shows, B's
        # were heard too.
        waitUntil(lambda: tokenAnswer().org_limits.version == mine.version, limit=1.0)
        answer = tokenAnswer()
        assert answer.org_limits == auth_pb2.Limits(rpm=11, version=mine.version)
        agentAnswer = stub.ValidateAgent(
            auth_pb2.ValidateAgentRequest(agent_id=str(a.agentID), org_id=str(a.orgID)),
            metadata=metadata,
            timeout=5,
        )
        assert not agentAnswer.HasField("agent_limits")
        for text in (str(answer), str(agentAnswer)):
            assert "424242" not in text and "434343" not in text
            assertNothingOf(b, text)
        code, _ = grpcCode(
            stub.ValidateAgent,
            auth_pb2.ValidateAgentRequest(agent_id=str(b.agentID), org_id=str(a.orgID)),
            a.token,
        )
        assert code == grpc.StatusCode.PERMISSION_DENIED
    finally:
        owner.clearLimits(a.orgID)
        owner.clearLimits(b.orgID, b.agentID)
        owner.clearLimits(b.orgID)
