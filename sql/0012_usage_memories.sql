-- How many memories context assembly put in a chat request's prompt
-- (decisions D13, "Context assembly" in docs/design.rst).
--
-- usage_ledger gains memories: NULL when recall was off for the request
-- (every row recorded before this migration, and every row of another
-- kind), else the memories injected, 0 when none were found or the recall
-- failed. Part of a row's content, as every column is: a ledger id sent
-- again with another count is a conflict (svcd/auth/store.py).
--
-- As sql/0008_usage_kind.sql: ADD COLUMN without a default changes the
-- catalog only, and the check is added NOT VALID, so that no row is read
-- under the table's exclusive lock (the rows already there hold NULL,
-- which passes). The rollup is untouched: it sums tokens and costs, and a
-- report of memories per request reads the ledger.

ALTER TABLE usage_ledger ADD COLUMN memories integer;
ALTER TABLE usage_ledger
    ADD CONSTRAINT usage_ledger_memories_check
        CHECK (memories BETWEEN 0 AND 100) NOT VALID;
