from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ValidateTokenRequest(_message.Message):
    __slots__ = ("access_token",)
    ACCESS_TOKEN_FIELD_NUMBER: _ClassVar[int]
    access_token: str
    def __init__(self, access_token: _Optional[str] = ...) -> None: ...

class ValidateTokenResponse(_message.Message):
    __slots__ = ("org_id", "permissions", "agent_id", "user_id", "token_id", "expires_at", "org_limits")
    ORG_ID_FIELD_NUMBER: _ClassVar[int]
    PERMISSIONS_FIELD_NUMBER: _ClassVar[int]
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    USER_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    ORG_LIMITS_FIELD_NUMBER: _ClassVar[int]
    org_id: str
    permissions: int
    agent_id: str
    user_id: str
    token_id: str
    expires_at: str
    org_limits: Limits
    def __init__(self, org_id: _Optional[str] = ..., permissions: _Optional[int] = ..., agent_id: _Optional[str] = ..., user_id: _Optional[str] = ..., token_id: _Optional[str] = ..., expires_at: _Optional[str] = ..., org_limits: _Optional[_Union[Limits, _Mapping]] = ...) -> None: ...

class ValidateAgentRequest(_message.Message):
    __slots__ = ("agent_id", "org_id")
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    ORG_ID_FIELD_NUMBER: _ClassVar[int]
    agent_id: str
    org_id: str
    def __init__(self, agent_id: _Optional[str] = ..., org_id: _Optional[str] = ...) -> None: ...

class ValidateAgentResponse(_message.Message):
    __slots__ = ("agent_id", "org_id", "status", "agent_limits")
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    ORG_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    AGENT_LIMITS_FIELD_NUMBER: _ClassVar[int]
    agent_id: str
    org_id: str
    status: str
    agent_limits: Limits
    def __init__(self, agent_id: _Optional[str] = ..., org_id: _Optional[str] = ..., status: _Optional[str] = ..., agent_limits: _Optional[_Union[Limits, _Mapping]] = ...) -> None: ...

class Limits(_message.Message):
    __slots__ = ("rpm", "tpm", "max_output_tokens", "version")
    RPM_FIELD_NUMBER: _ClassVar[int]
    TPM_FIELD_NUMBER: _ClassVar[int]
    MAX_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    rpm: int
    tpm: int
    max_output_tokens: int
    version: int
    def __init__(self, rpm: _Optional[int] = ..., tpm: _Optional[int] = ..., max_output_tokens: _Optional[int] = ..., version: _Optional[int] = ...) -> None: ...

class CreateTokenRequest(_message.Message):
    __slots__ = ("name", "permissions", "agent_id", "expires_in_seconds")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PERMISSIONS_FIELD_NUMBER: _ClassVar[int]
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_IN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    name: str
    permissions: int
    agent_id: str
    expires_in_seconds: int
    def __init__(self, name: _Optional[str] = ..., permissions: _Optional[int] = ..., agent_id: _Optional[str] = ..., expires_in_seconds: _Optional[int] = ...) -> None: ...

class CreateTokenResponse(_message.Message):
    __slots__ = ("token", "info")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    INFO_FIELD_NUMBER: _ClassVar[int]
    token: str
    info: TokenInfo
    def __init__(self, token: _Optional[str] = ..., info: _Optional[_Union[TokenInfo, _Mapping]] = ...) -> None: ...

class RevokeTokenRequest(_message.Message):
    __slots__ = ("token_id",)
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    token_id: str
    def __init__(self, token_id: _Optional[str] = ...) -> None: ...

class RevokeTokenResponse(_message.Message):
    __slots__ = ("token_id", "revoked")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    REVOKED_FIELD_NUMBER: _ClassVar[int]
    token_id: str
    revoked: bool
    def __init__(self, token_id: _Optional[str] = ..., revoked: _Optional[bool] = ...) -> None: ...

class ListTokensRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListTokensResponse(_message.Message):
    __slots__ = ("tokens",)
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedCompositeFieldContainer[TokenInfo]
    def __init__(self, tokens: _Optional[_Iterable[_Union[TokenInfo, _Mapping]]] = ...) -> None: ...

class TokenInfo(_message.Message):
    __slots__ = ("token_id", "org_id", "name", "agent_id", "user_id", "permissions", "expires_at", "revoked", "created_at")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    ORG_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    USER_ID_FIELD_NUMBER: _ClassVar[int]
    PERMISSIONS_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    REVOKED_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    token_id: str
    org_id: str
    name: str
    agent_id: str
    user_id: str
    permissions: int
    expires_at: str
    revoked: bool
    created_at: str
    def __init__(self, token_id: _Optional[str] = ..., org_id: _Optional[str] = ..., name: _Optional[str] = ..., agent_id: _Optional[str] = ..., user_id: _Optional[str] = ..., permissions: _Optional[int] = ..., expires_at: _Optional[str] = ..., revoked: _Optional[bool] = ..., created_at: _Optional[str] = ...) -> None: ...

class WatchChangesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Change(_message.Message):
    __slots__ = ("known_token_ids", "snapshot_complete", "token_changed", "agent_changed", "heartbeat", "limits_changed")
    KNOWN_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_COMPLETE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_CHANGED_FIELD_NUMBER: _ClassVar[int]
    AGENT_CHANGED_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    LIMITS_CHANGED_FIELD_NUMBER: _ClassVar[int]
    known_token_ids: bytes
    snapshot_complete: SnapshotComplete
    token_changed: bytes
    agent_changed: bytes
    heartbeat: Heartbeat
    limits_changed: LimitsChanged
    def __init__(self, known_token_ids: _Optional[bytes] = ..., snapshot_complete: _Optional[_Union[SnapshotComplete, _Mapping]] = ..., token_changed: _Optional[bytes] = ..., agent_changed: _Optional[bytes] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ..., limits_changed: _Optional[_Union[LimitsChanged, _Mapping]] = ...) -> None: ...

class LimitsChanged(_message.Message):
    __slots__ = ("org_id", "agent_id", "limits")
    ORG_ID_FIELD_NUMBER: _ClassVar[int]
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    org_id: bytes
    agent_id: bytes
    limits: Limits
    def __init__(self, org_id: _Optional[bytes] = ..., agent_id: _Optional[bytes] = ..., limits: _Optional[_Union[Limits, _Mapping]] = ...) -> None: ...

class SnapshotComplete(_message.Message):
    __slots__ = ("token_count",)
    TOKEN_COUNT_FIELD_NUMBER: _ClassVar[int]
    token_count: int
    def __init__(self, token_count: _Optional[int] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
