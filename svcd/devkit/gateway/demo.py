"""
The demo of a C{dev/gateway} run: its organization, agent and token, made
once and remembered in C{.data/demo.json} (L{demoTenant}), memory turned
on for its agent, the providers file of the scripted model server's demo
models, and the commands printed to try them (L{announce}): curl in
OpenAI's shape and in Anthropic's, and one command for each SDK.
"""

from __future__ import annotations

import datetime
import json
import os
import shlex
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

import psycopg

from svcd.common.permissions import parsePermissions
from svcd.devkit.gateway.children import DevStackError, say, svcctl, writePrivateJSON
from svcd.devkit.gateway.settings import Settings
from svcd.metering.models import ANTHROPIC, CHAT, EMBEDDING
from svcd.providers.table import ProviderTable

# The model of the providers file written for the scripted model server,
# and the script of svcd/devkit/upstream's grammar that answers it: a
# normal answer describing the request, with usage.
DEMO_MODEL = "demo"
DEMO_UPSTREAM_MODEL = "echo"
# Decisions D14: a Claude-shaped model of a provider of Anthropic's
# Messages API, the same scripted server (which speaks both dialects)
# answering it with the same script, priced as Anthropic prices a Claude
# model (dollars per million tokens: input, cache reads, cache writes,
# output), so that its ledger rows show each priced apart.
DEMO_CLAUDE_MODEL = "demo-claude"
DEMO_CLAUDE_PRICE = 'input = "3.00", cached_input = "0.30", cache_write = "3.75", output = "15.00"'
# The anthropic-version the printed Messages command sends, as Anthropic's
# SDKs do (the gateway would default to it).
DEMO_ANTHROPIC_VERSION = "2023-06-01"
# The printed Messages requests' max_tokens, which Anthropic's API requires
# (the scripted answer to "hello" is ten words).
DEMO_MAX_TOKENS = 1024
# The embedding model of that file (decisions D13): the scripted server's
# vectors, under which texts that share words are near, of this length.
DEMO_EMBEDDING_MODEL = "demo-embed"
DEMO_EMBEDDING_DIMENSIONS = 64
# The demo token's permissions: those of every route of svc-proxy (chat,
# embeddings, memories; the auth probes need none). A token remembered in
# demo.json without them all is replaced by a new one.
DEMO_PERMISSIONS = "ProxyChatCompletion,ProxyEmbeddings,MemoryRead,MemoryWrite"
# The subject of the printed memory commands (decisions D13).
DEMO_SUBJECT = "demo-user"
# The fact the printed commands tell the gateway and the question that
# recalls it, of a subject of their own, so that the memory stored by the
# commands before them is not recalled too. The scripted extraction keeps
# the user's sentences in the first person; the scripted embeddings make
# texts sharing words ("I", "drink", "morning") near.
DEMO_FACT_SUBJECT = "demo-tea-drinker"
# Why the fact's commands name a subject (decisions D13 amended): printed
# with them.
DEMO_OBSERVE_NOTE = (
    "(observe is on for the demo agent: a chat is remembered only when it names its user"
    " with X-SVC-Memory-Subject, as these do; the hello chats name none and are not)"
)
DEMO_FACT = "I drink green tea every morning."
DEMO_QUESTION = "What do I drink in the morning?"


def databaseIdentity(dsn: str) -> str:
    """
    A name for the database behind C{dsn} that stays the same between runs
    and changes when the database is a new one, so that demo.json is not
    believed about a database that never saw its tenant: the cluster's
    system identifier (new at every initdb), the database's name and oid
    (new when it is dropped and made again). A role that may not read the
    system identifier gets host and port in its place.
    """
    with psycopg.connect(dsn, connect_timeout=10, autocommit=True) as connection:
        row = connection.execute(
            "SELECT current_database(), oid::text FROM pg_database"
            " WHERE datname = current_database()"
        ).fetchone()
        assert row is not None
        name, oid = row
        try:
            system = connection.execute(
                "SELECT system_identifier::text FROM pg_control_system()"
            ).fetchone()
            cluster = str(system[0]) if system else ""
        except psycopg.Error:
            cluster = f"{connection.info.host}:{connection.info.port}"
    return f"{cluster}/{name}/{oid}"


