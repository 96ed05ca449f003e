"""
Memory settings in svc-proxy (decisions D13, "Settings", and D13 amended,
"Whose words"): the limit book's L{LimitBook.memoryFor} (the agent's
setting wins over its organization's, both off by default, no
allocation; observe one of on, all and off), the settings off the wire
(an svc-auth of the previous release sends only the switch), the
request header C{X-SVC-Memory} (only C{off}), and the whole way from
svcctl to a running proxy: a real PostgreSQL, a real svc-auth and a proxy
assembled as the daemon is, learning from the change feed within one
second, and from validation answers when it has no feed.
"""

from __future__ import annotations

import datetime
import json
import time
import tracemalloc
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import pytest_twisted
from authfixtures import Tenant, makeTenant
from authhelpers import document, svcctl
from authservice import RunningAuthService
from limitshelpers import AGENT_ID, ORG_ID, waitFor
from proxydoubles import MemoryCounters
from treq.testing import StubTreq
from twisted.internet import threads
from twisted.web.resource import Resource
from twisted.web.server import Request
from twisted.web.test.requesthelper import DummyChannel

import svcd.limits.book
from svcd.auth.store import Store
from svcd.authclient.feed import memorySettingsFromProto, memorySettingsRowOf, rowOf
from svcd.common.errors import ApiError, envelope
from svcd.limits.book import MEMORY_OFF, BudgetRow, LimitBook, LimitsRow, MemorySettingsRow
from svcd.limits.records import Budget, Limits, MemorySettings
from svcd.pb.auth.v1 import auth_pb2
from svcd.proxy.assembly import ProxyDaemon, assembleProxy
from svcd.proxy.config import ProxyConfig
from svcd.proxy.memoryheaders import (
    MEMORY_HEADER,
    MEMORY_SUBJECT_HEADER,
    chatMemory,
    requestMemory,
)

OTHER_AGENT = str(uuid.uuid4())
ON, OFF, INHERIT = True, False, None
# The observe modes (decisions D13 amended).
OBS_ON, OBS_ALL, OBS_OFF = "on", "all", "off"


def bookWith(*rows: MemorySettingsRow) -> LimitBook:
    book = LimitBook()
    book.replace(rows)
    return book


def test_withoutSettingsMemoryIsOff() -> None:
    """
    An empty book, or one holding only limits and budgets, answers the
    shared (False, "off") for every organization and agent.
    """
    assert LimitBook().memoryFor(ORG_ID, AGENT_ID) is MEMORY_OFF
    assert LimitBook().memoryFor(ORG_ID, None) is MEMORY_OFF
    book = LimitBook()
    book.replace(
        [
            LimitsRow(ORG_ID, None, Limits(rpm=1)),
            BudgetRow(ORG_ID, AGENT_ID, Budget(nanoUSD=5, period="day")),
        ]
    )
    assert book.memoryFor(ORG_ID, AGENT_ID) == (False, OBS_OFF)
    assert MEMORY_OFF == (False, OBS_OFF)


