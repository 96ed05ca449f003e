"""
POST /v1/embeddings end to end (decisions D13, issue 30): real svc-auth and
svc-proxy daemons over PostgreSQL and Redis, forwarding to the scripted
upstream, driven with the official C{openai} SDK's
C{client.embeddings.create}: both encodings (the SDK asks for base64 unless
told otherwise, and decodes it), a list input, bad input refused as
C{openai.BadRequestError}, a fallback, 501 for a model of the other kind
on either route, 403 without C{ProxyEmbeddings}, NO_PRICE under a budget,
and the usage row the proxy sends: kind C{embedding}, the answer's prompt
tokens, read from the proxy's journal (C{SVC_USAGE_JOURNAL}), where each
row is written before it is queued for svc-auth, then as svc-auth commits
it in the ledger.

The tokens are made with C{svcctl token create --permissions
ProxyChatCompletion,ProxyEmbeddings}, as an operator makes them. The edge
in one process (every refusal, the reservation, the budget's worst case)
is tests/test_proxy_embeddings.py's.
"""

from __future__ import annotations

import base64
import json
import struct
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import openai
import psycopg
import pytest
from authfixtures import Tenant
from authhelpers import document, svcctl
from forwardingfixtures import FORWARDING_ENVIRONMENT
from gatewayfixtures import Gateway, request, runningGateway, waitFor

from svcd.devkit.postgres import PostgresServer
from svcd.devkit.upstream.client import ScriptedUpstream
from svcd.devkit.upstream.content import embeddingOf
from svcd.ledger.journalfile import JOURNAL_MAGIC
from svcd.pb.auth.v1 import auth_pb2

# Starts real daemons or processes (conftest.py, pytest.ini): left out of a
# quick run, dev/test -m "not e2e".
pytestmark = pytest.mark.e2e

DIMENSIONS = 32
TEXTS = ["the cat sat on the mat", "the cat ran", "quantum chromodynamics"]

PROVIDERS = """
[[providers]]
name = "scripted"
base_url = "{base}"

[[models]]
name = "chat"
provider = "scripted"
upstream_model = "echo"

[[models]]
name = "embed"
provider = "scripted"
upstream_model = "echo"
kind = "embedding"
dimensions = {dimensions}

[[models]]
name = "embed-failing"
provider = "scripted"
upstream_model = "status:503"
kind = "embedding"
fallbacks = ["embed"]

[[models]]
name = "embed-priced"
provider = "scripted"
upstream_model = "echo"
kind = "embedding"
price = {{ input = "0.02" }}
"""


@attrs.frozen
class Embedder:
    """
    The module's gateway, its upstream, and a token of the main and the
    other organization with ProxyEmbeddings.
    """

    gateway: Gateway
    upstream: ScriptedUpstream
    journal: Path
    tokens: dict[str, str]

    def client(self, tenant: str = "main", token: str | None = None) -> openai.OpenAI:
        chosen = self.gateway.tenants[tenant]
        return openai.OpenAI(
            base_url=f"http://127.0.0.1:{self.gateway.port}/v1",
            api_key=token if token is not None else self.tokens[tenant],
            default_headers={"X-SVC-Agent-ID": str(chosen.agentID)},
            max_retries=0,
            timeout=30.0,
        )

    def received(self, requestID: str) -> list[Any]:
        return [
            each for each in self.upstream.requests() if each.header("x-request-id") == requestID
        ]


def embeddingsToken(dsn: str, tenant: Tenant, permissions: str) -> str:
    """
    A token of C{tenant}'s organization and agent made as an operator makes
    one, with the permissions named as the operator names them.
    """
    created = document(
        svcctl(
            dsn,
            "token",
            "create",
            "--org",
            str(tenant.orgID),
            "--agent",
            str(tenant.agentID),
            "--permissions",
            permissions,
        )
    )
    token: str = created["token"]
    return token


def usable(port: int, tenant: Tenant, token: str) -> bool:
    """
    Whether the proxy takes C{token} yet (decisions D8: a token made
    anywhere works everywhere within a second).
    """
    headers = {"Authorization": f"Bearer {token}", "X-SVC-Agent-ID": str(tenant.agentID)}
    return request(port, "GET", "/v1/internal/auth-probe", headers).status == 200


