"""
The scripted model server's two ports as Twisted resources: the API port
(L{UpstreamResource}: its routes, the API key, the request log) and the
control port (L{ControlResource}: the log and the connection counts, for
the tests). See "Routes of the API port" and "Routes of the control port"
in the package's manual.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable

import attrs
from twisted.internet.interfaces import IReactorTime
from twisted.protocols.policies import ProtocolWrapper, WrappingFactory
from twisted.python.failure import Failure
from twisted.web.http import Request as HTTPRequest
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Request, Site

from svcd.devkit.upstream import anthropic
from svcd.devkit.upstream.content import (
    DEFAULT_EMBEDDING_DIMENSIONS,
    MAX_EMBEDDING_DIMENSIONS,
    endsWithToolResult,
    toolNameOf,
)
from svcd.devkit.upstream.delivery import RequestRecord, setStatus
from svcd.devkit.upstream.openai import ChatCompletionAnswer, EmbeddingsAnswer, errorBody
from svcd.devkit.upstream.script import Script, ScriptError, capUsage, parseScript

# The answer kinds that make sense for a chat answer only (a message or a
# chat completion): an embeddings request, or a token count, naming one
# is a 400.
_CHAT_ONLY = frozenset({"events", "bytes", "tool-call", "error-mid-stream"})


class UpstreamResource(Resource):
    """
    The API port's one resource: chat completions, embeddings, models and
    Anthropic's messages and token counts under any prefix, every request
    recorded.
    """

    isLeaf = True

    def __init__(
        self,
        reactor: IReactorTime,
        clock: Callable[[], float],
        apiKey: str | None,
        embeddingDimensions: int = DEFAULT_EMBEDDING_DIMENSIONS,
    ) -> None:
        super().__init__()
        self._reactor = reactor
        self._clock = clock
        self._apiKey = apiKey
        self._embeddingDimensions = embeddingDimensions
        self.records: list[RequestRecord] = []
        self._numbers = itertools.count(1)

    def render(self, request: Request) -> bytes | int:
        record = self._record(request)
        path = request.path
        if path.endswith((b"/messages", b"/messages/count_tokens")):
            return self._messagesRoute(request, record)
        if path.endswith((b"/chat/completions", b"/embeddings")):
            allowed = b"POST"
        elif path.endswith(b"/models"):
            allowed = b"GET"
        else:
            return self._error(request, record, 404, f"Unknown path {record.path}.", "unknown_url")
        if request.method != allowed:
            request.setHeader(b"allow", allowed)
            return self._error(request, record, 405, f"Use {allowed.decode()} here.", None)
        if self._apiKey is not None:
            expected = f"Bearer {self._apiKey}".encode()
            if request.getHeader(b"authorization") != expected:
                return self._error(
                    request, record, 401, "Incorrect API key provided.", "invalid_api_key"
                )
        if allowed == b"GET":
            return self._models(request, record)
        if path.endswith(b"/embeddings"):
            return self._embeddings(request, record)
        return self._chatCompletion(request, record)

    def _record(self, request: Request) -> RequestRecord:
        raw = request.content.read() if request.content is not None else b""
        body: object = None
        bodyText: str | None = None
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            bodyText = raw.decode("utf-8", errors="replace")
        peer = request.getClientAddress()
        record = RequestRecord(
            number=next(self._numbers),
            method=request.method.decode("ascii", errors="replace"),
            path=request.path.decode("utf-8", errors="replace"),
            query=request.uri.partition(b"?")[2].decode("utf-8", errors="replace"),
            headers=[
                (name.decode("latin-1").lower(), value.decode("latin-1"))
                for name, values in request.requestHeaders.getAllRawHeaders()
                for value in values
            ],
            body=body,
            bodyText=bodyText,
            bodyLength=len(raw),
            clientPort=getattr(peer, "port", None),
            arrived=self._clock(),
        )
        self.records.append(record)

        def ended(result: Failure | None) -> None:
            record.ended = self._clock()
            record.outcome = "clientGone" if isinstance(result, Failure) else "finished"

        request.notifyFinish().addBoth(ended)
        return record

    def _error(
        self,
        request: Request,
        record: RequestRecord,
        status: int,
        message: str,
        code: str | None,
    ) -> bytes:
        setStatus(request, status)
        request.setHeader(b"content-type", b"application/json")
        request.setHeader(b"x-request-id", b"req_scripted_%d" % record.number)
        record.status = status
        return errorBody(message, "invalid_request_error", code)

    def _models(self, request: Request, record: RequestRecord) -> bytes:
        names = ["echo", "slow:500", "status:429", "close-mid-stream", "never-ending"]
        models = [
            {"id": name, "object": "model", "created": 0, "owned_by": "svc-tests"} for name in names
        ]
        request.setHeader(b"content-type", b"application/json")
        request.setHeader(b"x-request-id", b"req_scripted_%d" % record.number)
        record.status = 200
        return json.dumps({"object": "list", "data": models}).encode()

    def _chatCompletion(self, request: Request, record: RequestRecord) -> bytes | int:
        if not isinstance(record.body, dict):
            message = "We could not parse the JSON body of your request."
            return self._error(request, record, 400, message, None)
        model = record.body.get("model")
        if not isinstance(model, str):
            return self._error(request, record, 400, "You must provide a model parameter.", None)
        try:
            script = _chatScript(model, record)
        except ScriptError as error:
            return self._error(request, record, 400, f"Bad script {model!r}: {error}", None)
        answer = ChatCompletionAnswer(
            self._reactor, self._clock, request, record, script, record.number
        )
        answer.start()
        return NOT_DONE_YET

    def _embeddings(self, request: Request, record: RequestRecord) -> bytes | int:
        body = record.body
        if not isinstance(body, dict):
            message = "We could not parse the JSON body of your request."
            return self._error(request, record, 400, message, None)
        model = body.get("model")
        if not isinstance(model, str):
            return self._error(request, record, 400, "You must provide a model parameter.", None)
        try:
            script = parseScript(model)
            if script.kind in _CHAT_ONLY:
                raise ScriptError(f"{script.kind} is for chat completions")
            if script.cache is not None:
                raise ScriptError("cache is for chat completions")
            if script.capFactor:
                counts = (record.bodyLength * script.capFactor, 0)
                script = attrs.evolve(script, counts=counts)
            inputs = _embeddingInputs(body.get("input"))
            dimensions = _embeddingDimensions(body.get("dimensions"), self._embeddingDimensions)
            encoding = body.get("encoding_format") or "float"
            if encoding not in ("float", "base64"):
                raise ScriptError(f"encoding_format must be float or base64, not {encoding!r}")
        except ScriptError as error:
            return self._error(request, record, 400, f"Bad request for {model!r}: {error}", None)
        answer = EmbeddingsAnswer(
            self._reactor,
            self._clock,
            request,
            record,
            script,
            record.number,
            inputs,
            dimensions,
            encoding,
        )
        answer.start()
        return NOT_DONE_YET

    # Anthropic's Messages API

    def _anthropicError(
        self, request: Request, record: RequestRecord, status: int, message: str
    ) -> bytes:
        setStatus(request, status)
        request.setHeader(b"content-type", b"application/json")
        requestID = f"req_scripted_{record.number}"
        request.setHeader(b"request-id", requestID.encode())
        record.status = status
        return anthropic.errorBody(status, message, requestID)

    def _messagesRoute(self, request: Request, record: RequestRecord) -> bytes | int:
        """
        C{POST .../messages} and C{POST .../messages/count_tokens}, checked
        as Anthropic checks them: the key (C{x-api-key}), the version header,
        then the body.
        """
        if request.method != b"POST":
            request.setHeader(b"allow", b"POST")
            return self._anthropicError(request, record, 405, "Use POST here.")
        if self._apiKey is not None:
            # Anthropic's API takes the key as x-api-key, or as a bearer
            # token (what the anthropic SDK of .venv sends).
            given = request.getHeader(b"x-api-key")
            bearer = request.getHeader(b"authorization")
            key = self._apiKey.encode()
            if given is None and bearer is None:
                return self._anthropicError(request, record, 401, "x-api-key header is required")
            if given != key and bearer != b"Bearer " + key:
                return self._anthropicError(request, record, 401, "invalid x-api-key")
        if not request.getHeader(b"anthropic-version"):
            message = "anthropic-version: header is required"
            return self._anthropicError(request, record, 400, message)
        counting = request.path.endswith(b"/count_tokens")
        body = record.body
        if not isinstance(body, dict):
            message = "There was an error parsing the body of your request."
            return self._anthropicError(request, record, 400, message)
        problem = _messagesBodyProblem(body, counting)
        if problem is not None:
            return self._anthropicError(request, record, 400, problem)
        model = str(body["model"])
        try:
            script = _countScript(model, record) if counting else _chatScript(model, record)
        except ScriptError as error:
            message = f"Bad script {model!r}: {error}"
            return self._anthropicError(request, record, 400, message)
        answerClass = anthropic.CountTokensAnswer if counting else anthropic.MessageAnswer
        answer = answerClass(self._reactor, self._clock, request, record, script, record.number)
        answer.start()
        return NOT_DONE_YET


def _chatScript(model: str, record: RequestRecord) -> Script:
    """
    The script of a chat answer (a chat completion or a message): its
    usage taken from the request for C{usage-at-cap}, its tool chosen for
    C{tool-call}.

    @raise ScriptError: for a script that cannot answer this request.
    """
    body = record.body if isinstance(record.body, dict) else {}
    script = parseScript(model)
    if script.vectors is not None:
        raise ScriptError("vectors is for embeddings")
    if script.capFactor:
        counts = capUsage(body, record.bodyLength, script.capFactor)
        script = attrs.evolve(script, counts=counts)
    if script.kind == "tool-call" and script.tool is None and not endsWithToolResult(body):
        tool = toolNameOf(body)
        if tool is None:
            raise ScriptError("tool-call needs a tool: the request's tools, or tool-call:<name>")
        script = attrs.evolve(script, tool=tool)
    return script


def _countScript(model: str, record: RequestRecord) -> Script:
    """
    The script of a C{count_tokens} request: its faults and delivery as a
    whole message's; C{usage-at-cap} counts a token per byte of the body.

    @raise ScriptError: for a script that makes no count.
    """
    script = parseScript(model)
    if script.kind in ("events", "bytes", "tool-call"):
        raise ScriptError(f"{script.kind} is for messages")
    if script.vectors is not None:
        raise ScriptError("vectors is for embeddings")
    if script.capFactor:
        script = attrs.evolve(script, counts=(record.bodyLength * script.capFactor, 0))
    return script


def _messagesBodyProblem(body: dict[str, object], counting: bool) -> str | None:
    """
    What Anthropic would refuse in a Messages (or C{count_tokens}) body
    before reading its model, as its message says it, or L{None}.
    """
    if not isinstance(body.get("model"), str):
        return "model: Field required"
    if not isinstance(body.get("messages"), list):
        return "messages: Field required"
    if counting:
        return None
    maxTokens = body.get("max_tokens")
    if maxTokens is None:
        return "max_tokens: Field required"
    if not isinstance(maxTokens, int) or isinstance(maxTokens, bool) or maxTokens < 1:
        return "max_tokens: Input should be a whole number of at least 1"
    return None


def _embeddingInputs(value: object) -> list[str]:
    """
    The inputs of an embeddings request: a string, or an array of strings.

    @raise ScriptError: for anything else (token arrays included).
    """
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(isinstance(item, str) for item in value):
        return list(value)
    raise ScriptError("input must be a string or a non-empty array of strings")


def _embeddingDimensions(value: object, default: int) -> int:
    if value is None:
        return default
    if (
        not isinstance(value, int)
        or isinstance(value, bool)
        or not 1 <= value <= MAX_EMBEDDING_DIMENSIONS
    ):
        raise ScriptError(
            f"dimensions must be a whole number from 1 to {MAX_EMBEDDING_DIMENSIONS}, not {value!r}"
        )
    return value


class ControlResource(Resource):
    """
    The control port's resource: the request log and connection counts.
    """

    isLeaf = True

    def __init__(self, upstream: UpstreamResource, connections: CountingFactory) -> None:
        super().__init__()
        self._upstream = upstream
        self._connections = connections

    def render(self, request: Request) -> bytes:
        request.setHeader(b"content-type", b"application/json")
        route = (request.method, request.path)
        if route == (b"GET", b"/_upstream/requests"):
            return json.dumps([record.asJSON() for record in self._upstream.records]).encode()
        if route == (b"DELETE", b"/_upstream/requests"):
            self._upstream.records.clear()
            return b"{}"
        if route == (b"GET", b"/_upstream/connections"):
            counts = {
                "open": len(self._connections.protocols),
                "accepted": self._connections.accepted,
            }
            return json.dumps(counts).encode()
        request.setResponseCode(404)
        return errorBody("No such control route.", "invalid_request_error", None)


class CountingFactory(WrappingFactory):
    """
    Wraps the API port's site to count its connections: C{protocols} holds
    the open ones, C{accepted} counts every one since the start.
    """

    noisy = False

    def __init__(self, wrappedFactory: Site) -> None:
        super().__init__(wrappedFactory)
        self.accepted = 0

    def registerProtocol(self, p: ProtocolWrapper) -> None:
        self.accepted += 1
        super().registerProtocol(p)


class QuietSite(Site):
    """
    A site that writes no access log: the server logs nothing but errors.
    """

    noisy = False

    def log(self, request: HTTPRequest) -> None:
        pass
