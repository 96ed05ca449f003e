-- Memories and observations of svc-memory (decisions D13).
--
-- A memory is a short text an agent should remember, in one scope: an
-- organization, one of its agents and, within the agent, a subject (the
-- end user the agent serves, chosen by the caller; '' by default). It is
-- stored with the vector that the embedding model named in the row made of
-- its content, so that svc-memory can search the scope exactly.
--
-- svc-memory runs every query as its own role, svc_memory_app (it issues
-- SET ROLE on each pooled connection), to which row-level security applies
-- whatever role POSTGRES_DSN logs in as, exactly as svc_auth_app does for
-- svc-auth (sql/0002_row_level_security.sql). The role may touch these two
-- tables and nothing of svc-auth's: a fault of svc-memory can never read a
-- token's hash or change a limit. Each transaction names its organization
-- with the setting svc.org_id, read by svc_current_org() of 0002.
--
-- Forgetting is deletion: no history table, no soft delete. A deleted
-- memory's row and vector leave the table at commit (and PostgreSQL's own
-- storage at the next vacuum); every replica drops it from its cache on
-- the notification below.

DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'svc_memory_app') THEN
        CREATE ROLE svc_memory_app NOLOGIN NOSUPERUSER NOBYPASSRLS NOINHERIT;
    END IF;
END
$$;

-- Let the migrating user (and so, typically, the service's login user and
-- svcctl) switch to the role.
DO $$
BEGIN
    IF NOT pg_has_role(current_user, 'svc_memory_app', 'MEMBER') THEN
        EXECUTE format('GRANT svc_memory_app TO %I', current_user);
    END IF;
END
$$;

GRANT USAGE ON SCHEMA public TO svc_memory_app;

-- The vector is the embedding's float32 components, little-endian, 4 bytes
-- each (bytea rather than real[]): one value that svc-memory turns into a
-- numpy row without a Python float per component, 4 bytes a component on
-- disk without real[]'s per-array header, and the very bytes an OpenAI
-- base64 embedding decodes to. STORAGE EXTERNAL: out of line without
-- compression, which random floats would only waste CPU on.
--
-- The composite foreign key ties a memory to an agent of its own
-- organization (checked by PostgreSQL whatever row-level security hides).
CREATE TABLE memories (
    id                 uuid PRIMARY KEY,
    org_id             uuid NOT NULL,
    agent_id           uuid NOT NULL,
    subject            text NOT NULL DEFAULT ''
                       CHECK (subject ~ '^[A-Za-z0-9._:@-]{0,128}$'),
    content            text NOT NULL CHECK (char_length(content) BETWEEN 1 AND 4000),
    -- A JSON object of at most 4 KiB as svc-memory writes it compactly;
    -- the bound here is a backstop on PostgreSQL's own spelling.
    metadata           jsonb NOT NULL DEFAULT '{}'::jsonb
                       CHECK (jsonb_typeof(metadata) = 'object'
                              AND octet_length(metadata::text) <= 16384),
    source             text NOT NULL CHECK (source IN ('api', 'extracted')),
    source_request_id  text CHECK (char_length(source_request_id) <= 200),
    embedding_model    text NOT NULL CHECK (char_length(embedding_model) BETWEEN 1 AND 200),
    dimensions         integer NOT NULL CHECK (dimensions BETWEEN 1 AND 16384),
    vector             bytea NOT NULL CHECK (octet_length(vector) = 4 * dimensions),
    created_at         timestamptz NOT NULL DEFAULT now(),
    updated_at         timestamptz NOT NULL DEFAULT now(),
    FOREIGN KEY (agent_id, org_id) REFERENCES agents (agent_id, org_id) ON DELETE CASCADE
);
ALTER TABLE memories ALTER COLUMN vector SET STORAGE EXTERNAL;
-- A scope's memories newest first (lists, the cap's count, a cache load).
CREATE INDEX memories_scope_newest
    ON memories (org_id, agent_id, subject, created_at DESC, id DESC);

