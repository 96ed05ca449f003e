"""
What an outbox (L{svcd.ledger.outbox}) and its journal
(L{svcd.ledger.journal}) call the records they carry, in their log lines
and refusals (L{OutboxWords}), and the usage ledger's words
(L{USAGE_WORDS}), their default.
"""

from __future__ import annotations

import attrs

__all__ = ["USAGE_WORDS", "OutboxWords"]


@attrs.frozen
class OutboxWords:
    """
    What an outbox carries, to whom and through which journal, in the
    words of its log lines and refusals: the usage ledger's by default
    (L{USAGE_WORDS}); svc-proxy's observations for svc-memory
    (decisions D13) have theirs, so that an operator reading
    "RecordUsage to svc-auth failed" knows it is the ledger, and
    "QueueObservations to svc-memory failed" that it is not.

    @ivar records: records in a count (C{"{rows} usage row(s) waiting"}).
    @ivar record: one record (C{"rejected usage row {key}"}).
    @ivar peer: the daemon that commits them.
    @ivar call: its gRPC method.
    @ivar journal: the journal's name at the start of a line.
    @ivar variable: the variable that names the journal.
    @ivar keyField: the log field that carries a record's key, besides
        C{key} (C{ledger_id} for usage rows, as before).
    """

    records: str = "usage row(s)"
    record: str = "usage row"
    peer: str = "svc-auth"
    call: str = "RecordUsage"
    journal: str = "Usage journal"
    variable: str = "SVC_USAGE_JOURNAL"
    keyField: str = "ledger_id"

    def fields(self) -> dict[str, str]:
        """
        The log fields of every line that names what is carried.
        """
        return {
            "records": self.records,
            "record": self.record,
            "peer": self.peer,
            "call": self.call,
            "journal": self.journal,
            "variable": self.variable,
        }


USAGE_WORDS = OutboxWords()
