-- The change feed of svc-auth to svc-proxy (decisions D8).
--
-- svc-proxy keeps a set of the token ids svc-auth may accept, so that a
-- made-up token id costs it no call; a token created anywhere must reach
-- that set within one second. So token creations are announced too, not
-- only changes: the trigger of 0003 now fires on INSERT as well (payload
-- 'token:<token_id>', as for a change).
--
-- A new feed stream starts with every token id that may be accepted.
-- svc_auth_app cannot read other organizations' rows (row-level
-- security), so svc_known_token_ids() runs as the schema owner
-- (SECURITY DEFINER) and returns the ids alone: never a hash, a name or an
-- organization.

DROP TRIGGER tokens_notify_change ON tokens;
CREATE TRIGGER tokens_notify_change
    AFTER INSERT OR UPDATE OR DELETE ON tokens
    FOR EACH ROW EXECUTE FUNCTION svc_notify_token_change();

CREATE FUNCTION svc_known_token_ids() RETURNS SETOF uuid
    LANGUAGE sql STABLE SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
    AS $$
        SELECT token_id FROM public.tokens
        WHERE revoked_at IS NULL AND (expires_at IS NULL OR expires_at > now())
    $$;
REVOKE ALL ON FUNCTION svc_known_token_ids() FROM PUBLIC;
GRANT EXECUTE ON FUNCTION svc_known_token_ids() TO svc_auth_app;
