-- Memory settings of organizations and agents (decisions D13, "Settings").
--
-- At most one row per organization (agent_id NULL) and one per agent of
-- it. recall (memories put in a chat request's prompt) and observe
-- (answered exchanges kept for the worker) are each true (on), false
-- (off) or NULL (inherit): an agent's NULL takes its organization's
-- setting, an organization's NULL (or no row at all) is off. A row whose
-- two settings are NULL is kept, not deleted, so that svcctl can print
-- the version it took.
--
-- Shaped exactly like limits and budgets (sql/0005_limits.sql,
-- sql/0006_usage.sql): the composite foreign key ties an agent's row to
-- its own organization, version comes from one sequence and is taken anew
-- by every insert and update, svc_auth_app may only read, in one
-- organization's context, and every row through
-- svc_memory_settings_rows(); each change is announced on
-- svc_auth_changes as 'memory_settings:<org_id>:<agent_id or empty>'.

CREATE SEQUENCE memory_settings_version AS bigint;

CREATE TABLE memory_settings (
    org_id      uuid NOT NULL REFERENCES organizations (org_id),
    agent_id    uuid,
    recall      boolean,
    observe     boolean,
    -- set by the trigger memory_settings_bump_version
    version     bigint NOT NULL,
    updated_at  timestamptz NOT NULL DEFAULT now(),
    FOREIGN KEY (agent_id, org_id) REFERENCES agents (agent_id, org_id)
);
ALTER SEQUENCE memory_settings_version OWNED BY memory_settings.version;
CREATE UNIQUE INDEX memory_settings_org_row ON memory_settings (org_id) WHERE agent_id IS NULL;
CREATE UNIQUE INDEX memory_settings_agent_row ON memory_settings (org_id, agent_id)
    WHERE agent_id IS NOT NULL;

CREATE FUNCTION svc_memory_settings_bump_version() RETURNS trigger
    LANGUAGE plpgsql
    AS $$
BEGIN
    NEW.version := nextval('memory_settings_version');
    NEW.updated_at := now();
    RETURN NEW;
END
$$;

CREATE TRIGGER memory_settings_bump_version
    BEFORE INSERT OR UPDATE ON memory_settings
    FOR EACH ROW EXECUTE FUNCTION svc_memory_settings_bump_version();

ALTER TABLE memory_settings ENABLE ROW LEVEL SECURITY;
ALTER TABLE memory_settings FORCE ROW LEVEL SECURITY;
GRANT SELECT ON memory_settings TO svc_auth_app;
CREATE POLICY tenant_isolation ON memory_settings TO svc_auth_app
    USING (org_id = svc_current_org())
    WITH CHECK (org_id = svc_current_org());
DO $$
BEGIN
    EXECUTE format(
        'CREATE POLICY svc_owner_all ON memory_settings TO %I USING (true) WITH CHECK (true)',
        current_user);
END
$$;

CREATE FUNCTION svc_notify_memory_settings_change() RETURNS trigger
    LANGUAGE plpgsql
    AS $$
BEGIN
    IF TG_OP <> 'INSERT' THEN
        PERFORM pg_notify('svc_auth_changes',
            'memory_settings:' || OLD.org_id::text || ':' || COALESCE(OLD.agent_id::text, ''));
    END IF;
    IF TG_OP <> 'DELETE' AND (TG_OP = 'INSERT'
            OR NEW.org_id IS DISTINCT FROM OLD.org_id
            OR NEW.agent_id IS DISTINCT FROM OLD.agent_id) THEN
        PERFORM pg_notify('svc_auth_changes',
            'memory_settings:' || NEW.org_id::text || ':' || COALESCE(NEW.agent_id::text, ''));
    END IF;
    RETURN NULL;
END
$$;

CREATE TRIGGER memory_settings_notify_change
    AFTER INSERT OR UPDATE OR DELETE ON memory_settings
    FOR EACH ROW EXECUTE FUNCTION svc_notify_memory_settings_change();

-- Every row of every organization, for svc-auth's table of memory
-- settings and the start of each change feed stream (as
-- svc_limits_rows()): ids, switches and versions only.
CREATE FUNCTION svc_memory_settings_rows()
    RETURNS TABLE (org_id uuid, agent_id uuid, recall boolean, observe boolean, version bigint)
    LANGUAGE sql STABLE SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
    AS $$
        SELECT org_id, agent_id, recall, observe, version FROM public.memory_settings
    $$;
REVOKE ALL ON FUNCTION svc_memory_settings_rows() FROM PUBLIC;
GRANT EXECUTE ON FUNCTION svc_memory_settings_rows() TO svc_auth_app;
