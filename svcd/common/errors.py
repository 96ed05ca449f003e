"""
The one canonical list of client-facing error codes, their HTTP status, and
the one builder of the error envelope
C{{"error": {code, message, detail?, docs_url?, request_id, timestamp,
field_errors?}}}.

An error that makes no sense to show a client is not an L{ApiError}: it is
a bug, answered as INTERNAL_ERROR by the outermost step without detail.
"""

from __future__ import annotations

import datetime
import enum
from collections.abc import Mapping, Sequence
from typing import Any

import attrs


class ErrorCode(str, enum.Enum):
    """
    Canonical codes of spec section 7, decisions D4, each with its HTTP
    status and a safe default message.
    """

    def __new__(cls, value: str, status: int, message: str) -> "ErrorCode":
        member = str.__new__(cls, value)
        member._value_ = value
        member.status = status
        member.defaultMessage = message
        return member

    status: int
    defaultMessage: str

    INVALID_JSON = ("INVALID_JSON", 400, "The request body is not valid JSON.")
    VALIDATION_ERROR = ("VALIDATION_ERROR", 400, "The request failed validation.")
    MISSING_AGENT_ID = (
        "MISSING_AGENT_ID",
        400,
        "The X-SVC-Agent-ID header is required.",
    )
    MISSING_TOKEN = ("MISSING_TOKEN", 401, "An Authorization bearer token is required.")
    INVALID_TOKEN = ("INVALID_TOKEN", 401, "The bearer token is invalid, expired or revoked.")
    INSUFFICIENT_PERMISSIONS = (
        "INSUFFICIENT_PERMISSIONS",
        403,
        "The token does not allow this request.",
    )
    AGENT_NOT_AUTHORIZED = (
        "AGENT_NOT_AUTHORIZED",
        403,
        "The agent is not authorized for this token's organization.",
    )
    AGENT_SUSPENDED = ("AGENT_SUSPENDED", 403, "The agent is not active.")
    NOT_FOUND = ("NOT_FOUND", 404, "No such resource.")
    METHOD_NOT_ALLOWED = (
        "METHOD_NOT_ALLOWED",
        405,
        "The HTTP method is not allowed on this resource.",
    )
    PAYLOAD_TOO_LARGE = ("PAYLOAD_TOO_LARGE", 413, "The request body is too large.")
    UNSUPPORTED_MEDIA_TYPE = (
        "UNSUPPORTED_MEDIA_TYPE",
        415,
        "The request body must be application/json.",
    )
    RATE_LIMITED = (
        "RATE_LIMITED",
        429,
        "The organization's requests per minute are exceeded.",
    )
    BUDGET_EXCEEDED = (
        "BUDGET_EXCEEDED",
        429,
        "The budget of this period is spent; it starts again with the next period.",
    )
    INTERNAL_ERROR = ("INTERNAL_ERROR", 500, "An internal error occurred.")
    PROVIDER_NOT_CONFIGURED = (
        "PROVIDER_NOT_CONFIGURED",
        501,
        "No LLM provider is configured for this gateway.",
    )
    # Decisions D13: the memory routes without svc-memory's address, the
    # providers file's [memory] table, or an embedding model the caller's
    # organization may use; and a scope that holds SVC_MEMORY_MAX_PER_SCOPE
    # memories already.
    MEMORY_NOT_CONFIGURED = (
        "MEMORY_NOT_CONFIGURED",
        501,
        "Memory is not configured for this gateway.",
    )
    MEMORY_FULL = (
        "MEMORY_FULL",
        409,
        "This agent and subject hold as many memories as allowed; delete some first.",
    )
    # Decisions D13, amended: the organization has SVC_MEMORY_MAX_WAITING_PER_ORG
    # observations waiting for the worker.
    MEMORY_QUEUE_FULL = (
        "MEMORY_QUEUE_FULL",
        429,
        "Too many conversations are waiting to become memories; try again later.",
    )
    UPSTREAM_REJECTED = (
        "UPSTREAM_REJECTED",
        400,
        "The model provider refused the request.",
    )
    UPSTREAM_RATE_LIMITED = (
        "UPSTREAM_RATE_LIMITED",
        429,
        "The model provider is limiting this gateway's requests; try again later.",
    )
    UPSTREAM_ERROR = ("UPSTREAM_ERROR", 502, "The model provider failed to answer.")
    UPSTREAM_TIMEOUT = ("UPSTREAM_TIMEOUT", 504, "The model provider did not answer in time.")
    SERVICE_DEGRADED = (
        "SERVICE_DEGRADED",
        503,
        "Token validation is unavailable; try again shortly.",
    )
    AUTH_UNAVAILABLE = (
        "AUTH_UNAVAILABLE",
        503,
        "Agent verification is unavailable; try again shortly.",
    )