def _expired(expiresAt: object) -> bool:
    if not isinstance(expiresAt, str) or not expiresAt:
        return False
    try:
        moment = datetime.datetime.fromisoformat(expiresAt)
    except ValueError:
        return False
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=datetime.UTC)
    # A minute of margin: a token about to expire is of no use to paste.
    return moment <= datetime.datetime.now(datetime.UTC) + datetime.timedelta(minutes=1)


def demoTenant(environ: Mapping[str, str], dataDirectory: Path, dsn: str) -> dict[str, Any]:
    """
    The demo organization, agent and token: made once and remembered in
    demo.json, step by step, so that an interrupted run resumes where it
    stopped instead of making a second organization.
    """
    path = dataDirectory / "demo.json"
    identity = databaseIdentity(dsn)
    demo: dict[str, Any] = {}
    if path.exists():
        try:
            demo = json.loads(path.read_text())
        except ValueError:
            demo = {}
        if demo.get("database") != identity:
            say(f"{path} is about another database; making a new demo tenant")
            demo = {}
    demo["database"] = identity

    def field(document: Mapping[str, Any], key: str) -> str:
        value = document.get(key)
        if not isinstance(value, str) or not value:
            raise DevStackError(f"svcctl's answer lacks {key!r}")
        return value

    if "org_id" not in demo:
        created = svcctl(environ, "org", "create", "--name", "demo", dsn=dsn)
        demo["org_id"] = field(created, "org_id")
        writePrivateJSON(path, demo)
        say(f"created the demo organization {demo['org_id']}")
    if "agent_id" not in demo:
        created = svcctl(
            environ, "agent", "create", "--org", demo["org_id"], "--name", "demo-agent", dsn=dsn
        )
        demo["agent_id"] = field(created, "agent_id")
        writePrivateJSON(path, demo)
        say(f"created the demo agent {demo['agent_id']}")
    wanted = parsePermissions(DEMO_PERMISSIONS)
    if "token" not in demo or _expired(demo.get("expires_at")) or demo.get("permissions") != wanted:
        created = svcctl(
            environ,
            "token",
            "create",
            "--org",
            demo["org_id"],
            "--agent",
            demo["agent_id"],
            "--name",
            "demo",
            "--permissions",
            DEMO_PERMISSIONS,
            dsn=dsn,
        )
        replaced = demo.get("token_id") if "token" in demo else None
        demo["token"] = field(created, "token")
        demo["token_id"] = field(created, "token_id")
        demo["expires_at"] = created.get("expires_at")
        demo["permissions"] = created.get("permissions")
        writePrivateJSON(path, demo)
        say(f"created the demo token {demo['token_id']} (saved in {path})")
        if isinstance(replaced, str) and replaced:
            # An older run's token (expired, or without a permission
            # the demo needs now): nobody has it any more.
            try:
                svcctl(environ, "token", "revoke", replaced, dsn=dsn)
            except DevStackError as error:
                say(f"could not revoke the demo token it replaces, {replaced}: {error}")
            else:
                say(f"revoked the demo token it replaces, {replaced}")
    return demo


def demoMemorySettings(
    environ: Mapping[str, str], dataDirectory: Path, dsn: str, demo: dict[str, Any]
) -> None:
    """
    Turn recall and observe on for the demo agent (decisions D13), so
    that what the printed commands tell the gateway becomes a memory
    and comes back in the next answer. Once per demo tenant, noted in
    demo.json: a developer who turns them off with C{svcctl memory
    settings} afterwards is not overruled at the next run.

    Observe C{on} (decisions D13 amended, "Whose words"), not C{all}:
    the demo shows the setting an agent that serves many users needs,
    under which a chat is observed only when it names its user
    (C{X-SVC-Memory-Subject}); every printed command meant to be
    remembered names one, and the plain C{hello} chats, which name
    none, are answered as usual and not observed. (C{all} would
    observe those too, into the agent's one shared subject: right
    only for an agent that serves one user.) A run of an earlier
    release set the switch on, which sql/0016 made C{on}: the same.
    """
    if demo.get("memory_settings") == "on":
        return
    svcctl(
        environ,
        "memory",
        "settings",
        "--org",
        demo["org_id"],
        "--agent",
        demo["agent_id"],
        "--recall",
        "on",
        "--observe",
        "on",
        dsn=dsn,
    )
    demo["memory_settings"] = "on"
    writePrivateJSON(dataDirectory / "demo.json", demo)
    say("turned recall and observe on for the demo agent")


