-- What each ledger row's call was, and the request it was made for
-- (decisions D13, "The ledger's kinds" in docs/design.rst).
--
-- usage_ledger gains kind: 'chat' (a chat completion, what every row
-- recorded before this migration is), 'embedding' (POST /v1/embeddings, a
-- recall's query, a memory's content) or 'extraction' (the worker asking
-- a chat model for memories); and parent_request_id: the request another
-- call was made for (the chat request whose prompt a recall embedded, the
-- observation a worker's call served), NULL for a call a client made
-- itself. parent_request_id has request_id's bounds: 1 to 128 characters.
-- Both are part of a row's content, so a ledger id sent again with another
-- kind or parent is a conflict (svcd/auth/store.py compares every column).
--
-- usage_rollup gains kind in its group (org, day, agent, token, model,
-- kind, slot), so that reports by kind are summed from the rollup like
-- every other grouping. Every existing rollup row sums chat rows only, so
-- 'chat' is right for each. GetSpend sums every kind, as before.
--
-- What it costs on a big ledger: ADD COLUMN with a constant default (and
-- without one) is a change of the catalog only since PostgreSQL 11: no
-- row is rewritten, the existing rows read the default. A CHECK added with
-- the column would make PostgreSQL read every row to verify it, holding
-- the table's ACCESS EXCLUSIVE lock (RecordUsage waits, and the proxies
-- keep their rows) for the length of the scan; the checks are therefore
-- added NOT VALID: PostgreSQL enforces them on every row written from now
-- on, and the rows already there hold the default and NULL, which pass by
-- construction. (An operator who wants them marked validated may run
-- "ALTER TABLE usage_ledger VALIDATE CONSTRAINT usage_ledger_kind_check"
-- and the same for the other checks at any time: it scans without
-- blocking reads or writes.) The rollup's key is rebuilt with kind: one
-- index build over the rollup, which holds a few rows per group and day,
-- not one per request. The whole migration takes well under a second at
-- tens of millions of ledger rows.
--
-- Row-level security is untouched: both tables stay enabled and forced,
-- and their policies cover the new columns (a policy is on rows). The
-- service's grants stay as they were: it may insert both new columns, and
-- may update the rollup's sums only, never its kind.

ALTER TABLE usage_ledger
    ADD COLUMN kind text NOT NULL DEFAULT 'chat',
    ADD COLUMN parent_request_id text;
ALTER TABLE usage_ledger
    ADD CONSTRAINT usage_ledger_kind_check
        CHECK (kind IN ('chat', 'embedding', 'extraction')) NOT VALID,
    ADD CONSTRAINT usage_ledger_parent_request_id_check
        CHECK (length(parent_request_id) BETWEEN 1 AND 128) NOT VALID;

ALTER TABLE usage_rollup
    ADD COLUMN kind text NOT NULL DEFAULT 'chat';
ALTER TABLE usage_rollup
    ADD CONSTRAINT usage_rollup_kind_check
        CHECK (kind IN ('chat', 'embedding', 'extraction')) NOT VALID;
ALTER TABLE usage_rollup DROP CONSTRAINT usage_rollup_key;
ALTER TABLE usage_rollup ADD CONSTRAINT usage_rollup_key
    UNIQUE NULLS NOT DISTINCT (org_id, day, agent_id, token_id, model, kind, slot);