@pytest.mark.parametrize(
    "org, agent, expected",
    [
        # Nothing set: off.
        (None, None, (False, OBS_OFF)),
        ((INHERIT, INHERIT), (INHERIT, INHERIT), (False, OBS_OFF)),
        # The organization's, for every agent that inherits.
        ((ON, OBS_OFF), None, (True, OBS_OFF)),
        ((OFF, OBS_ON), (INHERIT, INHERIT), (False, OBS_ON)),
        ((OFF, OBS_ALL), (INHERIT, INHERIT), (False, OBS_ALL)),
        ((ON, OBS_ON), (INHERIT, OBS_OFF), (True, OBS_OFF)),
        # The agent's wins over its organization's, each setting alone.
        ((ON, OBS_ON), (OFF, OBS_OFF), (False, OBS_OFF)),
        ((OFF, OBS_OFF), (ON, OBS_ON), (True, OBS_ON)),
        ((OFF, OBS_ALL), (ON, OBS_ON), (True, OBS_ON)),
        ((OFF, OBS_ON), (ON, OBS_ALL), (True, OBS_ALL)),
        ((OFF, INHERIT), (ON, INHERIT), (True, OBS_OFF)),
        (None, (INHERIT, OBS_ON), (False, OBS_ON)),
        (None, (INHERIT, OBS_ALL), (False, OBS_ALL)),
        ((INHERIT, INHERIT), (ON, OBS_OFF), (True, OBS_OFF)),
    ],
)
def test_theAgentsSettingWinsOverItsOrganizations(
    org: tuple[bool | None, str | None] | None,
    agent: tuple[bool | None, str | None] | None,
    expected: tuple[bool, str],
) -> None:
    """
    Each switch is the agent's when it has one, else its organization's,
    else off; another agent of the organization, and the organization's
    requests without an agent, see the organization's alone.
    """
    rows = []
    if org is not None:
        rows.append(MemorySettingsRow(ORG_ID, None, MemorySettings(*org)))
    if agent is not None:
        rows.append(MemorySettingsRow(ORG_ID, AGENT_ID, MemorySettings(*agent)))
    book = bookWith(*rows)
    assert book.memoryFor(ORG_ID, AGENT_ID) == expected
    ofOrg = (org[0] is True, org[1] or OBS_OFF) if org is not None else (False, OBS_OFF)
    assert book.memoryFor(ORG_ID, OTHER_AGENT) == ofOrg
    assert book.memoryFor(ORG_ID, None) == ofOrg
    # Another organization's agent of the same id learns nothing of these.
    assert book.memoryFor(str(uuid.uuid4()), AGENT_ID) == (False, OBS_OFF)


def test_changesSetReplaceAndClear() -> None:
    """
    A change sets, replaces or clears one row; a row whose switches all
    inherit is forgotten like a cleared one, so that a book of such rows
    takes the shortcut of an empty one; a new snapshot is all there is.
    """
    book = LimitBook()
    book.changed(MemorySettingsRow(ORG_ID, AGENT_ID, MemorySettings(recall=True)))
    assert book.memoryFor(ORG_ID, AGENT_ID) == (True, OBS_OFF)
    assert len(book) == 1
    book.changed(MemorySettingsRow(ORG_ID, None, MemorySettings(observe=OBS_ALL)))
    assert book.memoryFor(ORG_ID, AGENT_ID) == (True, OBS_ALL)
    book.changed(MemorySettingsRow(ORG_ID, AGENT_ID, MemorySettings(None, None, version=9)))
    assert book.memoryFor(ORG_ID, AGENT_ID) == (False, OBS_ALL)
    book.changed(MemorySettingsRow(ORG_ID, None, None))
    assert book.memoryFor(ORG_ID, AGENT_ID) is MEMORY_OFF
    assert len(book) == 0
    book.changed(MemorySettingsRow(ORG_ID, AGENT_ID, MemorySettings(recall=True)))
    book.replace([MemorySettingsRow(ORG_ID, OTHER_AGENT, MemorySettings(observe=OBS_ON))])
    assert book.memoryFor(ORG_ID, AGENT_ID) == (False, OBS_OFF)
    assert book.memoryFor(ORG_ID, OTHER_AGENT) == (False, OBS_ON)
    book.replace([])
    assert len(book) == 0


def test_answersAreLearnedOnlyWithoutALiveFeed() -> None:
    """
    While the feed is live its rows rule, so an answer read before a
    change cannot undo it; without one, each answer's settings are taken,
    and an answer without settings clears them.
    """
    book = LimitBook()
    live = [True]
    book.feedLive = lambda: live[0]
    book.learnOrg(ORG_ID, None, None, MemorySettings(recall=True))
    book.learnAgent(ORG_ID, AGENT_ID, None, None, MemorySettings(observe=OBS_ON))
    assert book.memoryFor(ORG_ID, AGENT_ID) is MEMORY_OFF
    live[0] = False
    book.learnOrg(ORG_ID, None, None, MemorySettings(recall=True))
    book.learnAgent(ORG_ID, AGENT_ID, None, None, MemorySettings(observe=OBS_ON))
    assert book.memoryFor(ORG_ID, AGENT_ID) == (True, OBS_ON)
    book.learnAgent(ORG_ID, AGENT_ID, None, None, MemorySettings(recall=False))
    assert book.memoryFor(ORG_ID, AGENT_ID) == (False, OBS_OFF)
    book.learnAgent(ORG_ID, AGENT_ID, None, None, None)
    assert book.memoryFor(ORG_ID, AGENT_ID) == (True, OBS_OFF)
    book.learnOrg(ORG_ID, None)
    assert book.memoryFor(ORG_ID, AGENT_ID) is MEMORY_OFF