def writeDemoProviders(path: Path, port: int) -> None:
    """
    Write, in one step, the providers file that sends the demo models
    (chat, Claude-shaped chat and embedding) to the scripted model server
    on C{port}, as two providers: the server speaks OpenAI's API and
    Anthropic's Messages API (decisions D14) under the same base URL.
    """
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(
        "# Written by dev/gateway at each run without SVC_PROVIDERS_FILE: the\n"
        "# scripted model server of the tests (svcd/devkit/upstream), which\n"
        "# it runs on a free port, answers the model below. To forward to your\n"
        "# own models, write a file like etc/svc/providers.toml and run\n"
        "# SVC_PROVIDERS_FILE=that-file dev/gateway.\n"
        "\n"
        "[[providers]]\n"
        'name = "scripted"\n'
        f'base_url = "http://127.0.0.1:{port}/v1"\n'
        "\n"
        "# The same server as a provider of Anthropic's Messages API (decisions\n"
        "# D14): requests to <base_url>/messages. Each model serves both\n"
        "# /v1/chat/completions and /v1/messages, translated where the dialects\n"
        "# differ.\n"
        "[[providers]]\n"
        'name = "scripted-anthropic"\n'
        f'api = "{ANTHROPIC}"\n'
        f'base_url = "http://127.0.0.1:{port}/v1"\n'
        "\n"
        "[[models]]\n"
        f'name = "{DEMO_MODEL}"\n'
        'provider = "scripted"\n'
        f'upstream_model = "{DEMO_UPSTREAM_MODEL}"   # an answer that describes the request\n'
        "\n"
        "[[models]]\n"
        f'name = "{DEMO_CLAUDE_MODEL}"\n'
        'provider = "scripted-anthropic"\n'
        f'upstream_model = "{DEMO_UPSTREAM_MODEL}"   # the same answer, as Anthropic shapes it\n'
        f"price = {{ {DEMO_CLAUDE_PRICE} }}\n"
        "\n"
        "[[models]]\n"
        f'name = "{DEMO_EMBEDDING_MODEL}"\n'
        'provider = "scripted"\n'
        f'upstream_model = "{DEMO_UPSTREAM_MODEL}"   # vectors near for texts sharing words\n'
        'kind = "embedding"\n'
        f"dimensions = {DEMO_EMBEDDING_DIMENSIONS}\n"
        "\n"
        "# Memory (decisions D13): svc-memory and svc-worker run beside the\n"
        "# others; the proxy and the worker embed memories and queries with\n"
        "# the embedding model, and the worker asks the chat model for the\n"
        "# memories an exchange holds (the scripted server answers with the\n"
        "# user's sentences that say something of the user).\n"
        "[memory]\n"
        f'embedding_model = "{DEMO_EMBEDDING_MODEL}"\n'
        f'extraction_model = "{DEMO_MODEL}"\n'
    )
    os.replace(temporary, path)


class DemoModels(NamedTuple):
    """
    The models the printed commands name (L{demoModels}), each None
    when the demo organization has none of its kind.

    @ivar chat: the first chat model: the chat completions commands', and
        the C{openai} SDK's.
    @ivar embedding: the first embedding model (decisions D13).
    @ivar messages: the first chat model of a provider of Anthropic's
        Messages API, else the first chat model (decisions D14: a model of
        either kind of provider serves C{/v1/messages}): the Messages
        command's, and the C{anthropic} SDK's.
    """

    chat: str | None
    embedding: str | None
    messages: str | None


