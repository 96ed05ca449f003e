"""
The scripted upstream of L{svcd.devkit.upstream} is what svc-proxy's
forwarding is tested against, so it must itself be OpenAI-compatible and do
what its grammar says. The official C{openai} SDK, pointed straight at it,
is the judge of compatibility; raw sockets check what the SDK cannot see
(backpressure, bytes that keep coming).

Most tests share one server (module scope) to keep the module fast; those
that read the request log empty it first, and those that count connections
or need an API key start their own.
"""

from __future__ import annotations

import base64
import http.client
import json
import socket
import struct
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from svcd.devkit.upstream.client import ConnectionCounts, RecordedRequest, ScriptedUpstream
from svcd.devkit.upstream.content import DEFAULT_EMBEDDING_DIMENSIONS, embeddingOf
from svcd.devkit.upstream.script import DEFAULT_RETRY_AFTER, Script, ScriptError, parseScript

# Starts real daemons or processes (conftest.py, pytest.ini): left out of a
# quick run, dev/test -m "not e2e".
pytestmark = pytest.mark.e2e

MESSAGES: list[ChatCompletionMessageParam] = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Say hello to the test suite"},
]

# What echo answers to MESSAGES: 2 messages, the last 27 characters long;
# prompt tokens are the words of both messages (3 + 6), completion tokens
# the 10 words of the answer.
ECHO_CONTENT = "Scripted answer to 2 messages; the last has 27 characters."
ECHO_USAGE = {"prompt_tokens": 9, "completion_tokens": 10, "total_tokens": 19}


@pytest.fixture(scope="module")
def upstream(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ScriptedUpstream]:
    """
    One scripted upstream for the tests of this module that neither count
    connections nor need a key.
    """
    server = ScriptedUpstream(tmp_path_factory.mktemp("upstream")).start()
    yield server
    server.stop()


@pytest.fixture
def client(upstream: ScriptedUpstream) -> Iterator[openai.OpenAI]:
    """
    The official SDK pointed straight at the shared upstream, with no
    retries (the SDK retries 429 and 5xx by default, which would hide what
    the upstream answered).
    """
    with openai.OpenAI(
        base_url=upstream.baseURL, api_key="sk-test-key", max_retries=0, timeout=10.0
    ) as sdk:
        yield sdk


