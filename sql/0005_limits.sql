-- Limits of organizations and agents (decisions D11).
--
-- One row per organization (agent_id NULL) and at most one per agent of
-- it. Each of rpm (requests per calendar minute), tpm (tokens per calendar
-- minute) and max_output_tokens (the output cap assumed when a request
-- names none) is a positive integer, or NULL for unset. The composite
-- foreign key names the agent together with the row's organization, so a
-- row can never tie one organization's limits to another's agent.
--
-- version comes from one sequence for the whole table and is taken anew
-- by every insert and update (a trigger does it, whoever writes), so a
-- reader can tell the newer of two copies of a row. updated_at is for
-- operators.
--
-- Operators write the rows with svcctl (the schema owner); svc-auth only
-- reads them, so svc_auth_app may only SELECT, in one organization's
-- context as everywhere, and every row through svc_limits_rows() below.

CREATE SEQUENCE limits_version AS bigint;

CREATE TABLE limits (
    org_id             uuid NOT NULL REFERENCES organizations (org_id),
    agent_id           uuid,
    rpm                bigint CHECK (rpm > 0),
    tpm                bigint CHECK (tpm > 0),
    max_output_tokens  bigint CHECK (max_output_tokens > 0),
    -- set by the trigger limits_bump_version
    version            bigint NOT NULL,
    updated_at         timestamptz NOT NULL DEFAULT now(),
    FOREIGN KEY (agent_id, org_id) REFERENCES agents (agent_id, org_id)
);
ALTER SEQUENCE limits_version OWNED BY limits.version;
-- The organization's own row, and one row per agent.
CREATE UNIQUE INDEX limits_org_row ON limits (org_id) WHERE agent_id IS NULL;
CREATE UNIQUE INDEX limits_agent_row ON limits (org_id, agent_id) WHERE agent_id IS NOT NULL;

CREATE FUNCTION svc_limits_bump_version() RETURNS trigger
    LANGUAGE plpgsql
    AS $$
BEGIN
    NEW.version := nextval('limits_version');
    NEW.updated_at := now();
    RETURN NEW;
END
$$;

CREATE TRIGGER limits_bump_version
    BEFORE INSERT OR UPDATE ON limits
    FOR EACH ROW EXECUTE FUNCTION svc_limits_bump_version();

-- Row-level security, as sql/0002_row_level_security.sql does for the
-- other tenant tables.
ALTER TABLE limits ENABLE ROW LEVEL SECURITY;
ALTER TABLE limits FORCE ROW LEVEL SECURITY;
GRANT SELECT ON limits TO svc_auth_app;
CREATE POLICY tenant_isolation ON limits TO svc_auth_app
    USING (org_id = svc_current_org())
    WITH CHECK (org_id = svc_current_org());
DO $$
BEGIN
    EXECUTE format(
        'CREATE POLICY svc_owner_all ON limits TO %I USING (true) WITH CHECK (true)',
        current_user);
END
$$;

-- Each insert, update and delete is announced at commit on the channel of
-- sql/0003_change_notifications.sql, payload
-- 'limits:<org_id>:<agent_id>' (agent_id empty for the organization's
-- row); svc-auth re-reads that row and hands it to its change feed.
CREATE FUNCTION svc_notify_limits_change() RETURNS trigger
    LANGUAGE plpgsql
    AS $$
BEGIN
    IF TG_OP <> 'INSERT' THEN
        PERFORM pg_notify('svc_auth_changes',
            'limits:' || OLD.org_id::text || ':' || COALESCE(OLD.agent_id::text, ''));
    END IF;
    IF TG_OP <> 'DELETE' AND (TG_OP = 'INSERT'
            OR NEW.org_id IS DISTINCT FROM OLD.org_id
            OR NEW.agent_id IS DISTINCT FROM OLD.agent_id) THEN
        PERFORM pg_notify('svc_auth_changes',
            'limits:' || NEW.org_id::text || ':' || COALESCE(NEW.agent_id::text, ''));
    END IF;
    RETURN NULL;
END
$$;

CREATE TRIGGER limits_notify_change
    AFTER INSERT OR UPDATE OR DELETE ON limits
    FOR EACH ROW EXECUTE FUNCTION svc_notify_limits_change();

-- Every row of every organization, for svc-auth's table of limits and the
-- start of each change feed stream: svc_auth_app cannot read across
-- organizations, so this runs as the schema owner and returns ids and
-- numbers only.
CREATE FUNCTION svc_limits_rows()
    RETURNS TABLE (
        org_id uuid, agent_id uuid, rpm bigint, tpm bigint, max_output_tokens bigint,
        version bigint
    )
    LANGUAGE sql STABLE SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
    AS $$
        SELECT org_id, agent_id, rpm, tpm, max_output_tokens, version FROM public.limits
    $$;
REVOKE ALL ON FUNCTION svc_limits_rows() FROM PUBLIC;
GRANT EXECUTE ON FUNCTION svc_limits_rows() TO svc_auth_app;
