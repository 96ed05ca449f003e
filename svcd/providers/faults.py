"""
The faults of one attempt at a provider, before any byte reached the
client (decisions D9), and an upstream's refusal mapped to the gateway's
error: D9's table (in L{svcd.providers.upstream}'s docstring) for both
kinds of provider; an Anthropic provider's (decisions D14) by the same
statuses, its C{overloaded_error} or 529 remembered so that a client of
Anthropic's dialect is told it as Anthropic would
(L{svcd.dialects.errors.isOverloaded}).
"""

from __future__ import annotations

import json

from svcd.common.errors import ApiError, ErrorCode
from svcd.dialects.errors import isOverloaded
from svcd.metering.models import ANTHROPIC, Provider
from svcd.providers.http1 import UpstreamAnswer

# How much of an upstream's error message goes into C{detail}.
DETAIL_CHARACTERS = 1000


class UpstreamFault(Exception):
    """
    One attempt failed before any byte reached the client.

    @ivar error: the client's answer if no fallback does better.
    @ivar label: the C{status} label of svc_proxy_upstream_requests_total.
    @ivar overloaded: an Anthropic provider said it was overloaded (its
        529, or an C{overloaded_error}): a client of Anthropic's dialect is
        told C{overloaded_error} (decisions D14).
    """

    def __init__(self, error: ApiError, label: str, *, overloaded: bool = False) -> None:
        super().__init__(error.code.value)
        self.error = error
        self.label = label
        self.overloaded = overloaded

    @property
    def fallback(self) -> bool:
        return self.error.code is not ErrorCode.UPSTREAM_REJECTED


def timeoutFault(label: str = "timeout") -> UpstreamFault:
    return UpstreamFault(ApiError(ErrorCode.UPSTREAM_TIMEOUT), label)


def brokenFault(label: str) -> UpstreamFault:
    return UpstreamFault(ApiError(ErrorCode.UPSTREAM_ERROR), label)


def refusalFault(response: UpstreamAnswer, answer: bytes, provider: Provider) -> UpstreamFault:
    """
    The fault of an upstream's non-2xx answer (D9's table), of either kind
    of provider: Anthropic's error envelope carries its message where
    OpenAI's does (C{error.message}).
    """
    fault = _refusal(response, answer, provider)
    if provider.api == ANTHROPIC:
        try:
            document = json.loads(answer) if answer else None
        except ValueError:
            document = None
        fault.overloaded = isOverloaded(response.code, document)
    return fault


def _refusal(response: UpstreamAnswer, answer: bytes, provider: Provider) -> UpstreamFault:
    status = response.code
    label = str(status)
    if status == 429:
        headers: list[tuple[str, str]] = []
        retryAfter = response.headers.getRawHeaders(b"retry-after")
        if retryAfter and _plausibleRetryAfter(retryAfter[0]):
            headers.append(("Retry-After", retryAfter[0].decode("ascii")))
        return UpstreamFault(ApiError(ErrorCode.UPSTREAM_RATE_LIMITED, headers=headers), label)
    if status >= 500 or status in (401, 403, 404) or status < 400:
        return UpstreamFault(ApiError(ErrorCode.UPSTREAM_ERROR), label)
    return UpstreamFault(
        ApiError(
            ErrorCode.UPSTREAM_REJECTED,
            detail=_upstreamMessage(answer, provider),
            status=status,
        ),
        label,
    )


def _plausibleRetryAfter(value: bytes) -> bool:
    """
    Seconds, or an HTTP date, of sane length and printable ASCII only.
    """
    return 0 < len(value) <= 64 and all(32 <= byte < 127 for byte in value)


def _upstreamMessage(answer: bytes, provider: Provider) -> str:
    """
    The upstream's own error message (OpenAI's C{error.message}, else its
    text), bounded, with the provider's key never in it.
    """
    message = ""
    try:
        document = json.loads(answer)
    except ValueError:
        document = None
    if isinstance(document, dict):
        error = document.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            message = error["message"]
        elif isinstance(error, str):
            message = error
        elif isinstance(document.get("message"), str):
            message = document["message"]
    if not message:
        message = answer.decode("utf-8", "replace")
    message = message.strip()[:DETAIL_CHARACTERS]
    if provider.apiKey:
        message = message.replace(provider.apiKey, "[redacted]")
    return message or "The provider refused the request."
