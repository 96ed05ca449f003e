"""
The gateway that forwards to scripted providers, shared by
tests/test_gateway_forwarding.py and tests/test_gateway_forwarding_ops.py
(decisions D9, issue 12 item 6), and the helpers of those tests. Loaded
for every test module by tests/conftest.py (pytest_plugins); the gateway
starts only for a test that asks for C{forwarding}, once per run.

The gateway is real: `twistd -n svc-auth` and `twistd -n svc-proxy`
processes over a real PostgreSQL and Redis, forwarding to two scripted
upstreams (L{svcd.devkit.upstream}, real HTTP servers in processes of
their own). Its providers file, written by the fixture, has several
providers on the two upstreams (base paths C{/v1}, C{/other/v1} and more
on the first; the second started with C{--api-key} and reached with
C{api_key_env}), one on a closed port, an impatient one for the timeouts,
a patient one for the clients that go away, a narrow one
(C{max_connections = 2}), models whose C{upstream_model} is a script of
the upstream's grammar, fallbacks (nested), and a model allowed to one
organization only.

Tests find what the upstreams received by the C{X-Request-ID} the gateway
sent them, so they do not depend on each other's traffic; the machine may
be loaded, so every wait is a poll with a deadline.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import attrs
import openai
import pytest
from authfixtures import Tenant
from gatewayfixtures import Answer, Gateway, chat, request, runningGateway
from openai.types.chat import ChatCompletionMessageParam
from prometheus_client.parser import text_string_to_metric_families

from svcd.common.ids import parseUUID
from svcd.devkit.postgres import PostgresServer
from svcd.devkit.upstream.client import RecordedRequest, ScriptedUpstream

# The body limit of svc-proxy (SVC_MAX_REQUEST_BODY_BYTES's default).
BODY_LIMIT = 1024 * 1024

# What no line of the proxy's log may ever hold: every message these tests
# send holds it.
CONTENT_MARKER = "secret-content-" + uuid.uuid4().hex

# The key the keyed upstream expects, given to the proxy through
# api_key_env; and a key it does not expect (its 401 is the operator's
# fault: 502).
UPSTREAM_KEY = "sk-upstream-" + uuid.uuid4().hex
WRONG_KEY = "sk-wrong-" + uuid.uuid4().hex

# The timeouts of the impatient provider (the timeout tests wait for them).
IMPATIENT_TIMEOUT = 0.5
IMPATIENT_IDLE_TIMEOUT = 0.3

# The idle timeout of the provider of the backpressure test, which a client
# that pauses the stream for longer must not trip.
BRISK_IDLE_TIMEOUT = 1.5

# The narrow provider's bound on requests in flight.
NARROW_CONNECTIONS = 2

# events:<n> for the backpressure test: over 500 bytes each on the wire, so
# the whole answer is some 28 MB, far more than the socket buffers on its
# way (the upstream pauses after some 10,000 events).
LARGE_STREAM_EVENTS = 50_000
EVENT_BYTES = 500

# Headers the gateway itself sends upstream; anything else would have come
# from the client. (Twisted's Agent adds Host and Content-Length; an
# Accept-Encoding of the gateway's own HTTP client is tolerated, and checked
# to be not the client's.)
GATEWAY_HEADERS = {"host", "content-type", "content-length", "x-request-id", "traceparent"}


@attrs.frozen
class ModelRow:
    """
    One [[models]] table of the fixture's providers file.

    @ivar upstream: the upstream_model (a script of the grammar); None
        leaves it out (the name itself is sent).
    """

    provider: str
    upstream: str | None = None
    fallbacks: tuple[str, ...] = ()
    privateToMain: bool = False

    def upstreamModel(self, name: str) -> str:
        return self.upstream if self.upstream is not None else name


MODELS: dict[str, ModelRow] = {
    # Normal answers, on each provider that answers.
    "fast": ModelRow("local", "echo"),
    "other-path": ModelRow("other", "echo"),
    "keyed": ModelRow("keyed", "echo"),
    "private": ModelRow("local", "echo", privateToMain=True),
    "gap:100": ModelRow("local"),
    "large-stream": ModelRow("brisk", f"events:{LARGE_STREAM_EVENTS}"),
    "narrow": ModelRow("narrow", "slow:300"),
    "no-usage": ModelRow("local"),
    # Each fault of D9's table.
    "refused": ModelRow("closed", "echo"),
    "wrong-key": ModelRow("wrongkey", "echo"),
    "reset": ModelRow("local"),
    "status:500": ModelRow("local"),
    "status:502": ModelRow("local"),
    "status:503": ModelRow("local"),
    "status:401": ModelRow("local"),
    "status:403": ModelRow("local"),
    "status:404": ModelRow("local"),
    "status:400": ModelRow("local"),
    "status:409": ModelRow("local"),
    "status:422": ModelRow("local"),
    "status:429": ModelRow("local"),
    "status:429:0": ModelRow("local"),
    "not-json": ModelRow("local"),
    # Past the proxy's bound on a non-streaming answer (16 MiB).
    "huge-answer": ModelRow("local", "bytes:17000000"),
    "late": ModelRow("impatient", "slow:30000"),
    "late-body": ModelRow("impatient", "hold:30000"),
    "stall": ModelRow("impatient", "stall-stream"),
    "close-mid-stream": ModelRow("local"),
    # For the clients that go away: the provider would take its time.
    "endless": ModelRow("patient", "never-ending"),
    "slow-answer": ModelRow("patient", "slow:30000"),
    "slow-then-fast": ModelRow("patient", "slow:30000", ("fast",)),
    # Fallbacks: each fault, then "fast".
    "via-refused": ModelRow("closed", "echo", ("fast",)),
    "via-reset": ModelRow("local", "reset", ("fast",)),
    "via-503": ModelRow("local", "status:503", ("fast",)),
    "via-404": ModelRow("local", "status:404", ("fast",)),
    "via-wrong-key": ModelRow("wrongkey", "echo", ("fast",)),
    "via-429": ModelRow("local", "status:429", ("fast",)),
    "via-late": ModelRow("impatient", "slow:30000", ("fast",)),
    "via-late-body": ModelRow("impatient", "hold:30000", ("fast",)),
    "via-not-json": ModelRow("local", "not-json", ("fast",)),
    "via-close-mid-stream": ModelRow("local", "close-mid-stream", ("fast",)),
    "via-400": ModelRow("local", "status:400", ("fast",)),
    "via-422": ModelRow("local", "status:422", ("fast",)),
    # Nested: a, then b and b's own fallback d, then c (depth first).
    "nest-a": ModelRow("local", "status:500", ("nest-b", "nest-c")),
    "nest-b": ModelRow("other", "reset", ("nest-d",)),
    "nest-c": ModelRow("other", "echo"),
    "nest-d": ModelRow("local", "status:503"),
    # Every attempt fails: the last one's error.
    "all-fail-429-last": ModelRow("local", "status:503", ("status:429",)),
    "all-fail-503-last": ModelRow("local", "status:429", ("status:503",)),
    # A fallback the caller's organization may not use is skipped.
    "to-private": ModelRow("local", "status:503", ("private",)),
}

PROVIDER_OF = {name: row.provider for name, row in MODELS.items()}


@attrs.frozen
class Metrics:
    """
    The samples of one scrape of the proxy's /metrics, by name and labels.
    """

    text: str
    samples: Mapping[tuple[str, tuple[tuple[str, str], ...]], float]

    @classmethod
    def parse(cls, text: str) -> Metrics:
        samples = {
            (sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
        }
        return cls(text, samples)

    def value(self, name: str, **labels: str) -> float:
        return self.samples.get((name, tuple(sorted(labels.items()))), 0.0)

    def since(self, before: Metrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """
        What changed since C{before}: every sample that moved, by how much.
        """
        return {
            key: value - before.samples.get(key, 0.0)
            for key, value in self.samples.items()
            if value != before.samples.get(key, 0.0)
        }


@attrs.frozen
class Forwarding:
    """
    The module's gateway and its two upstreams.
    """

    gateway: Gateway
    upstream: ScriptedUpstream
    keyedUpstream: ScriptedUpstream

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.gateway.port}"

    def client(
        self,
        tenant: str = "main",
        headers: dict[str, str] | None = None,
        timeout: float = 30.0,
        token: str | None = None,
    ) -> openai.OpenAI:
        """
        The openai SDK pointed at the gateway as C{tenant}, without retries.
        """
        chosen = self.gateway.tenants[tenant]
        return openai.OpenAI(
            base_url=self.base + "/v1",
            api_key=token if token is not None else chosen.token,
            default_headers={"X-SVC-Agent-ID": str(chosen.agentID), **(headers or {})},
            max_retries=0,
            timeout=timeout,
        )

    def received(
        self, requestID: str, count: int = 1, timeout: float = 10.0
    ) -> list[RecordedRequest]:
        """
        The requests the upstreams received for the gateway's request
        C{requestID}, in the order they arrived, once there are at least
        C{count} and every one has ended.
        """
        deadline = time.monotonic() + timeout
        while True:
            found = sorted(
                (
                    each
                    for upstream in (self.upstream, self.keyedUpstream)
                    for each in upstream.requests()
                    if each.header("x-request-id") == requestID
                ),
                key=lambda each: each.arrived,
            )
            if len(found) >= count and all(each.ended is not None for each in found):
                return found
            assert time.monotonic() < deadline, (
                f"the upstreams did not receive and end {count} request(s) for {requestID}: {found}"
            )
            time.sleep(0.02)

    def receivedNothing(self, requestID: str) -> bool:
        return not any(
            each.header("x-request-id") == requestID
            for upstream in (self.upstream, self.keyedUpstream)
            for each in upstream.requests()
        )

    def proxyLog(self) -> list[dict[str, Any]]:
        """
        Every JSON line the proxy has written so far.
        """
        return [
            json.loads(line)
            for line in self.gateway.proxy.output().splitlines()
            if line.startswith("{")
        ]

    def accessLine(self, requestID: str, timeout: float = 10.0) -> dict[str, Any]:
        """
        The access-log line of C{requestID} (lines are written in batches,
        at most 0.2 s late; a warning or worse at once, with every line
        before it).
        """
        deadline = time.monotonic() + timeout
        while True:
            for line in self.proxyLog():
                if line.get("request_id") == requestID and "route" in line:
                    return line
            assert time.monotonic() < deadline, f"no access-log line for {requestID}"
            time.sleep(0.05)

    def faultLines(self) -> list[dict[str, Any]]:
        """
        The proxy's lines at level error or critical.
        """
        return [line for line in self.proxyLog() if line["level"] in ("error", "critical")]

    def metrics(self) -> Metrics:
        answer = request(self.gateway.port, "GET", "/metrics")
        assert answer.status == 200
        return Metrics.parse(answer.body.decode())

    def rawChat(self, body: bytes, requestID: str | None = None, tenant: str = "main") -> Answer:
        """
        A chat request over plain HTTP (for what is on the wire), with its
        own request id when given.
        """
        headers = {"X-Request-ID": requestID} if requestID is not None else {}
        return chat(self.gateway.port, self.gateway.tenants[tenant], body=body, headers=headers)


def _providersFile(
    path: Path, upstream: ScriptedUpstream, keyed: ScriptedUpstream, mainOrg: str
) -> Path:
    providers: dict[str, dict[str, Any]] = {
        "local": {"base_url": upstream.baseURL, "timeout": "20s", "idle_timeout": "10s"},
        "other": {"base_url": upstream.baseURLUnder("other")},
        "keyed": {"base_url": keyed.baseURL, "api_key_env": "SVC_TEST_UPSTREAM_KEY"},
        "wrongkey": {
            "base_url": keyed.baseURLUnder("wrong"),
            "api_key_env": "SVC_TEST_WRONG_KEY",
        },
        # Port 1 of the loopback: nothing listens there, and no test may
        # bind it (it is privileged).
        "closed": {"base_url": "http://127.0.0.1:1/v1"},
        "impatient": {
            "base_url": upstream.baseURLUnder("impatient"),
            "timeout": f"{int(IMPATIENT_TIMEOUT * 1000)}ms",
            "idle_timeout": f"{int(IMPATIENT_IDLE_TIMEOUT * 1000)}ms",
        },
        "patient": {
            "base_url": upstream.baseURLUnder("patient"),
            "timeout": "60s",
            "idle_timeout": "60s",
        },
        "brisk": {
            "base_url": upstream.baseURLUnder("brisk"),
            "idle_timeout": f"{int(BRISK_IDLE_TIMEOUT * 1000)}ms",
        },
        "narrow": {
            "base_url": upstream.baseURLUnder("narrow"),
            "timeout": "30s",
            "max_connections": NARROW_CONNECTIONS,
        },
    }
    lines: list[str] = []
    for name, keys in providers.items():
        lines += ["[[providers]]", f"name = {json.dumps(name)}"]
        lines += [f"{key} = {json.dumps(value)}" for key, value in keys.items()]
        lines.append("")
    for name, row in MODELS.items():
        lines += [
            "[[models]]",
            f"name = {json.dumps(name)}",
            f"provider = {json.dumps(row.provider)}",
        ]
        if row.upstream is not None:
            lines.append(f"upstream_model = {json.dumps(row.upstream)}")
        if row.fallbacks:
            lines.append(f"fallbacks = {json.dumps(list(row.fallbacks))}")
        if row.privateToMain:
            lines.append(f"orgs = {json.dumps([mainOrg])}")
        lines.append("")
    path.write_text("\n".join(lines))
    return path


# A cold token validation on a loaded machine can take longer than the
# default 50 ms deadline; these tests are about forwarding. The rate limit
# is one no test reaches, and its headers are still sent.
FORWARDING_ENVIRONMENT = {
    "SVC_AUTH_VALIDATE_TIMEOUT": "5s",
    "SVC_RATE_LIMIT_DEFAULT_RPM": "1000000",
}


@pytest.fixture(scope="session")
def forwarding(
    postgresServer: PostgresServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Forwarding]:
    """
    The gateway with its providers file, and the two scripted upstreams.
    """
    workdir = tmp_path_factory.mktemp("forwarding")
    upstream = ScriptedUpstream(workdir / "upstream").start()
    keyed = ScriptedUpstream(workdir / "keyed", apiKey=UPSTREAM_KEY).start()

    def prepare(tenants: dict[str, Tenant]) -> dict[str, str]:
        path = _providersFile(
            workdir / "providers.toml", upstream, keyed, str(tenants["main"].orgID)
        )
        return {"SVC_PROVIDERS_FILE": str(path)}

    try:
        with runningGateway(
            postgresServer,
            workdir,
            proxyEnvironment={
                **FORWARDING_ENVIRONMENT,
                # Every line the proxy can write, for the content checks.
                "SVC_LOG_LEVEL": "DEBUG",
                "SVC_TEST_UPSTREAM_KEY": UPSTREAM_KEY,
                "SVC_TEST_WRONG_KEY": WRONG_KEY,
            },
            prepare=prepare,
        ) as gateway:
            yield Forwarding(gateway, upstream, keyed)
    finally:
        upstream.stop()
        keyed.stop()


def messages(text: str = "hello there") -> list[ChatCompletionMessageParam]:
    return [{"role": "user", "content": f"{text} {CONTENT_MARKER}"}]


def echoContent(text: str = "hello there") -> str:
    """
    What the scripted upstream answers to L{messages}C{(text)}.
    """
    content = f"{text} {CONTENT_MARKER}"
    return f"Scripted answer to 1 messages; the last has {len(content)} characters."


def chatBody(model: str, stream: bool = False, **extra: Any) -> bytes:
    body: dict[str, Any] = {"model": model, "messages": messages()}
    if stream:
        body["stream"] = True
    return json.dumps({**body, **extra}).encode()


def assertGatewayHeaders(headers: Mapping[str, str]) -> str:
    """
    The headers of every answer of the gateway on a rate-limited route:
    request and trace ids, X-RateLimit-*. Returns the request id.
    """
    requestID = headers["x-request-id"]
    parsed = parseUUID(requestID)
    assert parsed is not None and parsed.version in (4, 7)
    assert re.fullmatch(r"[0-9a-f]{32}", headers["x-trace-id"])
    assert int(headers["x-ratelimit-limit"]) == 1000000
    assert 0 <= int(headers["x-ratelimit-remaining"]) < 1000000
    assert int(headers["x-ratelimit-reset"]) % 60 == 0
    return requestID


def assertEnvelopeOf(
    error: openai.APIStatusError, status: int, code: str, kind: type[openai.APIStatusError]
) -> dict[str, Any]:
    """
    An error the SDK raised: its class, the gateway's status and code, and
    an envelope whose request_id is the answer's X-Request-ID.
    """
    assert type(error) is kind, (type(error), error)
    assert error.status_code == status, error
    body = error.body
    assert isinstance(body, dict), body
    assert body["code"] == code, body
    assert body["message"]
    assert body["timestamp"].endswith("Z")
    assert body["request_id"] == assertGatewayHeaders(error.response.headers)
    assert error.response.headers["content-type"] == "application/json"
    return body


def sseEvents(body: bytes) -> list[bytes]:
    """
    The data of each event of an event stream, in order.
    """
    events = []
    for event in re.split(rb"\r\n\r\n|\n\n|\r\r", body):
        data = [line[5:].strip() for line in event.splitlines() if line.startswith(b"data:")]
        if data:
            events.append(b"\n".join(data))
    return events


def streamedContent(chunks: list[Any]) -> str:
    return "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)


@pytest.fixture
def emptyRequestLogs(forwarding: Forwarding) -> Iterator[None]:
    """
    Empty the upstreams' request logs after a test: each test finds its own
    requests by request id, and emptying keeps the logs small (some bodies
    are a megabyte).
    """
    yield
    forwarding.upstream.clearRequests()
    forwarding.keyedUpstream.clearRequests()
