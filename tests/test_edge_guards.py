"""
The edge's guards of decisions D10 over a real loopback socket (real edge,
site and rate limiter; in-memory auth and counters), with raw request
lines so that nothing on the client side normalises what is sent:

  - one canonical spelling per route: an empty or dot segment, an escaped
    unreserved character or slash, or a broken escape is 404 NOT_FOUND in
    the envelope, counted under route "unmatched" and in the access log,
    while normal paths and query strings work as before;
  - client values on log lines are bounded: a 5,000-character method, a
    long path, a model with control characters, through the daemons' own
    JSON log observer, and the model on the chat span.

The same against the real daemons is in tests/test_faults_edge.py.
"""

from __future__ import annotations

import io
import json
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import pytest_twisted
from proxydoubles import FakeAuthClient, MemoryCounters, listeningProxy
from rawhttp import RawClient, head
from twisted.internet.endpoints import TCP4ClientEndpoint
from twisted.internet.protocol import Factory
from twisted.logger import globalLogPublisher

from svcd.common.logbounds import CUT_MARKER, MAX_LOGGED_CHARACTERS, loggedMethod, loggedText
from svcd.common.logs import JSONLinesObserver
from svcd.proxy.http.paths import RouteTable, isCanonicalPath
from svcd.proxy.service import ProxyService

PROBE = "/v1/internal/auth-probe"


class Proxy:
    """
    A listening proxy with one tenant, spoken to over raw sockets.
    """

    def __init__(self, service: ProxyService, port: int, auth: FakeAuthClient) -> None:
        self.service = service
        self.port = port
        self.auth = auth
        self.token, self.orgID, self.agentID = auth.addTenant()

    def credentials(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}", "X-SVC-Agent-ID": self.agentID}

    async def exchange(self, raw: bytes) -> tuple[int, dict[str, str], bytes]:
        """
        Send C{raw} (one request, asking to close) and read the one answer.
        """
        from twisted.internet import reactor

        endpoint = TCP4ClientEndpoint(reactor, "127.0.0.1", self.port)
        client = await endpoint.connect(Factory.forProtocol(RawClient))
        assert isinstance(client, RawClient)
        assert client.transport is not None
        client.transport.write(raw)
        await client.closed
        [answer] = client.responses()
        return answer

    async def get(
        self, target: bytes, method: bytes = b"GET", **headers: str
    ) -> tuple[int, dict[str, str], bytes]:
        lines = [method + b" " + target + b" HTTP/1.1", b"Host: proxy.test", b"Connection: close"]
        lines += [f"{name}: {value}".encode("latin-1") for name, value in headers.items()]
        return await self.exchange(b"\r\n".join(lines) + b"\r\n\r\n")


@pytest_twisted.async_yield_fixture
async def proxy() -> AsyncIterator[Proxy]:
    from twisted.internet import reactor

    auth = FakeAuthClient()
    service, port = await listeningProxy(reactor, auth, MemoryCounters(), 1024 * 1024)
    try:
        yield Proxy(service, port, auth)
    finally:
        await service.stopService()


class CapturedLines:
    """
    What the daemons' JSON observer writes, parsed.
    """

    def __init__(self) -> None:
        self.output = io.StringIO()
        self.observer = JSONLinesObserver(self.output)

    def lines(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.output.getvalue().splitlines()]

    def access(self) -> list[dict[str, Any]]:
        return [line for line in self.lines() if "route" in line and "status" in line]


@pytest.fixture
def captured() -> Iterator[CapturedLines]:
    lines = CapturedLines()
    globalLogPublisher.addObserver(lines.observer)
    try:
        yield lines
    finally:
        globalLogPublisher.removeObserver(lines.observer)


def envelopeCode(body: bytes) -> str:
    return str(json.loads(body)["error"]["code"])


# One canonical path per route

ORG = "0b5a8e3c-6f1d-4a2b-9c3d-4e5f6a7b8c9d"

NOT_CANONICAL = [
    b"//v1/internal/auth-probe",
    b"/v1//internal/auth-probe",
    b"/v1/internal//auth-probe",
    b"/v1/internal/auth-probe/",
    b"/v1/internal/auth%2Dprobe",
    b"/v1/internal/auth%2dprobe",
    b"/%761/internal/auth-probe",
    b"/v1/internal/%61uth-probe",
    b"/v1/internal/auth-probe%7E",
    b"/v1%2Finternal%2Fauth-probe",
    b"/v1/internal%2fauth-probe",
    b"/v1/./internal/auth-probe",
    b"/v1/x/../internal/auth-probe",
    b"/v1/internal/auth-probe/.",
    b"/v1/internal/%2E/auth-probe",
    b"/v1/internal/auth-probe%",
    b"/v1/internal/auth-probe%2",
    b"/v1/internal/auth-probe%zz",
    b"/v1/orgs/" + ORG.replace("-", "%2D", 1).encode() + b"/auth-probe",
    b"//v1/orgs/" + ORG.encode() + b"/auth-probe",
    b"//health",
    b"/%68ealth",
    b"/health/",
    b"///ready",
]


