"""
svc-worker's parts that need no daemon (decisions D13): its configuration
(refused, one variable named, without what it cannot run without), the
extraction answer it accepts, the backoff of failed attempts, and the
scripted model server's extraction answers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from svcd.common.config import ConfigError
from svcd.devkit.upstream.content import extractionContent
from svcd.worker.config import WorkerConfig
from svcd.worker.extraction import (
    EXTRACTION_PROMPT,
    MAX_MEMORIES,
    BadExtraction,
    Turn,
    extractionRequest,
    memoriesOf,
    userText,
)
from svcd.worker.loop import backoff, leaseOwner

PROVIDERS = """
[[providers]]
name = "p"
base_url = "http://127.0.0.1:9/v1"

[[models]]
name = "chat"
provider = "p"

[[models]]
name = "embed"
provider = "p"
kind = "embedding"
"""


def environment(
    tmp_path: Path, memory: str | None = '[memory]\nembedding_model = "embed"\n'
) -> dict[str, str]:
    providers = tmp_path / "providers.toml"
    providers.write_text(PROVIDERS + (memory or ""))
    return {
        "SVC_MEMORY_GRPC_ADDR": "127.0.0.1:9092",
        "SVC_AUTH_GRPC_ADDR": "127.0.0.1:9091",
        "SVC_PROVIDERS_FILE": str(providers),
    }


def test_configurationDefaultsAndRefusals(tmp_path: Path) -> None:
    """
    With its three required settings the worker takes D13's defaults
    (port 8083, a 60 s lease, 8 attempts); without svc-memory's or
    svc-auth's address, without a providers file or without its [memory]
    table it refuses, naming the variable; a lease out of bounds too.
    """
    config = WorkerConfig.fromEnvironment(environment(tmp_path))
    assert (config.port, config.lease, config.maxAttempts) == (8083, 60.0, 8)
    assert config.memory.embeddingModel.name == "embed"
    assert config.memory.extractionModel is None
    for name in ("SVC_MEMORY_GRPC_ADDR", "SVC_AUTH_GRPC_ADDR", "SVC_PROVIDERS_FILE"):
        incomplete = environment(tmp_path)
        del incomplete[name]
        with pytest.raises(ConfigError) as refused:
            WorkerConfig.fromEnvironment(incomplete)
        assert refused.value.variable == name
    with pytest.raises(ConfigError) as refused:
        WorkerConfig.fromEnvironment(environment(tmp_path, memory=None))
    assert refused.value.variable == "SVC_PROVIDERS_FILE"
    assert "has no [memory] table" in refused.value.problem
    with pytest.raises(ConfigError) as refused:
        WorkerConfig.fromEnvironment({**environment(tmp_path), "SVC_WORKER_LEASE": "2s"})
    assert refused.value.variable == "SVC_WORKER_LEASE"


def chatAnswer(content: object) -> bytes:
    return json.dumps(
        {"choices": [{"message": {"role": "assistant", "content": content}}]}
    ).encode()


def test_theOneAnswerAccepted() -> None:
    """
    Only a first choice whose content is {"memories": [strings]} with at
    most 20 is accepted: trimmed, empty ones dropped, repeats kept once.
    Anything else is a failed attempt whose reason quotes no content.
    """
    answer = {"memories": [" Lives in Lyon. ", "", "Lives in Lyon.", "Likes tea."]}
    assert memoriesOf(chatAnswer(json.dumps(answer))) == ["Lives in Lyon.", "Likes tea."]
    assert memoriesOf(chatAnswer('{"memories": []}')) == []
    bad = [
        b"not json",
        json.dumps({"choices": []}).encode(),
        chatAnswer(None),
        chatAnswer("secret words, not JSON"),
        chatAnswer('["secret"]'),
        chatAnswer('{"facts": ["secret"]}'),
        chatAnswer('{"memories": ["secret", 3]}'),
        chatAnswer(json.dumps({"memories": ["secret"] * (MAX_MEMORIES + 1)})),
        chatAnswer(json.dumps({"memories": ["secret" * 1000]})),
    ]
    for each in bad:
        with pytest.raises(BadExtraction) as refused:
            memoriesOf(each)
        assert "secret" not in str(refused.value)


def test_theRequestAndTheUsersText() -> None:
    """
    The extraction request carries the prompt, the conversation as JSON
    data and response_format json_object; the scripted model server
    answers it with the user's first-person statements. Without an
    extraction model the user's text (its user turns) is the memory.
    """
    turns = [
        Turn("user", "My name is Ada. I live in Paris! Is it sunny? The sky is blue."),
        Turn("assistant", "I am an assistant."),
        Turn("user", "  I like tea.  "),
    ]
    request = extractionRequest("extractor", turns)
    assert request["response_format"] == {"type": "json_object"}
    assert request["messages"][0] == {"role": "system", "content": EXTRACTION_PROMPT}
    assert json.loads(request["messages"][1]["content"])["conversation"][1] == {
        "role": "assistant",
        "content": "I am an assistant.",
    }
    assert json.loads(extractionContent(request) or "") == {
        "memories": ["My name is Ada.", "I live in Paris!", "I like tea."]
    }
    assert extractionContent({"messages": request["messages"]}) is None
    assert userText(turns) == (
        "My name is Ada. I live in Paris! Is it sunny? The sky is blue.\nI like tea."
    )
    assert userText([Turn("assistant", "hello")]) == ""


def test_backoffAndOwners() -> None:
    """
    A failed attempt waits 1 s, doubled per attempt, at most 5 minutes;
    two workers of one host never share a lease owner's name.
    """
    assert [backoff(n) for n in (1, 2, 3, 4, 9, 10, 50)] == [1, 2, 4, 8, 256, 300, 300]
    # SVC_WORKER_MAX_ATTEMPTS has no upper bound: 2**1024 is no float.
    assert backoff(1025) == backoff(10**6) == 300
    assert leaseOwner("svc-worker") != leaseOwner("svc-worker")
    assert len(leaseOwner("x" * 300)) <= 200


@pytest.mark.parametrize("extracts", [True, False])
def test_aWaitAfterAPaidExtractionCountsAnAttempt(tmp_path: Path, extracts: bool) -> None:
    """
    A wait met after the extraction was paid (the embedding refused by a
    tpm that held the extraction, say) counts an attempt, waiting at least
    the refusal's Retry-After: the next attempt pays the extraction again,
    so a refusal that always comes ends at SVC_WORKER_MAX_ATTEMPTS. Without
    an extraction model (nothing paid before the embedding) it stays a
    wait that counts nothing.
    """
    from twisted.internet.defer import Deferred, succeed
    from twisted.internet.task import Clock
    from twisted.python.failure import Failure

    from svcd.providers.providersfile import providersFromEnvironment
    from svcd.worker.metrics import WorkerMetrics
    from svcd.worker.processor import Deferral, FailedAttempt, Observation, ObservationProcessor

    memory = '[memory]\nembedding_model = "embed"\n'
    if extracts:
        memory += 'extraction_model = "chat"\n'
    providers = providersFromEnvironment(
        {"SVC_PROVIDERS_FILE": environment(tmp_path, memory)["SVC_PROVIDERS_FILE"]}, lambda: 0.0
    )
    assert providers is not None

    class Admission:
        def applicable(self, orgID: str, agentID: str) -> object:
            return None

    class Lease:
        def hold(self) -> Deferred[None]:
            return succeed(None)

    parts: Any = (None, providers, None, None, Admission(), None, WorkerMetrics(), Clock())
    processor = ObservationProcessor("worker-1", *parts)
    extracted: list[str] = []

    async def extract(*_: object) -> list[str]:
        extracted.append("paid")
        return ["The user likes green tea."]

    async def embed(*_: object) -> object:
        raise Deferral(42.0, "RATE_LIMITED: tokens per minute")

    patched: Any = processor
    patched._extract, patched._embed = extract, embed
    observation = Observation(
        "obs-1",
        "0190c0de-0000-7000-8000-000000000001",
        "0190c0de-0000-7000-8000-000000000002",
        "",
        "req-1",
        (Turn("user", "I like green tea."),),
        0,
        "token",
    )
    failures: list[BaseException | None] = []

    def kept(failure: Failure) -> None:
        failures.append(failure.value)

    lease: Any = Lease()
    Deferred.fromCoroutine(processor.process(observation, lease)).addErrback(kept)
    [raised] = failures
    if extracts:
        assert extracted == ["paid"]
        assert isinstance(raised, FailedAttempt) and not raised.final
        assert raised.retryAfter == 42.0
        assert raised.reason == "after its paid extraction: RATE_LIMITED: tokens per minute"
    else:
        assert extracted == []
        assert isinstance(raised, Deferral) and raised.retryAfter == 42.0


@pytest.mark.parametrize(
    ("details", "outcome"),
    [("the observation was forgotten", "forgotten"), ("no such id", "lost")],
)
def test_anObservationGoneAtItsStoreIsForgottenOrLost(
    tmp_path: Path, details: str, outcome: str
) -> None:
    """
    svc-memory answering StoreObservation NOT_FOUND: the observation is
    gone and nothing was stored. Taken by a deletion of its scope or agent
    (svc-memory's details say so), its outcome is C{forgotten} (decisions
    D13, amended); otherwise (dropped by an operator) C{lost}.
    """
    import grpc
    from twisted.internet.defer import Deferred, fail, succeed
    from twisted.internet.task import Clock

    from svcd.memoryclient.errors import MemoryNotFound
    from svcd.providers.providersfile import providersFromEnvironment
    from svcd.worker.metrics import WorkerMetrics
    from svcd.worker.processor import Observation, ObservationProcessor

    providers = providersFromEnvironment(
        {
            "SVC_PROVIDERS_FILE": environment(tmp_path, '[memory]\nembedding_model = "embed"\n')[
                "SVC_PROVIDERS_FILE"
            ]
        },
        lambda: 0.0,
    )
    assert providers is not None

    class Admission:
        def applicable(self, orgID: str, agentID: str) -> object:
            return None

    class Lease:
        token = "token"
        seconds = 60.0

        def hold(self) -> Deferred[None]:
            return succeed(None)

    class Memory:
        def storeObservation(self, *_: object) -> Deferred[object]:
            return fail(MemoryNotFound(grpc.StatusCode.NOT_FOUND, details))

    class Embedded:
        model = "embed"
        vectors = [b"\x00\x00\x80?"]

    parts: Any = (Memory(), providers, None, None, Admission(), None, WorkerMetrics(), Clock())
    processor = ObservationProcessor("worker-1", *parts)

    async def embed(*_: object) -> object:
        return Embedded()

    patched: Any = processor
    patched._embed = embed
    observation = Observation(
        "obs-1",
        "0190c0de-0000-7000-8000-000000000001",
        "0190c0de-0000-7000-8000-000000000002",
        "ann",
        "req-1",
        (Turn("user", "I like green tea."),),
        0,
        "token",
    )
    outcomes: list[str] = []
    lease: Any = Lease()
    Deferred.fromCoroutine(processor.process(observation, lease)).addCallback(outcomes.append)
    assert outcomes == [outcome]
