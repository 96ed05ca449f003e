"""
OpenTelemetry's GenAI conventions on the real gateway (decisions D15):
`twistd -n svc-auth` and `twistd -n svc-proxy` over PostgreSQL and Redis,
forwarding to the scripted upstream, exporting spans (every one:
OTEL_SAMPLE_RATIO=1.0) and metrics over OTLP gRPC to a receiver in this
test process (L{otlpreceiver}), on short schedules (spans every 100 ms,
metrics every 200 ms), so that nothing waits for the stop.

A chat completion whose first deployment fails (503) and whose second
answers, a streamed one, one to an Anthropic provider and an embeddings
request: each try is a client span named C{<operation> <model>} with the
GenAI attributes and its deployment, and the proxy's meter exports
C{gen_ai.client.operation.duration} and C{gen_ai.client.token.usage}
with the conventions' attributes, units and buckets, and the tokens the
upstream counted. No span holds the messages' content.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest
from authfixtures import Tenant
from forwardingfixtures import FORWARDING_ENVIRONMENT
from gatewayfixtures import Answer, Gateway, chat, runningGateway
from otlpreceiver import HistogramPoint, ReceivedSpan, Receiver, runningReceiver, waitUntil

from svcd.auth.authority import issueToken
from svcd.common.permissions import Permission
from svcd.devkit.postgres import PostgresServer
from svcd.devkit.upstream.client import ScriptedUpstream
from svcd.providers.genai import DURATION_BUCKETS, TOKEN_BUCKETS

pytestmark = pytest.mark.e2e

CONTENT = "genai-secret-content-" + uuid.uuid4().hex
HEAVY = 1_000_000  # a weight that puts its deployment first (1 in a million not)
# OTLP's span kind and status codes (opentelemetry.proto.trace.v1).
SPAN_KIND_CLIENT = 3
STATUS_ERROR = 2
# OTLP's cumulative temporality.
CUMULATIVE = 2
WAIT = 15.0

MODELS = f"""
[[models]]
name = "retried"
deployments = [
    {{ provider = "a", upstream_model = "status:503", weight = {HEAVY} }},
    {{ provider = "b", upstream_model = "usage:7:11" }},
]

[[models]]
name = "streamed"
provider = "b"
upstream_model = "usage:5:3"

[[models]]
name = "claude"
provider = "claude"
upstream_model = "usage:9:4"
max_output_tokens = 300