def allocatedBy(function: Callable[[], object], times: int = 2000) -> int:
    """
    The memory blocks still held, made by lines of svcd/limits/book.py,
    after calling C{function} C{times} times (tracemalloc's count).
    """
    function()
    filters = [tracemalloc.Filter(True, svcd.limits.book.__file__)]
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot().filter_traces(filters)
        kept = [function() for _ in range(times)]
        after = tracemalloc.take_snapshot().filter_traces(filters)
    finally:
        tracemalloc.stop()
    del kept
    return sum(each.count_diff for each in after.compare_to(before, "filename") if each.count_diff)


def test_aLookupAllocatesNothing() -> None:
    """
    memoryFor, called on every chat request, makes nothing the caller
    keeps: its answers are shared tuples, whether the book is empty or
    holds the organization's and the agent's rows.
    """
    empty = LimitBook()
    assert allocatedBy(lambda: empty.memoryFor(ORG_ID, AGENT_ID)) == 0
    full = bookWith(
        MemorySettingsRow(ORG_ID, None, MemorySettings(recall=True, observe=OBS_OFF)),
        MemorySettingsRow(ORG_ID, AGENT_ID, MemorySettings(observe=OBS_ALL)),
    )
    assert full.memoryFor(ORG_ID, AGENT_ID) == (True, OBS_ALL)
    assert allocatedBy(lambda: full.memoryFor(ORG_ID, AGENT_ID)) == 0
    assert allocatedBy(lambda: full.memoryFor(ORG_ID, OTHER_AGENT)) == 0
    assert full.memoryFor(ORG_ID, AGENT_ID) is full.memoryFor(ORG_ID, AGENT_ID)


def test_settingsOffTheWire() -> None:
    """
    A switch absent on the wire inherits (None); present, it is on or
    off. The observe mode is observe_mode's; without it (an svc-auth of
    the previous release), the switch observe's true is on (decisions D13
    amended: never all), its false off; a mode this proxy does not know
    is off. A message whose ids are not 16 bytes is no row at all, and
    one without settings clears the row.
    """
    org, agent = uuid.uuid4(), uuid.uuid4()
    assert memorySettingsFromProto(auth_pb2.MemorySettings(version=4)) == MemorySettings(
        None, None, 4
    )
    for switch, mode, expected in [
        (True, "", OBS_ON),
        (False, "", OBS_OFF),
        (None, "", None),
        (True, "on", OBS_ON),
        (True, "all", OBS_ALL),
        (False, "off", OBS_OFF),
        (None, "all", OBS_ALL),
        (True, "everyone", OBS_OFF),
    ]:
        message = auth_pb2.MemorySettings(recall=False, observe_mode=mode, version=5)
        if switch is not None:
            message.observe = switch
        assert memorySettingsFromProto(message) == MemorySettings(False, expected, 5), message
    change = auth_pb2.Change(
        memory_settings_changed=auth_pb2.MemorySettingsChanged(
            org_id=org.bytes,
            agent_id=agent.bytes,
            settings=auth_pb2.MemorySettings(recall=True, version=6),
        )
    )
    assert rowOf(change) == MemorySettingsRow(str(org), str(agent), MemorySettings(True, None, 6))
    cleared = auth_pb2.MemorySettingsChanged(org_id=org.bytes)
    assert memorySettingsRowOf(cleared) == MemorySettingsRow(str(org), None, None)
    assert memorySettingsRowOf(auth_pb2.MemorySettingsChanged(org_id=b"short")) is None
    assert (
        memorySettingsRowOf(auth_pb2.MemorySettingsChanged(org_id=org.bytes, agent_id=b"x")) is None
    )


