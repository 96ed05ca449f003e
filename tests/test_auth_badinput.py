"""
Bad input to svc-auth's gRPC methods gets a clear answer (decisions D10):
INVALID_ARGUMENT naming the field, or the spec's status for that field
(UNAUTHENTICATED for a malformed token), never INTERNAL, never a line
above info in the log and never a database outage that did not happen.

Requests are sent as raw protobuf bytes, so that a string field can carry
what no well-behaved client sends: bytes that are not UTF-8, a lone
surrogate (ED A0 80), NUL, a hundred thousand characters; integers cover
their whole int64 range.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from typing import Any, cast

import attrs
import grpc
import pytest
from authfixtures import Tenant, makeTenant, ownerStore
from authservice import RunningAuthService
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from twisted.logger import ILogObserver, LogLevel, globalLogPublisher

from svcd.auth.store import Store
from svcd.common.migrations import migrate
from svcd.common.permissions import Permission
from svcd.common.pgtransactions import StoreValueRefused
from svcd.devkit.postgres import PostgresServer

SERVICE = "/svc.auth.v1.AuthService/"
ALL_PERMISSIONS = int(
    Permission.ProxyChatCompletion
    | Permission.TokenCreate
    | Permission.TokenRevoke
    | Permission.TokenList
)
NOT_UTF8 = [b"\xff", b"a\xc0\x80b", b"\xed\xa0\x80", b"ok\xed\xb0\x80", b"\xf4\x90\x80\x80"]
INT64 = st.integers(-(2**63), 2**63 - 1)


def varint(value: int) -> bytes:
    value &= 2**64 - 1
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def message(*fields: tuple[int, bytes | int]) -> bytes:
    """
    The wire format of a message with these (field number, value) pairs:
    bytes as a length-delimited field, an int as a varint.
    """
    out = b""
    for number, value in fields:
        if isinstance(value, int):
            out += varint(number << 3) + varint(value)
        else:
            out += varint(number << 3 | 2) + varint(len(value)) + value
    return out


@attrs.define
class Watched:
    """
    A running AuthService for the whole module, with what was logged above
    info (twisted.logger events and records of Python's logging, where
    grpcio logs) since the last L{quiet}.
    """

    service: RunningAuthService
    admin: Tenant
    owner: Store
    loud: list[str] = attrs.field(factory=list)

    def call(self, method: str, raw: bytes, bearer: str | None = None) -> tuple[Any, str]:
        metadata = () if bearer is None else (("authorization", bearer),)
        call = self.service.channel.unary_unary(SERVICE + method)
        try:
            call(raw, metadata=metadata, timeout=10)
        except grpc.RpcError as error:
            return error.code(), error.details() or ""
        return grpc.StatusCode.OK, ""

    def quiet(self) -> None:
        loud, self.loud[:] = list(self.loud), []
        assert loud == []


class _Recorder(logging.Handler):
    def __init__(self, sink: list[str]) -> None:
        super().__init__(logging.WARNING)
        self._sink = sink

    def emit(self, record: logging.LogRecord) -> None:
        self._sink.append(f"logging {record.levelname}: {record.getMessage()}")


@pytest.fixture(scope="module")
def watched(postgresServer: PostgresServer) -> Iterator[Watched]:
    loud: list[str] = []

    def observe(event: dict[str, Any]) -> None:
        if event.get("log_level", LogLevel.info) > LogLevel.info:
            loud.append(f"twisted {event['log_level'].name}: {event.get('log_format')}")

    recorder = _Recorder(loud)
    logging.getLogger().addHandler(recorder)
    globalLogPublisher.addObserver(cast(ILogObserver, observe))
    with postgresServer.temporaryDatabase() as dsn:
        migrate(dsn)
        owner, connection = ownerStore(dsn)
        service = RunningAuthService(dsn).start()
        try:
            admin = makeTenant(owner, "admin", permissions=ALL_PERMISSIONS)
            yield Watched(service, admin, owner, loud)
        finally:
            service.stop()
            connection.close()
            globalLogPublisher.removeObserver(cast(ILogObserver, observe))
            logging.getLogger().removeHandler(recorder)


@pytest.fixture(autouse=True)
def fromSilence(watched: Watched) -> None:
    """
    Each test starts with nothing logged, whatever a test before it left.
    """
    watched.loud.clear()


def names(details: str, *fields: str) -> bool:
    """
    Does an INVALID_ARGUMENT message begin with one of the field names?
    """
    return details.split(" ", 1)[0] in fields


def stringValues(*known: str) -> st.SearchStrategy[bytes]:
    """
    What a string field may carry on the wire: any text (lone surrogates
    included, sent as the invalid UTF-8 they encode to), any bytes, and the
    cases D10 names, around the C{known} good values.
    """
    goodAndNear = [value.encode() for value in known] + [
        (value + "\x00").encode() for value in known
    ]
    return st.one_of(
        st.text(st.characters(exclude_categories=()), max_size=300).map(
            lambda text: text.encode("utf-8", "surrogatepass")
        ),
        st.binary(max_size=64),
        st.sampled_from(
            [
                b"",
                b"\x00",
                b"a\x00b",
                b"x" * 201,
                "é".encode() * 200,
                b"y" * 100_000,
                *NOT_UTF8,
                *goodAndNear,
            ]
        ),
    )


SETTINGS = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@SETTINGS
@given(token=stringValues("svc_pat_" + str(uuid.uuid4()) + "_" + "a" * 43))
def test_validateTokenAnswersAnyAccessTokenUnauthenticated(watched: Watched, token: bytes) -> None:
    """
    Whatever access_token holds, a token that is not valid is
    Unauthenticated (spec 4.3), bytes that are not UTF-8 included.
    """
    code, _ = watched.call("ValidateToken", message((1, token)))
    assert code == grpc.StatusCode.UNAUTHENTICATED
    watched.quiet()


@SETTINGS
@given(data=st.data())
def test_validateAgentNamesTheBadField(watched: Watched, data: st.DataObject) -> None:
    """
    ValidateAgent with any agent_id and org_id answers OK, PermissionDenied
    or InvalidArgument naming agent_id or org_id.
    """
    admin = watched.admin
    agentID = data.draw(stringValues(str(admin.agentID), str(uuid.uuid4())), "agent_id")
    orgID = data.draw(stringValues(str(admin.orgID), str(uuid.uuid4())), "org_id")
    code, details = watched.call(
        "ValidateAgent", message((1, agentID), (2, orgID)), f"Bearer {admin.token}"
    )
    assert code in {
        grpc.StatusCode.OK,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.INVALID_ARGUMENT,
    }, (code, details)
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        assert names(details, "agent_id", "org_id"), details
    watched.quiet()


@SETTINGS
@given(data=st.data())
def test_createTokenNamesTheBadField(watched: Watched, data: st.DataObject) -> None:
    """
    CreateToken with any name, permissions, agent_id and lifetime answers
    OK, PermissionDenied (a bit the caller lacks) or InvalidArgument naming
    the field: a lifetime past the year 9999 or negative, a name with NUL,
    over 200 characters or not UTF-8, an agent_id that is not a UUID.
    """
    admin = watched.admin
    name = data.draw(stringValues("ci", "x" * 200), "name")
    permissions = data.draw(st.one_of(st.sampled_from([0, 1, ALL_PERMISSIONS]), INT64))
    agentID = data.draw(stringValues("", str(admin.agentID), str(uuid.uuid4())), "agent_id")
    lifetime = data.draw(
        st.one_of(st.sampled_from([0, 1, 3600, 2**31, 2**62, 2**63 - 1, -1, -(2**63)]), INT64),
        "expires_in_seconds",
    )
    code, details = watched.call(
        "CreateToken",
        message((1, name), (2, permissions), (3, agentID), (4, lifetime)),
        f"Bearer {admin.token}",
    )
    assert code in {
        grpc.StatusCode.OK,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.INVALID_ARGUMENT,
    }, (code, details)
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        assert names(details, "name", "agent_id", "expires_in_seconds"), details
    watched.quiet()


@SETTINGS
@given(tokenID=stringValues(str(uuid.uuid4())))
def test_revokeTokenNamesTheBadField(watched: Watched, tokenID: bytes) -> None:
    """
    RevokeToken with any token_id answers PermissionDenied (no token of
    the caller's organization) or InvalidArgument naming token_id.
    """
    code, details = watched.call(
        "RevokeToken", message((1, tokenID)), f"Bearer {watched.admin.token}"
    )
    assert code in {grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.INVALID_ARGUMENT}
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        assert names(details, "token_id"), details
    watched.quiet()


@SETTINGS
@given(raw=st.binary(max_size=200))
def test_anyBytesAreAnsweredWithoutInternal(watched: Watched, raw: bytes) -> None:
    """
    Any bytes at all as the request of any method (unknown fields, broken
    wire format, wrong wire types) are answered with a status of the
    method's contract, never INTERNAL.
    """
    for method in ("ValidateToken", "ValidateAgent", "CreateToken", "RevokeToken", "ListTokens"):
        code, details = watched.call(method, raw, f"Bearer {watched.admin.token}")
        assert code in {
            grpc.StatusCode.OK,
            grpc.StatusCode.UNAUTHENTICATED,
            grpc.StatusCode.PERMISSION_DENIED,
            grpc.StatusCode.INVALID_ARGUMENT,
        }, (method, code, details)
    watched.quiet()


@SETTINGS
@given(
    value=st.one_of(
        st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=200),
        st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=80).map(
            lambda text: "Bearer " + text
        ),
        st.sampled_from(
            ["", "Bearer", "Bearer ", "bearer  x", "Basic abc", "Bearer " + "a" * 7000]
        ),
    )
)
def test_anyAuthorizationIsUnauthenticated(watched: Watched, value: str) -> None:
    """
    Every method that needs a caller answers any authorization metadata
    that is not a valid bearer Unauthenticated (what grpcio lets through:
    printable ASCII).
    """
    requests = {
        "ValidateAgent": message((1, str(uuid.uuid4()).encode()), (2, str(uuid.uuid4()).encode())),
        "CreateToken": message((2, 1)),
        "RevokeToken": message((1, str(uuid.uuid4()).encode())),
        "ListTokens": b"",
    }
    for method, raw in requests.items():
        code, _ = watched.call(method, raw, value)
        assert code == grpc.StatusCode.UNAUTHENTICATED, (method, value)
    watched.quiet()


def test_oversizedMetadataIsRefusedByGrpcio(watched: Watched) -> None:
    """
    Metadata past grpcio's limits (8 KiB, refused with a rising chance up
    to 16 KiB, always past it) is refused by grpcio itself with
    RESOURCE_EXHAUSTED, before any of our code: a clear answer, no log.
    """
    for size in (12_000, 20_000, 100_000):
        code, _ = watched.call("ListTokens", b"", "Bearer " + "a" * size)
        assert code in {grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.RESOURCE_EXHAUSTED}
    code, _ = watched.call("ListTokens", b"", "Bearer " + "a" * 20_000)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    watched.quiet()


# The two cases the issue found, and the store's second line of defence.


def test_aLifetimePastTheYear9999IsInvalidArgument(watched: Watched) -> None:
    """
    CreateToken with expires_in_seconds = 2**62 answered INTERNAL and
    logged a critical traceback: it is InvalidArgument naming the field;
    the last second of 9999 is still accepted.
    """
    request = message((2, 1), (4, 2**62))
    code, details = watched.call("CreateToken", request, f"Bearer {watched.admin.token}")
    assert (code, details) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "expires_in_seconds ends after the year 9999",
    )
    watched.quiet()


def test_aNulInANameIsInvalidArgumentNotAnOutage(watched: Watched) -> None:
    """
    A NUL byte in a token name answered INTERNAL "database unavailable"
    and logged a database outage: it is InvalidArgument naming the field,
    logged nowhere above info.
    """
    request = message((1, b"ci\x00"), (2, 1))
    code, details = watched.call("CreateToken", request, f"Bearer {watched.admin.token}")
    assert (code, details) == (grpc.StatusCode.INVALID_ARGUMENT, "name contains a NUL character")
    watched.quiet()


@pytest.mark.parametrize("badBytes", NOT_UTF8)
def test_bytesThatAreNotUTF8AreNamedWithoutATraceback(watched: Watched, badBytes: bytes) -> None:
    """
    A string field holding bytes that are not UTF-8 (protobuf cannot parse
    the request at all; grpcio answered INTERNAL "Exception deserializing
    request!" and logged a traceback) is InvalidArgument naming the field;
    in ValidateToken's access_token it is a malformed token.
    """
    bearer = f"Bearer {watched.admin.token}"
    answers = [
        watched.call(
            "ValidateAgent", message((1, str(uuid.uuid4()).encode()), (2, badBytes)), bearer
        ),
        watched.call("CreateToken", message((1, badBytes), (2, 1)), bearer),
        watched.call("RevokeToken", message((1, badBytes)), bearer),
        watched.call("ValidateToken", message((1, badBytes))),
    ]
    assert answers == [
        (grpc.StatusCode.INVALID_ARGUMENT, "org_id is not valid UTF-8"),
        (grpc.StatusCode.INVALID_ARGUMENT, "name is not valid UTF-8"),
        (grpc.StatusCode.INVALID_ARGUMENT, "token_id is not valid UTF-8"),
        (grpc.StatusCode.UNAUTHENTICATED, "malformed token"),
    ]
    watched.quiet()


def test_refusedCallsAreCountedAsInvalidArgument(watched: Watched) -> None:
    """
    A request that cannot be parsed is counted in
    svc_auth_grpc_requests_total under its method and INVALID_ARGUMENT.
    """
    registry = watched.service.registry
    labels = {"method": "RevokeToken", "code": "INVALID_ARGUMENT"}
    before = registry.get_sample_value("svc_auth_grpc_requests_total", labels) or 0
    watched.call("RevokeToken", message((1, b"\xff")), f"Bearer {watched.admin.token}")
    assert registry.get_sample_value("svc_auth_grpc_requests_total", labels) == before + 1


@pytest.mark.parametrize(
    "name", ["nul\x00inside", "lone \ud800 surrogate"], ids=["nul", "surrogate"]
)
def test_theStoreRefusesAValueItCannotHoldAsTheCallersMistake(watched: Watched, name: str) -> None:
    """
    Past the checks above, a value PostgreSQL cannot hold (NUL in text, a
    lone surrogate) is StoreValueRefused, the caller's mistake, not
    StoreUnavailable, and the pool's connection stays usable.
    """
    store = watched.service.store
    with pytest.raises(StoreValueRefused):
        store.createToken(
            tokenID=uuid.uuid4(),
            orgID=watched.admin.orgID,
            secretHash="x",
            permissions=1,
            name=name,
        )
    assert store.organizationExists(watched.admin.orgID)


def test_everyMethodIsRegisteredWithItsShape(watched: Watched) -> None:
    """
    The handlers svc-auth registers itself (to parse requests itself) are
    one per method of the .proto, each streaming exactly as declared, and
    taking bytes.
    """
    from prometheus_client import CollectorRegistry

    from svcd.auth.grpcservice import AuthMetrics, AuthServicer
    from svcd.pb.auth.v1 import auth_pb2

    servicer = AuthServicer(watched.service.authority, AuthMetrics(CollectorRegistry()))
    handlers = servicer.handlers()
    methods = auth_pb2.DESCRIPTOR.services_by_name["AuthService"].methods
    assert sorted(handlers) == sorted(method.name for method in methods)
    for method in methods:
        handler = handlers[method.name]
        assert handler.request_deserializer is None
        assert (handler.request_streaming, handler.response_streaming) == (
            method.client_streaming,
            method.server_streaming,
        )
