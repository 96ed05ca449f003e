"""
Searches that share a call (decisions D13, "Context assembly"): svc-memory's
SearchMany and the client's L{svcd.memoryclient.batches.SearchBatches} that sends
it.

Against the real MemoryService over grpcio and a real PostgreSQL
(L{RunningMemoryService}):

  - SearchMany answers each search as Search answers it, in the order
    asked, a refusal in its own outcome (never the call's), each scope in
    its own organization; 1 to 64 searches, else the call is refused.
  - SearchBatches, one call in flight per organization: searches started
    in one reactor turn go as one Search (the first) and one SearchMany
    (the rest), each with its own answer; organizations never share a
    call; C{maxBatch} splits what is held; C{maxInFlight} lets that many go
    alone.

Against grpcio servers of our own standing in for svc-memory
(L{scriptedMemory}: calls held until the test lets them go, every call
that arrives counted by method, cancellations seen as the server sees
them):

  - a refusal in an outcome is the exception L{MemoryClient} raises for
    the same status from Search; a failed SearchMany fails its searches;
  - cancelling: a held search is never sent; one of a SearchMany in flight
    leaves the others their answers; all of them cancel the call;
  - a held search whose deadline passed before its turn is not sent;
  - a server without SearchMany (grpcio's own UNIMPLEMENTED) has the batch
    sent again one Search each, and later batches too, without SearchMany,
    until C{retryBatchesAfter} has passed.

And L{searchManyAnswer}'s bytes are the message protobuf builds (a
Hypothesis property), an answer without hits included.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from typing import Any, TypeVar, cast

import attrs
import grpc
import pytest
import pytest_twisted
from authfixtures import Tenant
from hypothesis import given, settings
from hypothesis import strategies as st
from memoryfixtures import MODEL, embedding, memoryRecords, scopeOf, vectorBytes
from memoryservice import RunningMemoryService
from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.interfaces import IReactorFromThreads
from twisted.internet.task import Clock, deferLater

from svcd.memory.records import MemoryRecord
from svcd.memory.wire import encodedMemory, memoryMessage, searchAnswer, searchManyAnswer
from svcd.memoryclient.batches import SearchBatches
from svcd.memoryclient.channel import memoryChannel
from svcd.memoryclient.client import MemoryClient
from svcd.memoryclient.errors import (
    MemoryCallFailed,
    MemoryForbidden,
    MemoryFull,
    MemoryInvalid,
    MemoryNotFound,
    MemoryUnavailable,
)
from svcd.memoryclient.records import FORBIDDEN_DETAILS, MAX_SEARCHES_PER_CALL, Scope
from svcd.pb.memory.v1 import memory_pb2

T = TypeVar("T")

SERVICE = "svc.memory.v1.MemoryService"

# How long a test waits for something that should take milliseconds: a
# bound that only a broken behaviour (or a machine stalled for seconds)
# reaches.
LIMIT = 15.0


# Helpers.


def scopeMessage(tenant: Tenant, subject: str = "") -> memory_pb2.Scope:
    return memory_pb2.Scope(org_id=str(tenant.orgID), agent_id=str(tenant.agentID), subject=subject)


def vector(values: list[float]) -> memory_pb2.Embedding:
    return memory_pb2.Embedding(model=MODEL, vector=vectorBytes(values))


def add(
    service: RunningMemoryService, where: memory_pb2.Scope, content: str, values: list[float]
) -> memory_pb2.Memory:
    memory: memory_pb2.Memory = service.stub.AddMemory(
        memory_pb2.AddMemoryRequest(scope=where, content=content, embedding=vector(values)),
        timeout=10,
    )
    return memory


def requestsTotal(service: RunningMemoryService, method: str, code: str = "OK") -> float:
    """
    svc-memory's C{svc_memory_grpc_requests_total} for C{method} and
    C{code}: the calls it answered.
    """
    value = service.registry.get_sample_value(
        "svc_memory_grpc_requests_total", {"method": method, "code": code}
    )
    return value or 0.0


class SentCalls(grpc.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    """
    A client interceptor recording each call as the client starts it (on
    the reactor thread, synchronously in the stub's C{future}): its method
    and request. What a test reads to know which searches went together.
    """

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        self.calls.append((details.method.rsplit("/", 1)[-1], request))
        return continuation(details, request)

    def methods(self) -> list[str]:
        return [method for method, _ in self.calls]

    def searchesOf(self, index: int) -> list[memory_pb2.SearchRequest]:
        """
        The searches the call C{index} carried: one for a Search, each of
        a SearchMany's.
        """
        method, request = self.calls[index]
        if method == "SearchMany":
            return list(request.searches)
        assert method == "Search"
        return [request]


def clientOf(address: str, timeout: float = 10.0, sent: SentCalls | None = None) -> MemoryClient:
    """
    A started L{MemoryClient} of C{address}, whose calls C{sent} records.
    """
    from twisted.internet import reactor

    def channel() -> Any:
        made = memoryChannel(address)
        return made if sent is None else grpc.intercept_channel(made, sent)

    client = MemoryClient(channel, IReactorFromThreads(reactor), timeout=timeout)
    client.start()
    return client


async def waitFor(condition: Callable[[], bool], seconds: float = LIMIT) -> None:
    """
    Let the reactor run until C{condition} holds; fail after C{seconds}.
    """
    from twisted.internet import reactor

    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"not true within {seconds}s"
        await deferLater(reactor, 0.01, lambda: None)


async def settled(result: Deferred[T], seconds: float = LIMIT) -> T:
    """
    C{result}'s outcome once it has fired, within C{seconds}; waiting for
    it this way (not with a timeout on it) never cancels it.
    """
    await waitFor(lambda: result.called, seconds)
    return await result


async def refusedBy(result: Deferred[Any], seconds: float = LIMIT) -> BaseException:
    """
    The exception C{result} failed with, within C{seconds}.
    """
    try:
        await settled(result, seconds)
    except AssertionError:
        raise
    except Exception as error:
        return error
    raise AssertionError("answered, not refused")


def failedAlready(result: Deferred[Any], kind: type[BaseException]) -> BaseException:
    """
    The exception of C{kind} that C{result} has already failed with (read
    without waiting: the test's claim is that it failed at once).
    """
    assert result.called, "not failed yet"
    failures: list[Any] = []
    result.addErrback(failures.append)
    assert len(failures) == 1, "answered, not failed"
    error = failures[0].value
    assert isinstance(error, kind), repr(error)
    return error


def contents(answer: memory_pb2.SearchResponse) -> list[str]:
    return [hit.memory.content for hit in answer.results]


# SearchMany through the real servicer.


def test_eachOutcomeIsWhatSearchAnswers(
    memoryService: RunningMemoryService, acme: Tenant, globex: Tenant
) -> None:
    """
    Searches of two organizations, valid and not, in one SearchMany: one
    outcome per search in the order asked, each exactly what Search
    answers for the same request (its hits, or its status code as a
    number and its details). Two refusals (k of 0, an unknown mode) are
    INVALID_ARGUMENT (3) in their own outcomes while the others answer,
    and the call itself is OK. An answer without hits still has its
    response; a refusal has none.
    """
    stub = memoryService.stub
    mine, theirs = scopeMessage(acme), scopeMessage(globex)
    add(memoryService, mine, "green tea in the morning", [1.0, 0.0, 0.0])
    add(memoryService, mine, "plays chess", [0.0, 1.0, 0.0])
    add(memoryService, mine, "black tea at night", [1.0, 1.0, 0.0])
    add(memoryService, theirs, "theirs: rides a bike", [1.0, 0.0, 0.0])
    searches = [
        memory_pb2.SearchRequest(scope=mine, query=vector([1.0, 0.0, 0.0]), k=2),
        memory_pb2.SearchRequest(scope=mine, query=vector([1.0, 0.0, 0.0]), k=0),
        memory_pb2.SearchRequest(scope=theirs, query=vector([1.0, 0.0, 0.0]), k=10),
        memory_pb2.SearchRequest(
            scope=mine, query=vector([1.0, 0.0, 0.0]), k=5, mode="semantic", text="tea"
        ),
        memory_pb2.SearchRequest(
            scope=scopeMessage(acme, "nobody"), query=vector([1.0, 0.0, 0.0]), k=5
        ),
        memory_pb2.SearchRequest(scope=mine, k=5, mode="text", text="tea"),
        memory_pb2.SearchRequest(scope=mine, query=vector([1.0, 0.0, 0.0]), k=5, min_score=0.9),
    ]
    before = requestsTotal(memoryService, "SearchMany")
    searchesBefore = [
        requestsTotal(memoryService, "Search", code) for code in ("OK", "INVALID_ARGUMENT")
    ]
    answer = stub.SearchMany(memory_pb2.SearchManyRequest(searches=searches), timeout=10)
    assert requestsTotal(memoryService, "SearchMany") == before + 1
    # Each search counted as a Search of its outcome: 5 answered, 2 refused.
    assert [
        requestsTotal(memoryService, "Search", code) for code in ("OK", "INVALID_ARGUMENT")
    ] == [searchesBefore[0] + 5, searchesBefore[1] + 2]
    assert len(answer.outcomes) == len(searches)
    for search, outcome in zip(searches, answer.outcomes, strict=True):
        try:
            alone = stub.Search(search, timeout=10)
        except grpc.RpcError as error:
            assert (outcome.code, outcome.details) == (error.code().value[0], error.details())
            assert not outcome.HasField("response")
        else:
            assert outcome.code == 0 and outcome.details == ""
            assert outcome.HasField("response") and outcome.response == alone
    # What the comparison above went through, spelled out: the two
    # refusals, and that the others did answer something.
    assert [outcome.code for outcome in answer.outcomes] == [0, 3, 0, 3, 0, 0, 0]
    assert answer.outcomes[1].details.startswith("k")
    assert answer.outcomes[3].details.startswith("mode")
    assert contents(answer.outcomes[0].response) == [
        "green tea in the morning",
        "black tea at night",
    ]
    assert contents(answer.outcomes[2].response) == ["theirs: rides a bike"]
    assert contents(answer.outcomes[4].response) == []
    assert sorted(contents(answer.outcomes[5].response)) == [
        "black tea at night",
        "green tea in the morning",
    ]
    assert contents(answer.outcomes[6].response) == ["green tea in the morning"]


def test_eachSearchIsInItsOwnOrganization(
    memoryService: RunningMemoryService, acme: Tenant, globex: Tenant
) -> None:
    """
    Two organizations whose memories have the same vectors, searched in
    one call: each search finds its own organization's memories only, and
    a scope naming one organization with the other's agent finds nothing
    of either (it is answered as Search answers it).
    """
    stub = memoryService.stub
    ours = {add(memoryService, scopeMessage(acme), f"acme {n}", [1.0, n]).id for n in range(3)}
    theirs = {
        add(memoryService, scopeMessage(globex), f"globex {n}", [1.0, n]).id for n in range(3)
    }
    crossed = memory_pb2.Scope(org_id=str(globex.orgID), agent_id=str(acme.agentID))
    searches = [
        memory_pb2.SearchRequest(scope=where, query=vector([1.0, 0.5]), k=100)
        for where in (scopeMessage(acme), scopeMessage(globex), crossed, scopeMessage(acme))
    ]
    answer = stub.SearchMany(memory_pb2.SearchManyRequest(searches=searches), timeout=10)
    first, second, third, fourth = answer.outcomes
    assert {hit.memory.id for hit in first.response.results} == ours
    assert {hit.memory.org_id for hit in first.response.results} == {str(acme.orgID)}
    assert {hit.memory.id for hit in second.response.results} == theirs
    assert {hit.memory.org_id for hit in second.response.results} == {str(globex.orgID)}
    assert fourth == first
    assert not {hit.memory.id for hit in third.response.results} & (ours | theirs)
    try:
        alone = stub.Search(searches[2], timeout=10)
    except grpc.RpcError as error:
        assert (third.code, third.details) == (error.code().value[0], error.details())
    else:
        assert third.code == 0 and third.response == alone


class _Deadline:
    """
    The part of a call's context SearchMany reads: the seconds left, one
    value per search asked (the last one repeated).
    """

    def __init__(self, *remaining: float) -> None:
        self.remaining = list(remaining)

    def time_remaining(self) -> float:
        return self.remaining.pop(0) if len(self.remaining) > 1 else self.remaining[0]


def test_searchesPastTheCallsDeadlineAreNotMade(
    memoryService: RunningMemoryService, acme: Tenant
) -> None:
    """
    Once the call's deadline has passed between two searches (scopes
    loaded one after another), the searches not made yet are answered
    DEADLINE_EXCEEDED and counted so, and those made before still reach
    the caller.
    """
    add(memoryService, scopeMessage(acme), "one", [1.0])
    search = memory_pb2.SearchRequest(scope=scopeMessage(acme), query=vector([1.0]), k=1)
    before = requestsTotal(memoryService, "Search", "DEADLINE_EXCEEDED")
    written = memoryService.parts.servicer.SearchMany(
        memory_pb2.SearchManyRequest(searches=[search] * 4),
        cast(grpc.ServicerContext, _Deadline(5.0, 0.5, 0.0)),
    )
    answer = memory_pb2.SearchManyResponse.FromString(written)
    assert [outcome.code for outcome in answer.outcomes] == [0, 0, 4, 4]
    assert [len(outcome.response.results) for outcome in answer.outcomes[:2]] == [1, 1]
    assert answer.outcomes[2].details == "deadline passed"
    assert requestsTotal(memoryService, "Search", "DEADLINE_EXCEEDED") == before + 2


def test_aCallHoldsOneToSixtyFourSearches(
    memoryService: RunningMemoryService, acme: Tenant
) -> None:
    """
    No search, or 65, and the call itself is INVALID_ARGUMENT naming
    C{searches}; 64 (the most, L{MAX_SEARCHES_PER_CALL}) are all answered.
    """
    stub = memoryService.stub
    add(memoryService, scopeMessage(acme), "one", [1.0])
    search = memory_pb2.SearchRequest(scope=scopeMessage(acme), query=vector([1.0]), k=1)
    for count in (0, MAX_SEARCHES_PER_CALL + 1):
        with pytest.raises(grpc.RpcError) as raised:
            stub.SearchMany(memory_pb2.SearchManyRequest(searches=[search] * count), timeout=10)
        error = raised.value
        assert isinstance(error, grpc.Call)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, count
        assert error.details().startswith("searches"), error.details()
    answer = stub.SearchMany(
        memory_pb2.SearchManyRequest(searches=[search] * MAX_SEARCHES_PER_CALL), timeout=10
    )
    assert [contents(outcome.response) for outcome in answer.outcomes] == [
        ["one"]
    ] * MAX_SEARCHES_PER_CALL
    assert requestsTotal(memoryService, "SearchMany", "INVALID_ARGUMENT") == 2


# SearchMany's answer written as bytes.

records = memoryRecords

# An outcome: a search's hits (possibly none), or a refusal's status code
# (a google.rpc.Code other than OK) and details.
outcomes = st.one_of(
    st.lists(st.tuples(records, st.floats(-1, 1, width=32)), max_size=4),
    st.tuples(st.integers(1, 16), st.text(max_size=300)),
)


def builtByProtobuf(
    chosen: Sequence[list[tuple[MemoryRecord, float]] | tuple[int, str]],
) -> memory_pb2.SearchManyResponse:
    built = memory_pb2.SearchManyResponse()
    for each in chosen:
        outcome = built.outcomes.add()
        if isinstance(each, list):
            outcome.response.SetInParent()
            for record, score in each:
                outcome.response.results.add(memory=memoryMessage(record), score=score)
        else:
            outcome.code, outcome.details = each
    return built


def writtenAsBytes(chosen: Sequence[list[tuple[MemoryRecord, float]] | tuple[int, str]]) -> bytes:
    written: list[tuple[int, bytes | str]] = []
    for each in chosen:
        if isinstance(each, list):
            written.append(
                (0, searchAnswer([(encodedMemory(record), score) for record, score in each]))
            )
        else:
            written.append(each)
    return searchManyAnswer(written)


# No deadline: the machine's load, not the code, decides how long an
# example takes.
@settings(deadline=None)
@given(st.lists(outcomes, max_size=6))
def test_anAnswerWrittenAsBytesIsTheMessageProtobufBuilds(
    chosen: list[list[tuple[MemoryRecord, float]] | tuple[int, str]],
) -> None:
    """
    L{searchManyAnswer}'s bytes parse into the SearchManyResponse
    protobuf builds from the same outcomes, every answer's response
    present (hits or none) and every refusal's absent; and they are the
    very bytes protobuf writes, except that a refusal's empty details are
    written (as an empty field 3) where protobuf leaves them out, which
    parses the same.
    """
    built = builtByProtobuf(chosen)
    written = writtenAsBytes(chosen)
    parsed = memory_pb2.SearchManyResponse.FromString(written)
    assert parsed == built
    assert [outcome.HasField("response") for outcome in parsed.outcomes] == [
        isinstance(each, list) for each in chosen
    ]
    if all(isinstance(each, list) or each[1] for each in chosen):
        assert written == built.SerializeToString()


def test_anAnswerWithoutHitsIsStillAnAnswer() -> None:
    """
    An OK outcome without hits is written with its (empty) response, so
    that it is told apart from an outcome that has none: parsed, it has
    the field, and code 0.
    """
    written = searchManyAnswer([(0, searchAnswer([])), (5, "no such id")])
    assert written == b"\x0a\x02\x0a\x00" + b"\x0a\x0e\x10\x05\x1a\x0ano such id"
    empty, refused = memory_pb2.SearchManyResponse.FromString(written).outcomes
    assert empty.HasField("response") and empty.code == 0 and not empty.response.results
    assert not refused.HasField("response") and (refused.code, refused.details) == (
        5,
        "no such id",
    )


# SearchBatches against the real service.


@attrs.frozen
class Batching:
    """
    A SearchBatches on a client of the real svc-memory whose calls
    C{sent} records.
    """

    service: RunningMemoryService
    client: MemoryClient
    sent: SentCalls

    def batches(self, maxInFlight: int = 1, maxBatch: int = MAX_SEARCHES_PER_CALL) -> SearchBatches:
        from twisted.internet import reactor

        return SearchBatches(self.client, reactor, maxInFlight=maxInFlight, maxBatch=maxBatch)


@pytest.fixture
def batching(memoryService: RunningMemoryService) -> Iterator[Batching]:
    sent = SentCalls()
    client = clientOf(memoryService.address, sent=sent)
    try:
        yield Batching(memoryService, client, sent)
    finally:
        client.close()


def subjects(requests: Sequence[memory_pb2.SearchRequest]) -> list[str]:
    return [request.scope.subject for request in requests]


@pytest_twisted.ensureDeferred
async def test_searchesThatPileUpShareOneCall(batching: Batching, acme: Tenant) -> None:
    """
    One call in flight per organization: of five searches started in one
    reactor turn the first is sent at once, alone, as a Search, and the
    four others are held (nothing else is sent in that turn); when the
    first ends they go as one SearchMany, in the order they came. Each
    gets what MemoryClient.search answers for it, a refusal included
    (k of 1,000: MemoryInvalid, with Search's details). svc-memory
    counted exactly one Search and one SearchMany.
    """
    service = batching.service
    for n in range(4):
        add(service, scopeMessage(acme, f"s{n}"), f"memory of s{n}", [1.0, float(n)])
    batches = batching.batches()
    asked: list[tuple[Scope, int]] = [(scopeOf(acme, f"s{n}"), 5) for n in range(4)]
    asked.append((scopeOf(acme, "s1"), 1000))
    results = [batches.search(where, embedding([1.0, 0.0]), k) for where, k in asked]
    assert batching.sent.methods() == ["Search"]
    assert subjects(batching.sent.searchesOf(0)) == ["s0"]

    answers = [await settled(result) for result in results[:4]]
    refused = await refusedBy(results[4])
    assert batching.sent.methods() == ["Search", "SearchMany"]
    assert subjects(batching.sent.searchesOf(1)) == ["s1", "s2", "s3", "s1"]
    # The batch's searches are counted as Searches of their outcomes too.
    assert requestsTotal(service, "Search") == 1 + 3
    assert requestsTotal(service, "Search", "INVALID_ARGUMENT") == 1
    assert requestsTotal(service, "SearchMany") == 1

    assert [contents(answer) for answer in answers] == [[f"memory of s{n}"] for n in range(4)]
    for (where, k), answer in zip(asked[:4], answers, strict=True):
        assert answer == await batching.client.search(where, embedding([1.0, 0.0]), k)
    with pytest.raises(MemoryInvalid) as alone:
        await batching.client.search(asked[4][0], embedding([1.0, 0.0]), 1000)
    assert type(refused) is MemoryInvalid
    assert (refused.code, refused.details) == (alone.value.code, alone.value.details)


@pytest_twisted.ensureDeferred
async def test_organizationsNeverShareACall(
    batching: Batching, acme: Tenant, globex: Tenant
) -> None:
    """
    Searches of two organizations interleaved in one reactor turn: each
    organization's first is sent at once, alone (the other's call in
    flight holds back nothing of it); the held ones go per organization,
    acme's two as one SearchMany and globex's one as a plain Search. No
    call carries two organizations' searches, and each search finds its
    own organization's memory.
    """
    service = batching.service
    add(service, scopeMessage(acme), "acme's", [1.0, 0.0])
    add(service, scopeMessage(globex), "globex's", [1.0, 0.0])
    batches = batching.batches()
    tenants = [acme, globex, acme, globex, acme]
    results = [batches.search(scopeOf(tenant), embedding([1.0, 0.0]), k=10) for tenant in tenants]
    assert batching.sent.methods() == ["Search", "Search"]
    assert [request.scope.org_id for _, request in batching.sent.calls] == [
        str(acme.orgID),
        str(globex.orgID),
    ]
    answers = [await settled(result) for result in results]
    expected = {acme.orgID: ["acme's"], globex.orgID: ["globex's"]}
    assert [contents(answer) for answer in answers] == [
        expected[tenant.orgID] for tenant in tenants
    ]
    assert sorted(batching.sent.methods()) == ["Search", "Search", "Search", "SearchMany"]
    byOrganization: dict[str, list[int]] = {}
    for index in range(len(batching.sent.calls)):
        organizations = {request.scope.org_id for request in batching.sent.searchesOf(index)}
        assert len(organizations) == 1, "two organizations in one call"
        byOrganization.setdefault(organizations.pop(), []).append(
            len(batching.sent.searchesOf(index))
        )
    assert byOrganization == {str(acme.orgID): [1, 2], str(globex.orgID): [1, 1]}


@pytest_twisted.ensureDeferred
async def test_aBatchHoldsAtMostMaxBatch(batching: Batching, acme: Tenant) -> None:
    """
    With maxBatch 2, the five searches held behind the first go two, two
    and one (a Search) at a time, each call when the one before ends, in
    the order they came; each answered.
    """
    service = batching.service
    for n in range(6):
        add(service, scopeMessage(acme, f"s{n}"), f"memory of s{n}", [1.0])
    batches = batching.batches(maxBatch=2)
    results = [batches.search(scopeOf(acme, f"s{n}"), embedding([1.0]), k=1) for n in range(6)]
    answers = [await settled(result) for result in results]
    assert [contents(answer) for answer in answers] == [[f"memory of s{n}"] for n in range(6)]
    assert batching.sent.methods() == ["Search", "SearchMany", "SearchMany", "Search"]
    assert [subjects(batching.sent.searchesOf(index)) for index in range(4)] == [
        ["s0"],
        ["s1", "s2"],
        ["s3", "s4"],
        ["s5"],
    ]


@pytest_twisted.ensureDeferred
async def test_maxInFlightCallsGoAlone(batching: Batching, acme: Tenant) -> None:
    """
    With maxInFlight 2, the first two searches of a turn are sent at once,
    alone; the two after them wait for one of those and go together. One
    search at a time (each awaited before the next) is always a Search:
    a quiet client waits for nothing.
    """
    service = batching.service
    add(service, scopeMessage(acme), "only", [1.0])
    batches = batching.batches(maxInFlight=2)
    results = [batches.search(scopeOf(acme), embedding([1.0]), k=1) for _ in range(4)]
    assert batching.sent.methods() == ["Search", "Search"]
    answers = [await settled(result) for result in results]
    assert [contents(answer) for answer in answers] == [["only"]] * 4
    assert batching.sent.methods() == ["Search", "Search", "SearchMany"]
    assert len(batching.sent.searchesOf(2)) == 2

    del batching.sent.calls[:]
    for _ in range(3):
        assert contents(await settled(batches.search(scopeOf(acme), embedding([1.0]), k=1))) == [
            "only"
        ]
    assert batching.sent.methods() == ["Search"] * 3


# SearchBatches against grpcio servers of our own.


def answerTo(request: memory_pb2.SearchRequest) -> memory_pb2.SearchResponse:
    """
    What the scripted server answers a search: one hit naming the search's
    subject, so that a test sees whose answer each search got.
    """
    return memory_pb2.SearchResponse(
        results=[
            memory_pb2.ScoredMemory(
                memory=memory_pb2.Memory(
                    content=f"answer to {request.scope.subject}", org_id=request.scope.org_id
                ),
                score=0.5,
            )
        ]
    )


def refusalFor(request: memory_pb2.SearchRequest) -> tuple[grpc.StatusCode, str] | None:
    """
    The status a scripted search is refused with: one whose subject is
    C{refuse-<code>} is refused with that code, and details of its own
    (for PERMISSION_DENIED, 7, svc-memory's own refusal of another
    tenant's memory); None for the others, which are answered.
    """
    subject = request.scope.subject
    if not subject.startswith("refuse-"):
        return None
    number = int(subject.removeprefix("refuse-"))
    code = next(each for each in grpc.StatusCode if each.value[0] == number)
    return code, FORBIDDEN_DETAILS if number == 7 else f"refused with {number}"


@attrs.define
class ScriptedMemory:
    """
    A grpcio server standing in for svc-memory, with Search (and
    SearchMany unless left out, when grpcio itself answers it
    UNIMPLEMENTED).

    @ivar arrived: the method of every call that reached the server, in
        order, attempts at a method it does not have included.
    @ivar entered: each call in its handler: its method and request.
    @ivar gates: a method's set, its calls are answered; cleared, each
        waits in its handler until it is set again or the caller cancels
        (L{hold}, L{release}).
    @ivar cancelled: the methods of the calls whose caller cancelled them
        while they waited.
    @ivar remaining: each call's time left before its deadline, as the
        server saw it on entering.
    @ivar refuseAll: a status every SearchMany call is refused with.
    """

    address: str = ""
    arrived: list[str] = attrs.Factory(list)
    entered: list[tuple[str, Any]] = attrs.Factory(list)
    gates: dict[str, threading.Event] = attrs.Factory(
        lambda: {method: threading.Event() for method in ("Search", "SearchMany")}
    )
    cancelled: list[str] = attrs.Factory(list)
    remaining: list[float | None] = attrs.Factory(list)
    refuseAll: grpc.StatusCode | None = None

    def hold(self, *methods: str) -> None:
        """
        Hold the calls of C{methods} (every method's by default) in their
        handlers from now on.
        """
        for method in methods or tuple(self.gates):
            self.gates[method].clear()

    def release(self, *methods: str) -> None:
        """
        Answer the calls of C{methods} (every method's by default), those
        held and those to come.
        """
        for method in methods or tuple(self.gates):
            self.gates[method].set()

    def searches(self, method: str) -> list[list[str]]:
        """
        The subjects of each call of C{method} that was handled.
        """
        handled: list[list[str]] = []
        for name, request in list(self.entered):
            if name == method:
                requests = request.searches if name == "SearchMany" else [request]
                handled.append(subjects(requests))
        return handled

    def _enter(self, method: str, request: Any, context: grpc.ServicerContext) -> bool:
        """
        Record the call and wait for its method's gate: False if the caller
        cancelled it meanwhile.
        """
        self.remaining.append(context.time_remaining())
        self.entered.append((method, request))
        deadline = time.monotonic() + LIMIT
        while not self.gates[method].wait(0.005):
            if not context.is_active():
                self.cancelled.append(method)
                return False
            if time.monotonic() > deadline:
                break
        return True

    def search(
        self, request: memory_pb2.SearchRequest, context: grpc.ServicerContext
    ) -> memory_pb2.SearchResponse:
        if self._enter("Search", request, context):
            refusal = refusalFor(request)
            if refusal is not None:
                context.abort(*refusal)
        return answerTo(request)

    def searchMany(
        self, request: memory_pb2.SearchManyRequest, context: grpc.ServicerContext
    ) -> memory_pb2.SearchManyResponse:
        answer = memory_pb2.SearchManyResponse()
        if not self._enter("SearchMany", request, context):
            return answer
        if self.refuseAll is not None:
            context.abort(self.refuseAll, "refused whole")
        for search in request.searches:
            outcome = answer.outcomes.add()
            refusal = refusalFor(search)
            if refusal is None:
                outcome.response.CopyFrom(answerTo(search))
            else:
                outcome.code, outcome.details = refusal[0].value[0], refusal[1]
        return answer


class _Arrivals(grpc.ServerInterceptor):  # type: ignore[misc]
    """
    Records each call's method as it reaches the server, before grpcio
    looks for its handler (so that a method the server lacks is counted).
    """

    def __init__(self, arrived: list[str]) -> None:
        self._arrived = arrived

    def intercept_service(self, continuation: Any, details: Any) -> Any:
        self._arrived.append(details.method.rsplit("/", 1)[-1])
        return continuation(details)


@contextlib.contextmanager
def scriptedMemory(withSearchMany: bool = True) -> Iterator[ScriptedMemory]:
    """
    A L{ScriptedMemory} listening on a free loopback port, answering.
    """
    scripted = ScriptedMemory()
    scripted.release()
    methods = {
        "Search": grpc.unary_unary_rpc_method_handler(
            scripted.search,
            request_deserializer=memory_pb2.SearchRequest.FromString,
            response_serializer=memory_pb2.SearchResponse.SerializeToString,
        )
    }
    if withSearchMany:
        methods["SearchMany"] = grpc.unary_unary_rpc_method_handler(
            scripted.searchMany,
            request_deserializer=memory_pb2.SearchManyRequest.FromString,
            response_serializer=memory_pb2.SearchManyResponse.SerializeToString,
        )
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=16),
        interceptors=[_Arrivals(scripted.arrived)],
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, methods),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    scripted.address = f"127.0.0.1:{port}"
    try:
        yield scripted
    finally:
        scripted.release()
        server.stop(0).wait(5)


@pytest.fixture
def scripted() -> Iterator[ScriptedMemory]:
    with scriptedMemory() as made:
        yield made


@pytest.fixture
def scriptedClient(scripted: ScriptedMemory) -> Iterator[MemoryClient]:
    client = clientOf(scripted.address, timeout=30.0)
    try:
        yield client
    finally:
        client.close()


def searchOf(
    batches: SearchBatches, tenant: Tenant, subject: str, timeout: float | None = None
) -> Deferred[memory_pb2.SearchResponse]:
    return batches.search(scopeOf(tenant, subject), embedding([1.0]), k=1, timeout=timeout)


@pytest_twisted.ensureDeferred
async def test_refusalsInABatchAreMemoryClientsExceptions(
    scripted: ScriptedMemory, scriptedClient: MemoryClient, acme: Tenant
) -> None:
    """
    Each status a SearchMany outcome can carry fails its search with the
    exception, code and details MemoryClient.search fails with when Search
    answers the same status: NOT_FOUND, svc-memory's PERMISSION_DENIED,
    FAILED_PRECONDITION, INVALID_ARGUMENT, and the others (UNAVAILABLE,
    INTERNAL, UNKNOWN...) as MemoryUnavailable; the searches between them
    are answered.
    """
    from twisted.internet import reactor

    numbers = [5, 7, 9, 3, 14, 13, 2, 8]
    expected: list[tuple[type[BaseException], Any, str]] = []
    for number in numbers:
        alone = await refusedBy(scriptedClient.search(scopeOf(acme, f"refuse-{number}"), None, 1))
        assert isinstance(alone, MemoryCallFailed)
        expected.append((type(alone), alone.code, alone.details))
    assert [kind for kind, _, _ in expected[:4]] == [
        MemoryNotFound,
        MemoryForbidden,
        MemoryFull,
        MemoryInvalid,
    ]
    assert {kind for kind, _, _ in expected[4:]} == {MemoryUnavailable}

    del scripted.entered[:]
    scripted.hold("Search")
    batches = SearchBatches(scriptedClient, reactor)
    first = searchOf(batches, acme, "first")
    asked = [subject for number in numbers for subject in (f"refuse-{number}", f"ok-{number}")]
    held = [searchOf(batches, acme, subject) for subject in asked]
    scripted.release("Search")
    assert contents(await settled(first)) == ["answer to first"]
    for subject, result in zip(asked, held, strict=True):
        if subject.startswith("ok-"):
            assert contents(await settled(result)) == [f"answer to {subject}"]
        else:
            error = await refusedBy(result)
            assert isinstance(error, MemoryCallFailed)
            assert (type(error), error.code, error.details) == expected[
                numbers.index(int(subject.removeprefix("refuse-")))
            ]
    assert scripted.searches("SearchMany") == [asked]


@pytest_twisted.ensureDeferred
async def test_aFailedSearchManyFailsEachOfItsSearches(
    scripted: ScriptedMemory, scriptedClient: MemoryClient, acme: Tenant
) -> None:
    """
    A SearchMany refused as a whole (RESOURCE_EXHAUSTED: svc-memory past
    its bound on calls) fails every search it carried with that status as
    L{MemoryUnavailable}; the organization's next search is sent at once.
    """
    from twisted.internet import reactor

    scripted.refuseAll = grpc.StatusCode.RESOURCE_EXHAUSTED
    scripted.hold("Search")
    batches = SearchBatches(scriptedClient, reactor)
    first = searchOf(batches, acme, "first")
    held = [searchOf(batches, acme, f"held-{n}") for n in range(3)]
    scripted.release("Search")
    assert contents(await settled(first)) == ["answer to first"]
    for result in held:
        error = await refusedBy(result)
        assert isinstance(error, MemoryUnavailable)
        assert error.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert contents(await settled(searchOf(batches, acme, "after"))) == ["answer to after"]
    assert scripted.arrived == ["Search", "SearchMany", "Search"]


@pytest_twisted.ensureDeferred
async def test_aHeldSearchCancelledIsNeverSent(
    scripted: ScriptedMemory, scriptedClient: MemoryClient, acme: Tenant
) -> None:
    """
    A search held behind the organization's call in flight, cancelled:
    its Deferred fails with CancelledError at once, and it is never sent;
    the other held one goes (alone, so as a Search) when the first ends.
    """
    from twisted.internet import reactor

    scripted.hold("Search")
    batches = SearchBatches(scriptedClient, reactor)
    first = searchOf(batches, acme, "first")
    second = searchOf(batches, acme, "second")
    third = searchOf(batches, acme, "third")
    second.cancel()
    failedAlready(second, CancelledError)
    await waitFor(lambda: len(scripted.entered) == 1)
    scripted.release("Search")
    assert contents(await settled(first)) == ["answer to first"]
    assert contents(await settled(third)) == ["answer to third"]
    assert scripted.arrived == ["Search", "Search"]
    assert scripted.searches("Search") == [["first"], ["third"]]


@pytest_twisted.ensureDeferred
async def test_aSearchCancelledInASharedCallLeavesTheOthersTheirAnswers(
    scripted: ScriptedMemory, scriptedClient: MemoryClient, acme: Tenant
) -> None:
    """
    Three searches in one SearchMany, in flight at the server; one of
    them cancelled fails with CancelledError at once, and the call goes
    on (the server does not see it cancelled): the two others get their
    own answers when it ends.
    """
    from twisted.internet import reactor

    scripted.hold()
    batches = SearchBatches(scriptedClient, reactor)
    first = searchOf(batches, acme, "first")
    shared = [searchOf(batches, acme, subject) for subject in ("a", "b", "c")]
    await waitFor(lambda: len(scripted.entered) == 1)
    scripted.release("Search")
    assert contents(await settled(first)) == ["answer to first"]
    await waitFor(lambda: len(scripted.entered) == 2)
    assert scripted.searches("SearchMany") == [["a", "b", "c"]]
    assert not any(result.called for result in shared)
    shared[1].cancel()
    failedAlready(shared[1], CancelledError)
    scripted.release("SearchMany")
    assert contents(await settled(shared[0])) == ["answer to a"]
    assert contents(await settled(shared[2])) == ["answer to c"]
    assert scripted.cancelled == []
    assert scripted.arrived == ["Search", "SearchMany"]


@pytest_twisted.ensureDeferred
async def test_whenEverySearchOfACallIsCancelledTheCallIsCancelled(
    scripted: ScriptedMemory, scriptedClient: MemoryClient, acme: Tenant
) -> None:
    """
    Every search of a SearchMany in flight cancelled, one after the
    other: each fails CancelledError at once, the call goes on while one
    is left, and the last one's cancellation cancels the call (the server
    sees it cancelled). The organization then has no call in flight: its
    next search is sent at once, alone.
    """
    from twisted.internet import reactor

    batches = SearchBatches(scriptedClient, reactor)
    scripted.hold()
    first = searchOf(batches, acme, "first")
    shared = [searchOf(batches, acme, subject) for subject in ("a", "b")]
    await waitFor(lambda: len(scripted.entered) == 1)
    scripted.release("Search")
    assert contents(await settled(first)) == ["answer to first"]
    await waitFor(lambda: len(scripted.entered) == 2)
    shared[0].cancel()
    failedAlready(shared[0], CancelledError)
    # The call goes on for "b": a cancelled call would have failed it
    # (CancelledError) at once, on this very turn.
    assert not shared[1].called
    shared[1].cancel()
    failedAlready(shared[1], CancelledError)
    await waitFor(lambda: scripted.cancelled == ["SearchMany"])
    after = searchOf(batches, acme, "after")
    assert contents(await settled(after)) == ["answer to after"]
    assert scripted.arrived == ["Search", "SearchMany", "Search"]
    assert scripted.searches("Search") == [["first"], ["after"]]


@pytest_twisted.ensureDeferred
async def test_aHeldSearchPastItsDeadlineIsNotSent(
    scripted: ScriptedMemory, scriptedClient: MemoryClient, acme: Tenant
) -> None:
    """
    On SearchBatches' clock (a Clock the test advances), two searches held
    while the first call hangs: one with a 0.3 s deadline, one with 30 s.
    The first fails L{MemoryUnavailable} at its deadline, while the call
    it waited for still hangs, and is never sent; the other is sent, alone
    (a Search), when that call ends, with what is left of its deadline (29
    s of 30, one second having passed).
    """
    clock = Clock()
    batches = SearchBatches(scriptedClient, clock)
    scripted.hold("Search")
    first = searchOf(batches, acme, "first", timeout=30.0)
    late = searchOf(batches, acme, "late", timeout=0.3)
    patient = searchOf(batches, acme, "patient", timeout=30.0)
    await waitFor(lambda: len(scripted.entered) == 1)
    clock.advance(0.2)
    assert [late.called, first.called] == [False, False]
    # At its deadline, though the call it waits for still hangs.
    clock.advance(0.8)
    assert [late.called, first.called] == [True, False]
    scripted.release("Search")
    assert contents(await settled(first)) == ["answer to first"]
    error = await refusedBy(late)
    assert isinstance(error, MemoryUnavailable)
    assert error.code is grpc.StatusCode.DEADLINE_EXCEEDED and "deadline" in error.details
    assert contents(await settled(patient)) == ["answer to patient"]
    assert scripted.arrived == ["Search", "Search"]
    assert scripted.searches("Search") == [["first"], ["patient"]]
    sentWith = scripted.remaining[1]
    # grpcio sends a deadline rounded up, by as much as 0.1 s (the first
    # call's 30 s arrive as 29.99 or 30.09): 29.5 tells 29 s from 30.
    assert sentWith is not None and 20.0 < sentWith < 29.5


@pytest_twisted.ensureDeferred
async def test_withoutSearchManyEachSearchGoesAlone(acme: Tenant) -> None:
    """
    An svc-memory of an earlier release (grpcio answers its SearchMany
    UNIMPLEMENTED): the held searches are answered all the same, sent
    again one Search each. For retryBatchesAfter (60 s on SearchBatches'
    clock) a later batch goes one Search each without SearchMany being
    tried; after it, SearchMany is tried again (and refused again).
    """
    clock = Clock()
    with scriptedMemory(withSearchMany=False) as scripted:
        client = clientOf(scripted.address, timeout=30.0)
        try:
            batches = SearchBatches(client, clock, retryBatchesAfter=60.0)

            async def pileUp(turn: str) -> None:
                # One search in flight (held at the server), two held
                # behind it; all answered once the server answers.
                scripted.hold("Search")
                before = len(scripted.entered)
                first = searchOf(batches, acme, f"{turn}-first")
                held = [searchOf(batches, acme, f"{turn}-{n}") for n in range(2)]
                await waitFor(lambda: len(scripted.entered) == before + 1)
                scripted.release("Search")
                for subject, result in zip(("first", "0", "1"), [first, *held], strict=True):
                    assert contents(await settled(result)) == [f"answer to {turn}-{subject}"]

            await pileUp("one")
            assert scripted.arrived == ["Search", "SearchMany", "Search", "Search"]
            clock.advance(59.0)
            await pileUp("two")
            assert scripted.arrived[4:] == ["Search", "Search", "Search"]
            clock.advance(2.0)
            await pileUp("three")
            assert scripted.arrived[7:] == ["Search", "SearchMany", "Search", "Search"]
            assert sorted(
                subject for call in scripted.searches("Search") for subject in call
            ) == sorted(
                f"{turn}-{subject}"
                for turn in ("one", "two", "three")
                for subject in ("first", "0", "1")
            )
        finally:
            client.close()