class MemoryProbe(Resource):
    """
    Answers what L{requestMemory} says of each request, or its refusal's
    status and envelope, as the chat route will.
    """

    isLeaf = True

    def __init__(self, book: LimitBook) -> None:
        super().__init__()
        self._book = book

    def render_GET(self, request: Request) -> bytes:
        try:
            recall, observe = requestMemory(request, self._book, ORG_ID, AGENT_ID)
        except ApiError as error:
            request.setResponseCode(error.status)
            body = envelope(error, requestID="probe", now=datetime.datetime.now(datetime.UTC))
            return json.dumps(body).encode()
        return json.dumps({"recall": recall, "observe": observe}).encode()


async def probe(book: LimitBook, *values: str) -> tuple[int, Any]:
    """
    One request through real HTTP parsing (StubTreq), with each of
    C{values} as an C{X-SVC-Memory} header line.
    """
    stub = StubTreq(MemoryProbe(book))
    headers = {MEMORY_HEADER: list(values)} if values else {}
    # StubTreq sets get() and the others in its __init__; treq's types do
    # not declare them.
    response = await stub.get("http://proxy.test/", headers=headers)  # type: ignore[attr-defined]
    return response.code, json.loads(await response.content())


@pytest_twisted.ensureDeferred
async def test_theHeaderTurnsBothOffForTheRequest() -> None:
    """
    Without the header, a request has its agent's and organization's
    settings; with X-SVC-Memory: off (any case, surrounding spaces
    allowed), both are off for it, whatever the settings.
    """
    book = bookWith(
        MemorySettingsRow(ORG_ID, None, MemorySettings(recall=True)),
        MemorySettingsRow(ORG_ID, AGENT_ID, MemorySettings(observe=OBS_ON)),
    )
    assert await probe(book) == (200, {"recall": True, "observe": OBS_ON})
    for value in ("off", "OFF", "Off", " off "):
        assert await probe(book, value) == (200, {"recall": False, "observe": OBS_OFF}), value
    assert await probe(LimitBook(), "off") == (200, {"recall": False, "observe": OBS_OFF})


@pytest.mark.parametrize(
    "values",
    [("on",), ("true",), ("0",), ("",), ("off, off",), ("off", "off"), ("off", "on"), ("of",)],
)
@pytest_twisted.ensureDeferred
async def test_anyOtherValueIsRefusedNamingTheHeader(values: tuple[str, ...]) -> None:
    """
    Only off is valid: any other value (on included: a request cannot turn
    on what its settings have off), an empty one, or the header given
    twice is 400 VALIDATION_ERROR with a field error naming the header.
    """
    book = bookWith(MemorySettingsRow(ORG_ID, None, MemorySettings(recall=True)))
    status, body = await probe(book, *values)
    assert status == 400
    assert body["error"]["code"] == "VALIDATION_ERROR"
    assert body["error"]["field_errors"] == [
        {"field": "X-SVC-Memory", "code": "INVALID_ENUM", "message": "must be off when given"}
    ]


def chatRequest(memory: list[bytes], subject: list[bytes]) -> Request:
    """
    A request with these X-SVC-Memory and X-SVC-Memory-Subject lines.
    """
    request = Request(DummyChannel())
    if memory:
        request.requestHeaders.setRawHeaders(MEMORY_HEADER.encode(), memory)
    if subject:
        request.requestHeaders.setRawHeaders(MEMORY_SUBJECT_HEADER.encode(), subject)
    return request


