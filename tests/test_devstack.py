"""
dev/gateway as a newcomer meets it (issue 24 item 6, "The first run
serves"): without C{SVC_PROVIDERS_FILE} it runs the scripted model server
beside the stack, so that the curl commands it prints (in OpenAI's shape
and in Anthropic's), the command it prints for each SDK (C{openai} and
C{anthropic}, issue 46), and the C{openai} SDK program of README's Quick
start, get a model's answer with usage on the first run; with the
variable set it forwards to the file's providers (or, set but empty, to
none: 501) and runs no model server.

Each test runs L{svcd.devkit.gateway} as dev/gateway does after dev/bootstrap
(C{python -m svcd.devkit.gateway}), as a process of its own with ports of its
own and its data directory under the test's temporary directory, and runs
the commands it printed as printed. The default run starts its private
PostgreSQL and Redis as a newcomer's does; the other runs use the suite's
servers to be quicker. The machine may be loaded (every run starts some
ten Python processes): each wait is a poll with a generous deadline.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import anthropic
import attrs
import openai
import pytest

from svcd.devkit.gateway.children import stopLeftovers
from svcd.devkit.gateway.demo import (
    DEMO_CLAUDE_MODEL,
    DEMO_EMBEDDING_DIMENSIONS,
    DEMO_EMBEDDING_MODEL,
    DEMO_FACT,
    DEMO_MODEL,
    DEMO_OBSERVE_NOTE,
    DEMO_QUESTION,
)
from svcd.devkit.gateway.stack import MODEL_SERVER
from svcd.devkit.servers import freePort
from svcd.devkit.upstream.client import ScriptedUpstream
from svcd.devkit.upstream.content import embeddingOf
from svcd.metering.models import ANTHROPIC
from svcd.providers.providersfile import loadProviders

# Starts real daemons or processes (conftest.py, pytest.ini): left out of a
# quick run, dev/test -m "not e2e".
pytestmark = pytest.mark.e2e

CHECKOUT = Path(__file__).resolve().parents[1]
README = CHECKOUT / "README.rst"

# From the start of a run to its announcement: a new PostgreSQL cluster,
# the migrations, four svcctl processes (argon2 for the token) and three
# more Python processes, on two cores that others share.
START_LIMIT = 240.0
# dev/gateway gives each daemon 15 s after SIGTERM, then the servers.
STOP_LIMIT = 90.0
COMMAND_LIMIT = 60.0
# How long svc-worker may take to make a memory of an observation: about a
# second on an idle machine (its poll interval, an extraction and an
# embedding), much more on a loaded one.
WORKER_LIMIT = 60.0

PREFIX = "dev/gateway: "
ANNOUNCED = "Ctrl-C stops everything."

# What the scripted model server's echo answers to the printed request (one
# message, "hello"): its content, and one prompt word and ten answer words.
ECHO_CONTENT = "Scripted answer to 1 messages; the last has 5 characters."
ECHO_USAGE = {"prompt_tokens": 1, "completion_tokens": 10, "total_tokens": 11}
# The same usage as Anthropic's Messages API says it (the scripted server's,
# relayed as given from a provider of that API: no cache reads or writes).
ECHO_MESSAGES_USAGE = {
    "input_tokens": 1,
    "cache_creation_input_tokens": 0,
    "cache_read_input_tokens": 0,
    "output_tokens": 10,
}

# What the printed streaming command adds to the body to get the usage.
INCLUDE_USAGE = '"stream_options":{"include_usage":true},'

# Variables of this machine that would change what a run does.
_FOREIGN = re.compile(r"SVC_.*|POSTGRES_DSN|REDIS_URL|(?i:(https?|all|no)_proxy)")


def environmentOfTheTests() -> dict[str, str]:
    """
    The tests' environment without what would change a run or the commands
    it prints (svc variables, a proxy for HTTP), and with loopback never
    sent to a proxy.
    """
    environment = {
        name: value for name, value in os.environ.items() if not _FOREIGN.fullmatch(name)
    }
    environment["no_proxy"] = environment["NO_PROXY"] = "127.0.0.1,localhost"
    return environment


def _commandLine(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


@attrs.define
class GatewayRun:
    """
    One run of dev/gateway: its process, what it wrote (stdout: the
    announcement and the daemons' logs; stderr: its own lines) and where
    its data lives.
    """

    process: subprocess.Popen[bytes]
    directory: Path
    dataDirectory: Path
    stdout: Path
    stderr: Path
    proxyPort: int

    @property
    def processRecord(self) -> Path:
        return self.dataDirectory / "processes.json"

    def ourLines(self) -> list[str]:
        """
        The lines dev/gateway wrote of its own on stderr.
        """
        lines = self.stderr.read_text(errors="replace").splitlines()
        return [line for line in lines if line.startswith(PREFIX)]

    def report(self, lastLines: int = 40) -> str:
        """
        What a failed start shows: dev/gateway's own lines, then the last
        C{lastLines} of everything else it and its daemons wrote (the
        reason a daemon exited before it was ready is there, and gone with
        the test's temporary directory).
        """
        stdout = self.stdout.read_text(errors="replace").splitlines()
        stderr = self.stderr.read_text(errors="replace").splitlines()
        others = [line for line in stderr if not line.startswith(PREFIX)]
        return "\n".join(
            [
                *self.ourLines(),
                f"--- the last {lastLines} lines of stdout:",
                *stdout[-lastLines:],
                f"--- the last {lastLines} other lines of stderr:",
                *others[-lastLines:],
            ]
        )

    def waitForAnnouncement(self) -> list[str]:
        """
        Wait until the run has printed what to try, and return its stdout's
        lines.

        @raise AssertionError: when it exits first, or takes too long; the
            message holds its own lines.
        """
        deadline = time.monotonic() + START_LIMIT
        while True:
            text = self.stdout.read_text(errors="replace")
            if ANNOUNCED in text:
                return text.splitlines()
            status = self.process.poll()
            assert status is None, f"dev/gateway exited with {status}:\n{self.report()}"
            assert time.monotonic() < deadline, f"no announcement:\n{self.report()}"
            time.sleep(0.1)

    def printedCommands(self) -> list[str]:
        """
        The curl commands of the announcement, as printed (without their
        indentation).
        """
        lines = self.waitForAnnouncement()
        return [line.strip() for line in lines if line.startswith("  curl ")]

    def printedSDKCommands(self) -> list[str]:
        """
        The SDKs' commands of the announcement, as printed (without their
        indentation): this Python (the one dev/gateway ran with) running a
        program.
        """
        lines = self.waitForAnnouncement()
        python = f"  {shlex.quote(sys.executable)} -c "
        return [line.strip() for line in lines if line.startswith(python)]

    def recorded(self) -> dict[str, dict[str, Any]]:
        """
        processes.json by name: what a killed run would leave running.
        """
        return {entry["name"]: entry for entry in json.loads(self.processRecord.read_text())}

    def stop(self, signum: int = signal.SIGINT) -> int:
        """
        Send C{signum} (Ctrl-C) and return the exit status once it exits.
        """
        if self.process.poll() is None:
            self.process.send_signal(signum)
        try:
            return self.process.wait(STOP_LIMIT)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise AssertionError(f"not stopped within {STOP_LIMIT:.0f} s") from None


@attrs.define
class Runs:
    """
    Starts runs of dev/gateway, and leaves nothing of them running: each is
    stopped with Ctrl-C, and what processes.json still names afterwards (a
    run killed outright, whose leftovers no later run stopped) with
    dev/gateway's own L{stopLeftovers}.
    """

    base: Path
    started: list[GatewayRun] = attrs.Factory(list)

    def start(
        self, environment: Mapping[str, str], ports: tuple[int, int, int] | None = None
    ) -> GatewayRun:
        """
        Start a run with C{environment} added to the tests' own, on
        C{ports} (proxy, auth HTTP, auth gRPC; free ones by default), its
        data in C{.data} of the test's directory.
        """
        number = len(self.started) + 1
        directory = self.base / f"run-{number}"
        directory.mkdir(parents=True)
        dataDirectory = self.base / ".data"
        proxyPort, authPort, grpcPort = ports or (freePort(), freePort(), freePort())
        stdout, stderr = directory / "stdout", directory / "stderr"
        with stdout.open("wb") as out, stderr.open("wb") as err:
            process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "svcd.devkit.gateway",
                    "--data-directory",
                    str(dataDirectory),
                ],
                env={
                    **environmentOfTheTests(),
                    "SVC_PROXY_PORT": str(proxyPort),
                    "SVC_AUTH_PORT": str(authPort),
                    "SVC_AUTH_GRPC_PORT": str(grpcPort),
                    # svc-memory's, when the providers file turns memory on.
                    "SVC_MEMORY_PORT": str(freePort()),
                    "SVC_MEMORY_GRPC_PORT": str(freePort()),
                    # svc-worker's, which runs beside svc-memory.
                    "SVC_WORKER_PORT": str(freePort()),
                    **environment,
                },
                cwd=CHECKOUT,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
            )
        run = GatewayRun(process, directory, dataDirectory, stdout, stderr, proxyPort)
        self.started.append(run)
        return run

    def stopAll(self) -> None:
        for run in reversed(self.started):
            # A run that does not stop is killed by stop(); its leftovers
            # are stopped below.
            with contextlib.suppress(AssertionError):
                run.stop()
        for record in {run.processRecord for run in self.started}:
            stopLeftovers(record, timeout=STOP_LIMIT)


@pytest.fixture
def runs(tmp_path: Path) -> Iterator[Runs]:
    started = Runs(tmp_path)
    yield started
    started.stopAll()


@pytest.fixture
def sharedServers(databaseDSN: str, redisURL: str) -> dict[str, str]:
    """
    The suite's PostgreSQL (a new database) and Redis, for runs whose
    servers are not what the test is about. Ask for it before C{runs}, so
    that the runs are stopped before the database is dropped.
    """
    return {"POSTGRES_DSN": databaseDSN, "REDIS_URL": redisURL}


@pytest.fixture(scope="module")
def firstRun(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayRun]:
    """
    dev/gateway as a newcomer runs it: no variable set, nothing in .data,
    its own PostgreSQL and Redis. Shared by the tests that only send
    requests through it.
    """
    started = Runs(tmp_path_factory.mktemp("first-run"))
    try:
        run = started.start({})
        run.waitForAnnouncement()
        yield run
    finally:
        started.stopAll()


def runCurl(command: str, body: Callable[[str], str] = lambda body: body) -> str:
    """
    Run a printed curl command as a shell would split it, its C{-d} body
    (if any) first passed through C{body}; return its stdout.
    """
    arguments = shlex.split(command)
    assert arguments[0] == "curl", command
    if "-d" in arguments:
        data = arguments.index("-d") + 1
        arguments[data] = body(arguments[data])
    result = subprocess.run(
        # --silent: no progress meter on stderr (the printed command
        # shows one on a terminal).
        [shutil.which("curl") or "curl", "--silent", *arguments[1:]],
        env=environmentOfTheTests(),
        capture_output=True,
        timeout=COMMAND_LIMIT,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.decode()


def parseResponse(output: str) -> tuple[int, dict[str, str], Any]:
    """
    The status, headers (lower-case names) and JSON body of C{curl -i}'s
    output.
    """
    head, _, body = output.partition("\r\n\r\n")
    statusLine, *headerLines = head.split("\r\n")
    headers = {}
    for line in headerLines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(statusLine.split()[1]), headers, json.loads(body)


def streamEvents(output: str) -> list[str]:
    """
    The data of each server-sent event of C{curl -N}'s output.
    """
    events = [event for event in output.split("\n\n") if event.strip()]
    assert all(event.startswith("data: ") for event in events), output
    return [event.removeprefix("data: ") for event in events]


needsCurl = pytest.mark.skipif(
    shutil.which("curl") is None, reason="curl is missing (dev/bootstrap installs it)"
)


def test_firstRunSaysItRunsTheModelServer(firstRun: GatewayRun) -> None:
    """
    Without SVC_PROVIDERS_FILE, dev/gateway says in one line that the
    scripted model server answers the models "demo", "demo-claude" and
    "demo-embed", naming its address and the providers file it wrote under
    .data; that file sends all three there, the second through a provider
    of Anthropic's Messages API (decisions D14) at the same address, priced
    as a Claude model with cache writes, the third an embedding model
    (decisions D13); processes.json names the server with its command
    line, so that a killed run's server is stopped by the next.
    """
    lines = firstRun.ourLines()
    [line] = [line for line in lines if "model server" in line]
    providersFile = firstRun.dataDirectory / "providers.toml"
    match = re.fullmatch(
        re.escape(PREFIX + "model server: the scripted one of the tests on 127.0.0.1:")
        + r"(\d+)"
        + re.escape(
            f' answers the models "{DEMO_MODEL}", "{DEMO_CLAUDE_MODEL}" (Anthropic\'s Messages'
            f' API) and "{DEMO_EMBEDDING_MODEL}" (providers file {providersFile};'
            " SVC_PROVIDERS_FILE names your own)"
        ),
        line,
    )
    assert match is not None, line
    port = int(match.group(1))
    table = loadProviders(str(providersFile), {}, time.time)
    model, claude, embedding = table.modelsFor("00000000-0000-4000-8000-000000000000")
    assert (model.name, model.kind) == (DEMO_MODEL, "chat")
    assert (claude.name, claude.kind) == (DEMO_CLAUDE_MODEL, "chat")
    assert (embedding.name, embedding.kind) == (DEMO_EMBEDDING_MODEL, "embedding")
    assert embedding.dimensions == DEMO_EMBEDDING_DIMENSIONS
    assert model.provider.baseURL == f"http://127.0.0.1:{port}/v1"
    assert embedding.provider is model.provider
    assert model.provider.api != ANTHROPIC
    assert claude.provider.api == ANTHROPIC
    assert claude.provider.messagesURL == f"http://127.0.0.1:{port}/v1/messages"
    assert claude.upstreamModel == model.upstreamModel == "echo"
    # As Anthropic prices a Claude model, in nano-dollars per million tokens.
    assert claude.price is not None
    assert (
        claude.price.input,
        claude.price.cachedInput,
        claude.price.cacheWrite,
        claude.price.output,
    ) == (3_000_000_000, 300_000_000, 3_750_000_000, 15_000_000_000)
    # svc-worker asks the chat model for memories (decisions D13).
    assert table.memory is not None
    assert table.memory.embeddingModel is embedding
    assert table.memory.extractionModel is model
    entry = firstRun.recorded()[MODEL_SERVER]
    assert "svcd.devkit.upstream" in entry["command"]
    assert _commandLine(entry["pid"]) == entry["command"]


@needsCurl
def test_printedCommandGetsTheModelsAnswerWithUsage(firstRun: GatewayRun) -> None:
    """
    The first printed command, run as printed, answers 200 with the
    model's answer and its usage, from the model "demo".
    """
    plain, *_ = firstRun.printedCommands()
    assert plain.startswith(f"curl -i http://127.0.0.1:{firstRun.proxyPort}/v1/chat/completions")
    status, headers, answer = parseResponse(runCurl(plain))
    assert status == 200, answer
    assert headers["x-svc-upstream-model"] == DEMO_MODEL
    assert answer["object"] == "chat.completion"
    assert answer["choices"][0]["message"]["content"] == ECHO_CONTENT
    assert answer["usage"] == ECHO_USAGE


@needsCurl
def test_printedStreamingCommandEndsWithUsageAndDone(firstRun: GatewayRun) -> None:
    """
    The printed streaming command gets the answer as chunk events, then
    the usage event it asks for, then data: [DONE]; without
    stream_options the same events come without the usage event.
    """
    _, streaming, *_ = firstRun.printedCommands()
    assert streaming.startswith("curl -N ") and '"stream":true' in streaming
    assert INCLUDE_USAGE in streaming
    *chunks, usage, done = streamEvents(runCurl(streaming))
    assert done == "[DONE]"
    assert json.loads(usage)["choices"] == []
    assert json.loads(usage)["usage"] == ECHO_USAGE
    parsed = [json.loads(chunk) for chunk in chunks]
    assert all(chunk["object"] == "chat.completion.chunk" for chunk in parsed)
    content = "".join(chunk["choices"][0]["delta"].get("content", "") for chunk in parsed)
    assert content == ECHO_CONTENT
    assert parsed[-1]["choices"][0]["finish_reason"] == "stop"

    *chunks, done = streamEvents(runCurl(streaming, lambda body: body.replace(INCLUDE_USAGE, "")))
    assert done == "[DONE]"
    assert all(json.loads(chunk)["choices"] for chunk in chunks)
    assert all(json.loads(chunk).get("usage") is None for chunk in chunks)


@needsCurl
def test_printedMessagesCommandGetsClaudesAnswer(firstRun: GatewayRun) -> None:
    """
    Issue 46: the third printed command, run as printed, sends Anthropic's
    shape to /v1/messages with the demo token in x-api-key (as the
    anthropic SDK does) and answers 200 from the model "demo-claude" with
    a message in Anthropic's shape and its usage (relayed as the Anthropic
    provider gave it).
    """
    _, _, messages, *_ = firstRun.printedCommands()
    assert messages.startswith(f"curl -i http://127.0.0.1:{firstRun.proxyPort}/v1/messages ")
    arguments = shlex.split(messages)
    demo = json.loads((firstRun.dataDirectory / "demo.json").read_text())
    assert f"x-api-key: {demo['token']}" in arguments
    assert not any(argument.startswith("Authorization") for argument in arguments)
    status, headers, answer = parseResponse(runCurl(messages))
    assert status == 200, answer
    assert headers["x-svc-upstream-model"] == DEMO_CLAUDE_MODEL
    assert (answer["type"], answer["role"], answer["stop_reason"]) == (
        "message",
        "assistant",
        "end_turn",
    )
    assert answer["content"] == [{"type": "text", "text": ECHO_CONTENT}]
    assert {key: answer["usage"][key] for key in ECHO_MESSAGES_USAGE} == ECHO_MESSAGES_USAGE


def test_printedSDKCommandsGetAnswers(firstRun: GatewayRun) -> None:
    """
    Issue 46, "one command for each SDK": the two printed Python commands,
    run as printed (split as a shell would), answer "hello" through the
    gateway: the openai SDK's from "demo" with OpenAI's usage, the
    anthropic SDK's from "demo-claude" (its base URL the gateway's root,
    the token as its api_key) with Anthropic's.
    """
    openaiCommand, anthropicCommand = firstRun.printedSDKCommands()
    outputs = []
    for command, sdk, model in (
        (openaiCommand, "openai", DEMO_MODEL),
        (anthropicCommand, "anthropic", DEMO_CLAUDE_MODEL),
    ):
        arguments = shlex.split(command)
        assert arguments[:2] == [sys.executable, "-c"], command
        assert arguments[2].startswith(f"import {sdk}; ")
        assert f'model="{model}"' in arguments[2]
        result = subprocess.run(
            arguments,
            cwd=firstRun.directory,
            env=environmentOfTheTests(),
            capture_output=True,
            text=True,
            timeout=COMMAND_LIMIT,
            check=False,
        )
        assert result.returncode == 0, result.stderr
        outputs.append(result.stdout.strip())
    openaiOutput, anthropicOutput = outputs
    assert openaiOutput.startswith(
        ECHO_CONTENT + " CompletionUsage(completion_tokens=10, prompt_tokens=1, total_tokens=11"
    )
    assert anthropicOutput.startswith(ECHO_CONTENT + " Usage(")
    for key, value in ECHO_MESSAGES_USAGE.items():
        assert f"{key}={value}" in anthropicOutput, anthropicOutput


def test_theClaudeModelIsListedAndAnswersTheAnthropicSDK(firstRun: GatewayRun) -> None:
    """
    Issue 46: GET /v1/models lists "demo-claude" beside "demo" and
    "demo-embed", owned by the Anthropic provider; the official anthropic
    SDK, pointed at the gateway with the demo token, gets its answer whole
    and streamed (the text deltas, then the final message with its usage).
    """
    demo = json.loads((firstRun.dataDirectory / "demo.json").read_text())
    proxy = f"http://127.0.0.1:{firstRun.proxyPort}"
    headers = {"X-SVC-Agent-ID": demo["agent_id"]}
    with openai.OpenAI(
        base_url=proxy + "/v1", api_key=demo["token"], default_headers=headers, max_retries=0
    ) as chat:
        listed = {model.id: model.owned_by for model in chat.models.list()}
    assert listed == {
        DEMO_MODEL: "scripted",
        DEMO_CLAUDE_MODEL: "scripted-anthropic",
        DEMO_EMBEDDING_MODEL: "scripted",
    }
    hello: list[anthropic.types.MessageParam] = [{"role": "user", "content": "hello"}]
    with anthropic.Anthropic(
        base_url=proxy,
        api_key=demo["token"],
        default_headers=headers,
        max_retries=0,
        timeout=COMMAND_LIMIT,
    ) as sdk:
        message = sdk.messages.create(model=DEMO_CLAUDE_MODEL, max_tokens=1024, messages=hello)
        with sdk.messages.stream(
            model=DEMO_CLAUDE_MODEL, max_tokens=1024, messages=hello
        ) as stream:
            streamed = "".join(stream.text_stream)
            final = stream.get_final_message()
    assert message.content[0].type == "text"
    assert message.content[0].text == streamed == ECHO_CONTENT
    assert (message.usage.input_tokens, message.usage.output_tokens) == (1, 10)
    assert final.stop_reason == "end_turn"
    assert (final.usage.input_tokens, final.usage.output_tokens) == (1, 10)


@needsCurl
def test_printedEmbeddingsCommandGetsVectors(firstRun: GatewayRun) -> None:
    """
    Decisions D13: the printed embeddings command, run as printed, answers
    200 from the model "demo-embed" with one vector of its dimensions per
    text (the scripted server's: texts that share words are near) and the
    usage; the demo token has ProxyEmbeddings.
    """
    _, _, _, embeddings, *_ = firstRun.printedCommands()
    assert embeddings.startswith(f"curl -i http://127.0.0.1:{firstRun.proxyPort}/v1/embeddings")
    status, headers, answer = parseResponse(runCurl(embeddings))
    assert status == 200, answer
    assert headers["x-svc-upstream-model"] == DEMO_EMBEDDING_MODEL
    texts = json.loads(shlex.split(embeddings)[-1])["input"]
    assert [item["embedding"] for item in answer["data"]] == [
        embeddingOf(text, DEMO_EMBEDDING_DIMENSIONS)[0] for text in texts
    ]
    assert answer["usage"] == {"prompt_tokens": 9, "total_tokens": 9}
    demo = json.loads((firstRun.dataDirectory / "demo.json").read_text())
    # ProxyChatCompletion, ProxyEmbeddings, MemoryRead and MemoryWrite.
    assert demo["permissions"] == 1 + 32 + 64 + 128


@needsCurl
def test_printedMemoryCommandsStoreAndFind(firstRun: GatewayRun) -> None:
    """
    Decisions D13: on the first run svc-memory runs beside the others and
    memory is on (the written providers file has a [memory] table naming
    "demo-embed"); the printed commands, run as printed, store a memory
    of a subject (201) and the search finds it first.
    """
    _, _, _, _, store, search, *_ = firstRun.printedCommands()
    assert store.startswith(f"curl -i http://127.0.0.1:{firstRun.proxyPort}/v1/memories ")
    assert "X-SVC-Memory-Subject: " in store
    status, _, memory = parseResponse(runCurl(store))
    assert status == 201, memory
    assert memory["object"] == "memory"
    assert memory["content"] == json.loads(shlex.split(store)[-1])["content"]
    status, _, found = parseResponse(runCurl(search))
    assert status == 200, found
    assert found["data"][0]["memory"]["id"] == memory["id"]
    assert "svc-memory" in firstRun.recorded()


@needsCurl
def test_printedCommandsTellAFactThatIsRecalled(firstRun: GatewayRun) -> None:
    """
    Issue 33, "The first run remembers": svc-worker runs beside svc-memory,
    the demo agent has recall and observe on, and the last three printed
    commands, run as printed and in order, queue the fact told (202), which
    the worker turns into a memory through the scripted extraction (waited
    for by listing, with a bounded limit); the question then has the
    memory recalled into its prompt (X-SVC-Memories: 1, and the scripted
    answer counts the message it was given besides the question); the
    same question to "demo-claude" with the anthropic SDK (issue 46) has
    it recalled into its system prompt alike; the list shows the one
    memory, extracted, of the fact's words.
    """
    *_, tell, ask, listing = firstRun.printedCommands()
    assert "svc-worker" in firstRun.recorded()
    proxy = f"curl -i http://127.0.0.1:{firstRun.proxyPort}"
    assert tell.startswith(f"{proxy}/v1/memories ") and '"messages"' in tell
    assert ask.startswith(f"{proxy}/v1/chat/completions ")
    assert listing.startswith(f"curl http://127.0.0.1:{firstRun.proxyPort}/v1/memories ")
    assert "-d" not in shlex.split(listing)

    status, _, queued = parseResponse(runCurl(tell))
    assert status == 202, queued
    assert (queued["object"], queued["status"]) == ("memory.observation", "queued")

    deadline = time.monotonic() + WORKER_LIMIT
    while not (memories := json.loads(runCurl(listing))["data"]):
        assert time.monotonic() < deadline, "svc-worker made no memory of the fact told"
        time.sleep(0.1)

    status, headers, answer = parseResponse(runCurl(ask))
    assert status == 200, answer
    assert headers["x-svc-memories"] == "1"
    question = json.loads(shlex.split(ask)[-1])["messages"][-1]["content"]
    # The recalled memories' message, then the question.
    assert answer["choices"][0]["message"]["content"] == (
        f"Scripted answer to 2 messages; the last has {len(question)} characters."
    )

    # Issue 46: the same question of the same user, to "demo-claude" with
    # the anthropic SDK, has the memory recalled into its system prompt
    # (decisions D14: the block after the client's own, here the only
    # one), which the scripted answer counts as one more message.
    demo = json.loads((firstRun.dataDirectory / "demo.json").read_text())
    with anthropic.Anthropic(
        base_url=f"http://127.0.0.1:{firstRun.proxyPort}",
        api_key=demo["token"],
        default_headers={
            "X-SVC-Agent-ID": demo["agent_id"],
            "X-SVC-Memory-Subject": subjectOf(ask),
        },
        max_retries=0,
        timeout=COMMAND_LIMIT,
    ) as sdk:
        raw = sdk.messages.with_raw_response.create(
            model=DEMO_CLAUDE_MODEL,
            max_tokens=1024,
            messages=[{"role": "user", "content": DEMO_QUESTION}],
        )
    assert raw.headers["X-SVC-Memories"] == "1"
    recalled = raw.parse().content[0]
    assert recalled.type == "text"
    assert recalled.text == (
        f"Scripted answer to 2 messages; the last has {len(DEMO_QUESTION)} characters."
    )

    # The questions were observed too; a question states nothing, so it
    # adds no memory.
    listed = json.loads(runCurl(listing))
    assert [(memory["content"], memory["source"]) for memory in listed["data"]] == [
        (DEMO_FACT, "extracted")
    ]
    assert listed["data"][0]["id"] == memories[0]["id"]


def subjectOf(command: str) -> str:
    """
    The memory subject a printed command names.
    """
    [subject] = [
        argument.removeprefix("X-SVC-Memory-Subject: ")
        for argument in shlex.split(command)
        if argument.startswith("X-SVC-Memory-Subject: ")
    ]
    return subject


def observationsCounted(run: GatewayRun) -> dict[str, float]:
    """
    svc_proxy_memory_observations_total of the run's svc-proxy, by outcome.
    """
    with urllib.request.urlopen(
        f"http://127.0.0.1:{run.proxyPort}/metrics", timeout=COMMAND_LIMIT
    ) as response:
        text = response.read().decode()
    found = re.findall(
        r'^svc_proxy_memory_observations_total\{outcome="([a-z_]+)"\} (\S+)$', text, re.MULTILINE
    )
    return {outcome: float(value) for outcome, value in found}


@needsCurl
def test_theDemoAgentObservesOnlyChatsThatNameTheirUser(firstRun: GatewayRun) -> None:
    """
    Decisions D13 amended, "Whose words": the demo agent's observe is on,
    not all, and the announcement says so beside the fact's commands
    (which name their user); the first printed command, a hello chat that
    names no user, is answered as usual and left unobserved, counted
    no_subject, while nothing more is recorded; so is the hello of the
    printed /v1/messages command to "demo-claude" (issue 46), and of
    each SDK's command.
    """
    lines = [line.strip() for line in firstRun.waitForAnnouncement()]
    assert DEMO_OBSERVE_NOTE in lines
    assert lines.index(DEMO_OBSERVE_NOTE) < lines.index(firstRun.printedCommands()[-3])
    plain, _, messages, *_ = firstRun.printedCommands()
    for hello in (plain, messages, *firstRun.printedSDKCommands()):
        assert "X-SVC-Memory-Subject" not in hello
    for hello in (plain, messages):
        before = observationsCounted(firstRun)
        status, _, answer = parseResponse(runCurl(hello))
        assert status == 200, answer
        after = observationsCounted(firstRun)
        assert after["no_subject"] == before.get("no_subject", 0) + 1
        assert after["recorded"] == before["recorded"]


def readmeSDKProgram() -> str:
    """
    The C{openai} SDK program of README's Quick start: the literal block
    that imports openai.
    """
    lines = README.read_text().splitlines()
    quickStart = lines.index("Quick start")
    start = lines.index("    import openai", quickStart)
    while not lines[start - 1].endswith("::"):
        start -= 1
    end = start
    while end < len(lines) and (lines[end].startswith("    ") or not lines[end].strip()):
        end += 1
    return textwrap.dedent("\n".join(lines[start:end]))


def test_readmeSDKProgramGetsAnswersWithUsage(firstRun: GatewayRun) -> None:
    """
    The openai SDK program of README's Quick start, run from the directory
    that holds .data (as from the checkout) with the run's port in place of
    8080, lists the models "demo", "demo-claude" and "demo-embed", prints its answer with
    the usage, and streams it with the usage chunk last.
    """
    program = readmeSDKProgram()
    assert 'base_url="http://127.0.0.1:8080/v1"' in program
    assert firstRun.dataDirectory.name == ".data"
    result = subprocess.run(
        [sys.executable, "-c", program.replace(":8080/", f":{firstRun.proxyPort}/")],
        cwd=firstRun.dataDirectory.parent,
        env=environmentOfTheTests(),
        capture_output=True,
        text=True,
        timeout=COMMAND_LIMIT,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    models, answer, *streamed, usage = result.stdout.splitlines()
    assert models == f"['{DEMO_MODEL}', '{DEMO_CLAUDE_MODEL}', '{DEMO_EMBEDDING_MODEL}']"
    usageText = "completion_tokens=10, prompt_tokens=1, total_tokens=11"
    assert answer.startswith(ECHO_CONTENT + " CompletionUsage(" + usageText)
    # The role chunk's empty content, a word per chunk (its space kept),
    # the finish chunk's None, then the usage chunk.
    assert "".join(streamed[1:-1]) == ECHO_CONTENT
    assert streamed[-1] == "None"
    assert usage.startswith("CompletionUsage(" + usageText)


def readmeAnthropicProgram() -> str:
    """
    The C{anthropic} SDK program of README's Quick start: the literal
    block that imports anthropic.
    """
    lines = README.read_text().splitlines()
    quickStart = lines.index("Quick start")
    start = lines.index("    import anthropic", quickStart)
    while not lines[start - 1].endswith("::"):
        start -= 1
    end = start
    while end < len(lines) and (lines[end].startswith("    ") or not lines[end].strip()):
        end += 1
    return textwrap.dedent("\n".join(lines[start:end]))


def test_readmeAnthropicProgramGetsAnswersWithUsage(firstRun: GatewayRun) -> None:
    """
    Issue 46, "README (both SDKs in the first run)": the anthropic SDK
    program of README's Quick start, run as the openai one (from the
    directory that holds .data, the run's port in place of 8080), prints
    "demo-claude"'s answer with its usage, streams it a word per line, then
    prints the final message's usage. As README says, either SDK may name
    either model: the same program naming "demo" (an OpenAI-compatible
    provider: translated) prints the same, and so does the openai program
    naming "demo-claude".
    """
    program = readmeAnthropicProgram()
    assert 'base_url="http://127.0.0.1:8080"' in program
    assert f'model="{DEMO_CLAUDE_MODEL}"' in program

    def run(source: str) -> list[str]:
        result = subprocess.run(
            [sys.executable, "-c", source.replace(':8080"', f':{firstRun.proxyPort}"')],
            cwd=firstRun.dataDirectory.parent,
            env=environmentOfTheTests(),
            capture_output=True,
            text=True,
            timeout=COMMAND_LIMIT,
            check=False,
        )
        assert result.returncode == 0, result.stderr
        return result.stdout.splitlines()

    for source in (program, program.replace(f'"{DEMO_CLAUDE_MODEL}"', f'"{DEMO_MODEL}"')):
        answer, *streamed, usage = run(source)
        assert answer.startswith(ECHO_CONTENT + " Usage(")
        assert usage.startswith("Usage(")
        for text in (answer, usage):
            for key, value in ECHO_MESSAGES_USAGE.items():
                assert f"{key}={value}" in text, text
        # A word per text delta, its space kept.
        assert streamed == re.findall(r"\S+\s*", ECHO_CONTENT)

    openaiProgram = readmeSDKProgram().replace(":8080/", f":{firstRun.proxyPort}/")
    openaiProgram = openaiProgram.replace(f'model="{DEMO_MODEL}"', f'model="{DEMO_CLAUDE_MODEL}"')
    _, answer, *streamed, usage = run(openaiProgram)
    usageText = "completion_tokens=10, prompt_tokens=1, total_tokens=11"
    assert answer.startswith(ECHO_CONTENT + " CompletionUsage(" + usageText)
    assert "".join(streamed[1:-1]) == ECHO_CONTENT
    assert usage.startswith("CompletionUsage(" + usageText)


def readmeSDKMemoryProgram() -> str:
    """
    README's second C{openai} SDK program: the first run remembering
    (the literal block that names X-SVC-Memory-Subject).
    """
    lines = README.read_text().splitlines()
    quickStart = lines.index("Quick start")
    start = next(
        index
        for index in range(quickStart, len(lines))
        if lines[index].strip().startswith('"X-SVC-Memory-Subject"')
    )
    while not lines[start - 1].endswith("::"):
        start -= 1
    end = start
    while end < len(lines) and (lines[end].startswith("    ") or not lines[end].strip()):
        end += 1
    return textwrap.dedent("\n".join(lines[start:end]))


def test_readmeSDKMemoryProgramRemembersAndRecalls(firstRun: GatewayRun) -> None:
    """
    Issue 33: "README shows the same with the openai SDK". README's memory
    program, run as the other: its chat tells a fact, which is observed
    (observe is on for the demo agent) and made a memory by svc-worker;
    the listing shows it, extracted; the question after it has it
    recalled (X-SVC-Memories: 1, and the scripted answer counts the
    memories' message besides the question).
    """
    program = readmeSDKMemoryProgram()
    assert 'base_url="http://127.0.0.1:8080/v1"' in program
    result = subprocess.run(
        [sys.executable, "-c", program.replace(":8080/", f":{firstRun.proxyPort}/")],
        cwd=firstRun.dataDirectory.parent,
        env=environmentOfTheTests(),
        capture_output=True,
        text=True,
        # The program waits up to 60 s for the worker itself.
        timeout=COMMAND_LIMIT + WORKER_LIMIT,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    listed, memories, answer = result.stdout.splitlines()
    assert listed == "[('I drink green tea every morning.', 'extracted')]"
    assert memories == "X-SVC-Memories: 1"
    question = "What do I drink in the morning?"
    assert answer == f"Scripted answer to 2 messages; the last has {len(question)} characters."


@needsCurl
def test_ctrlCStopsTheModelServerAndAKilledRunsIsStoppedNextTime(
    sharedServers: dict[str, str], runs: Runs
) -> None:
    """
    A run killed outright leaves its model server and daemons running; the
    next run on the same data directory and ports stops them (one line
    each), starts its own and serves; Ctrl-C then stops all of it, the
    model server included, exits 0 and removes processes.json.
    """
    ports = (freePort(), freePort(), freePort())
    killed = runs.start(sharedServers, ports)
    killed.waitForAnnouncement()
    left = killed.recorded()
    # svc-memory too: the written providers file turns memory on.
    assert set(left) == {MODEL_SERVER, "svc-auth", "svc-memory", "svc-proxy", "svc-worker"}
    killed.process.kill()
    killed.process.wait()
    for name, entry in left.items():
        # Recorded as /proc shows it once the program runs: never empty.
        assert entry["command"], name
        assert _commandLine(entry["pid"]) == entry["command"], (name, _commandLine(entry["pid"]))

    second = runs.start(sharedServers, ports)
    plain, *_ = second.printedCommands()
    for name, entry in left.items():
        assert _commandLine(entry["pid"]) != entry["command"], name
        stopped = f"stopping {name} left running by an earlier run (pid {entry['pid']})"
        assert PREFIX + stopped in second.ourLines()
    status, _, answer = parseResponse(runCurl(plain))
    assert status == 200, answer
    assert answer["usage"] == ECHO_USAGE

    running = second.recorded()
    assert running[MODEL_SERVER]["pid"] != left[MODEL_SERVER]["pid"]
    assert second.stop(signal.SIGINT) == 0
    for name, entry in running.items():
        assert _commandLine(entry["pid"]) != entry["command"], name
    assert PREFIX + f"stopping {MODEL_SERVER}" in second.ourLines()
    assert not second.processRecord.exists()


@needsCurl
def test_providersFileSetRunsNoModelServer(
    sharedServers: dict[str, str], runs: Runs, scriptedUpstream: ScriptedUpstream, tmp_path: Path
) -> None:
    """
    With SVC_PROVIDERS_FILE naming a file, dev/gateway starts no model
    server and writes no providers file; svc-proxy forwards to the file's
    provider, whose first model the printed commands name: the Messages
    command and the anthropic SDK's too, the file having no Anthropic
    provider (decisions D14: a model of an OpenAI-compatible provider
    serves /v1/messages, translated to a chat completion).
    """
    providers = tmp_path / "providers.toml"
    providers.write_text(
        "[[providers]]\n"
        'name = "mine"\n'
        f'base_url = "{scriptedUpstream.baseURL}"\n'
        "[[models]]\n"
        'name = "fast"\n'
        'provider = "mine"\n'
        'upstream_model = "echo"\n'
    )
    run = runs.start({**sharedServers, "SVC_PROVIDERS_FILE": str(providers)})
    plain, streaming, messages = run.printedCommands()
    assert '"model":"fast"' in plain and '"model":"fast"' in streaming
    assert '"model":"fast"' in messages
    assert all('model="fast"' in command for command in run.printedSDKCommands())
    assert not any("model server" in line for line in run.ourLines())
    assert set(run.recorded()) == {"svc-auth", "svc-proxy"}
    assert not (run.dataDirectory / "providers.toml").exists()
    status, headers, answer = parseResponse(runCurl(plain))
    assert status == 200, answer
    assert (headers["x-svc-upstream-model"], answer["usage"]) == ("fast", ECHO_USAGE)
    [forwarded] = scriptedUpstream.requests()
    assert forwarded.body["model"] == "echo"
    status, headers, answer = parseResponse(runCurl(messages))
    assert status == 200, answer
    assert headers["x-svc-upstream-model"] == "fast"
    assert answer["content"] == [{"type": "text", "text": ECHO_CONTENT}]
    assert (answer["usage"]["input_tokens"], answer["usage"]["output_tokens"]) == (1, 10)
    _, translated = scriptedUpstream.requests()
    assert translated.path == "/v1/chat/completions"
    assert translated.body["model"] == "echo"


@needsCurl
def test_emptyProvidersFileAnswers501(sharedServers: dict[str, str], runs: Runs) -> None:
    """
    With SVC_PROVIDERS_FILE set but empty, dev/gateway runs as before the
    model server existed: none runs, svc-proxy has no provider, and the one
    printed command says so and answers 501 PROVIDER_NOT_CONFIGURED.
    """
    run = runs.start({**sharedServers, "SVC_PROVIDERS_FILE": ""})
    [plain] = run.printedCommands()
    assert "501 PROVIDER_NOT_CONFIGURED" in "\n".join(run.waitForAnnouncement())
    assert not any("model server" in line for line in run.ourLines())
    assert set(run.recorded()) == {"svc-auth", "svc-proxy"}
    status, _, answer = parseResponse(runCurl(plain))
    assert status == 501, answer
    assert answer["error"]["code"] == "PROVIDER_NOT_CONFIGURED"
