"""
Retrieval benchmark of memory search's three modes (decisions D13,
"Hybrid search"; issue 34): recall@1, @5 and @10 of vector, text and
hybrid search over conversations with known evidence, loaded and searched
through the gateway.

    python bench/retrieval.py [--embedder minilm|hashed] [--embedder-python PATH]
        [--conversations 10] [--seed 7] [--json FILE]

Starts, on this machine, its own PostgreSQL and Redis, `twistd -n
svc-auth`, `twistd -n svc-memory`, `twistd -n svc-proxy` and an embedder
behind an OpenAI-compatible /v1/embeddings (bench/embedder.py) that the
providers file names as memory's embedding model. The data set is the
project's own (bench/retrievaldata.py: generated conversations with
names, dates and rare words; nothing collected). Each conversation is one
subject of one agent: its turns are stored with POST /v1/memories, one by
one; then each question is asked with POST /v1/memories/search, k = 10, in
each mode, and the rank of its evidence is noted. A question is recalled
at k when its evidence is among the first k.

The embedder: "minilm" is all-MiniLM-L6-v2, a small real model, which
needs a Python with torch and sentence-transformers (--embedder-python;
bench/README.rst says how to make one); "hashed" is the scripted
upstream's hashed bag of words, which knows no meaning (texts are near
when they share words): vector search is then a crude word match, and its
numbers say nothing of a real embedder's.

Prints recall@1/5/10 per mode, over every question and per kind of
question (entity, paraphrase).
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import psycopg  # noqa: E402
from retrievaldata import Conversation, conversations  # noqa: E402

from svcd.auth.authority import issueToken  # noqa: E402
from svcd.auth.store import Store  # noqa: E402
from svcd.common.migrations import migrate  # noqa: E402
from svcd.devkit.daemons import Daemon, authEnvironment, memoryEnvironment  # noqa: E402
from svcd.devkit.postgres import PostgresServer  # noqa: E402
from svcd.devkit.redis import RedisServer  # noqa: E402
from svcd.devkit.servers import freePort  # noqa: E402

MODES = ("vector", "text", "hybrid")
CUTS = (1, 5, 10)
# MemoryRead and MemoryWrite.
PERMISSIONS = 64 + 128


def providersFile(workdir: Path, embedderPort: int) -> Path:
    path = workdir / "providers.toml"
    path.write_text(
        f"""
[[providers]]
name = "embedder"
base_url = "http://127.0.0.1:{embedderPort}/v1"
timeout = 60

[[models]]
name = "embed"
provider = "embedder"
kind = "embedding"