@pytest.mark.parametrize("target", NOT_CANONICAL, ids=lambda target: target.decode())
@pytest_twisted.ensureDeferred
async def test_otherSpellingsAreNotFound(
    proxy: Proxy, captured: CapturedLines, target: bytes
) -> None:
    """
    Another spelling of a route, with credentials that the route itself
    accepts, is 404 NOT_FOUND in the envelope, without a call to
    svc-auth; the access line says route "unmatched" and the path as sent.
    """
    credentials = proxy.credentials()
    if b"orgs" in target:
        token, _, agentID = proxy.auth.addTenant(orgID=ORG)
        credentials = {"Authorization": f"Bearer {token}", "X-SVC-Agent-ID": agentID}
    status, headers, body = await proxy.get(target, b"GET", **credentials)
    assert (status, envelopeCode(body)) == (404, "NOT_FOUND")
    assert json.loads(body)["error"]["request_id"] == headers["x-request-id"]
    assert proxy.auth.calls == []
    [access] = captured.access()
    assert (access["route"], access["status"], access["path"]) == (
        "unmatched",
        404,
        target.decode(),
    )


@pytest_twisted.ensureDeferred
async def test_canonicalPathsStillAnswer(proxy: Proxy) -> None:
    """
    The canonical spellings answer as before, with or without a query
    string (which is not looked at, escapes and all); an escape of a
    reserved character is still decoded and judged by the route (an org
    id that is not a UUID: 400 VALIDATION_ERROR).
    """
    credentials = proxy.credentials()
    for target in (
        PROBE.encode(),
        PROBE.encode() + b"?x=1&y=%2D//./..",
        b"/v1/orgs/" + proxy.orgID.encode() + b"/auth-probe",
    ):
        status, _, body = await proxy.get(target, b"GET", **credentials)
        assert status == 200, (target, body)
        assert json.loads(body)["org_id"] == proxy.orgID
    for target in (b"/health", b"/health?probe=1", b"/ready", b"/metrics?"):
        status, _, _ = await proxy.get(target)
        assert status == 200, target
    status, _, body = await proxy.get(b"/v1/orgs/%3A/auth-probe", b"GET", **credentials)
    assert (status, envelopeCode(body)) == (400, "VALIDATION_ERROR")
    status, _, body = await proxy.get(b"/v2/unknown")
    assert (status, envelopeCode(body)) == (404, "NOT_FOUND")


@pytest_twisted.ensureDeferred
async def test_refusedSpellingsCountedUnmatched(proxy: Proxy) -> None:
    """
    The 404s of other spellings are counted under route "unmatched",
    never under the route they spell nor their raw path.
    """
    for target in (b"//health", b"/%68ealth", b"/v1/internal/auth%2Dprobe"):
        await proxy.get(target)
    _, _, metrics = await proxy.get(b"/metrics")
    text = metrics.decode()
    assert 'svc_proxy_requests_total{code="404",method="GET",route="unmatched"} 3.0' in text
    assert "%2D" not in text and "%68" not in text
    assert 'route="/health"' not in text


def test_isCanonicalPath() -> None:
    """
    The rule by itself: the forms above are refused; escapes of reserved
    characters, and names with dots that are not dot segments, are not.
    """
    for target in NOT_CANONICAL:
        assert not isCanonicalPath(target), target
    for path in (b"", b"*", b"http://x/health", b"/", b"/a/%2F"):
        assert not isCanonicalPath(path), path
    for path in (
        b"/health",
        b"/v1/orgs/%3A/auth-probe",
        b"/v1/orgs/%20%25%00/auth-probe",
        b"/.well-known/x",
        b"/a/..b/c.d/...",
        b"/a%5Cb",
    ):
        assert isCanonicalPath(path), path


def test_routeTable() -> None:
    """
    A canonical path finds its route: a template without variables by the
    raw path, one with a variable by its other segments, the variable
    percent-decoded; a variable that is not UTF-8 once decoded raises, and
    every other path finds none.
    """
    table = RouteTable(
        [
            ("/health", "health"),
            ("/v1/orgs/{org_id}/auth-probe", "org-probe"),
            ("/v1/{name}/x/{other}", "two"),
        ]
    )
    assert table.routeOf(b"/health") == ("health", {})
    assert table.routeOf(b"/v1/orgs/abc/auth-probe") == ("org-probe", {"org_id": "abc"})
    assert table.routeOf(b"/v1/orgs/%3A%20%C3%A9/auth-probe") == (
        "org-probe",
        {"org_id": ": \u00e9"},
    )
    assert table.routeOf(b"/v1/a/x/b") == ("two", {"name": "a", "other": "b"})
    for path in (b"/healthz", b"/v1/orgs/abc/auth-probe/x", b"/v1/orgs/abc/probe", b"/v1/a/y/b"):
        assert table.routeOf(path) is None, path
    with pytest.raises(UnicodeDecodeError):
        table.routeOf(b"/v1/orgs/%FF/auth-probe")
    for template in ("health", "/a//b", "/a/"):
        with pytest.raises(ValueError, match="not a path template"):
            RouteTable([(template, "x")])