def sdkCommands(proxy: str, demo: Mapping[str, Any], models: DemoModels) -> list[str]:
    """
    One command for each SDK (decisions D14): this Python (the one of
    .venv that runs dev/gateway, where both SDKs are installed) running a
    program that sends "hello" through the gateway with the demo token, the
    C{openai} SDK to C{models.chat}, the C{anthropic} SDK (whose base URL
    is the gateway's root: it adds C{/v1/messages}) to C{models.messages},
    and prints the answer and its usage. Each is one shell word, in single
    quotes, so that it pastes as printed.
    """
    token, agent = json.dumps(demo["token"]), json.dumps(demo["agent_id"])
    headers = f'default_headers={{"X-SVC-Agent-ID": {agent}}}'
    hello = 'messages=[{"role": "user", "content": "hello"}]'
    openaiBase = json.dumps(proxy + "/v1")
    programs = [
        "import openai; "
        f"client = openai.OpenAI(base_url={openaiBase}, api_key={token}, {headers}); "
        f"answer = client.chat.completions.create(model={json.dumps(models.chat)}, {hello}); "
        "print(answer.choices[0].message.content, answer.usage)",
        "import anthropic; "
        f"client = anthropic.Anthropic(base_url={json.dumps(proxy)}, api_key={token}, {headers}); "
        f"answer = client.messages.create(model={json.dumps(models.messages)},"
        f" max_tokens={DEMO_MAX_TOKENS}, {hello}); "
        "print(answer.content[0].text, answer.usage)",
    ]
    return [f"{shlex.quote(sys.executable)} -c {shlex.quote(program)}" for program in programs]


