"""
Errors between the dialects (svcd.dialects.errors): Anthropic's error
envelope with its type from the status and the gateway's code, read by
Anthropic's SDK as the exception its users catch; an Anthropic provider's
error as the gateway's own; a field with no counterpart as a 400 naming
it.
"""

from __future__ import annotations

from typing import Any

import anthropic
import httpx2
import pytest
from anthropic.types import ErrorResponse

from svcd.common.errors import ApiError, ErrorCode, FieldError, FieldErrorCode
from svcd.dialects.errors import (
    Untranslatable,
    anthropicErrorBody,
    anthropicErrorOf,
    anthropicErrorType,
    apiErrorOfAnthropic,
    isOverloaded,
)


@pytest.mark.parametrize(
    ("status", "overloaded", "kind"),
    [
        (400, False, "invalid_request_error"),
        (401, False, "authentication_error"),
        (403, False, "permission_error"),
        (404, False, "not_found_error"),
        (405, False, "invalid_request_error"),
        (409, False, "invalid_request_error"),
        (413, False, "request_too_large"),
        (415, False, "invalid_request_error"),
        (429, False, "rate_limit_error"),
        (500, False, "api_error"),
        (501, False, "api_error"),
        (502, False, "api_error"),
        (503, False, "api_error"),
        (504, False, "api_error"),
        (502, True, "overloaded_error"),
        (503, True, "overloaded_error"),
        (504, True, "overloaded_error"),
        (529, False, "overloaded_error"),
        (400, True, "invalid_request_error"),
        (429, True, "rate_limit_error"),
    ],
)
def test_errorTypeFollowsStatus(status: int, overloaded: bool, kind: str) -> None:
    """
    The error type follows the status, as Anthropic names them; a 502, 503
    or 504 is overloaded_error only when the provider said so.
    """
    assert anthropicErrorType(status, overloaded=overloaded) == kind


@pytest.mark.parametrize("code", list(ErrorCode))
def test_everyCodeHasAnthropicShape(code: ErrorCode) -> None:
    """
    Every error of the gateway has Anthropic's envelope: type, message and
    the gateway's code; its SDK's model reads it (request_too_large, which
    Anthropic's API documents but its SDK's union lacks, aside).
    """
    body = anthropicErrorBody(ApiError(code), requestID="req-1")
    assert body["type"] == "error" and body["request_id"] == "req-1"
    assert body["error"] == {
        "type": anthropicErrorType(code.status),
        "message": code.defaultMessage,
        "code": code.value,
    }
    if body["error"]["type"] != "request_too_large":
        ErrorResponse.model_validate(body)


def test_fieldErrorsAndDetail() -> None:
    """
    Field errors are named in the message (what an SDK's exception shows)
    and listed; a provider's message is the detail.
    """
    error = ApiError(
        ErrorCode.VALIDATION_ERROR,
        fieldErrors=[
            FieldError("max_tokens", FieldErrorCode.REQUIRED, "is required"),
            FieldError("top_k", FieldErrorCode.INVALID_FORMAT, "has no counterpart"),
        ],
    )
    inner = anthropicErrorBody(error)["error"]
    assert inner["message"] == (
        "The request failed validation. max_tokens: is required; top_k: has no counterpart"
    )
    assert inner["field_errors"] == [
        {"field": "max_tokens", "code": "REQUIRED", "message": "is required"},
        {"field": "top_k", "code": "INVALID_FORMAT", "message": "has no counterpart"},
    ]
    rejected = ApiError(ErrorCode.UPSTREAM_REJECTED, detail="prompt is too long", status=400)
    assert anthropicErrorBody(rejected)["error"]["detail"] == "prompt is too long"
    assert "request_id" not in anthropicErrorBody(rejected)