[[models]]
name = "embed"
provider = "a"
upstream_model = "usage:6:0"
kind = "embedding"
"""


@attrs.frozen
class Run:
    gateway: Gateway
    upstream: ScriptedUpstream
    receiver: Receiver
    answers: dict[str, Answer]

    def spansOf(self, name: str, count: int) -> list[ReceivedSpan]:
        """
        The GenAI spans of the request C{name}'s trace, once C{count} came.
        """
        traceID = self.answers[name].headers["x-trace-id"]

        def found() -> list[ReceivedSpan] | None:
            spans = [
                each
                for each in self.receiver.spans()
                if each.traceID == traceID and "gen_ai.operation.name" in each.attributes
            ]
            return spans if len(spans) >= count else None

        return waitUntil(found, WAIT, f"{count} GenAI spans of {name}")

    def point(self, metric: str, **attributes: Any) -> HistogramPoint:
        """
        The proxy's exported point of C{metric} whose attributes include
        C{attributes} (exactly one such series).
        """

        def found() -> list[HistogramPoint]:
            return [
                each
                for each in self.receiver.points(metric)
                if each.service == "svc-proxy"
                and all(each.attributes.get(key) == value for key, value in attributes.items())
            ]

        [point] = waitUntil(found, WAIT, f"{metric} {attributes}")
        return point


def _body(model: str, **extra: Any) -> bytes:
    return json.dumps(
        {"model": model, "messages": [{"role": "user", "content": CONTENT}], **extra}
    ).encode()


def _providers(path: Path, upstream: ScriptedUpstream) -> Path:
    lines = []
    for name in ("a", "b"):
        lines += [
            "[[providers]]",
            f'name = "{name}"',
            f'base_url = "{upstream.baseURLUnder(name)}"',
        ]
    lines += [
        "[[providers]]",
        'name = "claude"',
        'api = "anthropic"',
        f'base_url = "{upstream.baseURL}"',
    ]
    path.write_text("\n".join(lines) + "\n" + MODELS)
    return path


def _drive(gateway: Gateway, tenant: Tenant) -> dict[str, Answer]:
    port = gateway.port
    answers = {
        "retried": chat(port, tenant, body=_body("retried", max_tokens=64)),
        "streamed": chat(
            port,
            tenant,
            body=_body("streamed", stream=True, stream_options={"include_usage": True}),
        ),
        "claude": chat(port, tenant, body=_body("claude")),
        "embed": chat(
            port,
            tenant,
            path="/v1/embeddings",
            body=json.dumps({"model": "embed", "input": [CONTENT, "second"]}).encode(),
        ),
    }
    for name, answer in answers.items():
        assert answer.status == 200, (name, answer.body)
    return answers


@pytest.fixture(scope="module")
def run(postgresServer: PostgresServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    workdir = tmp_path_factory.mktemp("genai")
    upstream = ScriptedUpstream(workdir / "upstream").start()
    providers = _providers(workdir / "providers.toml", upstream)
    try:
        with runningReceiver() as (receiver, endpoint), pytest.MonkeyPatch.context() as patch:
            # Daemon.start passes the test's environment on to both daemons.
            patch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
            patch.setenv("OTEL_SAMPLE_RATIO", "1.0")
            patch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
            patch.setenv("OTEL_METRIC_EXPORT_INTERVAL", "200")
            with runningGateway(
                postgresServer,
                workdir,
                proxyEnvironment={**FORWARDING_ENVIRONMENT, "SVC_PROVIDERS_FILE": str(providers)},
            ) as gateway:
                main = gateway.tenants["main"]
                token, _ = issueToken(
                    gateway.owner,
                    orgID=main.orgID,
                    permissions=int(Permission.ProxyChatCompletion | Permission.ProxyEmbeddings),
                )
                tenant = attrs.evolve(main, token=token)
                yield Run(gateway, upstream, receiver, _drive(gateway, tenant))
    finally:
        upstream.stop()


def test_triesAreSpansOfTheirDeployments(run: Run) -> None:
    """
    A request answered at its second try has two client spans, one per
    try, each named C{chat <upstream model>} with its deployment, the
    provider, the server and the cap sent; the failed one is ERROR with
    its error.type, the answered one has the model that answered and the
    tokens the upstream counted.
    """
    spans = run.spansOf("retried", 2)
    byDeployment = {each.attributes["svc.deployment"]: each for each in spans}
    assert set(byDeployment) == {"a", "b"}
    failed, answered = byDeployment["a"], byDeployment["b"]
    common = {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": "openai",
        "gen_ai.request.max_tokens": 64,
        "server.address": "127.0.0.1",
        "server.port": run.upstream.port,
        "svc.model": "retried",
    }
    for span in spans:
        assert span.kind == SPAN_KIND_CLIENT and span.scope == "svcd.proxy"
        assert common.items() <= span.attributes.items()
        assert "gen_ai.request.stream" not in span.attributes
    assert failed.name == "chat status:503"
    assert failed.attributes["gen_ai.request.model"] == "status:503"
    assert failed.attributes["error.type"] == "503"
    assert failed.attributes["svc.provider"] == "a"
    assert failed.statusCode == STATUS_ERROR
    assert "gen_ai.usage.input_tokens" not in failed.attributes
    assert answered.name == "chat usage:7:11"
    assert answered.statusCode != STATUS_ERROR and "error.type" not in answered.attributes
    assert {
        "gen_ai.request.model": "usage:7:11",
        "gen_ai.response.model": "usage:7:11",
        "gen_ai.usage.input_tokens": 7,
        "gen_ai.usage.output_tokens": 11,
        "svc.provider": "b",
    }.items() <= answered.attributes.items()


def test_streamAnthropicAndEmbeddingsSpans(run: Run) -> None:
    """
    A stream's span says so and has its usage event's model and tokens;
    an Anthropic provider's is named anthropic (its cap the model's, which
    a translated request is sent); an embeddings span has its input tokens
    and no output tokens.
    """
    [streamed] = run.spansOf("streamed", 1)
    assert streamed.name == "chat usage:5:3"
    assert {
        "gen_ai.request.stream": True,
        "gen_ai.response.model": "usage:5:3",
        "gen_ai.usage.input_tokens": 5,
        "gen_ai.usage.output_tokens": 3,
        "svc.deployment": "b",
    }.items() <= streamed.attributes.items()
    [claude] = run.spansOf("claude", 1)
    assert claude.name == "chat usage:9:4"
    assert {
        "gen_ai.provider.name": "anthropic",
        "gen_ai.request.max_tokens": 300,
        "gen_ai.usage.input_tokens": 9,
        "gen_ai.usage.output_tokens": 4,
        "svc.provider": "claude",
    }.items() <= claude.attributes.items()
    [embed] = run.spansOf("embed", 1)
    assert embed.name == "embeddings usage:6:0"
    assert {
        "gen_ai.operation.name": "embeddings",
        "gen_ai.provider.name": "openai",
        "gen_ai.response.model": "usage:6:0",
        "gen_ai.usage.input_tokens": 6,
    }.items() <= embed.attributes.items()
    assert "gen_ai.usage.output_tokens" not in embed.attributes


def test_noContentInAnySpan(run: Run) -> None:
    """
    The messages' and the input's content is on no span of either daemon.
    """
    run.spansOf("embed", 1)
    for span in run.receiver.spans():
        assert CONTENT not in repr(span)


def test_operationDuration(run: Run) -> None:
    """
    gen_ai.client.operation.duration: a histogram in seconds, with the
    conventions' buckets, one point per try with the conventions'
    attributes; the failed try's has its error.type.
    """
    server = {"server.address": "127.0.0.1", "server.port": run.upstream.port}
    failed = run.point(
        "gen_ai.client.operation.duration",
        **{"gen_ai.request.model": "status:503"},
    )
    assert failed.attributes == {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": "openai",
        "gen_ai.request.model": "status:503",
        "error.type": "503",
        **server,
    }
    answered = run.point(
        "gen_ai.client.operation.duration", **{"gen_ai.request.model": "usage:7:11"}
    )
    assert answered.attributes == {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": "openai",
        "gen_ai.request.model": "usage:7:11",
        "gen_ai.response.model": "usage:7:11",
        **server,
    }
    embed = run.point("gen_ai.client.operation.duration", **{"gen_ai.request.model": "usage:6:0"})
    assert embed.attributes["gen_ai.operation.name"] == "embeddings"
    for point in (failed, answered, embed):
        assert point.unit == "s"
        assert point.bounds == tuple(DURATION_BUCKETS)
        assert point.temporality == CUMULATIVE
        assert point.count == 1
        assert 0 < point.sum < WAIT


def test_tokenUsage(run: Run) -> None:
    """
    gen_ai.client.token.usage: the tokens the upstream counted, by
    gen_ai.token.type, in {token} with the conventions' buckets; an
    embeddings request has input tokens only, a failed try none.
    """
    expected = {
        ("usage:7:11", "input"): 7,
        ("usage:7:11", "output"): 11,
        ("usage:5:3", "input"): 5,
        ("usage:5:3", "output"): 3,
        ("usage:9:4", "input"): 9,
        ("usage:9:4", "output"): 4,
        ("usage:6:0", "input"): 6,
    }
    for (model, kind), tokens in expected.items():
        point = run.point(
            "gen_ai.client.token.usage",
            **{"gen_ai.request.model": model, "gen_ai.token.type": kind},
        )
        assert (point.count, point.sum) == (1, tokens), (model, kind)
        assert point.unit == "{token}"
        assert point.bounds == tuple(TOKEN_BUCKETS)
        assert point.attributes["gen_ai.response.model"] == model
    models = {
        each.attributes["gen_ai.request.model"]
        for each in run.receiver.points("gen_ai.client.token.usage")
    }
    assert "status:503" not in models
    assert not [
        each
        for each in run.receiver.points("gen_ai.client.token.usage")
        if each.attributes["gen_ai.request.model"] == "usage:6:0"
        and each.attributes["gen_ai.token.type"] == "output"
    ]
