"""
Benchmark of the whole gateway over loopback with wrk.

    python bench/gateway.py [--duration 10] [--connections 32,256] [--workers 1,2]
    python bench/gateway.py --soak 600

Starts, on this machine, its own PostgreSQL and Redis, `twistd -n
svc-auth`, `twistd -n svc-proxy` and a bare Klein handler (bench/floor.py)
that answers the same 501 JSON with nothing in front of it, creates a
tenant, then drives each row with wrk (Debian package wrk; bench/load.lua)
and prints requests/s, p50, p99, p99.9, unexpected statuses and the ratio
to the floor measured in the same run (the exit status is 1 when a row of
the gateway saw an unexpected status):

    floor     bare Klein handler, POST -> 501
    ceiling   the floor plus one Redis INCR: the best a proxy whose
              validations are all answered from memory can do -> 501
    prototype bench/prototype.py: the floor plus two bare gRPC calls to a
              trivial grpcio server and one Redis INCR, nothing else -> 501
    chat      full pipeline: valid token, active agent, rate limit on -> 501
    spread    the chat row with each request carrying the next of 1,024
              tokens, so that no two requests in flight share a token
              (without the validation cache every request pays its own two
              calls to svc-auth) -> 501
    probe     GET /v1/internal/auth-probe -> 200
    rejected  a well-formed token with a wrong secret -> 401
    chat-phase1, spread-phase1
              the chat and spread rows through proxies without the
              validation cache (SVC_AUTH_CACHE_SIZE=0), as in Phase 1
    upstream  wrk straight at the fast local upstream (Debian's nginx,
              answering a fixed OpenAI-shaped chat.completion) -> 200
    forward   the chat row forwarded to that upstream (a providers file
              names it) -> 200
    upstream-stream, stream
              the same with "stream": true: nginx answers a fixed event
              stream (7 events), the proxy relays it -> 200
    embed     POST /v1/embeddings (decisions D13) of one input, forwarded to
              that upstream, which answers a fixed embedding (one vector of
              64 float32 values in base64, as the openai SDK asks for them,
              with its usage) -> 200; its requests/s are compared with the
              forward row's in the same run
    memory-add
              POST /v1/memories (decisions D13) of one short content: the
              proxy embeds it with that upstream's fixed embedding (a
              ledger row of kind embedding) and stores it in svc-memory
              (started for this row, on the same PostgreSQL), each request
              in the next of 1,024 subjects so that the adds spread over
              as many scopes -> 201; its requests/s are compared with the
              embed row's in the same run
    forward-limits
              the forward row for a second tenant whose organization has
              limits rows of requests and tokens per minute and whose agent
              has one of requests per minute (decisions D11), all far above
              the load: every counter is checked and the tokens reserved
              and settled, in the same one Redis script call -> 200
    forward-budget
              the forward row for a third tenant whose organization has a
              monthly budget (decisions D12, far above the load) and a
              model with a price: each request's worst-case cost reserved
              in the same Redis script call, settled to its cost, and its
              ledger row priced -> 200
    forward-recall
              the forward row for a fourth tenant with recall on (decisions
              D13: context assembly): svc-memory runs beside (started only
              for this row, and then every proxy has memory configured),
              the agent's scope holds --recall-memories memories (1,000
              by default; each with a vector of its own, or all one with
              --recall-vectors tied), each request's message is another
              text (bench/load.lua, SVC_BENCH_VARY), nginx embeds it (one
              vector for each input, so shared requests are answered
              whole: njs, Debian's libnginx-mod-http-js), and the 5 best memories
              (ranked by --recall-mode: vector, text or hybrid; vector by
              default) go into the prompt forwarded to nginx -> 200;
              compared with the forward row's requests/s in the same run,
              and in the 1-connection pass with its p50; the recalls'
              outcomes are printed (every one should be ok)
    messages  POST /v1/messages (decisions D14: Anthropic's body, the token
              in x-api-key, anthropic-version sent as Anthropic's SDKs send
              it) to a model of an api = "anthropic" provider, nginx
              answering a fixed Anthropic message (of the forward row's
              answer's size), relayed as given -> 200
    chat-to-anthropic
              the forward row's chat completion to that Anthropic
              provider's model: the body translated to a Messages body,
              the answer back to a chat completion -> 200
    messages-to-openai
              the messages row's body to the forward row's model (an
              OpenAI-compatible provider): translated to a chat completion,
              nginx's chat completion back to an Anthropic message -> 200
    messages-stream, chat-to-anthropic-stream, messages-to-openai-stream
              the same three with "stream": true: nginx answers a fixed
              Anthropic event stream (8 events) or the stream row's, the
              proxy relays it as given or translates it event by event
              -> 200
              The three are compared with the forward row's requests/s
              and p50 at each connection count, the streamed three with
              the stream row's; and in the 1-connection pass, their p50
              with forward's (stream's)
    forward-deployments
              the forward row to a model of three deployments (decisions
              D15: weighted 1:1:2, three providers on three ports of
              nginx, each its own pool of connections) -> 200; compared
              with the forward row's requests/s
    forward-failing
              the forward row to a model of three deployments, one of
              which answers 503 to every request (nginx's /failing/v1):
              its tries are retried on the others, and it cools down for
              10 s after 3 failures, then fails 3 more -> 200; compared
              with the forward row's requests/s, and the tries of both
              rows are printed by deployment and outcome

With the forwarding rows, a 1-connection pass of upstream, forward,
upstream-stream and stream follows: the gateway's added latency (p50 of
the forwarded row minus p50 of the upstream alone) and, for the stream,
the added time to the first event (the stream arrives in one piece, so
the whole answer is its first event).

Every proxy row runs once per --workers count: that many svc-proxy
processes sharing one port with SVC_REUSE_PORT (each count its own port).
Then ValidateToken calls/s against svc-auth directly (bench/auth_validate),
and for each proxy row what the cycle collector did in svc-proxy meanwhile:
collections per second and the p99 of their pauses, by generation (from
svc_python_gc_pause_seconds).

The tenant's rate limit is raised far above the load, so the limiter runs
(one Redis round trip per request) without refusing anything.

--soak SECONDS instead drives the chat row (or --soak-row ROW; 32
connections, one worker) for that long and prints, each minute, the
resident memory and open file descriptors of both daemons; it fails when
either daemon's RSS moves more than 10% from its value after the first
minute, or its descriptors grow. With a forwarded row it then waits for
the proxy's usage rows to reach the ledger and fails unless the ledger
holds one for each answer wrk read.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import os
import random
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import attrs
import grpc
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import psycopg  # noqa: E402
from auth_validate import closedLoop  # noqa: E402

from svcd.auth.authority import issueToken  # noqa: E402
from svcd.auth.store import Store  # noqa: E402
from svcd.common.migrations import migrate  # noqa: E402
from svcd.common.pat import formatToken, newSecret, parseToken  # noqa: E402
from svcd.devkit.daemons import Daemon, authEnvironment, memoryEnvironment  # noqa: E402
from svcd.devkit.postgres import PostgresServer  # noqa: E402
from svcd.devkit.redis import RedisServer  # noqa: E402
from svcd.devkit.servers import freePort  # noqa: E402
from svcd.pb.auth.v1 import auth_pb2, auth_pb2_grpc  # noqa: E402
from svcd.pb.memory.v1 import memory_pb2, memory_pb2_grpc  # noqa: E402

LOAD_SCRIPT = Path(__file__).with_name("load.lua")
# Rows answered by the fast local upstream, without the gateway.
_UPSTREAM = ("upstream", "upstream-stream")
_FORWARDING = ("upstream", "forward", "upstream-stream", "stream")
# Forwarded rows compared with the forward row: under limits rows, or
# another route (decisions D13).
_EMBEDDED = ("embed",)
# Rows on svc-memory (decisions D13), compared with the embed row.
_MEMORY = ("memory-add",)
MEMORY_CONTENT = "the user likes green tea in the morning"
MEMORY_SUBJECTS = 1024
# Forwarded rows under limits rows, compared with the forward row.
_LIMITED = ("forward-limits", "forward-budget")
# Rows of Anthropic's dialect (decisions D14), on either side or both,
# compared with the forward row; their streamed variants with the stream
# row.
_DIALECTS = ("messages", "chat-to-anthropic", "messages-to-openai")
_DIALECT_STREAMS = tuple(row + "-stream" for row in _DIALECTS)
# All six, for bench/compare.py.
DIALECT_ROWS = (*_DIALECTS, *_DIALECT_STREAMS)
ANTHROPIC_MODEL = "bench-anthropic"
# Forwarded rows to models of three deployments (decisions D15), compared
# with the forward row: all three answering, and one failing every request.
DEPLOYMENT_ROWS = ("forward-deployments", "forward-failing")
DEPLOYED_MODEL = "bench-deployed"
FAILING_MODEL = "bench-failing"
# Ports of nginx besides the first: the other deployments' upstreams.
_DEPLOYMENT_PORTS = 2
# The forwarded row with recall (decisions D13), compared with the forward
# row; its scope's memories, and how many go into each prompt.
_RECALLED = ("forward-recall",)
RECALL_MEMORIES = 1000
RECALL_K = 5
PRICED_MODEL = "bench-priced"
# Limits rows of the forward-limits row's tenant: never reached.
_HIGH = 1_000_000_000
FORWARDED_MODEL = "bench-fast"
EMBEDDING_MODEL = "bench-embed"
# The embed row's input: a short sentence, as the chat rows' message is.
EMBEDDING_INPUT = "hello there"
ANSWER = json.dumps(
    {
        "id": "chatcmpl-bench",
        "object": "chat.completion",
        "created": 1795392965,
        "model": "bench-upstream",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Hello! How can I help you today?"},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 9, "completion_tokens": 9, "total_tokens": 18},
    },
    separators=(",", ":"),
)


# The messages rows' answer: what Anthropic's API answers for the forward
# row's text, its usage with the cache counts the API writes (a few bytes
# less than ANSWER).
ANTHROPIC_ANSWER = json.dumps(
    {
        "id": "msg_bench",
        "type": "message",
        "role": "assistant",
        "model": "bench-upstream",
        "content": [{"type": "text", "text": "Hello! How can I help you today?"}],
        "stop_reason": "end_turn",
        "stop_sequence": None,
        "usage": {
            "input_tokens": 9,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0,
            "output_tokens": 9,
        },
    },
    separators=(",", ":"),
)


def _anthropicStreamAnswer() -> str:
    """
    The streamed messages rows' answer: Anthropic's events for the stream
    row's text (three deltas), as its API sends them.
    """

    def event(document: dict[str, Any]) -> str:
        return f"event: {document['type']}\ndata: {json.dumps(document, separators=(',', ':'))}\n\n"

    usage = {
        "input_tokens": 9,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
        "output_tokens": 1,
    }
    message: dict[str, Any] = {
        "id": "msg_bench",
        "type": "message",
        "role": "assistant",
        "model": "bench-upstream",
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": usage,
    }
    return (
        event({"type": "message_start", "message": message})
        + event(
            {
                "type": "content_block_start",
                "index": 0,
                "content_block": {"type": "text", "text": ""},
            }
        )
        + "".join(
            event(
                {
                    "type": "content_block_delta",
                    "index": 0,
                    "delta": {"type": "text_delta", "text": word},
                }
            )
            for word in ("Hello! ", "How can ", "I help?")
        )
        + event({"type": "content_block_stop", "index": 0})
        + event(
            {
                "type": "message_delta",
                "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                "usage": {"output_tokens": 5},
            }
        )
        + event({"type": "message_stop"})
    )


def _embeddingVector() -> str:
    """
    The vector nginx's embeddings route answers for every input: 64
    float32 values (a unit vector's worth of varied ones), base64 as
    OpenAI writes it.
    """
    values = [((index * 37) % 64 - 31.5) / 256 for index in range(64)]
    return base64.b64encode(struct.pack("<64f", *values)).decode("ascii")


# nginx's embeddings route (njs, Debian's libnginx-mod-http-js): one vector
# for each input, as a provider answers, so that the embeddings a busy
# proxy's recalls share (decisions D13, issue 32) are answered whole; a
# fixed answer of one vector would fail every shared request, and a
# failing recall is cheaper than one that works (issue 44).
_EMBEDDINGS_JS = """
function embeddings(r) {
    var input = JSON.parse(r.requestText).input;
    var count = Array.isArray(input) ? input.length : 1;
    var data = [];
    for (var index = 0; index < count; index++) {
        data.push({object: "embedding", index: index, embedding: "%(vector)s"});
    }
    r.headersOut["Content-Type"] = "application/json";
    r.return(200, JSON.stringify({
        object: "list", data: data, model: "bench-upstream-embed",
        usage: {prompt_tokens: 2 * count, total_tokens: 2 * count}
    }));
}
export default {embeddings};
"""
_NJS_MODULE = Path("/usr/lib/nginx/modules/ngx_http_js_module.so")


def _streamAnswer() -> str:
    def chunk(delta: dict[str, str], finish: str | None = None, usage: Any = None) -> str:
        document = {
            "id": "chatcmpl-bench",
            "object": "chat.completion.chunk",
            "created": 1795392965,
            "model": "bench-upstream",
            "choices": [] if usage else [{"index": 0, "delta": delta, "finish_reason": finish}],
            "usage": usage,
        }
        return "data: " + json.dumps(document, separators=(",", ":")) + "\n\n"

    return (
        chunk({"role": "assistant", "content": ""})
        + "".join(chunk({"content": word}) for word in ("Hello! ", "How can ", "I help?"))
        + chunk({}, "stop")
        + chunk({}, usage={"prompt_tokens": 9, "completion_tokens": 5, "total_tokens": 14})
        + "data: [DONE]\n\n"
    )


def _nginxConfig(workdir: Path, port: int, morePorts: list[int]) -> str:
    """
    nginx answering POST .../chat/completions with a fixed answer: JSON
    under /v1, an event stream under /stream/v1; POST /v1/embeddings
    with a fixed embedding; and POST .../messages with a fixed Anthropic
    message (decisions D14): JSON under /anthropic/v1, events under
    /anthropic-stream/v1; 503 to every chat completion under /failing/v1
    (a deployment that fails, decisions D15). The same on C{morePorts}:
    the upstreams of the other deployments.
    """
    temp = workdir / "nginx-temp"
    temp.mkdir(exist_ok=True)
    user = "user root;\n" if os.geteuid() == 0 else ""
    if not _NJS_MODULE.exists():
        raise SystemExit(
            "nginx's js module is missing: apt-get install libnginx-mod-http-js"
            " (it answers the embeddings of the memory rows)"
        )
    script = workdir / "embeddings.js"
    script.write_text(_EMBEDDINGS_JS % {"vector": _embeddingVector()})

    def quoted(text: str) -> str:
        return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"

    listens = "".join(f"    listen 127.0.0.1:{each} backlog=511;\n" for each in morePorts)

    return f"""load_module {_NJS_MODULE};
{user}worker_processes 1;
daemon off;
pid {workdir}/nginx.pid;
error_log {workdir}/nginx.log warn;
events {{ worker_connections 4096; }}
http {{
  access_log off;
  client_body_temp_path {temp}/body;
  proxy_temp_path {temp}/proxy;
  fastcgi_temp_path {temp}/fastcgi;
  uwsgi_temp_path {temp}/uwsgi;
  scgi_temp_path {temp}/scgi;
  keepalive_requests 10000000;
  keepalive_timeout 75s;
  js_import embed from {script};
  server {{
    listen 127.0.0.1:{port} backlog=511;
{listens}
    location = /failing/v1/chat/completions {{
      default_type application/json;
      return 503 '{{"error":{{"message":"overloaded","type":"server_error"}}}}';
    }}
    location = /v1/chat/completions {{
      default_type application/json;
      return 200 {quoted(ANSWER)};
    }}
    location = /stream/v1/chat/completions {{
      default_type text/event-stream;
      return 200 {quoted(_streamAnswer())};
    }}
    location = /anthropic/v1/messages {{
      default_type application/json;
      return 200 {quoted(ANTHROPIC_ANSWER)};
    }}
    location = /anthropic-stream/v1/messages {{
      default_type text/event-stream;
      return 200 {quoted(_anthropicStreamAnswer())};
    }}
    location = /v1/embeddings {{
      client_body_buffer_size 1m;
      client_body_in_single_buffer on;
      js_content embed.embeddings;
    }}
  }}
}}
"""


def startNginx(
    stack: contextlib.ExitStack, workdir: Path, morePorts: list[int] | None = None
) -> tuple[int, subprocess.Popen[bytes]]:
    """
    The fast local upstream of the forwarding rows, on a free port (and on
    C{morePorts}).
    """
    nginx = shutil.which("nginx") or (
        "/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None
    )
    if nginx is None:
        raise SystemExit("nginx is missing: apt-get install nginx (or drop the forwarding rows)")
    port = freePort()
    config = workdir / "nginx.conf"
    config.write_text(_nginxConfig(workdir, port, morePorts or []))
    process = subprocess.Popen([nginx, "-c", str(config), "-p", str(workdir)])
    stack.callback(process.wait, 10)
    stack.callback(process.terminate)
    deadline = time.monotonic() + 10
    while True:
        try:
            with contextlib.closing(socket.create_connection(("127.0.0.1", port), 1)):
                return port, process
        except OSError:
            assert process.poll() is None, f"nginx exited:\n{(workdir / 'nginx.log').read_text()}"
            assert time.monotonic() < deadline, "nginx did not start"
            time.sleep(0.05)


def _providersFile(
    workdir: Path,
    nginxPort: int,
    morePorts: list[int],
    recallMode: str = "vector",
    withDialects: bool = True,
) -> Path:
    """
    The providers file: nginx's routes as models, the deployments' models
    over nginx's ports (C{nginxPort} and C{morePorts}), and the [memory]
    table of the memory rows (used only where SVC_MEMORY_GRPC_ADDR is set;
    every memory scores at least -1, so each recall of the forward-recall
    row injects the C{RECALL_K} best), recalling by C{recallMode}
    (--recall-mode). Without C{withDialects}, no Anthropic provider: a
    revision from before decisions D14 (compare.py) refuses the file's
    C{api} key.
    """
    deployed = "".join(
        f"""
[[providers]]
name = "nginx-port-{number}"
base_url = "http://127.0.0.1:{port}/v1"
max_connections = 256
"""
        for number, port in enumerate(morePorts, start=2)
    )
    anthropic = f"""
[[providers]]
name = "nginx-anthropic"
api = "anthropic"
base_url = "http://127.0.0.1:{nginxPort}/anthropic/v1"
max_connections = 256

[[providers]]
name = "nginx-anthropic-stream"
api = "anthropic"
base_url = "http://127.0.0.1:{nginxPort}/anthropic-stream/v1"
max_connections = 256

[[models]]
name = "{ANTHROPIC_MODEL}"
provider = "nginx-anthropic"

[[models]]
name = "{ANTHROPIC_MODEL}-stream"
provider = "nginx-anthropic-stream"
"""
    path = workdir / "providers.toml"
    path.write_text(
        f"""
[[providers]]
name = "nginx"
base_url = "http://127.0.0.1:{nginxPort}/v1"
max_connections = 256

[[providers]]
name = "nginx-stream"
base_url = "http://127.0.0.1:{nginxPort}/stream/v1"
max_connections = 256
{anthropic if withDialects else ""}
[[models]]
name = "{FORWARDED_MODEL}"
provider = "nginx"

[[models]]
name = "{FORWARDED_MODEL}-stream"
provider = "nginx-stream"

[[models]]
name = "{EMBEDDING_MODEL}"
provider = "nginx"
kind = "embedding"

[[models]]
name = "{PRICED_MODEL}"
provider = "nginx"
price = {{ input = "2.50", output = "10.00", cached_input = "1.25" }}

[[providers]]
name = "nginx-failing"
base_url = "http://127.0.0.1:{nginxPort}/failing/v1"
max_connections = 256
{deployed}
# Three deployments: nginx's three ports, weighted 1:1:2.
[[models]]
name = "{DEPLOYED_MODEL}"
deployments = [
    {{ provider = "nginx" }},
    {{ provider = "nginx-port-2" }},
    {{ provider = "nginx-port-3", weight = 2 }},
]

# Three deployments, the second failing every request.
[[models]]
name = "{FAILING_MODEL}"
deployments = [
    {{ provider = "nginx" }},
    {{ provider = "nginx-failing" }},
    {{ provider = "nginx-port-2" }},
]

# Used only where SVC_MEMORY_GRPC_ADDR is set (the memory rows).
[memory]
embedding_model = "{EMBEDDING_MODEL}"
recall_k = {RECALL_K}
min_score = -1
recall_mode = "{recallMode}"
"""
    )
    return path


def remember(
    address: str, orgID: str, agentID: str, memories: int = RECALL_MEMORIES, tied: bool = False
) -> None:
    """
    Store the forward-recall row's memories in its agent's scope: short
    sentences, each with a vector of its own (64 float32 values, as nginx's
    embedding), under the [memory] model's name; with C{tied}, one vector
    for all of them (the tie path of issue 44: every memory scores the
    same). Added by eight calls at a time, so that 10,000 take seconds.
    bench/search_cost.py fills its scope with it too.
    """
    generator = random.Random(13)
    shared = [generator.gauss(0, 1) for _ in range(64)]
    vectors = []
    for _ in range(memories):
        values = shared if tied else [generator.gauss(0, 1) for _ in range(64)]
        norm = sum(value * value for value in values) ** 0.5
        vectors.append(struct.pack("<64f", *(value / norm for value in values)))
    with grpc.insecure_channel(address) as channel:
        stub = memory_pb2_grpc.MemoryServiceStub(channel)

        def add(index: int) -> None:
            stub.AddMemory(
                memory_pb2.AddMemoryRequest(
                    scope=memory_pb2.Scope(org_id=orgID, agent_id=agentID),
                    content=f"memory {index}: the user mentioned a preference worth keeping",
                    source="api",
                    embedding=memory_pb2.Embedding(model=EMBEDDING_MODEL, vector=vectors[index]),
                ),
                timeout=30,
            )

        with ThreadPoolExecutor(8) as pool:
            list(pool.map(add, range(memories)))


# Rows served by one process of their own, whatever --workers says.
_SINGLE = ("floor", "ceiling", "prototype", "upstream", "upstream-stream")
# Rows through proxies without the validation cache end so.
_PHASE1 = "-phase1"
_PHASE1_ENVIRONMENT = {"SVC_AUTH_CACHE_SIZE": "0"}


def _variant(row: str) -> tuple[str, bool]:
    """
    The row's base name and whether its proxies have no validation cache.
    """
    if row.endswith(_PHASE1):
        return row[: -len(_PHASE1)], True
    return row, False


# Tokens of the spread row: more than requests in flight at 256 connections.
SPREAD = 1024


def wrkCommand(url: str, connections: int, duration: float) -> list[str]:
    wrk = shutil.which("wrk")
    if wrk is None:
        raise SystemExit("wrk is missing: apt-get install wrk")
    return [
        wrk,
        f"-t{min(2, connections)}",
        f"-c{connections}",
        f"-d{max(1, round(duration))}s",
        "--timeout",
        "5s",
        "-s",
        str(LOAD_SCRIPT),
        url,
    ]


def startWrk(
    url: str, connections: int, duration: float, environment: dict[str, str]
) -> subprocess.Popen[str]:
    return subprocess.Popen(
        wrkCommand(url, connections, duration),
        env={**os.environ, **environment},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finishWrk(load: subprocess.Popen[str]) -> dict[str, Any]:
    """
    Wait for wrk and return what bench/load.lua printed.
    """
    stdout, stderr = load.communicate()
    if load.returncode:
        raise RuntimeError(f"wrk failed ({load.returncode}):\n{stdout}\n{stderr}")
    for line in stdout.splitlines():
        if line.startswith("RESULT "):
            parsed: dict[str, Any] = json.loads(line[len("RESULT ") :])
            return parsed
    raise RuntimeError(f"no RESULT line from wrk:\n{stdout}\n{stderr}")


def runWrk(
    url: str, connections: int, duration: float, environment: dict[str, str]
) -> dict[str, Any]:
    return finishWrk(startWrk(url, connections, duration, environment))


def summarize(
    name: str, connections: int, expected: int, raw: dict[str, Any], workers: int = 1
) -> dict[str, Any]:
    seconds = raw["duration_us"] / 1e6
    statuses = {int(status): count for status, count in raw["statuses"].items()}
    unexpected = sum(count for status, count in statuses.items() if status != expected)
    return {
        "row": name,
        "workers": workers,
        "connections": connections,
        "rps": raw["requests"] / seconds,
        "p50_ms": raw["p50_us"] / 1000,
        "p99_ms": raw["p99_us"] / 1000,
        "p999_ms": raw["p999_us"] / 1000,
        "errors": unexpected + raw["socket_errors"],
        "statuses": statuses,
    }


@contextlib.contextmanager
def runningStack(
    workdir: Path,
    logLevel: str,
    workerCounts: list[int],
    authExtra: dict[str, str] | None = None,
    proxyExtra: dict[str, str] | None = None,
    withPrototype: bool = False,
    withCeiling: bool = False,
    withPhase1: bool = False,
    withForwarding: bool = False,
    withMemory: bool = False,
    recallMode: str = "vector",
    recallMemories: int = RECALL_MEMORIES,
    recallTied: bool = False,
    withDialects: bool = True,
) -> Iterator[Stack]:
    """
    PostgreSQL, Redis, svc-auth, one group of svc-proxy processes per
    worker count (a group shares one port; with C{withPhase1} a second
    group per count without the validation cache), the floor, and a tenant.
    """
    with contextlib.ExitStack() as stack:
        postgres = PostgresServer.create(workdir / "postgres")
        postgres.start()
        stack.callback(postgres.destroy)
        dsn = postgres.createDatabase("bench")
        migrate(dsn)
        with psycopg.connect(dsn, autocommit=True) as connection:
            store = Store(lambda: contextlib.nullcontext(connection))
            orgID = store.createOrganization("bench")
            agent = store.createAgent(orgID, "bench-agent")
            # ProxyChatCompletion and ProxyEmbeddings (the embed row),
            # MemoryRead and MemoryWrite (the memory rows).
            token, _ = issueToken(store, orgID=orgID, permissions=1 + 32 + 64 + 128)
            spread = [issueToken(store, orgID=orgID, permissions=1)[0] for _ in range(SPREAD)]
            limitedOrgID = store.createOrganization("bench-limited")
            limitedAgent = store.createAgent(limitedOrgID, "bench-limited-agent")
            limitedToken, _ = issueToken(store, orgID=limitedOrgID, permissions=1)
            store.setLimits(limitedOrgID, None, {"rpm": _HIGH, "tpm": _HIGH})
            store.setLimits(limitedOrgID, limitedAgent.agentID, {"rpm": _HIGH})
            budgetedOrgID = store.createOrganization("bench-budgeted")
            budgetedAgent = store.createAgent(budgetedOrgID, "bench-budgeted-agent")
            budgetedToken, _ = issueToken(store, orgID=budgetedOrgID, permissions=1)
            # A million dollars a month: never reached.
            store.setBudget(budgetedOrgID, None, 10**15, "month")
            recallOrgID = store.createOrganization("bench-recall")
            recallAgent = store.createAgent(recallOrgID, "bench-recall-agent")
            recallToken, _ = issueToken(store, orgID=recallOrgID, permissions=1)
            store.setMemorySettings(recallOrgID, None, {"recall": True})
        parsed = parseToken(token)
        spreadFile = workdir / "tokens.txt"
        spreadFile.write_text("".join(each + "\n" for each in spread))
        assert parsed is not None

        redis = RedisServer.create(workdir / "redis")
        redis.start()
        stack.callback(redis.destroy)

        nginx: subprocess.Popen[bytes] | None = None
        nginxPort = 0
        forwardingEnvironment: dict[str, str] = {}
        if withForwarding:
            morePorts = [freePort() for _ in range(_DEPLOYMENT_PORTS)]
            nginxPort, nginx = startNginx(stack, workdir, morePorts)
            forwardingEnvironment["SVC_PROVIDERS_FILE"] = str(
                _providersFile(workdir, nginxPort, morePorts, recallMode, withDialects)
            )

        auth = Daemon(
            "svc-auth",
            authEnvironment(dsn, SVC_LOG_LEVEL=logLevel, **(authExtra or {})),
            workdir / "auth.log",
        ).start()
        stack.callback(auth.terminate)
        auth.waitForReady()
        _validateAll(auth, [*spread, limitedToken, budgetedToken, recallToken])
        memory: Daemon | None = None
        if withMemory:
            # No cap in the way: the adds of a run stay far below it.
            memory = Daemon(
                "svc-memory",
                memoryEnvironment(dsn, SVC_LOG_LEVEL=logLevel, SVC_MEMORY_MAX_PER_SCOPE="1000000"),
                workdir / "memory.log",
            ).start()
            stack.callback(memory.terminate)
            memory.waitForReady()
            memoryAddress = f"127.0.0.1:{memory.environment['SVC_GRPC_PORT']}"
            # The forward-recall row's scope.
            remember(
                memoryAddress,
                str(recallOrgID),
                str(recallAgent.agentID),
                recallMemories,
                recallTied,
            )
            forwardingEnvironment["SVC_MEMORY_GRPC_ADDR"] = memoryAddress

        groups: dict[tuple[int, bool], list[Daemon]] = {}
        for workers, phase1 in (
            (count, phase1) for count in workerCounts for phase1 in (False, True)[: 1 + withPhase1]
        ):
            port = str(freePort())
            group = groups[workers, phase1] = []
            for worker in range(workers):
                proxy = Daemon(
                    "svc-proxy",
                    {
                        "SVC_HOST": "127.0.0.1",
                        "SVC_PORT": port,
                        "SVC_REUSE_PORT": "true" if workers > 1 else "false",
                        "SVC_AUTH_GRPC_ADDR": f"127.0.0.1:{auth.environment['SVC_GRPC_PORT']}",
                        "REDIS_URL": redis.url,
                        "SVC_RATE_LIMIT_ORG_OVERRIDES": (
                            f"{orgID}=1000000000,{budgetedOrgID}=1000000000,"
                            f"{recallOrgID}=1000000000"
                        ),
                        "SVC_LOG_LEVEL": logLevel,
                        **forwardingEnvironment,
                        **(proxyExtra or {}),
                        **(_PHASE1_ENVIRONMENT if phase1 else {}),
                    },
                    workdir / f"proxy-{workers}-{'phase1-' if phase1 else ''}{worker}.log",
                ).start()
                stack.callback(proxy.terminate)
                group.append(proxy)
            for proxy in group:
                proxy.waitForReady()
                if not phase1:
                    _waitForFeed(proxy)

        floorPort = freePort()
        floor = _startScript(stack, ["floor.py", str(floorPort)], floorPort)
        prototype: dict[str, subprocess.Popen[bytes]] = {}
        prototypePort = freePort()
        if withPrototype:
            prototypeAuthPort = freePort()
            prototype["prototype-auth"] = _startScript(
                stack, ["prototype.py", "auth", str(prototypeAuthPort)], prototypeAuthPort
            )
            prototype["prototype-proxy"] = _startScript(
                stack,
                [
                    "prototype.py",
                    "proxy",
                    str(prototypePort),
                    str(prototypeAuthPort),
                    str(redis.port),
                ],
                prototypePort,
            )

        ceiling: subprocess.Popen[bytes] | None = None
        ceilingPort = freePort()
        if withCeiling:
            ceiling = _startScript(
                stack, ["prototype.py", "ceiling", str(ceilingPort), str(redis.port)], ceilingPort
            )

        yield Stack(
            auth=auth,
            memory=memory,
            nginx=nginx,
            nginxURL=f"http://127.0.0.1:{nginxPort}",
            ceiling=ceiling,
            ceilingURL=f"http://127.0.0.1:{ceilingPort}",
            proxies=groups,
            floorURL=f"http://127.0.0.1:{floorPort}",
            floor=floor,
            prototype=prototype,
            prototypeURL=f"http://127.0.0.1:{prototypePort}",
            token=token,
            spreadFile=spreadFile,
            wrongSecret=formatToken(parsed.tokenID, newSecret()),
            agentID=str(agent.agentID),
            limitedToken=limitedToken,
            limitedAgentID=str(limitedAgent.agentID),
            budgetedToken=budgetedToken,
            budgetedAgentID=str(budgetedAgent.agentID),
            recallToken=recallToken,
            recallAgentID=str(recallAgent.agentID),
            dsn=dsn,
        )


@attrs.frozen
class Stack:
    auth: Daemon
    memory: Daemon | None
    nginx: subprocess.Popen[bytes] | None
    nginxURL: str
    ceiling: subprocess.Popen[bytes] | None
    ceilingURL: str
    proxies: dict[tuple[int, bool], list[Daemon]]
    floorURL: str
    floor: subprocess.Popen[bytes]
    prototype: dict[str, subprocess.Popen[bytes]]
    prototypeURL: str
    token: str
    spreadFile: Path
    wrongSecret: str
    agentID: str
    limitedToken: str
    limitedAgentID: str
    budgetedToken: str
    budgetedAgentID: str
    recallToken: str
    recallAgentID: str
    dsn: str

    def pids(self, row: str, workers: int) -> dict[str, int]:
        """
        The processes that serve C{row}, by name, for their CPU time.
        """
        if row == "floor":
            return {"floor": self.floor.pid}
        if row == "ceiling":
            assert self.ceiling is not None
            return {"ceiling": self.ceiling.pid}
        if row in _UPSTREAM:
            assert self.nginx is not None
            return {"nginx": self.nginx.pid}
        if row == "prototype":
            return {name: process.pid for name, process in self.prototype.items()}
        pids = {"svc-auth": _pid(self.auth)}
        if row in (*_MEMORY, *_RECALLED) and self.memory is not None:
            pids["svc-memory"] = _pid(self.memory)
        for index, proxy in enumerate(self.proxies[workers, _variant(row)[1]]):
            pids[f"proxy{index + 1}"] = _pid(proxy)
        return pids

    def proxiesOf(self, row: str, workers: int) -> list[Daemon]:
        """
        The svc-proxy processes that serve C{row} (none for the others).
        """
        if row in _SINGLE:
            return []
        return self.proxies[workers, _variant(row)[1]]

    def proxyURL(self, workers: int, phase1: bool = False) -> str:
        return f"http://127.0.0.1:{self.proxies[workers, phase1][0].httpPort}"

    def shape(self, row: str, workers: int) -> tuple[str, dict[str, str], int]:
        """
        The URL, the wrk script's environment and the expected status of
        C{row}.
        """
        if row == "floor":
            return f"{self.floorURL}/v1/chat/completions", _wrkEnvironment("POST", "", ""), 501
        if row == "ceiling":
            return f"{self.ceilingURL}/v1/chat/completions", _wrkEnvironment("POST", "", ""), 501
        if row == "upstream":
            return f"{self.nginxURL}/v1/chat/completions", _wrkEnvironment("POST", "", ""), 200
        if row == "upstream-stream":
            environment = _wrkEnvironment("POST", "", "")
            environment["SVC_BENCH_STREAM"] = "true"
            return f"{self.nginxURL}/stream/v1/chat/completions", environment, 200
        if row == "prototype":
            return f"{self.prototypeURL}/v1/chat/completions", _wrkEnvironment("POST", "", ""), 501
        row, phase1 = _variant(row)
        base = self.proxyURL(workers, phase1)
        if row == "chat":
            environment = _wrkEnvironment("POST", self.token, self.agentID)
            return f"{base}/v1/chat/completions", environment, 501
        if row == "spread":
            environment = _wrkEnvironment("POST", self.token, self.agentID)
            environment["SVC_BENCH_TOKENS_FILE"] = str(self.spreadFile)
            return f"{base}/v1/chat/completions", environment, 501
        if row == "forward":
            environment = _wrkEnvironment("POST", self.token, self.agentID)
            environment["SVC_BENCH_MODEL"] = FORWARDED_MODEL
            return f"{base}/v1/chat/completions", environment, 200
        if row == "embed":
            environment = _wrkEnvironment("POST", self.token, self.agentID)
            environment["SVC_BENCH_MODEL"] = EMBEDDING_MODEL
            environment["SVC_BENCH_INPUT"] = EMBEDDING_INPUT
            return f"{base}/v1/embeddings", environment, 200
        if row == "memory-add":
            environment = _wrkEnvironment("POST", self.token, self.agentID)
            environment["SVC_BENCH_CONTENT"] = MEMORY_CONTENT
            environment["SVC_BENCH_SUBJECTS"] = str(MEMORY_SUBJECTS)
            return f"{base}/v1/memories", environment, 201
        if row in DEPLOYMENT_ROWS:
            environment = _wrkEnvironment("POST", self.token, self.agentID)
            environment["SVC_BENCH_MODEL"] = (
                DEPLOYED_MODEL if row == "forward-deployments" else FAILING_MODEL
            )
            return f"{base}/v1/chat/completions", environment, 200
        if row == "forward-limits":
            environment = _wrkEnvironment("POST", self.limitedToken, self.limitedAgentID)
            environment["SVC_BENCH_MODEL"] = FORWARDED_MODEL
            return f"{base}/v1/chat/completions", environment, 200
        if row == "forward-budget":
            environment = _wrkEnvironment("POST", self.budgetedToken, self.budgetedAgentID)
            environment["SVC_BENCH_MODEL"] = PRICED_MODEL
            return f"{base}/v1/chat/completions", environment, 200
        if row == "forward-recall":
            environment = _wrkEnvironment("POST", self.recallToken, self.recallAgentID)
            environment["SVC_BENCH_MODEL"] = FORWARDED_MODEL
            environment["SVC_BENCH_VARY"] = "true"
            return f"{base}/v1/chat/completions", environment, 200
        if row == "stream":
            environment = _wrkEnvironment("POST", self.token, self.agentID)
            environment["SVC_BENCH_MODEL"] = FORWARDED_MODEL + "-stream"
            environment["SVC_BENCH_STREAM"] = "true"
            return f"{base}/v1/chat/completions", environment, 200
        if row in (*_DIALECTS, *_DIALECT_STREAMS):
            return self._dialectShape(base, row)
        if row == "probe":
            environment = _wrkEnvironment("GET", self.token, self.agentID)
            return f"{base}/v1/internal/auth-probe", environment, 200
        if row == "rejected":
            environment = _wrkEnvironment("POST", self.wrongSecret, self.agentID)
            return f"{base}/v1/chat/completions", environment, 401
        raise SystemExit(
            f"unknown row {row!r}: use floor, ceiling, prototype, chat, spread, probe,"
            " rejected, chat-phase1, spread-phase1, upstream, forward, upstream-stream,"
            " stream, forward-limits, forward-budget, forward-recall, embed, memory-add,"
            " forward-deployments, forward-failing,"
            " messages, chat-to-anthropic, messages-to-openai or each of those three"
            " with -stream"
        )

    def _dialectShape(self, base: str, row: str) -> tuple[str, dict[str, str], int]:
        """
        The rows of Anthropic's dialect (decisions D14): a Messages body
        (its token in x-api-key, as Anthropic's SDKs send it) or a chat
        completion, to a model of the Anthropic provider or of the
        forward row's, whole or streamed.
        """
        streamed = row.endswith("-stream")
        row = row.removesuffix("-stream")
        environment = _wrkEnvironment("POST", self.token, self.agentID)
        model = FORWARDED_MODEL if row == "messages-to-openai" else ANTHROPIC_MODEL
        environment["SVC_BENCH_MODEL"] = model + ("-stream" if streamed else "")
        environment["SVC_BENCH_STREAM"] = "true" if streamed else "false"
        if row == "chat-to-anthropic":
            return f"{base}/v1/chat/completions", environment, 200
        environment["SVC_BENCH_SHAPE"] = "messages"
        environment["SVC_BENCH_KEY_HEADER"] = "x-api-key"
        return f"{base}/v1/messages", environment, 200


def _measure(
    stack: Stack, row: str, connections: int, workers: int, duration: float, warmup: float
) -> dict[str, Any]:
    """
    One row: wrk after a warm-up, with each serving process's CPU time per
    request.
    """
    url, environment, expected = stack.shape(row, workers)
    if warmup:
        runWrk(url, connections, warmup, environment)
    measured = stack.pids(row, workers)
    proxies = stack.proxiesOf(row, workers)
    pausesBefore = gcPauses(proxies)
    before = [cpuSeconds(pid) for pid in measured.values()]
    raw = runWrk(url, connections, duration, environment)
    after = [cpuSeconds(pid) for pid in measured.values()]
    result = summarize(row, connections, expected, raw, workers)
    if proxies:
        result["gc"] = gcDuring(pausesBefore, gcPauses(proxies), raw["duration_us"] / 1e6)
    result["cpu_us_per_request"] = {
        name: (end - start) / max(1, raw["requests"]) * 1e6
        for name, start, end in zip(measured, before, after, strict=True)
    }
    return result


def _startScript(
    stack: contextlib.ExitStack, arguments: list[str], port: int
) -> subprocess.Popen[bytes]:
    """
    Run one of bench/'s servers and wait until it accepts connections.
    """
    process = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name(arguments[0])), *arguments[1:]]
    )
    stack.callback(process.terminate)
    deadline = time.monotonic() + 10
    while True:
        try:
            with contextlib.closing(socket.create_connection(("127.0.0.1", port), 1)):
                return process
        except OSError:
            assert process.poll() is None, f"{arguments[0]} exited"
            assert time.monotonic() < deadline, f"{arguments[0]} did not start"
            time.sleep(0.05)


def _pid(daemon: Daemon) -> int:
    assert daemon.process is not None
    return daemon.process.pid


def _recalls(stack: Stack, workerCounts: list[int]) -> dict[str, float]:
    """
    svc_proxy_memory_recalls_total by outcome, summed over every proxy.
    """
    counts: dict[str, float] = {}
    for workers in workerCounts:
        for proxy in stack.proxies[workers, False]:
            for family in text_string_to_metric_families(proxy.get("/metrics")[1].decode()):
                for sample in family.samples:
                    if sample.name == "svc_proxy_memory_recalls_total":
                        outcome = sample.labels["outcome"]
                        counts[outcome] = counts.get(outcome, 0.0) + sample.value
    return counts


def _deploymentTries(stack: Stack, workerCounts: list[int]) -> dict[tuple[str, ...], float]:
    """
    svc_proxy_deployment_requests_total (by model, deployment and outcome)
    and svc_proxy_deployment_cooldowns_total (by model, deployment and
    reason) of the deployment rows' models, summed over every proxy.
    """
    counts: dict[tuple[str, ...], float] = {}
    for workers in workerCounts:
        for proxy in stack.proxies[workers, False]:
            for family in text_string_to_metric_families(proxy.get("/metrics")[1].decode()):
                for sample in family.samples:
                    labels = sample.labels
                    if labels.get("model") not in (DEPLOYED_MODEL, FAILING_MODEL):
                        continue
                    if sample.name == "svc_proxy_deployment_requests_total":
                        kind = "tries " + labels["outcome"]
                    elif sample.name == "svc_proxy_deployment_cooldowns_total":
                        kind = "cooldowns " + labels["reason"]
                    else:
                        continue
                    key = (labels["model"], labels["deployment"], kind)
                    counts[key] = counts.get(key, 0.0) + sample.value
    return counts


def _recallsSince(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {outcome: count - before.get(outcome, 0.0) for outcome, count in after.items()}


def _wrkEnvironment(method: str, bearer: str, agentID: str) -> dict[str, str]:
    return {"SVC_BENCH_METHOD": method, "SVC_BENCH_TOKEN": bearer, "SVC_BENCH_AGENT": agentID}


def _waitForFeed(proxy: Daemon, timeout: float = 30.0) -> None:
    """
    Wait until the proxy's validation cache is live (svc-auth's change feed
    has arrived), so that its rows measure the cache from the start.
    """
    deadline = time.monotonic() + timeout
    while "svc_proxy_auth_feed_up 1.0" not in proxy.get("/metrics")[1].decode():
        if time.monotonic() > deadline:
            raise RuntimeError(f"the change feed did not come up:\n{proxy.output()[-2000:]}")
        time.sleep(0.05)


def _validateAll(auth: Daemon, tokens: list[str]) -> None:
    """
    Have svc-auth verify each token once, so that the spread row measures
    its warm cache, as the chat row does, not 1,024 first argon2 checks.
    """
    port = auth.environment["SVC_GRPC_PORT"]
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = auth_pb2_grpc.AuthServiceStub(channel)
        for token in tokens:
            stub.ValidateToken(auth_pb2.ValidateTokenRequest(access_token=token), timeout=5)


def validateTokenDirect(stack: Stack, duration: float, concurrency: int) -> tuple[float, int]:
    """
    Cached ValidateToken calls per second against svc-auth, from this
    process over one channel, C{concurrency} calls in flight, and how many
    failed. Half svc-auth's per-connection bound (SVC_GRPC_MAX_CALLS_PER_PEER,
    32) at most: a client that sends its next call the moment an answer
    arrives can find the bound still held by the call just answered, and
    is refused (decisions D10), which measures the bound, not the service.
    """
    port = stack.auth.environment["SVC_GRPC_PORT"]
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = auth_pb2_grpc.AuthServiceStub(channel)
        request = auth_pb2.ValidateTokenRequest(access_token=stack.token)
        stub.ValidateToken(request, timeout=5)
        closedLoop(stub, stack.token, concurrency, 1.0)
        ok, errors, _ = closedLoop(stub, stack.token, concurrency, duration)
    return ok / duration, errors


GENERATIONS = ("0", "1", "2")


def gcPauses(daemons: list[Daemon]) -> dict[str, list[tuple[float, float]]]:
    """
    The cycle collector's pause histogram of C{daemons} added up, by
    generation: cumulative counts by upper bound (svc_python_gc_pause_seconds).
    """
    pauses: dict[str, dict[float, float]] = {generation: {} for generation in GENERATIONS}
    for daemon in daemons:
        for family in text_string_to_metric_families(daemon.get("/metrics")[1].decode()):
            if family.name != "svc_python_gc_pause_seconds":
                continue
            for sample in family.samples:
                if sample.name.endswith("_bucket"):
                    bound = float(sample.labels["le"])
                    counts = pauses[sample.labels["generation"]]
                    counts[bound] = counts.get(bound, 0.0) + sample.value
    return {generation: sorted(counts.items()) for generation, counts in pauses.items()}


def pauseQuantile(buckets: list[tuple[float, float]], quantile: float) -> float | None:
    """
    The quantile of a cumulative histogram, interpolated within its bucket
    as Prometheus's histogram_quantile does; None when it is empty.
    """
    total = buckets[-1][1] if buckets else 0.0
    if not total:
        return None
    rank = quantile * total
    lower, below = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if bound == float("inf"):
                return lower
            return lower + (bound - lower) * (rank - below) / max(count - below, 1e-9)
        lower, below = bound, count
    return lower


def gcDuring(
    before: dict[str, list[tuple[float, float]]],
    after: dict[str, list[tuple[float, float]]],
    seconds: float,
) -> dict[str, dict[str, Any]]:
    """
    What the collector did between two L{gcPauses}, by generation:
    collections, collections per second, p50, p99 and the bound of the
    longest pause's bucket (ms), and the histogram itself.
    """
    summary: dict[str, dict[str, Any]] = {}
    for generation in GENERATIONS:
        earlier = dict(before.get(generation, []))
        buckets = [
            (bound, count - earlier.get(bound, 0.0)) for bound, count in after.get(generation, [])
        ]
        total = buckets[-1][1] if buckets else 0.0
        longest = None
        below = 0.0
        for bound, count in buckets:
            if count > below:
                longest = bound
            below = count
        p50, p99 = pauseQuantile(buckets, 0.5), pauseQuantile(buckets, 0.99)
        summary[generation] = {
            "collections": total,
            "per_second": total / seconds,
            "p50_ms": None if p50 is None else p50 * 1000,
            "p99_ms": None if p99 is None else p99 * 1000,
            "longest_bucket_ms": None if longest is None else longest * 1000,
            "buckets": buckets,
        }
    return summary


def gcCells(summary: dict[str, dict[str, Any]]) -> str:
    """
    One line of L{gcDuring}: per generation, collections per second and
    the p99 of their pauses (and the longest pause's bucket).
    """
    cells = []
    for generation, each in summary.items():
        if not each["collections"]:
            cells.append(f"gen{generation} -")
            continue
        longest = each["longest_bucket_ms"]
        longestText = "+Inf" if longest == float("inf") else f"{longest:g}"
        cells.append(
            f"gen{generation} {each['per_second']:.2f}/s p99 {each['p99_ms']:.2f} ms"
            f" (≤{longestText})"
        )
    return "  ".join(cells)


def cpuSeconds(pid: int) -> float:
    """
    User plus system CPU time of process C{pid} (all its threads) so far.
    """
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def reactorCPUSeconds(pid: int) -> float:
    """
    User plus system CPU time of process C{pid}'s main thread so far: a
    Twisted daemon's reactor thread, the one that bounds what one process
    can serve (its other threads, grpcio's, run beside it).
    """
    fields = Path(f"/proc/{pid}/task/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def processUsage(pid: int) -> tuple[float, int]:
    """
    Resident memory in MiB and open file descriptors of process C{pid}.
    """
    rss = 0.0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1]) / 1024
    return rss, len(os.listdir(f"/proc/{pid}/fd"))


def soak(stack: Stack, seconds: int, row: str = "chat") -> int:
    """
    C{row} at 32 connections for C{seconds}, sampling both daemons' memory
    and descriptors each minute; 1 when the memory moved more than 10% from
    the first minute's value or the descriptors grew. A forwarded row also
    counts the ledger's rows once the proxy has sent them all (decisions
    D12): 1 unless there is one for each answer wrk read (and at most one
    more for each connection, whose answer was written as wrk stopped).
    """
    daemons = {"svc-auth": stack.auth, "svc-proxy": stack.proxies[1, False][0]}
    url, environment, expected = stack.shape(row, 1)
    load = startWrk(url, 32, seconds, environment)
    started = time.monotonic()
    samples: dict[str, list[tuple[float, int]]] = {name: [] for name in daemons}
    print(f"{'minute':>6} " + " ".join(f"{name + ' MiB':>14} {'fds':>4}" for name in daemons))
    minute = 0
    while minute < seconds // 60:
        minute += 1
        time.sleep(max(0.0, started + minute * 60 - time.monotonic()))
        cells = []
        for name, daemon in daemons.items():
            assert daemon.process is not None
            rss, fds = processUsage(daemon.process.pid)
            samples[name].append((rss, fds))
            cells.append(f"{rss:>14.1f} {fds:>4}")
        print(f"{minute:>6} " + " ".join(cells), flush=True)
    result = finishWrk(load)
    summary = summarize(row, 32, expected, result)
    print(
        f"{row} under soak: {summary['rps']:.0f} req/s, p99 {summary['p99_ms']:.2f} ms,"
        f" {summary['errors']} unexpected; statuses {summary['statuses']}"
    )
    failed = bool(summary["errors"])
    if expected == 200:
        failed = not _ledgerHoldsEveryAnswer(stack, summary["statuses"].get(200, 0)) or failed
    for name, taken in samples.items():
        if len(taken) < 2:
            continue
        baseRSS, baseFDs = taken[0]
        drift = max(abs(rss - baseRSS) / baseRSS for rss, _ in taken[1:])
        grew = max(fds for _, fds in taken[1:]) > baseFDs
        verdict = "ok" if drift <= 0.10 and not grew else "FAILED"
        failed = failed or verdict != "ok"
        print(
            f"{name}: RSS after minute 1 {baseRSS:.1f} MiB, largest drift {drift:.1%};"
            f" fds {baseFDs} -> {taken[-1][1]} (max {max(f for _, f in taken)}): {verdict}"
        )
    return 1 if failed else 0


def _ledgerHoldsEveryAnswer(stack: Stack, answered: int, connections: int = 32) -> bool:
    """
    Wait (at most a minute) until the proxy has no usage row waiting, then
    compare the ledger with the answers wrk read.
    """
    proxy = stack.proxies[1, False][0]
    deadline = time.monotonic() + 60
    while "svc_proxy_usage_outbox_rows 0.0" not in proxy.get("/metrics")[1].decode():
        if time.monotonic() > deadline:
            print("the proxy still had usage rows waiting after a minute: FAILED")
            return False
        time.sleep(0.2)
    with psycopg.connect(stack.dsn, autocommit=True) as connection:
        outcomes: dict[str, int] = dict(
            connection.execute(
                "SELECT outcome, count(*) FROM usage_ledger GROUP BY outcome"
            ).fetchall()
        )
    ok = outcomes.get("ok", 0)
    verdict = "ok" if answered <= ok <= answered + connections else "FAILED"
    print(
        f"ledger: {sum(outcomes.values())} rows {outcomes}; wrk read {answered} answers"
        f" (200): {verdict}"
    )
    return verdict == "ok"


def _compareDialects(results: list[dict[str, Any]], latency: dict[str, dict[str, Any]]) -> None:
    """
    Decisions D14's rows against the row they are measured by, in the same
    run: the whole three against forward's, the streamed three against
    stream's (its mean, for a row named several times in --rows), their
    requests/s and p50 at each connection count; then their p50 in the
    1-connection pass against that row's in the same pass.
    """
    runs: dict[tuple[str, int, int], list[dict[str, Any]]] = {}
    for each in results:
        if each["row"] in ("forward", "stream"):
            runs.setdefault((each["row"], each["connections"], each["workers"]), []).append(each)
    for each in results:
        if each["row"] not in (*_DIALECTS, *_DIALECT_STREAMS):
            continue
        against = "stream" if each["row"] in _DIALECT_STREAMS else "forward"
        measured = runs.get((against, each["connections"], each["workers"]))
        if not measured:
            continue
        rps = sum(run["rps"] for run in measured) / len(measured)
        p50 = sum(run["p50_ms"] for run in measured) / len(measured)
        each[f"ratio_to_{against}"] = each["rps"] / rps
        each[f"p50_over_{against}_ms"] = each["p50_ms"] - p50
        print(
            f"{each['row']} at {each['connections']} connections, {each['workers']}"
            f" worker(s): {each['rps'] / rps:.1%} of the {against} row's requests/s,"
            f" p50 {each['p50_ms'] - p50:+.2f} ms over {against}'s"
        )
    for row, each in latency.items():
        if row not in (*_DIALECTS, *_DIALECT_STREAMS):
            continue
        against = "stream" if row in _DIALECT_STREAMS else "forward"
        if against in latency:
            added = each["p50_ms"] - latency[against]["p50_ms"]
            print(
                f"1 connection: {row} p50 {each['p50_ms']:.2f} ms, {against} p50"
                f" {latency[against]['p50_ms']:.2f} ms: {added:+.2f} ms over {against}"
            )


def _copyLogs(scratch: Path, destination: Path) -> None:
    destination.mkdir(parents=True, exist_ok=True)
    for log in scratch.glob("*.log"):
        shutil.copy(log, destination / log.name)


def _assignments(pairs: list[str]) -> dict[str, str]:
    environment = {}
    for pair in pairs:
        name, equals, value = pair.partition("=")
        if not equals:
            raise SystemExit(f"expected NAME=VALUE, got {pair!r}")
        environment[name] = value
    return environment


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per row")
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds before each row")
    parser.add_argument("--connections", default="32,256", help="comma-separated, e.g. 32,256")
    parser.add_argument("--workers", default="1,2", help="svc-proxy processes, e.g. 1,2")
    parser.add_argument(
        "--rows",
        default=(
            "floor,ceiling,prototype,chat,spread,probe,rejected,chat-phase1,spread-phase1,"
            "upstream,forward,upstream-stream,stream,forward-limits,forward-budget,embed,"
            "memory-add"
        ),
    )
    parser.add_argument("--log-level", default="INFO", help="SVC_LOG_LEVEL of the daemons")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument(
        "--keep-logs", type=Path, metavar="DIR", help="copy the daemons' logs here at the end"
    )
    parser.add_argument("--soak", type=int, metavar="SECONDS", help="run the soak instead")
    parser.add_argument(
        "--soak-row", default="chat", help="the soak's row (chat, forward, forward-budget, ...)"
    )
    parser.add_argument(
        "--auth-env", action="append", default=[], metavar="NAME=VALUE", help="for svc-auth"
    )
    parser.add_argument(
        "--proxy-env", action="append", default=[], metavar="NAME=VALUE", help="for svc-proxy"
    )
    parser.add_argument(
        "--recall-mode",
        default="vector",
        choices=("vector", "text", "hybrid"),
        help="[memory].recall_mode of the forward-recall row (decisions D13)",
    )
    parser.add_argument(
        "--recall-memories",
        type=int,
        default=RECALL_MEMORIES,
        help="the memories in the forward-recall row's scope (issue 44: 1,000 and 10,000)",
    )
    parser.add_argument(
        "--recall-vectors",
        default="distinct",
        choices=("distinct", "tied"),
        help="the forward-recall row's memories each with a vector of its own, or all one",
    )
    arguments = parser.parse_args()
    connectionCounts = [int(each) for each in arguments.connections.split(",")]
    workerCounts = [int(each) for each in arguments.workers.split(",")]
    rows = arguments.rows.split(",")
    if arguments.soak:
        workerCounts = [1]

    with (
        tempfile.TemporaryDirectory(prefix="svc-bench-") as scratch,
        contextlib.ExitStack() as keeping,
    ):
        if arguments.keep_logs:
            # Runs once the daemons have stopped (and written their last
            # lines), before the scratch directory goes.
            keeping.callback(_copyLogs, Path(scratch), arguments.keep_logs)
        with runningStack(
            Path(scratch),
            arguments.log_level,
            workerCounts,
            _assignments(arguments.auth_env),
            _assignments(arguments.proxy_env),
            withPrototype="prototype" in rows,
            withCeiling="ceiling" in rows,
            withPhase1=any(row.endswith(_PHASE1) for row in rows),
            withForwarding=any(
                row
                in (
                    *_FORWARDING,
                    *_LIMITED,
                    *_EMBEDDED,
                    *_MEMORY,
                    *_RECALLED,
                    *_DIALECTS,
                    *_DIALECT_STREAMS,
                    *DEPLOYMENT_ROWS,
                )
                for row in [*rows, *([arguments.soak_row] if arguments.soak else [])]
            ),
            withMemory=any(
                row in (*_MEMORY, *_RECALLED)
                for row in [*rows, *([arguments.soak_row] if arguments.soak else [])]
            ),
            recallMode=arguments.recall_mode,
            recallMemories=arguments.recall_memories,
            recallTied=arguments.recall_vectors == "tied",
        ) as stack:
            if arguments.soak:
                return soak(stack, arguments.soak, arguments.soak_row)
            results = []
            for connections in connectionCounts:
                for row in rows:
                    for workers in [1] if row in _SINGLE else workerCounts:
                        results.append(
                            _measure(
                                stack,
                                row,
                                connections,
                                workers,
                                arguments.duration,
                                arguments.warmup,
                            )
                        )
            recallsBefore = _recalls(stack, workerCounts)
            # The 1-connection pass with the first --workers count: the
            # only proxies started when that count is not 1.
            latency = {
                row: _measure(stack, row, 1, workerCounts[0], arguments.duration, arguments.warmup)
                for row in (*_FORWARDING, *_RECALLED, *_DIALECTS, *_DIALECT_STREAMS)
                if row in rows
            }
            recalls = _recallsSince(recallsBefore, _recalls(stack, workerCounts))
            deploymentTries = (
                _deploymentTries(stack, workerCounts)
                if any(row in DEPLOYMENT_ROWS for row in rows)
                else {}
            )
            validateRate, validateErrors = validateTokenDirect(stack, arguments.duration, 16)

    floors = {each["connections"]: each["rps"] for each in results if each["row"] == "floor"}
    # Wide enough for the longest row's name (chat-to-anthropic-stream).
    width = max([13, *(len(each["row"]) for each in results)])
    header = (
        f"{'row':<{width}} {'workers':>7} {'conns':>5} {'req/s':>9} {'p50 ms':>8} {'p99 ms':>8}"
        f" {'p99.9 ms':>9} {'errors':>7} {'vs floor':>9}  CPU µs/request"
    )
    print(header)
    print("-" * len(header))
    for each in results:
        floorRPS = floors.get(each["connections"])
        ratio = f"{each['rps'] / floorRPS:8.1%}" if floorRPS else "      n/a"
        each["ratio_to_floor"] = None if not floorRPS else each["rps"] / floorRPS
        workersCell = "-" if each["row"] in _SINGLE else str(each["workers"])
        print(
            f"{each['row']:<{width}} {workersCell:>7} {each['connections']:>5} {each['rps']:>9.0f}"
            f" {each['p50_ms']:>8.2f} {each['p99_ms']:>8.2f} {each['p999_ms']:>9.2f}"
            f" {each['errors']:>7} {ratio:>9}  "
            + " ".join(f"{name} {us:.0f}" for name, us in each["cpu_us_per_request"].items())
        )
    print("cycle collector in svc-proxy during each row (collections/s, p99 of pauses):")
    for each in [*results, *latency.values()]:
        if "gc" in each:
            print(
                f"  {each['row']:<{width}} {each['workers']:>7} {each['connections']:>5}  "
                + gcCells(each["gc"])
            )
    chats = {
        (each["connections"], each["workers"]): each["rps"]
        for each in results
        if each["row"] == "chat"
    }
    for each in results:
        chatRPS = chats.get((each["connections"], each["workers"]))
        if each["row"] in ("forward", "stream") and chatRPS:
            print(
                f"{each['row']} at {each['connections']} connections, {each['workers']}"
                f" worker(s): {each['rps'] / chatRPS:.1%} of the chat row's requests/s"
            )
    # A row named several times in --rows (to alternate them) is compared
    # with the forward row's mean.
    forwardRuns: dict[tuple[int, int], list[float]] = {}
    for each in results:
        if each["row"] == "forward":
            forwardRuns.setdefault((each["connections"], each["workers"]), []).append(each["rps"])
    for each in results:
        runs = forwardRuns.get((each["connections"], each["workers"]))
        forwardRPS = sum(runs) / len(runs) if runs else None
        if each["row"] in (*_LIMITED, *_EMBEDDED, *_RECALLED, *DEPLOYMENT_ROWS) and forwardRPS:
            each["ratio_to_forward"] = each["rps"] / forwardRPS
            print(
                f"{each['row']} at {each['connections']} connections, {each['workers']}"
                f" worker(s): {each['rps'] / forwardRPS:.1%} of the forward row's requests/s"
            )
    _compareDialects(results, latency)
    # The memory rows against the embed row's mean: what storing adds to
    # embedding.
    embedRuns: dict[tuple[int, int], list[float]] = {}
    for each in results:
        if each["row"] == "embed":
            embedRuns.setdefault((each["connections"], each["workers"]), []).append(each["rps"])
    for each in results:
        runs = embedRuns.get((each["connections"], each["workers"]))
        if each["row"] in _MEMORY and runs:
            embedRPS = sum(runs) / len(runs)
            each["ratio_to_embed"] = each["rps"] / embedRPS
            print(
                f"{each['row']} at {each['connections']} connections, {each['workers']}"
                f" worker(s): {each['rps'] / embedRPS:.1%} of the embed row's requests/s"
            )
    for forwarded, alone, what in (
        ("forward", "upstream", "added p50 latency"),
        ("forward-recall", "forward", "p50 added by recall"),
        ("stream", "upstream-stream", "added p50 time to the first event"),
    ):
        if forwarded in latency and alone in latency:
            added = latency[forwarded]["p50_ms"] - latency[alone]["p50_ms"]
            print(
                f"1 connection: {forwarded} p50 {latency[forwarded]['p50_ms']:.2f} ms,"
                f" {alone} p50 {latency[alone]['p50_ms']:.2f} ms: {what} {added:.2f} ms"
            )
    if deploymentTries:
        print("the deployment rows' tries over the run (warm-ups included), by deployment:")
        for (model, deployment, kind), count in sorted(deploymentTries.items()):
            print(f"  {model:<15} {deployment:<13} {kind:<24} {count:>10.0f}")
    if recalls:
        print(
            "recalls in the 1-connection pass (svc_proxy_memory_recalls_total): "
            + ", ".join(f"{outcome} {count:.0f}" for outcome, count in sorted(recalls.items()))
        )
    print(
        f"svc-auth ValidateToken directly (cached token, 16 in flight): {validateRate:.0f} calls/s,"
        f" {validateErrors} failed"
    )
    if arguments.json:
        arguments.json.write_text(
            json.dumps(
                {
                    "rows": results,
                    "one_connection": latency,
                    "validate_token_per_second": validateRate,
                    "validate_token_errors": validateErrors,
                },
                indent=2,
            )
        )
    # The prototype is a reference: its errors are shown, not judged.
    return 1 if any(each["errors"] for each in results if each["row"] != "prototype") else 0


if __name__ == "__main__":
    raise SystemExit(main())
