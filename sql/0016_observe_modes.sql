-- Whose words are observed (decisions D13 amended, "Whose words"):
-- observe is no longer a switch but one of three modes, or inherit.
--
--   on    only chat requests that name a subject (X-SVC-Memory-Subject);
--   all   those, and requests that name none, into the agent's shared
--         subject "" (an agent that serves one user);
--   off   none;
--   NULL  inherit (an agent's from its organization, an organization's
--         from the default, off).
--
-- Rows set on before this migration become 'on', the new, stricter
-- meaning: the switch observed the subject-less requests of every user of
-- an agent into one shared subject, so that one user's words could steer
-- another's answers. An operator whose agent serves one user sets 'all'.
--
-- The boolean observe stays, kept equal to the mode (true for on and all,
-- false for off, NULL for inherit) by the trigger below, both ways: an
-- svc-auth of the previous release, still running in a rolling upgrade
-- (migrations run first), reads the switch it knows, and what its svcctl
-- writes to the switch moves the mode with it (true 'on', false 'off';
-- true on a row already 'all' keeps 'all', which that switch also reads
-- as true). A row's mode and switch never disagree (the constraint).

ALTER TABLE memory_settings
    ADD COLUMN observe_mode text
        CONSTRAINT memory_settings_observe_mode CHECK (observe_mode IN ('on', 'all', 'off'));

-- Before the trigger exists, so that the update is the plain copy it is.
-- (Its version is taken anew and its change announced, as for any
-- update: a running svc-auth reads the row again.)
UPDATE memory_settings
    SET observe_mode = CASE WHEN observe THEN 'on' ELSE 'off' END
    WHERE observe IS NOT NULL;

ALTER TABLE memory_settings
    ADD CONSTRAINT memory_settings_observe_matches_mode CHECK (
        observe IS NOT DISTINCT FROM
            CASE observe_mode WHEN 'off' THEN false WHEN 'on' THEN true WHEN 'all' THEN true END
    );

CREATE FUNCTION svc_memory_settings_observe_mode() RETURNS trigger
    LANGUAGE plpgsql
    AS $$
DECLARE
    switch boolean := CASE NEW.observe_mode
        WHEN 'off' THEN false WHEN 'on' THEN true WHEN 'all' THEN true END;
BEGIN
    IF TG_OP = 'UPDATE' AND NEW.observe_mode IS DISTINCT FROM OLD.observe_mode THEN
        -- The mode was written (this release): the switch follows it.
        NEW.observe := switch;
    ELSIF TG_OP = 'INSERT' AND NEW.observe_mode IS NOT NULL THEN
        NEW.observe := switch;
    ELSIF NEW.observe IS DISTINCT FROM switch THEN
        -- Only the switch was written (the previous release): the mode
        -- follows it.
        NEW.observe_mode := CASE WHEN NEW.observe THEN 'on' WHEN NOT NEW.observe THEN 'off' END;
    END IF;
    RETURN NEW;
END
$$;

CREATE TRIGGER memory_settings_observe_mode
    BEFORE INSERT OR UPDATE ON memory_settings
    FOR EACH ROW EXECUTE FUNCTION svc_memory_settings_observe_mode();

-- Every row, now with its mode: the previous release's svc-auth names its
-- columns, so the one added at the end changes nothing for it. (A
-- function's columns cannot be changed in place.)
DROP FUNCTION svc_memory_settings_rows();
CREATE FUNCTION svc_memory_settings_rows()
    RETURNS TABLE (org_id uuid, agent_id uuid, recall boolean, observe boolean, version bigint,
                   observe_mode text)
    LANGUAGE sql STABLE SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
    AS $$
        SELECT org_id, agent_id, recall, observe, version, observe_mode
        FROM public.memory_settings
    $$;
REVOKE ALL ON FUNCTION svc_memory_settings_rows() FROM PUBLIC;
GRANT EXECUTE ON FUNCTION svc_memory_settings_rows() TO svc_auth_app;