@pytest.fixture(scope="module")
def embedder(
    postgresServer: PostgresServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Embedder]:
    workdir = tmp_path_factory.mktemp("embeddings")
    upstream = ScriptedUpstream(workdir / "upstream").start()
    providers = workdir / "providers.toml"
    providers.write_text(PROVIDERS.format(base=upstream.baseURL, dimensions=DIMENSIONS))
    journal = workdir / "usage.journal"
    try:
        with runningGateway(
            postgresServer,
            workdir,
            proxyEnvironment={
                **FORWARDING_ENVIRONMENT,
                "SVC_PROVIDERS_FILE": str(providers),
                "SVC_USAGE_JOURNAL": str(journal),
            },
        ) as gateway:
            tokens = {
                name: embeddingsToken(
                    gateway.dsn, gateway.tenants[name], "ProxyChatCompletion,ProxyEmbeddings"
                )
                for name in ("main", "other")
            }
            for name, token in tokens.items():
                tenant = gateway.tenants[name]
                waitFor(lambda: usable(gateway.port, tenant, token), 10)  # noqa: B023
            yield Embedder(gateway, upstream, journal, tokens)
    finally:
        upstream.stop()


def journalRows(path: Path) -> list[auth_pb2.UsageRow]:
    """
    The usage rows of the proxy's journal, in the order they were written
    (the format is described in svcd/ledger/journalfile.py: a magic line, then
    records of a kind byte, a payload length and a CRC-32, big endian, and
    the payload; kind 1 is a row). Read as it stands: the proxy appends a
    row before it queues it, so a row of an answer already received is
    there.
    """
    data = path.read_bytes()
    assert data.startswith(JOURNAL_MAGIC)
    header = struct.Struct(">BII")
    rows = []
    offset = len(JOURNAL_MAGIC)
    while offset + header.size <= len(data):
        kind, length, checksum = header.unpack_from(data, offset)
        payload = data[offset + header.size : offset + header.size + length]
        if len(payload) < length or zlib.crc32(payload) != checksum:
            break
        if kind == 1:
            rows.append(auth_pb2.UsageRow.FromString(payload))
        offset += header.size + length
    return rows


def rowOf(embedder: Embedder, requestID: str) -> auth_pb2.UsageRow:
    [row] = [row for row in journalRows(embedder.journal) if row.request_id == requestID]
    return row


def test_svcctlKnowsProxyEmbeddingsByName(embedder: Embedder) -> None:
    """
    svcctl token create --permissions takes ProxyEmbeddings by name (bit
    5, value 32), alone or with others.
    """
    tenant = embedder.gateway.tenants["main"]
    for names, bitmap in (("ProxyEmbeddings", 32), ("ProxyChatCompletion,ProxyEmbeddings", 33)):
        created = document(
            svcctl(
                embedder.gateway.dsn,
                "token",
                "create",
                "--org",
                str(tenant.orgID),
                "--permissions",
                names,
            )
        )
        assert created["permissions"] == bitmap


def test_bothEncodingsThroughTheSDK(embedder: Embedder) -> None:
    """
    client.embeddings.create asks for base64 unless told otherwise, and
    decodes it; with encoding_format="float" the provider sends numbers.
    Either way the gateway sends the SDK's choice on and relays the
    answer as given, and the vectors are the scripted ones (float32).
    """
    client = embedder.client()
    raw = client.embeddings.with_raw_response.create(model="embed", input=TEXTS[0])
    assert raw.status_code == 200
    assert raw.headers["x-svc-upstream-model"] == "embed"
    requestID = raw.headers["x-request-id"]
    [received] = embedder.received(requestID)
    assert received.body["encoding_format"] == "base64"
    decoded = raw.parse()
    expected = embeddingOf(TEXTS[0], 64)[0]
    assert decoded.data[0].embedding == expected
    assert decoded.usage.prompt_tokens == 6

    floats = client.embeddings.with_raw_response.create(
        model="embed", input=TEXTS[0], encoding_format="float"
    )
    [received] = embedder.received(floats.headers["x-request-id"])
    assert received.body["encoding_format"] == "float"
    assert floats.parse().data[0].embedding == expected
    assert json.loads(floats.content)["data"][0]["embedding"] == expected

    given = client.embeddings.create(model="embed", input=TEXTS[0], encoding_format="base64")
    # Asked for explicitly, base64 is left as the gateway relayed it.
    relayed: object = given.data[0].embedding
    assert relayed == base64.b64encode(embeddingOf(TEXTS[0], 64)[1]).decode("ascii")


