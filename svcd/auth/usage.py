"""
The usage ledger's rules outside SQL (decisions D12, D12 amended, D14): what
a usage row from svc-proxy must be before it is recorded (each row checked
on its own), the span and grouping of a report, and a report as svcctl
usage prints it. The SQL itself is in
L{svcd.auth.store} (C{recordUsage}, C{spend}, C{usageSums}), shared by
svcctl and the gRPC methods.

Everything here is pure: no database, no clock but the one passed in.
"""

from __future__ import annotations

import csv
import datetime
import hashlib
import io
import re
import uuid
from collections.abc import Sequence
from typing import Any

import attrs

from svcd.auth.store.ledger import USAGE_GROUPINGS, UsageRecord, UsageSums
from svcd.common.ids import canonicalUUID, parseUUID
from svcd.common.money import formatDollars
from svcd.pb.auth.v1 import auth_pb2

# The most rows one RecordUsage call may carry: a bound on one
# transaction's work and on the message (a row is a few hundred bytes, so
# about 0.5 MB, well under gRPC's 4 MiB), and enough for a proxy to drain a
# backlog of 100000 rows in a hundred calls.
MAXIMUM_USAGE_BATCH = 1000

OUTCOMES = ("ok", "upstream_error", "client_gone")
TOKENS_FROM = ("provider", "reservation")
# What a row's call was (decisions D13); a row without one comes from a
# proxy older than the field, which only forwarded chat completions.
KINDS = ("chat", "embedding", "extraction")
DEFAULT_KIND = "chat"

# The longest request id, and the longest name (model, provider, price
# version) a row may hold, in characters: the proxy cuts a client's model
# name to 256 where it logs it, and a request id is a UUID.
MAXIMUM_REQUEST_ID_LENGTH = 128
MAXIMUM_NAME_LENGTH = 256
# Decisions D13: the memories one recall may put in a prompt are at most
# svc-memory's k (recall_k is at most 50).
MAXIMUM_MEMORIES = 100

_EPOCH = datetime.datetime(1970, 1, 1, tzinfo=datetime.UTC)
# The first microsecond past what a timestamp (and Python) can hold.
_END_OF_TIME_US = (
    int(
        (datetime.datetime(9999, 12, 31, 23, 59, 59, tzinfo=datetime.UTC) - _EPOCH).total_seconds()
        + 1
    )
    * 10**6
)
LATEST_UNIX_SECOND = _END_OF_TIME_US // 10**6 - 1

_NAME_FIELDS = ("model_requested", "model", "provider", "upstream_model", "price_version")

# The most tokens of each kind, and the highest cost in nano-dollars, one
# row may carry: 10^15 tokens is a billion times any model's context, and
# 10^15 nano-dollars is a million dollars for one request. A row past it is
# rejected as invalid (no proxy can have meant it: issue 28, item 8).
# Sums of rows are numeric in PostgreSQL and Python integers here, so no
# number of rows can overflow them; what a gRPC answer carries as int64 is
# clamped (L{clampInt64}).
MAXIMUM_ROW_AMOUNT = 10**15

# The largest int64: what GetSpend and GetUsage's counts answer at most.
INT64_MAX = 2**63 - 1

# The numbers of a row, each at least 0 and at most its maximum: the
# amounts the rollup and the reports add up at most MAXIMUM_ROW_AMOUNT, the
# duration (never summed) whatever int64 holds.
_COUNT_FIELDS: tuple[tuple[str, int], ...] = (
    ("prompt_tokens", MAXIMUM_ROW_AMOUNT),
    ("cached_tokens", MAXIMUM_ROW_AMOUNT),
    ("completion_tokens", MAXIMUM_ROW_AMOUNT),
    ("reasoning_tokens", MAXIMUM_ROW_AMOUNT),
    ("cost_nano_usd", MAXIMUM_ROW_AMOUNT),
    ("cache_write_tokens", MAXIMUM_ROW_AMOUNT),
    ("duration_us", INT64_MAX),
)

# Why a row of a RecordUsage batch is rejected.
INVALID = "invalid"
CONFLICT = "conflict"
REJECT_REASONS = (INVALID, CONFLICT)

# Report columns, in the order of D12's JSON and of the CSV header; the
# cache writes of decisions D14 after D12's, so that a reader of the CSV
# by position reads D12's columns where they were.
REPORT_COLUMNS = (
    "requests",
    "prompt_tokens",
    "cached_tokens",
    "completion_tokens",
    "reasoning_tokens",
    "cost_usd",
    "cache_write_tokens",
)

# ASCII digits only (decisions D12 amended): \d would take full-width ones.
_DATE = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}")