def waitFor(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the condition did not hold in time"
        time.sleep(0.02)


# The grammar, without a server.


def test_plainModelNamesEcho() -> None:
    """
    A model name that is not made of directives (what a gateway forwards
    for real models) is a plain echo.
    """
    assert parseScript("gpt-4o") == Script()
    assert parseScript("llama-3.1-8b") == Script()
    assert parseScript("echo") == Script()
    assert parseScript("slowly:5") == Script()


def test_directivesCombine() -> None:
    """
    Delivery directives combine with one answer kind, in any order.
    """
    assert parseScript("gap:50+events:20") == Script(kind="events", count=20, gap=0.05)
    assert parseScript("status:503+slow:200") == Script(kind="status", count=503, delay=0.2)
    assert parseScript("no-usage") == Script(usage=False)
    assert parseScript("hold:250+stall-stream") == Script(kind="stall-stream", hold=0.25)
    assert parseScript("status:429") == Script(
        kind="status", count=429, retryAfter=DEFAULT_RETRY_AFTER
    )
    assert parseScript("status:429:3").retryAfter == 3
    assert parseScript("status:429:0").retryAfter is None
    assert parseScript("status:500").retryAfter is None
    assert parseScript("usage:1200:300+slow:5") == Script(delay=0.005, counts=(1200, 300))
    assert parseScript("never-ending+usage:7:3:2:1") == Script(
        kind="never-ending", counts=(7, 3, 2, 1)
    )
    assert parseScript("usage-at-cap") == Script(capFactor=1)
    assert parseScript("gap:5+usage-over-cap") == Script(gap=0.005, capFactor=2)
    assert parseScript("usage-over-cap:10+events:3") == Script(kind="events", count=3, capFactor=10)


@pytest.mark.parametrize(
    "model",
    [
        "status:42",
        "status:abc",
        "status:500:3",
        "status",
        "slow",
        "slow:-1",
        "events:many",
        "reset:1",
        "reset+close-mid-stream",
        "slow:1+slow:2",
        "usage",
        "usage:10",
        "usage:10:5:1",
        "usage:10:5:11:0",
        "usage:10:5:0:6",
        "usage:10:5+no-usage",
        "usage-at-cap:2",
        "usage-over-cap:1",
        "usage-over-cap:2:3",
        "usage-at-cap+usage-over-cap",
        "usage-at-cap+usage:1:2",
        "usage-over-cap+no-usage",
    ],
)
def test_misusedDirectivesAreErrors(model: str) -> None:
    """
    Known directives used wrongly are an error, never silently an echo: a
    test with a typo in its script must not pass by chance.
    """
    with pytest.raises(ScriptError):
        parseScript(model)


# Compatibility with the official SDK.


def test_completion(client: openai.OpenAI) -> None:
    """
    A non-streaming completion parses into the SDK's ChatCompletion with
    the echo content, the request's model, and usage.
    """
    completion = client.chat.completions.create(model="echo", messages=MESSAGES)
    assert completion.object == "chat.completion"
    assert completion.model == "echo"
    assert completion.choices[0].message.role == "assistant"
    assert completion.choices[0].message.content == ECHO_CONTENT
    assert completion.choices[0].finish_reason == "stop"
    assert completion.usage is not None
    assert completion.usage.model_dump(include=set(ECHO_USAGE)) == ECHO_USAGE


def test_realModelNameEchoes(client: openai.OpenAI) -> None:
    """
    A real model name gets a normal answer naming that model.
    """
    completion = client.chat.completions.create(model="llama-3.1-8b", messages=MESSAGES)
    assert completion.model == "llama-3.1-8b"
    assert completion.choices[0].message.content == ECHO_CONTENT


def test_streamWithoutUsage(client: openai.OpenAI) -> None:
    """
    A stream is chat.completion.chunk events: the role first, content
    deltas that add up to the non-streaming content, a final chunk with
    finish_reason, and no usage chunk when none was asked for.
    """
    chunks = list(client.chat.completions.create(model="echo", messages=MESSAGES, stream=True))
    assert all(chunk.object == "chat.completion.chunk" for chunk in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks) == ECHO_CONTENT
    assert len(chunks) > 5, "several content deltas"
    assert all(chunk.usage is None and chunk.choices for chunk in chunks)


def test_streamWithUsage(client: openai.OpenAI) -> None:
    """
    With C{stream_options.include_usage}, the stream ends with one chunk
    whose choices are empty and whose usage is the non-streaming usage.
    """
    chunks = list(
        client.chat.completions.create(
            model="echo",
            messages=MESSAGES,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    *content, usage = chunks
    assert usage.choices == []
    assert usage.usage is not None
    assert usage.usage.model_dump(include=set(ECHO_USAGE)) == ECHO_USAGE
    assert content[-1].choices[0].finish_reason == "stop"
    assert all(chunk.usage is None for chunk in content)


def test_shapedUsage(client: openai.OpenAI) -> None:
    """
    C{usage:<prompt>:<completion>} says those counts, without details, in
    the completion and in a stream's usage chunk; with cached and
    reasoning counts too, OpenAI's C{prompt_tokens_details} and
    C{completion_tokens_details} carry them. The content stays the echo's.
    """
    plain = client.chat.completions.create(model="usage:1200:300", messages=MESSAGES)
    assert plain.choices[0].message.content == ECHO_CONTENT
    assert plain.usage is not None
    assert plain.usage.model_dump(exclude_none=True) == {
        "prompt_tokens": 1200,
        "completion_tokens": 300,
        "total_tokens": 1500,
    }
    chunks = list(
        client.chat.completions.create(
            model="usage:1234:321:1000:77",
            messages=MESSAGES,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    usage = chunks[-1].usage
    assert usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (1234, 321, 1555)
    assert usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == 1000
    assert usage.completion_tokens_details is not None
    assert usage.completion_tokens_details.reasoning_tokens == 77


def _postRaw(upstream: ScriptedUpstream, body: bytes) -> tuple[int, bytes]:
    connection = http.client.HTTPConnection(upstream.host, upstream.port, timeout=10)
    try:
        connection.request(
            "POST", "/v1/chat/completions", body, {"Content-Type": "application/json"}
        )
        answer = connection.getresponse()
        return answer.status, answer.read()
    finally:
        connection.close()


# A body of 127 bytes, counted by hand: 77 up to the caps, 50 from them.
CAPPED_BODY = (
    b'{"model":"usage-at-cap","messages":[{"role":"user","content":"12345 67890"}],'
    b'"max_completion_tokens":250,"max_tokens":40,"n":3}'
)


def test_usageAtCap(upstream: ScriptedUpstream) -> None:
    """
    C{usage-at-cap}: the usage is the most the request allows, the body's
    bytes for the prompt and its larger cap times its n for the answer,
    in a completion and in a stream's usage chunk.
    """
    assert len(CAPPED_BODY) == 77 + 50
    status, answer = _postRaw(upstream, CAPPED_BODY)
    assert status == 200
    assert json.loads(answer)["usage"] == {
        "prompt_tokens": 127,
        "completion_tokens": 250 * 3,
        "total_tokens": 127 + 750,
    }
    # One cap, no n: that cap once; a stream says the same in its chunk.
    streamed = (
        b'{"model":"usage-at-cap","messages":[{"role":"user","content":"x"}],"max_tokens":7,'
        b'"stream":true,"stream_options":{"include_usage":true}}'
    )
    status, events = _postRaw(upstream, streamed)
    assert status == 200
    usage = json.loads(events.decode().split("\n\n")[-3].removeprefix("data: "))["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (len(streamed), 7)


def test_usageOverCap(upstream: ScriptedUpstream) -> None:
    """
    C{usage-over-cap}: twice the most the request allows by default, or
    the factor given: a provider that ignored its cap.
    """
    status, answer = _postRaw(upstream, CAPPED_BODY.replace(b"usage-at-cap", b"usage-over-cap"))
    assert status == 200
    # "usage-over-cap" is 2 bytes longer than "usage-at-cap".
    assert json.loads(answer)["usage"]["prompt_tokens"] == 127 + 2
    assert json.loads(answer)["usage"]["completion_tokens"] == 250 * 3 * 2
    status, answer = _postRaw(upstream, CAPPED_BODY.replace(b"usage-at-cap", b"usage-over-cap:5"))
    assert json.loads(answer)["usage"]["completion_tokens"] == 250 * 3 * 5


@pytest.mark.parametrize(
    "extra",
    [b"", b',"max_tokens":0', b',"max_completion_tokens":"9"', b',"max_tokens":9,"n":0'],
    ids=["no cap", "zero cap", "cap not a number", "zero choices"],
)
def test_usageAtCapWithoutACapIsRefused(upstream: ScriptedUpstream, extra: bytes) -> None:
    """
    A request without a usable cap gets 400 from C{usage-at-cap}: a test
    sees that the gateway sent none instead of a made-up usage.
    """
    body = b'{"model":"usage-at-cap","messages":[{"role":"user","content":"x"}]' + extra + b"}"
    status, answer = _postRaw(upstream, body)
    assert status == 400
    assert b"usage-at-cap" in answer


def test_noUsage(client: openai.OpenAI) -> None:
    """
    C{no-usage} answers as providers that report no usage do: none in the
    completion, and no usage chunk even when asked.
    """
    completion = client.chat.completions.create(model="no-usage", messages=MESSAGES)
    assert completion.usage is None
    chunks = list(
        client.chat.completions.create(
            model="no-usage",
            messages=MESSAGES,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert all(chunk.choices for chunk in chunks)


def test_rawResponseHeaders(client: openai.OpenAI) -> None:
    """
    C{with_raw_response} shows the answer's headers (OpenAI's own
    x-request-id among them) and still parses the completion.
    """
    raw = client.chat.completions.with_raw_response.create(model="echo", messages=MESSAGES)
    assert raw.status_code == 200
    assert raw.headers["content-type"] == "application/json"
    assert raw.headers["x-request-id"].startswith("req_scripted_")
    assert raw.parse().choices[0].message.content == ECHO_CONTENT


def test_streamIsChunkedEventStream(upstream: ScriptedUpstream) -> None:
    """
    A stream goes out as text/event-stream with chunked transfer encoding
    and ends with C{data: [DONE]}.
    """
    connection = http.client.HTTPConnection(upstream.host, upstream.port, timeout=10)
    body = json.dumps({"model": "echo", "messages": MESSAGES, "stream": True})
    connection.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    answer = connection.getresponse()
    assert answer.getheader("content-type") == "text/event-stream"
    assert answer.getheader("transfer-encoding") == "chunked"
    events = answer.read().decode().split("\n\n")
    connection.close()
    assert events[-2:] == ["data: [DONE]", ""]
    assert all(event.startswith("data: {") for event in events[:-2])


def test_modelsList(client: openai.OpenAI) -> None:
    """
    C{models.list()} reads the OpenAI list shape.
    """
    models = [model.id for model in client.models.list()]
    assert "echo" in models


def test_otherPrefix(upstream: ScriptedUpstream) -> None:
    """
    The same routes answer under another base path, and the log tells the
    two apart: one server can stand for two providers.
    """
    upstream.clearRequests()
    with openai.OpenAI(
        base_url=upstream.baseURLUnder("other"), api_key="k", max_retries=0
    ) as other:
        completion = other.chat.completions.create(model="echo", messages=MESSAGES)
    assert completion.choices[0].message.content == ECHO_CONTENT
    assert [request.path for request in upstream.requests()] == ["/other/v1/chat/completions"]


# Faults, as the SDK sees them.


@pytest.mark.parametrize(
    ("model", "retryAfter"), [("status:429", "7"), ("status:429:3", "3"), ("status:429:0", None)]
)
def test_rateLimited(client: openai.OpenAI, model: str, retryAfter: str | None) -> None:
    """
    C{status:429} raises the SDK's RateLimitError, with the Retry-After
    the script chose visible on the answer.
    """
    with pytest.raises(openai.RateLimitError) as raised:
        client.chat.completions.create(model=model, messages=MESSAGES)
    assert raised.value.status_code == 429
    assert raised.value.response.headers.get("retry-after") == retryAfter
    assert raised.value.code == "rate_limit_exceeded"


def test_internalServerError(upstream: ScriptedUpstream, client: openai.OpenAI) -> None:
    """
    C{status:500} raises InternalServerError; with max_retries=0 the
    upstream saw exactly one request.
    """
    upstream.clearRequests()
    with pytest.raises(openai.InternalServerError) as raised:
        client.chat.completions.create(model="status:500", messages=MESSAGES)
    assert raised.value.status_code == 500
    assert raised.value.type == "server_error"
    assert [request.status for request in upstream.requests()] == [500]


def test_badRequest(client: openai.OpenAI) -> None:
    """
    C{status:400} raises BadRequestError carrying the upstream's message:
    what a gateway must pass on as the detail of UPSTREAM_REJECTED.
    """
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model="status:400", messages=MESSAGES)
    assert isinstance(raised.value.body, dict)
    assert raised.value.body["message"] == "Scripted error 400 for model 'status:400'."
    assert raised.value.type == "invalid_request_error"


def test_badScriptIsBadRequest(client: openai.OpenAI) -> None:
    """
    A misused directive answers 400 saying what is wrong with it.
    """
    with pytest.raises(openai.BadRequestError, match="status takes a whole number"):
        client.chat.completions.create(model="status:42", messages=MESSAGES)


def test_closeMidStream(upstream: ScriptedUpstream, client: openai.OpenAI) -> None:
    """
    C{close-mid-stream} delivers its first events, then the SDK raises
    while iterating: the stream ended without its terminating chunk. The
    log calls it aborted.
    """
    upstream.clearRequests()
    stream = client.chat.completions.create(
        model="close-mid-stream", messages=MESSAGES, stream=True
    )
    received = []
    with pytest.raises(openai.APIConnectionError):
        for chunk in stream:
            received.append(chunk)
    assert len(received) == 3
    (request,) = upstream.waitUntilEnded()
    assert (request.outcome, request.eventsSent) == ("aborted", 3)


def test_closeMidAnswer(client: openai.OpenAI) -> None:
    """
    Without streaming, C{close-mid-stream} closes the connection halfway
    through a body of announced length: a connection error for the SDK.
    """
    with pytest.raises(openai.APIConnectionError):
        client.chat.completions.create(model="close-mid-stream", messages=MESSAGES)


def test_reset(client: openai.OpenAI) -> None:
    """
    C{reset} aborts the connection before any answer.
    """
    with pytest.raises(openai.APIConnectionError):
        client.chat.completions.create(model="reset", messages=MESSAGES)


def test_slowAnswerTimesOut(upstream: ScriptedUpstream, client: openai.OpenAI) -> None:
    """
    C{slow:<ms>} holds the answer back: a client with a shorter timeout
    raises APITimeoutError, and the log shows the client gone.
    """
    upstream.clearRequests()
    started = time.monotonic()
    with pytest.raises(openai.APITimeoutError):
        client.with_options(timeout=0.3).chat.completions.create(
            model="slow:5000", messages=MESSAGES
        )
    assert time.monotonic() - started < 4.0
    (request,) = upstream.waitUntilEnded()
    assert request.outcome == "clientGone"
    assert request.status is None


def test_slowAnswerArrives(client: openai.OpenAI) -> None:
    """
    A slow answer within the client's timeout arrives whole, no sooner
    than the script said.
    """
    started = time.monotonic()
    completion = client.chat.completions.create(model="slow:200", messages=MESSAGES)
    assert time.monotonic() - started >= 0.2
    assert completion.choices[0].message.content == ECHO_CONTENT


@pytest.mark.parametrize("stream", [False, True])
def test_holdSendsHeadersFirst(upstream: ScriptedUpstream, stream: bool) -> None:
    """
    C{hold:<ms>} sends the headers at once and holds the body back: the
    status arrives while a read of the body times out.
    """
    connection = http.client.HTTPConnection(upstream.host, upstream.port, timeout=10)
    body = json.dumps({"model": "hold:60000", "messages": MESSAGES, "stream": stream})
    connection.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    answer = connection.getresponse()
    assert answer.status == 200
    assert connection.sock is not None
    connection.sock.settimeout(0.2)
    with pytest.raises(TimeoutError):
        answer.read1(100)
    connection.close()


def test_heldAnswerArrives(client: openai.OpenAI) -> None:
    """
    A held answer arrives whole once the hold is over, streamed or not.
    """
    completion = client.chat.completions.create(model="hold:100", messages=MESSAGES)
    assert completion.choices[0].message.content == ECHO_CONTENT
    chunks = client.chat.completions.create(model="hold:100", messages=MESSAGES, stream=True)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks) == ECHO_CONTENT


def test_stallStream(client: openai.OpenAI) -> None:
    """
    C{stall-stream} sends the headers and the role event, then nothing: a
    read timeout for the client.
    """
    stream = client.with_options(timeout=0.3).chat.completions.create(
        model="stall-stream", messages=MESSAGES, stream=True
    )
    received = []
    with pytest.raises(openai.APITimeoutError):
        for chunk in stream:
            received.append(chunk)
    assert [chunk.choices[0].delta.role for chunk in received] == ["assistant"]


def test_gapSpacesEvents(client: openai.OpenAI) -> None:
    """
    C{gap:<ms>} spaces the stream's events: six events (role, three
    contents, finish, [DONE]) take at least five gaps.
    """
    started = time.monotonic()
    chunks = list(
        client.chat.completions.create(model="gap:40+events:3", messages=MESSAGES, stream=True)
    )
    assert time.monotonic() - started >= 5 * 0.04
    assert len(chunks) == 5


def test_bytes(client: openai.OpenAI) -> None:
    """
    C{bytes:<n>} answers n characters of content, streamed or not.
    """
    completion = client.chat.completions.create(model="bytes:100000", messages=MESSAGES)
    assert len(completion.choices[0].message.content or "") == 100_000
    chunks = client.chat.completions.create(model="bytes:1000", messages=MESSAGES, stream=True)
    assert sum(len(chunk.choices[0].delta.content or "") for chunk in chunks) == 1000


def test_notJSON(upstream: ScriptedUpstream) -> None:
    """
    C{not-json} answers 200 claiming JSON with a body that is none, and
    as a stream an event whose data is none.
    """
    connection = http.client.HTTPConnection(upstream.host, upstream.port, timeout=10)
    body = json.dumps({"model": "not-json", "messages": MESSAGES})
    connection.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    answer = connection.getresponse()
    assert (answer.status, answer.getheader("content-type")) == (200, "application/json")
    with pytest.raises(ValueError):
        json.loads(answer.read())
    body = json.dumps({"model": "not-json", "messages": MESSAGES, "stream": True})
    connection.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    answer = connection.getresponse()
    assert answer.read() == b"data: this is not JSON\n\ndata: [DONE]\n\n"
    connection.close()


def test_neverEndingAnswerKeepsSendingBytes(upstream: ScriptedUpstream) -> None:
    """
    Without streaming, C{never-ending} is a 200 whose body keeps coming, a
    byte of JSON whitespace at a time, and never completes.
    """
    connection = http.client.HTTPConnection(upstream.host, upstream.port, timeout=10)
    body = json.dumps({"model": "gap:20+never-ending", "messages": MESSAGES})
    connection.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    answer = connection.getresponse()
    assert answer.status == 200
    received = b""
    while len(received) < 5:
        received += answer.read1(100)
    assert received.isspace()
    connection.close()


# The request log and the connection counts.


def test_requestLog(upstream: ScriptedUpstream, client: openai.OpenAI) -> None:
    """
    The log holds each request's method, path, every header and the parsed
    body, with the time it arrived and ended.
    """
    upstream.clearRequests()
    before = time.monotonic()
    client.chat.completions.create(
        model="echo",
        messages=MESSAGES,
        temperature=0.5,
        extra_headers={"X-Request-ID": "req-123"},
        extra_body={"unknown_key": {"kept": True}},
    )
    (request,) = upstream.requests()
    assert isinstance(request, RecordedRequest)
    assert (request.method, request.path, request.query) == ("POST", "/v1/chat/completions", "")
    assert request.header("Authorization") == "Bearer sk-test-key"
    assert request.header("x-request-id") == "req-123"
    assert request.header("content-type") == "application/json"
    assert request.body == {
        "model": "echo",
        "messages": MESSAGES,
        "temperature": 0.5,
        "unknown_key": {"kept": True},
    }
    assert request.bodyText is None
    assert request.bodyLength > 0
    assert (request.status, request.outcome) == (200, "finished")
    assert request.ended is not None
    assert before <= request.arrived <= request.ended <= time.monotonic()


def test_requestLogKeepsBodiesThatAreNotJSON(upstream: ScriptedUpstream) -> None:
    """
    A body that is not JSON is kept as text (and answered 400, as OpenAI
    would).
    """
    upstream.clearRequests()
    connection = http.client.HTTPConnection(upstream.host, upstream.port, timeout=10)
    connection.request("POST", "/v1/chat/completions?x=1", b"{not json")
    assert connection.getresponse().status == 400
    connection.close()
    (request,) = upstream.requests()
    assert (request.body, request.bodyText, request.query) == (None, "{not json", "x=1")


def test_clientClosingStreamEarlyIsRecorded(
    upstream: ScriptedUpstream, client: openai.OpenAI
) -> None:
    """
    When the client closes a never-ending stream, the log records when
    the connection was lost, soon after the client closed it: what a test
    of the gateway uses to check that it closed its upstream request.
    """
    upstream.clearRequests()
    stream = client.chat.completions.create(model="never-ending", messages=MESSAGES, stream=True)
    for received, _ in enumerate(stream, start=1):
        if received == 3:
            break
    closedAt = time.monotonic()
    stream.close()
    (request,) = upstream.waitUntilEnded(timeout=5.0)
    assert request.outcome == "clientGone"
    assert request.ended is not None
    assert closedAt <= request.ended < closedAt + 1.0
    assert request.eventsSent >= 3


def test_apiKey(startScriptedUpstream: Callable[..., ScriptedUpstream]) -> None:
    """
    With an API key, a request without the right bearer token gets 401
    (AuthenticationError for the SDK) and one with it is answered.
    """
    upstream = startScriptedUpstream(apiKey="sk-upstream")
    with openai.OpenAI(base_url=upstream.baseURL, api_key="sk-wrong", max_retries=0) as wrong:
        with pytest.raises(openai.AuthenticationError) as raised:
            wrong.chat.completions.create(model="echo", messages=MESSAGES)
        assert raised.value.code == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            wrong.models.list()
    with openai.OpenAI(base_url=upstream.baseURL, api_key="sk-upstream", max_retries=0) as right:
        completion = right.chat.completions.create(model="echo", messages=MESSAGES)
    assert completion.choices[0].message.content == ECHO_CONTENT
    assert [request.status for request in upstream.requests()] == [401, 401, 200]


def test_connectionCounts(scriptedUpstream: ScriptedUpstream) -> None:
    """
    The connection counts show a client's pooled connection: open while
    the client keeps it, one accepted for several requests, none open once
    the client is closed. The control queries themselves count nowhere.
    """
    assert scriptedUpstream.connections() == ConnectionCounts(open=0, accepted=0)
    with openai.OpenAI(base_url=scriptedUpstream.baseURL, api_key="k", max_retries=0) as sdk:
        for _ in range(3):
            sdk.chat.completions.create(model="echo", messages=MESSAGES)
        counts = scriptedUpstream.connections()
        assert (counts.open, counts.accepted) == (1, 1)
        ports = {request.clientPort for request in scriptedUpstream.requests()}
        assert len(ports) == 1, "the three requests shared one connection"
    waitFor(lambda: scriptedUpstream.connections().open == 0)
    assert scriptedUpstream.connections().accepted == 1


def test_eventsRespectBackpressure(upstream: ScriptedUpstream) -> None:
    """
    C{events:<n>} writes only as fast as its reader reads: while nobody
    reads, the upstream stops once the buffers are full, far short of n;
    once read, the whole stream arrives.
    """
    upstream.clearRequests()
    # About 15 MB, more than the loopback connection's buffers hold (the
    # upstream stops at 3 MB or so).
    count = 30_000
    body = json.dumps({"model": f"events:{count}", "messages": MESSAGES, "stream": True})
    request = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: upstream\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}"
    )
    with socket.create_connection((upstream.host, upstream.port), timeout=10) as connection:
        connection.sendall(request.encode())
        # Poll until the upstream has stopped writing: the same count on
        # several reads in a row.
        readings: list[int] = []

        def settled() -> bool:
            log = upstream.requests()
            readings.append(log[0].eventsSent if log else 0)
            return len(readings) >= 5 and readings[-1] > 0 and len(set(readings[-5:])) == 1

        waitFor(settled, timeout=20.0)
        assert readings[-1] < count / 2, f"wrote {readings[-1]} of {count} with no reader"
        chunks: list[bytes] = []
        ending = b"data: [DONE]\n\n\r\n0\r\n\r\n"
        while not b"".join(chunks[-2:]).endswith(ending):
            chunk = connection.recv(1 << 20)
            assert chunk, "the stream ended early"
            chunks.append(chunk)
    assert b"".join(chunks).count(b'"content": "event ') == count
    (record,) = upstream.waitUntilEnded()
    assert (record.outcome, record.eventsSent) == ("finished", count + 3)


# Embeddings (decisions D13)


def _cosine(left: list[float], right: list[float]) -> float:
    return sum(a * b for a, b in zip(left, right, strict=True))


def _postEmbeddings(upstream: ScriptedUpstream, body: object) -> tuple[int, dict[str, object]]:
    connection = http.client.HTTPConnection(upstream.host, upstream.port, timeout=10)
    try:
        connection.request(
            "POST",
            "/v1/embeddings",
            body=json.dumps(body),
            headers={"Content-Type": "application/json"},
        )
        answer = connection.getresponse()
        return answer.status, json.loads(answer.read())
    finally:
        connection.close()


def test_embeddingsThroughTheSDK(client: openai.OpenAI) -> None:
    """
    The SDK's embeddings.create works against the scripted upstream, in
    both encodings (the SDK asks for base64 unless told otherwise, and
    decodes it): one unit vector per input, in order, of the default 64
    dimensions, the same in both; texts that share words are near, texts
    that share none are not; prompt_tokens counts the inputs' words.
    """
    texts = ["the cat sat on the mat", "the cat ran", "quantum chromodynamics"]
    decoded = client.embeddings.create(model="text-embedding-3-small", input=texts)
    floats = client.embeddings.create(
        model="text-embedding-3-small", input=texts, encoding_format="float"
    )
    assert decoded.object == "list" and decoded.model == "text-embedding-3-small"
    assert [item.index for item in decoded.data] == [0, 1, 2]
    vectors = [item.embedding for item in decoded.data]
    assert vectors == [item.embedding for item in floats.data]
    assert vectors == [embeddingOf(text, DEFAULT_EMBEDDING_DIMENSIONS)[0] for text in texts]
    assert all(len(vector) == 64 for vector in vectors)
    assert all(abs(_cosine(vector, vector) - 1) < 1e-6 for vector in vectors)
    assert _cosine(vectors[0], vectors[1]) > 0.5
    assert abs(_cosine(vectors[0], vectors[2])) < 0.3
    assert (decoded.usage.prompt_tokens, decoded.usage.total_tokens) == (11, 11)


def test_embeddingsAreDeterministicAndHonourDimensions(client: openai.OpenAI) -> None:
    """
    The same text always has the same vector; a request's dimensions sets
    its length; base64 is the little-endian float32 bytes of the vector.
    """
    first = client.embeddings.create(model="m", input="Hello, world", dimensions=8)
    second = client.embeddings.create(model="m", input="hello WORLD", dimensions=8)
    assert first.data[0].embedding == second.data[0].embedding
    assert len(first.data[0].embedding) == 8
    raw = client.embeddings.create(
        model="m", input="Hello, world", dimensions=8, encoding_format="base64"
    )
    relayed: object = raw.data[0].embedding
    assert relayed == base64.b64encode(embeddingOf("hello world", 8)[1]).decode()
    assert list(struct.unpack("<8f", base64.b64decode(str(relayed)))) == first.data[0].embedding


def test_theDefaultDimensionsAreConfigurable(tmp_path: Path) -> None:
    """
    --embedding-dimensions sets the length of vectors when a request names
    none.
    """
    upstream = ScriptedUpstream(tmp_path / "wide", embeddingDimensions=256).start()
    try:
        status, answer = _postEmbeddings(upstream, {"model": "m", "input": "x"})
        assert status == 200
        data = answer["data"]
        assert isinstance(data, list) and len(data[0]["embedding"]) == 256
    finally:
        upstream.stop()


@pytest.mark.parametrize(
    ("body", "status"),
    [
        ({"model": "status:503", "input": "x"}, 503),
        ({"model": "status:400", "input": "x"}, 400),
        ({"model": "m", "input": [1, 2, 3]}, 400),
        ({"model": "m", "input": []}, 400),
        ({"model": "m", "input": "x", "dimensions": 0}, 400),
        ({"model": "m", "input": "x", "encoding_format": "hex"}, 400),
        ({"model": "events:3", "input": "x"}, 400),
    ],
    ids=["503", "400", "token array", "no input", "dimensions 0", "hex", "events"],
)
def test_embeddingsFaults(upstream: ScriptedUpstream, body: object, status: int) -> None:
    """
    The grammar's faults apply to embeddings; what OpenAI would refuse
    (or the scripted server cannot make) is a 400 in OpenAI's shape.
    """
    answered, answer = _postEmbeddings(upstream, body)
    assert answered == status
    assert "error" in answer


def test_embeddingsUsageDirectives(upstream: ScriptedUpstream) -> None:
    """
    usage:<prompt>:<completion> sets prompt_tokens, no-usage leaves the
    usage out, usage-at-cap counts a token per byte of the body, and
    usage-over-cap:3 three times that; "stream": true is ignored.
    """
    upstream.clearRequests()
    _, shaped = _postEmbeddings(upstream, {"model": "usage:42:0", "input": "x"})
    assert shaped["usage"] == {"prompt_tokens": 42, "total_tokens": 42}
    _, bare = _postEmbeddings(upstream, {"model": "no-usage", "input": "x", "stream": True})
    assert "usage" not in bare and bare["object"] == "list"
    _, atCap = _postEmbeddings(upstream, {"model": "usage-at-cap", "input": "x"})
    _, overCap = _postEmbeddings(upstream, {"model": "usage-over-cap:3", "input": "x"})
    lengths = [each.bodyLength for each in upstream.requests()[2:]]
    assert atCap["usage"] == {"prompt_tokens": lengths[0], "total_tokens": lengths[0]}
    assert overCap["usage"] == {"prompt_tokens": 3 * lengths[1], "total_tokens": 3 * lengths[1]}
