"""
Forwarding to OpenAI-compatible providers end to end (decisions D9, issue
12 item 6), with the official C{openai} SDK as the client wherever it can
be (raw sockets for a client that stops reading or goes away at a chosen
moment): clients that go away, backpressure, persistent connections and
their bound, GET /v1/models, usage, logs and metrics, odd bodies
(Hypothesis), and JSON that cannot be forwarded (D10).

The gateway and its providers file are those of tests/forwardingfixtures.py;
tests/test_gateway_forwarding.py has the answers, streams, faults and
fallbacks.
"""

from __future__ import annotations

import http.client
import json
import re
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import openai
import pytest
from forwardingfixtures import (
    BODY_LIMIT,
    BRISK_IDLE_TIMEOUT,
    CONTENT_MARKER,
    EVENT_BYTES,
    LARGE_STREAM_EVENTS,
    MODELS,
    NARROW_CONNECTIONS,
    PROVIDER_OF,
    UPSTREAM_KEY,
    WRONG_KEY,
    Forwarding,
    assertEnvelopeOf,
    assertGatewayHeaders,
    chatBody,
    echoContent,
    messages,
    sseEvents,
    streamedContent,
)
from gatewayfixtures import request
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

# Each test finds its own requests by request id (forwardingfixtures).
pytestmark = [pytest.mark.usefixtures("emptyRequestLogs"), pytest.mark.e2e]


# Clients that go away


def _leaveMidStream(forwarding: Forwarding) -> tuple[str, float]:
    """
    Read three chunks of a never-ending stream with the SDK, then close
    it; returns the request id and the time the client went away.
    """
    stream = forwarding.client().chat.completions.create(
        model="endless", messages=messages(), stream=True
    )
    requestID = stream.response.headers["x-request-id"]
    for count, _ in enumerate(stream, start=1):
        if count == 3:
            break
    stream.close()
    return requestID, time.monotonic()


def test_clientGoneMidStreamClosesUpstream(forwarding: Forwarding) -> None:
    """
    A client that closes a never-ending stream after three chunks: the
    upstream request is closed within one second.
    """
    requestID, gone = _leaveMidStream(forwarding)
    (received,) = forwarding.received(requestID)
    assert received.outcome == "clientGone"
    assert received.ended is not None
    assert received.ended - gone < 1.0, received.ended - gone


def test_clientGoneMidStreamIsNoFault(forwarding: Forwarding) -> None:
    """
    A client that leaves a stream is an ordinary event: the access log says
    it went away, and nothing is logged at error level or above. (A
    warning or worse is written at once, with every line before it: once
    the access line shows, any such line would too.)
    """
    faults = len(forwarding.faultLines())
    requestID, _ = _leaveMidStream(forwarding)
    line = forwarding.accessLine(requestID)
    assert line["message"] == "POST /v1/chat/completions: client went away", line
    assert forwarding.faultLines()[faults:] == []