class BadUsage(ValueError):
    """
    A usage row, a span or a grouping that cannot be taken: the caller's
    mistake (the message names the field, and the row's index).
    """


def _uuidOrNone(text: str, field: str) -> uuid.UUID | None:
    if not text:
        return None
    parsed = parseUUID(text.lower())
    if parsed is None:
        raise BadUsage(f"{field} is not a UUID")
    return parsed


def keyOfRequestID(requestID: str) -> str:
    """
    The ledger key of a row from a proxy older than ledger_id (decisions
    D12 amended): its request id when that is a UUID (proxies always made
    it one), else the UUID spelled by the MD5 of its UTF-8 bytes. The same
    rule gave the rows recorded before sql/0007 their ledger_id, so a batch
    sent again by an older proxy is found as the duplicate it is.
    """
    canonical = canonicalUUID(requestID)
    if canonical is not None:
        return canonical
    return str(uuid.UUID(hashlib.md5(requestID.encode("utf-8"), usedforsecurity=False).hexdigest()))


def usageRecord(row: auth_pb2.UsageRow) -> UsageRecord:
    """
    A row of a RecordUsage batch as the ledger keeps it.

    @raise BadUsage: naming the field, for a value the ledger cannot hold
        or the proxy cannot have meant.
    """
    if not row.request_id:
        raise BadUsage("request_id is empty")
    if len(row.request_id) > MAXIMUM_REQUEST_ID_LENGTH:
        raise BadUsage(f"request_id is longer than {MAXIMUM_REQUEST_ID_LENGTH} characters")
    if "\x00" in row.request_id:
        raise BadUsage("request_id contains a NUL character")
    # The parent is a request id too, with its bounds; empty is none.
    if len(row.parent_request_id) > MAXIMUM_REQUEST_ID_LENGTH:
        raise BadUsage(f"parent_request_id is longer than {MAXIMUM_REQUEST_ID_LENGTH} characters")
    if "\x00" in row.parent_request_id:
        raise BadUsage("parent_request_id contains a NUL character")
    memories = row.memories if row.HasField("memories") else None
    if memories is not None and not 0 <= memories <= MAXIMUM_MEMORIES:
        raise BadUsage(f"memories must be between 0 and {MAXIMUM_MEMORIES}")
    kind = row.kind or DEFAULT_KIND
    if kind not in KINDS:
        raise BadUsage(f"kind must be one of {', '.join(KINDS)}")
    if row.ledger_id:
        canonical = canonicalUUID(row.ledger_id)
        if canonical is None:
            raise BadUsage("ledger_id is not a UUID")
        ledgerID = canonical
    else:
        ledgerID = keyOfRequestID(row.request_id)
    if not row.org_id:
        raise BadUsage("org_id is empty")
    orgID = _uuidOrNone(row.org_id, "org_id")
    assert orgID is not None
    agentID = _uuidOrNone(row.agent_id, "agent_id")
    tokenID = _uuidOrNone(row.token_id, "token_id")
    for field in _NAME_FIELDS:
        value: str = getattr(row, field)
        if len(value) > MAXIMUM_NAME_LENGTH:
            raise BadUsage(f"{field} is longer than {MAXIMUM_NAME_LENGTH} characters")
        if "\x00" in value:
            raise BadUsage(f"{field} contains a NUL character")
    if row.outcome not in OUTCOMES:
        raise BadUsage(f"outcome must be one of {', '.join(OUTCOMES)}")
    if row.tokens_from not in TOKENS_FROM:
        raise BadUsage(f"tokens_from must be one of {', '.join(TOKENS_FROM)}")
    for field, maximum in _COUNT_FIELDS:
        number: int = getattr(row, field)
        if not 0 <= number <= maximum:
            if number < 0:
                raise BadUsage(f"{field} must not be negative")
            raise BadUsage(f"{field} is more than {maximum}")
    if not 0 <= row.started_at_us < _END_OF_TIME_US:
        raise BadUsage("started_at_us is not a time between 1970 and 9999")
    return UsageRecord(
        ledgerID=ledgerID,
        requestID=row.request_id,
        orgID=orgID,
        agentID=agentID,
        tokenID=tokenID,
        modelRequested=row.model_requested,
        model=row.model,
        provider=row.provider,
        upstreamModel=row.upstream_model,
        stream=row.stream,
        outcome=row.outcome,
        promptTokens=row.prompt_tokens,
        cachedTokens=row.cached_tokens,
        completionTokens=row.completion_tokens,
        reasoningTokens=row.reasoning_tokens,
        tokensFrom=row.tokens_from,
        costNanoUSD=row.cost_nano_usd,
        priceVersion=row.price_version,
        startedAt=_EPOCH + datetime.timedelta(microseconds=row.started_at_us),
        durationUS=row.duration_us,
        kind=kind,
        parentRequestID=row.parent_request_id or None,
        memories=memories,
        cacheWriteTokens=row.cache_write_tokens,
    )


