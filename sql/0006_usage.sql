-- Budgets and the usage ledger (decisions D12).
--
-- budgets: at most one row per organization (agent_id NULL) and one per
-- agent of it, each capping the cost of a calendar day or month (UTC) in
-- nano-dollars (10^-9 US dollars, an integer: money is never a float).
-- Shaped exactly like limits (sql/0005_limits.sql): the composite foreign
-- key ties an agent's row to its own organization, version comes from one
-- sequence and is taken anew by every insert and update, svc_auth_app may
-- only read, in one organization's context, and every row through
-- svc_budget_rows(); each change is announced on svc_auth_changes as
-- 'budget:<org_id>:<agent_id or empty>'.
--
-- usage_ledger: one row per forwarded request, keyed by its request id so
-- that a batch sent twice is recorded once (INSERT ... ON CONFLICT
-- (request_id) DO NOTHING). Every column is a number, an identifier or a
-- name; never a message's content. svc_auth_app may insert and read, in
-- the row's organization's context (row-level security as everywhere),
-- never update or delete: the ledger is append-only for the service.
--
-- The ledger has no foreign keys on purpose: a row records what happened,
-- and svc-proxy keeps a batch until it is committed, so a row refused for
-- a reference (an organization removed by hand) would hold every later
-- row back for ever. The ids were validated by svc-auth when the request
-- was admitted.

CREATE SEQUENCE budgets_version AS bigint;

CREATE TABLE budgets (
    org_id      uuid NOT NULL REFERENCES organizations (org_id),
    agent_id    uuid,
    nano_usd    bigint NOT NULL CHECK (nano_usd > 0),
    period      text NOT NULL CHECK (period IN ('day', 'month')),
    -- set by the trigger budgets_bump_version
    version     bigint NOT NULL,
    updated_at  timestamptz NOT NULL DEFAULT now(),
    FOREIGN KEY (agent_id, org_id) REFERENCES agents (agent_id, org_id)
);
ALTER SEQUENCE budgets_version OWNED BY budgets.version;
CREATE UNIQUE INDEX budgets_org_row ON budgets (org_id) WHERE agent_id IS NULL;
CREATE UNIQUE INDEX budgets_agent_row ON budgets (org_id, agent_id) WHERE agent_id IS NOT NULL;

CREATE FUNCTION svc_budgets_bump_version() RETURNS trigger
    LANGUAGE plpgsql
    AS $$
BEGIN
    NEW.version := nextval('budgets_version');
    NEW.updated_at := now();
    RETURN NEW;
END
$$;

CREATE TRIGGER budgets_bump_version
    BEFORE INSERT OR UPDATE ON budgets
    FOR EACH ROW EXECUTE FUNCTION svc_budgets_bump_version();

ALTER TABLE budgets ENABLE ROW LEVEL SECURITY;
ALTER TABLE budgets FORCE ROW LEVEL SECURITY;
GRANT SELECT ON budgets TO svc_auth_app;
CREATE POLICY tenant_isolation ON budgets TO svc_auth_app
    USING (org_id = svc_current_org())
    WITH CHECK (org_id = svc_current_org());

CREATE FUNCTION svc_notify_budget_change() RETURNS trigger
    LANGUAGE plpgsql
    AS $$
BEGIN
    IF TG_OP <> 'INSERT' THEN
        PERFORM pg_notify('svc_auth_changes',
            'budget:' || OLD.org_id::text || ':' || COALESCE(OLD.agent_id::text, ''));
    END IF;
    IF TG_OP <> 'DELETE' AND (TG_OP = 'INSERT'
            OR NEW.org_id IS DISTINCT FROM OLD.org_id
            OR NEW.agent_id IS DISTINCT FROM OLD.agent_id) THEN
        PERFORM pg_notify('svc_auth_changes',
            'budget:' || NEW.org_id::text || ':' || COALESCE(NEW.agent_id::text, ''));
    END IF;
    RETURN NULL;
END
$$;

CREATE TRIGGER budgets_notify_change
    AFTER INSERT OR UPDATE OR DELETE ON budgets
    FOR EACH ROW EXECUTE FUNCTION svc_notify_budget_change();

-- Every budget of every organization, for svc-auth's table of budgets and
-- the start of each change feed stream (as svc_limits_rows()).
CREATE FUNCTION svc_budget_rows()
    RETURNS TABLE (org_id uuid, agent_id uuid, nano_usd bigint, period text, version bigint)
    LANGUAGE sql STABLE SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
    AS $$
        SELECT org_id, agent_id, nano_usd, period, version FROM public.budgets
    $$;
REVOKE ALL ON FUNCTION svc_budget_rows() FROM PUBLIC;
GRANT EXECUTE ON FUNCTION svc_budget_rows() TO svc_auth_app;

CREATE TABLE usage_ledger (
    request_id         text PRIMARY KEY CHECK (length(request_id) BETWEEN 1 AND 128),
    org_id             uuid NOT NULL,
    agent_id           uuid,
    token_id           uuid,
    model_requested    text NOT NULL,
    model              text NOT NULL,
    provider           text NOT NULL,
    upstream_model     text NOT NULL,
    stream             boolean NOT NULL,
    outcome            text NOT NULL CHECK (outcome IN ('ok', 'upstream_error', 'client_gone')),
    prompt_tokens      bigint NOT NULL CHECK (prompt_tokens >= 0),
    -- part of prompt_tokens
    cached_tokens      bigint NOT NULL CHECK (cached_tokens >= 0),
    completion_tokens  bigint NOT NULL CHECK (completion_tokens >= 0),
    -- part of completion_tokens
    reasoning_tokens   bigint NOT NULL CHECK (reasoning_tokens >= 0),
    tokens_from        text NOT NULL CHECK (tokens_from IN ('provider', 'reservation')),
    cost_nano_usd      bigint NOT NULL CHECK (cost_nano_usd >= 0),
    -- the digest of the model's price entry; empty when it had no price
    price_version      text NOT NULL,
    started_at         timestamptz NOT NULL,
    duration_us        bigint NOT NULL CHECK (duration_us >= 0),
    recorded_at        timestamptz NOT NULL DEFAULT now()
);
-- Spend and reports: an organization's rows in a span of time, and one
-- agent's.
CREATE INDEX usage_ledger_org_started ON usage_ledger (org_id, started_at);
CREATE INDEX usage_ledger_agent_started ON usage_ledger (org_id, agent_id, started_at);

ALTER TABLE usage_ledger ENABLE ROW LEVEL SECURITY;
ALTER TABLE usage_ledger FORCE ROW LEVEL SECURITY;
GRANT SELECT, INSERT ON usage_ledger TO svc_auth_app;
CREATE POLICY tenant_isolation ON usage_ledger TO svc_auth_app
    USING (org_id = svc_current_org())
    WITH CHECK (org_id = svc_current_org());

DO $$
DECLARE
    tenant_table text;
BEGIN
    FOREACH tenant_table IN ARRAY ARRAY['budgets', 'usage_ledger'] LOOP
        EXECUTE format(
            'CREATE POLICY svc_owner_all ON %I TO %I USING (true) WITH CHECK (true)',
            tenant_table, current_user);
    END LOOP;
END
$$;
