"""
What the memory routes read (decisions D13), as units: the bodies of
adding, changing and searching (svcd/proxy/http/memorybody.py), the list's
query, a memory id of a path, the X-SVC-Memory-Subject header
(svcd/proxy/http/steps.py) and the memory as answered (never its vector).
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from twisted.web.http_headers import Headers
from twisted.web.server import Request
from twisted.web.test.requesthelper import DummyChannel

from svcd.common.errors import ApiError, ErrorCode
from svcd.memoryclient.records import ObservedMessage, Scope
from svcd.pb.memory.v1 import memory_pb2
from svcd.proxy.http.memorybody import (
    Conversation,
    MemoryChange,
    MemoryPage,
    MemorySearch,
    NewMemory,
    memoryJSON,
    parseAddBody,
    parseListQuery,
    parseMemoryID,
    parsePatchBody,
    parseSearchBody,
)
from svcd.proxy.http.routes.memories import conversationKey
from svcd.proxy.memoryheaders import MEMORY_SUBJECT_HEADER, memorySubject

PINNED_CONVERSATION_KEY = (
    "conversation:bab197f2d4038a46c923c04b3ff3ac640e051e0ba10024b762bdc3639156b85a"
)


def body(document: object) -> bytes:
    return json.dumps(document).encode()


def fieldErrors(raised: pytest.ExceptionInfo[ApiError]) -> list[tuple[str, str]]:
    assert raised.value.code is ErrorCode.VALIDATION_ERROR
    return [(each.field, each.code.value) for each in raised.value.fieldErrors]


def refused(parse: Any, document: object) -> list[tuple[str, str]]:
    with pytest.raises(ApiError) as raised:
        parse(body(document))
    return fieldErrors(raised)


# Adding


def test_aContentIsTrimmedWithItsMetadataCompact() -> None:
    """
    A content is kept trimmed; metadata as compact JSON ({} without it, or
    with null).
    """
    assert parseAddBody(body({"content": "  likes tea \n", "metadata": {"a": [1, 2]}})) == (
        NewMemory("likes tea", '{"a":[1,2]}')
    )
    assert parseAddBody(body({"content": "x", "metadata": None})) == NewMemory("x", "{}")


@pytest.mark.parametrize(
    ("document", "errors"),
    [
        ({}, [("content", "REQUIRED")]),
        ({"content": None}, [("content", "REQUIRED")]),
        ({"content": "   "}, [("content", "REQUIRED")]),
        ({"content": 5}, [("content", "INVALID_FORMAT")]),
        ({"content": "x" * 4001}, [("content", "TOO_LONG")]),
        ({"content": "a\x00b"}, [("content", "INVALID_FORMAT")]),
        ({"content": "x", "metadata": []}, [("metadata", "INVALID_FORMAT")]),
        ({"content": "x", "metadata": {"k": "v" * 4096}}, [("metadata", "TOO_LONG")]),
        (
            {"content": "", "metadata": "text"},
            [("content", "REQUIRED"), ("metadata", "INVALID_FORMAT")],
        ),
    ],
)
def test_aBadMemoryIsEveryRuleAtOnce(document: dict[str, Any], errors: list[Any]) -> None:
    """
    Every failed rule of a memory is in one VALIDATION_ERROR.
    """
    assert refused(parseAddBody, document) == errors


def test_4000CharactersAfterTrimmingAreAllowed() -> None:
    """
    The bound is on the trimmed content, in characters (not bytes).
    """
    content = "é" * 4000
    assert parseAddBody(body({"content": f"  {content}  "})) == NewMemory(content, "{}")


def test_aConversationKeepsUserAndAssistantText() -> None:
    """
    {"messages"} is a conversation: the text of user and assistant
    messages is kept (text parts joined by newlines, other parts left
    out), system, developer and tool messages skipped, empty ones too.
    """
    parsed = parseAddBody(
        body(
            {
                "messages": [
                    {"role": "system", "content": "be brief"},
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "I live"},
                            {"type": "image_url", "image_url": {"url": "http://x"}},
                            {"type": "text", "text": "in Porto"},
                        ],
                    },
                    {"role": "tool", "content": "42", "tool_call_id": "t"},
                    {"role": "assistant", "content": ""},
                    {"role": "assistant", "content": "Nice!"},
                ]
            }
        )
    )
    assert parsed == Conversation(
        (ObservedMessage("user", "I live\nin Porto"), ObservedMessage("assistant", "Nice!"))
    )


@pytest.mark.parametrize(
    ("document", "errors"),
    [
        ({"messages": []}, [("messages", "REQUIRED")]),
        ({"messages": "hi"}, [("messages", "INVALID_FORMAT")]),
        ({"messages": [{"role": "assistant", "content": "x"}]}, [("messages", "REQUIRED")]),
        ({"messages": [{"role": "user", "content": "   "}]}, [("messages", "REQUIRED")]),
        ({"messages": [{"role": "robot", "content": "x"}]}, [("messages[0].role", "INVALID_ENUM")]),
        ({"messages": ["x"]}, [("messages[0]", "INVALID_FORMAT")]),
        (
            {"messages": [{"role": "user", "content": 5}]},
            [("messages[0].content", "INVALID_FORMAT")],
        ),
        (
            {"messages": [{"role": "user", "content": "x" * (16 * 1024 + 1)}]},
            [("messages[0].content", "TOO_LONG")],
        ),
        ({"messages": [{"role": "user", "content": "x"}] * 65}, [("messages", "TOO_MANY")]),
        (
            {"messages": [{"role": "user", "content": "x"}], "content": "y"},
            [("messages", "INVALID_FORMAT")],
        ),
        (
            {"messages": [{"role": "user", "content": "x"}], "metadata": {}},
            [("metadata", "INVALID_FORMAT")],
        ),
    ],
)
def test_aBadConversationIsRefused(document: dict[str, Any], errors: list[Any]) -> None:
    """
    A conversation needs a user message with text, at most 64 kept
    messages of at most 16 KiB each, known roles, and neither a content
    nor metadata beside it.
    """
    assert refused(parseAddBody, document) == errors


@pytest.mark.parametrize("raw", [b"", b"not json", b"[1]", b'{"content": "\\ud800"}'])
def test_aBodyThatIsNoJSONObjectIsRefused(raw: bytes) -> None:
    """
    The JSON rules of every body (decisions D10): not JSON or a lone
    surrogate is INVALID_JSON, JSON that is no object a VALIDATION_ERROR.
    """
    for parse in (parseAddBody, parsePatchBody, parseSearchBody):
        with pytest.raises(ApiError) as raised:
            parse(raw)
        assert raised.value.code in (ErrorCode.INVALID_JSON, ErrorCode.VALIDATION_ERROR)


# Changing


def test_aChangeIsAContentOrMetadataOrBoth() -> None:
    assert parsePatchBody(body({"content": " new "})) == MemoryChange("new", None)
    assert parsePatchBody(body({"metadata": {}})) == MemoryChange(None, "{}")
    assert parsePatchBody(body({"content": "a", "metadata": {"b": 1}})) == MemoryChange(
        "a", '{"b":1}'
    )
    assert refused(parsePatchBody, {}) == [("content", "REQUIRED")]
    assert refused(parsePatchBody, {"content": None, "metadata": None}) == [("content", "REQUIRED")]
    assert refused(parsePatchBody, {"content": "", "metadata": 1}) == [
        ("content", "REQUIRED"),
        ("metadata", "INVALID_FORMAT"),
    ]


# Searching


def test_aSearchHasItsDefaults() -> None:
    assert parseSearchBody(body({"query": "tea"})) == MemorySearch("tea", 5, None)
    assert parseSearchBody(body({"query": "tea", "k": 50, "min_score": -1})) == MemorySearch(
        "tea", 50, -1.0
    )
    assert parseSearchBody(body({"query": "tea", "mode": "vector", "k": None})) == MemorySearch(
        "tea", 5, None
    )


@pytest.mark.parametrize("mode", ["text", "hybrid"])
def test_minScoreIsCheckedAndIgnoredOutsideVectorMode(mode: str) -> None:
    """
    D13: min_score applies in vector mode only. With text or hybrid it is
    still checked (a bad one is 400 in every mode) and then dropped: their
    scores are no cosine similarities.
    """
    assert parseSearchBody(body({"query": "tea", "mode": mode, "min_score": 0.9})) == (
        MemorySearch("tea", 5, None, mode)
    )
    assert refused(parseSearchBody, {"query": "x", "mode": mode, "min_score": 2}) == [
        ("min_score", "INVALID_FORMAT")
    ]


@pytest.mark.parametrize(
    ("document", "errors"),
    [
        ({}, [("query", "REQUIRED")]),
        ({"query": " "}, [("query", "REQUIRED")]),
        ({"query": 1}, [("query", "INVALID_FORMAT")]),
        ({"query": "x" * 8001}, [("query", "TOO_LONG")]),
        ({"query": "x", "k": 0}, [("k", "TOO_MANY")]),
        ({"query": "x", "k": 51}, [("k", "TOO_MANY")]),
        ({"query": "x", "k": 2.5}, [("k", "INVALID_FORMAT")]),
        ({"query": "x", "k": True}, [("k", "INVALID_FORMAT")]),
        ({"query": "x", "min_score": 1.5}, [("min_score", "INVALID_FORMAT")]),
        ({"query": "x", "min_score": "0.5"}, [("min_score", "INVALID_FORMAT")]),
        ({"query": "x", "mode": "semantic"}, [("mode", "INVALID_ENUM")]),
        ({"query": "x", "mode": "Text"}, [("mode", "INVALID_ENUM")]),
        ({"query": "x", "mode": 1}, [("mode", "INVALID_ENUM")]),
    ],
)
def test_aBadSearchIsRefused(document: dict[str, Any], errors: list[Any]) -> None:
    assert refused(parseSearchBody, document) == errors


# The list's query, ids


def test_theListsQuery() -> None:
    """
    limit 1 to 100 (20 by default) and after a memory id; anything else,
    or a parameter given twice, is 400 naming it; other parameters are
    ignored.
    """
    memoryID = "0190f0a0-0000-7000-8000-00000000000A"
    assert parseListQuery({}) == MemoryPage(20, None)
    assert parseListQuery({b"limit": [b"100"], b"after": [memoryID.encode()], b"x": [b"y"]}) == (
        MemoryPage(100, memoryID.lower())
    )
    for args, field in (
        ({b"limit": [b"0"]}, "limit"),
        ({b"limit": [b"101"]}, "limit"),
        ({b"limit": [b"-1"]}, "limit"),
        ({b"limit": [b"1", b"2"]}, "limit"),
        ({b"limit": [b"\xd9\xa3"]}, "limit"),
        ({b"after": [b"nope"]}, "after"),
        ({b"after": [b"\xff"]}, "after"),
    ):
        with pytest.raises(ApiError) as raised:
            parseListQuery(args)
        assert fieldErrors(raised) == [(field, "INVALID_FORMAT")]


def test_aMemoryIDIsAUUID() -> None:
    assert parseMemoryID("0190F0A0-0000-7000-8000-000000000001") == (
        "0190f0a0-0000-7000-8000-000000000001"
    )
    with pytest.raises(ApiError) as raised:
        parseMemoryID("search")
    assert fieldErrors(raised) == [("id", "INVALID_FORMAT")]


def test_aMemoryIsAnsweredWithoutItsVector() -> None:
    """
    The memory's answer has the fields of decisions D13, its metadata as
    an object, and nothing of its embedding.
    """
    message = memory_pb2.Memory(
        id="i",
        org_id="o",
        agent_id="a",
        subject="s",
        content="c",
        metadata_json='{"k":1}',
        source="api",
        source_request_id="r",
        created_at="2026-01-01T00:00:00.000Z",
        updated_at="2026-01-02T00:00:00.000Z",
        embedding_model="embed",
        dimensions=64,
    )
    assert memoryJSON(message) == {
        "id": "i",
        "object": "memory",
        "agent_id": "a",
        "subject": "s",
        "content": "c",
        "metadata": {"k": 1},
        "source": "api",
        "created_at": "2026-01-01T00:00:00.000Z",
        "updated_at": "2026-01-02T00:00:00.000Z",
    }


# The subject header


def requestWith(*values: bytes) -> Request:
    request = Request(DummyChannel())
    request.requestHeaders = Headers()
    if values:
        request.requestHeaders.setRawHeaders(MEMORY_SUBJECT_HEADER.encode(), list(values))
    return request


def test_theSubjectHeader() -> None:
    """
    Without the header, the agent's own subject (""); with it, 1 to 128
    characters of A-Za-z0-9._:@- as given.
    """
    assert memorySubject(requestWith()) == ""
    for subject in (b"alice@example.com", b"user:42", b"A.b_c-D", b"x" * 128):
        assert memorySubject(requestWith(subject)) == subject.decode()


@pytest.mark.parametrize(
    "values",
    [(b"",), (b"x" * 129,), (b"has space",), (b"\xc3\xbc",), (b"a/b",), (b"a", b"b"), (b"a;b",)],
)
def test_aBadSubjectIs400NamingTheHeader(values: tuple[bytes, ...]) -> None:
    with pytest.raises(ApiError) as raised:
        memorySubject(requestWith(*values))
    assert fieldErrors(raised) == [(MEMORY_SUBJECT_HEADER, "INVALID_FORMAT")]


@given(st.text(max_size=140))
def test_theSubjectHeaderAgreesWithSvcMemory(text: str) -> None:
    """
    What the header accepts is what svc-memory's rule accepts (besides
    the empty subject, which is the header's absence).
    """
    from svcd.memory.records import SUBJECT_PATTERN

    raw = text.encode("utf-8")
    try:
        accepted = memorySubject(requestWith(raw)) == text
    except ApiError:
        accepted = False
    assert accepted == (bool(text) and SUBJECT_PATTERN.fullmatch(text) is not None)


def test_aConversationsKeyIsTheSameOnEveryProxyAndRelease() -> None:
    """
    The key of a conversation posted to /v1/memories (its request id,
    agent, subject and messages, digested) is what makes a retry queue it
    once: any proxy, of any release that keeps this digest, must compute
    the same for the same request. Pinned here, so that a change to its
    encoding is a decision (and a release note), not an accident; another
    request id, agent, subject or message is another key.
    """
    orgID = uuid.UUID("0190a000-0000-7000-8000-000000000001")
    agentID = uuid.UUID("0190a000-0000-7000-8000-000000000002")
    requestID = "0190a000-0000-7000-8000-0000000000aa"
    messages = (
        ObservedMessage("user", "I moved to Porto"),
        ObservedMessage("assistant", "Nice! é"),
    )
    key = conversationKey(Scope(orgID, agentID, "bob"), requestID, messages)
    assert key == PINNED_CONVERSATION_KEY
    others = {
        conversationKey(Scope(orgID, agentID, "bob"), requestID.replace("aa", "ab"), messages),
        conversationKey(Scope(orgID, uuid.uuid4(), "bob"), requestID, messages),
        conversationKey(Scope(orgID, agentID, "eve"), requestID, messages),
        conversationKey(Scope(orgID, agentID, "bob"), requestID, messages[:1]),
    }
    assert len(others) == 4 and key not in others
