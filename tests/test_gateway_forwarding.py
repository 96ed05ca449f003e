"""
Forwarding to OpenAI-compatible providers end to end (decisions D9, issue
12 item 6), with the official C{openai} SDK as the client (raw HTTP only
where the bytes on the wire are the point): answers and what the upstream
receives, streams, every fault of D9's table before any byte, fallbacks,
and faults after the first byte.

The gateway and its providers file are those of tests/forwardingfixtures.py;
tests/test_gateway_forwarding_ops.py has the clients that go away,
backpressure, connections, GET /v1/models, usage and observability, and odd
bodies; tests/test_gateway_forwarding_config.py the gateway without a
providers file and the files that stop the proxy.
"""

from __future__ import annotations

import json
import re
import time
import uuid

import openai
import pytest
from forwardingfixtures import (
    GATEWAY_HEADERS,
    IMPATIENT_IDLE_TIMEOUT,
    IMPATIENT_TIMEOUT,
    MODELS,
    UPSTREAM_KEY,
    Forwarding,
    assertEnvelopeOf,
    assertGatewayHeaders,
    chatBody,
    echoContent,
    messages,
    sseEvents,
    streamedContent,
)
from openai.types.chat import ChatCompletion

# Each test finds its own requests by request id (forwardingfixtures).
pytestmark = [pytest.mark.usefixtures("emptyRequestLogs"), pytest.mark.e2e]


# Non-streaming


def test_answerRelayedWithHeaders(forwarding: Forwarding) -> None:
    """
    A non-streaming answer is relayed as the upstream gave it (content and
    usage), with 200 and the gateway's own headers: X-Request-ID, X-Trace-ID,
    X-RateLimit-* and X-SVC-Upstream-Model naming the model that answered.
    """
    raw = forwarding.client().chat.completions.with_raw_response.create(
        model="fast", messages=messages()
    )
    assert raw.status_code == 200
    requestID = assertGatewayHeaders(raw.headers)
    assert raw.headers["x-svc-upstream-model"] == "fast"
    assert raw.headers["content-type"] == "application/json"
    completion = raw.parse()
    (received,) = forwarding.received(requestID)
    assert completion.id == f"chatcmpl-scripted-{received.number}"
    assert completion.model == "echo"
    assert completion.choices[0].message.content == echoContent()
    assert completion.choices[0].finish_reason == "stop"
    assert completion.usage is not None
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (3, 10)


def test_whatTheUpstreamReceives(forwarding: Forwarding) -> None:
    """
    The upstream receives the client's JSON object with only the model
    replaced by upstream_model (unknown keys, unicode and nested values
    kept), Content-Type, X-Request-ID equal to the client's answer's, a
    traceparent whose trace id is the answer's X-Trace-ID, and no other
    header of the client's: not its token, not X-SVC-Agent-ID, not the
    SDK's own, not a custom one.
    """
    extra = {
        "temperature": 0.25,
        "max_tokens": 77,
        "x_unknown": {"nested": [1, 2.5, None, True, {"deep": "é😀\u2028\x00"}]},
        "metadata": {"tenant-key": "ünïcödé 𝄞", "quote": '"\\/'},
        "user": "user-1",
    }
    custom = {
        "X-Custom-Header": "custom-value",
        "Cookie": "session=client-cookie",
        "X-Forwarded-For": "203.0.113.9",
        "Accept-Encoding": "client-encoding",
        "OpenAI-Organization": "org-client",
    }
    raw = forwarding.client(headers=custom).chat.completions.with_raw_response.create(
        model="other-path", messages=messages(), extra_body=extra
    )
    assert raw.status_code == 200
    requestID = assertGatewayHeaders(raw.headers)
    assert raw.headers["x-svc-upstream-model"] == "other-path"
    (received,) = forwarding.received(requestID)
    assert (received.method, received.path) == ("POST", "/other/v1/chat/completions")
    assert received.body == {"model": "echo", "messages": messages(), **extra}
    names = {name for name, _ in received.headers}
    assert names - {"accept-encoding"} == GATEWAY_HEADERS, received.headers
    assert received.header("accept-encoding") in (None, "gzip")
    assert received.header("content-type") == "application/json"
    assert received.header("x-request-id") == requestID
    traceparent = received.header("traceparent")
    assert traceparent is not None
    version, traceID, parentID, flags = traceparent.split("-")
    assert (version, traceID) == ("00", raw.headers["x-trace-id"])
    assert re.fullmatch(r"[0-9a-f]{16}", parentID) and re.fullmatch(r"[0-9a-f]{2}", flags)
    everything = json.dumps(received.headers)
    tenant = forwarding.gateway.tenants["main"]
    for secret in (tenant.token, str(tenant.agentID), *custom.values()):
        assert secret not in everything