@pytest.mark.parametrize(
    ("error", "exception", "overloaded"),
    [
        (ApiError(ErrorCode.VALIDATION_ERROR), anthropic.BadRequestError, False),
        (ApiError(ErrorCode.INVALID_TOKEN), anthropic.AuthenticationError, False),
        (ApiError(ErrorCode.INSUFFICIENT_PERMISSIONS), anthropic.PermissionDeniedError, False),
        (ApiError(ErrorCode.NOT_FOUND), anthropic.NotFoundError, False),
        (ApiError(ErrorCode.PAYLOAD_TOO_LARGE), anthropic.ContentTooLargeError, False),
        (ApiError(ErrorCode.BUDGET_EXCEEDED), anthropic.RateLimitError, False),
        (ApiError(ErrorCode.UPSTREAM_ERROR), anthropic.InternalServerError, True),
        (ApiError(ErrorCode.PROVIDER_NOT_CONFIGURED), anthropic.InternalServerError, False),
    ],
)
def test_anthropicSDKRaisesItsException(
    error: ApiError, exception: type[anthropic.APIStatusError], overloaded: bool
) -> None:
    """
    Anthropic's SDK, answered the envelope at its status, raises the
    exception its users catch, with the gateway's code in its body.
    """
    body = anthropicErrorBody(error, requestID="r", overloaded=overloaded)

    def answer(request: httpx2.Request) -> httpx2.Response:
        return httpx2.Response(error.status, json=body, headers={"retry-after": "7"})

    client = anthropic.Anthropic(
        api_key="k",
        base_url="http://gateway.test",
        http_client=httpx2.Client(transport=httpx2.MockTransport(answer)),
        max_retries=0,
    )
    with pytest.raises(exception) as caught:
        client.messages.create(model="m", max_tokens=1, messages=[{"role": "user", "content": "x"}])
    assert caught.value.status_code == error.status
    sent: Any = caught.value.body
    assert sent["error"]["code"] == error.code.value
    assert sent["error"]["type"] == anthropicErrorType(error.status, overloaded=overloaded)


def test_untranslatableIsAValidationError() -> None:
    """
    A field with no counterpart is a 400 VALIDATION_ERROR naming it.
    """
    error = Untranslatable("messages[2].content[0].type", "has no counterpart").apiError()
    assert (error.status, error.code) == (400, ErrorCode.VALIDATION_ERROR)
    assert [(each.field, each.code) for each in error.fieldErrors] == [
        ("messages[2].content[0].type", FieldErrorCode.INVALID_FORMAT)
    ]


def test_readingAnthropicErrors() -> None:
    """
    An error in Anthropic's shape gives its type and message; anything
    else none. Overloaded is a 529 or an overloaded_error.
    """
    overloaded = {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}
    assert anthropicErrorOf(overloaded) == ("overloaded_error", "Overloaded")
    assert anthropicErrorOf({"type": "error", "error": {}}) == ("api_error", "")
    assert anthropicErrorOf({"error": {"message": "openai"}}) is None
    assert anthropicErrorOf("x") is None
    assert isOverloaded(503, overloaded) and isOverloaded(529, None)
    assert not isOverloaded(503, {"type": "error", "error": {"type": "api_error"}})


@pytest.mark.parametrize(
    ("kind", "code", "status", "detail"),
    [
        ("invalid_request_error", ErrorCode.UPSTREAM_REJECTED, 400, "bad"),
        ("request_too_large", ErrorCode.UPSTREAM_REJECTED, 413, "bad"),
        ("rate_limit_error", ErrorCode.UPSTREAM_RATE_LIMITED, 429, None),
        ("timeout_error", ErrorCode.UPSTREAM_TIMEOUT, 504, None),
        ("overloaded_error", ErrorCode.UPSTREAM_ERROR, 502, None),
        ("api_error", ErrorCode.UPSTREAM_ERROR, 502, None),
        ("authentication_error", ErrorCode.UPSTREAM_ERROR, 502, None),
        ("permission_error", ErrorCode.UPSTREAM_ERROR, 502, None),
        ("billing_error", ErrorCode.UPSTREAM_ERROR, 502, None),
    ],
)
def test_anthropicProviderErrorAsTheGateways(
    kind: str, code: ErrorCode, status: int, detail: str | None
) -> None:
    """
    An Anthropic provider's error is the gateway's as D9 maps a provider's
    status: its words only for a request it refused, never for the
    operator's key.
    """
    error = apiErrorOfAnthropic(kind, "bad")
    assert (error.code, error.status, error.detail) == (code, status, detail)