[memory]
embedding_model = "embed"
"""
    )
    return path


def startEmbedder(workdir: Path, python: str, backend: str) -> tuple[subprocess.Popen[bytes], int]:
    port = freePort()
    log = (workdir / "embedder.log").open("wb")
    process = subprocess.Popen(
        [python, str(ROOT / "bench" / "embedder.py"), str(port), "--backend", backend],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 300
    while True:
        with contextlib.suppress(OSError):
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
            connection.request(
                "POST", "/v1/embeddings", json.dumps({"input": ["ready?"], "model": "embed"})
            )
            if connection.getresponse().status == 200:
                return process, port
        assert process.poll() is None, (workdir / "embedder.log").read_text()
        assert time.monotonic() < deadline, "the embedder did not start"
        time.sleep(0.5)


class Gateway:
    """
    One keep-alive connection to svc-proxy, as one agent.
    """

    def __init__(self, port: int, token: str, agentID: str) -> None:
        self._connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        self._headers = {
            "Authorization": f"Bearer {token}",
            "X-SVC-Agent-ID": agentID,
            "Content-Type": "application/json",
        }

    def call(self, path: str, body: dict[str, Any], subject: str) -> tuple[int, Any]:
        """
        POST C{body}; a 503 (svc-auth or svc-memory slow to answer on a
        loaded machine) is tried again, up to 20 times, 0.5 s apart.
        """
        for _ in range(20):
            self._connection.request(
                "POST",
                path,
                json.dumps(body),
                {**self._headers, "X-SVC-Memory-Subject": subject},
            )
            response = self._connection.getresponse()
            answer = json.loads(response.read())
            if response.status != 503:
                break
            time.sleep(0.5)
        return response.status, answer


@contextlib.contextmanager
def runningGateway(
    workdir: Path, python: str, backend: str
) -> Iterator[tuple[Gateway, subprocess.Popen[bytes]]]:
    with contextlib.ExitStack() as stack:
        postgres = PostgresServer.create(workdir / "postgres")
        postgres.start()
        stack.callback(postgres.destroy)
        dsn = postgres.createDatabase("retrieval")
        migrate(dsn)
        with psycopg.connect(dsn, autocommit=True) as connection:
            store = Store(lambda: contextlib.nullcontext(connection))
            orgID = store.createOrganization("retrieval")
            agent = store.createAgent(orgID, "retrieval-agent")
            token, _ = issueToken(store, orgID=orgID, permissions=PERMISSIONS)
        redis = RedisServer.create(workdir / "redis")
        redis.start()
        stack.callback(redis.destroy)
        embedder, embedderPort = startEmbedder(workdir, python, backend)
        stack.callback(embedder.wait, 10)
        stack.callback(embedder.terminate)
        auth = Daemon("svc-auth", authEnvironment(dsn, SVC_LOG_LEVEL="WARN"), workdir / "auth.log")
        auth.start()
        stack.callback(auth.terminate)
        memory = Daemon(
            "svc-memory", memoryEnvironment(dsn, SVC_LOG_LEVEL="WARN"), workdir / "memory.log"
        )
        memory.start()
        stack.callback(memory.terminate)
        auth.waitForReady()
        memory.waitForReady()
        port = freePort()
        proxy = Daemon(
            "svc-proxy",
            {
                "SVC_HOST": "127.0.0.1",
                "SVC_PORT": str(port),
                "SVC_AUTH_GRPC_ADDR": f"127.0.0.1:{auth.environment['SVC_GRPC_PORT']}",
                "SVC_MEMORY_GRPC_ADDR": f"127.0.0.1:{memory.environment['SVC_GRPC_PORT']}",
                "SVC_PROVIDERS_FILE": str(providersFile(workdir, embedderPort)),
                "SVC_RATE_LIMIT_ORG_OVERRIDES": f"{orgID}=1000000000",
                "REDIS_URL": redis.url,
                "SVC_LOG_LEVEL": "WARN",
            },
            workdir / "proxy.log",
        )
        proxy.start()
        stack.callback(proxy.terminate)
        proxy.waitForReady()
        yield Gateway(port, token, str(agent.agentID)), embedder


def load(gateway: Gateway, data: list[Conversation]) -> list[list[str]]:
    """
    Every turn stored as a memory of its conversation's subject; the ids,
    by conversation and turn.
    """
    ids: list[list[str]] = []
    for number, each in enumerate(data):
        stored = []
        for turn in each.turns:
            status, memory = gateway.call(
                "/v1/memories", {"content": turn}, f"conversation-{number}"
            )
            assert status == 201, memory
            stored.append(memory["id"])
        ids.append(stored)
    return ids


def evaluate(
    gateway: Gateway, data: list[Conversation], ids: list[list[str]]
) -> dict[str, dict[str, dict[int, float]]]:
    """
    recall@k by mode, over all questions ("all") and by kind.
    """
    hits: dict[str, dict[str, dict[int, int]]] = {}
    totals: dict[str, int] = {}
    for number, each in enumerate(data):
        for question in each.questions:
            evidence = ids[number][question.evidence]
            for kind in ("all", question.kind):
                totals[kind] = totals.get(kind, 0) + 1
            for mode in MODES:
                status, answer = gateway.call(
                    "/v1/memories/search",
                    {"query": question.text, "k": max(CUTS), "mode": mode},
                    f"conversation-{number}",
                )
                assert status == 200, answer
                ranked = [found["memory"]["id"] for found in answer["data"]]
                for kind in ("all", question.kind):
                    counts = hits.setdefault(mode, {}).setdefault(kind, dict.fromkeys(CUTS, 0))
                    for cut in CUTS:
                        counts[cut] += evidence in ranked[:cut]
    return {
        mode: {
            kind: {cut: round(count / totals[kind], 3) for cut, count in counts.items()}
            for kind, counts in byKind.items()
        }
        for mode, byKind in hits.items()
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--embedder", choices=("minilm", "hashed"), default="minilm")
    parser.add_argument(
        "--embedder-python",
        default=sys.executable,
        help="the Python that runs bench/embedder.py (minilm needs torch and"
        " sentence-transformers there)",
    )
    parser.add_argument("--conversations", type=int, default=10)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--json", type=Path, help="also write the results here")
    arguments = parser.parse_args()
    data = conversations(arguments.seed, arguments.conversations)
    questions = sum(len(each.questions) for each in data)
    turns = sum(len(each.turns) for each in data)
    with (
        tempfile.TemporaryDirectory(prefix="svc-retrieval-") as scratch,
        runningGateway(Path(scratch), arguments.embedder_python, arguments.embedder) as (
            gateway,
            _,
        ),
    ):
        started = time.perf_counter()
        ids = load(gateway, data)
        loaded = time.perf_counter() - started
        started = time.perf_counter()
        results = evaluate(gateway, data, ids)
        searched = time.perf_counter() - started
    print(
        f"{arguments.conversations} conversations, {turns} memories, {questions} questions;"
        f" embedder {arguments.embedder}; loaded in {loaded:.0f}s, searched in {searched:.0f}s"
    )
    kinds = ("all", "entity", "paraphrase")
    print("mode   | " + " | ".join(f"{kind} @1 @5 @10" for kind in kinds))
    for mode in MODES:
        print(
            f"{mode:<6} | "
            + " | ".join(
                " ".join(f"{results[mode][kind][cut]:.3f}" for cut in CUTS) for kind in kinds
            )
        )
    if arguments.json:
        arguments.json.write_text(
            json.dumps(
                {
                    "embedder": arguments.embedder,
                    "conversations": arguments.conversations,
                    "memories": turns,
                    "questions": questions,
                    "recall": results,
                },
                indent=2,
            )
            + "\n"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