def test_clientsRequestIDAndTraceAreCarriedOn(forwarding: Forwarding) -> None:
    """
    A client's own valid X-Request-ID and traceparent: the upstream gets
    that request id, and a traceparent in the client's trace (with the
    gateway's span as parent, not the client's).
    """
    inboundID = str(uuid.uuid4())
    traceID, parentID = uuid.uuid4().hex, uuid.uuid4().hex[:16]
    client = forwarding.client(
        headers={"X-Request-ID": inboundID, "traceparent": f"00-{traceID}-{parentID}-01"}
    )
    raw = client.chat.completions.with_raw_response.create(model="fast", messages=messages())
    assert raw.headers["x-request-id"] == inboundID
    assert raw.headers["x-trace-id"] == traceID
    (received,) = forwarding.received(inboundID)
    traceparent = received.header("traceparent")
    assert traceparent is not None
    version, sentTrace, sentParent, _ = traceparent.split("-")
    assert (version, sentTrace) == ("00", traceID)
    assert sentParent != parentID


def test_providerKeyOnlyWhereConfigured(forwarding: Forwarding) -> None:
    """
    Authorization goes upstream only for a provider with api_key_env, and
    it is the provider's key (the keyed upstream accepts it), never the
    client's token; a provider without a key gets no Authorization.
    """
    client = forwarding.client()
    raw = client.chat.completions.with_raw_response.create(model="keyed", messages=messages())
    assert raw.status_code == 200
    assert raw.parse().choices[0].message.content == echoContent()
    (received,) = forwarding.received(raw.headers["x-request-id"])
    assert received.status == 200
    assert received.headerValues("authorization") == [f"Bearer {UPSTREAM_KEY}"]
    names = {name for name, _ in received.headers}
    assert names - {"accept-encoding"} == GATEWAY_HEADERS | {"authorization"}

    raw = client.chat.completions.with_raw_response.create(model="fast", messages=messages())
    (received,) = forwarding.received(raw.headers["x-request-id"])
    assert received.header("authorization") is None


# Streaming