def test_aChatReadsItsMemoryHeadersInOnePlace() -> None:
    """
    L{chatMemory}, which the recall's plan and the observation's read: the
    settings as L{requestMemory} gives them and the subject; a bad
    X-SVC-Memory is the refusal whatever the subject, and a bad subject
    is refused even with memory off for the request.
    """
    book = bookWith(MemorySettingsRow(ORG_ID, None, MemorySettings(recall=True, observe=OBS_ALL)))
    assert chatMemory(chatRequest([], []), book, ORG_ID, AGENT_ID) == (True, OBS_ALL, "")
    assert chatMemory(chatRequest([], [b"user-1"]), book, ORG_ID, AGENT_ID) == (
        True,
        OBS_ALL,
        "user-1",
    )
    assert chatMemory(chatRequest([b"off"], [b"user-1"]), book, ORG_ID, AGENT_ID) == (
        False,
        OBS_OFF,
        "user-1",
    )
    with pytest.raises(ApiError) as bothBad:
        chatMemory(chatRequest([b"on"], [b"no spaces"]), book, ORG_ID, AGENT_ID)
    assert [each.field for each in bothBad.value.fieldErrors] == [MEMORY_HEADER]
    with pytest.raises(ApiError) as subjectBad:
        chatMemory(chatRequest([b"off"], [b""]), book, ORG_ID, AGENT_ID)
    assert [each.field for each in subjectBad.value.fieldErrors] == [MEMORY_SUBJECT_HEADER]


# The whole way: svcctl, PostgreSQL, svc-auth, the proxy.


@pytest_twisted.async_yield_fixture
async def proxies(authService: RunningAuthService) -> AsyncIterator[tuple[ProxyDaemon, ...]]:
    """
    Two proxies assembled as the daemon is, on svc-auth: one with the
    validation cache and so the change feed, one without (SVC_AUTH_CACHE_SIZE=0,
    no feed: it learns from its validation answers). Both listen once
    their dependencies are ready (the first, once the feed's snapshot has
    arrived).
    """
    from twisted.internet import reactor

    made = []
    for cacheSize in (100_000, 0):
        config = ProxyConfig(
            authGrpcAddr=f"127.0.0.1:{authService.port}",
            host="127.0.0.1",
            port=0,
            authCacheSize=cacheSize,
            # A loaded machine: these tests are about settings, not deadlines.
            validateTimeout=2.0,
            shutdownTimeout=1.0,
        )
        made.append(assembleProxy(config, reactor, counters=MemoryCounters()))
    for daemon in made:
        daemon.service.startService()
    for daemon in made:
        await daemon.service.whenListening()
    yield tuple(made)
    for daemon in made:
        await daemon.service.stopService()


async def memorySettings(dsn: str, *arguments: str) -> dict[str, Any]:
    """
    Run svcctl memory settings off the reactor thread (the feed's messages
    are applied on it meanwhile) and return what it printed.
    """
    result = await threads.deferToThread(svcctl, dsn, "memory", "settings", *arguments)
    printed: dict[str, Any] = document(result)
    return printed


@pytest_twisted.ensureDeferred
async def test_aSettingMadeWithSvcctlReachesARunningProxyWithinOneSecond(
    proxies: tuple[ProxyDaemon, ...], owner: Store, migratedDSN: str
) -> None:
    """
    With its change feed live, a proxy has each setting made with svcctl
    within one second of svcctl's answer, without a single request: the
    organization's, then the agent's winning over it, then each switch
    given back to inheritance.
    """
    withFeed, _ = proxies
    book = withFeed.limitBook
    assert book.feedLive()
    tenant = makeTenant(owner)
    org, agent = str(tenant.orgID), str(tenant.agentID)
    assert book.memoryFor(org, agent) == (False, OBS_OFF)
    steps: list[tuple[tuple[str, ...], tuple[bool, str]]] = [
        (("--org", org, "--recall", "on"), (True, OBS_OFF)),
        (("--org", org, "--agent", agent, "--observe", "on"), (True, OBS_ON)),
        (("--org", org, "--agent", agent, "--recall", "off"), (False, OBS_ON)),
        (("--org", org, "--agent", agent, "--observe", "all"), (False, OBS_ALL)),
        (("--org", org, "--recall", "inherit", "--observe", "on"), (False, OBS_ALL)),
        (("--org", org, "--agent", agent, "--recall", "inherit"), (False, OBS_ALL)),
        (("--org", org, "--agent", agent, "--observe", "inherit"), (False, OBS_ON)),
        (("--org", org, "--observe", "inherit"), (False, OBS_OFF)),
    ]
    for arguments, expected in steps:
        await memorySettings(migratedDSN, *arguments)
        began = time.monotonic()
        await waitFor(lambda: book.memoryFor(org, agent) == expected, 1.0)  # noqa: B023
        assert time.monotonic() - began < 1.0
    # Another organization's agent of the same id never has these.
    other = makeTenant(owner, "other")
    await memorySettings(migratedDSN, "--org", str(other.orgID), "--recall", "on")
    await waitFor(lambda: book.memoryFor(str(other.orgID), None) == (True, OBS_OFF), 1.0)
    assert book.memoryFor(org, agent) == (False, OBS_OFF)
    assert book.memoryFor(str(other.orgID), agent) == (True, OBS_OFF)


