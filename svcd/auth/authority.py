"""
The decisions of svc-auth, independent of gRPC: who a bearer is, whether an
agent may act, and the management of tokens.

Methods block (database, argon2) and run in grpcio's server threads; they
raise the L{Refusal} subclasses below, which the gRPC layer maps to status
codes one to one.

Validation takes the call's deadline: a call that waited for a cold slot or
for another call's read (single flight) and whose client has given up
meanwhile is dropped before it reaches PostgreSQL or argon2 (decisions
D10), so that a queue of abandoned calls costs nothing but the wait.
"""

from __future__ import annotations

import datetime
import threading
import time
import uuid
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

import attrs
from twisted.logger import Logger

from svcd.auth.cache import CachedAgent, CachedToken, ValidationCache
from svcd.auth.hashing import SecretDigester, hashSecret, verifySecret
from svcd.auth.limits import BudgetsTable, LimitsTable, MemorySettingsTable, RowTable
from svcd.auth.store import Store
from svcd.auth.store.budgets import BudgetRecord
from svcd.auth.store.ledger import UsageSums
from svcd.auth.store.limits import LimitsRecord
from svcd.auth.store.memorysettings import MemorySettingsRecord
from svcd.auth.store.tokens import TokenRecord
from svcd.auth.usage import (
    CONFLICT,
    INVALID,
    BadUsage,
    CheckedBatch,
    RejectedRow,
    reportGrouping,
    reportSpan,
    unixMoment,
)
from svcd.common.ids import parseUUID
from svcd.common.pat import ParsedToken, formatToken, newSecret, parseToken
from svcd.common.permissions import Permission
from svcd.common.pgtransactions import StoreRejected, StoreUnavailable, StoreValueRefused

AGENT_NOT_ACTIVE = "agent is not active"

# The longest token name CreateToken accepts, in characters.
MAXIMUM_NAME_LENGTH = 200
# The latest expiry a token can have (the store and Python's datetime both
# end with the year 9999).
LATEST_EXPIRY = datetime.datetime(9999, 12, 31, 23, 59, 59, tzinfo=datetime.UTC).timestamp()

_T = TypeVar("_T")
K = TypeVar("K", bound=Hashable)
_Row = TypeVar("_Row", LimitsRecord, BudgetRecord, MemorySettingsRecord)


def issueToken(
    store: Store,
    *,
    orgID: uuid.UUID,
    permissions: int,
    agentID: uuid.UUID | None = None,
    userID: uuid.UUID | None = None,
    name: str | None = None,
    expiresAt: datetime.datetime | None = None,
    createdBy: uuid.UUID | None = None,
) -> tuple[str, TokenRecord]:
    """
    Make a token and store only the argon2id hash of its secret; the full
    bearer value is returned once, here, and kept nowhere.
    """
    tokenID = uuid.uuid4()
    secret = newSecret()
    record = store.createToken(
        tokenID=tokenID,
        orgID=orgID,
        secretHash=hashSecret(secret),
        permissions=permissions,
        agentID=agentID,
        userID=userID,
        name=name,
        expiresAt=expiresAt,
        createdBy=createdBy,
    )
    return formatToken(tokenID, secret), record


class Refusal(Exception):
    """
    A request svc-auth answers with a non-OK status; the message goes to
    the caller, so it never holds a secret.
    """


class Unauthenticated(Refusal):
    pass


class PermissionDenied(Refusal):
    pass


class InvalidArgument(Refusal):
    pass


class Overloaded(Refusal):
    """
    Too many cache misses are already being verified; see L{Authority}.
    """


class Unavailable(Refusal):
    """
    The database failed; the caller sees Internal.
    """


class TryAgain(Refusal):
    """
    The database failed, and the call is safe to repeat: the caller sees
    Unavailable, which its client retries (RecordUsage, whose rows the
    proxy keeps until they are committed, and the ledger's reads). The
    older methods keep answering Internal for the same failure
    (L{Unavailable}), as their callers expect.
    """


class DeadlinePassed(Refusal):
    """
    The call's deadline passed before its turn came: its client has gone,
    and the work is not done. The caller sees DeadlineExceeded.
    """


@attrs.frozen
class Caller:
    """
    A validated token, as the rest of the service sees it.
    """

    tokenID: uuid.UUID
    orgID: uuid.UUID
    permissions: int
    agentID: uuid.UUID | None
    userID: uuid.UUID | None
    expiresAt: datetime.datetime | None


