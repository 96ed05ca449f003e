-- The ledger keyed by the gateway, and its daily rollup (decisions D12,
-- amended).
--
-- usage_ledger's key becomes ledger_id, a UUID v7 that svc-proxy makes for
-- every forwarded request: never an id the client chose, so that requests
-- sharing an X-Request-ID (in one organization or in two) are each one
-- row. request_id stays, as the client's request id, an ordinary column:
-- many rows may hold the same one. No query of svc-auth looks rows up by
-- it, so it keeps no index.
--
-- Rows recorded before this migration were keyed by their request id,
-- which svc-proxy always made a canonical UUID: that UUID becomes their
-- ledger_id, so that a batch an older proxy sends again (ledger_id empty:
-- svc-auth then takes request_id as the key, the same way) is found as the
-- duplicate it is. Any other request id (none is known to exist) gets the
-- UUID spelled by its MD5, as svc-auth derives it too (svcd/auth/usage.py).
--
-- usage_rollup: the sums of the ledger's rows per organization, UTC day
-- (of started_at), agent, token and model, kept by the same statement that
-- inserts the rows (svcd/auth/store.py, Store.recordUsage): only the rows
-- that statement actually inserted are added, in the same transaction, so
-- the rollup equals the ledger's sums at every commit.
--
-- Each group is striped over up to 8 rows (slot, 0 to 7, taken from the
-- writing transaction's id): a transaction holds the rows it adds to until
-- it commits, and batches from several proxies (or svc-auth's several
-- connections) for one busy agent, token and model would otherwise queue
-- behind each other on one row; measured, 4 writers at once recorded half
-- the rows per second (bench/README.rst). Readers sum the slots, at most 8
-- rows where there would be one. GetSpend, GetUsage
-- and svcctl usage read it for whole days and the ledger only for the
-- partial days at the edges of a span, so a month costs the same at any
-- number of rows. The sums are numeric: a row's counts and cost are at most
-- 10^15 each (checked by svc-auth), and numeric never overflows however
-- many rows are added. requests is a count of rows, bigint.
--
-- Row-level security as for every table: svc_auth_app may read, insert and
-- add to (UPDATE of the sums only) its organization's rows, never delete or
-- move one. Owners (svcctl, migrations) see every row.
--
-- On a ledger holding rows, this migration rewrites the table once (the
-- UPDATE of ledger_id) and sums every row into the rollup: minutes for
-- tens of millions of rows, in the migration's one transaction.

ALTER TABLE usage_ledger ADD COLUMN ledger_id uuid;
UPDATE usage_ledger SET ledger_id = CASE
    WHEN request_id ~ '^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$'
        THEN request_id::uuid
    ELSE md5(request_id)::uuid
END;
ALTER TABLE usage_ledger ALTER COLUMN ledger_id SET NOT NULL;
ALTER TABLE usage_ledger DROP CONSTRAINT usage_ledger_pkey;
ALTER TABLE usage_ledger ADD CONSTRAINT usage_ledger_pkey PRIMARY KEY (ledger_id);

CREATE TABLE usage_rollup (
    org_id             uuid NOT NULL,
    -- the UTC calendar day of the rows' started_at
    day                date NOT NULL,
    agent_id           uuid,
    token_id           uuid,
    model              text NOT NULL,
    slot               smallint NOT NULL DEFAULT 0 CHECK (slot BETWEEN 0 AND 7),
    requests           bigint NOT NULL CHECK (requests >= 0),
    prompt_tokens      numeric NOT NULL CHECK (prompt_tokens >= 0),
    cached_tokens      numeric NOT NULL CHECK (cached_tokens >= 0),
    completion_tokens  numeric NOT NULL CHECK (completion_tokens >= 0),
    reasoning_tokens   numeric NOT NULL CHECK (reasoning_tokens >= 0),
    cost_nano_usd      numeric NOT NULL CHECK (cost_nano_usd >= 0),
    -- One row per group and slot; an agent or token that is NULL in the
    -- ledger is NULL here, and two NULLs are the same group.
    CONSTRAINT usage_rollup_key
        UNIQUE NULLS NOT DISTINCT (org_id, day, agent_id, token_id, model, slot)
)
-- Every batch adds to a few rows of the current day: room on each page
-- lets those updates stay heap-only (no index entry for a new version).
WITH (fillfactor = 50);
-- GetSpend of one agent (the key's index serves the organization's).
CREATE INDEX usage_rollup_agent_day ON usage_rollup (org_id, agent_id, day);

ALTER TABLE usage_rollup ENABLE ROW LEVEL SECURITY;
ALTER TABLE usage_rollup FORCE ROW LEVEL SECURITY;
GRANT SELECT, INSERT ON usage_rollup TO svc_auth_app;
GRANT UPDATE (
    requests, prompt_tokens, cached_tokens, completion_tokens, reasoning_tokens, cost_nano_usd
) ON usage_rollup TO svc_auth_app;
CREATE POLICY tenant_isolation ON usage_rollup TO svc_auth_app
    USING (org_id = svc_current_org())
    WITH CHECK (org_id = svc_current_org());
DO $$
BEGIN
    EXECUTE format(
        'CREATE POLICY svc_owner_all ON usage_rollup TO %I USING (true) WITH CHECK (true)',
        current_user);
END
$$;

INSERT INTO usage_rollup (
    org_id, day, agent_id, token_id, model, requests, prompt_tokens, cached_tokens,
    completion_tokens, reasoning_tokens, cost_nano_usd
)
SELECT org_id, (started_at AT TIME ZONE 'UTC')::date, agent_id, token_id, model, count(*),
    sum(prompt_tokens), sum(cached_tokens), sum(completion_tokens), sum(reasoning_tokens),
    sum(cost_nano_usd)
FROM usage_ledger
GROUP BY 1, 2, 3, 4, 5;