def _leaveWhileWaiting(
    forwarding: Forwarding, model: str, stream: bool = False
) -> tuple[str, float]:
    """
    Send a request for C{model} over a socket, wait until the upstream has
    it, and close the socket (before any answer); returns the request id
    and the time the client went away.
    """
    tenant = forwarding.gateway.tenants["main"]
    requestID = str(uuid.uuid4())
    body = chatBody(model, stream)
    with socket.create_connection(("127.0.0.1", forwarding.gateway.port), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\n"
            b"Content-Type: application/json\r\n"
            + f"Authorization: Bearer {tenant.token}\r\n".encode()
            + f"X-SVC-Agent-ID: {tenant.agentID}\r\n".encode()
            + f"X-Request-ID: {requestID}\r\n".encode()
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        forwarding.upstream.waitForRequests(
            lambda requests: any(each.header("x-request-id") == requestID for each in requests),
            timeout=10,
        )
    return requestID, time.monotonic()


def test_clientGoneWhileWaitingClosesUpstream(forwarding: Forwarding) -> None:
    """
    A client that goes away while a non-streaming answer is awaited (the
    provider would take 30 s): the upstream request is closed within one
    second.
    """
    requestID, gone = _leaveWhileWaiting(forwarding, "slow-answer")
    (received,) = forwarding.received(requestID)
    assert received.outcome == "clientGone"
    assert received.ended is not None
    assert received.ended - gone < 1.0, received.ended - gone


def _upstreamRequestsCounted(counted: dict[tuple[str, Any], float]) -> dict[str, float]:
    return {
        dict(labels)["status"]: value
        for (name, labels), value in counted.items()
        if name == "svc_proxy_upstream_requests_total"
    }


def test_clientGoneWhileWaitingIsNoUpstreamFault(forwarding: Forwarding) -> None:
    """
    A client that goes away while a non-streaming answer is awaited is not
    an upstream fault: the access log says the client went away (no 502),
    the attempt is counted as cancelled (not as a failure to connect), and
    the request as closed by the client (499).
    """
    before = forwarding.metrics()
    requestID, _ = _leaveWhileWaiting(forwarding, "slow-answer")
    line = forwarding.accessLine(requestID)
    counted = forwarding.metrics().since(before)
    chats = {
        dict(labels)["code"]: value
        for (name, labels), value in counted.items()
        if name == "svc_proxy_requests_total" and dict(labels)["route"] == "/v1/chat/completions"
    }
    # All three at once, so that a failure shows each.
    seen = (line["message"], _upstreamRequestsCounted(counted), chats)
    assert seen == ("POST /v1/chat/completions: client went away", {"cancelled": 1}, {"499": 1}), (
        seen
    )


@pytest.mark.parametrize("stream", [False, True])
def test_clientGoneTriesNoFallback(forwarding: Forwarding, stream: bool) -> None:
    """
    A client that goes away while its first attempt is awaited (streaming
    or not): no fallback is sent for a client that is gone. (The access
    line is written once every attempt is over.)
    """
    requestID, _ = _leaveWhileWaiting(forwarding, "slow-then-fast", stream)
    forwarding.accessLine(requestID)
    received = forwarding.received(requestID)
    assert [each.body["model"] for each in received] == ["slow:30000"]


# Backpressure and connections


def _rss(pid: int) -> int:
    """
    The resident set of process C{pid}, in bytes.
    """
    status = Path(f"/proc/{pid}/status").read_text()
    match = re.search(r"^VmRSS:\s+(\d+) kB$", status, re.MULTILINE)
    assert match is not None
    return int(match.group(1)) * 1024


def test_slowClientPausesTheUpstream(forwarding: Forwarding) -> None:
    """
    A client that stops reading a large stream (a small receive buffer):
    the upstream is paused, having written a small part of the answer, and
    the proxy's memory does not grow with the answer; once the client reads
    again, the whole stream arrives, ending with [DONE]: the pause, longer
    than the provider's idle_timeout, did not count against it.
    """
    process = forwarding.gateway.proxy.process
    assert process is not None
    rssBefore = _rss(process.pid)
    tenant = forwarding.gateway.tenants["main"]
    requestID = str(uuid.uuid4())
    body = chatBody("large-stream", stream=True)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(60)
    try:
        sock.connect(("127.0.0.1", forwarding.gateway.port))
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\nConnection: close\r\n"
            b"Content-Type: application/json\r\n"
            + f"Authorization: Bearer {tenant.token}\r\n".encode()
            + f"X-SVC-Agent-ID: {tenant.agentID}\r\n".encode()
            + f"X-Request-ID: {requestID}\r\n".encode()
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        # Wait until the upstream stops writing: its count of events sent
        # has not moved for longer than the provider's idle_timeout.
        deadline = time.monotonic() + 30
        last, steadySince = -1, time.monotonic()
        while True:
            mine = [
                each
                for each in forwarding.upstream.requests()
                if each.header("x-request-id") == requestID
            ]
            sent = mine[0].eventsSent if mine else -1
            if sent != last:
                last, steadySince = sent, time.monotonic()
            elif sent > 0 and time.monotonic() - steadySince >= BRISK_IDLE_TIMEOUT + 0.5:
                break
            assert time.monotonic() < deadline, f"the upstream never paused: {sent} events sent"
            time.sleep(0.1)
        grown = _rss(process.pid) - rssBefore
        answerBytes = LARGE_STREAM_EVENTS * EVENT_BYTES
        assert last < LARGE_STREAM_EVENTS // 2, (last, LARGE_STREAM_EVENTS)
        assert grown < answerBytes // 4, (grown, answerBytes)
        assert mine[0].ended is None

        # Reading again, with a common buffer.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024 * 1024)
        response = http.client.HTTPResponse(sock)
        response.begin()
        assert response.status == 200
        assert response.getheader("x-request-id") == requestID
        events = sseEvents(response.read())
    finally:
        sock.close()
    assert events[-1] == b"[DONE]"
    assert len(events) == LARGE_STREAM_EVENTS + 3
    (received,) = forwarding.received(requestID)
    assert received.outcome == "finished"


def test_connectionsAreReused(forwarding: Forwarding) -> None:
    """
    Sequential requests to one provider reuse its persistent connections:
    twenty requests, at most two new upstream connections.
    """
    client = forwarding.client()
    accepted = forwarding.upstream.connections().accepted
    requestIDs = []
    for _ in range(20):
        raw = client.chat.completions.with_raw_response.create(model="fast", messages=messages())
        assert raw.status_code == 200
        requestIDs.append(raw.headers["x-request-id"])
    ports = {forwarding.received(requestID)[0].clientPort for requestID in requestIDs}
    assert len(ports) <= 2, ports
    assert forwarding.upstream.connections().accepted - accepted <= 2


def test_maxConnectionsBoundsRequestsInFlight(forwarding: Forwarding) -> None:
    """
    At most max_connections requests are in flight to a provider at once:
    six concurrent requests to a provider of two (each 300 ms upstream) all
    succeed, never more than two at a time at the upstream.
    """
    answers: list[str] = []
    failures: list[BaseException] = []

    def ask() -> None:
        try:
            raw = forwarding.client().chat.completions.with_raw_response.create(
                model="narrow", messages=messages()
            )
            answers.append(raw.headers["x-request-id"])
        except BaseException as error:  # reported by the test thread
            failures.append(error)

    threads = [threading.Thread(target=ask) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert failures == [] and len(answers) == 6
    received = [forwarding.received(requestID)[0] for requestID in answers]
    assert {each.path for each in received} == {"/narrow/v1/chat/completions"}
    # Each arrival counts one more in flight, each end one fewer; an end
    # and an arrival at the same moment, the end first.
    moments = sorted(
        [(each.arrived, 1) for each in received]
        + [(each.ended, -1) for each in received if each.ended is not None]
    )
    inFlight, most = 0, 0
    for _, change in moments:
        inFlight += change
        most = max(most, inFlight)
    assert most <= NARROW_CONNECTIONS


# GET /v1/models


def test_modelsListedPerOrganization(forwarding: Forwarding) -> None:
    """
    client.models.list() names the models the caller's organization may
    use, in the file's order and OpenAI's shape: the allow-listed model for
    its organization only.
    """
    started = int(time.time())
    raw = forwarding.client("main").models.with_raw_response.list()
    assert raw.status_code == 200
    assertGatewayHeaders(raw.headers)
    listed = list(raw.parse())
    assert [model.id for model in listed] == list(MODELS)
    for model in listed:
        assert model.object == "model"
        assert model.owned_by == PROVIDER_OF[model.id]
        assert 0 < model.created <= started
    others = [model.id for model in forwarding.client("other").models.list()]
    assert others == [name for name in MODELS if name != "private"]


def test_modelOfOtherOrganizationsIsNotConfigured(forwarding: Forwarding) -> None:
    """
    A model listed for other organizations only answers 501
    PROVIDER_NOT_CONFIGURED exactly as a model nobody has (same status,
    envelope and headers), and nothing is forwarded.
    """
    client = forwarding.client("other")
    errors: list[tuple[openai.InternalServerError, dict[str, Any]]] = []
    for model in ("private", "no-such-model"):
        with pytest.raises(openai.InternalServerError) as raised:
            client.chat.completions.create(model=model, messages=messages())
        body = assertEnvelopeOf(
            raised.value, 501, "PROVIDER_NOT_CONFIGURED", openai.InternalServerError
        )
        assert forwarding.receivedNothing(body["request_id"])
        errors.append((raised.value, body))
    (private, privateBody), (unknown, unknownBody) = errors
    assert set(privateBody) == set(unknownBody)
    assert privateBody["message"] == unknownBody["message"]
    assert privateBody.get("detail") == unknownBody.get("detail")
    assert set(private.response.headers) == set(unknown.response.headers)
    assert len(private.response.content) == len(unknown.response.content)


def test_modelsNeedAToken(forwarding: Forwarding) -> None:
    """
    GET /v1/models is authenticated like the auth-probe: 401 without a
    token (the SDK's AuthenticationError).
    """
    bogus = f"svc_pat_{uuid.uuid4()}_{'a' * 43}"
    with pytest.raises(openai.AuthenticationError) as raised:
        forwarding.client(token=bogus).models.list()
    body = raised.value.body
    assert isinstance(body, dict)
    assert body["code"] == "INVALID_TOKEN"
    answer = request(forwarding.gateway.port, "GET", "/v1/models")
    assert (answer.status, answer.code) == (401, "MISSING_TOKEN")


# Usage and observability


def _labelled(name: str, **labels: str) -> tuple[str, tuple[tuple[str, str], ...]]:
    return name, tuple(sorted(labels.items()))


def test_accessLogAndMetrics(forwarding: Forwarding) -> None:
    """
    The access-log line has provider, model, upstream_model, upstream_ms
    and the tokens (also for a stream whose client did not ask for usage);
    the D9 metrics count each request to a provider by provider, model and
    status, its duration, and the tokens by kind; no org id, agent id or
    token in any series.
    """
    client = forwarding.client()
    before = forwarding.metrics()
    plain = client.chat.completions.with_raw_response.create(model="fast", messages=messages())
    streamed = client.chat.completions.create(model="fast", messages=messages(), stream=True)
    list(streamed)
    withUsage = client.chat.completions.create(
        model="fast", messages=messages(), stream=True, stream_options={"include_usage": True}
    )
    list(withUsage)
    with pytest.raises(openai.InternalServerError) as failed:
        client.chat.completions.create(model="status:503", messages=messages())
    with pytest.raises(openai.BadRequestError) as rejected:
        client.chat.completions.create(model="status:400", messages=messages())

    for requestID in (
        plain.headers["x-request-id"],
        streamed.response.headers["x-request-id"],
        withUsage.response.headers["x-request-id"],
    ):
        line = forwarding.accessLine(requestID)
        assert line["status"] == 200
        assert (line["provider"], line["model"], line["upstream_model"]) == (
            "local",
            "fast",
            "echo",
        )
        assert (line["prompt_tokens"], line["completion_tokens"]) == (3, 10)
        assert isinstance(line["upstream_ms"], float | int) and line["upstream_ms"] >= 0
    for error, model, status in ((failed, "status:503", 502), (rejected, "status:400", 400)):
        body = error.value.body
        assert isinstance(body, dict)
        line = forwarding.accessLine(body["request_id"])
        assert line["status"] == status
        assert (line["provider"], line["model"], line["upstream_model"]) == ("local", model, model)
        assert line["prompt_tokens"] is None and line["completion_tokens"] is None
        assert line["upstream_ms"] >= 0

    after = forwarding.metrics()
    counted = after.since(before)
    requests = "svc_proxy_upstream_requests_total"
    tokens = "svc_proxy_upstream_tokens_total"
    assert {key: value for key, value in counted.items() if key[0] == requests} == {
        _labelled(requests, provider="local", model="fast", status="200"): 3,
        _labelled(requests, provider="local", model="status:503", status="503"): 1,
        _labelled(requests, provider="local", model="status:400", status="400"): 1,
    }
    assert {key: value for key, value in counted.items() if key[0] == tokens} == {
        _labelled(tokens, provider="local", model="fast", kind="prompt"): 9,
        _labelled(tokens, provider="local", model="fast", kind="completion"): 30,
    }
    durations = {key: value for key, value in counted.items() if "upstream_duration" in key[0]}
    assert durations[_labelled("svc_proxy_upstream_duration_seconds_count", provider="local")] == 5
    assert all(("provider", "local") in key[1] for key in durations)
    upstreamSeries = {
        tuple(name for name, _ in labels)
        for name, labels in after.samples
        if name.startswith("svc_proxy_upstream")
    }
    assert upstreamSeries <= {
        ("model", "provider", "status"),
        ("provider",),
        ("le", "provider"),
        ("kind", "model", "provider"),
    }
    for tenant in forwarding.gateway.tenants.values():
        for secret in (tenant.orgID, tenant.agentID, tenant.tokenID, tenant.token):
            assert str(secret) not in after.text


def test_answersWithoutUsage(forwarding: Forwarding) -> None:
    """
    A provider that sends no usage, even when asked: the answer and the
    stream are relayed whole (no usage chunk), the access log has no
    tokens, and no token is counted.
    """
    client = forwarding.client()
    before = forwarding.metrics()
    completion = client.chat.completions.with_raw_response.create(
        model="no-usage", messages=messages()
    )
    assert completion.parse().usage is None
    assert completion.parse().choices[0].message.content == echoContent()
    stream = client.chat.completions.create(
        model="no-usage", messages=messages(), stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert all(chunk.choices and chunk.usage is None for chunk in chunks)
    assert streamedContent(chunks) == echoContent()
    for requestID in (
        completion.headers["x-request-id"],
        stream.response.headers["x-request-id"],
    ):
        line = forwarding.accessLine(requestID)
        assert (line["status"], line["upstream_model"]) == (200, "no-usage")
        assert line["prompt_tokens"] is None and line["completion_tokens"] is None
    counted = forwarding.metrics().since(before)
    assert _upstreamRequestsCounted(counted) == {"200": 2}
    assert not any(name == "svc_proxy_upstream_tokens_total" for name, _ in counted)


def test_noContentOrKeyInTheLog(forwarding: Forwarding) -> None:
    """
    Message content is never logged, on success or failure, streaming or
    not (every message of this module holds the marker, and the proxy logs
    at DEBUG); nor is a provider's key or a client's token.
    """
    client = forwarding.client()
    client.chat.completions.create(model="fast", messages=messages())
    list(client.chat.completions.create(model="fast", messages=messages(), stream=True))
    for model in ("status:400", "status:503", "wrong-key", "refused"):
        with pytest.raises(openai.APIStatusError):
            client.chat.completions.create(model=model, messages=messages())
    with pytest.raises(openai.APIError):
        list(
            client.chat.completions.create(
                model="close-mid-stream", messages=messages(), stream=True
            )
        )
    last = client.chat.completions.with_raw_response.create(model="keyed", messages=messages())
    forwarding.accessLine(last.headers["x-request-id"])
    output = forwarding.gateway.proxy.output()
    assert CONTENT_MARKER not in output
    assert "hello there" not in output
    for secret in (
        UPSTREAM_KEY,
        WRONG_KEY,
        *(t.token for t in forwarding.gateway.tenants.values()),
    ):
        assert secret not in output


# Odd bodies


_RESERVED = {"model", "messages", "stream", "stream_options", "temperature", "max_tokens"}
_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
)
_VALUES = st.recursive(
    _SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
_MESSAGES = st.lists(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["system", "developer", "user", "assistant"]),
            "content": st.text(max_size=60).map(lambda text: f"{text} {CONTENT_MARKER}"),
        },
        optional={"name": st.text(max_size=8), "x_part": _VALUES},
    ),
    min_size=1,
    max_size=3,
)