@pytest_twisted.ensureDeferred
async def test_variableNotUTF8IsNotFound(proxy: Proxy) -> None:
    """
    An org id whose escapes do not decode to UTF-8 is an unknown path:
    404 NOT_FOUND, without a call to svc-auth.
    """
    status, _, body = await proxy.get(b"/v1/orgs/%FF/auth-probe", b"GET", **proxy.credentials())
    assert (status, envelopeCode(body)) == (404, "NOT_FOUND")
    assert proxy.auth.calls == []


# Bounded log lines


@pytest_twisted.ensureDeferred
async def test_longMethodIsLoggedAsOther(proxy: Proxy, captured: CapturedLines) -> None:
    """
    A 5,000-character method is answered (405) and logged as OTHER; a
    token method of 16 characters is logged as received, one of 17 as
    OTHER. (A method that is not a token never gets this far: Twisted
    refuses its request line.)
    """
    for method in (b"X" * 5000, b"PROPFINDPROPFIND", b"PROPFINDPROPFINDX"):
        status, _, body = await proxy.get(b"/health", method=method)
        assert (status, envelopeCode(body)) == (405, "METHOD_NOT_ALLOWED")
    methods = [line["method"] for line in captured.access()]
    assert methods == ["OTHER", "PROPFINDPROPFIND", "OTHER"]
    assert captured.access()[0]["message"] == "OTHER /health 405"
    assert "X" * 100 not in captured.output.getvalue()


@pytest_twisted.ensureDeferred
async def test_longPathIsCut(proxy: Proxy, captured: CapturedLines) -> None:
    """
    A 5,000-character path is logged as its first 256 characters and the
    cut marker; a control byte in a path (DEL: Twisted refuses the others
    in a request line) is escaped.
    """
    await proxy.get(b"/" + b"p" * 4999)
    await proxy.get(b"/a\x7fb")
    first, second = captured.access()
    assert first["path"] == "/" + "p" * (MAX_LOGGED_CHARACTERS - 1) + CUT_MARKER
    assert second["path"] == "/a\\x7fb"
    assert "p" * 300 not in captured.output.getvalue()


@pytest_twisted.ensureDeferred
async def test_chatModelIsBoundedInTheChatLine(proxy: Proxy, captured: CapturedLines) -> None:
    """
    The chat line's model, the one client value in it, is bounded too: a
    model of the 256 characters the body allows, holding a newline and an
    escape sequence, is logged with them escaped and cut at 256.
    """
    model = "m\n\x1b[2J" + "x" * 250
    assert len(model) == 256
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}]})
    raw = head(
        "POST",
        "/v1/chat/completions",
        {
            **proxy.credentials(),
            "Content-Type": "application/json",
            "Content-Length": str(len(body)),
            "Connection": "close",
        },
    )
    status, _, _ = await proxy.exchange(raw + body.encode())
    assert status == 501
    [chatLine] = [line for line in captured.lines() if "model" in line]
    assert chatLine["model"] == loggedText(model)
    assert chatLine["model"].startswith("m\\x0a\\x1b[2Jxxx")
    assert chatLine["model"].endswith(CUT_MARKER)
    assert len(chatLine["model"]) == MAX_LOGGED_CHARACTERS + len(CUT_MARKER)


@pytest_twisted.ensureDeferred
async def test_chatSpanModelIsBounded() -> None:
    """
    The model on the chat span goes through the same bound as the log
    line.
    """
    from tracinghelpers import Traced, chatHeaders

    traced = Traced()
    token, _, agentID = traced.auth.addTenant()
    model = "\x07" * 256
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}]})
    response = await traced.request(
        "POST", "/v1/chat/completions", chatHeaders(token, agentID), body.encode()
    )
    assert response.code == 501
    [span] = traced.spans()
    assert dict(span.attributes or {})["gen_ai.request.model"] == loggedText(model)
    assert loggedText(model) == "\\x07" * 64 + CUT_MARKER


def test_loggedValues() -> None:
    """
    The bound by itself: short values unchanged; 256 characters kept
    whole; longer ones cut with the marker; methods as OTHER unless short
    tokens.
    """
    assert loggedText("gpt-4o") == "gpt-4o"
    assert loggedText("é" * 256) == "é" * 256
    assert loggedText("é" * 257) == "é" * 256 + CUT_MARKER
    assert loggedText("a\tb\x7f\x85") == "a\\x09b\\x7f\\x85"
    assert loggedMethod("GET") == "GET"
    assert loggedMethod("M-SEARCH") == "M-SEARCH"
    for method in ("", "G T", "GET\n", "X" * 17, "ÉTÉ", str(uuid.uuid4())):
        assert loggedMethod(method) == "OTHER", method
