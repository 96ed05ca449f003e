-- Tenants, users, agents and personal access tokens.
--
-- Every tenant table carries org_id; agents and tokens reference their
-- organization through composite keys so that a token can only be bound
-- to an agent of its own organization.

CREATE TABLE organizations (
    org_id      uuid PRIMARY KEY,
    name        text NOT NULL CHECK (length(name) BETWEEN 1 AND 200),
    created_at  timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE users (
    user_id     uuid PRIMARY KEY,
    org_id      uuid NOT NULL REFERENCES organizations (org_id),
    email       text,
    created_at  timestamptz NOT NULL DEFAULT now(),
    UNIQUE (user_id, org_id)
);

CREATE TABLE agents (
    agent_id    uuid PRIMARY KEY,
    org_id      uuid NOT NULL REFERENCES organizations (org_id),
    name        text,
    status      text NOT NULL DEFAULT 'active'
                CHECK (status IN ('active', 'paused', 'suspended', 'archived')),
    created_at  timestamptz NOT NULL DEFAULT now(),
    updated_at  timestamptz NOT NULL DEFAULT now(),
    UNIQUE (agent_id, org_id)
);
CREATE INDEX agents_org_id ON agents (org_id);

CREATE TABLE tokens (
    token_id     uuid PRIMARY KEY,
    org_id       uuid NOT NULL REFERENCES organizations (org_id),
    agent_id     uuid,
    user_id      uuid,
    name         text,
    -- argon2id hash (PHC string) of the secret; the secret itself is
    -- never stored.
    secret_hash  text NOT NULL,
    permissions  bigint NOT NULL DEFAULT 0,
    expires_at   timestamptz,
    revoked_at   timestamptz,
    created_at   timestamptz NOT NULL DEFAULT now(),
    updated_at   timestamptz NOT NULL DEFAULT now(),
    -- the token that issued this one, for the audit trail
    created_by   uuid,
    FOREIGN KEY (agent_id, org_id) REFERENCES agents (agent_id, org_id),
    FOREIGN KEY (user_id, org_id) REFERENCES users (user_id, org_id)
);
CREATE INDEX tokens_org_id ON tokens (org_id);
