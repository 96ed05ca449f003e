"""
Hostile requests against the real daemons (twistd svc-proxy and svc-auth,
PostgreSQL, Redis): invalid UTF-8 and deeply nested JSON in chat bodies,
bytes that are not UTF-8 or not ASCII in every header the proxy reads,
oversized headers, and bodies that lie about their length. Each gets a
4xx envelope (or the answer a well-formed request would get) or a closed
connection; never a 500, never a connection left hanging.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from http import HTTPStatus

import pytest
from gatewayfixtures import (
    PATIENT_AUTH,
    Gateway,
    assertCommonHeaders,
    assertEnvelope,
    chat,
    unlimitedGateway,
)
from rawhttp import exchange, parsed, rawChat

from svcd.devkit.postgres import PostgresServer

# Starts real daemons or processes (conftest.py, pytest.ini): left out of a
# quick run, dev/test -m "not e2e".
pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def gateway(
    postgresServer: PostgresServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Gateway]:
    with unlimitedGateway(
        postgresServer, tmp_path_factory.mktemp("hostile"), **PATIENT_AUTH
    ) as running:
        yield running


@pytest.mark.parametrize(
    "body",
    [
        b'{"model": "m\xff", "messages": [{"role": "user", "content": "x"}]}',
        b'{"model": "m", "messages": [{"role": "user", "content": "\xed\xa0\x80"}]}',
        b"\xef\xbb\xbf" + b'{"model": "m"}',
        b"\x00" * 100,
        b"[" * 100_000,
        b"[" * 100_000 + b"]" * 100_000,
        b'{"model": "m", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        b'{"a":' * 100_000 + b"1" + b"}" * 100_000,
    ],
    ids=[
        "bad-utf8",
        "surrogate-utf8",
        "bom",
        "nul",
        "open",
        "nested",
        "nested-messages",
        "objects",
    ],
)
def test_hostileBodiesAreInvalidJSON(gateway: Gateway, body: bytes) -> None:
    """
    Invalid UTF-8 and 100,000-deep nesting through the real proxy: 400
    INVALID_JSON with the envelope and its headers, never a 500.
    """
    answer = chat(gateway.port, gateway.tenants["main"], body=body)
    assertEnvelope(answer, 400, "INVALID_JSON")


@pytest.mark.parametrize(
    ("header", "value", "status", "code"),
    [
        ("Authorization", b"Bearer svc_pat_\xff\xfe", 401, "INVALID_TOKEN"),
        ("Authorization", b"Bearer " + "svc_pat_\u0661".encode() + b"x" * 70, 401, "INVALID_TOKEN"),
        ("Authorization", b"\xff", 401, "INVALID_TOKEN"),
        ("X-SVC-Agent-ID", b"\xff" * 36, 400, "VALIDATION_ERROR"),
        ("X-SVC-Agent-ID", "\u0661".encode() * 18, 400, "VALIDATION_ERROR"),
        ("Content-Type", b"application/json\xff", 415, "UNSUPPORTED_MEDIA_TYPE"),
        ("X-Request-ID", b"\xff" * 36, 501, "PROVIDER_NOT_CONFIGURED"),
        ("traceparent", b"00-\xff" + b"a" * 50, 501, "PROVIDER_NOT_CONFIGURED"),
    ],
)
def test_headersThatAreNotUTF8(
    gateway: Gateway, header: str, value: bytes, status: int, code: str
) -> None:
    """
    Bytes that are not UTF-8 (or digits that are not ASCII) in each header
    the proxy reads: the answer a malformed value of that header gets, or
    the ordinary answer for headers that are only ever informative.
    """
    body = b'{"model": "m", "messages": [{"role": "user", "content": "x"}]}'
    raw, _ = exchange(gateway.port, rawChat(gateway, body, **{header: value}))
    answer = parsed(raw)
    assertEnvelope(answer, status, code)


def test_headerValuesAreNeverEchoed(gateway: Gateway) -> None:
    """
    A hostile request id or trace header never comes back: the proxy
    answers with ids of its own.
    """
    body = b'{"model": "m", "messages": [{"role": "user", "content": "x"}]}'
    raw, _ = exchange(
        gateway.port,
        rawChat(
            gateway,
            body,
            **{"X-Request-ID": b"<script>" + b"a" * 28, "traceparent": b"00-<script>"},
        ),
    )
    assert b"<script>" not in raw
    assertCommonHeaders(parsed(raw))


@pytest.mark.parametrize(
    ("attack", "status", "reason"),
    [
        (
            b"GET /health HTTP/1.1\r\nHost: g\r\nX-Big: " + b"a" * 20_000 + b"\r\n\r\n",
            431,
            "headers_too_large",
        ),
        (
            b"GET /health HTTP/1.1\r\nHost: g\r\n"
            + b"".join(b"X-%d: %s\r\n" % (n, b"a" * 100) for n in range(200))
            + b"\r\n",
            431,
            "headers_too_large",
        ),
        (
            b"GET /health HTTP/1.1\r\nHost: g\r\n"
            + b"".join(b"X-%d: a\r\n" % n for n in range(600))
            + b"\r\n",
            431,
            "too_many_headers",
        ),
        (
            b"GET /" + b"a" * 20_000 + b" HTTP/1.1\r\nHost: g\r\n\r\n",
            414,
            "request_line_too_long",
        ),
        (b"GET /health HTTP/1.1\r\nHost: g\r\nX-Nul: a\x00b\r\n\r\n", 400, "bad_header"),
        (b"GET /health HTTP/1.1\r\nHost: g\r\nBad Name: a\r\n\r\n", 400, "bad_header"),
        (b"GET /health HTTP/1.1\r\nHost: g\r\n\xff: a\r\n\r\n", 400, "bad_header"),
        (b"GET /health HTTP/9.9\r\nHost: g\r\n\r\n", 400, "bad_request_line"),
    ],
    ids=[
        "long-line",
        "headers-16k",
        "600-headers",
        "long-path",
        "nul",
        "space-in-name",
        "binary-name",
        "bad-version",
    ],
)
def test_malformedRequestsAreAnsweredAndCounted(
    gateway: Gateway, attack: bytes, status: int, reason: str
) -> None:
    """
    Oversized or malformed request heads are refused before any route
    (decisions D10): 414, 431 or 400 with its reason phrase, then a closed
    connection; never a 5xx, never a hang; counted in
    svc_proxy_protocol_errors_total under their reason. (A head that never
    ends, such as a TLS hello sent to the plaintext port, is cut off by the
    30 s request deadline; see test_hostile_http.py.)
    """
    before = protocolErrors(gateway, reason)
    raw, took = exchange(gateway.port, attack)
    assert took < 5
    expected = f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\n".encode()
    assert raw.startswith(expected), raw[:100]
    assert parsed(raw).headers["connection"] == "close"
    assert protocolErrors(gateway, reason) == before + 1


def protocolErrors(gateway: Gateway, reason: str) -> float:
    _, page = gateway.proxy.get("/metrics")
    pattern = rf'^svc_proxy_protocol_errors_total\{{reason="{reason}"\}} (\S+)$'
    match = re.search(pattern, page.decode(), re.MULTILINE)
    assert match is not None, f"no series for {reason}"
    return float(match.group(1))


def test_lyingContentLengths(gateway: Gateway) -> None:
    """
    A body longer than its Content-Length does not smuggle the bytes after
    it as a second request: one answer, then the connection is closed.
    Conflicting or malformed lengths are a bare 400 and a close.
    """
    tenant = gateway.tenants["main"]
    body = b'{"model": "m", "messages": [{"role": "user", "content": "x"}]}'
    smuggled = (
        b"GET /v1/internal/auth-probe HTTP/1.1\r\nHost: g\r\n"
        + f"Authorization: Bearer {tenant.token}\r\n".encode()
        + f"X-SVC-Agent-ID: {tenant.agentID}\r\n\r\n".encode()
    )
    request = rawChat(gateway, body).replace(b"Connection: close\r\n", b"")
    raw, _ = exchange(gateway.port, request + smuggled)
    assert raw.count(b"HTTP/1.1 ") == 1, raw
    answer = parsed(raw)
    assertEnvelope(answer, 501, "PROVIDER_NOT_CONFIGURED")
    assert answer.headers["connection"] == "close"
    assert b'"org_id"' not in raw
    for lengths in (b"5, 5", b"-1", b"0x10", b"1e3"):
        raw, _ = exchange(gateway.port, rawChat(gateway, body, Content_Length=lengths))
        assert raw.startswith(b"HTTP/1.1 400"), (lengths, raw[:100])