@attrs.frozen
class RejectedRow:
    """
    A row of a RecordUsage batch that is not recorded and never will be
    (decisions D12 amended): C{reason} L{INVALID} or L{CONFLICT}, C{detail}
    naming what is wrong (never a message's content, which a row never
    holds anyway). C{ledgerID} and C{orgID} are the row's as sent, for the
    log line; empty when absent.
    """

    index: int
    reason: str
    detail: str
    ledgerID: str
    orgID: str


@attrs.frozen
class CheckedBatch:
    """
    A RecordUsage batch with each row checked on its own: the rows the
    ledger can hold (C{records}, each at C{indices[i]} of the batch) and
    the others, rejected as L{INVALID}.
    """

    records: list[UsageRecord]
    indices: list[int]
    invalid: list[RejectedRow]


def checkBatch(rows: Sequence[auth_pb2.UsageRow]) -> CheckedBatch:
    """
    Check every row of a RecordUsage batch on its own, so that one bad row
    is set aside while the others are recorded (a bad row refusing the
    whole batch stalled the proxy's queue for ever: issue 28, item 6).

    @raise BadUsage: for a batch past L{MAXIMUM_USAGE_BATCH} rows, which is
        bad as a whole.
    """
    if len(rows) > MAXIMUM_USAGE_BATCH:
        raise BadUsage(f"rows holds {len(rows)} rows; at most {MAXIMUM_USAGE_BATCH} per call")
    records: list[UsageRecord] = []
    indices: list[int] = []
    invalid: list[RejectedRow] = []
    for index, row in enumerate(rows):
        try:
            records.append(usageRecord(row))
        except BadUsage as error:
            invalid.append(
                RejectedRow(
                    index=index,
                    reason=INVALID,
                    detail=str(error),
                    ledgerID=_printable(row.ledger_id),
                    orgID=_printable(row.org_id),
                )
            )
        else:
            indices.append(index)
    return CheckedBatch(records, indices, invalid)


def _printable(identifier: str) -> str:
    """
    An id from a row for a log line: as sent when it is an id at all,
    else cut short with its odd characters escaped.
    """
    if len(identifier) <= 40 and identifier.isprintable() and identifier.isascii():
        return identifier
    return repr(identifier[:40])


def unixMoment(seconds: int, field: str) -> datetime.datetime:
    """
    Seconds since the Unix epoch as an aware UTC datetime.

    @raise BadUsage: before 1970 or past 9999.
    """
    if not 0 <= seconds <= LATEST_UNIX_SECOND:
        raise BadUsage(f"{field} is not a time between 1970 and 9999")
    return _EPOCH + datetime.timedelta(seconds=seconds)


# Reports.


def parseMoment(text: str, field: str) -> datetime.datetime:
    """
    A report's bound: C{YYYY-MM-DD} (midnight UTC) or an RFC 3339 time with
    its offset (C{2025-06-01T12:00:00Z}, C{...+02:00}), as aware UTC.

    @raise BadUsage: naming C{field}, for anything else.
    """
    stripped = text.strip()
    problem = BadUsage(
        f"{field} must be a date (YYYY-MM-DD) or an RFC 3339 time such as"
        f" 2025-06-01T00:00:00Z, got {text!r}"
    )
    if not stripped.isascii():
        # Digits of other scripts (full-width, Arabic-Indic) are not RFC 3339's.
        raise problem
    if _DATE.fullmatch(stripped):
        try:
            return datetime.datetime.strptime(stripped, "%Y-%m-%d").replace(tzinfo=datetime.UTC)
        except ValueError:
            raise problem from None
    if len(stripped) < 20 or stripped[10] not in "Tt" or not _DATE.fullmatch(stripped[:10]):
        raise problem
    try:
        moment = datetime.datetime.fromisoformat(stripped[:10] + "T" + stripped[11:])
    except ValueError:
        raise problem from None
    if moment.tzinfo is None:
        raise problem
    try:
        return moment.astimezone(datetime.UTC)
    except OverflowError:
        raise problem from None