@st.composite
def _oddBodies(draw: st.DrawFn) -> tuple[dict[str, Any], bytes]:
    """
    A valid chat body with unknown keys and odd values, and its bytes:
    escaped to ASCII or not (astral characters as surrogate-pair escapes),
    slashes escaped or not.
    """
    body: dict[str, Any] = {"model": "fast", "messages": draw(_MESSAGES)}
    unknownKeys = st.text(min_size=1, max_size=10).filter(lambda key: key not in _RESERVED)
    body.update(draw(st.dictionaries(unknownKeys, _VALUES, max_size=4)))
    if draw(st.booleans()):
        body["stream"] = draw(st.booleans())
    if draw(st.booleans()):
        body["stream_options"] = draw(
            st.dictionaries(st.text(max_size=8), _VALUES, max_size=3) | _VALUES
        )
    text = json.dumps(body, ensure_ascii=draw(st.booleans()))
    if draw(st.booleans()):
        # A "/" is only ever inside a string in JSON: "\/" is the same.
        text = text.replace("/", "\\/")
    return body, text.encode("utf-8")


@settings(
    max_examples=20,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(_oddBodies())
def test_oddBodiesForwardedIntact(
    forwarding: Forwarding, case: tuple[dict[str, Any], bytes]
) -> None:
    """
    Whatever valid body a client sends (unknown keys at any depth, unicode
    including astral characters, escapes), the upstream receives the same
    JSON object with only the model replaced, and for a stream
    stream_options.include_usage set (the client's other options kept).
    """
    body, data = case
    requestID = str(uuid.uuid4())
    answer = forwarding.rawChat(data, requestID)
    assert answer.status == 200, answer.body
    expected = {**body, "model": "echo"}
    if body.get("stream") is True:
        options = body.get("stream_options")
        expected["stream_options"] = {
            **(options if isinstance(options, dict) else {}),
            "include_usage": True,
        }
    (received,) = forwarding.received(requestID)
    assert received.body == expected


def test_largestBodyForwardedIntact(forwarding: Forwarding) -> None:
    """
    A body of exactly the body limit (many-byte characters included) is
    forwarded whole; one byte more is refused with 413 and not forwarded.
    """
    filler = "é😀ab" * 12_000  # 2 + 4 + 2 = 8 bytes, 96,000 bytes a message
    body: dict[str, Any] = {
        "model": "fast",
        "messages": [{"role": "user", "content": filler} for _ in range(10)],
        "x_extra": {"nested": ["𝄞" * 10]},
    }
    body["messages"].append({"role": "user", "content": ""})
    size = len(json.dumps(body, ensure_ascii=False).encode())
    body["messages"][-1]["content"] = "z" * (BODY_LIMIT - size)
    data = json.dumps(body, ensure_ascii=False).encode()
    assert len(data) == BODY_LIMIT
    requestID = str(uuid.uuid4())
    answer = forwarding.rawChat(data, requestID)
    assert answer.status == 200, answer.body
    (received,) = forwarding.received(requestID)
    assert received.body == {**body, "model": "echo"}

    tooLarge = str(uuid.uuid4())
    body["messages"][-1]["content"] += "z"
    answer = forwarding.rawChat(json.dumps(body, ensure_ascii=False).encode(), tooLarge)
    assert (answer.status, answer.code) == (413, "PAYLOAD_TOO_LARGE")
    assert forwarding.receivedNothing(tooLarge)


@pytest.mark.parametrize(
    "body",
    [
        b'{"model": "fast", "messages": [{"role": "user", "content": "hi"}], "x": 1e999999}',
        b'{"model": "fast", "messages": [{"role": "user", "content": "hi"}], "x": {"y": [-1e400]}}',
        b'{"model": "fast", "messages": [{"role": "user", "content": "\\ud800"}]}',
        b'{"model": "fast", "messages": [{"role": "user", "content": "hi"}],'
        b' "x": ["\\udfff tail"]}',
    ],
)
def test_jsonThatCannotBeForwardedIsRefused(forwarding: Forwarding, body: bytes) -> None:
    """
    Decisions D10: a number that is not finite once parsed, or a lone
    surrogate, anywhere in the body, is refused with 400 INVALID_JSON
    where it is parsed; nothing is forwarded.
    """
    requestID = str(uuid.uuid4())
    answer = forwarding.rawChat(body, requestID)
    assert (answer.status, answer.code) == (400, "INVALID_JSON"), answer.body
    assert forwarding.receivedNothing(requestID)