def _caller(record: TokenRecord) -> Caller:
    return Caller(
        tokenID=record.tokenID,
        orgID=record.orgID,
        permissions=record.permissions,
        agentID=record.agentID,
        userID=record.userID,
        expiresAt=record.expiresAt,
    )


def bearerFromMetadata(value: str | None) -> str:
    """
    The token of an C{authorization: Bearer <token>} metadata value.
    """
    if not value:
        raise Unauthenticated("missing authorization metadata")
    scheme, _, token = value.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise Unauthenticated("authorization metadata is not a bearer token")
    return token.strip()


class _Flights(Generic[K]):
    """
    The cold reads in progress, one per key (a token id, an agent): the
    first call for a key leads, later ones wait for it (single flight).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._inProgress: dict[K, threading.Event] = {}

    def join(self, key: K) -> tuple[threading.Event, bool]:
        """
        The event that is set when the read of C{key} in progress ends, and
        whether the caller is its leader (and must L{land} it).
        """
        with self._lock:
            event = self._inProgress.get(key)
            if event is not None:
                return event, False
            event = self._inProgress[key] = threading.Event()
            return event, True

    def land(self, key: K, event: threading.Event) -> None:
        with self._lock:
            if self._inProgress.get(key) is event:
                del self._inProgress[key]
        event.set()


class Authority:
    """
    Token and agent validation with the cache of L{svcd.auth.cache}, and the
    management operations of decisions D6.

    Cold work (a database read, and argon2 for a secret not seen before) is
    admitted through a semaphore of C{coldSlots}, waiting at most
    C{coldWait} seconds; a flood of unknown ids or wrong secrets can then
    occupy only that many threads, while cached valid tokens never wait.
    Concurrent cold calls for one token id, or one agent, do that work
    once: the first leads, the others wait (at most C{coldWait}) and take
    its cached answer.

    Every validation takes the call's C{deadline} (in C{monotonic} seconds,
    None for none): waits end by it, and past it the call raises
    L{DeadlinePassed} before a database read or an argon2 verification.

    @param wallClock: Unix time in seconds, for expiry.
    @param monotonic: the clock of deadlines.
    @param limits: the table of limits validation answers carry, if any.
    @param budgets: the table of budgets validation answers carry, if any.
    @param memorySettings: the table of memory settings validation answers
        carry, if any.
    """

    log = Logger()

    def __init__(
        self,
        store: Store,
        cache: ValidationCache,
        wallClock: Callable[[], float],
        digester: SecretDigester | None = None,
        coldSlots: int = 4,
        coldWait: float = 0.25,
        monotonic: Callable[[], float] = time.monotonic,
        limits: LimitsTable | None = None,
        budgets: BudgetsTable | None = None,
        memorySettings: MemorySettingsTable | None = None,
    ) -> None:
        self._store = store
        self._limits = limits
        self._budgets = budgets
        self._memorySettings = memorySettings
        self._monotonic = monotonic
        self._cache = cache
        self._wallClock = wallClock
        self._digester = digester if digester is not None else SecretDigester()
        self._coldSlots = threading.BoundedSemaphore(coldSlots)
        self._coldWait = coldWait
        self._tokenFlights: _Flights[uuid.UUID] = _Flights()
        self._agentFlights: _Flights[tuple[uuid.UUID, uuid.UUID]] = _Flights()

    # Deadlines

    def _waitFor(self, deadline: float | None) -> float:
        """
        How long a wait may last: C{coldWait}, or less when the deadline
        comes first.
        """
        if deadline is None:
            return self._coldWait
        return max(0.0, min(self._coldWait, deadline - self._monotonic()))

    def _inTime(self, deadline: float | None) -> None:
        """
        Raise L{DeadlinePassed} when C{deadline} has passed.
        """
        if deadline is not None and self._monotonic() >= deadline:
            raise DeadlinePassed("the call's deadline passed before its turn came")

    # Validation

    def validateToken(self, bearer: str, deadline: float | None = None) -> Caller:
        """
        Who presents this bearer? Unauthenticated for a malformed, unknown,
        wrong, expired or revoked token.
        """
        parsed = parseToken(bearer)
        if parsed is None:
            raise Unauthenticated("malformed token")
        digest = self._digester.digest(parsed.secret)
        caller, cached = self._answerFromCache(parsed, digest)
        if caller is not None:
            return caller
        flight, leading = self._tokenFlights.join(parsed.tokenID)
        if not leading:
            # Another call is reading and verifying this very token (a
            # burst on a cold cache: svc-auth just started, or the entry was
            # dropped). Its answer, once cached, is almost always ours too;
            # without this wait each call of the burst would run argon2 and
            # queue for a cold slot, and the burst would miss its deadlines.
            flight.wait(self._waitFor(deadline))
            caller, cached = self._answerFromCache(parsed, digest)
            if caller is not None:
                return caller
            # Nothing cached that answers us (another secret, an unknown id,
            # a change meanwhile): do the work ourselves.
        try:
            return self._validateCold(parsed, digest, cached, deadline)
        finally:
            if leading:
                self._tokenFlights.land(parsed.tokenID, flight)

    def _answerFromCache(
        self, parsed: ParsedToken, digest: bytes
    ) -> tuple[Caller | None, CachedToken | None]:
        """
        What the cache settles without the database: the caller, or
        Unauthenticated (raised) for a secret known to be wrong. Else no
        caller, with the token's entry if a stale one is cached (its digest
        may still spare argon2).
        """
        cached, fresh = self._cache.token(parsed.tokenID)
        if cached is not None and fresh:
            if not self._digester.same(cached.secretDigest, digest):
                # Right token, wrong secret: the cached digest proves it
                # without argon2.
                raise Unauthenticated("invalid token")
            return self._usable(cached.record), cached
        if self._cache.isKnownWrongSecret(parsed.tokenID, digest):
            raise Unauthenticated("invalid token")
        return None, cached

    def _validateCold(
        self,
        parsed: ParsedToken,
        digest: bytes,
        cached: CachedToken | None,
        deadline: float | None,
    ) -> Caller:
        """
        Read the token's row and verify the secret (argon2 unless C{cached}
        proves it), within a cold slot; cache the outcome.
        """
        self._inTime(deadline)
        if cached is not None and self._digester.same(cached.secretDigest, digest):
            # An entry gone stale (no listener vouched for it, or a change
            # was announced for it) whose secret its digest proves: what is
            # left is a read of the row, which is not the work the cold
            # slots bound (argon2), and a flood of wrong secrets holding
            # every slot must not refuse a token in use. Only a stored hash
            # that changed meanwhile needs a slot.
            record, epoch, readAt = self._readToken(parsed, deadline)
            if record.secretHash == cached.record.secretHash:
                self._cache.rememberToken(CachedToken(record, digest, readAt), epoch)
                return self._usable(record)
        if not self._coldSlots.acquire(timeout=self._waitFor(deadline)):
            self._inTime(deadline)
            raise Overloaded("too many token validations in progress")
        try:
            record, epoch, readAt = self._readToken(parsed, deadline)
            if (
                cached is not None
                and cached.record.secretHash == record.secretHash
                and self._digester.same(cached.secretDigest, digest)
            ):
                verified = True  # same secret, same stored hash: no argon2
            else:
                self._inTime(deadline)
                verified = verifySecret(record.secretHash, parsed.secret)
            if not verified:
                self._cache.rememberWrongSecret(parsed.tokenID, digest)
                raise Unauthenticated("invalid token")
            self._cache.rememberToken(CachedToken(record, digest, readAt), epoch)
        finally:
            self._coldSlots.release()
        return self._usable(record)

    def _readToken(
        self, parsed: ParsedToken, deadline: float | None
    ) -> tuple[TokenRecord, int, float]:
        """
        The token's row, with the cache's epoch and time taken before the
        read (what L{ValidationCache.rememberToken} needs to know whether a
        change came meanwhile); Unauthenticated when there is no such token.
        """
        epoch = self._cache.epoch()
        readAt = self._cache.now()
        record = self._read(lambda: self._store.tokenForAuthentication(parsed.tokenID), deadline)
        if record is None:
            raise Unauthenticated("invalid token")
        return record, epoch, readAt

    def _usable(self, record: TokenRecord) -> Caller:
        if record.revokedAt is not None:
            raise Unauthenticated("token revoked")
        if record.expiresAt is not None and self._wallClock() >= record.expiresAt.timestamp():
            raise Unauthenticated("token expired")
        return _caller(record)

    def validateAgent(
        self, bearer: str, agentIDText: str, orgIDText: str, deadline: float | None = None
    ) -> str:
        """
        May the holder of C{bearer} act as this agent of this organization?
        Returns the agent's status (always "active").
        """
        caller = self.validateToken(bearer, deadline)
        agentID = parseUUID(agentIDText)
        if agentID is None:
            raise InvalidArgument("agent_id is not a UUID")
        orgID = parseUUID(orgIDText)
        if orgID is None:
            raise InvalidArgument("org_id is not a UUID")
        if orgID != caller.orgID:
            raise PermissionDenied("agent is not authorized for this token's organization")
        if caller.agentID is not None and caller.agentID != agentID:
            raise PermissionDenied("token is bound to another agent")
        status = self._agentStatus(orgID, agentID, deadline)
        if status is None:
            raise PermissionDenied("agent is not authorized for this token's organization")
        if status != "active":
            raise PermissionDenied(AGENT_NOT_ACTIVE)
        return status

    def _agentStatus(
        self, orgID: uuid.UUID, agentID: uuid.UUID, deadline: float | None
    ) -> str | None:
        cached = self._cache.agent(orgID, agentID)
        if cached is not None:
            return cached.status
        key = (orgID, agentID)
        flight, leading = self._agentFlights.join(key)
        if not leading:
            # As for tokens: a burst of first calls for one agent reads it
            # once instead of queueing every call for a database connection.
            flight.wait(self._waitFor(deadline))
            cached = self._cache.agent(orgID, agentID)
            if cached is not None:
                return cached.status
        try:
            epoch = self._cache.epoch()
            readAt = self._cache.now()
            agent = self._read(lambda: self._store.agentInOrganization(orgID, agentID), deadline)
            status = None if agent is None else agent.status
            self._cache.rememberAgent(orgID, agentID, CachedAgent(status, readAt), epoch)
            return status
        finally:
            if leading:
                self._agentFlights.land(key, flight)

    # Limits (decisions D11)

    def limitsOf(
        self, orgID: uuid.UUID, agentID: uuid.UUID | None, deadline: float | None = None
    ) -> LimitsRecord | None:
        """
        The limits row of an organization (C{agentID} None) or of one of its
        agents as it is now, for a validation answer: from the table of
        limits, never from a cached validation, so that a change shows at
        once. While the table cannot vouch for it (the change listener is
        not listening), the row is read from the database. None when there
        is no row, or no table.
        """
        if self._limits is None:
            return None
        return self._rowOf(self._limits, self._store.limits, orgID, agentID, deadline)

    def budgetOf(
        self, orgID: uuid.UUID, agentID: uuid.UUID | None, deadline: float | None = None
    ) -> BudgetRecord | None:
        """
        The budget of an organization (C{agentID} None) or of one of its
        agents as it is now (decisions D12), exactly as L{limitsOf} finds a
        limits row.
        """
        if self._budgets is None:
            return None
        return self._rowOf(self._budgets, self._store.budget, orgID, agentID, deadline)

    def memorySettingsOf(
        self, orgID: uuid.UUID, agentID: uuid.UUID | None, deadline: float | None = None
    ) -> MemorySettingsRecord | None:
        """
        The memory settings row of an organization (C{agentID} None) or of
        one of its agents as it is now (decisions D13), exactly as
        L{limitsOf} finds a limits row.
        """
        if self._memorySettings is None:
            return None
        return self._rowOf(
            self._memorySettings, self._store.memorySettings, orgID, agentID, deadline
        )

    def _rowOf(
        self,
        table: RowTable[_Row],
        read: Callable[[uuid.UUID, uuid.UUID | None], _Row | None],
        orgID: uuid.UUID,
        agentID: uuid.UUID | None,
        deadline: float | None,
    ) -> _Row | None:
        known, row = table.lookup(orgID, agentID)
        if known:
            return row
        readAt = table.now()
        row = self._read(lambda: read(orgID, agentID), deadline)
        table.remember(orgID, agentID, row, readAt)
        return row

    # The usage ledger (decisions D12)

    def recordUsage(
        self, batch: CheckedBatch, deadline: float | None = None
    ) -> tuple[int, int, list[RejectedRow]]:
        """
        Record a checked batch of usage rows (L{svcd.auth.usage.checkBatch})
        in one transaction: how many were recorded now, how many were
        recorded already with the same content, and the rows rejected
        (those the checks found invalid, the conflicts, and any the
        database refused), in the batch's order, once committed. A
        database failure is L{TryAgain}: nothing was committed, and the
        batch may be sent again as it is.
        """
        written = self._write(deadline, lambda: self._store.recordUsage(batch.records), TryAgain)
        rejected = list(batch.invalid)
        for reason, rows in ((CONFLICT, written.conflicts), (INVALID, written.refused)):
            for position, detail in rows:
                record = batch.records[position]
                rejected.append(
                    RejectedRow(
                        index=batch.indices[position],
                        reason=reason,
                        detail=detail,
                        ledgerID=record.ledgerID,
                        orgID=str(record.orgID),
                    )
                )
        rejected.sort(key=lambda each: each.index)
        return written.recorded, written.duplicates, rejected

    def spend(
        self,
        orgIDText: str,
        agentIDText: str,
        sinceUnix: int,
        untilUnix: int,
        deadline: float | None = None,
    ) -> int:
        """
        What an organization (or one of its agents) spent in [since,
        until), in nano-dollars: the proxy's way to take a budget's count
        again when Redis lost it, and to bring its count back to the ledger's.
        No caller metadata: with mutual TLS, L{svcd.auth.callers} admits only
        the subjects of SVC_GRPC_INTERNAL_SUBJECTS.
        """
        orgID = parseUUID(orgIDText.lower())
        if orgID is None:
            raise InvalidArgument("org_id is not a UUID")
        agentID: uuid.UUID | None = None
        if agentIDText:
            agentID = parseUUID(agentIDText.lower())
            if agentID is None:
                raise InvalidArgument("agent_id is not a UUID")
        try:
            since = unixMoment(sinceUnix, "since_unix")
            until = unixMoment(untilUnix, "until_unix")
        except BadUsage as error:
            raise InvalidArgument(str(error)) from None
        if until <= since:
            return 0
        return self._read(
            lambda: self._store.spend(orgID, agentID, since, until), deadline, TryAgain
        )

    def usage(
        self,
        bearer: str,
        agentIDText: str,
        sinceText: str,
        untilText: str,
        byText: str,
        deadline: float | None = None,
    ) -> tuple[uuid.UUID, datetime.datetime, datetime.datetime, str, list[UsageSums]]:
        """
        The usage sums of the caller's own organization (needs UsageRead),
        or of one of its agents: the organization, the span, the grouping
        and the sums. An agent of another organization is PermissionDenied
        (never NotFound), and a token bound to an agent sees that agent's
        usage only, as it acts only as that agent.
        """
        caller = self._authorize(bearer, Permission.UsageRead, deadline)
        agentID: uuid.UUID | None = None
        if agentIDText:
            agentID = parseUUID(agentIDText.lower())
            if agentID is None:
                raise InvalidArgument("agent_id is not a UUID")
        if caller.agentID is not None:
            if agentID not in (None, caller.agentID):
                raise PermissionDenied("token is bound to another agent")
            agentID = caller.agentID
        try:
            now = datetime.datetime.fromtimestamp(self._wallClock(), datetime.UTC)
            since, until = reportSpan(sinceText, untilText, now)
            by = reportGrouping(byText)
        except BadUsage as error:
            raise InvalidArgument(str(error)) from None
        if agentID is not None and self._agentStatus(caller.orgID, agentID, deadline) is None:
            raise PermissionDenied("agent is not authorized for this token's organization")
        sums = self._read(
            lambda: self._store.usageSums(caller.orgID, agentID, since, until, by),
            deadline,
            TryAgain,
        )
        return caller.orgID, since, until, by, sums

    # Management (decisions D6)

    def _authorize(self, bearer: str, needed: Permission, deadline: float | None) -> Caller:
        caller = self.validateToken(bearer, deadline)
        if not caller.permissions & needed:
            raise PermissionDenied(f"token lacks the {needed.name} permission")
        return caller

    def createToken(
        self,
        bearer: str,
        *,
        name: str,
        permissions: int,
        agentIDText: str,
        expiresInSeconds: int,
        deadline: float | None = None,
    ) -> tuple[str, TokenRecord]:
        """
        Issue a token in the caller's organization, never with a permission
        bit the caller lacks; a caller bound to an agent can only issue
        tokens bound to that agent.

        Any int64 is a permission bitmap (svcctl lets operators set bits
        that D3 does not name yet): a bit the caller does not hold is
        PermissionDenied, as D6 says, whatever its meaning.
        """
        caller = self._authorize(bearer, Permission.TokenCreate, deadline)
        if permissions & ~caller.permissions:
            raise PermissionDenied("cannot grant permissions the caller does not hold")
        if expiresInSeconds < 0:
            raise InvalidArgument("expires_in_seconds must not be negative")
        if expiresInSeconds and self._wallClock() + expiresInSeconds > LATEST_EXPIRY:
            raise InvalidArgument("expires_in_seconds ends after the year 9999")
        if len(name) > MAXIMUM_NAME_LENGTH:
            raise InvalidArgument(f"name is longer than {MAXIMUM_NAME_LENGTH} characters")
        if "\x00" in name:
            raise InvalidArgument("name contains a NUL character")
        agentID: uuid.UUID | None = None
        if agentIDText:
            agentID = parseUUID(agentIDText)
            if agentID is None:
                raise InvalidArgument("agent_id is not a UUID")
        if caller.agentID is not None:
            if agentID not in (None, caller.agentID):
                raise PermissionDenied("token is bound to another agent")
            agentID = caller.agentID
        if agentID is not None and self._agentStatus(caller.orgID, agentID, deadline) is None:
            raise PermissionDenied("agent is not authorized for this token's organization")
        expiresAt = None
        if expiresInSeconds:
            expiresAt = datetime.datetime.fromtimestamp(
                self._wallClock() + expiresInSeconds, datetime.UTC
            ).replace(microsecond=0)
        return self._write(
            deadline,
            lambda: issueToken(
                self._store,
                orgID=caller.orgID,
                permissions=permissions,
                agentID=agentID,
                userID=caller.userID,
                name=name or None,
                expiresAt=expiresAt,
                createdBy=caller.tokenID,
            ),
        )

    def revokeToken(
        self, bearer: str, tokenIDText: str, deadline: float | None = None
    ) -> TokenRecord:
        """
        Revoke a token of the caller's organization. A token id of another
        organization is PermissionDenied, never NotFound, so ids cannot be
        probed across tenants.
        """
        caller = self._authorize(bearer, Permission.TokenRevoke, deadline)
        tokenID = parseUUID(tokenIDText)
        if tokenID is None:
            raise InvalidArgument("token_id is not a UUID")
        record = self._write(deadline, lambda: self._store.revokeToken(tokenID, orgID=caller.orgID))
        if record is None:
            raise PermissionDenied("token is not in the caller's organization")
        self._cache.forgetToken(tokenID)
        return record

    def listTokens(self, bearer: str, deadline: float | None = None) -> list[TokenRecord]:
        caller = self._authorize(bearer, Permission.TokenList, deadline)
        return self._read(lambda: self._store.listTokens(caller.orgID), deadline)

    # Database access with failures mapped to refusals

    def _read(
        self,
        query: Callable[[], _T],
        deadline: float | None,
        down: type[Refusal] = Unavailable,
    ) -> _T:
        """
        Run a read; a database failure is C{down} (L{Unavailable}, seen as
        Internal, or L{TryAgain}, seen as Unavailable).
        """
        self._inTime(deadline)
        try:
            return query()
        except StoreValueRefused as error:
            raise self._valueRefused(error) from error
        except StoreUnavailable as error:
            self.log.warn("Database unavailable: {problem}", problem=str(error))
            raise down("database unavailable") from error

    def _write(
        self,
        deadline: float | None,
        change: Callable[[], _T],
        down: type[Refusal] = Unavailable,
    ) -> _T:
        self._inTime(deadline)
        try:
            return change()
        except StoreValueRefused as error:
            raise self._valueRefused(error) from error
        except StoreRejected as error:
            raise InvalidArgument("the request conflicts with stored data") from error
        except StoreUnavailable as error:
            self.log.warn("Database unavailable: {problem}", problem=str(error))
            raise down("database unavailable") from error

    def _valueRefused(self, error: StoreValueRefused) -> InvalidArgument:
        """
        The database refused a value of the request that the checks above
        let through: the client's mistake, and no outage (decisions D10).
        """
        self.log.info("The database refused a value of a request: {problem}", problem=str(error))
        return InvalidArgument("a value of the request cannot be stored")