def test_streamWithoutUsage(forwarding: Forwarding) -> None:
    """
    A stream without stream_options: every event relayed in order, as
    text/event-stream with the gateway's headers; the upstream was asked
    for include_usage, and its usage event is not relayed (no chunk without
    choices).
    """
    raw = forwarding.client().chat.completions.with_raw_response.create(
        model="fast", messages=messages(), stream=True
    )
    assert raw.status_code == 200
    assert raw.headers["content-type"] == "text/event-stream"
    assert raw.headers["x-svc-upstream-model"] == "fast"
    requestID = assertGatewayHeaders(raw.headers)
    chunks = list(raw.parse())
    (received,) = forwarding.received(requestID)
    assert received.body["stream_options"] == {"include_usage": True}
    assert received.body["stream"] is True and received.body["model"] == "echo"
    assert all(chunk.choices for chunk in chunks)
    assert all(chunk.usage is None for chunk in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert streamedContent(chunks) == echoContent()
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert {chunk.id for chunk in chunks} == {f"chatcmpl-scripted-{received.number}"}


def test_streamWithUsage(forwarding: Forwarding) -> None:
    """
    A stream with stream_options.include_usage: the usage chunk (no
    choices) is relayed last; the client's other stream options are kept.
    """
    stream = forwarding.client().chat.completions.create(
        model="fast",
        messages=messages(),
        stream=True,
        extra_body={"stream_options": {"include_usage": True, "x_option": [1]}},
    )
    chunks = list(stream)
    (received,) = forwarding.received(stream.response.headers["x-request-id"])
    assert received.body["stream_options"] == {"include_usage": True, "x_option": [1]}
    usage = chunks[-1]
    assert usage.choices == [] and usage.usage is not None
    assert (usage.usage.prompt_tokens, usage.usage.completion_tokens) == (3, 10)
    assert all(chunk.choices for chunk in chunks[:-1])
    assert streamedContent(chunks) == echoContent()


def test_streamEndsWithDone(forwarding: Forwarding) -> None:
    """
    On the wire: the upstream's events in order, the last one C{data:
    [DONE]}; a client's include_usage false is overridden upstream, and the
    usage event left out.
    """
    answer = forwarding.rawChat(
        chatBody("fast", stream=True, stream_options={"include_usage": False})
    )
    assert answer.status == 200, answer.body
    assert answer.headers["content-type"] == "text/event-stream"
    assert answer.headers["cache-control"] == "no-cache"
    events = sseEvents(answer.body)
    assert events[-1] == b"[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    assert all(chunk["choices"] for chunk in chunks)
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == echoContent()
    (received,) = forwarding.received(answer.headers["x-request-id"])
    assert received.body["stream_options"] == {"include_usage": True}


def test_firstEventLongBeforeTheLast(forwarding: Forwarding) -> None:
    """
    Events are relayed as they come: with 100 ms between the upstream's
    events, the first chunk reaches the SDK at least a second before the
    last (never the whole stream at once).
    """
    stream = forwarding.client().chat.completions.create(
        model="gap:100", messages=messages(), stream=True
    )
    arrivals = [time.monotonic() for _ in stream]
    # The role event, 10 words and the finishing event: 11 gaps of 100 ms.
    assert len(arrivals) == 12
    assert arrivals[-1] - arrivals[0] >= 1.0, arrivals


# Faults before any byte


FAULTS = [
    # model, also streamed, status, code, the SDK's class
    ("refused", True, 502, "UPSTREAM_ERROR", openai.InternalServerError),
    ("reset", True, 502, "UPSTREAM_ERROR", openai.InternalServerError),
    ("status:500", True, 502, "UPSTREAM_ERROR", openai.InternalServerError),
    ("status:502", False, 502, "UPSTREAM_ERROR", openai.InternalServerError),
    ("status:503", True, 502, "UPSTREAM_ERROR", openai.InternalServerError),
    ("status:401", False, 502, "UPSTREAM_ERROR", openai.InternalServerError),
    ("status:403", False, 502, "UPSTREAM_ERROR", openai.InternalServerError),
    ("status:404", True, 502, "UPSTREAM_ERROR", openai.InternalServerError),
    ("wrong-key", True, 502, "UPSTREAM_ERROR", openai.InternalServerError),
    ("not-json", False, 502, "UPSTREAM_ERROR", openai.InternalServerError),
    ("huge-answer", False, 502, "UPSTREAM_ERROR", openai.InternalServerError),
    ("close-mid-stream", False, 502, "UPSTREAM_ERROR", openai.InternalServerError),
    ("late", True, 504, "UPSTREAM_TIMEOUT", openai.InternalServerError),
    ("late-body", True, 504, "UPSTREAM_TIMEOUT", openai.InternalServerError),
    ("stall", False, 504, "UPSTREAM_TIMEOUT", openai.InternalServerError),
    ("status:429", True, 429, "UPSTREAM_RATE_LIMITED", openai.RateLimitError),
    ("status:429:0", False, 429, "UPSTREAM_RATE_LIMITED", openai.RateLimitError),
    ("status:400", True, 400, "UPSTREAM_REJECTED", openai.BadRequestError),
    ("status:409", False, 409, "UPSTREAM_REJECTED", openai.ConflictError),
    ("status:422", False, 422, "UPSTREAM_REJECTED", openai.UnprocessableEntityError),
]


@pytest.mark.parametrize(("model", "alsoStreamed", "status", "code", "kind"), FAULTS)
def test_faultBeforeAnyByte(
    forwarding: Forwarding,
    model: str,
    alsoStreamed: bool,
    status: int,
    code: str,
    kind: type[openai.APIStatusError],
) -> None:
    """
    Each fault of D9's table, before any byte reached the client, answers
    its status and code in the envelope (with the request id), mapped to
    the SDK's natural class; a 429 carries the upstream's Retry-After (none
    when it gave none); only UPSTREAM_REJECTED carries the upstream's
    message, in detail. A timeout closes the upstream request.
    """
    client = forwarding.client()
    upstreamModel = MODELS[model].upstreamModel(model)
    for stream in (False, True) if alsoStreamed else (False,):
        started = time.monotonic()
        with pytest.raises(openai.APIStatusError) as raised:
            client.chat.completions.create(model=model, messages=messages(), stream=stream)
        took = time.monotonic() - started
        body = assertEnvelopeOf(raised.value, status, code, kind)
        headers = raised.value.response.headers
        if code == "UPSTREAM_REJECTED":
            assert body["detail"] == f"Scripted error {status} for model {upstreamModel!r}."
        else:
            assert "detail" not in body
        if model == "status:429":
            assert headers["retry-after"] == "7"
        else:
            assert "retry-after" not in headers
        if model == "refused":
            assert forwarding.receivedNothing(body["request_id"])
            continue
        (received,) = forwarding.received(body["request_id"])
        assert received.body["model"] == upstreamModel
        assert received.body.get("stream", False) is stream
        if code == "UPSTREAM_TIMEOUT":
            assert took >= (IMPATIENT_IDLE_TIMEOUT if stream else IMPATIENT_TIMEOUT)
            assert received.outcome == "clientGone"


def test_gatewaysOwnRefusalIsAuthenticationError(forwarding: Forwarding) -> None:
    """
    The gateway's own 401 (a token it does not know) is the SDK's
    AuthenticationError, in the envelope, and nothing is forwarded.
    """
    bogus = f"svc_pat_{uuid.uuid4()}_{'a' * 43}"
    with pytest.raises(openai.AuthenticationError) as raised:
        forwarding.client(token=bogus).chat.completions.create(model="fast", messages=messages())
    assert raised.value.status_code == 401
    body = raised.value.body
    assert isinstance(body, dict)
    assert body["code"] == "INVALID_TOKEN"
    requestID = raised.value.response.headers["x-request-id"]
    assert body["request_id"] == requestID
    assert forwarding.receivedNothing(requestID)


# Fallbacks


FALLBACKS = [
    # model, also streamed, what the upstreams received before "fast"
    ("via-refused", True, []),
    ("via-reset", True, ["reset"]),
    ("via-503", True, ["status:503"]),
    ("via-404", False, ["status:404"]),
    ("via-wrong-key", False, ["echo"]),
    ("via-429", True, ["status:429"]),
    ("via-late", False, ["slow:30000"]),
    ("via-late-body", True, ["hold:30000"]),
    ("via-not-json", False, ["not-json"]),
    ("via-close-mid-stream", False, ["close-mid-stream"]),
]


@pytest.mark.parametrize(("model", "alsoStreamed", "before"), FALLBACKS)
def test_faultTriesTheFallback(
    forwarding: Forwarding, model: str, alsoStreamed: bool, before: list[str]
) -> None:
    """
    Each fault but UPSTREAM_REJECTED tries the model's fallback: the answer
    is the fallback's, X-SVC-Upstream-Model names it, and the upstreams saw
    the failed attempt first, with the same request id.
    """
    client = forwarding.client()
    for stream in (False, True) if alsoStreamed else (False,):
        raw = client.chat.completions.with_raw_response.create(
            model=model, messages=messages(), stream=stream
        )
        assert raw.status_code == 200
        assert raw.headers["x-svc-upstream-model"] == "fast"
        requestID = assertGatewayHeaders(raw.headers)
        parsed = raw.parse()
        if stream:
            assert streamedContent(list(parsed)) == echoContent()
        else:
            assert isinstance(parsed, ChatCompletion)
            assert parsed.choices[0].message.content == echoContent()
        received = forwarding.received(requestID, count=len(before) + 1)
        assert [each.body["model"] for each in received] == [*before, "echo"]
        assert received[-1].path == "/v1/chat/completions"


@pytest.mark.parametrize("model", ["via-400", "via-422"])
def test_rejectedTriesNoFallback(forwarding: Forwarding, model: str) -> None:
    """
    UPSTREAM_REJECTED (the provider refused the request itself) answers at
    once with the provider's status, without trying the fallback. (Every
    attempt is sent before the client's answer, so the upstream's log is
    complete once the SDK has its error.)
    """
    status = int(MODELS[model].upstreamModel(model).split(":")[1])
    for stream in (False, True):
        with pytest.raises(openai.APIStatusError) as raised:
            forwarding.client().chat.completions.create(
                model=model, messages=messages(), stream=stream
            )
        assert raised.value.status_code == status
        body = raised.value.body
        assert isinstance(body, dict)
        assert body["code"] == "UPSTREAM_REJECTED"
        received = forwarding.received(body["request_id"])
        assert [each.body["model"] for each in received] == [f"status:{status}"]


def test_nestedFallbacksDepthFirst(forwarding: Forwarding) -> None:
    """
    Fallbacks are tried in order, each followed by its own (depth first):
    nest-a (500), nest-b (reset), nest-b's nest-d (503), then nest-c, which
    answers and is named in X-SVC-Upstream-Model.
    """
    raw = forwarding.client().chat.completions.with_raw_response.create(
        model="nest-a", messages=messages()
    )
    assert raw.headers["x-svc-upstream-model"] == "nest-c"
    assert raw.parse().choices[0].message.content == echoContent()
    received = forwarding.received(raw.headers["x-request-id"], count=4)
    assert [(each.path, each.body["model"]) for each in received] == [
        ("/v1/chat/completions", "status:500"),
        ("/other/v1/chat/completions", "reset"),
        ("/v1/chat/completions", "status:503"),
        ("/other/v1/chat/completions", "echo"),
    ]


def test_allAttemptsFailLastOnesError(forwarding: Forwarding) -> None:
    """
    When every attempt fails, the answer is the last one's error: 429 with
    its Retry-After after a 503, and 502 (no Retry-After) after a 429.
    """
    client = forwarding.client()
    with pytest.raises(openai.RateLimitError) as limited:
        client.chat.completions.create(model="all-fail-429-last", messages=messages())
    body = assertEnvelopeOf(limited.value, 429, "UPSTREAM_RATE_LIMITED", openai.RateLimitError)
    assert limited.value.response.headers["retry-after"] == "7"
    received = forwarding.received(body["request_id"], count=2)
    assert [each.body["model"] for each in received] == ["status:503", "status:429"]

    with pytest.raises(openai.InternalServerError) as failed:
        client.chat.completions.create(model="all-fail-503-last", messages=messages())
    body = assertEnvelopeOf(failed.value, 502, "UPSTREAM_ERROR", openai.InternalServerError)
    assert "retry-after" not in failed.value.response.headers
    received = forwarding.received(body["request_id"], count=2)
    assert [each.body["model"] for each in received] == ["status:429", "status:503"]


def test_fallbackOfAnotherOrganizationIsSkipped(forwarding: Forwarding) -> None:
    """
    A fallback allowed to another organization only is never tried for
    this one: its error is the first attempt's.
    """
    raw = forwarding.client("main").chat.completions.with_raw_response.create(
        model="to-private", messages=messages()
    )
    assert raw.headers["x-svc-upstream-model"] == "private"
    with pytest.raises(openai.InternalServerError) as raised:
        forwarding.client("other").chat.completions.create(model="to-private", messages=messages())
    body = assertEnvelopeOf(raised.value, 502, "UPSTREAM_ERROR", openai.InternalServerError)
    received = forwarding.received(body["request_id"])
    assert [each.body["model"] for each in received] == ["status:503"]


# Faults after the first byte


def test_closedMidStreamEndsWithOneErrorEvent(forwarding: Forwarding) -> None:
    """
    An upstream that closes mid-stream: the events it sent are relayed,
    then one error event with the envelope (UPSTREAM_ERROR, the request
    id), no [DONE], and no fallback; the SDK raises while iterating.
    """
    answer = forwarding.rawChat(chatBody("via-close-mid-stream", stream=True))
    assert answer.status == 200
    assert answer.headers["x-svc-upstream-model"] == "via-close-mid-stream"
    requestID = assertGatewayHeaders(answer.headers)
    events = sseEvents(answer.body)
    assert b"[DONE]" not in events
    assert len(events) == 4, events
    error = json.loads(events[-1])["error"]
    assert error["code"] == "UPSTREAM_ERROR" and error["request_id"] == requestID
    assert all("error" not in json.loads(event) for event in events[:-1])
    received = forwarding.received(requestID)
    assert [each.body["model"] for each in received] == ["close-mid-stream"]

    stream = forwarding.client().chat.completions.create(
        model="close-mid-stream", messages=messages(), stream=True
    )
    seen = []
    with pytest.raises(openai.APIError) as raised:
        for chunk in stream:
            seen.append(chunk)
    assert len(seen) == 3
    body = raised.value.body
    assert isinstance(body, dict)
    assert body["code"] == "UPSTREAM_ERROR"
    assert body["request_id"] == stream.response.headers["x-request-id"]


def test_stalledStreamEndsWithTimeoutEvent(forwarding: Forwarding) -> None:
    """
    A stream whose next event does not come within idle_timeout: the
    events so far, then one error event UPSTREAM_TIMEOUT, no [DONE]; the
    upstream request is closed.
    """
    started = time.monotonic()
    stream = forwarding.client().chat.completions.create(
        model="stall", messages=messages(), stream=True
    )
    seen = []
    with pytest.raises(openai.APIError) as raised:
        for chunk in stream:
            seen.append(chunk)
    assert time.monotonic() - started >= IMPATIENT_IDLE_TIMEOUT
    assert len(seen) == 1 and seen[0].choices[0].delta.role == "assistant"
    requestID = stream.response.headers["x-request-id"]
    body = raised.value.body
    assert isinstance(body, dict)
    assert body["code"] == "UPSTREAM_TIMEOUT"
    assert body["request_id"] == requestID
    (received,) = forwarding.received(requestID)
    assert received.outcome == "clientGone"
