"""
Errors between the dialects: a field that has no counterpart in the other
one (L{Untranslatable}), the error envelope of Anthropic's Messages API
that clients of C{/v1/messages} read (L{anthropicErrorBody}), and an
Anthropic provider's error as the gateway's own (L{apiErrorOfAnthropic}),
which is what a client of C{/v1/chat/completions} then sees, in OpenAI's
envelope (decisions D4, D9).

Anthropic's envelope is C{{"type": "error", "error": {"type", "message",
"code"}}}: C{type} follows the HTTP status as Anthropic's own API and SDKs
name them, C{code} is the gateway's code of D4, so that a client can tell
BUDGET_EXCEEDED from RATE_LIMITED though both are a C{rate_limit_error}.
Field errors (D4: all of them at once) are both in the message, where an
SDK's exception shows them, and in C{field_errors}; a provider's own
message (UPSTREAM_REJECTED) is in C{detail}. The status codes, headers and
C{Retry-After} stay D4's: only the body changes shape.
"""

from __future__ import annotations

from typing import Any

from svcd.common.errors import (
    ApiError,
    ErrorCode,
    FieldError,
    FieldErrorCode,
    validationError,
)

# Anthropic's error types by HTTP status; any other 4xx is an
# invalid_request_error, any other 5xx an api_error.
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    529: "overloaded_error",
}
OVERLOADED = "overloaded_error"
# The statuses at which the gateway says what the provider said: a
# provider that was overloaded (Anthropic's 529, or its error type
# overloaded_error) makes the gateway's 502, 503 or 504 an
# overloaded_error, which Anthropic's SDKs retry as they retry Anthropic.
_UPSTREAM_STATUSES = frozenset({502, 503, 504})


class Untranslatable(Exception):
    """
    A field of a request that the other dialect cannot carry: the route
    answers 400 VALIDATION_ERROR naming it, and forwards nothing.
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message

    def fieldError(self) -> FieldError:
        return FieldError(self.field, FieldErrorCode.INVALID_FORMAT, self.message)

    def apiError(self) -> ApiError:
        return validationError([self.fieldError()])


def anthropicErrorType(status: int, *, overloaded: bool = False) -> str:
    """
    Anthropic's error type for an answer of C{status}; C{overloaded} when
    the provider said it was (see L{isOverloaded}).
    """
    if overloaded and status in _UPSTREAM_STATUSES:
        return OVERLOADED
    known = _TYPES.get(status)
    if known is not None:
        return known
    return "invalid_request_error" if status < 500 else "api_error"


def anthropicErrorBody(
    error: ApiError, *, requestID: str | None = None, overloaded: bool = False
) -> dict[str, Any]:
    """
    The body of C{error} in Anthropic's shape, for an answer or for an
    C{error} event of a stream (the same object, as Anthropic sends).
    """
    message = error.message
    if error.fieldErrors:
        message = (
            message + " " + "; ".join(f"{each.field}: {each.message}" for each in error.fieldErrors)
        )
    inner: dict[str, Any] = {
        "type": anthropicErrorType(error.status, overloaded=overloaded),
        "message": message,
        "code": error.code.value,
    }
    if error.detail is not None:
        inner["detail"] = error.detail
    if error.fieldErrors:
        inner["field_errors"] = [each.asJSON() for each in error.fieldErrors]
    body: dict[str, Any] = {"type": "error", "error": inner}
    if requestID is not None:
        body["request_id"] = requestID
    return body


def anthropicErrorOf(document: object) -> tuple[str, str] | None:
    """
    The type and message of an error in Anthropic's shape (an answer's
    body or a stream's C{error} event), or C{None} when C{document} is not
    one.
    """
    if not isinstance(document, dict) or document.get("type") != "error":
        return None
    inner = document.get("error")
    if not isinstance(inner, dict):
        return None
    kind, message = inner.get("type"), inner.get("message")
    return (
        kind if isinstance(kind, str) else "api_error",
        message if isinstance(message, str) else "",
    )


def isOverloaded(status: int, document: object) -> bool:
    """
    Whether an Anthropic provider's refusal says it is overloaded: its 529,
    or an C{overloaded_error} at any status.
    """
    if status == 529:
        return True
    found = anthropicErrorOf(document)
    return found is not None and found[0] == OVERLOADED


def apiErrorOfAnthropic(kind: str, message: str) -> ApiError:
    """
    The gateway's error for an Anthropic provider's error of type C{kind},
    as D9 maps a provider's status: what a client of chat completions sees
    when its Anthropic provider fails, mid-stream (its C{error} event)
    included. The provider's own words go in C{detail} only where D9 puts
    them (a request the provider refused); never its key or account's
    troubles (an authentication or permission error is the operator's).
    """
    if kind == "rate_limit_error":
        return ApiError(ErrorCode.UPSTREAM_RATE_LIMITED)
    if kind == "invalid_request_error":
        return ApiError(ErrorCode.UPSTREAM_REJECTED, detail=message or None, status=400)
    if kind == "request_too_large":
        return ApiError(ErrorCode.UPSTREAM_REJECTED, detail=message or None, status=413)
    if kind == "timeout_error":
        return ApiError(ErrorCode.UPSTREAM_TIMEOUT)
    return ApiError(ErrorCode.UPSTREAM_ERROR)


class BadAnswer(Exception):
    """
    A provider's answer, or an event of its stream, that is not of its
    dialect's shape, so that it cannot be translated: the route answers as
    for any answer that is not what was asked (decisions D9: 502
    UPSTREAM_ERROR, or the fault event of a stream already begun).
    """


class UpstreamStreamError(Exception):
    """
    A provider's stream that reported an error of its own after it began
    (Anthropic's C{error} event, or an OpenAI-shaped C{{"error": ...}}
    chunk): the route ends its client's stream with the fault event of the
    client's dialect, for L{apiError}.
    """

    def __init__(self, apiError: ApiError, *, overloaded: bool = False) -> None:
        super().__init__(apiError.code.value, apiError.message)
        self.apiError = apiError
        self.overloaded = overloaded
