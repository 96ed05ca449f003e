"""
What svc-auth remembers between calls, so that the hot path (a known token
with its right secret, an active agent) costs no database round trip and
no argon2 work, while revocation and status changes still take effect
within one second on every replica (decisions D7).

Freshness rule: an entry is trusted while the change listener
(L{svcd.auth.listener}) has been connected since before the entry was
read from the database, because then any later change of that row was
announced to us and dropped the entry. Without a connected listener an
entry is trusted for at most C{untrustedTTL} (one second) and then
re-read; re-reading costs a query, never an argon2 verification, because
the entry remembers which secret digest it was verified with and which
stored hash that was checked against.

A change announced for a token, and a read that such an announcement
overtook, leave the token's entry untrusted but not forgotten: the row is
read again before the entry answers, yet its secret stays verified (the
stored hash of a token never changes). Dropping it instead made the next
call of a token in use run argon2 again and queue for a cold slot, where a
flood of wrong secrets got it refused; and every new token's own INSERT
notification, when it came after the first read, did that.

All methods are called from grpcio's server threads and the listener
thread, so every access holds one lock; each holds it for a few dict
operations only.
"""

from __future__ import annotations

import math
import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable

import attrs

from svcd.auth.store.tokens import TokenRecord

# The readAt of an entry no read vouches for any more: never fresh, kept
# for its secret digest (see the module docstring).
_UNVOUCHED = -math.inf


@attrs.frozen
class CachedToken:
    record: TokenRecord
    # keyed digest of the secret that was verified against record.secretHash
    secretDigest: bytes = attrs.field(repr=False)
    readAt: float


@attrs.frozen
class CachedAgent:
    status: str | None  # None: not visible in that organization
    readAt: float


class ValidationCache:
    """
    Bounded LRU maps of verified tokens, known-wrong secrets and agent
    statuses, with the freshness rule of the module docstring.

    @param monotonic: a monotonic clock in seconds.
    """

    def __init__(
        self,
        monotonic: Callable[[], float],
        maximumEntries: int = 100_000,
        untrustedTTL: float = 1.0,
    ) -> None:
        self._monotonic = monotonic
        self._maximumEntries = maximumEntries
        self._untrustedTTL = untrustedTTL
        self._lock = threading.Lock()
        self._tokens: OrderedDict[uuid.UUID, CachedToken] = OrderedDict()
        self._wrongSecrets: OrderedDict[tuple[uuid.UUID, bytes], None] = OrderedDict()
        self._agents: OrderedDict[tuple[uuid.UUID, uuid.UUID], CachedAgent] = OrderedDict()
        # When the listener's current session began; None while it is down.
        self._listeningSince: float | None = None
        # Bumped by every invalidation, so a database read that raced with
        # a change is not stored (see L{epoch}).
        self._epoch = 0

    # Freshness

    def listening(self) -> None:
        """
        The change listener has (re)subscribed: from now on every change is
        announced. Entries read before now may have missed announcements
        made while we were not listening, so they stay on the short TTL.
        """
        with self._lock:
            self._listeningSince = self._monotonic()
            self._epoch += 1

    def isListening(self) -> bool:
        """
        Whether the change listener's session is up, so that what is read
        from now on stays trusted.
        """
        with self._lock:
            return self._listeningSince is not None

    def notListening(self) -> None:
        """
        The change listener lost its connection: fall back to the TTL.
        """
        with self._lock:
            self._listeningSince = None
            self._epoch += 1

    def _fresh(self, readAt: float) -> bool:
        since = self._listeningSince
        if since is not None and readAt >= since:
            return True
        return self._monotonic() - readAt < self._untrustedTTL

    def epoch(self) -> int:
        """
        Take before a database read; pass to the C{remember} call after it,
        which then stores nothing if an invalidation happened in between
        (the read may predate the change it announced).
        """
        with self._lock:
            return self._epoch

    def now(self) -> float:
        return self._monotonic()

    # Tokens

    def token(self, tokenID: uuid.UUID) -> tuple[CachedToken | None, bool]:
        """
        The cached entry for a token and whether it is fresh. A stale entry
        is still returned: its digest spares argon2 when the re-read row
        shows the same stored hash.
        """
        with self._lock:
            entry = self._tokens.get(tokenID)
            if entry is None:
                return None, False
            self._tokens.move_to_end(tokenID)
            return entry, self._fresh(entry.readAt)

    def rememberToken(self, entry: CachedToken, epoch: int) -> None:
        """
        Remember a verified token read at C{epoch}. If an invalidation came
        since, the read may predate the change it announced: the entry is
        kept untrusted, unless the token has an entry already.
        """
        tokenID = entry.record.tokenID
        with self._lock:
            if epoch != self._epoch:
                if tokenID in self._tokens:
                    return
                entry = attrs.evolve(entry, readAt=_UNVOUCHED)
            self._tokens[tokenID] = entry
            self._tokens.move_to_end(tokenID)
            while len(self._tokens) > self._maximumEntries:
                self._tokens.popitem(last=False)

    def isKnownWrongSecret(self, tokenID: uuid.UUID, digest: bytes) -> bool:
        """
        Was this exact secret already found wrong for this token? A secret
        never becomes right later (the hash of a token never changes), so
        these entries need no invalidation.
        """
        key = (tokenID, digest)
        with self._lock:
            if key in self._wrongSecrets:
                self._wrongSecrets.move_to_end(key)
                return True
            return False

    def rememberWrongSecret(self, tokenID: uuid.UUID, digest: bytes) -> None:
        with self._lock:
            self._wrongSecrets[(tokenID, digest)] = None
            while len(self._wrongSecrets) > self._maximumEntries:
                self._wrongSecrets.popitem(last=False)

    def forgetToken(self, tokenID: uuid.UUID) -> None:
        """
        The token changed: its entry is no longer trusted, and its next
        call reads the row again (a revocation then shows), but keeps the
        digest that spares argon2.
        """
        with self._lock:
            self._epoch += 1
            entry = self._tokens.get(tokenID)
            if entry is not None:
                self._tokens[tokenID] = attrs.evolve(entry, readAt=_UNVOUCHED)

    # Agents

    def agent(self, orgID: uuid.UUID, agentID: uuid.UUID) -> CachedAgent | None:
        """
        The agent's status as seen from C{orgID}, when fresh.
        """
        with self._lock:
            entry = self._agents.get((orgID, agentID))
            if entry is None or not self._fresh(entry.readAt):
                return None
            self._agents.move_to_end((orgID, agentID))
            return entry

    def rememberAgent(
        self, orgID: uuid.UUID, agentID: uuid.UUID, entry: CachedAgent, epoch: int
    ) -> None:
        with self._lock:
            if epoch != self._epoch:
                return
            self._agents[(orgID, agentID)] = entry
            self._agents.move_to_end((orgID, agentID))
            while len(self._agents) > self._maximumEntries:
                self._agents.popitem(last=False)

    def forgetAgent(self, agentID: uuid.UUID) -> None:
        with self._lock:
            self._epoch += 1
            for key in [key for key in self._agents if key[1] == agentID]:
                del self._agents[key]

    def forgetEverything(self) -> None:
        with self._lock:
            self._epoch += 1
            self._tokens.clear()
            self._agents.clear()