def test_aListInputAndDimensions(embedder: Embedder) -> None:
    """
    A list of inputs gives one vector each, in order, of the dimensions
    asked for; texts that share words are nearer than texts that share
    none; the usage is the provider's.
    """
    answer = embedder.client().embeddings.create(model="embed", input=TEXTS, dimensions=DIMENSIONS)
    assert [item.index for item in answer.data] == [0, 1, 2]
    vectors = [item.embedding for item in answer.data]
    assert vectors == [embeddingOf(text, DIMENSIONS)[0] for text in TEXTS]

    def cosine(left: list[float], right: list[float]) -> float:
        return sum(a * b for a, b in zip(left, right, strict=True))

    assert cosine(vectors[0], vectors[1]) > cosine(vectors[0], vectors[2]) + 0.3
    assert answer.usage.prompt_tokens == answer.usage.total_tokens == 11


@pytest.mark.parametrize(
    ("value", "field"),
    [([""], "input[0]"), ([1, 2, 3], "input"), ([], "input")],
    ids=["an empty string", "a token array", "no input"],
)
def test_badInputIsABadRequestError(embedder: Embedder, value: Any, field: str) -> None:
    """
    Bad input is refused by the gateway with a field error, which the SDK
    raises as BadRequestError; nothing reaches the provider.
    """
    before = len(embedder.upstream.requests())
    with pytest.raises(openai.BadRequestError) as caught:
        embedder.client().embeddings.create(model="embed", input=value, encoding_format="float")
    body = caught.value.body
    assert isinstance(body, dict)
    assert body["code"] == "VALIDATION_ERROR"
    assert [each["field"] for each in body["field_errors"]] == [field]
    assert len(embedder.upstream.requests()) == before


def test_aFaultTriesTheFallback(embedder: Embedder) -> None:
    """
    The provider's 503 for the model tries its fallback, which answers
    and is named in X-SVC-Upstream-Model.
    """
    raw = embedder.client().embeddings.with_raw_response.create(
        model="embed-failing", input="hello"
    )
    assert raw.status_code == 200
    assert raw.headers["x-svc-upstream-model"] == "embed"
    received = embedder.received(raw.headers["x-request-id"])
    assert [each.status for each in received] == [503, 200]
    assert rowOf(embedder, raw.headers["x-request-id"]).model == "embed"


def test_aModelOfTheOtherKindIs501OnEitherRoute(embedder: Embedder) -> None:
    """
    A chat model asked for embeddings, and an embedding model asked to
    chat, are 501 PROVIDER_NOT_CONFIGURED, as a model the file does not
    list; nothing is forwarded.
    """
    client = embedder.client()
    before = len(embedder.upstream.requests())
    with pytest.raises(openai.APIStatusError) as caught:
        client.embeddings.create(model="chat", input="hello")
    assert caught.value.status_code == 501
    assert isinstance(caught.value.body, dict)
    assert caught.value.body["code"] == "PROVIDER_NOT_CONFIGURED"
    with pytest.raises(openai.APIStatusError) as caught:
        client.chat.completions.create(model="embed", messages=[{"role": "user", "content": "hi"}])
    assert caught.value.status_code == 501
    assert len(embedder.upstream.requests()) == before
    chat = client.chat.completions.create(
        model="chat", messages=[{"role": "user", "content": "hi"}]
    )
    assert chat.choices[0].message.content


def test_aTokenWithoutProxyEmbeddingsIs403(embedder: Embedder) -> None:
    """
    The tenant's first token has ProxyChatCompletion only: the embeddings
    route answers 403 INSUFFICIENT_PERMISSIONS, which the SDK raises as
    PermissionDeniedError.
    """
    tenant = embedder.gateway.tenants["main"]
    with pytest.raises(openai.PermissionDeniedError) as caught:
        embedder.client(token=tenant.token).embeddings.create(model="embed", input="hello")
    assert isinstance(caught.value.body, dict)
    assert caught.value.body["code"] == "INSUFFICIENT_PERMISSIONS"