def _monthStart(moment: datetime.datetime, months: int = 0) -> datetime.datetime:
    index = moment.year * 12 + moment.month - 1 + months
    return datetime.datetime(index // 12, index % 12 + 1, 1, tzinfo=datetime.UTC)


def reportSpan(
    since: str | None, until: str | None, now: datetime.datetime
) -> tuple[datetime.datetime, datetime.datetime]:
    """
    A report's [since, until): each given as L{parseMoment} reads it, by
    default the start of the current UTC month and of the next one.

    @raise BadUsage: for a bound that cannot be read, or an empty span.
    """
    start = parseMoment(since, "since") if since else _monthStart(now)
    end = parseMoment(until, "until") if until else _monthStart(now, 1)
    if start >= end:
        raise BadUsage(
            f"since ({formatMoment(start)}) must come before until ({formatMoment(end)})"
        )
    return start, end


def reportGrouping(by: str | None) -> str:
    """
    What a report is grouped by; C{day} by default.

    @raise BadUsage: for anything but day, model, agent, token or kind.
    """
    if not by:
        return "day"
    if by not in USAGE_GROUPINGS:
        raise BadUsage(f"by must be one of {', '.join(USAGE_GROUPINGS)}, got {by!r}")
    return by


def formatMoment(moment: datetime.datetime) -> str:
    """
    RFC 3339 UTC, to the second (to the microsecond when it has any).
    """
    utc = moment.astimezone(datetime.UTC)
    if utc.microsecond:
        return utc.strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    return utc.strftime("%Y-%m-%dT%H:%M:%SZ")


def totalOf(sums: Sequence[UsageSums]) -> UsageSums:
    """
    The sum of a report's rows, exact (integers throughout).
    """
    return UsageSums(
        key="",
        requests=sum(each.requests for each in sums),
        promptTokens=sum(each.promptTokens for each in sums),
        cachedTokens=sum(each.cachedTokens for each in sums),
        completionTokens=sum(each.completionTokens for each in sums),
        reasoningTokens=sum(each.reasoningTokens for each in sums),
        costNanoUSD=sum(each.costNanoUSD for each in sums),
        cacheWriteTokens=sum(each.cacheWriteTokens for each in sums),
    )


def _columns(sums: UsageSums) -> dict[str, Any]:
    return {
        "requests": sums.requests,
        "prompt_tokens": sums.promptTokens,
        "cached_tokens": sums.cachedTokens,
        "completion_tokens": sums.completionTokens,
        "reasoning_tokens": sums.reasoningTokens,
        "cost_usd": formatDollars(sums.costNanoUSD),
        "cache_write_tokens": sums.cacheWriteTokens,
    }


def reportDocument(
    orgID: uuid.UUID,
    since: datetime.datetime,
    until: datetime.datetime,
    by: str,
    sums: Sequence[UsageSums],
) -> dict[str, Any]:
    """
    A report as svcctl usage prints it (decisions D12).
    """
    return {
        "org_id": str(orgID),
        "since": formatMoment(since),
        "until": formatMoment(until),
        "by": by,
        "rows": [{"key": each.key, **_columns(each)} for each in sums],
        "total": _columns(totalOf(sums)),
    }


def reportCSV(sums: Sequence[UsageSums]) -> str:
    """
    A report's rows as CSV, after a header line (svcctl usage --format
    csv).
    """
    output = io.StringIO()
    writer = csv.writer(output, lineterminator="\n")
    writer.writerow(("key", *REPORT_COLUMNS))
    for each in sums:
        columns = _columns(each)
        writer.writerow((each.key, *(columns[name] for name in REPORT_COLUMNS)))
    return output.getvalue()


def clampInt64(value: int) -> int:
    """
    C{value}, or the largest int64 when it is larger: a sum of the ledger
    is exact (numeric in PostgreSQL, an integer here) but an int64 field of
    a gRPC answer cannot hold every sum. Sums are never negative.
    """
    return min(value, INT64_MAX)


def usageSum(sums: UsageSums) -> auth_pb2.UsageSum:
    """
    A report's row (or total) as GetUsage answers it: the counts clamped
    to int64 (L{clampInt64}: tokens past 9.2 * 10^18 answer that much),
    cost_usd exact at any size, being a decimal string.
    """
    return auth_pb2.UsageSum(
        key=sums.key,
        requests=clampInt64(sums.requests),
        prompt_tokens=clampInt64(sums.promptTokens),
        cached_tokens=clampInt64(sums.cachedTokens),
        completion_tokens=clampInt64(sums.completionTokens),
        reasoning_tokens=clampInt64(sums.reasoningTokens),
        cost_usd=formatDollars(sums.costNanoUSD),
        cache_write_tokens=clampInt64(sums.cacheWriteTokens),
    )
