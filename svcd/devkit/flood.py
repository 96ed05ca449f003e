"""
Floods of chat requests over many keep-alive connections: of bearers
carrying made-up token ids, for the test that the proxy keeps nothing per
made-up id (tests/test_gateway_cache.py) and for the benchmark that sends a
million of them (bench/madeup.py); and of one tenant's requests, for the
tests that count how thousands of requests split over a model's
deployments (tests/test_gateway_deployments.py).

One selector drives every connection, so the flood costs the client as
little CPU as it can: on a 2-core machine the client shares the cores with
the proxy it measures.
"""

# A flood of our own requests to a proxy on loopback; the token ids are
# random on purpose (made up), not for secrecy.
from __future__ import annotations

import collections
import os
import secrets
import selectors
import socket
import time
import uuid
from collections.abc import Callable
from pathlib import Path

# A valid chat body: the requests are refused for their token, not for
# what they ask.
CHAT_BODY = b'{"model": "m", "messages": [{"role": "user", "content": "hello"}]}'


def floodMadeUp(
    port: int,
    agentID: str,
    count: int,
    connections: int = 200,
    limit: float = 1800.0,
    body: bytes = CHAT_BODY,
) -> collections.Counter[int]:
    """
    Send C{count} chat requests to 127.0.0.1:C{port}, each with a distinct
    made-up token id, over C{connections} keep-alive connections (a few
    dozen made-up ids at a time wait about two heartbeats for their 401, so
    it takes many requests in flight to keep the proxy busy). Returns the
    answers' statuses, counted.

    @raise AssertionError: when the proxy closes a connection, or the
        flood has not finished within C{limit} seconds.
    """
    secret = secrets.token_urlsafe(32)
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\n"
        f"X-SVC-Agent-ID: {agentID}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nAuthorization: Bearer svc_pat_"
    )

    def madeUp() -> bytes:
        tokenID = uuid.UUID(bytes=os.urandom(16), version=4)
        return (head + f"{tokenID}_{secret}\r\n\r\n").encode() + body

    return flood(port, madeUp, count, connections, limit)


def chatRequest(token: str, agentID: str, body: bytes) -> bytes:
    """
    One chat completion request of C{token}'s tenant, as sent on the wire.
    """
    return (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\n"
        f"X-SVC-Agent-ID: {agentID}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nAuthorization: Bearer {token}\r\n\r\n"
    ).encode() + body


def flood(
    port: int,
    nextRequest: Callable[[], bytes] | bytes,
    count: int,
    connections: int = 200,
    limit: float = 1800.0,
) -> collections.Counter[int]:
    """
    Send C{count} requests to 127.0.0.1:C{port} over C{connections}
    keep-alive connections, each connection sending its next request when
    its answer has come (so at most C{connections} in flight). Returns the
    answers' statuses, counted.

    @param nextRequest: the bytes of each request (the same every time),
        or what makes the next one; each answer must carry a
        Content-Length.
    @raise AssertionError: when the proxy closes a connection, or the
        flood has not finished within C{limit} seconds.
    """
    make = (lambda: nextRequest) if isinstance(nextRequest, bytes) else nextRequest
    selector = selectors.DefaultSelector()
    buffers: dict[socket.socket, bytes] = {}
    sent = 0
    statuses: collections.Counter[int] = collections.Counter()

    def sendNext(sock: socket.socket) -> None:
        nonlocal sent
        sock.sendall(make())
        sent += 1

    for _ in range(min(connections, count)):
        sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        buffers[sock] = b""
        selector.register(sock, selectors.EVENT_READ, sock)
        sendNext(sock)
    deadline = time.monotonic() + limit
    try:
        while buffers:
            assert time.monotonic() < deadline, "the flood did not finish in time"
            for key, _ in selector.select(timeout=5):
                sock = key.data
                assert isinstance(sock, socket.socket)
                chunk = sock.recv(65536)
                assert chunk, "the proxy closed a connection"
                buffer = buffers[sock] + chunk
                while True:
                    end = buffer.find(b"\r\n\r\n")
                    if end < 0:
                        break
                    header = buffer[:end]
                    lengths = header.lower().split(b"content-length:")
                    assert len(lengths) == 2, f"an answer without a Content-Length: {header!r}"
                    length = int(lengths[1].split(b"\r\n")[0])
                    if len(buffer) < end + 4 + length:
                        break
                    statuses[int(header[9:12])] += 1
                    buffer = buffer[end + 4 + length :]
                    if sent < count:
                        sendNext(sock)
                    elif not buffer:
                        selector.unregister(sock)
                        sock.close()
                        del buffers[sock]
                        break
                if sock in buffers:
                    buffers[sock] = buffer
    finally:
        for sock in buffers:
            sock.close()
        selector.close()
    return statuses


def rssKiB(pid: int) -> int:
    """
    The resident memory of process C{pid}, in KiB (VmRSS).
    """
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for process {pid}")