def announce(
    settings: Settings,
    demo: Mapping[str, Any],
    models: DemoModels,
    proxyAvailable: bool,
    memory: bool,
) -> None:
    """
    Print what runs, and the commands that try it with the demo token:
    C{models} are the demo organization's models the commands name
    (L{demoModels}), C{memory} whether svc-memory runs.
    """
    proxy = f"http://127.0.0.1:{settings.proxyPort}"
    lines = [
        "",
        "svc gateway is running:",
        f"  svc-auth   http://127.0.0.1:{settings.authPort}  (gRPC 127.0.0.1:"
        f"{settings.authGrpcPort})",
    ]
    if proxyAvailable:
        lines.append(f"  svc-proxy  {proxy}")
    model, embeddingModel, messagesModel = models
    headers = (
        f' -H "Authorization: Bearer {demo["token"]}"'
        f' -H "X-SVC-Agent-ID: {demo["agent_id"]}"'
        ' -H "Content-Type: application/json"'
    )
    body = '{"model":"%s",%s"messages":[{"role":"user","content":"hello"}]}'
    lines += [
        f"  demo organization {demo['org_id']}, agent {demo['agent_id']}",
        "",
        "Send a request through the gateway:"
        if model is not None
        else "Send a request through the gateway (svc-proxy has no model for the demo"
        " organization: it answers 501 PROVIDER_NOT_CONFIGURED):",
        "",
        f"  curl -i {proxy}/v1/chat/completions{headers} -d '{body % (model or DEMO_MODEL, '')}'",
    ]
    if model is not None:
        # Usage is relayed on a stream only when the client asks (D9).
        streaming = '"stream":true,"stream_options":{"include_usage":true},'
        lines += [
            "",
            f"Stream the answer of {model} (its usage comes last):",
            "",
            f"  curl -N {proxy}/v1/chat/completions{headers} -d '{body % (model, streaming)}'",
        ]
    if messagesModel is not None:
        # Decisions D14: Anthropic's Messages API, the token in x-api-key
        # as Anthropic's SDKs send it.
        anthropicHeaders = (
            f' -H "x-api-key: {demo["token"]}"'
            f' -H "X-SVC-Agent-ID: {demo["agent_id"]}"'
            f' -H "anthropic-version: {DEMO_ANTHROPIC_VERSION}"'
            ' -H "Content-Type: application/json"'
        )
        message = json.dumps(
            {
                "model": messagesModel,
                "max_tokens": DEMO_MAX_TOKENS,
                "messages": [{"role": "user", "content": "hello"}],
            },
            separators=(",", ":"),
        )
        lines += [
            "",
            f"Send it to {messagesModel} in Anthropic's shape (/v1/messages, the token in"
            " x-api-key as the anthropic SDK sends it):",
            "",
            f"  curl -i {proxy}/v1/messages{anthropicHeaders} -d '{message}'",
        ]
    if embeddingModel is not None:
        # Decisions D13: the embeddings route, with two texts.
        texts = '{"model":"%s","input":["the cat sat on the mat","the cat ran"]}'
        lines += [
            "",
            f"Embed two texts with {embeddingModel} (one vector each, its usage last):",
            "",
            f"  curl -i {proxy}/v1/embeddings{headers} -d '{texts % embeddingModel}'",
        ]
    if embeddingModel is not None and memory:
        # Decisions D13: a memory told, then found.
        subject = f' -H "X-SVC-Memory-Subject: {DEMO_SUBJECT}"'
        told = '{"content":"The user likes green tea in the morning."}'
        asked = '{"query":"What does the user drink in the morning?","k":3}'
        lines += [
            "",
            "Store a memory about a user of the demo agent, then search for it:",
            "",
            f"  curl -i {proxy}/v1/memories{headers}{subject} -d '{told}'",
            f"  curl -i {proxy}/v1/memories/search{headers}{subject} -d '{asked}'",
        ]
    if model is not None and embeddingModel is not None and memory:
        # Decisions D13: a fact told in a conversation, queued for
        # svc-worker (which asks the extraction model for its memories),
        # then recalled into a chat completion (X-SVC-Memories: how
        # many), then listed.
        subject = f' -H "X-SVC-Memory-Subject: {DEMO_FACT_SUBJECT}"'
        compact = (",", ":")
        told = json.dumps(
            {"messages": [{"role": "user", "content": DEMO_FACT}]}, separators=compact
        )
        asked = json.dumps(
            {"model": model, "messages": [{"role": "user", "content": DEMO_QUESTION}]},
            separators=compact,
        )
        lines += [
            "",
            "Tell the gateway a fact (svc-worker makes a memory of it within a second or so),",
            "ask about it (X-SVC-Memories: 1, the memory recalled into the prompt),"
            " then list the memories:",
            DEMO_OBSERVE_NOTE,
            "",
            f"  curl -i {proxy}/v1/memories{headers}{subject} -d '{told}'",
            f"  curl -i {proxy}/v1/chat/completions{headers}{subject} -d '{asked}'",
            f"  curl {proxy}/v1/memories{headers}{subject}",
        ]
    if model is not None:
        lines += [
            "",
            "With the openai SDK, then the anthropic SDK (longer programs: README.rst,"
            ' "Quick start"):',
            "",
            *(f"  {command}" for command in sdkCommands(proxy, demo, models)),
        ]
    lines += ["", "Ctrl-C stops everything.", ""]
    print("\n".join(lines), flush=True)


def demoModels(table: ProviderTable | None, orgID: str) -> DemoModels:
    """
    The first chat model, the first embedding model (decisions D13) and
    the first chat model of an Anthropic provider (decisions D14; else the
    first chat model) of C{table}, the providers file
    (SVC_PROVIDERS_FILE, or the one written for the model server), that
    the demo organization may use, each None without one (a chat request
    then answers 501; no embeddings command is printed).
    """
    if table is None:
        return DemoModels(None, None, None)
    models = table.modelsFor(orgID)
    chats = [model for model in models if model.kind == CHAT]
    chat = chats[0].name if chats else None
    embedding = next((model.name for model in models if model.kind == EMBEDDING), None)
    messages = next((model.name for model in chats if model.provider.api == ANTHROPIC), chat)
    return DemoModels(chat, embedding, messages)
