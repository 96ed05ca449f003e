-- Change notifications for the validation caches of svc-auth.
--
-- Every replica keeps validated tokens and agent statuses in memory and
-- LISTENs on the channel svc_auth_changes; these triggers announce each
-- change of a token or an agent (and each new agent, which an earlier
-- lookup may have found missing) at commit, so a revocation or a status
-- change reaches every replica within milliseconds (decisions D7).
-- Payloads are 'token:<token_id>' and 'agent:<agent_id>'.

CREATE FUNCTION svc_notify_token_change() RETURNS trigger
    LANGUAGE plpgsql
    AS $$
BEGIN
    PERFORM pg_notify('svc_auth_changes', 'token:' || COALESCE(NEW.token_id, OLD.token_id)::text);
    RETURN NULL;
END
$$;

CREATE FUNCTION svc_notify_agent_change() RETURNS trigger
    LANGUAGE plpgsql
    AS $$
BEGIN
    PERFORM pg_notify('svc_auth_changes', 'agent:' || COALESCE(NEW.agent_id, OLD.agent_id)::text);
    RETURN NULL;
END
$$;

CREATE TRIGGER tokens_notify_change
    AFTER UPDATE OR DELETE ON tokens
    FOR EACH ROW EXECUTE FUNCTION svc_notify_token_change();

CREATE TRIGGER agents_notify_change
    AFTER INSERT OR UPDATE OR DELETE ON agents
    FOR EACH ROW EXECUTE FUNCTION svc_notify_agent_change();
