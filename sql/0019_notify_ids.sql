-- Subjects are personal data (decisions D13, amended): like content, never
-- sent in a database notification, which any role that may connect can
-- LISTEN to. Each insert, update and delete of a memory is announced at
-- commit on svc_memory_changes as '<op>:<org_id>:<agent_id>:<id>', op
-- insert, update or delete: identifiers only. A replica that caches one of
-- the agent's scopes reads the row itself, in the organization's context,
-- and finds a deleted memory's scope by its id in its own caches
-- (svcd/memory/listener.py). A memory whose organization, agent or subject
-- changes is announced deleted from where it was, then updated where it is.
--
-- A replica of the release before reads these payloads as malformed: it
-- logs a warning for each and ignores it, never crashes, but its caches no
-- longer follow changes. docs/operations.rst says in which order to
-- upgrade.
CREATE OR REPLACE FUNCTION svc_notify_memory_change() RETURNS trigger
    LANGUAGE plpgsql
    AS $$
BEGIN
    IF TG_OP = 'DELETE' OR (TG_OP = 'UPDATE' AND (NEW.org_id, NEW.agent_id, NEW.subject)
            IS DISTINCT FROM (OLD.org_id, OLD.agent_id, OLD.subject)) THEN
        PERFORM pg_notify('svc_memory_changes', 'delete:' || OLD.org_id::text || ':'
            || OLD.agent_id::text || ':' || OLD.id::text);
    END IF;
    IF TG_OP <> 'DELETE' THEN
        PERFORM pg_notify('svc_memory_changes', lower(TG_OP) || ':' || NEW.org_id::text || ':'
            || NEW.agent_id::text || ':' || NEW.id::text);
    END IF;
    RETURN NULL;
END
$$;
