"""
svc-auth's tokens (decisions D2, D7): a bearer's one token read before its
organization is known, the ids every change feed starts from, and the
tokens svcctl and the API issue, revoke and list.
"""

from __future__ import annotations

import datetime
import uuid
from typing import Any

import attrs

from svcd.auth.store.base import StoreBase, oneRow, optionalRow
from svcd.common.pgtransactions import Cursor


@attrs.frozen
class TokenRecord:
    """
    A stored token, including its argon2id hash: never leaves svc-auth.
    """

    tokenID: uuid.UUID
    orgID: uuid.UUID
    agentID: uuid.UUID | None
    userID: uuid.UUID | None
    name: str | None
    secretHash: str = attrs.field(repr=False)
    permissions: int
    expiresAt: datetime.datetime | None
    revokedAt: datetime.datetime | None
    createdAt: datetime.datetime


_TOKEN_COLUMNS = (
    "token_id, org_id, agent_id, user_id, name, secret_hash, permissions, "
    "expires_at, revoked_at, created_at"
)


def _token(row: dict[str, Any]) -> TokenRecord:
    return TokenRecord(
        tokenID=row["token_id"],
        orgID=row["org_id"],
        agentID=row["agent_id"],
        userID=row["user_id"],
        name=row["name"],
        secretHash=row["secret_hash"],
        permissions=row["permissions"],
        expiresAt=row["expires_at"],
        revokedAt=row["revoked_at"],
        createdAt=row["created_at"],
    )


class TokensStore(StoreBase):
    """
    The tokens table (sql/0001, sql/0004_change_feed.sql).
    """

    def tokenForAuthentication(self, tokenID: uuid.UUID) -> TokenRecord | None:
        """
        The one token a bearer names, read before its organization is known
        (the token_lookup policy allows exactly this row).
        """

        def query(cursor: Cursor) -> TokenRecord | None:
            cursor.execute(f"SELECT {_TOKEN_COLUMNS} FROM tokens WHERE token_id = %s", (tokenID,))
            return optionalRow(_token, cursor.fetchone())

        return self._run("token_lookup", query, lookupTokenID=tokenID)

    def knownTokenIDs(self) -> bytes:
        """
        The ids of every token that may be accepted (neither revoked nor
        expired), 16 bytes each, concatenated: the snapshot that begins a
        change feed stream (sql/0004_change_feed.sql). One bytea made by
        PostgreSQL, so a million ids cost no Python object each.
        """

        def query(cursor: Cursor) -> bytes:
            cursor.execute(
                "SELECT coalesce(string_agg(uuid_send(known), ''::bytea), ''::bytea) AS ids"
                " FROM svc_known_token_ids() AS known"
            )
            return bytes(oneRow(cursor.fetchone())["ids"])

        return self._run("known_token_ids", query)

    def createToken(
        self,
        *,
        tokenID: uuid.UUID,
        orgID: uuid.UUID,
        secretHash: str,
        permissions: int,
        agentID: uuid.UUID | None = None,
        userID: uuid.UUID | None = None,
        name: str | None = None,
        expiresAt: datetime.datetime | None = None,
        createdBy: uuid.UUID | None = None,
    ) -> TokenRecord:
        def insert(cursor: Cursor) -> TokenRecord:
            cursor.execute(
                "INSERT INTO tokens (token_id, org_id, agent_id, user_id, name, secret_hash,"
                " permissions, expires_at, created_by)"
                " VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s)"
                f" RETURNING {_TOKEN_COLUMNS}",
                (
                    tokenID,
                    orgID,
                    agentID,
                    userID,
                    name,
                    secretHash,
                    permissions,
                    expiresAt,
                    createdBy,
                ),
            )
            return _token(oneRow(cursor.fetchone()))

        return self._run("token_create", insert, orgID=orgID)

    def revokeToken(self, tokenID: uuid.UUID, orgID: uuid.UUID | None = None) -> TokenRecord | None:
        """
        Revoke a token (a second revocation keeps the first time); None when
        no visible token has that id.
        """

        def update(cursor: Cursor) -> TokenRecord | None:
            cursor.execute(
                "UPDATE tokens SET revoked_at = COALESCE(revoked_at, now()), updated_at = now()"
                f" WHERE token_id = %s RETURNING {_TOKEN_COLUMNS}",
                (tokenID,),
            )
            return optionalRow(_token, cursor.fetchone())

        return self._run("token_revoke", update, orgID=orgID)

    def listTokens(self, orgID: uuid.UUID) -> list[TokenRecord]:
        def query(cursor: Cursor) -> list[TokenRecord]:
            cursor.execute(
                f"SELECT {_TOKEN_COLUMNS} FROM tokens WHERE org_id = %s"
                " ORDER BY created_at, token_id",
                (orgID,),
            )
            return [_token(row) for row in cursor.fetchall()]

        return self._run("token_list", query, orgID=orgID)