class FieldErrorCode(str, enum.Enum):
    """
    Codes of the objects in C{field_errors}.
    """

    REQUIRED = "REQUIRED"
    TOO_LONG = "TOO_LONG"
    TOO_MANY = "TOO_MANY"
    INVALID_ENUM = "INVALID_ENUM"
    INVALID_FORMAT = "INVALID_FORMAT"
    # Decisions D12: a model without a price, under a budget.
    NO_PRICE = "NO_PRICE"


@attrs.frozen
class FieldError:
    """
    One failed rule of a request: which field, which rule, in words.
    """

    field: str
    code: FieldErrorCode
    message: str

    def asJSON(self) -> dict[str, str]:
        return {"field": self.field, "code": self.code.value, "message": self.message}


class ApiError(Exception):
    """
    An error meant for the client; the outermost step renders it with
    L{envelope}.
    """

    def __init__(
        self,
        code: ErrorCode,
        message: str | None = None,
        *,
        detail: str | Mapping[str, str] | None = None,
        fieldErrors: Sequence[FieldError] = (),
        headers: Sequence[tuple[str, str]] = (),
        status: int | None = None,
    ) -> None:
        self.code = code
        # Only UPSTREAM_REJECTED answers another status than its code's: the
        # provider's own 4xx (decisions D9).
        self._status = status
        self.message = message if message is not None else code.defaultMessage
        self.detail = detail
        self.fieldErrors = tuple(fieldErrors)
        self.headers = tuple(headers)
        super().__init__(code.value, self.message)

    @property
    def status(self) -> int:
        return self._status if self._status is not None else self.code.status


def validationError(fieldErrors: Sequence[FieldError]) -> ApiError:
    """
    A VALIDATION_ERROR carrying every failed rule at once.
    """
    return ApiError(ErrorCode.VALIDATION_ERROR, fieldErrors=fieldErrors)


# The last whole second rfc3339 formatted, and its text: an envelope is made
# for most answers, and strftime is the dearest part of one.
_lastSecond: tuple[datetime.datetime | None, str] = (None, "")


def rfc3339(moment: datetime.datetime) -> str:
    """
    Format an aware datetime as RFC 3339 UTC with millisecond precision and
    a C{Z} suffix.
    """
    global _lastSecond
    utc = moment.astimezone(datetime.UTC)
    second = utc.replace(microsecond=0)
    cached, text = _lastSecond
    if second != cached:
        text = utc.strftime("%Y-%m-%dT%H:%M:%S.")
        _lastSecond = (second, text)
    return f"{text}{utc.microsecond // 1000:03d}Z"


def envelope(
    error: ApiError,
    *,
    requestID: str,
    now: datetime.datetime,
    docsBase: str | None = None,
) -> dict[str, Any]:
    """
    Build the error envelope of spec section 7 for C{error}.

    C{docs_url} is present only when a documentation base is configured;
    it is the base followed by the lowercase code, so one page can hold an
    anchor per code.
    """
    body: dict[str, Any] = {
        "code": error.code.value,
        "message": error.message,
    }
    if error.detail is not None:
        body["detail"] = error.detail
    if docsBase:
        body["docs_url"] = docsBase.rstrip("/") + "/" + error.code.value.lower()
    body["request_id"] = requestID
    body["timestamp"] = rfc3339(now)
    if error.fieldErrors:
        body["field_errors"] = [each.asJSON() for each in error.fieldErrors]
    return {"error": body}
