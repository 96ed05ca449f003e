"""
Raw HTTP against svc-proxy's edge: a client that writes bytes as given and
reads the answer as sent (L{RawClient}, L{head}), an edge on a loopback port
(L{Harness}), the gateway's answers to hand-made requests (L{rawChat},
L{exchange}, L{parsed}) and the hostile bodies and values of the parser
tests.

Moved here from test_hostile_http, test_hostile_gateway and
test_hostile_parsers so that the modules that share them import a library
rather than another test module.
"""

from __future__ import annotations

import json
import socket
import time
from typing import Any

import pytest
from gatewayfixtures import (
    Answer,
    Gateway,
)
from hypothesis import strategies as st
from proxydoubles import FakeAuthClient
from twisted.internet.defer import Deferred
from twisted.internet.endpoints import TCP4ClientEndpoint
from twisted.internet.error import ConnectionDone
from twisted.internet.protocol import Factory, Protocol
from twisted.internet.task import deferLater
from twisted.python.failure import Failure

from svcd.common.errors import ApiError
from svcd.proxy.http.chatbody import MAX_CONTENT_BYTES, MAX_MESSAGES, ROLES, parseChatBody
from svcd.proxy.service import ProxyService

CHAT = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()


class RawClient(Protocol):
    """
    Sends what it is told and keeps everything the server writes; C{closed}
    fires when the connection ends, and C{reason} says how.
    """

    def __init__(self) -> None:
        self.received = b""
        self.closed: Deferred[None] = Deferred()
        self.closedAt: float | None = None
        self.reason: Failure | None = None

    def dataReceived(self, data: bytes) -> None:
        self.received += data

    def connectionLost(self, reason: Failure = Failure(ConnectionDone())) -> None:  # noqa: B008
        self.closedAt = time.monotonic()
        self.reason = reason
        self.closed.callback(None)

    def responses(self) -> list[tuple[int, dict[str, str], bytes]]:
        """
        The responses received, each framed by its Content-Length.
        """
        found = []
        rest = self.received
        while rest:
            head, separator, rest = rest.partition(b"\r\n\r\n")
            assert separator, f"a truncated response: {head!r}"
            lines = head.decode("latin-1").split("\r\n")
            headers = {}
            for line in lines[1:]:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
            length = int(headers.get("content-length", "0"))
            body, rest = rest[:length], rest[length:]
            found.append((int(lines[0].split()[1]), headers, body))
        return found


class Harness:
    def __init__(self, service: ProxyService, port: int, auth: FakeAuthClient) -> None:
        self.service = service
        self.port = port
        self.auth = auth
        self.token, self.orgID, self.agentID = auth.addTenant()

    async def connect(self) -> RawClient:
        from twisted.internet import reactor

        endpoint = TCP4ClientEndpoint(reactor, "127.0.0.1", self.port)
        client = await endpoint.connect(Factory.forProtocol(RawClient))
        assert isinstance(client, RawClient)
        return client

    def chatHead(self, length: int | None = None, **extra: str) -> bytes:
        headers = {
            "Authorization": f"Bearer {self.token}",
            "X-SVC-Agent-ID": self.agentID,
            "Content-Type": "application/json",
            **extra,
        }
        if length is not None:
            headers["Content-Length"] = str(length)
        return head("POST", "/v1/chat/completions", headers)


def head(method: str, path: str, headers: dict[str, str] | None = None) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: proxy.test"]
    lines += [f"{name}: {value}" for name, value in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


async def sleep(seconds: float) -> None:
    from twisted.internet import reactor

    await deferLater(reactor, seconds, lambda: None)


def exchange(port: int, raw: bytes, timeout: float = 5.0) -> tuple[bytes, float]:
    """
    Send C{raw} on a fresh connection and read until the proxy closes it
    (or C{timeout}, which fails the test: a hanging connection).
    """
    began = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as connection:
        connection.sendall(raw)
        received = b""
        while True:
            try:
                chunk = connection.recv(65536)
            except ConnectionResetError:
                break
            except TimeoutError:
                pytest.fail(f"the connection hung; received {received[:200]!r}")
            if not chunk:
                break
            received += chunk
    return received, time.monotonic() - began


def parsed(raw: bytes) -> Answer:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return Answer(int(lines[0].split()[1]), headers, body)


def rawChat(gateway: Gateway, body: bytes, **extra: bytes) -> bytes:
    tenant = gateway.tenants["main"]
    headers = {
        b"Host": b"gateway",
        b"Authorization": f"Bearer {tenant.token}".encode(),
        b"X-SVC-Agent-ID": str(tenant.agentID).encode(),
        b"Content-Type": b"application/json",
        b"Content-Length": str(len(body)).encode(),
        b"Connection": b"close",
    }
    headers.update({name.replace("_", "-").encode(): value for name, value in extra.items()})
    head = b"POST /v1/chat/completions HTTP/1.1\r\n"
    head += b"".join(name + b": " + value + b"\r\n" for name, value in headers.items())
    return head + b"\r\n" + body


FIELD_CODES = ("REQUIRED", "TOO_LONG", "TOO_MANY", "INVALID_ENUM", "INVALID_FORMAT")


# JSON values of every kind, including the edge cases of each type.
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=20),
    st.sampled_from([*sorted(ROLES), "", "User", "user ", "user\u200b"]),
)


values = st.recursive(
    scalars,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)


def contents() -> st.SearchStrategy[Any]:
    # Most contents are small; some sit on either side of the byte limit,
    # in 1- to 4-byte characters.
    near = st.tuples(
        st.sampled_from(["a", "\u00e9", "\u20ac", "\U0001f600"]), st.integers(-2, 2)
    ).map(lambda pair: pair[0] * (MAX_CONTENT_BYTES // len(pair[0].encode()) + pair[1]))
    return st.one_of(values, near)


messages = st.fixed_dictionaries(
    {},
    optional={
        "role": st.one_of(st.sampled_from(sorted(ROLES)), values),
        "content": contents(),
        "name": values,
    },
)


messageLists = st.one_of(
    st.lists(st.one_of(messages, values), max_size=5),
    st.integers(MAX_MESSAGES - 1, MAX_MESSAGES + 2).map(
        lambda count: [{"role": "user", "content": "x"}] * count
    ),
    values,
)


models = st.one_of(
    st.text(max_size=20),
    st.integers(250, 260).map(lambda length: "m" * length),
    values,
)


bodies = st.fixed_dictionaries(
    {},
    optional={
        "model": models,
        "messages": messageLists,
        "stream": values,
        "temperature": values,
        "max_tokens": values,
        "tools": values,
    },
)


def outcome(body: bytes) -> tuple[str, set[str]]:
    """
    What the parser makes of C{body}: "ok", or the error code and the set
    of field error codes. Anything else than an ApiError of 400 fails.
    """
    try:
        parseChatBody(body)
    except ApiError as error:
        assert error.status == 400, error
        assert error.code.value in ("INVALID_JSON", "VALIDATION_ERROR")
        codes = {each.code.value for each in error.fieldErrors}
        assert codes <= set(FIELD_CODES)
        if error.code.value == "VALIDATION_ERROR":
            assert codes, "a VALIDATION_ERROR without field errors"
        return error.code.value, codes
    return "ok", set()