@pytest_twisted.ensureDeferred
async def test_settingsAtTheFeedsStartAreKnownAtOnce(
    authService: RunningAuthService, owner: Store, migratedDSN: str
) -> None:
    """
    A proxy that starts after the settings were made has them from its
    feed's first snapshot, before it listens.
    """
    from twisted.internet import reactor

    tenant = makeTenant(owner)
    org, agent = str(tenant.orgID), str(tenant.agentID)
    await memorySettings(migratedDSN, "--org", org, "--observe", "on")
    await memorySettings(migratedDSN, "--org", org, "--agent", agent, "--recall", "on")
    await waitFor(lambda: len(authService.memorySettings.rows()) == 2, 1.0)
    config = ProxyConfig(authGrpcAddr=f"127.0.0.1:{authService.port}", host="127.0.0.1", port=0)
    daemon = assembleProxy(config, reactor, counters=MemoryCounters())
    daemon.service.startService()
    try:
        await daemon.service.whenListening()
        assert daemon.limitBook.feedLive()
        assert daemon.limitBook.memoryFor(org, agent) == (True, OBS_ON)
        assert daemon.limitBook.memoryFor(org, None) == (False, OBS_ON)
    finally:
        await daemon.service.stopService()


async def validated(daemon: ProxyDaemon, tenant: Tenant) -> None:
    """
    Validate the tenant's token and agent through the proxy's own client
    to svc-auth, as a request does.
    """
    await daemon.auth.validateToken(tenant.token)
    await daemon.auth.validateAgent(tenant.token, str(tenant.agentID), str(tenant.orgID))


@pytest_twisted.ensureDeferred
async def test_withoutAFeedSettingsAreLearnedFromValidationAnswers(
    proxies: tuple[ProxyDaemon, ...], owner: Store, migratedDSN: str
) -> None:
    """
    A proxy without the change feed learns the organization's settings
    from ValidateToken answers and the agent's from ValidateAgent answers,
    as svc-auth has them when it answers; the agent's still win, and
    inherit falls back to the organization's.
    """
    _, withoutFeed = proxies
    book = withoutFeed.limitBook
    assert not book.feedLive()
    tenant = makeTenant(owner)
    org, agent = str(tenant.orgID), str(tenant.agentID)
    await validated(withoutFeed, tenant)
    assert book.memoryFor(org, agent) == (False, OBS_OFF)
    steps: list[tuple[tuple[str, ...], tuple[bool, str]]] = [
        (("--org", org, "--recall", "on", "--observe", "on"), (True, OBS_ON)),
        (("--org", org, "--agent", agent, "--observe", "off"), (True, OBS_OFF)),
        (("--org", org, "--agent", agent, "--observe", "all"), (True, OBS_ALL)),
        (("--org", org, "--agent", agent, "--observe", "inherit"), (True, OBS_ON)),
        (("--org", org, "--recall", "off", "--observe", "inherit"), (False, OBS_OFF)),
    ]
    for arguments, expected in steps:
        await memorySettings(migratedDSN, *arguments)

        async def learned() -> bool:
            await validated(withoutFeed, tenant)
            return book.memoryFor(org, agent) == expected  # noqa: B023

        deadline = time.monotonic() + 1.0
        while not await learned():
            assert time.monotonic() < deadline, f"{expected} not learned within 1 s"
