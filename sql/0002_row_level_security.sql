-- Row-level security.
--
-- svc-auth runs every query as the role svc_auth_app (it issues SET ROLE
-- on each pooled connection), to which row-level security applies even
-- when POSTGRES_DSN names a superuser or the tables' owner. Each
-- transaction names its tenant with the setting svc.org_id; a query made
-- in one organization's context never sees another organization's rows.
--
-- One narrow exception serves authentication: a bearer names its token
-- id before anyone knows its organization, so svc.token_id lets exactly
-- that one token row be read (and nothing else), to check its secret.
--
-- The schema owner (whoever runs svcctl migrate) keeps full access
-- through the svc_owner_all policies: it owns the tables and could turn
-- row-level security off anyway, and svcctl needs it to create the first
-- organization.

DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'svc_auth_app') THEN
        CREATE ROLE svc_auth_app NOLOGIN NOSUPERUSER NOBYPASSRLS NOINHERIT;
    END IF;
END
$$;

-- Let the migrating user (and so, typically, the service's login user)
-- switch to the role.
DO $$
BEGIN
    IF NOT pg_has_role(current_user, 'svc_auth_app', 'MEMBER') THEN
        EXECUTE format('GRANT svc_auth_app TO %I', current_user);
    END IF;
END
$$;

GRANT USAGE ON SCHEMA public TO svc_auth_app;
GRANT SELECT, INSERT, UPDATE ON organizations, users, agents, tokens TO svc_auth_app;

-- The tenant of the current transaction, or NULL when none is set.
CREATE FUNCTION svc_current_org() RETURNS uuid
    LANGUAGE sql STABLE
    AS $$ SELECT NULLIF(current_setting('svc.org_id', true), '')::uuid $$;

-- The one token an authentication lookup may read, or NULL.
CREATE FUNCTION svc_lookup_token() RETURNS uuid
    LANGUAGE sql STABLE
    AS $$ SELECT NULLIF(current_setting('svc.token_id', true), '')::uuid $$;

ALTER TABLE organizations ENABLE ROW LEVEL SECURITY;
ALTER TABLE organizations FORCE ROW LEVEL SECURITY;
ALTER TABLE users ENABLE ROW LEVEL SECURITY;
ALTER TABLE users FORCE ROW LEVEL SECURITY;
ALTER TABLE agents ENABLE ROW LEVEL SECURITY;
ALTER TABLE agents FORCE ROW LEVEL SECURITY;
ALTER TABLE tokens ENABLE ROW LEVEL SECURITY;
ALTER TABLE tokens FORCE ROW LEVEL SECURITY;

CREATE POLICY tenant_isolation ON organizations TO svc_auth_app
    USING (org_id = svc_current_org())
    WITH CHECK (org_id = svc_current_org());
CREATE POLICY tenant_isolation ON users TO svc_auth_app
    USING (org_id = svc_current_org())
    WITH CHECK (org_id = svc_current_org());
CREATE POLICY tenant_isolation ON agents TO svc_auth_app
    USING (org_id = svc_current_org())
    WITH CHECK (org_id = svc_current_org());
CREATE POLICY tenant_isolation ON tokens TO svc_auth_app
    USING (org_id = svc_current_org())
    WITH CHECK (org_id = svc_current_org());
CREATE POLICY token_lookup ON tokens FOR SELECT TO svc_auth_app
    USING (token_id = svc_lookup_token());

DO $$
DECLARE
    tenant_table text;
BEGIN
    FOREACH tenant_table IN ARRAY ARRAY['organizations', 'users', 'agents', 'tokens'] LOOP
        EXECUTE format(
            'CREATE POLICY svc_owner_all ON %I TO %I USING (true) WITH CHECK (true)',
            tenant_table, current_user);
    END LOOP;
END
$$;