def test_anUnpricedModelUnderABudgetIsNoPrice(embedder: Embedder) -> None:
    """
    Once the other organization has a budget, an embedding model without
    a price is 400 NO_PRICE on model (never billed at zero), and a priced
    one answers.
    """
    tenant = embedder.gateway.tenants["other"]
    document(
        svcctl(
            embedder.gateway.dsn,
            "budget",
            "set",
            "--org",
            str(tenant.orgID),
            "--usd",
            "5.00",
            "--period",
            "month",
        )
    )
    client = embedder.client("other")
    refused: list[openai.BadRequestError] = []

    def noPrice() -> bool:
        try:
            client.embeddings.create(model="embed", input="hello")
        except openai.BadRequestError as error:
            refused.append(error)
            return True
        return False

    # The budget reaches the proxy through the change feed, within a second.
    waitFor(noPrice, 10)
    body = refused[0].body
    assert isinstance(body, dict)
    assert [(each["field"], each["code"]) for each in body["field_errors"]] == [
        ("model", "NO_PRICE")
    ]
    answer = client.embeddings.create(model="embed-priced", input="hello")
    assert answer.usage.prompt_tokens == 1


def test_theRowSentIsOfKindEmbedding(embedder: Embedder) -> None:
    """
    Each forwarded embeddings request sends one usage row to svc-auth:
    kind embedding, no parent request, the model, the answer's prompt
    tokens and no completion tokens, its cost at the input price; svc-auth
    commits it with kind embedding in the ledger, and a chat request's row
    with kind chat.
    """
    raw = embedder.client().embeddings.with_raw_response.create(model="embed-priced", input=TEXTS)
    answer = raw.parse()
    row = rowOf(embedder, raw.headers["x-request-id"])
    assert (row.kind, row.parent_request_id) == ("embedding", "")
    assert (row.model_requested, row.model, row.upstream_model) == ("embed-priced",) * 2 + ("echo",)
    assert row.org_id == str(embedder.gateway.tenants["main"].orgID)
    assert (row.prompt_tokens, row.completion_tokens) == (answer.usage.prompt_tokens, 0)
    assert (row.outcome, row.stream, row.tokens_from) == ("ok", False, "provider")
    assert row.cost_nano_usd == answer.usage.prompt_tokens * 20
    chat = embedder.client().chat.completions.with_raw_response.create(
        model="chat", messages=[{"role": "user", "content": "hi"}]
    )
    assert rowOf(embedder, chat.headers["x-request-id"]).kind == "chat"
    # svc-auth commits both with their kind (the ledger's column).
    requestIDs = (raw.headers["x-request-id"], chat.headers["x-request-id"])
    committed: dict[str, tuple[Any, ...]] = {}

    def inTheLedger() -> bool:
        with psycopg.connect(embedder.gateway.dsn, autocommit=True) as connection:
            rows = connection.execute(
                "SELECT request_id, kind, parent_request_id, prompt_tokens, completion_tokens"
                " FROM usage_ledger WHERE request_id = ANY(%s)",
                (list(requestIDs),),
            ).fetchall()
        committed.update({str(each[0]): tuple(each[1:]) for each in rows})
        return len(committed) == 2

    waitFor(inTheLedger, 30)
    assert committed[requestIDs[0]] == ("embedding", None, answer.usage.prompt_tokens, 0)
    assert committed[requestIDs[1]][:2] == ("chat", None)


def test_theProxyLogsNoInput(embedder: Embedder) -> None:
    """
    No line of the proxy's log holds an input, and the access line of an
    embeddings request has its tokens and provider.
    """
    marker = f"secret-input-{time.monotonic_ns()}"
    raw = embedder.client().embeddings.with_raw_response.create(model="embed", input=[marker])
    requestID = raw.headers["x-request-id"]

    def accessLine() -> dict[str, Any] | None:
        for line in embedder.gateway.proxy.output().splitlines():
            if line.startswith("{"):
                event = json.loads(line)
                if event.get("request_id") == requestID and "route" in event:
                    return dict(event)
        return None

    waitFor(lambda: accessLine() is not None, 10)
    line = accessLine()
    assert line is not None
    assert (line["route"], line["status"], line["provider"]) == ("/v1/embeddings", 200, "scripted")
    assert (line["prompt_tokens"], line["completion_tokens"]) == (1, 0)
    assert marker not in embedder.gateway.proxy.output()