-- Observations wait here for svc-worker (decisions D13, "Observation and
-- the worker"): queued by the proxy, idempotent by (org_id, request_id),
-- claimed under a lease (lease_owner until lease_expires_at; a lease that
-- runs out returns the observation to the queue), deleted once processed.
-- state 'failed' keeps one that used up its attempts, for svcctl. The
-- messages (the user's messages and the answer's text) are content: never
-- logged, never in a notification, gone with the row.
CREATE TABLE memory_observations (
    id                uuid PRIMARY KEY,
    org_id            uuid NOT NULL,
    agent_id          uuid NOT NULL,
    subject           text NOT NULL DEFAULT ''
                      CHECK (subject ~ '^[A-Za-z0-9._:@-]{0,128}$'),
    request_id        text NOT NULL CHECK (char_length(request_id) BETWEEN 1 AND 200),
    messages          jsonb NOT NULL CHECK (jsonb_typeof(messages) = 'array'),
    state             text NOT NULL DEFAULT 'waiting' CHECK (state IN ('waiting', 'failed')),
    attempts          integer NOT NULL DEFAULT 0 CHECK (attempts >= 0),
    reason            text CHECK (char_length(reason) <= 500),
    next_attempt_at   timestamptz NOT NULL DEFAULT now(),
    lease_owner       text CHECK (char_length(lease_owner) <= 200),
    lease_expires_at  timestamptz,
    created_at        timestamptz NOT NULL DEFAULT now(),
    updated_at        timestamptz NOT NULL DEFAULT now(),
    UNIQUE (org_id, request_id)
);
CREATE INDEX memory_observations_due
    ON memory_observations (next_attempt_at, id) WHERE state = 'waiting';
CREATE INDEX memory_observations_scope ON memory_observations (org_id, agent_id, subject);

GRANT SELECT, INSERT, UPDATE, DELETE ON memories, memory_observations TO svc_memory_app;

ALTER TABLE memories ENABLE ROW LEVEL SECURITY;
ALTER TABLE memories FORCE ROW LEVEL SECURITY;
ALTER TABLE memory_observations ENABLE ROW LEVEL SECURITY;
ALTER TABLE memory_observations FORCE ROW LEVEL SECURITY;

CREATE POLICY tenant_isolation ON memories TO svc_memory_app
    USING (org_id = svc_current_org())
    WITH CHECK (org_id = svc_current_org());
CREATE POLICY tenant_isolation ON memory_observations TO svc_memory_app
    USING (org_id = svc_current_org())
    WITH CHECK (org_id = svc_current_org());

DO $$
DECLARE
    tenant_table text;
BEGIN
    FOREACH tenant_table IN ARRAY ARRAY['memories', 'memory_observations'] LOOP
        EXECUTE format(
            'CREATE POLICY svc_owner_all ON %I TO %I USING (true) WITH CHECK (true)',
            tenant_table, current_user);
    END LOOP;
END
$$;

-- Each insert, update and delete of a memory is announced at commit on the
-- channel svc_memory_changes, so that every replica's cache of vectors
-- follows within a second: '<op>:<org_id>:<agent_id>:<id>:<subject>' with
-- op insert, update or delete, and the subject last since it may hold a
-- colon. Identifiers only, never the content or the vector (a replica that
-- caches the scope reads the row itself, in the organization's context).
CREATE FUNCTION svc_notify_memory_change() RETURNS trigger
    LANGUAGE plpgsql
    AS $$
BEGIN
    IF TG_OP = 'DELETE' OR (TG_OP = 'UPDATE' AND (NEW.org_id, NEW.agent_id, NEW.subject)
            IS DISTINCT FROM (OLD.org_id, OLD.agent_id, OLD.subject)) THEN
        PERFORM pg_notify('svc_memory_changes', 'delete:' || OLD.org_id::text || ':'
            || OLD.agent_id::text || ':' || OLD.id::text || ':' || OLD.subject);
    END IF;
    IF TG_OP <> 'DELETE' THEN
        PERFORM pg_notify('svc_memory_changes', lower(TG_OP) || ':' || NEW.org_id::text || ':'
            || NEW.agent_id::text || ':' || NEW.id::text || ':' || NEW.subject);
    END IF;
    RETURN NULL;
END
$$;

CREATE TRIGGER memories_notify_change
    AFTER INSERT OR UPDATE OR DELETE ON memories
    FOR EACH ROW EXECUTE FUNCTION svc_notify_memory_change();

-- Whether a memory id exists at all, in any organization: svc_memory_app
-- sees only its organization's rows, and a memory of another organization
-- or agent must be told apart from an unknown id (403 against 404,
-- decisions D13). It answers a boolean and nothing else of the row.
CREATE FUNCTION svc_memory_exists(memory_id uuid) RETURNS boolean
    LANGUAGE sql STABLE SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
    AS $$ SELECT EXISTS (SELECT 1 FROM public.memories WHERE id = memory_id) $$;
REVOKE ALL ON FUNCTION svc_memory_exists(uuid) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION svc_memory_exists(uuid) TO svc_memory_app;

-- The same for an observation (the worker completes or releases one by id).
CREATE FUNCTION svc_observation_exists(observation_id uuid) RETURNS boolean
    LANGUAGE sql STABLE SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
    AS $$ SELECT EXISTS (SELECT 1 FROM public.memory_observations WHERE id = observation_id) $$;
REVOKE ALL ON FUNCTION svc_observation_exists(uuid) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION svc_observation_exists(uuid) TO svc_memory_app;

-- svc-worker's claim: the observations due, of every organization, leased
-- to claim_owner for lease_seconds. The worker serves every organization,
-- so this runs as the schema owner; it hands out observations that are
-- waiting, due and not leased, oldest due first, each to one claimant
-- (SKIP LOCKED: two workers claiming at once take different rows).
CREATE FUNCTION svc_claim_observations(claim_owner text, lease_seconds double precision,
                                       claim_limit integer)
    RETURNS TABLE (
        id uuid, org_id uuid, agent_id uuid, subject text, request_id text, messages jsonb,
        attempts integer, lease_expires_at timestamptz
    )
    LANGUAGE sql VOLATILE SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
    AS $$
        WITH due AS (
            SELECT waiting.id FROM public.memory_observations AS waiting
            WHERE waiting.state = 'waiting' AND waiting.next_attempt_at <= now()
              AND (waiting.lease_expires_at IS NULL OR waiting.lease_expires_at <= now())
            ORDER BY waiting.next_attempt_at, waiting.id
            LIMIT claim_limit
            FOR UPDATE SKIP LOCKED
        )
        UPDATE public.memory_observations AS claimed
        SET lease_owner = claim_owner,
            lease_expires_at = now() + make_interval(secs => lease_seconds),
            updated_at = now()
        FROM due WHERE claimed.id = due.id
        RETURNING claimed.id, claimed.org_id, claimed.agent_id, claimed.subject,
                  claimed.request_id, claimed.messages, claimed.attempts,
                  claimed.lease_expires_at
    $$;
REVOKE ALL ON FUNCTION svc_claim_observations(text, double precision, integer) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION svc_claim_observations(text, double precision, integer)
    TO svc_memory_app;

-- How many observations wait, over every organization: the gauge
-- svc_memory_observations_waiting. A count, nothing of any row.
CREATE FUNCTION svc_observations_waiting() RETURNS bigint
    LANGUAGE sql STABLE SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
    AS $$ SELECT count(*) FROM public.memory_observations WHERE state = 'waiting' $$;
REVOKE ALL ON FUNCTION svc_observations_waiting() FROM PUBLIC;
GRANT EXECUTE ON FUNCTION svc_observations_waiting() TO svc_memory_app;
